//! Codec and validation tests of every message.

use super::*;
use crate::geometry::Dtype;
use crate::ids::{Generation, Owner};
use proptest::prelude::*;

fn owner() -> Owner {
    Owner {
        request: RequestId(42),
        generation: Generation(7),
    }
}

fn geometry() -> PageGeometry {
    PageGeometry {
        tokens_per_page: 16,
        layers: 2,
        kv_heads: 2,
        head_dim: 8,
        dtype: Dtype::F16,
    }
}

fn manifest() -> Manifest {
    Manifest {
        owner: owner(),
        tokens: 20,
        pages: vec![PageId(3), PageId(9)],
        digests: vec![0xdead_beef, 1],
    }
}

/// One valid message of every type.
fn every_message() -> Vec<Message> {
    vec![
        Hello::new(Role::Client).into(),
        HelloAck {
            version: 1,
            generation: Generation(3),
        }
        .into(),
        RegisterWorker {
            id: "prefill@gpu0".into(),
            role: Role::Prefill,
            geometry: geometry(),
            pool_pages: 128,
            transports: vec![Transport::Shm, Transport::Rdma],
            endpoint: None,
            model: "reference".into(),
            max_batch: 0,
        }
        .into(),
        RegisterAck {
            generation: Generation(3),
            max_context: 8192,
            max_new_tokens: 512,
        }
        .into(),
        Submit {
            tenant: "team-a.prod_1".into(),
            prompt: crate::model::tokenize(b"hello"),
            max_new_tokens: 16,
            deadline_ms: 0,
            sampling: crate::proto::Sampling::GREEDY,
        }
        .into(),
        Tokens {
            first_index: 4,
            tokens: vec![1, 2, 70_000],
        }
        .into(),
        Done {
            tokens: 16,
            signature: u64::MAX,
            pages_transferred: 2,
            bytes_transferred: 1 << 40,
            elapsed_us: 99,
            prefill_worker: "p-1".into(),
            decode_worker: String::new(),
        }
        .into(),
        Error {
            code: ErrorCode::PoolFull,
            message: "no room".into(),
        }
        .into(),
        StatusQuery {}.into(),
        StatusReply {
            generation: Generation(3),
            max_context: 8192,
            max_new_tokens: 512,
            workers: vec![WorkerStatus {
                id: "decode-0".into(),
                role: Role::Decode,
                connected: true,
                drain: false,
                in_flight: 2,
                held_pages: 3,
                transports: vec![Transport::Shm, Transport::Tcp],
                served: 7,
                counters: vec![("pulls".into(), 3)],
                pool_pages: 10,
                tokens_per_page: 16,
                free: 5,
                reserved: 1,
                writing: 1,
                readable: 2,
                draining: 1,
                max_batch: 16,
            }],
            counters: vec![("admitted".into(), 12), ("rejected".into(), 0)],
            transport: Some(Transport::Tcp),
            model: None,
        }
        .into(),
        DecodeReserve {
            owner: owner(),
            prompt_tokens: 20,
            max_new_tokens: 16,
        }
        .into(),
        DecodeReserved {
            owner: owner(),
            pages: 3,
        }
        .into(),
        PrefillRun {
            owner: owner(),
            prompt: vec![0, 255, 7],
        }
        .into(),
        PrefillDone {
            manifest: manifest(),
        }
        .into(),
        PrefillPool {
            worker: "prefill-0".into(),
            geometry: geometry(),
            pool_pages: 64,
        }
        .into(),
        PullKv {
            source: "prefill-0".into(),
            manifest: manifest(),
            max_new_tokens: 16,
            last_token: 7,
            sampling: crate::proto::Sampling::GREEDY,
        }
        .into(),
        PullDone { owner: owner() }.into(),
        Release { owner: owner() }.into(),
        Abort {
            owner: owner(),
            code: ErrorCode::Timeout,
            reason: "deadline".into(),
        }
        .into(),
        PoolReport {
            free: 1,
            reserved: 2,
            writing: 3,
            readable: 4,
            draining: 5,
            counters: vec![("pulls".into(), 3)],
        }
        .into(),
        Freed {
            owner: owner(),
            pages: 9,
        }
        .into(),
        PrefillEndpoint {
            worker: "prefill-1".into(),
            geometry: geometry(),
            pool_pages: 64,
            endpoint: endpoint(),
            rdma: true,
        }
        .into(),
        PageRequest {
            token: [7; TOKEN_BYTES],
            owner: owner(),
            pages: vec![PageId(3), PageId(9)],
        }
        .into(),
        PageData {
            owner: owner(),
            index: 1,
            len: 4096,
        }
        .into(),
        RdmaConnect {
            token: [3; TOKEN_BYTES],
            qp_num: 17,
            psn: 0x00ab_cdef,
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 0, 2, 1],
        }
        .into(),
        RdmaWindows {
            owner: owner(),
            windows: vec![
                RdmaWindow {
                    first: 0,
                    pages: 3,
                    addr: 0x7f00_0000_0000,
                    rkey: 0x1234_5601,
                },
                RdmaWindow {
                    first: 3,
                    pages: 1,
                    addr: 0x7f00_0010_0000,
                    rkey: 0x1234_5702,
                },
            ],
        }
        .into(),
        RdmaReadDone { owner: owner() }.into(),
        PrefillGone {
            worker: "prefill-1".into(),
        }
        .into(),
        Drain {
            worker: "decode-1".into(),
            drain: true,
        }
        .into(),
        DrainReply {
            worker: WorkerStatus {
                id: "decode-1".into(),
                role: Role::Decode,
                connected: true,
                drain: true,
                in_flight: 0,
                held_pages: 0,
                transports: vec![Transport::Shm],
                served: 0,
                counters: Vec::new(),
                pool_pages: 10,
                tokens_per_page: 16,
                free: 10,
                reserved: 0,
                writing: 0,
                readable: 0,
                draining: 0,
                max_batch: 0,
            },
        }
        .into(),
    ]
}

