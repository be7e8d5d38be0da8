//! The `kvctl` binary against a fake kvctld holding four workers: `status` (text, `-v`,
//! `--json`), `drain` (with and without `--wait`, idle in time or not), `undrain`,
//! `generate` naming the pair that served it, a JSON error object when kvctld cannot be
//! reached, and a closed stdout (`kvctl status | head`) that must not make kvctl panic.

use libkv::Generation;
use libkv::proto::{
    Done, DrainReply, Error, ErrorCode, HelloAck, Message, Role, StatusReply, Tokens, Transport,
    WorkerStatus,
};
use libkv::sys::uds::{read_frame_timeout, send_frame};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// The worker that never finishes its requests.
const STUCK: &str = "decode-1";

fn worker(id: &str, role: Role, connected: bool, drain: bool, in_flight: u32) -> WorkerStatus {
    WorkerStatus {
        id: id.into(),
        role,
        connected,
        drain,
        in_flight,
        held_pages: 2 * in_flight,
        transports: vec![Transport::Shm, Transport::Tcp],
        served: 11,
        counters: vec![(format!("{id}.pulls"), 7)],
        pool_pages: 64,
        tokens_per_page: 16,
        free: 64 - 2 * in_flight,
        reserved: 2 * in_flight,
        writing: 0,
        readable: 0,
        draining: 0,
        max_batch: if role == Role::Decode { 16 } else { 0 },
    }
}

/// A fake kvctld on a socket in a fresh directory. Each status query finishes one request
/// on every drained worker but [`STUCK`].
struct Fake {
    _dir: tempfile::TempDir,
    socket: PathBuf,
}

impl Fake {
    fn start() -> Fake {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("kvctld.sock");
        let workers = Arc::new(Mutex::new(vec![
            worker("prefill-10", Role::Prefill, true, false, 0),
            worker("prefill-1", Role::Prefill, true, false, 3),
            worker("decode-0", Role::Decode, false, false, 0),
            worker(STUCK, Role::Decode, true, true, 1),
        ]));
        let listener = UnixListener::bind(&socket).unwrap();
        thread::spawn(move || {
            let queries = Arc::new(AtomicU64::new(0));
            for s in listener.incoming().flatten() {
                let workers = Arc::clone(&workers);
                let queries = Arc::clone(&queries);
                thread::spawn(move || serve(&s, &workers, &queries));
            }
        });
        Fake { _dir: dir, socket }
    }

    fn kvctl(&self, args: &[&str]) -> Output {
        kvctl_at(&self.socket, args)
    }
}

fn kvctl_at(socket: &Path, args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_kvctl"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("panicked"),
        "kvctl {args:?} panicked: {stderr}"
    );
    out
}

/// Answers one connection; `queries` counts the status queries of this fake.
fn serve(s: &UnixStream, workers: &Mutex<Vec<WorkerStatus>>, queries: &AtomicU64) {
    let send = |id: u64, msg: Message| {
        let frame = msg.encode(libkv::RequestId(id)).unwrap();
        send_frame(s, &frame, &[]).is_ok()
    };
    while let Ok((_, msg, _)) = read_frame_timeout(s, Duration::from_secs(30)) {
        let sent = match msg {
            Message::Hello(_) => send(
                0,
                HelloAck {
                    version: 2,
                    generation: Generation(3),
                }
                .into(),
            ),
            Message::StatusQuery(_) => {
                let mut workers = workers.lock().unwrap();
                for w in workers.iter_mut().filter(|w| w.drain && w.id != STUCK) {
                    w.in_flight = w.in_flight.saturating_sub(1);
                    w.held_pages = 2 * w.in_flight;
                    w.reserved = w.held_pages;
                    w.free = w.pool_pages - w.held_pages;
                }
                let reply = StatusReply {
                    generation: Generation(3),
                    max_context: 256,
                    max_new_tokens: 64,
                    workers: workers.clone(),
                    counters: {
                        // Every query finds 10 more requests completed, whose transfers
                        // took 2.5 ms each.
                        let n = queries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        vec![
                            ("admitted".into(), 42),
                            ("rejected".into(), 1),
                            ("completed".into(), 10 * n),
                            ("latency_transfer_count".into(), 10 * n),
                            ("latency_transfer_us".into(), 25_000 * n),
                        ]
                    },
                    transport: Some(Transport::Tcp),
                    model: None,
                };
                send(0, reply.into())
            }
            Message::Drain(d) => {
                let mut workers = workers.lock().unwrap();
                let reply: Message = match workers.iter_mut().find(|w| w.id == d.worker) {
                    Some(w) => {
                        w.drain = d.drain;
                        DrainReply { worker: w.clone() }.into()
                    }
                    None => Error {
                        code: ErrorCode::BadRequest,
                        message: format!("no worker {:?}", d.worker),
                    }
                    .into(),
                };
                send(0, reply)
            }
            Message::Submit(m) => {
                let tokens: Vec<u32> = m.prompt.clone();
                let n = u32::try_from(tokens.len()).unwrap();
                send(
                    9,
                    Tokens {
                        first_index: 0,
                        tokens,
                    }
                    .into(),
                ) && send(
                    9,
                    Done {
                        tokens: n,
                        signature: 0x1234,
                        pages_transferred: 1,
                        bytes_transferred: 4096,
                        elapsed_us: 50,
                        prefill_worker: "prefill-1".into(),
                        decode_worker: "decode-0".into(),
                    }
                    .into(),
                )
            }
            other => panic!("fake kvctld: unexpected {other:?}"),
        };
        if !sent {
            break;
        }
    }
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {}", stdout(out)))
}

