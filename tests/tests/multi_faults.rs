//! Losing one worker of many (2 prefill + 2 decode under one kvctld), on the real daemons.
//!
//! Under a continuous load from several threads (bounded in requests and time), one worker
//! is killed with SIGKILL while requests are in flight on it: a prefill worker mid-transfer
//! (large prompts, so pulls take milliseconds; over shared memory and over TCP), and
//! separately a decode worker mid-decode (many new tokens). Then:
//!
//! - only requests on that worker fail, each with `WorkerLost` naming it (over TCP the
//!   decode worker may see the page server go first and name its address), each within
//!   its deadline, and only requests that were in flight at the kill or reached kvctld
//!   before it saw the loss;
//! - every request that succeeds equals the monolithic path, and requests keep succeeding
//!   on the other workers after the kill;
//! - no page leaks: every surviving worker reports all its pages free, kvctld lends none
//!   and has no request in flight (waited for, not read once);
//! - the worker restarted under its id rejoins and serves again (kvctld's `served` and its
//!   own counters grow from zero), and then every worker is all free again.
//!
//! A prefill worker lost while idle is listed as disconnected, requests go to the other
//! one meanwhile, and once restarted it serves again under the same id.
//!
//! The binaries come from this test's target directory: `cargo build --release --bins`
//! first for `cargo test --release`.

use kvctld::client::ClientError;
use kvctld::stack::{Stack, error_chain, find_worker, wait_until, worker_id_connected};
use kvfence_tests::{
    Job, all_worker_ids, assert_matches, expected, model, prompt, serves_again, start_stack, tcp,
    under_load, wait_all_free,
};
use libkv::config::Config;
use libkv::model::ReferenceModel;
use libkv::proto::{ErrorCode, Role};
use std::thread;
use std::time::{Duration, Instant};

/// Longest any test here may take, start to finish.
const TEST_BOUND: Duration = Duration::from_secs(50);
/// Threads of the load, each with one request at a time.
const LOAD_THREADS: usize = 8;
/// Most requests one load thread sends.
const PER_THREAD: usize = 400;
/// Deadline of each load request.
const DEADLINE_MS: u32 = 8000;
/// Most kills tried before one lands while requests are in flight on the worker.
const KILL_ROUNDS: usize = 3;
/// How long the load runs on after a kill, so that requests meet the worker's absence.
const AFTER_KILL: Duration = Duration::from_millis(600);

/// Pools that hold every request of the load on the workers left after a kill, and
/// deadlines that let a request wait for room instead of failing while the CPUs are busy.
fn roomy(config: &mut Config) {
    config.prefill.pool_pages = 2048;
    config.decode.pool_pages = 2048;
    config.deadlines.admission_wait = 5000;
    config.deadlines.bootstrap = 3000;
    config.deadlines.transfer = 3000;
    config.deadlines.request = 15_000;
}

/// Large prompts and few new tokens: the time of a request goes to prefill and transfer.
fn transfer_heavy(t: usize, n: usize) -> (&'static str, Vec<u8>, u32) {
    let tenant = ["acme", "globex", "initech", "umbrella"][t % 4];
    let len = 2000 + (t * 389 + n * 613) % 2000;
    let max_new = 1 + u32::try_from((t + n) % 16).expect("small");
    (tenant, prompt(tenant, t * 1000 + n, len), max_new)
}

/// Many new tokens: the time of a request goes to decode.
fn decode_heavy(t: usize, n: usize) -> (&'static str, Vec<u8>, u32) {
    let tenant = ["acme", "globex", "initech", "umbrella"][t % 4];
    let len = 800 + (t * 389 + n * 613) % 2400;
    let max_new = 128 + u32::try_from((t * 31 + n * 17) % 128).expect("small");
    (tenant, prompt(tenant, t * 1000 + n, len), max_new)
}

#[test]
fn killing_one_prefill_worker_mid_transfer_fails_only_its_requests() {
    kill_one_worker_under_load("prefill-1", roomy, transfer_heavy);
}

#[test]
fn killing_one_prefill_worker_mid_transfer_over_tcp_fails_only_its_requests() {
    kill_one_worker_under_load(
        "prefill-1",
        |c| {
            roomy(c);
            tcp(c);
        },
        transfer_heavy,
    );
}

#[test]
fn killing_one_decode_worker_mid_decode_fails_only_its_requests() {
    kill_one_worker_under_load("decode-0", roomy, decode_heavy);
}

