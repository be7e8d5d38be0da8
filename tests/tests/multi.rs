//! Many prefill and many decode workers under one kvctld (xPyD), end to end on the real
//! daemons: 2 + 2 and 3 + 2 workers, over shared memory and over TCP on loopback.
//!
//! 96 concurrent requests of 8 tenants all equal the monolithic path (tokens and signature,
//! pages and bytes transferred), every worker serves some of them (kvctld's `served` and the
//! worker's own counters: prefilld's `prefill_runs`, decoded's `pulls` and `pages_pulled`,
//! and over TCP prefilld's `pages_served`), pages cross pairs (with 3 + 2 some request must
//! be served by a pair other than `(prefill-i, decode-i)`), every page is free again after
//! the load, and then each of the `P x D` pairs is shown to move pages, whichever the load
//! used, by keeping the other workers drained (`kvctl drain`) for one request on it.
//!
//! The binaries come from this test's target directory: `cargo build --release --bins`
//! first for `cargo test --release`. Every wait is bounded, every client has a deadline, and
//! the daemons are killed when a test ends, passing or not.

use kvctld::client::{GenerateOutcome, ServingPair};
use kvctld::stack::{Stack, error_chain};
use kvfence_tests::{
    all_worker_ids, assert_matches, counter, expected, model, prompt, start_stack, tcp,
    wait_all_free, worker_counter,
};
use libkv::config::Config;
use libkv::proto::{Role, Transport};
use std::collections::BTreeSet;
use std::thread;
use std::time::{Duration, Instant};

/// Longest any test here may take, start to finish.
const TEST_BOUND: Duration = Duration::from_secs(45);
/// Requests of the concurrent load.
const REQUESTS: usize = 96;
/// Tenants the load's requests belong to, 12 requests each.
const TENANTS: [&str; 8] = [
    "acme", "globex", "initech", "umbrella", "hooli", "stark", "wayne", "tyrell",
];
/// Deadline of each request.
const DEADLINE_MS: u32 = 20_000;

/// Deadlines for 96 requests at once on a small, shared machine: the load queues for pool
/// room (up to `admission_wait`), and the workers' event loops take their turn on the CPUs.
fn roomy_deadlines(config: &mut Config) {
    config.deadlines.admission_wait = 15_000;
    config.deadlines.bootstrap = 5000;
    config.deadlines.transfer = 5000;
    config.deadlines.decode = 15_000;
    config.deadlines.request = DEADLINE_MS;
}

#[test]
fn two_prefill_two_decode_over_shared_memory_equal_the_monolithic_path() {
    many_workers_equal_the_monolithic_path(2, 2, Transport::Shm);
}

#[test]
fn three_prefill_two_decode_over_shared_memory_equal_the_monolithic_path() {
    many_workers_equal_the_monolithic_path(3, 2, Transport::Shm);
}

#[test]
fn two_prefill_two_decode_over_tcp_equal_the_monolithic_path() {
    many_workers_equal_the_monolithic_path(2, 2, Transport::Tcp);
}

#[test]
fn three_prefill_two_decode_over_tcp_equal_the_monolithic_path() {
    many_workers_equal_the_monolithic_path(3, 2, Transport::Tcp);
}

/// The `i`-th request of the load: its tenant, prompt and new tokens. Prompts go from a few
/// tokens to 1,900 (up to 119 pages), so some transfers take several milliseconds.
fn job(i: usize) -> (&'static str, Vec<u8>, u32) {
    let tenant = TENANTS[i % TENANTS.len()];
    let len = 12 + (i * 197) % 1900;
    let max_new = 1 + u32::try_from((i * 29) % 96).expect("small");
    (tenant, prompt(tenant, i, len), max_new)
}

