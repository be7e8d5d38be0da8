//! Bounded, stable-Rust fuzzing of the frame decoder: valid frames of every message type,
//! mutated (bit flips, byte edits, truncations, insertions, length-field and type edits),
//! fed to `decode_frame` and through a real `FrameReader` over a socket pair.
//!
//! Checked: nothing panics; every refusal is one of the typed `ProtoError` variants and its
//! numbers are consistent with the input (matched exhaustively, so a new variant must be
//! added here); every frame that decodes re-encodes to a frame that decodes to the same
//! header and message, no longer than the original; the reader yields exactly the frames and
//! the first error that decoding the byte stream frame by frame yields, however it is cut
//! into writes.
//!
//! The coverage-guided fuzzers in `fuzz/` (cargo-fuzz) run the same checks without bounds;
//! `KVFENCE_FUZZ_SEEDS=<dir> cargo test -p libkv --test frame_fuzz -- --ignored` writes their
//! seed corpus.

#![allow(clippy::cast_possible_truncation)]

use libkv::proto::{
    Abort, DecodeReserve, DecodeReserved, Done, Drain, DrainReply, Error, ErrorCode, Freed,
    HEADER_LEN, Header, Hello, HelloAck, MAGIC, MAX_BODY_LEN, MAX_FRAME_LEN, Message, MsgType,
    PoolReport, PrefillDone, PrefillGone, PrefillPool, PrefillRun, ProtoError, PullDone, PullKv,
    RdmaConnect, RdmaReadDone, RdmaWindow, RdmaWindows, RegisterAck, RegisterWorker, Release, Role,
    StatusQuery, StatusReply, Submit, Tokens, Transport, WorkerStatus, decode_frame,
};
use libkv::sys::uds::{FrameReader, ReadOutcome};
use libkv::verify::Manifest;
use libkv::{Dtype, Generation, Owner, PageGeometry, PageId, RequestId};
use proptest::prelude::*;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::OnceLock;

fn owner() -> Owner {
    Owner {
        request: RequestId(300),
        generation: Generation(2),
    }
}

fn geometry() -> PageGeometry {
    PageGeometry {
        tokens_per_page: 16,
        layers: 2,
        kv_heads: 2,
        head_dim: 8,
        dtype: Dtype::Bf16,
    }
}

fn manifest() -> Manifest {
    Manifest {
        owner: owner(),
        tokens: 20,
        pages: vec![PageId(3), PageId(70000)],
        digests: vec![0xdead_beef, 7],
    }
}