/// The addresses the prefill worker `id` served pages on, over all its starts (from its
/// log's "serving pages on ADDR" lines).
fn page_server_addrs(stack: &Stack, id: &str) -> Vec<String> {
    stack
        .log(id)
        .lines()
        .filter_map(|l| l.split("serving pages on ").nth(1))
        .map(|a| a.trim().to_owned())
        .collect()
}

fn kill_one_worker_under_load(victim: &str, tweak: fn(&mut Config), job: Job) {
    let begun = Instant::now();
    let mut run = start_stack("kvfault.", 2, 2, tweak);
    let stack = &mut run.stack;
    let model = model(stack);
    let ids = all_worker_ids(stack);
    let survivors: Vec<String> = ids.iter().filter(|id| *id != victim).cloned().collect();
    let socket = stack.socket().to_path_buf();
    let request_bound = Duration::from_millis(u64::from(DEADLINE_MS)) + Duration::from_millis(1500);

    // Each round: wait until requests are in flight on the victim, kill it, let the load
    // meet its absence, and stop once a kill failed some request (else restart it and try
    // again). `kills` holds when each kill was sent.
    let (kills, attempts) = under_load(
        &socket,
        LOAD_THREADS,
        PER_THREAD,
        DEADLINE_MS,
        job,
        |attempts| {
            let mut kills: Vec<Instant> = Vec::new();
            let warm = wait_until(Duration::from_secs(20), || {
                let ok = attempts
                    .lock()
                    .expect("attempts")
                    .iter()
                    .filter(|a| a.result.is_ok())
                    .count();
                (ok >= LOAD_THREADS).then_some(())
            });
            assert!(warm.is_some(), "the load did not get going within 20 s");
            for round in 0..KILL_ROUNDS {
                if round > 0 {
                    stack
                        .restart(victim)
                        .unwrap_or_else(|e| panic!("restarting {victim}: {}", error_chain(&e)));
                }
                let busy = wait_until(Duration::from_secs(10), || {
                    let s = stack.status().ok()?;
                    find_worker(&s, victim)
                        .is_some_and(|w| w.connected && w.in_flight >= 2)
                        .then_some(())
                });
                assert!(
                    busy.is_some(),
                    "no requests in flight on {victim} within 10 s"
                );
                kills.push(Instant::now());
                stack
                    .kill(victim)
                    .unwrap_or_else(|e| panic!("killing {victim}: {}", error_chain(&e)));
                thread::sleep(AFTER_KILL);
                let failed = attempts
                    .lock()
                    .expect("attempts")
                    .iter()
                    .any(|a| a.result.is_err());
                if failed {
                    break;
                }
                eprintln!("round {round}: the kill of {victim} failed no request; again");
            }
            kills
        },
    );

    // The victim's names in an error: its id, or over TCP its page server's addresses.
    let mut names = vec![victim.to_owned()];
    names.extend(page_server_addrs(stack, victim));
    let last_kill = *kills.last().expect("a kill");
    let (mut ok, mut failed, mut ok_after_kill) = (0usize, 0usize, 0usize);
    let mut messages = std::collections::BTreeSet::new();
    for a in &attempts {
        let what = a.what();
        let took = a.ended - a.started;
        assert!(
            took <= request_bound,
            "{what}: returned after {took:?}, past its deadline of {DEADLINE_MS} ms ({:?})",
            a.result.as_ref().err().map(|e| error_chain(e))
        );
        match &a.result {
            Ok(out) => {
                ok += 1;
                assert_matches(out, &expected(&model, &a.prompt, a.max_new), &what);
                if a.started > last_kill {
                    ok_after_kill += 1;
                    assert!(
                        out.pair.prefill != victim && out.pair.decode != victim,
                        "{what}: served by {} although {victim} was dead",
                        out.pair
                    );
                }
            }
            Err(ClientError::Server { code, message }) => {
                failed += 1;
                messages.insert(message.clone());
                assert_eq!(
                    *code,
                    ErrorCode::WorkerLost,
                    "{what}: failed with {code:?} ({message}), not WorkerLost"
                );
                assert!(
                    names.iter().any(|n| message.contains(n.as_str())),
                    "{what}: failed ({message}) without naming {victim} ({names:?})"
                );
                assert!(
                    kills
                        .iter()
                        .any(|k| a.started <= *k + AFTER_KILL && a.ended >= *k),
                    "{what}: failed ({message}) but was not in flight around a kill"
                );
            }
            Err(e) => panic!("{what}: failed without kvctld's answer: {}", error_chain(e)),
        }
    }
    assert!(
        failed > 0,
        "no request failed in {} kills of {victim}",
        kills.len()
    );
    assert!(
        ok_after_kill > 0,
        "no request succeeded on the other workers after {victim} was killed"
    );
    eprintln!(
        "{victim} killed {} time(s) under load: {ok} requests succeeded ({ok_after_kill} \
         after the last kill), {failed} failed with WorkerLost naming it: {messages:?}",
        kills.len()
    );

    // No page leaks on the survivors, with the victim still dead; then it rejoins.
    let s = wait_all_free(stack, &survivors, Duration::from_secs(10));
    assert!(
        find_worker(&s, victim).is_none_or(|w| !w.connected),
        "{victim} is listed as connected while dead"
    );
    stack
        .restart(victim)
        .unwrap_or_else(|e| panic!("restarting {victim}: {}", error_chain(&e)));
    serves_again(stack, &model, victim);
    wait_all_free(stack, &ids, Duration::from_secs(10));
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}

