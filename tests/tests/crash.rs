//! Crash campaign: SIGKILL one daemon of a loaded stack at a random point, restart it, and
//! check that nobody got a wrong answer, nobody hung, and no page leaked.
//!
//! Each of [`ROUNDS`] rounds starts [`CLIENTS`] load threads (every prompt carries its
//! tenant's secret; poison mode is on for both pools), kills one of kvctld, prefilld and
//! decoded (seeded choice) right away (before bootstrap), after a few milliseconds (during
//! transfer) or later (during decode), keeps it down a moment, restarts it with
//! `Stack::restart`, and lets the load run on against the restarted daemon. Then:
//!
//! - every request either matches the monolithic reference (tokens and signature), with no
//!   other tenant's secret and no poison in its output, or ended with an error of a kind
//!   the kill explains, within its deadline plus [`SLACK`] (measured per request): never a
//!   wrong or foreign output, never a hang;
//! - once the load stops, both pools drain to all free and kvctld has nothing in flight;
//! - a fresh request succeeds and matches.
//!
//! The binaries come from this test's target directory: `cargo build --release --bins`
//! first for `cargo test --release`.

#![allow(clippy::cast_possible_truncation)]

use kvctld::client::{Client, ClientError};
use kvctld::stack::{Daemon, Stack, StackOptions, error_chain, wait_until};
use kvfence_tests::{LogsOnPanic, bin_dir};
use libkv::config::{Config, PoisonMode};
use libkv::model::{ReferenceModel, detokenize, monolithic, tokenize};
use libkv::proto::{ErrorCode, Role, StatusReply};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// Rounds of the campaign (one kill and one restart each).
const ROUNDS: usize = 24;

/// Rounds to run: [`ROUNDS`] in CI; `KVFENCE_CRASH_ROUNDS` for the long campaign.
fn rounds() -> usize {
    std::env::var("KVFENCE_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(ROUNDS)
}
/// Seed of every random choice.
const SEED: u64 = 0x6b76_6665_6e63_6531;
/// Load threads per round.
const CLIENTS: usize = 6;
/// Deadline every load request asks for.
const DEADLINE_MS: u32 = 3000;
/// Time past its deadline a request may take to come back.
const SLACK: Duration = Duration::from_millis(1500);
/// Most requests one load thread issues in one round.
const MAX_PER_THREAD: usize = 400;
/// Longest the whole campaign may take.
const TEST_BOUND: Duration = Duration::from_secs(120);
/// Longest the pools may take to drain after a round.
const DRAIN_WITHIN: Duration = Duration::from_secs(8);

const TENANTS: [&str; 4] = ["acme", "globex", "initech", "umbrella"];

/// xorshift64*: deterministic from the seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn secret(tenant: &str) -> String {
    format!("s3cr3t-{tenant}-canary")
}

/// A prompt of `len` bytes for `tenant`, its secret first and repeated.
fn prompt(tenant: &str, index: usize, len: usize) -> Vec<u8> {
    let mut p = format!("[{}] ", secret(tenant)).into_bytes();
    let filler = format!("{tenant} data {index} {} ", secret(tenant));
    while p.len() < len {
        p.extend_from_slice(filler.as_bytes());
    }
    p.truncate(len.max(1));
    p
}

/// Where in a request's life the kill lands (roughly: requests take a few to tens of ms).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    /// Right as the load starts: before bootstrap.
    Immediate,
    /// A few ms in: during bootstrap and transfer.
    Early,
    /// Tens of ms in: during decode.
    Late,
}

fn counter(status: &StatusReply, name: &str) -> Option<u64> {
    status
        .counters
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| *v)
}

/// Whether both workers are connected with every page free, and kvctld holds no request.
fn idle_and_free(status: &StatusReply) -> bool {
    let pools = [Role::Prefill, Role::Decode].iter().all(|role| {
        status.workers.iter().any(|w| {
            w.role == *role
                && w.connected
                && w.free == w.pool_pages
                && w.reserved == 0
                && w.writing == 0
                && w.readable == 0
                && w.draining == 0
        })
    });
    pools && counter(status, "in_flight") == Some(0)
}

/// One request of the load.
struct Attempt {
    started: Instant,
    elapsed: Duration,
    outcome: Outcome,
}

#[derive(Debug)]
enum Outcome {
    Ok,
    /// An error the kill explains, by kind.
    Failed(String),
    /// Something that must never happen.
    Violation(String),
}

