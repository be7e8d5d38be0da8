//! Operating a stack of many workers (2 prefill + 2 decode under one kvctld), on the real
//! daemons: who may join, how much waits, and taking a worker out of service.
//!
//! - A worker that can never fit is refused when it starts into the running stack: a
//!   different page geometry, or a pool one page too small for `max_context` (prefill) or
//!   `max_context + max_new_tokens` (decode). It exits with code 2, its log names both
//!   numbers (both geometries, or the pages it has and the pages needed), kvctld counts the
//!   refusal and does not list it as connected, and the stack keeps serving; given a
//!   config that fits, the same worker rejoins and serves.
//! - `admission_queue = 0`: on an idle stack every request that fits is served; with every
//!   pool taken (the decode workers stopped with SIGSTOP while they hold a request each, and
//!   separately many concurrent requests that each fill a pool), a request that would have
//!   to wait is refused at once with `PoolFull`, and kvctld queues none.
//! - SIGTERM of one worker under load drains it: the requests in flight on it finish and
//!   equal the monolithic path, no request fails, requests sent once kvctld shows it
//!   drained go to the other workers, and it exits 0 once idle, before its drain deadline.
//! - `kvctl drain` (`Client::drain`) keeps new requests off a worker while it stays
//!   connected, and `undrain` brings it back: kvctld's `served` counts tell.
//! - `kvctl drain ID --wait` while requests are in flight on ID, then SIGKILL of ID: kvctl
//!   exits 5 naming the loss and how many requests failed (as many as the clients saw fail
//!   with `WorkerLost`), never 0 with "safe to stop"; `status --json` shows the lost worker
//!   not safe to stop.
//!
//! The binaries come from this test's target directory: `cargo build --release --bins`
//! first for `cargo test --release`. Every wait is bounded and every request has a deadline.

use kvctld::client::{ClientError, GenerateOutcome};
use kvctld::stack::{Stack, StackError, error_chain, find_worker, wait_until};
use kvfence_tests::{
    Job, all_worker_ids, assert_matches, bin_dir, counter, expected, model, prompt, serves_again,
    start_stack, under_load, wait_all_free,
};
use libkv::config::Config;
use libkv::model::ReferenceModel;
use libkv::proto::{ErrorCode, Role};
use nix::sys::signal::Signal;
use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

/// Longest any test here may take, start to finish.
const TEST_BOUND: Duration = Duration::from_secs(50);
/// Deadline of each request.
const DEADLINE_MS: u32 = 8000;

/// Runs one request and checks it against the monolithic path; returns its outcome.
fn serve_one(
    stack: &Stack,
    model: &ReferenceModel,
    p: &[u8],
    max_new: u32,
    what: &str,
) -> GenerateOutcome {
    let out = stack
        .client()
        .expect("client")
        .generate(
            "ops",
            &libkv::model::tokenize(p),
            max_new,
            DEADLINE_MS,
            |_| {},
        )
        .unwrap_or_else(|e| panic!("{what}: {}", error_chain(&e)));
    assert_matches(&out, &expected(model, p, max_new), what);
    out
}

/// Runs `n` requests at once and checks each against the monolithic path.
fn serve_many(stack: &Stack, model: &ReferenceModel, n: usize, what: &str) -> Vec<GenerateOutcome> {
    thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|i| {
                s.spawn(move || {
                    let p = prompt("ops", i, 100 + i * 113);
                    serve_one(stack, model, &p, 8 + u32::try_from(i).expect("small"), what)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("request"))
            .collect()
    })
}

fn served(stack: &Stack, id: &str) -> u64 {
    let s = stack.status().expect("status");
    find_worker(&s, id).map_or(0, |w| w.served)
}

// ---- workers that cannot fit ---------------------------------------------------------------

/// A config for worker `id` that validates on its own but cannot join a stack running
/// `base`, and the texts its refusal must name.
struct Misfit {
    id: &'static str,
    what: &'static str,
    config: Config,
    needles: Vec<String>,
}

