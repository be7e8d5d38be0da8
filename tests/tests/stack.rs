//! The local stack end to end: the real kvctld, prefilld and decoded, spawned through
//! `kvctld::stack::Stack` on a socket in a fresh directory under /tmp.
//!
//! The binaries come from the target directory of this test (`target/<profile>/`): build
//! them first with `cargo build --bins` (or `cargo build --release --bins` for
//! `cargo test --release`). Every test is bounded in time: clients have deadlines, every
//! wait is bounded, and the daemons are killed when a test ends, passing or not.

use kvctld::client::{Client, ClientError, GenerateOutcome, REPLY_SLACK, exit};
use kvctld::stack::{Daemon, Stack, StackOptions, error_chain, wait_until};
use kvfence_tests::{
    LogsOnPanic, Moved, assert_matches, assert_transport, bin_dir, expected, model, prompt, rdma,
    rdma_device, tcp, worker_counter,
};
use libkv::config::{Config, Transfer, TransportKind};
use libkv::proto::{ErrorCode, Role, StatusReply};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// Longest any test here may take, start to finish.
const TEST_BOUND: Duration = Duration::from_secs(90);

/// A stack on the embedded default config, changed by `tweak`, in a fresh directory under
/// /tmp (the socket path must stay short).
fn start(tweak: impl FnOnce(&mut Config)) -> (tempfile::TempDir, LogsOnPanic, Stack) {
    let bin_dir = bin_dir();
    let dir = tempfile::Builder::new()
        .prefix("kvst.")
        .tempdir_in("/tmp")
        .expect("temp dir");
    let mut config = Config::embedded_default(dir.path().join("kvctld.sock"));
    tweak(&mut config);
    let mut opts = StackOptions::new(config, dir.path().to_path_buf()).expect("options");
    opts.bin_dir = bin_dir;
    let logs = LogsOnPanic(dir.path().to_path_buf());
    let stack =
        Stack::start(opts).unwrap_or_else(|e| panic!("starting the stack: {}", error_chain(&e)));
    (dir, logs, stack)
}

/// Whether every page of both pools is free, as kvctld last heard from the workers.
fn pools_all_free(status: &StatusReply) -> bool {
    [Role::Prefill, Role::Decode].iter().all(|role| {
        status.workers.iter().any(|w| {
            w.role == *role
                && w.connected
                && w.free == w.pool_pages
                && w.reserved == 0
                && w.writing == 0
                && w.readable == 0
                && w.draining == 0
        })
    })
}

/// Waits until both pools are all free again; fails with the last status otherwise.
fn assert_pools_drain(stack: &Stack, within: Duration) {
    let mut last = None;
    let drained = wait_until(within, || {
        let s = stack.status().ok()?;
        let free = pools_all_free(&s);
        last = Some(s);
        free.then_some(())
    });
    assert!(
        drained.is_some(),
        "pages still held {within:?} after the requests ended: {:#?}",
        last.map(|s| s.workers)
    );
}

#[test]
fn concurrent_requests_of_four_tenants_match_the_monolithic_path() {
    concurrent_requests_match_the_monolithic_path(|_| {}, Moved::Shm);
}

#[test]
fn concurrent_requests_over_tcp_match_the_monolithic_path() {
    concurrent_requests_match_the_monolithic_path(tcp, Moved::Tcp);
}

#[test]
fn concurrent_requests_over_rdma_match_the_monolithic_path() {
    if rdma_device().is_some() {
        concurrent_requests_match_the_monolithic_path(rdma, Moved::Rdma);
    }
}

