//! Hostile input at kvctld's control socket, against a live stack.
//!
//! Raw `UnixStream`s send what no honest peer sends: truncated frames, oversized lengths,
//! unknown and zero message types, bad magic and version, reserved bits, descriptors on
//! types that carry none, worker-only messages from a client, impostor workers (a wrong
//! geometry, a pool one page too small for the context, a writable pool fd, the id of a live
//! worker, no pool fd), invalid tenants, and a flood of half-open connections. For each, the
//! offender gets an `Error` frame (where the protocol says one is sent: `Misconfigured`
//! naming both numbers for a registration that can never be accepted) or is disconnected
//! within [`REPLY_WITHIN`], while a normal client keeps getting correct output, the three
//! daemons stay up, no impostor joins, kvctld closes every descriptor it refused, its memory
//! stays bounded, and `protocol_errors` and `registrations_refused` count the offences.
//! Every raw connection is closed at the end, and kvctld is seen to drop them all.
//!
//! The binaries come from this test's target directory: `cargo build --release --bins`
//! first for `cargo test --release`.

#![allow(clippy::cast_possible_truncation)]

use kvctld::client::{Client, GenerateOutcome};
use kvctld::stack::{Daemon, Stack, StackOptions, error_chain, find_worker, wait_until};
use kvfence_tests::{LogsOnPanic, bin_dir};
use libkv::config::Config;
use libkv::model::{ReferenceModel, monolithic, tokenize};
use libkv::proto::{
    self, DecodeReserved, Done, ErrorCode, Freed, HEADER_LEN, Hello, MAX_BODY_LEN, Message,
    PROTOCOL_VERSION, PrefillDone, PullDone, PullKv, RegisterWorker, Role, StatusQuery,
    StatusReply, Submit, Tokens, Transport,
};
use libkv::sys::uds::{self, UdsError};
use libkv::verify::Manifest;
use libkv::{Generation, Owner, PageGeometry, PageId, RequestId};
use nix::sys::signal::kill;
use nix::unistd::Pid;
use std::io::{self, Write};
use std::net::Shutdown;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::thread;
use std::time::{Duration, Instant};

/// Longest an offender waits for its `Error` frame or the disconnect.
const REPLY_WITHIN: Duration = Duration::from_secs(5);
/// Half-open connections of the flood.
const FLOOD: usize = 300;
/// Connections of the flood that announce a 1 MiB body and send most of it.
const BIG_PARTIAL: usize = 24;
/// Bytes of body each of them sends.
const BIG_PARTIAL_BYTES: usize = 768 * 1024;
/// Most kvctld's resident memory may grow over the flood.
const MAX_RSS_GROWTH_KIB: u64 = 64 * 1024;
/// Longest the whole test may take.
const TEST_BOUND: Duration = Duration::from_secs(90);
/// Name of the memfds attached to hostile frames, to find them among kvctld's descriptors.
const HOSTILE_MEMFD: &std::ffi::CStr = c"kvfence-hostile";

fn counter(status: &StatusReply, name: &str) -> u64 {
    status
        .counters
        .iter()
        .find(|(n, _)| n == name)
        .map_or(0, |(_, v)| *v)
}

/// A field of /proc/<pid>/status, e.g. "VmRSS" or "State".
fn proc_status(pid: Pid, field: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .map(|v| v.trim().to_owned())
}

/// kvctld's resident memory in KiB.
fn rss_kib(pid: Pid) -> u64 {
    proc_status(pid, "VmRSS")
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS for {pid}"))
}

/// Where kvctld's descriptors point (the targets of /proc/<pid>/fd/*).
fn fd_targets(pid: Pid) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|p| p.to_string_lossy().into_owned())
        .collect()
}

fn sockets_open(pid: Pid) -> usize {
    fd_targets(pid)
        .iter()
        .filter(|t| t.starts_with("socket:"))
        .count()
}

/// kvctld's sockets once connections being closed are gone: the least of a few samples.
fn settled_sockets(pid: Pid) -> usize {
    (0..15)
        .map(|_| {
            thread::sleep(Duration::from_millis(20));
            sockets_open(pid)
        })
        .min()
        .unwrap_or(0)
}