fn endpoint() -> TcpEndpoint {
    TcpEndpoint {
        addr: "192.0.2.1:7470".into(),
        token: [0xa5; TOKEN_BYTES],
    }
}

fn frame_with(msg: &Message, edit: impl FnOnce(&mut RawHeader)) -> Vec<u8> {
    let mut frame = msg.encode(RequestId(5)).unwrap();
    let (mut raw, _) = RawHeader::read_from_prefix(&frame).unwrap();
    edit(&mut raw);
    frame[..HEADER_LEN].copy_from_slice(raw.as_bytes());
    frame
}

#[test]
fn every_type_round_trips() {
    let all = every_message();
    assert_eq!(all.len(), 30, "one message per MsgType but Invalid");
    for (i, msg) in all.iter().enumerate() {
        assert_eq!(msg.msg_type() as usize, i + 1);
        let frame = msg.encode(RequestId(0x0102_0304_0506_0708)).unwrap();
        let (header, back) = decode_frame(&frame, msg.fd_count()).unwrap();
        assert_eq!(header.msg_type, msg.msg_type());
        assert_eq!(header.request_id, RequestId(0x0102_0304_0506_0708));
        assert_eq!(header.frame_len(), frame.len());
        assert_eq!(&back, msg);
    }
}

#[test]
fn header_layout_matches_the_docs() {
    let frame = Message::from(StatusQuery {})
        .encode(RequestId(0x1122_3344_5566_7788))
        .unwrap();
    assert_eq!(&frame[0..4], b"KVFC");
    assert_eq!(&frame[4..6], &[4, 0]);
    assert_eq!(&frame[6..8], &[9, 0]);
    assert_eq!(&frame[8..12], &[0, 0, 0, 0]);
    assert_eq!(&frame[12..16], &[0, 0, 0, 0]);
    assert_eq!(
        &frame[16..24],
        &[0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11]
    );
    assert_eq!(frame.len(), HEADER_LEN);
}

#[test]
fn error_code_is_its_u16_on_the_wire() {
    let msg = Message::from(Error {
        code: ErrorCode::ShuttingDown,
        message: String::new(),
    });
    let frame = msg.encode(RequestId(0)).unwrap();
    assert_eq!(frame[HEADER_LEN], 9);
    let mut bad = frame.clone();
    bad[HEADER_LEN] = 11;
    assert!(matches!(
        decode_frame(&bad, 0),
        Err(ProtoError::BadBody {
            msg_type: MsgType::Error,
            ..
        })
    ));
}