/// Classifies a load request's error. `kvctld_killed`: whether kvctld is this round's
/// victim (only then may the connection itself fail).
fn classify(e: &ClientError, kvctld_killed: bool) -> Outcome {
    match e {
        ClientError::Server { code, message } => match code {
            ErrorCode::WorkerLost
            | ErrorCode::Timeout
            | ErrorCode::PoolFull
            | ErrorCode::VerifyFailed
            | ErrorCode::Internal => Outcome::Failed(format!("{code:?}")),
            ErrorCode::Rejected
            | ErrorCode::BadRequest
            | ErrorCode::Unauthorized
            | ErrorCode::ShuttingDown => {
                Outcome::Violation(format!("in-limit request answered {code:?}: {message}"))
            }
        },
        ClientError::Connect { .. }
        | ClientError::Handshake { .. }
        | ClientError::HelloRefused { .. }
        | ClientError::Closed { .. }
        | ClientError::Send { .. }
        | ClientError::Recv(_)
            if kvctld_killed =>
        {
            Outcome::Failed("disconnected".into())
        }
        ClientError::TimedOut { .. } => Outcome::Violation(format!(
            "hang: no answer from kvctld within the deadline plus the client's slack: {}",
            error_chain(e)
        )),
        other => Outcome::Violation(format!("unexpected client error: {}", error_chain(other))),
    }
}

/// Checks an output against the reference and the canaries; `None` when it is right.
fn check_output(
    model: &ReferenceModel,
    tenant: &str,
    prompt: &[u8],
    max_new: u32,
    tokens: &[u32],
    signature: u64,
) -> Option<String> {
    let text = detokenize(tokens);
    let foreign: Vec<&str> = TENANTS
        .iter()
        .filter(|t| **t != tenant && text.contains(&secret(t)))
        .copied()
        .collect();
    let bytes: Vec<u8> = tokens.iter().map(|&t| t as u8).collect();
    let poison = bytes.windows(8).any(|w| w == b"KVPOISON") || tokens.iter().any(|&t| t > 0xFF);
    if !foreign.is_empty() || poison {
        return Some(format!(
            "{tenant}: output exposes foreign secrets {foreign:?} / poison {poison}: {text:?}"
        ));
    }
    match monolithic(model, &tokenize(prompt), max_new) {
        Ok(want) if want.tokens == tokens && want.signature == signature => None,
        Ok(want) => Some(format!(
            "{tenant}: output of {} tokens + {max_new} differs from monolithic \
             (tokens equal: {}, signature {signature:#x} vs {:#x})",
            prompt.len(),
            want.tokens == tokens,
            want.signature
        )),
        Err(e) => Some(format!("monolithic failed: {e}")),
    }
}

/// The load of one thread in one round.
fn load(
    socket: &Path,
    model: &ReferenceModel,
    stop: &AtomicBool,
    kvctld_killed: bool,
    mut rng: Rng,
    thread_index: usize,
) -> Vec<Attempt> {
    let mut attempts = Vec::new();
    for n in 0..MAX_PER_THREAD {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let tenant = TENANTS[(thread_index + n) % TENANTS.len()];
        let len = 16 + rng.below(480) as usize;
        let max_new = 1 + rng.below(64) as u32;
        let p = prompt(tenant, thread_index * 10_000 + n, len);
        let started = Instant::now();
        let result = Client::connect(socket, Duration::from_secs(2)).and_then(|mut c| {
            c.set_default_deadline(Duration::from_millis(u64::from(DEADLINE_MS)));
            c.generate(tenant, &p, max_new, DEADLINE_MS, |_| {})
        });
        let elapsed = started.elapsed();
        let outcome = match &result {
            Ok(out) => {
                match check_output(model, tenant, &p, max_new, &out.tokens, out.done.signature) {
                    None => Outcome::Ok,
                    Some(v) => Outcome::Violation(format!("{}: {v}", out.request)),
                }
            }
            Err(e) => classify(e, kvctld_killed),
        };
        let connect_failed = matches!(result, Err(ClientError::Connect { .. }));
        attempts.push(Attempt {
            started,
            elapsed,
            outcome,
        });
        if connect_failed {
            // kvctld is down: do not spin.
            thread::sleep(Duration::from_millis(10));
        }
    }
    attempts
}

/// Counts of the whole campaign.
#[derive(Default, Debug)]
struct Tally {
    kills: BTreeMap<String, usize>,
    phases: BTreeMap<String, usize>,
    ok: usize,
    failed: BTreeMap<String, usize>,
    in_flight_at_kill: usize,
    in_flight_failed: usize,
    max_elapsed: Duration,
    max_error_elapsed: Duration,
    checks_ok: usize,
    /// decoded's and kvctld's `verify_failed`, summed over their incarnations.
    decoded_verify_failed: u64,
    kvctld_verify_failed: u64,
    slowest_round: Duration,
    slowest_restart: Duration,
}

/// A counter summed over the incarnations of the daemon that reports it.
#[derive(Default)]
struct Incarnations {
    last: u64,
    total: u64,
}

impl Incarnations {
    fn restarted(&mut self) {
        self.last = 0;
    }