/// One valid message of every type (both kinds of `RegisterWorker`), with the descriptor
/// count each travels with.
fn valid_messages() -> Vec<(Message, usize)> {
    let worker = WorkerStatus {
        id: "decode@gpu1".into(),
        role: Role::Decode,
        connected: true,
        drain: false,
        in_flight: 1,
        held_pages: 2,
        transports: vec![Transport::Shm, Transport::Tcp],
        served: 3,
        counters: vec![("pulls".into(), 3)],
        pool_pages: 64,
        tokens_per_page: 16,
        free: 60,
        reserved: 1,
        writing: 1,
        readable: 1,
        draining: 1,
        max_batch: 4,
    };
    let msgs: Vec<Message> = vec![
        Hello::new(Role::Client).into(),
        HelloAck {
            version: 1,
            generation: Generation(9),
        }
        .into(),
        RegisterWorker {
            id: "prefill-0".into(),
            role: Role::Prefill,
            geometry: geometry(),
            pool_pages: 64,
            transports: vec![Transport::Shm, Transport::Rdma],
            endpoint: None,
            model: "reference".into(),
            max_batch: 0,
        }
        .into(),
        RegisterWorker {
            id: "decode-0".into(),
            role: Role::Decode,
            geometry: geometry(),
            pool_pages: 64,
            transports: vec![Transport::Tcp],
            endpoint: None,
            model: "reference".into(),
            max_batch: 4,
        }
        .into(),
        RegisterAck {
            generation: Generation(9),
            max_context: 4096,
            max_new_tokens: 256,
        }
        .into(),
        Submit {
            tenant: "tenant-a.1".into(),
            prompt: libkv::model::tokenize(b"why is the sky blue"),
            max_new_tokens: 200,
            deadline_ms: 1500,
            sampling: libkv::proto::Sampling::GREEDY,
        }
        .into(),
        Tokens {
            first_index: 5,
            tokens: vec![1, 300, 70000],
        }
        .into(),
        Done {
            tokens: 3,
            signature: u64::MAX - 5,
            pages_transferred: 2,
            bytes_transferred: 1 << 20,
            elapsed_us: 1234,
            prefill_worker: "prefill-0".into(),
            decode_worker: "decode-0".into(),
        }
        .into(),
        Error {
            code: ErrorCode::PoolFull,
            message: "no room".into(),
        }
        .into(),
        StatusQuery {}.into(),
        StatusReply {
            generation: Generation(9),
            max_context: 4096,
            max_new_tokens: 256,
            workers: vec![
                worker.clone(),
                WorkerStatus {
                    id: "prefill-0".into(),
                    role: Role::Prefill,
                    max_batch: 0,
                    ..worker.clone()
                },
            ],
            counters: vec![("admitted".into(), 5), ("rejected".into(), 1)],
            transport: Some(Transport::Rdma),
            model: None,
        }
        .into(),
        DecodeReserve {
            owner: owner(),
            prompt_tokens: 20,
            max_new_tokens: 8,
        }
        .into(),
        DecodeReserved {
            owner: owner(),
            pages: 2,
        }
        .into(),
        PrefillRun {
            owner: owner(),
            prompt: vec![1, 2, 3, 250],
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
            max_new_tokens: 8,
            sampling: libkv::proto::Sampling::GREEDY,
            last_token: 0,
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
            counters: vec![("verified".into(), 1)],
        }
        .into(),
        Freed {
            owner: owner(),
            pages: 2,
        }
        .into(),
        RdmaConnect {
            token: [9; 16],
            qp_num: 0x11,
            psn: 0x0022_3344,
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 0, 2, 2],
        }
        .into(),
        RdmaWindows {
            owner: owner(),
            windows: vec![RdmaWindow {
                first: 0,
                pages: 2,
                addr: 0x7f00_0000_1000,
                rkey: 0x0abc_de01,
            }],
        }
        .into(),
        RdmaReadDone { owner: owner() }.into(),
        PrefillGone {
            worker: "prefill-0".into(),
        }
        .into(),
        Drain {
            worker: "decode@gpu1".into(),
            drain: true,
        }
        .into(),
        DrainReply { worker }.into(),
    ];
    msgs.into_iter()
        .map(|m| {
            let fds = m.fd_count();
            (m, fds)
        })
        .collect()
}

/// The valid frames, encoded once.
fn valid_frames() -> &'static [(Vec<u8>, usize)] {
    static FRAMES: OnceLock<Vec<(Vec<u8>, usize)>> = OnceLock::new();
    FRAMES.get_or_init(|| {
        valid_messages()
            .into_iter()
            .enumerate()
            .map(|(i, (m, fds))| {
                m.validate().unwrap();
                (m.encode(RequestId(i as u64 * 1000 + 1)).unwrap(), fds)
            })
            .collect()
    })
}

/// Checks a refusal of `frame` (received with `fds` descriptors) against the input. The
/// match is exhaustive: a new `ProtoError` variant must be added here.
fn check_error(e: &ProtoError, frame: &[u8], fds: usize) -> Result<(), String> {
    let ok = match e {
        ProtoError::BadMagic { got } => *got != MAGIC && frame.len() >= HEADER_LEN,
        ProtoError::BadVersion { got, supported } => got != supported,
        ProtoError::ReservedBits { flags, reserved } => flags | reserved != 0,
        ProtoError::UnknownType { got } => *got != 0 && MsgType::try_from(*got).is_err(),
        ProtoError::InvalidType => true,
        ProtoError::Oversized { len, max } => {
            *max == MAX_BODY_LEN as usize && len > max && frame.len() >= HEADER_LEN
        }
        ProtoError::Truncated { need, got } => got < need && *got == frame.len(),
        ProtoError::BadBody { reason, .. } => !reason.is_empty(),
        ProtoError::TrailingBytes { extra, .. } => *extra > 0,
        ProtoError::BadFds { expected, got, .. } => expected != got && *got == fds,
        ProtoError::Invalid { reason, .. } => !reason.is_empty(),
        // Only `encode` makes this one.
        ProtoError::Encode { .. } => false,
    };
    if !ok {
        return Err(format!("inconsistent error {e:?}"));
    }
    // Formatting and the reply policy never panic, and a reply is itself a valid frame.
    let _ = e.to_string();
    assert!(e.is_fatal());
    if let Some(reply) = e.reply() {
        let msg = Message::from(reply);
        msg.validate()
            .map_err(|v| format!("reply to {e:?} invalid: {v}"))?;
    }
    Ok(())
}