fn misfits(base: &Config) -> Vec<Misfit> {
    let g = base.geometry;
    let (context, new) = (base.limits.max_context, base.limits.max_new_tokens);
    let tpp = g.tokens_per_page;
    let describe =
        |layers: u32| format!("16 tokens/page x {layers} layers x {} kv heads", g.kv_heads);
    assert_eq!(tpp, 16, "the misfits below assume 16 tokens per page");
    let mut wrong_geometry = base.clone();
    wrong_geometry.geometry.layers = g.layers + 1;
    // One page short of max_context: the worker's own config asks for one page of context
    // less, so it validates and starts, and only kvctld can refuse it.
    let prefill_need = g.pages_for_tokens(u64::from(context));
    let mut short_prefill = base.clone();
    short_prefill.limits.max_context = context - tpp;
    short_prefill.prefill.pool_pages = u32::try_from(prefill_need - 1).expect("pages");
    let decode_need = g.pages_for_tokens(u64::from(context) + u64::from(new));
    let mut short_decode = base.clone();
    short_decode.limits.max_new_tokens = new - tpp;
    short_decode.decode.pool_pages = u32::try_from(decode_need - 1).expect("pages");
    for c in [&wrong_geometry, &short_prefill, &short_decode] {
        c.validate()
            .expect("a misfit's config validates on its own");
    }
    vec![
        Misfit {
            id: "prefill-1",
            what: "a prefill worker of another page geometry",
            config: wrong_geometry.clone(),
            needles: vec![
                format!("has page geometry {}", describe(g.layers + 1)),
                format!("kvctld has {}", describe(g.layers)),
            ],
        },
        Misfit {
            id: "decode-1",
            what: "a decode worker of another page geometry",
            config: wrong_geometry,
            needles: vec![
                format!("has page geometry {}", describe(g.layers + 1)),
                format!("kvctld has {}", describe(g.layers)),
            ],
        },
        Misfit {
            id: "prefill-1",
            what: "a prefill worker one page short of max_context",
            config: short_prefill,
            needles: vec![
                format!("has a pool of {} pages", prefill_need - 1),
                format!("max_context {context} needs {prefill_need} pages"),
            ],
        },
        Misfit {
            id: "decode-1",
            what: "a decode worker one page short of max_context + max_new_tokens",
            config: short_decode,
            needles: vec![
                format!("has a pool of {} pages", decode_need - 1),
                format!("max_context {context} + max_new_tokens {new} needs {decode_need} pages"),
            ],
        },
    ]
}