/// Fails unless every daemon runs: signal 0 reaches it and it is not a zombie (the stack
/// reaps its children only when it kills them, so a dead daemon lingers as a zombie).
fn assert_daemons_up(stack: &Stack, after: &str) {
    for d in Daemon::ALL {
        let pid = stack
            .pid(d)
            .unwrap_or_else(|| panic!("{d} has no pid after {after}"));
        assert!(kill(pid, None).is_ok(), "{d} ({pid}) is gone after {after}");
        let state = proc_status(pid, "State").unwrap_or_default();
        assert!(
            !state.starts_with('Z') && !state.starts_with('X'),
            "{d} ({pid}) died after {after} (state {state}); end of its log:\n{}",
            stack.log(d)
        );
    }
}

/// A normal client: the one connection kept open through all the attacks, plus a fresh
/// connection for each check.
struct Victim {
    model: ReferenceModel,
    kept: Client,
    checks: usize,
}

/// Runs one normal request on `client` and checks it against the monolithic reference.
fn normal_request(model: &ReferenceModel, client: &mut Client, n: usize, what: &str) {
    let prompt = format!("[good tenant secret n{n:04}] the quick brown fox {what}");
    let max_new = 8 + (n % 16) as u32;
    let out: GenerateOutcome = client
        .generate(
            "good",
            &libkv::model::tokenize(prompt.as_bytes()),
            max_new,
            10_000,
            |_| {},
        )
        .unwrap_or_else(|e| panic!("after {what}: a normal request failed: {}", error_chain(&e)));
    let want = monolithic(model, &tokenize(prompt.as_bytes()), max_new).expect("monolithic");
    assert_eq!(out.tokens, want.tokens, "after {what}: tokens differ");
    assert_eq!(
        out.done.signature, want.signature,
        "after {what}: signature differs"
    );
}

impl Victim {
    /// The kept connection and a fresh one both get correct output; the daemons run.
    fn check(&mut self, stack: &Stack, what: &str) {
        normal_request(&self.model, &mut self.kept, self.checks, what);
        let mut fresh = stack
            .client()
            .unwrap_or_else(|e| panic!("after {what}: connecting: {}", error_chain(&e)));
        normal_request(&self.model, &mut fresh, self.checks + 1, what);
        self.checks += 2;
        assert_daemons_up(stack, what);
    }
}

/// A valid frame of `msg` with request id `id`.
fn frame(msg: impl Into<Message>, id: u64) -> Vec<u8> {
    msg.into().encode(RequestId(id)).expect("encoding")
}

/// `frame` with its header changed by `f` (offsets as in `libkv::proto`'s frame layout).
fn patched(mut frame: Vec<u8>, f: impl FnOnce(&mut [u8])) -> Vec<u8> {
    f(&mut frame[..HEADER_LEN]);
    frame
}