/// Decodes `frame` and checks the result: a typed, consistent refusal, or a message that
/// round-trips.
fn check_decode(frame: &[u8], fds: usize) -> Result<(), String> {
    match decode_frame(frame, fds) {
        Err(e) => check_error(&e, frame, fds),
        Ok((header, msg)) => {
            if header.frame_len() != frame.len() {
                return Err(format!(
                    "decoded {} of {} bytes",
                    header.frame_len(),
                    frame.len()
                ));
            }
            if msg.msg_type() != header.msg_type || msg.fd_count() != fds {
                return Err(format!("{header:?} decoded as {msg:?} with {fds} fds"));
            }
            let again = msg
                .encode(header.request_id)
                .map_err(|e| format!("re-encoding {msg:?}: {e}"))?;
            if again.len() > frame.len() {
                return Err(format!(
                    "re-encoding grew the frame from {} to {} bytes",
                    frame.len(),
                    again.len()
                ));
            }
            let (h2, m2) =
                decode_frame(&again, fds).map_err(|e| format!("re-encoded {msg:?}: {e}"))?;
            if h2.request_id != header.request_id || h2.msg_type != header.msg_type || m2 != msg {
                return Err(format!("round trip changed {msg:?} into {m2:?}"));
            }
            Ok(())
        }
    }
}

/// What decoding `stream` frame by frame yields: the frames up to the first error, and that
/// error (`Truncated` if the stream ends inside a frame).
fn reference(stream: &[u8]) -> (Vec<(Header, Message)>, Option<ProtoError>) {
    let mut frames = Vec::new();
    let mut rest = stream;
    while !rest.is_empty() {
        if rest.len() < HEADER_LEN {
            let e = ProtoError::Truncated {
                need: HEADER_LEN,
                got: rest.len(),
            };
            return (frames, Some(e));
        }
        let header = match Header::parse(rest) {
            Ok(h) => h,
            Err(e) => return (frames, Some(e)),
        };
        let need = header.frame_len();
        if rest.len() < need {
            let e = ProtoError::Truncated {
                need,
                got: rest.len(),
            };
            return (frames, Some(e));
        }
        match decode_frame(&rest[..need], 0) {
            Ok(f) => frames.push(f),
            Err(e) => return (frames, Some(e)),
        }
        rest = &rest[need..];
    }
    (frames, None)
}

/// Writes `stream` into a socket pair cut at `cuts`, reads it with a `FrameReader` after
/// each write, closes the writer and compares what the reader yields with [`reference`].
fn check_reader(stream: &[u8], cuts: &[usize]) -> Result<(), String> {
    let (mut tx, rx) = UnixStream::pair().map_err(|e| e.to_string())?;
    let mut reader = FrameReader::new();
    let mut frames = Vec::new();
    let mut error = None;
    let pump = |reader: &mut FrameReader, frames: &mut Vec<_>, error: &mut Option<_>| {
        loop {
            let outcome = reader
                .read_from(&rx)
                .map_err(|e| format!("read_from: {e}"))?;
            if reader.pending_bytes() > MAX_FRAME_LEN {
                return Err(format!("{} bytes pending", reader.pending_bytes()));
            }
            loop {
                match reader.next_frame() {
                    Ok(Some((h, m, fds))) => {
                        if !fds.is_empty() {
                            return Err("descriptors from nowhere".into());
                        }
                        frames.push((h, m));
                    }
                    Ok(None) => break,
                    Err(e) => {
                        if error.replace(e).is_some() {
                            return Err("two errors queued".into());
                        }
                    }
                }
            }
            if !matches!(outcome, ReadOutcome::Paused { .. }) {
                return Ok(outcome);
            }
        }
    };
    let mut at = 0;
    for &cut in cuts.iter().chain(std::iter::once(&stream.len())) {
        let cut = cut.clamp(at, stream.len());
        tx.write_all(&stream[at..cut]).map_err(|e| e.to_string())?;
        at = cut;
        pump(&mut reader, &mut frames, &mut error)?;
    }
    drop(tx);
    let last = pump(&mut reader, &mut frames, &mut error)?;
    if !matches!(last, ReadOutcome::Eof | ReadOutcome::Failed) {
        return Err(format!(
            "reader ended with {last:?} after the writer closed"
        ));
    }
    let (want_frames, want_error) = reference(stream);
    if frames != want_frames || error != want_error {
        return Err(format!(
            "reader gave {} frames and {error:?}; decoding frame by frame gives {} and {want_error:?}",
            frames.len(),
            want_frames.len()
        ));
    }
    Ok(())
}