#[test]
fn workers_that_cannot_fit_are_refused_exit_2_and_the_stack_keeps_serving() {
    let begun = Instant::now();
    let mut run = start_stack("kvmisfit.", 2, 2, |_| {});
    let stack = &mut run.stack;
    let model = model(stack);
    let ids = all_worker_ids(stack);
    let base = stack.config().clone();
    for (n, m) in misfits(&base).into_iter().enumerate() {
        let refused_before =
            counter(&stack.status().expect("status"), "registrations_refused").unwrap_or(0);
        let log_before = stack.log(m.id).len();
        // The worker starts again under its id with the misfit's config, into the stack
        // that keeps running with the other three.
        stack
            .set_worker_config(m.id, &m.config)
            .unwrap_or_else(|e| panic!("{}: {}", m.what, error_chain(&e)));
        let err = stack
            .restart(m.id)
            .expect_err(&format!("{} joined the stack", m.what));
        let StackError::Exited { name, status, .. } = &err else {
            panic!("{}: expected it to exit, got {}", m.what, error_chain(&err));
        };
        assert_eq!(name, m.id, "{}: another process exited: {err}", m.what);
        assert_eq!(
            status.code(),
            Some(2),
            "{}: exit status {status} (signal {:?}), expected 2",
            m.what,
            status.signal()
        );
        let log = stack.log(m.id);
        let said = &log[log_before.min(log.len())..];
        let line = said
            .lines()
            .find(|l| l.contains("refused the registration"))
            .unwrap_or_else(|| panic!("{}: no refusal in its log:\n{said}", m.what));
        for needle in &m.needles {
            assert!(
                line.contains(needle.as_str()),
                "{}: its refusal does not say {needle:?}: {line}",
                m.what
            );
        }
        let s = stack.status().expect("status");
        assert_eq!(
            counter(&s, "registrations_refused").unwrap_or(0),
            refused_before + 1,
            "{}: kvctld's registrations_refused",
            m.what
        );
        assert!(
            find_worker(&s, m.id).is_none_or(|w| !w.connected),
            "{}: listed as connected: {:?}",
            m.what,
            find_worker(&s, m.id)
        );
        // The stack keeps serving without it.
        let p = prompt("misfit", n, 900);
        let out = serve_one(
            stack,
            &model,
            &p,
            24,
            &format!("a request after {}", m.what),
        );
        assert!(
            out.pair.prefill != m.id && out.pair.decode != m.id,
            "served by the refused worker: {}",
            out.pair
        );
        // Given a config that fits, the same worker joins again.
        stack
            .set_worker_config(m.id, &base)
            .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
        stack
            .restart(m.id)
            .unwrap_or_else(|e| panic!("{} with a fitting config: {}", m.id, error_chain(&e)));
        eprintln!("{}: refused with exit 2: {line}", m.what);
    }
    // Refitted, both serve again.
    let before = [served(stack, "prefill-1"), served(stack, "decode-1")];
    let grew = (0..5).any(|_| {
        serve_many(stack, &model, 4, "a request once every worker fits");
        served(stack, "prefill-1") > before[0] && served(stack, "decode-1") > before[1]
    });
    assert!(
        grew,
        "prefill-1 and decode-1 did not serve again once they fit"
    );
    wait_all_free(stack, &ids, Duration::from_secs(5));
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}

// ---- admission_queue = 0 -------------------------------------------------------------------

/// Tiny pools that each hold exactly one request of the largest size, no admission queue,
/// and an admission wait long enough that a queued request would be seen waiting.
fn no_queue(c: &mut Config) {
    c.limits.max_context = 256;
    c.limits.max_new_tokens = 256;
    c.prefill.pool_pages = 16;
    c.decode.pool_pages = 32;
    c.control.admission_queue = 0;
    c.deadlines.admission_wait = 5000;
    c.deadlines.bootstrap = 5000;
    c.deadlines.request = 15_000;
}

/// Fails unless `r` is `PoolFull` for want of room with no queue, answered within `took`
/// well under the admission wait.
fn assert_refused_at_once(r: &Result<GenerateOutcome, ClientError>, took: Duration, what: &str) {
    match r {
        Err(ClientError::Server {
            code: ErrorCode::PoolFull,
            message,
        }) => assert!(
            message.contains("admission_queue = 0"),
            "{what}: PoolFull for another reason: {message}"
        ),
        Err(e) => panic!("{what}: expected PoolFull, got {}", error_chain(e)),
        Ok(out) => panic!("{what}: expected PoolFull, it was served by {}", out.pair),
    }
    assert!(
        took < Duration::from_millis(1500),
        "{what}: refused after {took:?}, not at once (admission_wait is 5 s)"
    );
}

