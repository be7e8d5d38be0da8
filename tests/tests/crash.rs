//! Crash campaign: SIGKILL one process of a loaded stack of several workers at a random
//! point, restart it under its id, and check that nobody got a wrong answer, nobody hung, no
//! page leaked, and the rest of the stack kept serving.
//!
//! The stack runs kvctld with [`PREFILL_WORKERS`] prefill and [`DECODE_WORKERS`] decode
//! workers. Each of [`ROUNDS`] rounds starts [`CLIENTS`] load threads (every prompt carries
//! its tenant's secret; poison mode is on for every pool) and kills one process: the victims
//! are kvctld and every worker equally often, in a seeded random order, each killed in turn
//! right away (before bootstrap), after a few milliseconds (during transfer) or later (during
//! decode). The victim stays down a moment, is restarted with `Stack::restart` (a worker
//! under the same id) and the load runs on against it. Then:
//!
//! - every request either matches the monolithic reference (tokens and signature), with no
//!   other tenant's secret and no poison in its output, served by workers of the stack, or
//!   ended with an error of a kind the kill explains, within its deadline plus [`SLACK`]
//!   (measured per request): never a wrong or foreign output, never a hang;
//! - a request failed for a lost worker names the victim, never a worker that was not
//!   killed;
//! - no process ever counts a verification failure: a kill changes no page another
//!   process may still be reading (prefilld keeps the pages it held when kvctld dies
//!   until no pull can read them);
//! - once the load stops, the stack goes idle: every worker connected with all its pages
//!   free, none lent, nothing in flight on it or in kvctld (waited for, bounded);
//! - fresh requests succeed and match, and the restarted worker serves one of them.
//!
//! Over the campaign, while a worker was down the other workers served requests, requests
//! were in flight at the kills and some failed. The end prints, per process, its kills by
//! phase, the requests in flight at them (and of those, the failed), the requests failed
//! naming it, those served while it was down, the load it served and the verification
//! failures counted in its rounds.
//!
//! The binaries come from this test's target directory: `cargo build --release --bins`
//! first for `cargo test --release`.

#![allow(clippy::cast_possible_truncation)]

use kvctld::client::{Client, ClientError, ServingPair};
use kvctld::stack::{KVCTLD, Stack, StackOptions, error_chain};
use kvfence_tests::idle;
use kvfence_tests::{LogsOnPanic, bin_dir};
use libkv::config::{Config, PoisonMode};
use libkv::model::{ReferenceModel, detokenize, monolithic, tokenize};
use libkv::proto::{ErrorCode, Role};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// Prefill workers of the stack.
const PREFILL_WORKERS: usize = 2;
/// Decode workers of the stack.
const DECODE_WORKERS: usize = 2;
/// Rounds of the campaign (one kill and one restart each): six kills of each of the five
/// processes, two at each of the three points.
const ROUNDS: usize = 30;

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
const CLIENTS: usize = 8;
/// Deadline every load request asks for.
const DEADLINE_MS: u32 = 3000;
/// Time past its deadline a request may take to come back.
const SLACK: Duration = Duration::from_millis(1500);
/// Most requests one load thread issues in one round.
const MAX_PER_THREAD: usize = 400;
/// Longest the campaign may take: this plus [`ROUND_BOUND`] per round.
const START_BOUND: Duration = Duration::from_secs(30);
/// Longest one round may take on average.
const ROUND_BOUND: Duration = Duration::from_secs(3);
/// Longest the stack may take to go idle after a round's load stops.
const DRAIN_WITHIN: Duration = Duration::from_secs(8);
/// Longest the stack may take to go idle at the end of the campaign.
const FINAL_IDLE_WITHIN: Duration = Duration::from_secs(10);

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

impl Phase {
    const ALL: [Phase; 3] = [Phase::Immediate, Phase::Early, Phase::Late];
}