/// One edit of a frame.
#[derive(Clone, Debug)]
enum Mutation {
    FlipBit(usize, u8),
    SetByte(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
    Append(Vec<u8>),
    /// Adds to the header's body_len (wrapping).
    BodyLenDelta(i32),
    /// Sets the header's body_len.
    BodyLen(u32),
    /// Sets the header's message type.
    Type(u16),
    /// Replaces the body with the body of another valid frame (same header).
    SwapBody(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let bytes = proptest::collection::vec(any::<u8>(), 1..8);
    prop_oneof![
        4 => (any::<usize>(), 0u8..8).prop_map(|(p, b)| Mutation::FlipBit(p, b)),
        3 => (any::<usize>(), any::<u8>()).prop_map(|(p, v)| Mutation::SetByte(p, v)),
        2 => any::<usize>().prop_map(Mutation::Truncate),
        1 => (any::<usize>(), bytes.clone()).prop_map(|(p, b)| Mutation::Insert(p, b)),
        1 => (any::<usize>(), 1usize..6).prop_map(|(p, n)| Mutation::Delete(p, n)),
        1 => bytes.prop_map(Mutation::Append),
        2 => (-8i32..8).prop_map(Mutation::BodyLenDelta),
        1 => prop_oneof![
            Just(0u32),
            Just(MAX_BODY_LEN),
            Just(MAX_BODY_LEN + 1),
            Just(u32::MAX),
            any::<u32>()
        ]
        .prop_map(Mutation::BodyLen),
        2 => prop_oneof![0u16..24, any::<u16>()].prop_map(Mutation::Type),
        1 => any::<usize>().prop_map(Mutation::SwapBody),
    ]
}

fn apply(frame: &mut Vec<u8>, m: &Mutation) {
    let n = frame.len();
    let set_u32 = |f: &mut Vec<u8>, at: usize, v: u32| {
        if f.len() >= at + 4 {
            f[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
    };
    let body_len = |f: &[u8]| {
        f.get(12..16)
            .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    match m {
        Mutation::FlipBit(p, b) if n > 0 => frame[p % n] ^= 1 << b,
        Mutation::SetByte(p, v) if n > 0 => frame[p % n] = *v,
        Mutation::Truncate(p) => frame.truncate(p % (n + 1)),
        Mutation::Insert(p, b) => {
            let at = p % (n + 1);
            frame.splice(at..at, b.iter().copied());
        }
        Mutation::Delete(p, k) if n > 0 => {
            let at = p % n;
            frame.drain(at..(at + k).min(n));
        }
        Mutation::Append(b) => frame.extend_from_slice(b),
        Mutation::BodyLenDelta(d) => {
            let v = body_len(frame).wrapping_add_signed(*d);
            set_u32(frame, 12, v);
        }
        Mutation::BodyLen(v) => set_u32(frame, 12, *v),
        Mutation::Type(t) if n >= 8 => frame[6..8].copy_from_slice(&t.to_le_bytes()),
        Mutation::SwapBody(i) if n >= HEADER_LEN => {
            let frames = valid_frames();
            let other = &frames[i % frames.len()].0;
            frame.truncate(HEADER_LEN);
            frame.extend_from_slice(&other[HEADER_LEN..]);
            set_u32(frame, 12, (other.len() - HEADER_LEN) as u32);
        }
        _ => {}
    }
}

fn mutated_frame() -> impl Strategy<Value = (Vec<u8>, usize)> {
    (
        any::<usize>(),
        proptest::collection::vec(mutation(), 1..5),
        prop_oneof![4 => Just(None), 1 => (0usize..3).prop_map(Some)],
    )
        .prop_map(|(i, muts, fds)| {
            let frames = valid_frames();
            let (frame, right_fds) = &frames[i % frames.len()];
            let mut frame = frame.clone();
            for m in &muts {
                apply(&mut frame, m);
            }
            (frame, fds.unwrap_or(*right_fds))
        })
}

#[test]
fn valid_frames_decode_and_round_trip() {
    for (frame, fds) in valid_frames() {
        check_decode(frame, *fds).unwrap();
        decode_frame(frame, *fds).unwrap();
        check_reader(frame, &[1, 23, 24, 25]).unwrap();
    }
    let all: Vec<u8> = valid_frames()
        .iter()
        .filter(|(_, fds)| *fds == 0)
        .flat_map(|(f, _)| f.clone())
        .collect();
    let (frames, error) = reference(&all);
    assert_eq!(error, None);
    assert_eq!(
        frames.len(),
        valid_frames().iter().filter(|f| f.1 == 0).count()
    );
    check_reader(&all, &[]).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 20_000,
        max_shrink_iters: 2_000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn mutated_frames_decode_or_fail_typed((frame, fds) in mutated_frame()) {
        if let Err(e) = check_decode(&frame, fds) {
            return Err(TestCaseError::fail(format!("{e}; frame {}", hex(&frame))));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 2_000,
        max_shrink_iters: 2_000,
        ..ProptestConfig::default()
    })]

    /// A stream of (mostly valid) frames, one of them mutated, cut into arbitrary writes:
    /// the reader agrees with decoding the stream frame by frame.
    #[test]
    fn reader_matches_frame_by_frame_decoding(
        before in proptest::collection::vec(any::<usize>(), 0..3),
        (bad, _) in mutated_frame(),
        after in proptest::collection::vec(any::<usize>(), 0..2),
        cuts in proptest::collection::vec(any::<usize>(), 0..6),
    ) {
        let frames = valid_frames();
        let pick = |i: &usize| {
            let ok: Vec<_> = frames.iter().filter(|f| f.1 == 0).collect();
            ok[i % ok.len()].0.clone()
        };
        let mut stream: Vec<u8> = before.iter().flat_map(pick).collect();
        stream.extend_from_slice(&bad);
        stream.extend(after.iter().flat_map(pick));
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (stream.len() + 1)).collect();
        cuts.sort_unstable();
        if let Err(e) = check_reader(&stream, &cuts) {
            return Err(TestCaseError::fail(format!("{e}; cuts {cuts:?}; stream {}", hex(&stream))));
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes the seed corpus of the cargo-fuzz targets into `$KVFENCE_FUZZ_SEEDS/{frame,reader}`.
#[test]
#[ignore = "writes files; run by hand to refresh fuzz/seeds"]
fn write_fuzz_seeds() {
    let Some(dir) = std::env::var_os("KVFENCE_FUZZ_SEEDS") else {
        eprintln!("KVFENCE_FUZZ_SEEDS not set: nothing written");
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    for sub in ["frame", "reader"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    for (i, (frame, fds)) in valid_frames().iter().enumerate() {
        // frame target: first byte is the descriptor count.
        let mut f = vec![*fds as u8];
        f.extend_from_slice(frame);
        std::fs::write(dir.join("frame").join(format!("msg{i:02}")), f).unwrap();
        // reader target: first byte is the number of cuts (none), then the stream.
        let mut r = vec![0u8];
        r.extend_from_slice(frame);
        std::fs::write(dir.join("reader").join(format!("msg{i:02}")), r).unwrap();
    }
    let all: Vec<u8> = valid_frames()
        .iter()
        .filter(|(_, fds)| *fds == 0)
        .flat_map(|(f, _)| f.clone())
        .collect();
    let mut r = vec![2u8, 10, 0, 40, 0];
    r.extend_from_slice(&all);
    std::fs::write(dir.join("reader").join("stream-all"), r).unwrap();
}