#[test]
fn with_admission_queue_0_what_fits_is_served_and_what_must_wait_is_refused_at_once() {
    let begun = Instant::now();
    let mut run = start_stack("kvnoq.", 2, 2, no_queue);
    let stack = &mut run.stack;
    let model = model(stack);
    let ids = all_worker_ids(stack);
    let (context, new) = (256usize, 256u32);
    let queued = |stack: &Stack| counter(&stack.status().expect("status"), "queued").unwrap_or(0);

    // Idle: requests that fit are served, the largest one included. (Each waits for every
    // page to be back first: kvctld lends pages again only on the workers' Freed.)
    for (i, (len, max_new)) in [(20, 4), (200, 64), (context, new), (context, new)]
        .into_iter()
        .enumerate()
    {
        wait_all_free(stack, &ids, Duration::from_secs(5));
        let p = prompt("fits", i, len);
        serve_one(
            stack,
            &model,
            &p,
            max_new,
            &format!("{len} + {max_new} on an idle stack"),
        );
    }
    wait_all_free(stack, &ids, Duration::from_secs(5));
    serve_many(
        stack,
        &model,
        2,
        "two small requests at once on an idle stack",
    );
    wait_all_free(stack, &ids, Duration::from_secs(5));

    // Every pool taken: each decode worker is stopped while it holds one request of the
    // largest size (kvctld lent both ledgers at admission, all 16 + 32 pages of the pair).
    for d in stack.worker_ids(Role::Decode) {
        stack.signal(&d, Signal::SIGSTOP).expect("SIGSTOP");
    }
    let refused_before = counter(&stack.status().expect("status"), "refused_full").unwrap_or(0);
    let held: Vec<Result<GenerateOutcome, ClientError>> = thread::scope(|s| {
        let stack = &*stack;
        let handles: Vec<_> = (0..2)
            .map(|i| {
                s.spawn(move || {
                    let p = prompt("holder", i, context);
                    stack.client().expect("client").generate(
                        "holder",
                        &libkv::model::tokenize(&p),
                        new,
                        DEADLINE_MS,
                        |_| {},
                    )
                })
            })
            .collect();
        let full = wait_until(Duration::from_secs(5), || {
            let s = stack.status().ok()?;
            s.workers
                .iter()
                .filter(|w| w.connected)
                .all(|w| w.in_flight == 1 && w.held_pages == w.pool_pages)
                .then_some(())
        });
        let outcome = || {
            assert!(
                full.is_some(),
                "the two requests did not take every pool: {:#?}",
                stack.status().map(|s| s.workers)
            );
            for (i, (len, max_new)) in [(context, new), (16, 1)].into_iter().enumerate() {
                let p = prompt("waiter", i, len);
                let start = Instant::now();
                let r = stack.client().expect("client").generate(
                    "waiter",
                    &libkv::model::tokenize(&p),
                    max_new,
                    DEADLINE_MS,
                    |_| {},
                );
                let what = format!("{len} + {max_new} with every pool taken");
                assert_refused_at_once(&r, start.elapsed(), &what);
            }
        };
        // Whatever happened, let the decode workers run again.
        let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(outcome));
        for d in stack.worker_ids(Role::Decode) {
            let _ = nix::sys::signal::kill(stack.pid(&d).expect("decode pid"), Signal::SIGCONT);
        }
        if let Err(panic) = checked {
            std::panic::resume_unwind(panic);
        }
        handles
            .into_iter()
            .map(|h| h.join().expect("holder"))
            .collect()
    });
    for (i, r) in held.iter().enumerate() {
        let p = prompt("holder", i, context);
        let out = r
            .as_ref()
            .unwrap_or_else(|e| panic!("a request that held a pool: {}", error_chain(e)));
        assert_matches(
            out,
            &expected(&model, &p, new),
            "a request that held a pool",
        );
    }
    let s = stack.status().expect("status");
    assert_eq!(
        counter(&s, "refused_full").unwrap_or(0),
        refused_before + 2,
        "kvctld's refused_full"
    );

    // Many requests at once, each of the largest size: two fit at a time, the others are
    // refused at once; none is queued.
    let threads = 8;
    let rounds = 4;
    let barrier = Barrier::new(threads);
    let refused_before = counter(&s, "refused_full").unwrap_or(0);
    let results: Vec<(usize, Result<GenerateOutcome, ClientError>, Duration)> =
        thread::scope(|s| {
            let (stack, barrier) = (&*stack, &barrier);
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    s.spawn(move || {
                        (0..rounds)
                            .map(|r| {
                                let i = t * rounds + r;
                                let p = prompt("crowd", i, context);
                                let mut client = stack.client().expect("client");
                                barrier.wait();
                                let start = Instant::now();
                                let res = client.generate(
                                    "crowd",
                                    &libkv::model::tokenize(&p),
                                    new,
                                    DEADLINE_MS,
                                    |_| {},
                                );
                                (i, res, start.elapsed())
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().expect("crowd"))
                .collect()
        });
    let (mut ok, mut full) = (0u64, 0u64);
    for (i, r, took) in &results {
        let what = format!("crowd request {i}");
        match r {
            Ok(out) => {
                ok += 1;
                assert_matches(
                    out,
                    &expected(&model, &prompt("crowd", *i, context), new),
                    &what,
                );
            }
            Err(_) => {
                full += 1;
                assert_refused_at_once(r, *took, &what);
            }
        }
    }
    assert!(
        ok > 0 && full > 0,
        "{ok} served and {full} refused of the crowd"
    );
    let s = stack.status().expect("status");
    assert_eq!(
        counter(&s, "refused_full").unwrap_or(0),
        refused_before + full,
        "kvctld's refused_full against the PoolFull answers"
    );
    assert_eq!(
        queued(stack),
        0,
        "kvctld queued requests with admission_queue = 0"
    );
    eprintln!(
        "admission_queue = 0: of {} requests at once, {ok} served, {full} refused",
        results.len()
    );
    wait_all_free(stack, &ids, Duration::from_secs(5));
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}

// ---- drain ---------------------------------------------------------------------------------

/// Many new tokens: the time of a request goes to decode.
fn decode_heavy(t: usize, n: usize) -> (&'static str, Vec<u8>, u32) {
    let tenant = ["acme", "globex", "initech", "umbrella"][t % 4];
    let len = 800 + (t * 389 + n * 613) % 2400;
    let max_new = 128 + u32::try_from((t * 31 + n * 17) % 128).expect("small");
    (tenant, prompt(tenant, t * 1000 + n, len), max_new)
}

/// Large prompts and few new tokens: the time of a request goes to prefill and transfer.
fn transfer_heavy(t: usize, n: usize) -> (&'static str, Vec<u8>, u32) {
    let tenant = ["acme", "globex", "initech", "umbrella"][t % 4];
    let len = 2000 + (t * 389 + n * 613) % 2000;
    let max_new = 1 + u32::try_from((t + n) % 16).expect("small");
    (tenant, prompt(tenant, t * 1000 + n, len), max_new)
}

#[test]
fn sigterm_drains_a_decode_worker_under_load() {
    sigterm_drains_one_worker_under_load("decode-1", decode_heavy);
}

#[test]
fn sigterm_drains_a_prefill_worker_under_load() {
    sigterm_drains_one_worker_under_load("prefill-1", transfer_heavy);
}

/// Most SIGTERMs tried before one lands while requests are in flight on the worker.
const DRAIN_ROUNDS: usize = 3;

fn sigterm_drains_one_worker_under_load(victim: &str, job: Job) {
    let begun = Instant::now();
    let mut run = start_stack("kvdrain.", 2, 2, |c| {
        c.prefill.pool_pages = 2048;
        c.decode.pool_pages = 2048;
        c.deadlines.admission_wait = 5000;
        c.deadlines.bootstrap = 3000;
        c.deadlines.transfer = 3000;
        c.deadlines.request = 15_000;
    });
    let stack = &mut run.stack;
    let model = model(stack);
    let ids = all_worker_ids(stack);
    let survivors: Vec<String> = ids.iter().filter(|id| *id != victim).cloned().collect();
    let drain_timeout = stack.config().deadlines.drain();
    let socket = stack.socket().to_path_buf();

    // Each round: wait until requests are in flight on the victim, SIGTERM it, note when
    // kvctld first shows it drained, and wait for its exit; stop once some request was in
    // flight on it across the SIGTERM, else start it again and retry.
    let (rounds, attempts) = under_load(&socket, 8, 400, DEADLINE_MS, job, |attempts| {
        let mut rounds: Vec<Round> = Vec::new();
        let warm = wait_until(Duration::from_secs(20), || {
            let a = attempts.lock().expect("attempts");
            (a.iter().filter(|a| a.result.is_ok()).count() >= 8).then_some(())
        });
        assert!(warm.is_some(), "the load did not get going within 20 s");
        for round in 0..DRAIN_ROUNDS {
            if let Some(last) = rounds.last_mut() {
                last.back = Some(Instant::now());
                stack
                    .restart(victim)
                    .unwrap_or_else(|e| panic!("restarting {victim}: {}", error_chain(&e)));
            }
            let busy = wait_until(Duration::from_secs(10), || {
                let s = stack.status().ok()?;
                find_worker(&s, victim)
                    .is_some_and(|w| w.connected && !w.drain && w.in_flight >= 2)
                    .then_some(())
            });
            assert!(
                busy.is_some(),
                "no requests in flight on {victim} within 10 s"
            );
            let termed = Instant::now();
            stack.signal(victim, Signal::SIGTERM).expect("SIGTERM");
            // Drained: kvctld shows it drained, or already gone.
            let seen = wait_until(Duration::from_secs(5), || {
                let s = stack.status().ok()?;
                find_worker(&s, victim)
                    .is_none_or(|w| w.drain || !w.connected)
                    .then(Instant::now)
            })
            .unwrap_or_else(|| panic!("kvctld did not show {victim} drained within 5 s"));
            let status = stack
                .wait_exit(victim, drain_timeout + Duration::from_secs(3))
                .expect("waiting for the exit")
                .unwrap_or_else(|| panic!("{victim} did not exit after SIGTERM"));
            let exited = Instant::now();
            assert_eq!(
                status.code(),
                Some(0),
                "{victim} exited with {status} after SIGTERM, expected 0"
            );
            rounds.push(Round {
                termed,
                seen,
                exited,
                back: None,
            });
            let across = attempts.lock().expect("attempts").iter().any(|a| {
                a.started < termed
                    && a.ended > termed
                    && a.result.as_ref().is_ok_and(|o| on(o, victim))
            });
            if across {
                break;
            }
            eprintln!("round {round}: no request of {victim} was in flight at its SIGTERM");
        }
        // The load runs on a while without it.
        thread::sleep(Duration::from_millis(300));
        rounds
    });

    let mut across = 0;
    for a in &attempts {
        let what = a.what();
        let out = a
            .result
            .as_ref()
            .unwrap_or_else(|e| panic!("{what} failed while {victim} drained: {}", error_chain(e)));
        assert_matches(out, &expected(&model, &a.prompt, a.max_new), &what);
        for r in &rounds {
            if a.started < r.termed && a.ended > r.termed && on(out, victim) {
                across += 1;
            }
            // Sent once kvctld showed it drained and before it was started again.
            if a.started > r.seen && r.back.is_none_or(|back| a.started < back) {
                assert!(
                    !on(out, victim),
                    "{what}: sent after kvctld showed {victim} drained, served by {}",
                    out.pair
                );
            }
        }
    }
    assert!(
        across > 0,
        "no request of {victim} was in flight at its SIGTERM"
    );
    let log = stack.log(victim);
    let drained_stops = log.matches("kvctld drained this worker: stopping").count();
    assert_eq!(
        drained_stops,
        rounds.len(),
        "{victim} did not stop each time because it was drained and idle:\n{log}"
    );
    assert!(
        !log.contains("no DrainReply within"),
        "{victim} stopped on its drain deadline, not once idle:\n{log}"
    );
    let last = rounds.last().expect("a round");
    eprintln!(
        "{victim}: SIGTERM under load ({} round(s)), seen drained after {:?}, exited 0 after \
         {:?}; {across} of its requests finished across the SIGTERM; {} requests, all served",
        rounds.len(),
        last.seen - last.termed,
        last.exited - last.termed,
        attempts.len()
    );
    let s = wait_all_free(stack, &survivors, Duration::from_secs(10));
    assert!(
        find_worker(&s, victim).is_none_or(|w| !w.connected),
        "{victim} is listed as connected after it exited"
    );
    // Started again, it is not drained (it drained itself only to stop) and serves.
    stack
        .restart(victim)
        .unwrap_or_else(|e| panic!("restarting {victim}: {}", error_chain(&e)));
    serves_again(stack, &model, victim);
    wait_all_free(stack, &ids, Duration::from_secs(10));
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}

/// One SIGTERM of the drain test.
struct Round {
    /// When the SIGTERM was sent.
    termed: Instant,
    /// When kvctld's status first showed the worker drained (or gone).
    seen: Instant,
    /// When the worker's exit was reaped.
    exited: Instant,
    /// When it was started again, if it was.
    back: Option<Instant>,
}

/// Whether worker `id` served the request.
fn on(out: &GenerateOutcome, id: &str) -> bool {
    out.pair.prefill == id || out.pair.decode == id
}

#[test]
fn kvctl_drain_keeps_new_requests_off_a_worker_and_undrain_brings_it_back() {
    let begun = Instant::now();
    let mut run = start_stack("kvundrain.", 2, 2, |_| {});
    let stack = &mut run.stack;
    let model = model(stack);
    let ids = all_worker_ids(stack);
    let drained = ["prefill-1", "decode-0"];
    let mut admin = stack.client().expect("client");
    for id in drained {
        let w = admin
            .drain(id, true)
            .unwrap_or_else(|e| panic!("draining {id}: {}", error_chain(&e)));
        assert!(
            w.drain && w.connected && w.idle(),
            "{id} after drain: {w:?}"
        );
    }
    match admin.drain("decode-7", true) {
        Err(ClientError::Server {
            code: ErrorCode::BadRequest,
            message,
        }) => assert!(message.contains("decode-7"), "{message}"),
        other => panic!("draining an unknown worker: {other:?}"),
    }
    let before: Vec<u64> = ids.iter().map(|id| served(stack, id)).collect();
    let outs = serve_many(stack, &model, 16, "a request with two workers drained");
    for out in &outs {
        assert!(
            drained.iter().all(|id| !on(out, id)),
            "served by a drained worker: {}",
            out.pair
        );
    }
    let s = stack.status().expect("status");
    for (id, b) in ids.iter().zip(&before) {
        let w = find_worker(&s, id).expect("listed");
        if drained.contains(&id.as_str()) {
            assert_eq!(w.served, *b, "{id} served while drained");
            assert!(w.drain && w.connected, "{id} while drained: {w:?}");
        } else {
            assert_eq!(w.served, b + 16, "{id} served all the requests");
        }
    }
    for id in drained {
        let w = admin
            .drain(id, false)
            .unwrap_or_else(|e| panic!("undraining {id}: {}", error_chain(&e)));
        assert!(!w.drain && w.connected, "{id} after undrain: {w:?}");
    }
    let back = (0..5).any(|_| {
        serve_many(stack, &model, 4, "a request once undrained");
        drained.iter().all(|id| served(stack, id) > 0)
    });
    assert!(back, "{drained:?} served nothing once undrained");
    wait_all_free(stack, &ids, Duration::from_secs(5));
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}

/// Runs kvctl against the stack's socket and returns its exit code and output.
fn kvctl(stack: &Stack, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(bin_dir().join("kvctl"))
        .arg("--socket")
        .arg(stack.socket())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running kvctl");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

#[test]
fn drain_wait_fails_when_the_worker_is_lost_before_it_is_idle() {
    let begun = Instant::now();
    let victim = "decode-1";
    let mut run = start_stack("kvdrainlost.", 1, 2, |c| {
        c.deadlines.request = 20_000;
    });
    let stack = &mut run.stack;
    let socket = stack.socket().to_path_buf();
    let ((code, text, in_flight, json), attempts) =
        under_load(&socket, 6, 400, 20_000, decode_heavy, |attempts| {
            let warm = wait_until(Duration::from_secs(20), || {
                let a = attempts.lock().expect("attempts");
                (a.iter().filter(|a| a.result.is_ok()).count() >= 4).then_some(())
            });
            assert!(warm.is_some(), "the load did not get going within 20 s");
            // Stopped while requests are on it, the victim holds them until it is killed.
            let mut in_flight = 0;
            for _ in 0..20 {
                let busy = wait_until(Duration::from_secs(10), || {
                    let s = stack.status().ok()?;
                    find_worker(&s, victim)
                        .is_some_and(|w| w.connected && w.in_flight >= 1)
                        .then_some(())
                });
                assert!(
                    busy.is_some(),
                    "no request in flight on {victim} within 10 s"
                );
                stack.signal(victim, Signal::SIGSTOP).expect("SIGSTOP");
                let s = stack.status().expect("status");
                in_flight = find_worker(&s, victim).map_or(0, |w| w.in_flight);
                if in_flight >= 1 {
                    break;
                }
                stack.signal(victim, Signal::SIGCONT).expect("SIGCONT");
            }
            assert!(
                in_flight >= 1,
                "{victim} was never stopped with a request on it"
            );
            let mut drain = Command::new(bin_dir().join("kvctl"))
                .arg("--socket")
                .arg(stack.socket())
                .args(["drain", victim, "--wait", "--timeout-ms", "30000"])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("running kvctl drain");
            let drained = wait_until(Duration::from_secs(10), || {
                let s = stack.status().ok()?;
                find_worker(&s, victim)
                    .is_some_and(|w| w.drain)
                    .then_some(())
            });
            assert!(drained.is_some(), "kvctld did not show {victim} drained");
            // kvctl is waiting; nothing on the stopped victim can finish.
            thread::sleep(Duration::from_millis(300));
            assert!(
                drain.try_wait().expect("kvctl").is_none(),
                "kvctl drain --wait ended while {victim} was stopped with requests on it"
            );
            stack.kill(victim).expect("SIGKILL");
            let status = kvfence_tests::ops::wait_exit(&mut drain, Duration::from_secs(10));
            let _ = drain.kill();
            let mut text = String::new();
            for pipe in [
                drain.stdout.take().map(|p| Box::new(p) as Box<dyn Read>),
                drain.stderr.take().map(|p| Box::new(p) as Box<dyn Read>),
            ]
            .into_iter()
            .flatten()
            {
                let mut p = pipe;
                p.read_to_string(&mut text).expect("kvctl output");
            }
            let status = status.unwrap_or_else(|| {
                panic!("kvctl drain --wait did not end 10 s after {victim} was killed: {text}")
            });
            let (_, json) = kvctl(stack, &["--json", "status"]);
            (status.code(), text, in_flight, json)
        });
    // The clients' side of the loss.
    let lost_msg = format!("the decode worker {victim} was lost");
    let failed_lost = attempts
        .iter()
        .filter(|a| {
            matches!(&a.result, Err(ClientError::Server { code: ErrorCode::WorkerLost, message })
                if message.contains(&lost_msg))
        })
        .count();
    assert!(
        failed_lost >= 1,
        "no client saw a request fail with WorkerLost for {victim}; kvctl said: {text}"
    );
    assert_eq!(
        code,
        Some(5),
        "kvctl drain --wait after {victim} was killed with {in_flight} request(s) on it: {text}"
    );
    assert!(
        !text.contains("safe to stop"),
        "kvctl called a killed worker safe to stop: {text}"
    );
    assert!(
        text.contains(&format!("{victim} was lost while draining"))
            && text.contains(&format!("{failed_lost} requests in flight on it failed")),
        "kvctl did not name the loss and the {failed_lost} failed request(s): {text}"
    );
    let v: serde_json::Value = serde_json::from_str(json.trim()).expect("status --json");
    let w = v["workers"]
        .as_array()
        .and_then(|ws| ws.iter().find(|w| w["id"] == victim))
        .unwrap_or_else(|| panic!("status --json does not list {victim}: {json}"));
    assert_eq!(w["connected"], false, "{w}");
    assert_eq!(
        w["safe_to_stop"], false,
        "a lost worker listed safe to stop: {w}"
    );
    assert_eq!(
        w["counters"]["failed_when_lost"],
        serde_json::json!(failed_lost),
        "{w}"
    );
    // Started again it stays drained (the operator's drain) until undrained, then serves.
    stack.restart(victim).expect("restart");
    let (code, text) = kvctl(stack, &["undrain", victim]);
    assert_eq!(code, Some(0), "{text}");
    serves_again(stack, &model(stack), victim);
    wait_all_free(stack, &all_worker_ids(stack), Duration::from_secs(10));
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}
