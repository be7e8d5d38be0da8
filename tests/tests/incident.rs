//! The incident, replayed against the real daemons.
//!
//! A prompt too long for the deployment must be rejected at admission with a clear error,
//! through every entry point (the client library, a raw frame, the kvctl CLI), with zero
//! pages reserved on either side, zero bootstrap messages and zero transfers, as the daemons'
//! own counters show. The misconfiguration itself (max context over the prefill pool) must
//! refuse to start. And a build that brings the incident's placeholder back must be caught
//! by the same checks (the fault-injection build, when present).

use kvctld::stack::{Stack, StackOptions, default_bin_dir, wait_until};
use kvfence_tests::{counter, worker_counter};
use libkv::RequestId;
use libkv::config::Config;
use libkv::proto::{self, ErrorCode, Hello, Message, Role, Submit};
use libkv::sys::uds;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// kvctld's own counters the replay watches.
const WATCHED: [&str; 4] = ["admitted", "bootstraps", "transfers", "pages_transferred"];

/// The workers' counters the replay watches, by worker id (each worker's own counters, from
/// its `WorkerStatus`).
const WATCHED_WORKERS: [(&str, &str); 4] = [
    ("decode-0", "frames_received"),
    ("decode-0", "reserves"),
    ("prefill-0", "frames_received"),
    ("prefill-0", "prefill_runs"),
];

fn counters(stack: &Stack) -> Vec<(String, u64)> {
    let st = stack.status().expect("status");
    let mut all: Vec<(String, u64)> = WATCHED
        .iter()
        .map(|w| ((*w).to_owned(), counter(&st, w).unwrap_or(0)))
        .collect();
    all.extend(WATCHED_WORKERS.iter().map(|(id, w)| {
        let v = worker_counter(&st, id, w).unwrap_or(0);
        (format!("{id}.{w}"), v)
    }));
    all
}

fn start(bin_dir: PathBuf, fault: Option<&str>) -> (tempfile::TempDir, Stack) {
    let dir = tempfile::Builder::new()
        .prefix("kvinc")
        .tempdir_in("/tmp")
        .unwrap();
    let cfg = Config::embedded_default(dir.path().join("ctl.sock"));
    let mut opts = StackOptions::new(cfg, dir.path().join("stack")).unwrap();
    opts.bin_dir = bin_dir;
    // The fault switch reaches the daemons through the environment of this process. Only
    // the fault-injection build reads it; the normal binaries have no such switch.
    if let Some(f) = fault {
        // SAFETY: this test binary has no C code reading the environment; std serialises its
        // own environment reads (Command::spawn) and writes with a lock.
        unsafe { std::env::set_var("KVFENCE_FAULT", f) };
    }
    let stack = Stack::start(opts)
        .unwrap_or_else(|e| panic!("starting the stack: {}", kvctld::stack::error_chain(&e)));
    (dir, stack)
}