#[test]
fn a_prefill_worker_lost_while_idle_rejoins_under_its_id() {
    let begun = Instant::now();
    let mut run = start_stack("kvrejoin.", 2, 2, |_| {});
    let stack = &mut run.stack;
    let model = model(stack);
    let ids = all_worker_ids(stack);
    let victim = "prefill-1";
    // It serves before it is lost.
    serves_once_drained_of_others(stack, &model, victim);
    wait_all_free(stack, &ids, Duration::from_secs(5));

    stack
        .kill(victim)
        .unwrap_or_else(|e| panic!("killing {victim}: {}", error_chain(&e)));
    let s = stack
        .wait_status(&format!("{victim} to be seen disconnected"), |s| {
            find_worker(s, victim).is_some_and(|w| !w.connected)
        })
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    assert_eq!(
        find_worker(&s, victim).map(|w| w.role),
        Some(Role::Prefill),
        "{victim} is listed with another role"
    );
    // Meanwhile the other prefill worker serves every request.
    for i in 0..4 {
        let p = prompt("meanwhile", i, 200 + i * 300);
        let out = stack
            .client()
            .expect("client")
            .generate(
                "meanwhile",
                &libkv::model::tokenize(&p),
                16,
                DEADLINE_MS,
                |_| {},
            )
            .unwrap_or_else(|e| panic!("request while {victim} is lost: {}", error_chain(&e)));
        assert_eq!(
            out.pair.prefill, "prefill-0",
            "served while {victim} is lost"
        );
        assert_matches(
            &out,
            &expected(&model, &p, 16),
            "request while a worker is lost",
        );
    }

    stack
        .restart(victim)
        .unwrap_or_else(|e| panic!("restarting {victim}: {}", error_chain(&e)));
    assert!(
        worker_id_connected(&stack.status().expect("status"), victim),
        "{victim} not connected after its restart"
    );
    serves_again(stack, &model, victim);
    wait_all_free(stack, &ids, Duration::from_secs(5));
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}

/// One request with every other prefill worker drained, served by `id`.
fn serves_once_drained_of_others(stack: &Stack, model: &ReferenceModel, id: &str) {
    let mut admin = stack.client().expect("client");
    let others: Vec<String> = stack
        .worker_ids(Role::Prefill)
        .into_iter()
        .filter(|o| o != id)
        .collect();
    for o in &others {
        admin
            .drain(o, true)
            .unwrap_or_else(|e| panic!("draining {o}: {}", error_chain(&e)));
    }
    let p = prompt("before", 0, 500);
    let out = stack
        .client()
        .expect("client")
        .generate(
            "before",
            &libkv::model::tokenize(&p),
            16,
            DEADLINE_MS,
            |_| {},
        )
        .unwrap_or_else(|e| panic!("request on {id}: {}", error_chain(&e)));
    assert_eq!(out.pair.prefill, id, "served with the others drained");
    assert_matches(&out, &expected(model, &p, 16), "request before the loss");
    for o in &others {
        admin
            .drain(o, false)
            .unwrap_or_else(|e| panic!("undraining {o}: {}", error_chain(&e)));
    }
}