#[test]
fn truncated_header() {
    let frame = Message::from(StatusQuery {}).encode(RequestId(1)).unwrap();
    for n in 0..HEADER_LEN {
        let r = Header::parse(&frame[..n]);
        assert!(
            matches!(r, Err(ProtoError::Truncated { need: HEADER_LEN, got }) if got == n),
            "{r:?}"
        );
    }
}

#[test]
fn truncated_body() {
    let frame = Message::from(Hello::new(Role::Decode))
        .encode(RequestId(1))
        .unwrap();
    let header = Header::parse(&frame).unwrap();
    let body = &frame[HEADER_LEN..frame.len() - 1];
    assert!(matches!(
        Message::decode(&header, body),
        Err(ProtoError::Truncated { need, got }) if need == body.len() + 1 && got == body.len()
    ));
    assert!(matches!(
        decode_frame(&frame[..frame.len() - 1], 0),
        Err(ProtoError::Truncated { .. })
    ));
}

#[test]
fn body_shorter_than_its_type_needs() {
    let msg = Message::from(Hello::new(Role::Decode));
    // Claim one byte less than the encoding: the body itself is cut short.
    let mut frame = frame_with(&msg, |h| h.body_len = U32::new(h.body_len.get() - 1));
    frame.pop();
    assert!(matches!(
        decode_frame(&frame, 0),
        Err(ProtoError::BadBody {
            msg_type: MsgType::Hello,
            ..
        })
    ));
}

#[test]
fn oversized_length_field() {
    let msg = Message::from(StatusQuery {});
    let frame = frame_with(&msg, |h| h.body_len = U32::new(MAX_BODY_LEN + 1));
    let max_body = MAX_BODY_LEN as usize;
    assert!(matches!(
        Header::parse(&frame),
        Err(ProtoError::Oversized { len, max }) if len == max_body + 1 && max == max_body
    ));
    let frame = frame_with(&msg, |h| h.body_len = U32::new(u32::MAX));
    assert!(matches!(
        Header::parse(&frame),
        Err(ProtoError::Oversized { .. })
    ));
    let frame = frame_with(&msg, |h| h.body_len = U32::new(MAX_BODY_LEN));
    assert!(Header::parse(&frame).is_ok());
}

#[test]
fn encode_refuses_an_oversized_body() {
    let msg = Message::from(Tokens {
        first_index: 0,
        tokens: vec![u32::MAX; 300_000],
    });
    let r = msg.encode(RequestId(1));
    assert!(
        matches!(r, Err(ProtoError::Oversized { max, .. }) if max == MAX_BODY_LEN as usize),
        "{r:?}"
    );
}

#[test]
fn unknown_and_invalid_types() {
    let msg = Message::from(StatusQuery {});
    let frame = frame_with(&msg, |h| h.msg_type = U16::new(31));
    assert!(matches!(
        Header::parse(&frame),
        Err(ProtoError::UnknownType { got: 31 })
    ));
    let frame = frame_with(&msg, |h| h.msg_type = U16::new(u16::MAX));
    assert!(matches!(
        Header::parse(&frame),
        Err(ProtoError::UnknownType { got: u16::MAX })
    ));
    let frame = frame_with(&msg, |h| h.msg_type = U16::new(0));
    assert!(matches!(
        Header::parse(&frame),
        Err(ProtoError::InvalidType)
    ));
    assert!(matches!(MsgType::try_from(0), Err(ProtoError::InvalidType)));
    for v in 1..=20u16 {
        assert_eq!(MsgType::try_from(v).unwrap() as u16, v);
    }
}

#[test]
fn bad_version_and_magic() {
    let msg = Message::from(StatusQuery {});
    let frame = frame_with(&msg, |h| h.version = U16::new(1));
    assert!(matches!(
        Header::parse(&frame),
        Err(ProtoError::BadVersion {
            got: 1,
            supported: PROTOCOL_VERSION
        })
    ));
    let frame = frame_with(&msg, |h| h.magic = U32::new(0x4346_564C));
    assert!(matches!(
        Header::parse(&frame),
        Err(ProtoError::BadMagic { got: 0x4346_564C })
    ));
}