/// Runs the incident's request through every entry point; returns what went wrong.
fn incident_violations(stack: &Stack, bin_dir: &Path) -> Vec<String> {
    let mut v = Vec::new();
    let cfg = stack.config().clone();
    let total = |s: &proto::StatusReply| -> Vec<(u32, u32)> {
        s.workers.iter().map(|w| (w.free, w.pool_pages)).collect()
    };
    // Start from a quiet stack: every page free, the workers' reports settled.
    let settled = wait_until(Duration::from_secs(10), || {
        let st = stack.status().ok()?;
        let quiet = total(&st).iter().all(|(f, t)| f == t);
        let a = counters(stack);
        std::thread::sleep(Duration::from_millis(50));
        (quiet && a == counters(stack)).then_some(a)
    });
    let before = settled.expect("the stack settles before the replay");
    let long = vec![b'x'; cfg.limits.max_context as usize + 100];

    // 1. The client library.
    let mut c = stack.client().unwrap();
    match c.generate("victim", &libkv::model::tokenize(&long), 8, 0, |_| {}) {
        Err(e) if e.server_code() == Some(ErrorCode::Rejected) => {
            let msg = e.to_string();
            if !msg.contains(&cfg.limits.max_context.to_string()) {
                v.push(format!("rejection does not name the limit: {msg}"));
            }
        }
        Err(e) => v.push(format!("client: expected a rejection, got {e}")),
        Ok(out) => v.push(format!(
            "client: over-long prompt was served: {} tokens",
            out.tokens.len()
        )),
    }

    // 2. A raw frame.
    let s = UnixStream::connect(stack.socket()).unwrap();
    let send = |m: Message| uds::send_frame(&s, &m.encode(RequestId(0)).unwrap(), &[]).unwrap();
    send(Hello::new(Role::Client).into());
    let _ack = uds::read_frame_timeout(&s, Duration::from_secs(5)).unwrap();
    send(
        Submit {
            tenant: "raw".into(),
            prompt: libkv::model::tokenize(&long),
            max_new_tokens: 8,
            deadline_ms: 0,
            sampling: libkv::proto::Sampling::GREEDY,
        }
        .into(),
    );
    match uds::read_frame_timeout(&s, Duration::from_secs(10)) {
        Ok((_, Message::Error(e), _)) if e.code == ErrorCode::Rejected => {}
        other => v.push(format!(
            "raw frame: expected Error(Rejected), got {other:?}"
        )),
    }

    // 3. The CLI.
    let out = Command::new(bin_dir.join("kvctl"))
        .arg("--socket")
        .arg(stack.socket())
        .args(["generate", "--tenant", "cli", "--max-new", "8"])
        .arg(String::from_utf8(long.clone()).unwrap())
        .output()
        .expect("running kvctl");
    if out.status.code() != Some(3) {
        v.push(format!(
            "kvctl exit {:?}, expected 3 (rejected): {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }

    // Nothing moved on either worker, nothing was bootstrapped or transferred.
    let after = counters(stack);
    for ((name, b), (_, a)) in before.iter().zip(&after) {
        if a != b {
            v.push(format!("counter {name} moved from {b} to {a}"));
        }
    }
    let idle = wait_until(Duration::from_secs(5), || {
        let st = stack.status().ok()?;
        total(&st).iter().all(|(f, t)| f == t).then_some(())
    });
    if idle.is_none() {
        v.push(format!(
            "pages reserved after the rejection: {:?}",
            stack.status().map(|s| total(&s))
        ));
    }
    v
}

#[test]
fn over_long_prompt_is_rejected_at_admission_everywhere() {
    let bin = default_bin_dir().unwrap();
    let (_dir, mut stack) = start(bin.clone(), None);
    // A normal request goes through first, so the counters are known to work.
    let mut c = stack.client().unwrap();
    let ok = c
        .generate("warmup", &libkv::model::tokenize(b"hello"), 4, 0, |_| {})
        .expect("a normal request succeeds");
    assert_eq!(libkv::model::detokenize(&ok.tokens), "hell");
    let violations = incident_violations(&stack, &bin);
    let _ = stack.stop();
    assert!(violations.is_empty(), "incident replay: {violations:#?}");
}

#[test]
fn the_incident_build_is_caught() {
    // Binaries built with `--features kvctld/fault-injection` (scripts/test builds them into
    // target/faulty): with KVFENCE_FAULT=placeholder kvctld admits the over-long prompt with
    // a one-token placeholder, as the incident's engine did. The same checks must flag it.
    let dir = std::env::var_os("KVFENCE_FAULTY_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let bin = default_bin_dir().unwrap();
            bin.parent()
                .map(|t| t.join("faulty/release"))
                .unwrap_or(bin)
        });
    if !dir.join("kvctld").is_file() {
        // CI always builds it (scripts/test); only a bare `cargo test` may lack it.
        assert!(
            std::env::var_os("CI").is_none(),
            "no fault-injection build in {}",
            dir.display()
        );
        eprintln!(
            "SKIPPED: no fault-injection build in {} (scripts/test builds one)",
            dir.display()
        );
        return;
    }
    let (_d, mut stack) = start(dir.clone(), Some("placeholder"));
    let violations = incident_violations(&stack, &dir);
    let _ = stack.stop();
    eprintln!("the broken build was flagged {} times:", violations.len());
    for x in &violations {
        eprintln!("  {x}");
    }
    assert!(
        !violations.is_empty(),
        "the incident's placeholder went unnoticed"
    );
    assert!(
        violations.iter().any(|x| x.contains("bootstraps")),
        "the placeholder's bootstrap was not seen in the counters: {violations:#?}"
    );
}

#[test]
fn config_with_the_incidents_numbers_refuses_to_start() {
    let bin = default_bin_dir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("incident.toml");
    // 42,580 pages of 16 tokens = 681,280 tokens, the incident's prefill pool.
    std::fs::write(
        &path,
        r#"
[geometry]
tokens_per_page = 16
layers = 2
kv_heads = 2
head_dim = 16
dtype = "bf16"

[limits]
max_context = 1048576
max_new_tokens = 1024

[control]
socket = "/tmp/kvfence-incident-never.sock"

[prefill]
pool_pages = 42580

[decode]
pool_pages = 131072
"#,
    )
    .unwrap();
    for daemon in ["kvctld", "prefilld", "decoded"] {
        let out = Command::new(bin.join(daemon))
            .arg("--config")
            .arg(&path)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{daemon} started with the incident's config: {err}"
        );
        assert!(
            err.contains("1048576") && err.contains("681280"),
            "{daemon} does not name both numbers: {err}"
        );
    }
    assert!(!Path::new("/tmp/kvfence-incident-never.sock").exists());
}