#[test]
fn status_lists_every_worker_with_its_state() {
    let fake = Fake::start();
    let out = fake.kvctl(&["status"]);
    assert!(out.status.success(), "{out:?}");
    let text = stdout(&out);
    let line = |id: &str| {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(id))
            .unwrap_or_else(|| panic!("no line for {id}:\n{text}"))
            .to_owned()
    };
    assert!(line("prefill-10").contains(" idle "), "{text}");
    assert!(line("prefill-1").contains(" busy "), "{text}");
    assert!(line("decode-0").contains(" disconnected "), "{text}");
    assert!(line(STUCK).contains(" draining "), "{text}");
    assert!(line("prefill-1").contains("shm,tcp"), "{text}");
    // A decode worker's batch slots, taken of its max_batch; none for prefill or the lost.
    let slots = |id: &str| line(id).split_whitespace().nth(6).unwrap().to_owned();
    assert_eq!(slots(STUCK), "1/16", "{text}");
    assert_eq!(slots("prefill-1"), "-", "{text}");
    assert_eq!(slots("decode-0"), "-", "{text}");
    // prefill first, ids in numeric order
    let order: Vec<usize> = ["prefill-1", "prefill-10", "decode-0", STUCK]
        .iter()
        .map(|id| text.find(&line(id)).unwrap())
        .collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{text}");
    assert!(
        text.contains("kvctld counters:") && text.contains("admitted"),
        "{text}"
    );
    assert!(!text.contains("prefill-1.pulls"), "{text}");

    let verbose = stdout(&fake.kvctl(&["-v", "status"]));
    assert!(verbose.contains("prefill-1.pulls"), "{verbose}");
    assert!(verbose.contains("served 11 requests"), "{verbose}");

    let out = fake.kvctl(&["--json", "status"]);
    assert!(out.status.success(), "{out:?}");
    let v = json(&out);
    let workers = v["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 4);
    assert_eq!(workers[0]["id"], "prefill-1");
    assert_eq!(workers[0]["in_flight"], 3);
    assert_eq!(workers[0]["state"], "busy");
    assert_eq!(workers[0]["transports"], serde_json::json!(["shm", "tcp"]));
    assert_eq!(workers[0]["counters"]["prefill-1.pulls"], 7);
    assert_eq!(workers[2]["connected"], false);
    assert_eq!(workers[3]["drain"], true);
    assert_eq!(workers[3]["safe_to_stop"], false);
    assert_eq!(workers[3]["slots"], 16);
    assert_eq!(workers[3]["slots_used"], 1);
    assert_eq!(workers[0]["slots"], serde_json::Value::Null);
    assert_eq!(workers[2]["slots_used"], serde_json::Value::Null);
    assert_eq!(v["counters"]["admitted"], 42);
}