#[test]
fn reserved_bits_and_field() {
    let msg = Message::from(StatusQuery {});
    let frame = frame_with(&msg, |h| h.flags = U16::new(0x8000));
    assert!(matches!(
        Header::parse(&frame),
        Err(ProtoError::ReservedBits {
            flags: 0x8000,
            reserved: 0
        })
    ));
    let frame = frame_with(&msg, |h| h.reserved = U16::new(1));
    assert!(matches!(
        Header::parse(&frame),
        Err(ProtoError::ReservedBits {
            flags: 0,
            reserved: 1
        })
    ));
}

#[test]
fn trailing_bytes() {
    let msg = Message::from(Release { owner: owner() });
    let mut frame = frame_with(&msg, |h| h.body_len = U32::new(h.body_len.get() + 3));
    frame.extend_from_slice(&[0, 0, 0]);
    assert!(matches!(
        decode_frame(&frame, 0),
        Err(ProtoError::TrailingBytes {
            msg_type: MsgType::Release,
            extra: 3
        })
    ));
    // A body slice longer than body_len is refused the same way.
    let frame = msg.encode(RequestId(1)).unwrap();
    let header = Header::parse(&frame).unwrap();
    let mut body = frame[HEADER_LEN..].to_vec();
    body.push(0);
    assert!(matches!(
        Message::decode(&header, &body),
        Err(ProtoError::TrailingBytes {
            msg_type: MsgType::Release,
            extra: 1
        })
    ));
}

#[test]
fn wrong_fd_counts() {
    let query = Message::from(StatusQuery {});
    let frame = query.encode(RequestId(1)).unwrap();
    assert!(matches!(
        decode_frame(&frame, 1),
        Err(ProtoError::BadFds {
            msg_type: MsgType::StatusQuery,
            expected: 0,
            got: 1
        })
    ));
    let pool = Message::from(PrefillPool {
        worker: "prefill-0".into(),
        geometry: geometry(),
        pool_pages: 8,
    });
    let frame = pool.encode(RequestId(1)).unwrap();
    assert!(matches!(
        decode_frame(&frame, 0),
        Err(ProtoError::BadFds {
            expected: 1,
            got: 0,
            ..
        })
    ));
    assert!(matches!(
        decode_frame(&frame, 2),
        Err(ProtoError::BadFds {
            expected: 1,
            got: 2,
            ..
        })
    ));
    let decode = RegisterWorker {
        id: "w-0".into(),
        role: Role::Decode,
        geometry: geometry(),
        pool_pages: 8,
        transports: vec![Transport::Shm],
        endpoint: None,
        model: "reference".into(),
        max_batch: 4,
    };
    let frame = Message::from(decode.clone()).encode(RequestId(1)).unwrap();
    assert!(decode_frame(&frame, 0).is_ok());
    assert!(matches!(
        decode_frame(&frame, 1),
        Err(ProtoError::BadFds {
            msg_type: MsgType::RegisterWorker,
            expected: 0,
            got: 1
        })
    ));
    let prefill = RegisterWorker {
        id: "w-0".into(),
        role: Role::Prefill,
        max_batch: 0,
        ..decode
    };
    let frame = Message::from(prefill.clone()).encode(RequestId(1)).unwrap();
    assert!(decode_frame(&frame, 1).is_ok());
    assert!(matches!(
        decode_frame(&frame, 0),
        Err(ProtoError::BadFds {
            msg_type: MsgType::RegisterWorker,
            expected: 1,
            got: 0
        })
    ));
    // A prefill worker on TCP attaches no fd.
    let tcp = RegisterWorker {
        transports: vec![Transport::Tcp],
        endpoint: Some(endpoint()),
        ..prefill
    };
    let frame = Message::from(tcp).encode(RequestId(1)).unwrap();
    assert!(decode_frame(&frame, 0).is_ok());
    assert!(matches!(
        decode_frame(&frame, 1),
        Err(ProtoError::BadFds {
            msg_type: MsgType::RegisterWorker,
            expected: 0,
            got: 1
        })
    ));
}