fn concurrent_requests_match_the_monolithic_path(tweak: fn(&mut Config), moved: Moved) {
    let begun = Instant::now();
    let (_dir, _logs, stack) = start(tweak);
    let model = model(&stack);
    let geometry = stack.config().geometry;
    let tenants = ["acme", "globex", "initech", "umbrella"];
    let jobs: Vec<(&str, Vec<u8>, u32)> = (0..24)
        .map(|i| {
            let tenant = tenants[i % tenants.len()];
            let len = 12 + (i * 37) % 420;
            let max_new = 1 + u32::try_from((i * 29) % 96).unwrap();
            (tenant, prompt(tenant, i, len), max_new)
        })
        .collect();
    let results: Vec<_> = thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|(tenant, prompt, max_new)| {
                let stack = &stack;
                s.spawn(move || {
                    let mut client = stack.client()?;
                    client.generate(
                        tenant,
                        &libkv::model::tokenize(prompt),
                        *max_new,
                        10_000,
                        |_| {},
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, ((tenant, prompt, max_new), result)) in jobs.iter().zip(&results).enumerate() {
        let what = format!(
            "request {i} of {tenant} ({} tokens + {max_new})",
            prompt.len()
        );
        let out = match result {
            Ok(out) => out,
            Err(e) => panic!("{what} failed: {}", error_chain(e)),
        };
        assert_matches(out, &expected(&model, prompt, *max_new), &what);
        let pages = geometry.pages_for_tokens(prompt.len() as u64);
        assert_eq!(
            u64::from(out.done.pages_transferred),
            pages,
            "{what}: pages transferred"
        );
        assert_eq!(
            out.done.bytes_transferred,
            pages * geometry.bytes_per_page(),
            "{what}: bytes transferred"
        );
    }
    let mut ids: Vec<_> = results.iter().flatten().map(|o| o.request).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), jobs.len(), "request ids are not unique");
    assert_pools_drain(&stack, Duration::from_secs(5));
    assert_transport(&stack, moved);
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}

#[test]
fn oversize_request_is_rejected_before_any_worker_sees_it() {
    let begun = Instant::now();
    let (_dir, _logs, stack) = start(|_| {});
    let model = model(&stack);
    let limits = stack.config().limits;
    let (prefill, decode) = (Daemon::Prefilld.name(), Daemon::Decoded.name());
    let watched = [
        (prefill, "frames_received"),
        (decode, "frames_received"),
        (decode, "reserves"),
        (prefill, "prefill_runs"),
    ];
    let snapshot = || -> BTreeMap<(&str, &str), Option<u64>> {
        let s = stack.status().expect("status");
        watched
            .iter()
            .map(|&(id, n)| ((id, n), worker_counter(&s, id, n)))
            .collect()
    };
    let before = snapshot();

    let max_context = usize::try_from(limits.max_context).unwrap();
    let cases: [(&str, Vec<u8>, u32); 2] = [
        (
            "prompt of max_context + 1",
            prompt("acme", 0, max_context + 1),
            8,
        ),
        (
            "max_new_tokens over the limit",
            prompt("acme", 1, 64),
            limits.max_new_tokens + 1,
        ),
    ];
    for (what, prompt, max_new) in &cases {
        let mut client = stack.client().expect("client");
        let start = Instant::now();
        match client.generate(
            "acme",
            &libkv::model::tokenize(prompt),
            *max_new,
            5000,
            |_| panic!("{what}: tokens arrived for a rejected request"),
        ) {
            Err(ClientError::Server {
                code: ErrorCode::Rejected,
                message,
            }) => {
                assert!(!message.is_empty(), "{what}: rejection without a reason");
                assert!(
                    start.elapsed() < Duration::from_secs(2),
                    "{what}: rejection took {:?}",
                    start.elapsed()
                );
            }
            Err(e) => panic!("{what}: expected Rejected, got {}", error_chain(&e)),
            Ok(out) => panic!("{what}: expected Rejected, got {} tokens", out.tokens.len()),
        }
        // The connection stays usable after a rejection.
        client.status().expect("status after a rejection");
    }
    // Let any (wrong) worker traffic reach the counters before comparing.
    thread::sleep(Duration::from_millis(200));
    let after = snapshot();
    assert_eq!(before, after, "worker counters moved for rejected requests");
    let s = stack.status().expect("status");
    assert!(
        pools_all_free(&s),
        "pages held after rejections: {:#?}",
        s.workers
    );

    // The boundary is admitted: a prompt of exactly max_context with the most new tokens,
    // and the workers' counters then do move (so the check above can fail).
    let edge = prompt("globex", 2, max_context);
    let out = stack
        .client()
        .expect("client")
        .generate(
            "globex",
            &libkv::model::tokenize(&edge),
            limits.max_new_tokens,
            20_000,
            |_| {},
        )
        .unwrap_or_else(|e| panic!("request of exactly max_context failed: {}", error_chain(&e)));
    assert_matches(
        &out,
        &expected(&model, &edge, limits.max_new_tokens),
        "request of exactly max_context",
    );
    let moved = wait_until(Duration::from_secs(5), || {
        let now = snapshot();
        let up = |k: (&str, &str)| now[&k].unwrap_or(0) > before[&k].unwrap_or(0);
        (up((decode, "reserves")) && up((prefill, "prefill_runs"))).then_some(())
    });
    assert!(
        moved.is_some(),
        "worker counters did not move for an admitted request: before {before:?}, now {:?}",
        snapshot()
    );
    assert_pools_drain(&stack, Duration::from_secs(5));
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}

/// One request of the load in the prefilld-kill test.
struct Attempt {
    tenant: &'static str,
    prompt: Vec<u8>,
    max_new: u32,
    deadline_ms: u32,
    result: Result<GenerateOutcome, ClientError>,
    started: Instant,
    elapsed: Duration,
}

#[test]
fn killing_prefilld_mid_flight_fails_requests_cleanly_and_leaks_no_pages() {
    kill_prefilld_mid_flight(|_| {}, Moved::Shm);
}

#[test]
fn killing_prefilld_mid_transfer_over_tcp_fails_requests_cleanly_and_leaks_no_pages() {
    kill_prefilld_mid_flight(tcp, Moved::Tcp);
}

#[test]
fn killing_prefilld_mid_transfer_over_rdma_fails_requests_cleanly_and_leaks_no_pages() {
    if rdma_device().is_some() {
        kill_prefilld_mid_flight(rdma, Moved::Rdma);
    }
}

/// A build with RDMA on a host without it (or a build without RDMA): the workers say once
/// why RDMA is off and move the pages over the page server's TCP connection.
#[test]
fn rdma_configured_on_a_host_without_it_serves_over_tcp_and_says_why_once() {
    if let libkv::rdma::RdmaAvailability::Available { devices } = libkv::rdma::rdma_status() {
        eprintln!("SKIPPED: this host has RDMA devices ({devices:?})");
        return;
    }
    let begun = Instant::now();
    let (_dir, _logs, stack) = start(|c| {
        c.transfer = Transfer {
            transport: TransportKind::Rdma,
            listen: Some("127.0.0.1:0".into()),
        };
        c.rdma = Some(libkv::config::RdmaConfig::for_device("mlx5_0"));
    });
    let model = model(&stack);
    let p = prompt("acme", 1, 300);
    let out = stack
        .client()
        .expect("client")
        .generate("acme", &libkv::model::tokenize(&p), 16, 10_000, |_| {})
        .unwrap_or_else(|e| panic!("request over the TCP fallback: {}", error_chain(&e)));
    assert_matches(
        &out,
        &expected(&model, &p, 16),
        "request over the TCP fallback",
    );
    assert_transport(&stack, Moved::Tcp);
    for d in [Daemon::Prefilld, Daemon::Decoded] {
        let log = stack.log(d);
        assert!(!log.is_empty(), "{d} wrote no log");
        let said = log.lines().filter(|l| l.contains("RDMA off:")).count();
        assert_eq!(said, 1, "{d} says once why RDMA is off:\n{log}");
    }
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}

fn kill_prefilld_mid_flight(tweak: fn(&mut Config), moved: Moved) {
    let begun = Instant::now();
    let (_dir, _logs, mut stack) = start(tweak);
    let model = model(&stack);
    let admission_wait = stack.config().deadlines.admission_wait();
    let stop = AtomicBool::new(false);
    let succeeded = AtomicUsize::new(0);
    let killed_at = Mutex::new(None);
    let attempts: Mutex<Vec<Attempt>> = Mutex::new(Vec::new());
    let tenants = ["acme", "globex", "initech"];
    let deadline_ms = 3000;
    // The load threads connect on their own, leaving the stack to the kill below.
    let socket = stack.socket().to_path_buf();
    let request_deadline = stack.config().deadlines.request();

    thread::scope(|s| {
        for (t, tenant) in tenants.iter().cycle().take(6).enumerate() {
            let (socket, stop, attempts, succeeded) = (&socket, &stop, &attempts, &succeeded);
            s.spawn(move || {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    let prompt = prompt(tenant, t * 1000 + n, 600 + (n * 97) % 1400);
                    let max_new = 64 + u32::try_from(n % 64).unwrap();
                    let start = Instant::now();
                    let result =
                        Client::connect(socket, Duration::from_secs(5)).and_then(|mut c| {
                            c.set_default_deadline(request_deadline);
                            c.generate(
                                tenant,
                                &libkv::model::tokenize(&prompt),
                                max_new,
                                deadline_ms,
                                |_| {},
                            )
                        });
                    let attempt = Attempt {
                        tenant,
                        prompt,
                        max_new,
                        deadline_ms,
                        result,
                        started: start,
                        elapsed: start.elapsed(),
                    };
                    if attempt.result.is_ok() {
                        succeeded.fetch_add(1, Ordering::Relaxed);
                    }
                    attempts.lock().unwrap().push(attempt);
                    n += 1;
                }
            });
        }
        // Load first (until requests complete), then the kill while requests are in
        // flight, then a while without prefilld so that requests certainly meet its
        // absence.
        let loaded = wait_until(Duration::from_secs(20), || {
            (succeeded.load(Ordering::Relaxed) >= 3).then_some(())
        });
        thread::sleep(Duration::from_millis(50));
        *killed_at.lock().unwrap() = Some(Instant::now());
        stack.kill(Daemon::Prefilld).expect("killing prefilld");
        thread::sleep(Duration::from_millis(1200));
        stop.store(true, Ordering::Relaxed);
        assert!(
            loaded.is_some(),
            "no request succeeded within 20 s before the kill"
        );
    });

    let attempts = attempts.into_inner().unwrap();
    let (mut ok, mut failed) = (0, 0);
    let mut codes = BTreeMap::new();
    for a in &attempts {
        let what = format!(
            "{} request of {} tokens + {}",
            a.tenant,
            a.prompt.len(),
            a.max_new
        );
        let bound = Duration::from_millis(u64::from(a.deadline_ms))
            + admission_wait
            + Duration::from_millis(1000);
        assert!(
            a.elapsed <= bound,
            "{what}: returned after {:?}, over its deadline bound {bound:?} ({:?})",
            a.elapsed,
            a.result.as_ref().err().map(|e| error_chain(e))
        );
        match &a.result {
            Ok(out) => {
                ok += 1;
                assert_matches(out, &expected(&model, &a.prompt, a.max_new), &what);
            }
            Err(ClientError::Server { code, .. }) => {
                failed += 1;
                *codes.entry(format!("{code:?}")).or_insert(0) += 1;
            }
            Err(e) => panic!(
                "{what}: failed without an error from kvctld: {}",
                error_chain(e)
            ),
        }
    }
    assert!(ok > 0, "no request succeeded before the kill");
    let killed_at = killed_at.into_inner().unwrap().expect("kill time");
    let in_flight = attempts
        .iter()
        .filter(|a| a.started < killed_at && a.started + a.elapsed > killed_at)
        .count();
    assert!(
        in_flight > 0,
        "no request was in flight when prefilld was killed"
    );
    assert!(
        failed > 0,
        "no request failed although prefilld was gone for 1.2 s ({ok} succeeded)"
    );
    eprintln!(
        "{ok} requests succeeded, {failed} failed: {codes:?}; {in_flight} in flight at the kill"
    );

    stack
        .restart(Daemon::Prefilld)
        .unwrap_or_else(|e| panic!("restarting prefilld: {}", error_chain(&e)));
    assert_pools_drain(&stack, Duration::from_secs(5));
    let s = stack.status().expect("status");
    let decode = s.workers.iter().find(|w| w.role == Role::Decode).unwrap();
    assert_eq!(decode.free, decode.pool_pages, "decode pages leaked");

    for (i, tenant) in tenants.iter().enumerate() {
        let p = prompt(tenant, 9000 + i, 300);
        let out = stack
            .client()
            .expect("client")
            .generate(tenant, &libkv::model::tokenize(&p), 40, 10_000, |_| {})
            .unwrap_or_else(|e| {
                panic!(
                    "request after prefilld restarted failed: {}",
                    error_chain(&e)
                )
            });
        assert_matches(&out, &expected(&model, &p, 40), "request after restart");
    }
    assert_pools_drain(&stack, Duration::from_secs(5));
    assert_transport(&stack, moved);
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}