    fn observe(&mut self, now: u64) {
        self.total += now.saturating_sub(self.last);
        self.last = now;
    }
}

#[test]
fn killing_any_daemon_at_any_point_fails_requests_cleanly_and_leaks_no_page() {
    let begun = Instant::now();
    let bin_dir = bin_dir();
    let dir = tempfile::Builder::new()
        .prefix("kvcrash.")
        .tempdir_in("/tmp")
        .expect("temp dir");
    let mut cfg = Config::embedded_default(dir.path().join("ctl.sock"));
    // Small pools, reused constantly; poison on both sides so a stale read would show.
    cfg.limits.max_context = 512;
    cfg.limits.max_new_tokens = 64;
    cfg.prefill.pool_pages = 96;
    cfg.decode.pool_pages = 128;
    cfg.prefill.poison = PoisonMode::Owner;
    cfg.decode.poison = PoisonMode::Owner;
    // Short deadlines so that failures come quickly.
    cfg.deadlines.admission_wait = 500;
    cfg.deadlines.bootstrap = 500;
    cfg.deadlines.transfer = 1000;
    cfg.deadlines.decode = 3000;
    cfg.deadlines.request = 4000;
    cfg.deadlines.drain = 1000;
    let mut opts = StackOptions::new(cfg, dir.path().to_path_buf()).expect("options");
    opts.bin_dir = bin_dir;
    opts.ready_timeout = Duration::from_secs(10);
    opts.client_timeout = Duration::from_secs(3);
    let _logs = LogsOnPanic(dir.path().to_path_buf());
    let mut stack =
        Stack::start(opts).unwrap_or_else(|e| panic!("starting the stack: {}", error_chain(&e)));
    let model = ReferenceModel::new(stack.config().geometry).expect("reference model");
    let socket = stack.socket().to_path_buf();

    // Every daemon is the victim equally often, in a seeded order.
    let mut rng = Rng::new(SEED);
    let mut victims: Vec<Daemon> = Daemon::ALL.iter().cycle().take(rounds()).copied().collect();
    for i in (1..victims.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        victims.swap(i, j);
    }

    let mut tally = Tally::default();
    let mut decoded_vf = Incarnations::default();
    let mut kvctld_vf = Incarnations::default();
    let mut violations: Vec<String> = Vec::new();

    for (round, victim) in victims.iter().copied().enumerate() {
        let round_start = Instant::now();
        let phase = match rng.below(3) {
            0 => Phase::Immediate,
            1 => Phase::Early,
            _ => Phase::Late,
        };
        let delay = match phase {
            Phase::Immediate => Duration::ZERO,
            Phase::Early => Duration::from_millis(2 + rng.below(8)),
            Phase::Late => Duration::from_millis(30 + rng.below(120)),
        };
        let down = Duration::from_millis(50 + rng.below(300));
        let kvctld_killed = victim == Daemon::Kvctld;
        let stop = AtomicBool::new(false);
        let results: Mutex<Vec<Attempt>> = Mutex::new(Vec::new());
        let mut killed_at = Instant::now();
        let mut restart_took = Duration::ZERO;
        let restarted = thread::scope(|s| {
            for t in 0..CLIENTS {
                let thread_rng = Rng::new(SEED ^ ((round as u64) << 16) ^ (t as u64 + 1));
                let (socket, model, stop, results) = (&socket, &model, &stop, &results);
                s.spawn(move || {
                    let a = load(socket, model, stop, kvctld_killed, thread_rng, t);
                    results.lock().unwrap().extend(a);
                });
            }
            thread::sleep(delay);
            killed_at = Instant::now();
            let killed = stack.kill(victim);
            thread::sleep(down);
            let restart_start = Instant::now();
            let restarted = killed.and_then(|_| stack.restart(victim));
            restart_took = restart_start.elapsed();
            // Some load against the restarted daemon, then stop (before any assertion, so
            // that the load threads end whatever happens).
            thread::sleep(Duration::from_millis(200));
            stop.store(true, Ordering::Relaxed);
            restarted
        });
        if let Err(e) = restarted {
            panic!(
                "round {round}: restarting {victim} after the kill failed: {}",
                error_chain(&e)
            );
        }
        if victim == Daemon::Decoded {
            decoded_vf.restarted();
        }
        if victim == Daemon::Kvctld {
            kvctld_vf.restarted();
        }
        *tally.kills.entry(victim.to_string()).or_insert(0) += 1;
        *tally.phases.entry(format!("{phase:?}")).or_insert(0) += 1;
        tally.slowest_restart = tally.slowest_restart.max(restart_took);

        let attempts = results.into_inner().unwrap();
        let bound = Duration::from_millis(u64::from(DEADLINE_MS)) + SLACK;
        for a in &attempts {
            let in_flight = a.started <= killed_at && a.started + a.elapsed > killed_at;
            if in_flight {
                tally.in_flight_at_kill += 1;
            }
            tally.max_elapsed = tally.max_elapsed.max(a.elapsed);
            if a.elapsed > bound {
                violations.push(format!(
                    "round {round} ({victim} killed, {phase:?}): a request returned after \
                     {:?}, over its deadline bound {bound:?}: {:?}",
                    a.elapsed, a.outcome
                ));
            }
            match &a.outcome {
                Outcome::Ok => tally.ok += 1,
                Outcome::Failed(kind) => {
                    *tally.failed.entry(kind.clone()).or_insert(0) += 1;
                    tally.max_error_elapsed = tally.max_error_elapsed.max(a.elapsed);
                    if in_flight {
                        tally.in_flight_failed += 1;
                    }
                }
                Outcome::Violation(v) => {
                    violations.push(format!("round {round} ({victim} killed, {phase:?}): {v}"));
                }
            }
        }
        assert!(
            violations.is_empty(),
            "round {round} ({victim} killed {delay:?} into the load, down {down:?}): \
             {} violations:\n{}",
            violations.len(),
            violations.join("\n")
        );

        // Idle: every page of both pools free again, nothing in flight.
        let mut last = None;
        let drained = wait_until(DRAIN_WITHIN, || {
            let s = stack.status().ok()?;
            let done = idle_and_free(&s);
            last = Some(s);
            done.then_some(())
        });
        assert!(
            drained.is_some(),
            "round {round} ({victim} killed, {phase:?}): not idle with all pages free \
             {DRAIN_WITHIN:?} after the load stopped: workers {:#?}, in_flight {:?}",
            last.as_ref().map(|s| &s.workers),
            last.as_ref().and_then(|s| counter(s, "in_flight"))
        );
        let status = last.expect("status");
        decoded_vf.observe(counter(&status, "decoded.verify_failed").unwrap_or(0));
        kvctld_vf.observe(counter(&status, "verify_failed").unwrap_or(0));

        // The restarted daemon serves: a fresh request succeeds and matches.
        let tenant = TENANTS[round % TENANTS.len()];
        let p = prompt(tenant, 90_000 + round, 100 + (round * 37) % 400);
        let out = stack
            .client()
            .and_then(|mut c| c.generate(tenant, &p, 24, DEADLINE_MS, |_| {}))
            .unwrap_or_else(|e| {
                panic!(
                    "round {round}: request after {victim} restarted failed: {}",
                    error_chain(&e)
                )
            });
        if let Some(v) = check_output(&model, tenant, &p, 24, &out.tokens, out.done.signature) {
            panic!("round {round}: request after {victim} restarted: {v}");
        }
        tally.checks_ok += 1;
        let took = round_start.elapsed();
        tally.slowest_round = tally.slowest_round.max(took);
        eprintln!(
            "round {round:2}: killed {victim:8} {phase:?} ({delay:?} in, down {down:?}, \
             restart {restart_took:?}): {} requests, round took {took:?}",
            attempts.len()
        );
    }

    // At the end, once idle, both pools are wholly free: no leaked page.
    let status = stack.status().expect("final status");
    assert!(
        idle_and_free(&status),
        "not idle at the end: {:#?}",
        status.workers
    );
    for w in &status.workers {
        assert_eq!(w.free, w.pool_pages, "{:?} pages leaked", w.role);
    }
    tally.decoded_verify_failed = decoded_vf.total;
    tally.kvctld_verify_failed = kvctld_vf.total;

    let failed: usize = tally.failed.values().sum();
    assert!(tally.ok > 0, "no request succeeded in the whole campaign");
    assert!(
        tally.in_flight_at_kill > 0,
        "no request was ever in flight at a kill: the campaign tested nothing"
    );
    assert!(
        failed > 0,
        "no request ever failed although daemons were killed"
    );
    let took = begun.elapsed();
    eprintln!(
        "crash campaign: {} rounds, kills {:?}, phases {:?}; requests ok {} failed {} \
         {:?}; in flight at a kill {} (failed {}); rounds' checks ok {}; verify_failed \
         decoded {} kvctld {}; slowest request {:?} (error {:?}), slowest restart {:?}, \
         slowest round {:?}; took {took:?}",
        rounds(),
        tally.kills,
        tally.phases,
        tally.ok,
        failed,
        tally.failed,
        tally.in_flight_at_kill,
        tally.in_flight_failed,
        tally.checks_ok,
        tally.decoded_verify_failed,
        tally.kvctld_verify_failed,
        tally.max_elapsed,
        tally.max_error_elapsed,
        tally.slowest_restart,
        tally.slowest_round,
    );
    assert!(took < TEST_BOUND, "campaign took {took:?}");
}