#[test]
fn top_shows_frames_with_rates_and_means_over_each_interval() {
    let fake = Fake::start();
    let out = fake.kvctl(&["top", "--interval-ms", "100", "--iterations", "3"]);
    assert!(out.status.success(), "{out:?}");
    let text = stdout(&out);
    let frames: Vec<&str> = text
        .split("\n\n")
        .filter(|f| f.starts_with("kvfence top"))
        .collect();
    assert_eq!(frames.len(), 3, "{text}");
    assert!(
        frames[0].contains("completed -"),
        "no rate in the first frame: {text}"
    );
    for f in &frames[1..] {
        // 10 requests per query, queries at least 100 ms apart: above 0, at most 100/s.
        let rate: f64 = f
            .split("completed ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|r| r.parse().ok())
            .unwrap_or_else(|| panic!("no completed rate: {f}"));
        assert!(rate > 0.0 && rate <= 100.5, "{rate}: {f}");
        assert!(f.contains("transfer 2.50"), "mean transfer latency: {f}");
    }
    for f in &frames {
        for id in ["prefill-1", "prefill-10", "decode-0", STUCK] {
            assert!(
                f.lines().any(|l| l.split_whitespace().next() == Some(id)),
                "no {id}: {f}"
            );
        }
    }
    let out = fake.kvctl(&["--json", "top", "--iterations", "1"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        json(&out)["error"].as_str().unwrap().contains("status"),
        "{out:?}"
    );
}

#[test]
fn drain_wait_returns_once_the_worker_is_idle() {
    let fake = Fake::start();
    let out = fake.kvctl(&["drain", "prefill-1"]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout(&out).contains("3 requests in flight"),
        "{}",
        stdout(&out)
    );
    assert!(stdout(&out).contains("--wait"), "{}", stdout(&out));

    let out = fake.kvctl(&[
        "--json",
        "drain",
        "prefill-1",
        "--wait",
        "--timeout-ms",
        "10000",
    ]);
    assert!(out.status.success(), "{out:?}");
    let v = json(&out);
    assert_eq!(v["worker"]["id"], "prefill-1");
    assert_eq!(v["worker"]["safe_to_stop"], true);
    assert_eq!(v["worker"]["in_flight"], 0);

    let status = json(&fake.kvctl(&["--json", "status"]));
    assert_eq!(status["workers"][0]["state"], "safe to stop");
    let text = stdout(&fake.kvctl(&["status"]));
    assert!(text.contains("safe to stop"), "{text}");

    let out = fake.kvctl(&["undrain", "prefill-1"]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout(&out).contains("prefill-1: taking new requests"),
        "{out:?}"
    );
    let status = json(&fake.kvctl(&["--json", "status"]));
    assert_eq!(status["workers"][0]["drain"], false);
}

#[test]
fn drain_wait_times_out_with_exit_4() {
    let fake = Fake::start();
    let start = Instant::now();
    let out = fake.kvctl(&["drain", STUCK, "--wait", "--timeout-ms", "300"]);
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    assert!(start.elapsed() < Duration::from_secs(5));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not idle after"), "{stderr}");

    let out = fake.kvctl(&["--json", "drain", STUCK, "--wait", "--timeout-ms", "200"]);
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    let v = json(&out);
    assert_eq!(v["exit_code"], 4);
    assert_eq!(v["worker"]["id"], STUCK);
    assert_eq!(v["worker"]["in_flight"], 1);
}

#[test]
fn drain_of_an_unknown_or_invalid_id_fails() {
    let fake = Fake::start();
    let out = fake.kvctl(&["drain", "decode-9"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("decode-9"));
    let out = fake.kvctl(&["--json", "undrain", "no such id"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(json(&out)["exit_code"], 1);
}

#[test]
fn generate_names_the_pair_that_served_it() {
    let fake = Fake::start();
    let out = fake.kvctl(&["-v", "generate", "--tenant", "t", "hello"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stdout(&out), "hello\n");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("served by prefill worker prefill-1 and decode worker decode-0"),
        "{stderr}"
    );
    let quiet = fake.kvctl(&["generate", "--tenant", "t", "hello"]);
    assert!(!String::from_utf8_lossy(&quiet.stderr).contains("served by"));

    let v = json(&fake.kvctl(&["--json", "generate", "--tenant", "t", "hi"]));
    assert_eq!(v["output"], "hi");
    assert_eq!(v["prefill_worker"], "prefill-1");
    assert_eq!(v["decode_worker"], "decode-0");
}

#[test]
fn json_status_without_kvctld_prints_an_error_object() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("absent.sock");
    let out = kvctl_at(&socket, &["--json", "status"]);
    assert_eq!(out.status.code(), Some(6), "{out:?}");
    let v = json(&out);
    assert_eq!(v["exit_code"], 6);
    assert!(v["error"].as_str().unwrap().contains("absent.sock"), "{v}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("kvctl: connecting to"), "{stderr}");
    // Without --json, nothing on stdout.
    let out = kvctl_at(&socket, &["status"]);
    assert_eq!(out.status.code(), Some(6));
    assert!(out.stdout.is_empty());
}

#[test]
fn a_closed_stdout_is_not_a_panic() {
    let fake = Fake::start();
    for args in [&["status"][..], &["-v", "status"], &["--json", "status"]] {
        // A pipe whose reader is gone before kvctl writes, as `kvctl status | head` is once
        // head exits: every write fails with EPIPE.
        let (reader, writer) = nix::unistd::pipe().unwrap();
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_kvctl"))
            .arg("--socket")
            .arg(&fake.socket)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(writer))
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(out.status.success(), "{args:?}: {:?} {stderr}", out.status);
        assert!(stderr.is_empty(), "{args:?}: {stderr}");
    }
}

#[test]
fn kvctl_and_kvctld_say_their_version() {
    for (name, bin) in [
        ("kvctl", env!("CARGO_BIN_EXE_kvctl")),
        ("kvctld", env!("CARGO_BIN_EXE_kvctld")),
    ] {
        let out = Command::new(bin)
            .arg("--version")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{name} --version: {out:?}");
        assert_eq!(
            stdout.trim(),
            format!("{name} {}", env!("CARGO_PKG_VERSION")),
            "{name} --version"
        );
    }
}