fn many_workers_equal_the_monolithic_path(prefill: usize, decode: usize, transport: Transport) {
    let begun = Instant::now();
    let run = start_stack("kvmulti.", prefill, decode, |c| {
        roomy_deadlines(c);
        if transport == Transport::Tcp {
            tcp(c);
        }
    });
    let stack = &run.stack;
    let model = model(stack);
    let geometry = stack.config().geometry;
    let prefill_ids = stack.worker_ids(Role::Prefill);
    let decode_ids = stack.worker_ids(Role::Decode);
    let ids = all_worker_ids(stack);
    assert_eq!((prefill_ids.len(), decode_ids.len()), (prefill, decode));

    let jobs: Vec<(&str, Vec<u8>, u32)> = (0..REQUESTS).map(job).collect();
    let results: Vec<_> = thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|(tenant, prompt, max_new)| {
                s.spawn(move || {
                    let mut client = stack.client()?;
                    client.generate(
                        tenant,
                        &libkv::model::tokenize(prompt),
                        *max_new,
                        DEADLINE_MS,
                        |_| {},
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("request thread"))
            .collect()
    });
    let mut outs: Vec<&GenerateOutcome> = Vec::new();
    for (i, ((tenant, prompt, max_new), result)) in jobs.iter().zip(&results).enumerate() {
        let what = format!(
            "request {i} of {tenant} ({} tokens + {max_new})",
            prompt.len()
        );
        let out = result
            .as_ref()
            .unwrap_or_else(|e| panic!("{what} failed: {}", error_chain(e)));
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
        assert!(
            prefill_ids.contains(&out.pair.prefill) && decode_ids.contains(&out.pair.decode),
            "{what}: served by {}, not a worker of the stack",
            out.pair
        );
        outs.push(out);
    }
    let unique: BTreeSet<_> = outs.iter().map(|o| o.request).collect();
    assert_eq!(unique.len(), REQUESTS, "request ids are not unique");

    // Every worker served some of the load, by kvctld's count and by its own counters.
    let s = wait_all_free(stack, &ids, Duration::from_secs(10));
    let by_prefill = |id: &str| outs.iter().filter(|o| o.pair.prefill == id).count() as u64;
    let by_decode = |id: &str| outs.iter().filter(|o| o.pair.decode == id).count() as u64;
    for id in &prefill_ids {
        let w = kvctld::stack::find_worker(&s, id).expect("listed");
        let runs = worker_counter(&s, id, "prefill_runs").unwrap_or(0);
        let served_pages = worker_counter(&s, id, "pages_served").unwrap_or(0);
        assert!(
            w.served > 0 && w.served == by_prefill(id) && runs >= w.served,
            "{id}: served {} (the outcomes name it {} times), {runs} prefill runs",
            w.served,
            by_prefill(id)
        );
        match transport {
            Transport::Tcp => assert!(served_pages > 0, "{id}: no page served over TCP"),
            _ => assert_eq!(served_pages, 0, "{id}: pages served over TCP on shm"),
        }
    }
    for id in &decode_ids {
        let w = kvctld::stack::find_worker(&s, id).expect("listed");
        let pulls = worker_counter(&s, id, "pulls").unwrap_or(0);
        let pulled = worker_counter(&s, id, "pages_pulled").unwrap_or(0);
        assert!(
            w.served > 0 && w.served == by_decode(id) && pulls >= w.served && pulled > 0,
            "{id}: served {} (the outcomes name it {} times), {pulls} pulls, {pulled} pages",
            w.served,
            by_decode(id)
        );
    }
    assert_eq!(s.transport, Some(transport), "the transport kvctld reports");
    // kvctld counts every page moved under the transport of its pair, and only there.
    let moved = counter(&s, "pages_transferred").unwrap_or(0);
    let by = |t: &str| counter(&s, &format!("pages_transferred_{t}")).unwrap_or(u64::MAX);
    let (here, others) = match transport {
        Transport::Tcp => ("tcp", ["shm", "rdma"]),
        _ => ("shm", ["tcp", "rdma"]),
    };
    assert!(
        moved > 0 && by(here) == moved,
        "{here}: {} of {moved} pages",
        by(here)
    );
    for t in others {
        assert_eq!(by(t), 0, "pages counted under {t} over {transport:?}");
    }
    assert_eq!(
        counter(&s, "completed").unwrap_or(0),
        REQUESTS as u64,
        "kvctld's completed count"
    );
    let pairs: BTreeSet<ServingPair> = outs.iter().map(|o| o.pair.clone()).collect();
    let crossed: Vec<&ServingPair> = pairs
        .iter()
        .filter(|p| p.prefill.strip_prefix("prefill-") != p.decode.strip_prefix("decode-"))
        .collect();
    if prefill > decode {
        assert!(
            !crossed.is_empty(),
            "with {prefill} + {decode} workers every request stayed on (prefill-i, decode-i): \
             {pairs:?}"
        );
    }
    eprintln!(
        "{prefill} + {decode} over {transport:?}: {REQUESTS} requests equal the monolithic \
         path in {:?}; pairs of the load: {}",
        begun.elapsed(),
        pairs
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );

    // Every pair moves pages, whichever the load happened to use: each is forced by
    // draining the other workers for one request.
    for p in &prefill_ids {
        for d in &decode_ids {
            let pair = ServingPair {
                prefill: p.clone(),
                decode: d.clone(),
            };
            one_request_on(stack, &pair, &ids);
        }
    }
    wait_all_free(stack, &ids, Duration::from_secs(10));
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}

/// Drains every worker but the two of `pair`, runs one request and checks that `pair`
/// served it and that it equals the monolithic path, then undrains them.
fn one_request_on(stack: &Stack, pair: &ServingPair, ids: &[String]) {
    let mut admin = stack.client().expect("client");
    let others: Vec<&String> = ids
        .iter()
        .filter(|id| **id != pair.prefill && **id != pair.decode)
        .collect();
    for id in &others {
        let w = admin
            .drain(id, true)
            .unwrap_or_else(|e| panic!("draining {id}: {}", error_chain(&e)));
        assert!(w.drain, "{id} not drained: {w:?}");
    }
    let p = prompt("pairs", ids.len(), 700);
    let out = stack
        .client()
        .expect("client")
        .generate(
            "pairs",
            &libkv::model::tokenize(&p),
            24,
            DEADLINE_MS,
            |_| {},
        )
        .unwrap_or_else(|e| panic!("request for the pair {pair}: {}", error_chain(&e)));
    assert_eq!(
        &out.pair, pair,
        "the request was not served by the only pair left"
    );
    assert_matches(
        &out,
        &expected(&model(stack), &p, 24),
        &format!("request on {pair}"),
    );
    for id in &others {
        let w = admin
            .drain(id, false)
            .unwrap_or_else(|e| panic!("undraining {id}: {}", error_chain(&e)));
        assert!(!w.drain, "{id} still drained: {w:?}");
    }
}