#[test]
fn client_of_a_disallowed_uid_is_refused() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!(
            "SKIPPED client_of_a_disallowed_uid_is_refused: needs root to run a client as \
             uid 65534"
        );
        return;
    }
    let begun = Instant::now();
    let (dir, _logs, stack) = start(|c| c.control.allowed_uids = Vec::new());
    // This test only: let uid 65534 reach the socket, so that refusing it is kvctld's
    // SO_PEERCRED check and not file permissions.
    let chmod = |p: &Path, mode| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
            .unwrap_or_else(|e| panic!("chmod {}: {e}", p.display()));
    };
    chmod(dir.path(), 0o777);
    chmod(stack.socket(), 0o777);
    // The client runs as another user, so it must be an executable that user can read.
    let kvctl = dir.path().join("kvctl");
    std::fs::copy(bin_dir().join("kvctl"), &kvctl).expect("copying kvctl");
    chmod(&kvctl, 0o755);

    let stdout_path = dir.path().join("kvctl.stdout");
    let stderr_path = dir.path().join("kvctl.stderr");
    let file = |p: &Path| std::fs::File::create(p).expect("output file");
    let mut child = std::process::Command::new(&kvctl)
        .arg("--socket")
        .arg(stack.socket())
        .arg("status")
        .uid(65534)
        .gid(65534)
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::null())
        .stdout(file(&stdout_path))
        .stderr(file(&stderr_path))
        .spawn()
        .expect("spawning kvctl as uid 65534");
    // Bounded: kill it (not yet reaped, so its pid is still its own) if it outlives its
    // own timeouts.
    let status = match wait_until(Duration::from_secs(20), || child.try_wait().ok().flatten()) {
        Some(status) => status,
        None => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvctl as uid 65534 did not return within 20 s");
        }
    };
    let out_stdout = std::fs::read(&stdout_path).unwrap_or_default();
    let out_stderr = std::fs::read(&stderr_path).unwrap_or_default();
    let stderr = String::from_utf8_lossy(&out_stderr);
    assert_eq!(
        status.code(),
        Some(i32::from(exit::CONNECT)),
        "kvctl as uid 65534: {status} / stderr: {stderr}"
    );
    assert!(
        stderr.contains("Unauthorized") || stderr.contains("connecting to"),
        "expected Unauthorized or a refused connection, got: {stderr}"
    );
    assert!(out_stdout.is_empty(), "status printed for a refused client");
    eprintln!("kvctl as uid 65534: {}", stderr.trim());

    // The daemon's own user is still served.
    let mut client = Client::connect(stack.socket(), Duration::from_secs(5)).expect("connect");
    client.status().expect("status as the daemon's uid");
    assert!(
        begun.elapsed() < TEST_BOUND + REPLY_SLACK,
        "took {:?}",
        begun.elapsed()
    );
}

#[test]
fn workers_register_again_after_kvctld_restarts() {
    let begun = Instant::now();
    let (_dir, _logs, mut stack) = start(|_| {});
    let model = model(&stack);
    let before = stack.status().expect("status").generation;
    stack.kill(Daemon::Kvctld).expect("killing kvctld");
    stack
        .restart(Daemon::Kvctld)
        .unwrap_or_else(|e| panic!("restarting kvctld: {}", error_chain(&e)));
    let s = stack.status().expect("status");
    assert_ne!(
        s.generation, before,
        "kvctld kept its generation across a restart"
    );
    assert_pools_drain(&stack, Duration::from_secs(5));
    let p = prompt("acme", 1, 100);
    let out = stack
        .client()
        .expect("client")
        .generate("acme", &libkv::model::tokenize(&p), 16, 10_000, |_| {})
        .unwrap_or_else(|e| panic!("request after kvctld restarted: {}", error_chain(&e)));
    assert_matches(
        &out,
        &expected(&model, &p, 16),
        "request after kvctld restarted",
    );
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}