fn set_u16(h: &mut [u8], at: usize, v: u16) {
    h[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

fn set_u32(h: &mut [u8], at: usize, v: u32) {
    h[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn connect(stack: &Stack) -> UnixStream {
    let s = UnixStream::connect(stack.socket()).expect("connecting a raw stream");
    s.set_write_timeout(Some(REPLY_WITHIN)).expect("timeout");
    s
}

/// Writes all of `bytes`.
fn put(s: &UnixStream, bytes: &[u8]) -> io::Result<()> {
    let mut w = s;
    w.write_all(bytes)
}

fn send(s: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    uds::send_frame(s, bytes, fds)
}

/// Says `Hello` as `role` and waits for the `HelloAck`.
fn hello(s: &UnixStream, role: Role) {
    send(s, &frame(Hello::new(role), 0), &[]).expect("sending Hello");
    match uds::read_frame_timeout(s, REPLY_WITHIN) {
        Ok((_, Message::HelloAck(_), _)) => {}
        other => panic!("expected HelloAck, got {other:?}"),
    }
}

/// How kvctld answered an offence.
#[derive(Debug)]
enum Answer {
    /// An `Error` frame, then the disconnect.
    Error { code: ErrorCode, message: String },
    /// The disconnect without a frame.
    Closed,
}

/// Waits for kvctld's answer to an offence: an `Error` frame then the disconnect, or the
/// disconnect alone. Anything else (another frame, an open connection after the timeout)
/// fails.
fn answer(s: &UnixStream, what: &str) -> (Answer, Duration) {
    let start = Instant::now();
    let closed = |r: &Result<uds::Frame, UdsError>| match r {
        Err(UdsError::Closed) => true,
        Err(UdsError::Recv(e)) => e.kind() == io::ErrorKind::ConnectionReset,
        _ => false,
    };
    let first = uds::read_frame_timeout(s, REPLY_WITHIN);
    if closed(&first) {
        return (Answer::Closed, start.elapsed());
    }
    let (code, message) = match first {
        Ok((_, Message::Error(e), fds)) => {
            assert!(fds.is_empty(), "{what}: Error frame came with descriptors");
            (e.code, e.message)
        }
        Ok((_, other, _)) => panic!("{what}: expected Error or a disconnect, got {other:?}"),
        Err(e) => panic!(
            "{what}: neither an Error frame nor a disconnect within {REPLY_WITHIN:?}: {}",
            error_chain(&e)
        ),
    };
    let left = REPLY_WITHIN
        .saturating_sub(start.elapsed())
        .max(Duration::from_millis(1));
    let next = uds::read_frame_timeout(s, left);
    assert!(
        closed(&next),
        "{what}: kvctld answered {code:?} ({message}) but did not disconnect: {next:?}"
    );
    (Answer::Error { code, message }, start.elapsed())
}

/// What the protocol says kvctld answers an offence with.
#[derive(Clone, Debug)]
enum Expect {
    /// `Error(BadRequest)` whose message contains the text, then the disconnect.
    Error(&'static str),
    /// `Error(code)` whose message contains every one of the texts, then the disconnect.
    Code(ErrorCode, Vec<String>),
    /// The disconnect; an `Error` first is tolerated (noted in the summary).
    Close,
}

/// Counts of the test.
#[derive(Debug, Default)]
struct Tally {
    attacks: usize,
    error_frames: usize,
    disconnects: usize,
    slowest: Duration,
}

/// Runs one offence on a fresh connection: `act` sends it (after a `Hello` as `role`, if
/// any); then the answer is checked and a normal client is served.
fn attack(
    stack: &Stack,
    victim: &mut Victim,
    tally: &mut Tally,
    what: &str,
    role: Option<Role>,
    expect: Expect,
    act: impl FnOnce(&UnixStream),
) {
    let s = connect(stack);
    if let Some(role) = role {
        hello(&s, role);
    }
    act(&s);
    let (got, took) = answer(&s, what);
    match (&got, expect) {
        (Answer::Error { code, message }, Expect::Error(needle)) => {
            assert_eq!(*code, ErrorCode::BadRequest, "{what}: {message}");
            assert!(
                message.contains(needle),
                "{what}: Error message {message:?} does not say {needle:?}"
            );
        }
        (Answer::Error { code, message }, Expect::Code(want, needles)) => {
            assert_eq!(*code, want, "{what}: {message}");
            for needle in &needles {
                assert!(
                    message.contains(needle.as_str()),
                    "{what}: Error message {message:?} does not say {needle:?}"
                );
            }
        }
        (Answer::Closed, Expect::Error(needle)) => {
            panic!("{what}: disconnected without the Error frame ({needle:?}) the protocol sends")
        }
        (Answer::Closed, Expect::Code(code, _)) => {
            panic!("{what}: disconnected without the Error({code:?}) frame the protocol sends")
        }
        (Answer::Error { code, message }, Expect::Close) => {
            eprintln!("note: {what}: answered {code:?} ({message}) before the disconnect");
        }
        (Answer::Closed, Expect::Close) => {}
    }
    match got {
        Answer::Error { .. } => tally.error_frames += 1,
        Answer::Closed => tally.disconnects += 1,
    }
    tally.attacks += 1;
    tally.slowest = tally.slowest.max(took);
    drop(s);
    victim.check(stack, what);
}

fn memfd(len: u64) -> OwnedFd {
    libkv::sys::memfd::create_sealed(HOSTILE_MEMFD, len).expect("memfd")
}

fn owner(request: u64, generation: Generation) -> Owner {
    Owner {
        request: RequestId(request),
        generation,
    }
}

fn manifest(owner: Owner, pages: Vec<PageId>) -> Manifest {
    Manifest {
        owner,
        tokens: 16 * pages.len() as u32,
        digests: vec![0xdead_beef; pages.len()],
        pages,
    }
}

fn register(id: &str, role: Role, geometry: PageGeometry, pool_pages: u32) -> RegisterWorker {
    RegisterWorker {
        id: id.to_owned(),
        role,
        geometry,
        pool_pages,
        transports: vec![Transport::Shm],
        endpoint: None,
        model: "reference".into(),
        max_batch: if role == Role::Decode { 4 } else { 0 },
    }
}

fn submit(tenant: &str) -> Submit {
    Submit {
        tenant: tenant.to_owned(),
        prompt: libkv::model::tokenize(b"hello"),
        max_new_tokens: 4,
        deadline_ms: 1000,
        sampling: libkv::proto::Sampling::GREEDY,
    }
}

#[test]
fn hostile_frames_and_floods_are_refused_while_normal_clients_are_served() {
    let begun = Instant::now();
    let bin_dir = bin_dir();
    let dir = tempfile::Builder::new()
        .prefix("kvbad.")
        .tempdir_in("/tmp")
        .expect("temp dir");
    let cfg = Config::embedded_default(dir.path().join("ctl.sock"));
    let mut opts = StackOptions::new(cfg, dir.path().to_path_buf()).expect("options");
    opts.bin_dir = bin_dir;
    let _logs = LogsOnPanic(dir.path().to_path_buf());
    let stack =
        Stack::start(opts).unwrap_or_else(|e| panic!("starting the stack: {}", error_chain(&e)));
    let cfg = stack.config().clone();
    let kvctld = stack.pid(Daemon::Kvctld).expect("kvctld pid");
    let mut victim = Victim {
        model: ReferenceModel::new(cfg.geometry).expect("reference model"),
        kept: stack.client().expect("client"),
        checks: 0,
    };
    victim.check(&stack, "start");
    let before = stack.status().expect("status");
    let generation = before.generation;
    let errors_before = counter(&before, "protocol_errors");
    let sockets_before = settled_sockets(kvctld);
    let mut tally = Tally::default();
    let hello_frame = frame(Hello::new(Role::Client), 0);
    let status_frame = frame(StatusQuery {}, 0);

    // ---- framing: truncated, oversized, unknown, bad header fields ------------------------
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "truncated header, then close",
        None,
        Expect::Close,
        |s| {
            put(s, &hello_frame[..10]).expect("write");
            s.shutdown(Shutdown::Write).expect("shutdown");
        },
    );
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "truncated body, then close",
        Some(Role::Client),
        Expect::Close,
        |s| {
            let f = frame(submit("acme"), 0);
            put(s, &f[..f.len() - 3]).expect("write");
            s.shutdown(Shutdown::Write).expect("shutdown");
        },
    );
    for (what, len) in [
        ("body_len MAX_BODY_LEN + 1", MAX_BODY_LEN + 1),
        ("body_len u32::MAX", u32::MAX),
    ] {
        attack(
            &stack,
            &mut victim,
            &mut tally,
            what,
            None,
            Expect::Error("exceeds the maximum"),
            |s| {
                let f = patched(hello_frame.clone(), |h| set_u32(h, 12, len));
                put(s, &f).expect("write");
            },
        );
    }
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "oversized body_len after Hello",
        Some(Role::Client),
        Expect::Error("exceeds the maximum"),
        |s| {
            let f = patched(status_frame.clone(), |h| {
                set_u32(h, 12, MAX_BODY_LEN + 4096)
            });
            put(s, &f).expect("write");
        },
    );
    // 31 is the first type after DrainReply (30); 0x7fff and u16::MAX are far past it.
    for ty in [31u16, 0x7fff, u16::MAX] {
        attack(
            &stack,
            &mut victim,
            &mut tally,
            &format!("unknown message type {ty}"),
            Some(Role::Client),
            Expect::Error("unknown message type"),
            |s| {
                let f = patched(status_frame.clone(), |h| set_u16(h, 6, ty));
                put(s, &f).expect("write");
            },
        );
    }
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "message type 0",
        None,
        Expect::Error("type 0"),
        |s| {
            let f = patched(hello_frame.clone(), |h| set_u16(h, 6, 0));
            put(s, &f).expect("write");
        },
    );
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "bad magic",
        None,
        Expect::Close,
        |s| {
            let f = patched(hello_frame.clone(), |h| h[..4].copy_from_slice(b"HTTP"));
            put(s, &f).expect("write");
        },
    );
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "bad magic after Hello",
        Some(Role::Client),
        Expect::Close,
        |s| {
            let f = patched(status_frame.clone(), |h| set_u32(h, 0, 0x4346_564C));
            put(s, &f).expect("write");
        },
    );
    // The version before and after this build's, and the extremes.
    for v in [0u16, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, u16::MAX] {
        attack(
            &stack,
            &mut victim,
            &mut tally,
            &format!("version {v}"),
            None,
            Expect::Error("unsupported protocol version"),
            |s| {
                let f = patched(hello_frame.clone(), |h| set_u16(h, 4, v));
                put(s, &f).expect("write");
            },
        );
    }
    for (what, at, v) in [
        ("flags 0x0001", 8, 1u16),
        ("flags 0x8000", 8, 0x8000),
        ("reserved field 1", 10, 1),
    ] {
        attack(
            &stack,
            &mut victim,
            &mut tally,
            what,
            Some(Role::Client),
            Expect::Error("reserved header bits"),
            |s| {
                let f = patched(status_frame.clone(), |h| set_u16(h, at, v));
                put(s, &f).expect("write");
            },
        );
    }
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "undecodable Submit body",
        Some(Role::Client),
        Expect::Error("undecodable"),
        |s| {
            let mut f = patched(status_frame.clone(), |h| {
                set_u16(h, 6, 5);
                set_u32(h, 12, 4);
            });
            f.extend_from_slice(&[0xff; 4]);
            put(s, &f).expect("write");
        },
    );
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "trailing bytes after a StatusQuery body",
        Some(Role::Client),
        Expect::Error("trailing bytes"),
        |s| {
            let mut f = patched(status_frame.clone(), |h| set_u32(h, 12, 3));
            f.extend_from_slice(&[0; 3]);
            put(s, &f).expect("write");
        },
    );

    // ---- descriptors on types that carry none ---------------------------------------------
    let (pipe_r, pipe_w) = nix::unistd::pipe().expect("pipe");
    let pipe_ino = std::fs::metadata(format!("/proc/self/fd/{}", {
        use std::os::fd::AsRawFd;
        pipe_r.as_raw_fd()
    }))
    .map(|m| m.ino())
    .expect("pipe inode");
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "Hello carrying a pipe fd",
        None,
        Expect::Error("file descriptors"),
        |s| send(s, &hello_frame, &[pipe_r.as_fd()]).expect("send"),
    );
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "StatusQuery carrying a memfd",
        Some(Role::Client),
        Expect::Error("file descriptors"),
        |s| {
            let fd = memfd(4096);
            send(s, &status_frame, &[fd.as_fd()]).expect("send");
        },
    );
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "Submit carrying a memfd and a pipe fd",
        Some(Role::Client),
        Expect::Error("file descriptors"),
        |s| {
            let fd = memfd(4096);
            send(s, &frame(submit("acme"), 0), &[fd.as_fd(), pipe_w.as_fd()]).expect("send");
        },
    );

    // ---- a client sending what only workers send ------------------------------------------
    let o = owner(1, generation);
    let client_offences: Vec<(&str, Vec<u8>)> = vec![
        (
            "PullKv naming out-of-range pages",
            frame(
                PullKv {
                    source: "prefill-0".into(),
                    manifest: manifest(o, vec![PageId(1_000_000_000), PageId(u32::MAX)]),
                    max_new_tokens: 4,
                    sampling: libkv::proto::Sampling::GREEDY,
                    last_token: 0,
                },
                1,
            ),
        ),
        (
            "DecodeReserved",
            frame(DecodeReserved { owner: o, pages: 4 }, 1),
        ),
        (
            "Freed",
            frame(
                Freed {
                    owner: o,
                    pages: 1_000_000,
                },
                1,
            ),
        ),
        (
            "RegisterWorker",
            frame(
                register(
                    "decode-9",
                    Role::Decode,
                    cfg.geometry,
                    cfg.decode.pool_pages,
                ),
                0,
            ),
        ),
        (
            "PrefillDone",
            frame(
                PrefillDone {
                    manifest: manifest(o, vec![PageId(0)]),
                },
                1,
            ),
        ),
        ("PullDone", frame(PullDone { owner: o }, 1)),
        (
            "Tokens",
            frame(
                Tokens {
                    first_index: 0,
                    tokens: vec![b'X'.into(); 4],
                },
                1,
            ),
        ),
        (
            "Done",
            frame(
                Done {
                    tokens: 0,
                    signature: 0,
                    pages_transferred: 0,
                    bytes_transferred: 0,
                    elapsed_us: 0,
                    prefill_worker: String::new(),
                    decode_worker: String::new(),
                },
                1,
            ),
        ),
        ("a second Hello", hello_frame.clone()),
    ];
    for (what, f) in client_offences {
        attack(
            &stack,
            &mut victim,
            &mut tally,
            &format!("client sends {what}"),
            Some(Role::Client),
            Expect::Error("may not send"),
            |s| put(s, &f).expect("write"),
        );
    }
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "StatusQuery before Hello",
        None,
        Expect::Error("expected Hello"),
        |s| put(s, &status_frame).expect("write"),
    );
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "Hello with an unsupported version range",
        None,
        Expect::Error("not supported"),
        |s| {
            let h = Hello {
                role: Role::Client,
                min_version: PROTOCOL_VERSION + 1,
                max_version: PROTOCOL_VERSION + 8,
            };
            put(s, &frame(h, 0)).expect("write");
        },
    );

    // ---- impostor workers -----------------------------------------------------------------
    // Each is refused before it joins: a registration that succeeded would add a worker (any
    // new id may register), so every one below is wrong in exactly one way.
    let wrong = PageGeometry {
        layers: cfg.geometry.layers + 1,
        ..cfg.geometry
    };
    let page_bytes = cfg.geometry.bytes_per_page();
    let tokens_per_page = u64::from(cfg.geometry.tokens_per_page);
    let prefill_need = cfg
        .geometry
        .pages_for_tokens(u64::from(cfg.limits.max_context));
    let decode_need = cfg
        .geometry
        .pages_for_tokens(u64::from(cfg.limits.max_context) + u64::from(cfg.limits.max_new_tokens));
    // A read-only, sealed pool memfd of `pages` pages, as an honest prefill worker sends.
    let read_only_pool = |pages: u32| {
        let fd = memfd(u64::from(pages) * page_bytes);
        libkv::sys::memfd::reopen_read_only(fd.as_fd()).expect("read-only fd")
    };
    let refused_before = counter(&stack.status().expect("status"), "registrations_refused");
    let mut registrations = 0u64;
    registrations += 1;
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "prefill worker with a wrong geometry",
        Some(Role::Prefill),
        Expect::Code(
            ErrorCode::Misconfigured,
            vec!["has page geometry".into(), "kvctld has".into()],
        ),
        |s| {
            let fd = read_only_pool(cfg.prefill.pool_pages);
            let f = frame(
                register("impostor-p", Role::Prefill, wrong, cfg.prefill.pool_pages),
                0,
            );
            send(s, &f, &[fd.as_fd()]).expect("send");
        },
    );
    let small_prefill = u32::try_from(prefill_need - 1).expect("pages");
    registrations += 1;
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "prefill worker with a pool one page too small for max_context",
        Some(Role::Prefill),
        Expect::Code(
            ErrorCode::Misconfigured,
            vec![
                format!("has a pool of {small_prefill} pages"),
                format!("needs {prefill_need} pages"),
            ],
        ),
        |s| {
            let fd = read_only_pool(small_prefill);
            let f = frame(
                register("impostor-p", Role::Prefill, cfg.geometry, small_prefill),
                0,
            );
            send(s, &f, &[fd.as_fd()]).expect("send");
        },
    );
    let small_decode = u32::try_from(decode_need - 1).expect("pages");
    registrations += 1;
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "decode worker with a pool one page too small for max_context + max_new_tokens",
        Some(Role::Decode),
        Expect::Code(
            ErrorCode::Misconfigured,
            vec![
                format!("has a pool of {small_decode} pages"),
                format!("needs {decode_need} pages"),
                format!("({} tokens)", decode_need * tokens_per_page),
            ],
        ),
        |s| {
            let f = frame(
                register("impostor-d", Role::Decode, cfg.geometry, small_decode),
                0,
            );
            put(s, &f).expect("write");
        },
    );
    registrations += 1;
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "prefill worker attaching a writable pool fd",
        Some(Role::Prefill),
        Expect::Code(ErrorCode::Misconfigured, vec!["read-only".into()]),
        |s| {
            let fd = memfd(u64::from(cfg.prefill.pool_pages) * page_bytes);
            let f = frame(
                register(
                    "impostor-p",
                    Role::Prefill,
                    cfg.geometry,
                    cfg.prefill.pool_pages,
                ),
                0,
            );
            send(s, &f, &[fd.as_fd()]).expect("send");
        },
    );
    registrations += 1;
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "a prefill worker under the id of the live prefill-0",
        Some(Role::Prefill),
        Expect::Error("registered by a live prefill worker"),
        |s| {
            let fd = read_only_pool(cfg.prefill.pool_pages);
            let f = frame(
                register(
                    Daemon::Prefilld.name(),
                    Role::Prefill,
                    cfg.geometry,
                    cfg.prefill.pool_pages,
                ),
                0,
            );
            send(s, &f, &[fd.as_fd()]).expect("send");
        },
    );
    registrations += 1;
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "a decode worker under the id of the live decode-0",
        Some(Role::Decode),
        Expect::Error("registered by a live decode worker"),
        |s| {
            let f = frame(
                register(
                    Daemon::Decoded.name(),
                    Role::Decode,
                    cfg.geometry,
                    cfg.decode.pool_pages,
                ),
                0,
            );
            put(s, &f).expect("write");
        },
    );
    attack(
        &stack,
        &mut victim,
        &mut tally,
        "prefill worker registering without its pool fd",
        Some(Role::Prefill),
        Expect::Error("file descriptors"),
        |s| {
            let f = frame(
                register(
                    "impostor-p",
                    Role::Prefill,
                    cfg.geometry,
                    cfg.prefill.pool_pages,
                ),
                0,
            );
            put(s, &f).expect("write");
        },
    );
    let after_impostors = stack.status().expect("status");
    let refused = counter(&after_impostors, "registrations_refused") - refused_before;
    assert_eq!(
        refused, registrations,
        "registrations_refused rose by {refused} over {registrations} refused registrations"
    );
    for id in ["impostor-p", "impostor-d"] {
        assert!(
            find_worker(&after_impostors, id).is_none(),
            "kvctld lists the refused {id}: {:#?}",
            after_impostors.workers
        );
    }
    for (what, f) in [
        (
            "Freed",
            frame(
                Freed {
                    owner: o,
                    pages: 64,
                },
                1,
            ),
        ),
        (
            "DecodeReserved",
            frame(DecodeReserved { owner: o, pages: 4 }, 1),
        ),
        ("PullDone", frame(PullDone { owner: o }, 1)),
    ] {
        attack(
            &stack,
            &mut victim,
            &mut tally,
            &format!("unregistered decode worker sends {what}"),
            Some(Role::Decode),
            Expect::Error("register first"),
            |s| put(s, &f).expect("write"),
        );
    }

    // ---- invalid tenants ------------------------------------------------------------------
    let long = "a".repeat(proto::MAX_TENANT_BYTES + 1);
    for tenant in ["", "a b", "../etc/passwd", "é", "tab\there", long.as_str()] {
        attack(
            &stack,
            &mut victim,
            &mut tally,
            &format!("Submit for tenant {tenant:?}"),
            Some(Role::Client),
            Expect::Error("tenant"),
            |s| put(s, &frame(submit(tenant), 0)).expect("write"),
        );
    }

    // No descriptor kvctld refused stays open in it.
    let leaked: Vec<String> = fd_targets(kvctld)
        .into_iter()
        .filter(|t| t.contains("kvfence-hostile") || *t == format!("pipe:[{pipe_ino}]"))
        .collect();
    assert!(
        leaked.is_empty(),
        "kvctld still holds descriptors it refused: {leaked:?}"
    );
    drop((pipe_r, pipe_w));

    let after_attacks = stack.status().expect("status");
    let errors_delta = counter(&after_attacks, "protocol_errors") - errors_before;
    // A refused registration counts in registrations_refused (checked above), every other
    // offence in protocol_errors.
    assert!(
        errors_delta + registrations >= tally.attacks as u64,
        "protocol_errors rose by {errors_delta} over {} offences ({registrations} of them \
         refused registrations)",
        tally.attacks
    );

    // ---- a flood of half-open connections -------------------------------------------------
    let rss_before = rss_kib(kvctld);
    let mut flood: Vec<UnixStream> = Vec::with_capacity(FLOOD + BIG_PARTIAL);
    let flood_start = Instant::now();
    for i in 0..FLOOD {
        let s = connect(&stack);
        match i % 3 {
            0 => {}
            1 => put(&s, &hello_frame[..12]).expect("half a header"),
            _ => {
                put(&s, &hello_frame).expect("hello");
                let f = frame(submit("flood"), 0);
                put(&s, &f[..HEADER_LEN / 2]).expect("half a header");
            }
        }
        flood.push(s);
    }
    let held = wait_until(Duration::from_secs(10), || {
        (sockets_open(kvctld) >= sockets_before + FLOOD).then_some(())
    });
    assert!(
        held.is_some(),
        "kvctld holds {} sockets, expected at least {} with the flood",
        sockets_open(kvctld),
        sockets_before + FLOOD
    );
    victim.check(&stack, "the half-open flood");
    let rss_half_open = rss_kib(kvctld);
    for _ in 0..BIG_PARTIAL {
        let s = connect(&stack);
        put(&s, &hello_frame).expect("hello");
        let mut f = patched(frame(submit("big"), 0), |h| set_u32(h, 12, MAX_BODY_LEN));
        f.truncate(HEADER_LEN);
        f.resize(HEADER_LEN + BIG_PARTIAL_BYTES, b'x');
        put(&s, &f).expect("most of a 1 MiB body");
        flood.push(s);
    }
    victim.check(&stack, "the partial 1 MiB bodies");
    // Let kvctld read what was sent before measuring.
    thread::sleep(Duration::from_millis(200));
    let rss_after = rss_kib(kvctld);
    let flood_took = flood_start.elapsed();
    let growth = rss_after.saturating_sub(rss_before);
    assert!(
        growth < MAX_RSS_GROWTH_KIB,
        "kvctld's RSS grew by {growth} KiB over the flood ({rss_before} -> {rss_after} KiB)"
    );
    let status = stack.status().expect("status during the flood");
    assert_eq!(counter(&status, "in_flight"), 0, "requests in flight");

    // Close every raw connection: kvctld drops them all and still answers.
    let sockets_flood = sockets_open(kvctld);
    drop(flood);
    let dropped = wait_until(Duration::from_secs(10), || {
        (sockets_open(kvctld) <= sockets_before).then_some(())
    });
    assert!(
        dropped.is_some(),
        "kvctld still holds {} sockets 10 s after the flood closed (before: {sockets_before})",
        sockets_open(kvctld)
    );
    let end = stack.status().expect("status after the flood");
    assert_eq!(
        counter(&end, "in_flight"),
        0,
        "requests in flight at the end"
    );
    victim.check(&stack, "the flood closed");
    let rss_end = rss_kib(kvctld);
    let errors_end = counter(&end, "protocol_errors") - errors_before;
    let took = begun.elapsed();
    eprintln!(
        "bad input: {} offences ({} answered Error then disconnected, {} disconnected \
         without a frame; slowest answer {:?}); protocol_errors +{errors_delta} (+{errors_end} \
         with the flood); flood of {FLOOD} half-open + {BIG_PARTIAL} x {} KiB partial bodies \
         in {flood_took:?}: kvctld sockets {sockets_before} -> {sockets_flood} -> {}, RSS \
         {rss_before} -> {rss_half_open} -> {rss_after} KiB (+{growth} KiB) -> {rss_end} KiB \
         after close; {} normal requests all correct; took {took:?}",
        tally.attacks,
        tally.error_frames,
        tally.disconnects,
        tally.slowest,
        BIG_PARTIAL_BYTES / 1024,
        sockets_open(kvctld),
        victim.checks,
    );
    assert!(took < TEST_BOUND, "took {took:?}");
}