/// One request of the load.
struct Attempt {
    started: Instant,
    elapsed: Duration,
    outcome: Outcome,
}

#[derive(Debug)]
enum Outcome {
    /// Right output, from this pair.
    Ok(ServingPair),
    /// An error the kill explains, by kind; for a lost worker, the worker the error names.
    Failed { kind: String, lost: Option<String> },
    /// Something that must never happen.
    Violation(String),
}

/// The worker of `names` a `WorkerLost` message says kvctld lost, if it names one.
fn lost_worker(message: &str, names: &[String]) -> Option<String> {
    names
        .iter()
        .find(|n| message.contains(&format!(" worker {n} was lost")))
        .cloned()
}

/// Classifies a load request's error. `kvctld_killed`: whether kvctld is this round's
/// victim (only then may the connection itself fail). `names`: the stack's processes.
fn classify(e: &ClientError, kvctld_killed: bool, names: &[String]) -> Outcome {
    match e {
        ClientError::Server { code, message } => match code {
            ErrorCode::WorkerLost
            | ErrorCode::Timeout
            | ErrorCode::PoolFull
            | ErrorCode::VerifyFailed
            | ErrorCode::Internal => Outcome::Failed {
                kind: format!("{code:?}"),
                lost: match code {
                    ErrorCode::WorkerLost => lost_worker(message, names),
                    _ => None,
                },
            },
            ErrorCode::Rejected
            | ErrorCode::BadRequest
            | ErrorCode::Unauthorized
            | ErrorCode::ShuttingDown
            | ErrorCode::Misconfigured => {
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
            Outcome::Failed {
                kind: "disconnected".into(),
                lost: None,
            }
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

/// The stack's workers, by role.
struct Workers {
    prefill: Vec<String>,
    decode: Vec<String>,
}

impl Workers {
    /// Why `pair` is not a prefill and a decode worker of the stack, or `None`.
    fn check(&self, pair: &ServingPair) -> Option<String> {
        (!self.prefill.contains(&pair.prefill) || !self.decode.contains(&pair.decode))
            .then(|| format!("served by {pair}, not a prefill and a decode worker of the stack"))
    }
}

/// What one load thread needs.
struct Load<'a> {
    socket: &'a Path,
    model: &'a ReferenceModel,
    workers: &'a Workers,
    names: &'a [String],
    stop: &'a AtomicBool,
    kvctld_killed: bool,
}

impl Load<'_> {
    /// The requests of one thread in one round.
    fn run(&self, mut rng: Rng, thread_index: usize) -> Vec<Attempt> {
        let mut attempts = Vec::new();
        for n in 0..MAX_PER_THREAD {
            if self.stop.load(Ordering::Relaxed) {
                break;
            }
            let tenant = TENANTS[(thread_index + n) % TENANTS.len()];
            let len = 16 + rng.below(480) as usize;
            let max_new = 1 + rng.below(64) as u32;
            let p = prompt(tenant, thread_index * 10_000 + n, len);
            let started = Instant::now();
            let result = Client::connect(self.socket, Duration::from_secs(2)).and_then(|mut c| {
                c.set_default_deadline(Duration::from_millis(u64::from(DEADLINE_MS)));
                c.generate(
                    tenant,
                    &libkv::model::tokenize(&p),
                    max_new,
                    DEADLINE_MS,
                    |_| {},
                )
            });
            let elapsed = started.elapsed();
            let outcome = match &result {
                Ok(out) => {
                    let wrong = check_output(
                        self.model,
                        tenant,
                        &p,
                        max_new,
                        &out.tokens,
                        out.done.signature,
                    )
                    .or_else(|| self.workers.check(&out.pair));
                    match wrong {
                        None => Outcome::Ok(out.pair.clone()),
                        Some(v) => Outcome::Violation(format!("{}: {v}", out.request)),
                    }
                }
                Err(e) => classify(e, self.kvctld_killed, self.names),
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
}

/// What the campaign did to one process.
#[derive(Default, Debug)]
struct VictimTally {
    kills: usize,
    /// Kills by [`Phase`].
    phases: [usize; 3],
    /// Requests in flight at its kills, and those of them that failed.
    in_flight: usize,
    in_flight_failed: usize,
    /// Requests failed with `WorkerLost` naming it.
    lost_named: usize,
    /// The latest such a request started after it was dead (kvctld had not seen it go).
    lost_latest_start: Duration,
    /// Requests that started after it was dead and were served before its restart began.
    ok_while_down: usize,
    /// Verification failures counted (by any process) in the rounds it was killed.
    verify_failed: u64,
}

/// Counts of the whole campaign.
#[derive(Default, Debug)]
struct Tally {
    victims: BTreeMap<String, VictimTally>,
    ok: usize,
    /// Load requests served, by worker.
    served: BTreeMap<String, usize>,
    failed: BTreeMap<String, usize>,
    max_elapsed: Duration,
    max_error_elapsed: Duration,
    checks_ok: usize,
    slowest_round: Duration,
    slowest_restart: Duration,
    slowest_idle: Duration,
}

/// The largest value a counter of each process incarnation (name and pid) reached: a
/// restarted process starts its counters again at 0, so the campaign's total is the sum
/// (what a killed incarnation counted after it was last seen is lost with it).
#[derive(Default)]
struct Incarnations(BTreeMap<(String, i32), u64>);

impl Incarnations {
    /// Records `value` for the incarnation; how much it grew since last seen.
    fn observe(&mut self, name: &str, pid: Option<nix::unistd::Pid>, value: u64) -> u64 {
        let Some(pid) = pid else {
            return 0;
        };
        let seen = self.0.entry((name.to_owned(), pid.as_raw())).or_insert(0);
        let grew = value.saturating_sub(*seen);
        *seen = (*seen).max(value);
        grew
    }

    fn total(&self) -> u64 {
        self.0.values().sum()
    }
}

/// Records the `verify_failed` counters of every process in an idle status; the processes
/// whose counter grew since last seen, and by how much.
fn observe_verify_failed(
    vf: &mut Incarnations,
    stack: &Stack,
    status: &libkv::proto::StatusReply,
) -> Vec<(String, u64)> {
    let mut grew = Vec::new();
    let kvctld = idle::counter(status, "verify_failed").unwrap_or(0);
    let n = vf.observe(KVCTLD, stack.pid(KVCTLD), kvctld);
    if n > 0 {
        grew.push((KVCTLD.to_owned(), n));
    }
    for w in &status.workers {
        let n = vf.observe(
            &w.id,
            stack.pid(&w.id),
            idle::worker_counter(w, "verify_failed"),
        );
        if n > 0 {
            grew.push((w.id.clone(), n));
        }
    }
    grew
}

#[test]
fn killing_any_process_of_several_workers_fails_requests_cleanly_and_leaks_no_page() {
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
    let mut opts = StackOptions::new(cfg, dir.path().to_path_buf())
        .expect("options")
        .with_workers(PREFILL_WORKERS, DECODE_WORKERS);
    opts.bin_dir = bin_dir;
    opts.ready_timeout = Duration::from_secs(10);
    opts.client_timeout = Duration::from_secs(3);
    let _logs = LogsOnPanic(dir.path().to_path_buf());
    let mut stack =
        Stack::start(opts).unwrap_or_else(|e| panic!("starting the stack: {}", error_chain(&e)));
    let model = ReferenceModel::new(stack.config().geometry).expect("reference model");
    let socket = stack.socket().to_path_buf();
    let names = stack.names();
    let workers = Workers {
        prefill: stack.worker_ids(Role::Prefill),
        decode: stack.worker_ids(Role::Decode),
    };
    // Sequential fresh requests after a restart: enough for the pairing to reach every
    // worker of a role (ties go to the worker picked longest ago).
    let fresh_tries = 2 * PREFILL_WORKERS.max(DECODE_WORKERS) + 2;

    // Every process is the victim equally often, in a seeded order; each goes through the
    // three phases in turn, from a seeded start.
    let mut rng = Rng::new(SEED);
    let mut victims: Vec<String> = names.iter().cycle().take(rounds()).cloned().collect();
    for i in (1..victims.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        victims.swap(i, j);
    }
    let first_phase: BTreeMap<String, usize> = names
        .iter()
        .map(|n| (n.clone(), rng.below(3) as usize))
        .collect();

    let mut tally = Tally::default();
    for n in &names {
        tally.victims.insert(n.clone(), VictimTally::default());
    }
    let mut verify_failed = Incarnations::default();
    let mut violations: Vec<String> = Vec::new();

    // Shown only on a terminal (`cargo test -- --nocapture` of the long campaign), never in CI.
    let progress = libkv::progress::bar(victims.len() as u64, "kills");
    for (round, victim) in victims.iter().enumerate() {
        progress.set_message(victim.clone());
        progress.inc(1);
        let round_start = Instant::now();
        let kills_before = tally.victims[victim].kills;
        let phase = Phase::ALL[(first_phase[victim] + kills_before) % 3];
        let delay = match phase {
            Phase::Immediate => Duration::ZERO,
            Phase::Early => Duration::from_millis(2 + rng.below(8)),
            Phase::Late => Duration::from_millis(30 + rng.below(120)),
        };
        let down = Duration::from_millis(50 + rng.below(300));
        let stop = AtomicBool::new(false);
        let results: Mutex<Vec<Attempt>> = Mutex::new(Vec::new());
        let load = Load {
            socket: &socket,
            model: &model,
            workers: &workers,
            names: &names,
            stop: &stop,
            kvctld_killed: victim == KVCTLD,
        };
        // The kill lands between `killed_at` and `dead_at` (SIGKILL, then reaped).
        let mut killed_at = Instant::now();
        let mut dead_at = Instant::now();
        let mut down_until = Instant::now();
        let mut restart_took = Duration::ZERO;
        let (killed, restarted) = thread::scope(|s| {
            for t in 0..CLIENTS {
                let thread_rng = Rng::new(SEED ^ ((round as u64) << 16) ^ (t as u64 + 1));
                let (load, results) = (&load, &results);
                s.spawn(move || {
                    let a = load.run(thread_rng, t);
                    results.lock().unwrap().extend(a);
                });
            }
            thread::sleep(delay);
            killed_at = Instant::now();
            let killed = stack.kill(victim);
            dead_at = Instant::now();
            thread::sleep(down);
            down_until = Instant::now();
            let restarted = stack.restart(victim);
            restart_took = down_until.elapsed();
            // Some load against the restarted process, then stop (before any assertion, so
            // that the load threads end whatever happens).
            thread::sleep(Duration::from_millis(200));
            stop.store(true, Ordering::Relaxed);
            (killed, restarted)
        });
        match killed {
            Ok(Some(_)) => {}
            Ok(None) => panic!("round {round}: {victim} was not running when it was to be killed"),
            Err(e) => panic!("round {round}: killing {victim}: {}", error_chain(&e)),
        }
        if let Err(e) = restarted {
            panic!(
                "round {round}: restarting {victim} after the kill failed: {}",
                error_chain(&e)
            );
        }
        tally.slowest_restart = tally.slowest_restart.max(restart_took);

        let attempts = results.into_inner().unwrap();
        let bound = Duration::from_millis(u64::from(DEADLINE_MS)) + SLACK;
        let v = tally
            .victims
            .get_mut(victim)
            .expect("every process has a tally");
        v.kills += 1;
        v.phases[phase as usize] += 1;
        for a in &attempts {
            let ended = a.started + a.elapsed;
            let in_flight = a.started <= killed_at && ended >= dead_at;
            if in_flight {
                v.in_flight += 1;
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
                Outcome::Ok(pair) => {
                    tally.ok += 1;
                    for id in [&pair.prefill, &pair.decode] {
                        *tally.served.entry(id.clone()).or_insert(0) += 1;
                    }
                    if a.started >= dead_at && ended <= down_until {
                        v.ok_while_down += 1;
                    }
                }
                Outcome::Failed { kind, lost } => {
                    *tally.failed.entry(kind.clone()).or_insert(0) += 1;
                    tally.max_error_elapsed = tally.max_error_elapsed.max(a.elapsed);
                    if in_flight {
                        v.in_flight_failed += 1;
                    }
                    match lost {
                        Some(id) if id == victim => {
                            v.lost_named += 1;
                            v.lost_latest_start = v
                                .lost_latest_start
                                .max(a.started.saturating_duration_since(dead_at));
                        }
                        Some(id) => violations.push(format!(
                            "round {round} ({victim} killed, {phase:?}): a request failed \
                             for the loss of {id}, which was not killed"
                        )),
                        None => {}
                    }
                }
                Outcome::Violation(msg) => {
                    violations.push(format!("round {round} ({victim} killed, {phase:?}): {msg}"));
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

        // Idle: every worker connected with all its pages free, nothing in flight.
        let idle_start = Instant::now();
        let status = idle::wait_idle(&stack, DRAIN_WITHIN).unwrap_or_else(|e| {
            panic!("round {round} ({victim} killed, {phase:?}): {}", e.message)
        });
        tally.slowest_idle = tally.slowest_idle.max(idle_start.elapsed());
        // A verification failure would be a clean error (decoded refuses the pages), but
        // no kill explains one: a worker's death changes no page of another process, and on
        // losing kvctld prefilld keeps what it held until no decode job can still copy it.
        let verify_grew = observe_verify_failed(&mut verify_failed, &stack, &status);
        assert!(
            verify_grew.is_empty(),
            "round {round} ({victim} killed, {phase:?}): verification failed in \
             {verify_grew:?}"
        );
        tally
            .victims
            .get_mut(victim)
            .expect("every process has a tally")
            .verify_failed += verify_grew.iter().map(|(_, n)| n).sum::<u64>();

        // The restarted process serves: fresh requests succeed and match, and one of them
        // is served by the restarted worker.
        let mut pairs = Vec::new();
        let mut served = victim == KVCTLD;
        for k in 0..fresh_tries {
            let tenant = TENANTS[(round + k) % TENANTS.len()];
            let p = prompt(
                tenant,
                90_000 + round * 100 + k,
                100 + (round * 37 + k) % 400,
            );
            let out = stack
                .client()
                .and_then(|mut c| {
                    c.generate(tenant, &libkv::model::tokenize(&p), 24, DEADLINE_MS, |_| {})
                })
                .unwrap_or_else(|e| {
                    panic!(
                        "round {round}: request after {victim} restarted failed: {}",
                        error_chain(&e)
                    )
                });
            if let Some(v) = check_output(&model, tenant, &p, 24, &out.tokens, out.done.signature)
                .or_else(|| workers.check(&out.pair))
            {
                panic!("round {round}: request after {victim} restarted: {v}");
            }
            tally.checks_ok += 1;
            served |= out.pair.prefill == *victim || out.pair.decode == *victim;
            pairs.push(out.pair.to_string());
            if served {
                break;
            }
        }
        assert!(
            served,
            "round {round}: {victim}, restarted, served none of {fresh_tries} fresh requests \
             (served by {pairs:?})"
        );
        let took = round_start.elapsed();
        tally.slowest_round = tally.slowest_round.max(took);
        eprintln!(
            "round {round:2}: killed {victim:9} {phase:9?} ({delay:?} in, down {down:?}, \
             restart {restart_took:?}): {} requests, round took {took:?}{}",
            attempts.len(),
            if verify_grew.is_empty() {
                String::new()
            } else {
                format!("; verify_failed grew: {verify_grew:?}")
            }
        );
    }

    // At the end, once idle, every pool is wholly free: no leaked page. The last fresh
    // request's pages are freed after its answer, so this is waited for too.
    let status = idle::wait_idle(&stack, FINAL_IDLE_WITHIN).unwrap_or_else(|e| {
        panic!(
            "at the end of the campaign ({:?} pages not free): {}",
            e.pages_not_free(),
            e.message
        )
    });
    let verify_grew = observe_verify_failed(&mut verify_failed, &stack, &status);
    assert!(
        verify_grew.is_empty(),
        "verify_failed grew with no kill since the last round: {verify_grew:?}"
    );

    progress.finish_and_clear();
    let failed: usize = tally.failed.values().sum();
    let in_flight: usize = tally.victims.values().map(|v| v.in_flight).sum();
    let lost_named: usize = tally.victims.values().map(|v| v.lost_named).sum();
    let took = begun.elapsed();
    eprintln!(
        "crash campaign: {} rounds on {PREFILL_WORKERS} + {DECODE_WORKERS} workers, \
         {CLIENTS} clients; requests {} (ok {}, failed cleanly {failed} {:?}); in flight at \
         a kill {in_flight}; fresh checks ok {}; verify_failed {}; slowest request {:?} \
         (error {:?}), restart {:?}, idle wait {:?}, round {:?}; took {took:?}",
        rounds(),
        tally.ok + failed,
        tally.ok,
        tally.failed,
        tally.checks_ok,
        verify_failed.total(),
        tally.max_elapsed,
        tally.max_error_elapsed,
        tally.slowest_restart,
        tally.slowest_idle,
        tally.slowest_round,
    );
    eprintln!(
        "  {:9} {:>5} {:>15} {:>9} {:>8} {:>10} {:>11} {:>8} {:>11} {:>13}",
        "process",
        "kills",
        "imm/early/late",
        "in flight",
        "(failed)",
        "lost named",
        "(latest at)",
        "ok down",
        "served load",
        "verify failed"
    );
    for (name, v) in &tally.victims {
        eprintln!(
            "  {name:9} {:>5} {:>15} {:>9} {:>8} {:>10} {:>11} {:>8} {:>11} {:>13}",
            v.kills,
            format!("{}/{}/{}", v.phases[0], v.phases[1], v.phases[2]),
            v.in_flight,
            v.in_flight_failed,
            v.lost_named,
            format!("{:.1?}", v.lost_latest_start),
            v.ok_while_down,
            if name == KVCTLD {
                "-".to_owned()
            } else {
                tally.served.get(name).copied().unwrap_or(0).to_string()
            },
            v.verify_failed
        );
    }

    assert!(tally.ok > 0, "no request succeeded in the whole campaign");
    assert!(
        in_flight > 0,
        "no request was ever in flight at a kill: the campaign tested nothing"
    );
    assert!(
        failed > 0,
        "no request ever failed although processes were killed"
    );
    let worker_kills = victims.iter().filter(|v| *v != KVCTLD).count();
    assert!(
        worker_kills == 0 || lost_named > 0,
        "no request failed naming a killed worker in {worker_kills} worker kills: the check \
         that a loss fails only the victim's requests saw nothing"
    );
    assert_eq!(
        tally.victims[KVCTLD].ok_while_down, 0,
        "requests were served while kvctld was down: its kills did not take"
    );
    for (name, v) in &tally.victims {
        assert!(
            name == KVCTLD || v.kills == 0 || v.ok_while_down > 0,
            "no request was served while {name} was down, in {} kills: the other workers \
             did not keep serving",
            v.kills
        );
    }
    let bound = START_BOUND + ROUND_BOUND * rounds() as u32;
    assert!(took < bound, "campaign took {took:?}, over {bound:?}");
}