fn invalid(msg: impl Into<Message>) -> String {
    match msg.into().validate() {
        Err(ProtoError::Invalid { reason, .. }) => reason,
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[test]
fn semantic_limits() {
    let submit = Submit {
        tenant: "t".into(),
        prompt: vec![1],
        max_new_tokens: 1,
        deadline_ms: 0,
        sampling: crate::proto::Sampling::GREEDY,
    };
    assert!(Message::from(submit.clone()).validate().is_ok());
    invalid(Submit {
        prompt: vec![],
        ..submit.clone()
    });
    let reason = invalid(Submit {
        prompt: vec![0; MAX_PROMPT_TOKENS + 1],
        ..submit.clone()
    });
    assert!(reason.contains(&MAX_PROMPT_TOKENS.to_string()), "{reason}");
    invalid(Submit {
        tenant: String::new(),
        ..submit.clone()
    });
    invalid(Submit {
        tenant: "a".repeat(MAX_TENANT_BYTES + 1),
        ..submit.clone()
    });
    invalid(Submit {
        tenant: "a b".into(),
        ..submit.clone()
    });
    invalid(Submit {
        tenant: "é".into(),
        ..submit.clone()
    });
    invalid(Submit {
        max_new_tokens: 0,
        ..submit.clone()
    });
    assert!(
        Message::from(Submit {
            tenant: "a".repeat(MAX_TENANT_BYTES),
            ..submit
        })
        .validate()
        .is_ok()
    );

    let pull = PullKv {
        source: "prefill-0".into(),
        manifest: manifest(),
        max_new_tokens: 4,
        last_token: 0,
        sampling: crate::proto::Sampling::GREEDY,
    };
    let mut m = manifest();
    m.digests.pop();
    assert_eq!(
        invalid(PullKv {
            source: "prefill-0".into(),
            manifest: m,
            ..pull.clone()
        }),
        "2 pages but 1 digests"
    );
    let mut m = manifest();
    m.pages[1] = m.pages[0];
    invalid(PullKv {
        source: "prefill-0".into(),
        manifest: m,
        ..pull.clone()
    });
    let mut m = manifest();
    m.pages = (0..=u32::try_from(MAX_MANIFEST_PAGES).unwrap())
        .map(PageId)
        .collect();
    m.digests = vec![0; m.pages.len()];
    invalid(PrefillDone { manifest: m });
    invalid(PullKv {
        source: "prefill-0".into(),
        manifest: Manifest {
            tokens: 0,
            ..manifest()
        },
        ..pull
    });

    invalid(Hello {
        role: Role::Client,
        min_version: 2,
        max_version: 1,
    });
    invalid(RegisterWorker {
        id: "w-0".into(),
        role: Role::Client,
        geometry: geometry(),
        pool_pages: 1,
        transports: vec![Transport::Shm],
        endpoint: None,
        model: "reference".into(),
        max_batch: 0,
    });
    invalid(RegisterWorker {
        id: "w-0".into(),
        role: Role::Decode,
        geometry: geometry(),
        pool_pages: 1,
        transports: vec![],
        endpoint: None,
        model: "reference".into(),
        max_batch: 4,
    });
    invalid(RegisterWorker {
        id: "w-0".into(),
        role: Role::Decode,
        geometry: geometry(),
        pool_pages: 1,
        transports: vec![Transport::Tcp, Transport::Tcp],
        endpoint: None,
        model: "reference".into(),
        max_batch: 4,
    });
    let tcp = RegisterWorker {
        id: "w-0".into(),
        role: Role::Prefill,
        geometry: geometry(),
        pool_pages: 1,
        transports: vec![Transport::Tcp],
        endpoint: Some(endpoint()),
        model: "reference".into(),
        max_batch: 0,
    };
    assert!(Message::from(tcp.clone()).validate().is_ok());
    invalid(RegisterWorker {
        id: "w-0".into(),
        role: Role::Decode,
        max_batch: 4,
        ..tcp.clone()
    });
    invalid(RegisterWorker {
        transports: vec![Transport::Shm],
        ..tcp.clone()
    });
    // A decode worker has 1 to MAX_BATCH batch slots; a prefill worker none.
    let decode = RegisterWorker {
        role: Role::Decode,
        transports: vec![Transport::Shm, Transport::Tcp],
        endpoint: None,
        max_batch: 1,
        ..tcp.clone()
    };
    assert!(Message::from(decode.clone()).validate().is_ok());
    for max_batch in [MAX_BATCH, 16] {
        let ok = RegisterWorker {
            max_batch,
            ..decode.clone()
        };
        assert!(Message::from(ok).validate().is_ok(), "{max_batch}");
    }
    for max_batch in [0, MAX_BATCH + 1, u32::MAX] {
        let reason = invalid(RegisterWorker {
            max_batch,
            ..decode.clone()
        });
        assert_eq!(
            reason,
            format!("a decode worker's max_batch is {max_batch}, expected 1 to {MAX_BATCH}")
        );
    }
    let reason = invalid(RegisterWorker {
        max_batch: 1,
        ..tcp.clone()
    });
    assert!(
        reason.contains("prefill worker's max_batch is 1"),
        "{reason}"
    );
    for addr in [
        "0.0.0.0:7470",
        "192.0.2.1:0",
        "192.0.2.1",
        "host:80",
        "224.0.0.1:1",
    ] {
        let reason = invalid(RegisterWorker {
            endpoint: Some(TcpEndpoint {
                addr: addr.into(),
                ..endpoint()
            }),
            ..tcp.clone()
        });
        assert!(reason.contains("IP:PORT"), "{addr}: {reason}");
    }
    invalid(PrefillEndpoint {
        worker: "prefill-0".into(),
        geometry: geometry(),
        pool_pages: 1,
        rdma: false,
        endpoint: TcpEndpoint {
            addr: "1".repeat(MAX_ADDR_BYTES + 1),
            ..endpoint()
        },
    });
    let request = PageRequest {
        token: [0; TOKEN_BYTES],
        owner: owner(),
        pages: vec![PageId(1)],
    };
    assert!(Message::from(request.clone()).validate().is_ok());
    invalid(PageRequest {
        pages: vec![],
        ..request.clone()
    });
    invalid(PageRequest {
        pages: vec![PageId(1), PageId(1)],
        ..request
    });
    let connect = RdmaConnect {
        token: [0; TOKEN_BYTES],
        qp_num: 5,
        psn: 1,
        gid: [1; GID_BYTES],
    };
    assert!(Message::from(connect.clone()).validate().is_ok());
    for bad in [
        RdmaConnect {
            qp_num: 0,
            ..connect.clone()
        },
        RdmaConnect {
            qp_num: 1 << 24,
            ..connect.clone()
        },
        RdmaConnect {
            psn: 1 << 24,
            ..connect.clone()
        },
        RdmaConnect {
            gid: [0; GID_BYTES],
            ..connect
        },
    ] {
        invalid(bad);
    }
    let w = |first, pages| RdmaWindow {
        first,
        pages,
        addr: 4096,
        rkey: 9,
    };
    let windows = |windows| RdmaWindows {
        owner: owner(),
        windows,
    };
    assert!(
        Message::from(windows(vec![w(0, 2), w(2, 1)]))
            .validate()
            .is_ok()
    );
    invalid(windows(vec![]));
    invalid(windows(vec![w(1, 2)])); // does not start at the first page
    invalid(windows(vec![w(0, 2), w(1, 1)])); // overlaps
    invalid(windows(vec![w(0, 2), w(3, 1)])); // leaves a gap
    invalid(windows(vec![w(0, 0)]));
    invalid(windows(vec![w(0, u32::MAX)])); // more pages than a manifest holds
    invalid(PrefillPool {
        worker: "prefill-0".into(),
        geometry: PageGeometry {
            layers: 0,
            ..geometry()
        },
        pool_pages: 1,
    });
    invalid(PrefillPool {
        worker: "prefill-0".into(),
        geometry: geometry(),
        pool_pages: 0,
    });
    invalid(Error {
        code: ErrorCode::Internal,
        message: "x".repeat(MAX_TEXT_BYTES + 1),
    });
    invalid(Abort {
        owner: owner(),
        code: ErrorCode::Internal,
        reason: "x".repeat(MAX_TEXT_BYTES + 1),
    });
    invalid(Tokens {
        first_index: u32::MAX,
        tokens: vec![1],
    });
    invalid(StatusReply {
        generation: Generation(1),
        max_context: 1,
        max_new_tokens: 1,
        workers: vec![],
        counters: vec![(String::new(), 1)],
        transport: Some(Transport::Rdma),
        model: None,
    });
    invalid(StatusReply {
        generation: Generation(1),
        max_context: 1,
        max_new_tokens: 1,
        workers: vec![],
        counters: vec![("c".into(), 1); MAX_COUNTERS + 1],
        transport: Some(Transport::Rdma),
        model: None,
    });
}

#[test]
fn largest_valid_bodies_fit_a_frame() {
    let pages = (0..MAX_MANIFEST_PAGES)
        .map(|i| PageId(u32::MAX - u32::try_from(i).unwrap()))
        .collect();
    let m = Manifest {
        owner: Owner {
            request: RequestId(u64::MAX),
            generation: Generation(u64::MAX),
        },
        tokens: u32::MAX,
        pages,
        digests: vec![u32::MAX; MAX_MANIFEST_PAGES],
    };
    let msgs: Vec<Message> = vec![
        PullKv {
            source: "prefill-0".into(),
            manifest: m,
            max_new_tokens: u32::MAX,
            last_token: u32::MAX,
            sampling: crate::proto::Sampling::GREEDY,
        }
        .into(),
        Submit {
            tenant: "t".repeat(MAX_TENANT_BYTES),
            prompt: vec![u32::MAX; MAX_PROMPT_TOKENS],
            max_new_tokens: u32::MAX,
            deadline_ms: u32::MAX,
            sampling: crate::proto::Sampling::GREEDY,
        }
        .into(),
        Tokens {
            first_index: 0,
            tokens: vec![u32::MAX; MAX_TOKENS_PER_FRAME],
        }
        .into(),
        StatusReply {
            generation: Generation(u64::MAX),
            max_context: u32::MAX,
            max_new_tokens: u32::MAX,
            workers: vec![
                WorkerStatus {
                    id: "d-0".into(),
                    role: Role::Decode,
                    connected: true,
                    drain: false,
                    in_flight: 0,
                    held_pages: 0,
                    transports: Vec::new(),
                    served: 0,
                    counters: Vec::new(),
                    pool_pages: u32::MAX,
                    tokens_per_page: u32::MAX,
                    free: u32::MAX,
                    reserved: 0,
                    writing: 0,
                    readable: 0,
                    draining: 0,
                    max_batch: MAX_BATCH,
                };
                MAX_WORKERS
            ],
            counters: vec![("c".repeat(MAX_COUNTER_NAME_BYTES), u64::MAX); MAX_COUNTERS],
            transport: Some(Transport::Tcp),
            model: None,
        }
        .into(),
    ];
    for msg in msgs {
        msg.validate().unwrap();
        let frame = msg.encode(RequestId(1)).unwrap();
        assert_eq!(decode_frame(&frame, 0).unwrap().1, msg);
    }
}

#[test]
fn error_policy() {
    let errors = [
        ProtoError::BadMagic { got: 0 },
        ProtoError::Truncated { need: 24, got: 0 },
        ProtoError::BadVersion {
            got: 9,
            supported: 1,
        },
        ProtoError::Invalid {
            msg_type: MsgType::Submit,
            reason: "é".repeat(MAX_TEXT_BYTES),
        },
    ];
    assert!(errors.iter().all(ProtoError::is_fatal));
    assert!(errors[0].reply().is_none());
    assert!(errors[1].reply().is_none());
    let reply = errors[3].reply().unwrap();
    assert_eq!(reply.code, ErrorCode::BadRequest);
    assert!(Message::from(reply).validate().is_ok());
    assert_eq!(Hello::new(Role::Client).negotiate(), Some(PROTOCOL_VERSION));
    assert_eq!(
        Hello {
            role: Role::Client,
            min_version: 5,
            max_version: 6
        }
        .negotiate(),
        None
    );
    // A peer of protocol 3 (no batch slots in RegisterWorker) is told apart at Hello.
    assert_eq!(
        Hello {
            role: Role::Decode,
            min_version: 3,
            max_version: 3
        }
        .negotiate(),
        None
    );
}

fn arb_owner() -> impl Strategy<Value = Owner> {
    (any::<u64>(), any::<u64>()).prop_map(|(r, g)| Owner {
        request: RequestId(r),
        generation: Generation(g),
    })
}

fn arb_submit() -> impl Strategy<Value = Submit> {
    (
        "[A-Za-z0-9_.-]{1,64}",
        proptest::collection::vec(any::<u32>(), 1..2048),
        1..=u32::MAX,
        any::<u32>(),
    )
        .prop_map(|(tenant, prompt, max_new_tokens, deadline_ms)| Submit {
            tenant,
            prompt,
            max_new_tokens,
            deadline_ms,
            sampling: crate::proto::Sampling::GREEDY,
        })
}

fn arb_pull() -> impl Strategy<Value = PullKv> {
    (
        arb_owner(),
        1..=u32::MAX,
        proptest::collection::hash_set(any::<u32>(), 1..512),
        any::<u32>(),
        1..=u32::MAX,
        any::<u32>(),
    )
        .prop_map(|(owner, tokens, pages, seed, max_new_tokens, last_token)| {
            let pages: Vec<PageId> = pages.into_iter().map(PageId).collect();
            let digests = pages.iter().map(|p| p.0.wrapping_mul(seed)).collect();
            PullKv {
                source: "prefill-0".into(),
                manifest: Manifest {
                    owner,
                    tokens,
                    pages,
                    digests,
                },
                max_new_tokens,
                last_token,
                sampling: crate::proto::Sampling::GREEDY,
            }
        })
}

/// Any known type with an arbitrary body, so random bodies reach the postcard layer.
fn arb_framed_body() -> impl Strategy<Value = Vec<u8>> {
    (
        1..=24u16,
        any::<u64>(),
        proptest::collection::vec(any::<u8>(), 0..256),
    )
        .prop_map(|(t, id, body)| {
            let header = Header {
                msg_type: MsgType::try_from(t).unwrap(),
                body_len: u32::try_from(body.len()).unwrap(),
                request_id: RequestId(id),
            };
            let mut frame = header.to_bytes().to_vec();
            frame.extend_from_slice(&body);
            frame
        })
}

proptest! {
    #[test]
    fn random_bytes_never_panic(
        bytes in proptest::collection::vec(any::<u8>(), 0..512),
        fds in 0..3usize,
    ) {
        if let Ok(header) = Header::parse(&bytes) {
            let end = bytes.len().min(header.frame_len());
            let _ = Message::decode(&header, &bytes[HEADER_LEN..end]);
        }
        let _ = decode_frame(&bytes, fds);
    }

    #[test]
    fn random_bodies_never_panic(frame in arb_framed_body(), fds in 0..3usize) {
        let header = Header::parse(&frame).unwrap();
        if let Ok(msg) = Message::decode(&header, &frame[HEADER_LEN..]) {
            let _ = msg.check_fds(fds);
            let _ = msg.validate();
            // Whatever decodes re-encodes to the same type.
            let again = msg.encode(header.request_id).unwrap();
            prop_assert_eq!(Header::parse(&again).unwrap().msg_type, header.msg_type);
        }
        let _ = decode_frame(&frame, fds);
    }

    #[test]
    fn submit_round_trips(submit in arb_submit(), id in any::<u64>()) {
        let msg = Message::from(submit);
        let frame = msg.encode(RequestId(id)).unwrap();
        let (header, back) = decode_frame(&frame, 0).unwrap();
        prop_assert_eq!(header.request_id, RequestId(id));
        prop_assert_eq!(back, msg);
    }

    #[test]
    fn pull_kv_round_trips(pull in arb_pull(), id in any::<u64>()) {
        let msg = Message::from(pull);
        let frame = msg.encode(RequestId(id)).unwrap();
        let (header, back) = decode_frame(&frame, 0).unwrap();
        prop_assert_eq!(header.msg_type, MsgType::PullKv);
        prop_assert_eq!(back, msg);
    }
}
