//! Decode under load, end to end: decoded decodes up to `[decode] max_batch` requests
//! together, and kvctld assigns a decode worker no more requests at once than that; the
//! others wait in kvctld's admission queue for a slot, at most `deadlines.admission_wait`.
//!
//! - Eight concurrent requests on one decode worker of two slots (and pages for all eight):
//!   every one equals the monolithic path, `kvctl status` never shows more than two slots taken (sampled all
//!   along), requests did wait for slots and did decode two at a time, and every page is
//!   free afterwards.
//! - A request that cannot get a slot (the only one is held by a long decode) fails once
//!   `admission_wait` has passed, saying it waited for a decode slot (`PoolFull`, never a
//!   transfer timeout), and one whose own deadline is shorter fails at that deadline saying
//!   the same; neither holds a page, the long one is undisturbed, and every page comes back.
//!
//! The reference model has no knob to slow it down: a long decode is a long one, many new
//! tokens over a long context (each step reads every position). Every wait is bounded.

use kvctld::client::{Client, ClientError, GenerateOutcome};
use kvctld::stack::{Stack, error_chain, wait_until};
use kvfence_tests::{
    all_worker_ids, assert_matches, counter, expected, model, prompt, start_stack, wait_all_free,
    worker_counter,
};
use libkv::config::Config;
use libkv::model::tokenize;
use libkv::proto::{ErrorCode, Role};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// Longest any test here may take, start to finish.
const TEST_BOUND: Duration = Duration::from_secs(120);

/// Limits and pools for long decodes: `max_new` new tokens on up to 1,024 prompt tokens, the
/// decode pool room for `held` such requests at once.
fn long_decodes(c: &mut Config, max_new: u32, held: u32) {
    c.limits.max_context = 1024;
    c.limits.max_new_tokens = max_new;
    let per_request = c.geometry.pages_for_tokens(u64::from(1024 + max_new));
    c.decode.pool_pages = u32::try_from(per_request).expect("pages") * held;
    c.deadlines.decode = 60_000;
    c.deadlines.request = 90_000;
}

/// One request, on a connection of its own, waiting for its deadline (at most the stack's
/// request deadline); `on_first` runs at its first tokens.
fn generate(
    stack: &Stack,
    tenant: &str,
    prompt: &[u8],
    max_new: u32,
    deadline_ms: u32,
    on_first: impl FnOnce(),
) -> Result<GenerateOutcome, ClientError> {
    let mut client = Client::connect(stack.socket(), Duration::from_secs(5))?;
    client.set_default_deadline(stack.config().deadlines.request());
    let mut first = Some(on_first);
    client.generate(tenant, &tokenize(prompt), max_new, deadline_ms, |_| {
        if let Some(f) = first.take() {
            f();
        }
    })
}

/// What `kvctl --json status` said of the decode slots.
#[derive(Debug)]
struct Slots {
    /// kvctld's counters: every decode slot, and those taken.
    all: u64,
    used: u64,
    /// Each decode worker's (slots, taken).
    workers: Vec<(u64, u64)>,
    /// Requests waiting for admission.
    queued: u64,
}

/// `kvctl --json status`, as an operator reads it: the decode slots.
fn kvctl_slots(stack: &Stack) -> Option<Slots> {
    let out = std::process::Command::new(kvfence_tests::bin_dir().join("kvctl"))
        .arg("--config")
        .arg(stack.config_path())
        .args(["--json", "status"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    let c = &v["counters"];
    let workers = v["workers"]
        .as_array()?
        .iter()
        .filter(|w| w["role"] == "decode")
        .map(|w| Some((w["slots"].as_u64()?, w["slots_used"].as_u64()?)))
        .collect::<Option<Vec<_>>>()?;
    Some(Slots {
        all: c["decode_slots"].as_u64()?,
        used: c["decode_slots_used"].as_u64()?,
        workers,
        queued: c["queue_len"].as_u64()?,
    })
}

#[test]
fn eight_concurrent_requests_on_two_decode_slots_match_the_monolithic_path() {
    let begun = Instant::now();
    let max_new = 3000;
    let running = start_stack("kvbat.", 1, 1, |c| {
        c.decode.max_batch = Some(2);
        // Pages for all eight at once: only the slots hold them back.
        long_decodes(c, max_new, 8);
        c.deadlines.admission_wait = 60_000;
    });
    let stack = &running.stack;
    let model = model(stack);
    let done = AtomicBool::new(false);
    let samples = Mutex::new(Vec::new());
    let results = Mutex::new(Vec::new());
    thread::scope(|s| {
        let sampler = s.spawn(|| {
            // Until the load is over, at most 60 s: kvctl status, every 50 ms.
            let end = Instant::now() + Duration::from_secs(60);
            while !done.load(Ordering::Relaxed) && Instant::now() < end {
                if let Some(sample) = kvctl_slots(stack) {
                    samples.lock().unwrap().push(sample);
                }
                thread::sleep(Duration::from_millis(50));
            }
        });
        let clients: Vec<_> = (0..8)
            .map(|i| {
                let (model, results) = (&model, &results);
                s.spawn(move || {
                    let p = prompt("acme", i, 200 + 97 * i);
                    let started = Instant::now();
                    let out = generate(stack, "acme", &p, max_new, 0, || {});
                    let took = started.elapsed();
                    if let Ok(out) = &out {
                        assert_matches(out, &expected(model, &p, max_new), &format!("request {i}"));
                    }
                    results.lock().unwrap().push((i, took, out.map(|_| ())));
                })
            })
            .collect();
        for c in clients {
            c.join().expect("a client thread panicked");
        }
        done.store(true, Ordering::Relaxed);
        sampler.join().expect("the sampler panicked");
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(i, ..)| *i);
    for (i, took, r) in &results {
        eprintln!(
            "request {i}: {took:?} {:?}",
            r.as_ref().err().map(|e| error_chain(e))
        );
        assert!(
            r.is_ok(),
            "request {i} failed: {}",
            error_chain(r.as_ref().unwrap_err())
        );
    }
    let samples = samples.into_inner().unwrap();
    eprintln!("{} status samples", samples.len());
    assert!(samples.len() >= 5, "too few status samples: {samples:?}");
    for s in &samples {
        assert_eq!(s.all, 2, "{samples:?}");
        assert!(s.used <= 2, "more than two slots taken: {samples:?}");
        assert!(
            s.workers.iter().all(|(n, u)| *n == 2 && u <= n),
            "{samples:?}"
        );
    }
    assert!(
        samples.iter().any(|s| s.used == 2 && s.queued > 0),
        "never seen both slots taken and requests waiting for one: {samples:?}"
    );
    let s = wait_all_free(stack, &all_worker_ids(stack), Duration::from_secs(10));
    let decode = &stack.worker_ids(Role::Decode)[0];
    let steps = worker_counter(&s, decode, "decode_batch_steps").expect("decode_batch_steps");
    let stepped = worker_counter(&s, decode, "decode_batch_requests").expect("requests");
    eprintln!("{stepped} requests stepped in {steps} steps");
    assert_eq!(
        stepped,
        8 * u64::from(max_new),
        "one step per token of every request"
    );
    assert!(
        steps < stepped && steps >= stepped / 2,
        "{steps} steps for {stepped}: never two together, or more than two"
    );
    assert_eq!(counter(&s, "completed"), Some(8));
    assert_eq!(counter(&s, "slot_timeouts"), Some(0));
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}

#[test]
fn a_request_that_cannot_get_a_decode_slot_fails_saying_so_and_holds_no_page() {
    let begun = Instant::now();
    // One slot; a long decode takes it (about 5 s alone on a 2-core machine, 16 times the
    // admission wait), with pages to spare for the others.
    let max_new = 10_000;
    let wait_ms = 300;
    let running = start_stack("kvslot.", 1, 1, |c| {
        c.decode.max_batch = Some(1);
        long_decodes(c, max_new, 2);
        c.deadlines.admission_wait = wait_ms;
    });
    let stack = &running.stack;
    let model = model(stack);
    let long = prompt("acme", 1, 1000);
    let decoding = AtomicBool::new(false);
    let finished = AtomicBool::new(false);
    thread::scope(|s| {
        let holder = s.spawn(|| {
            let started = Instant::now();
            let out = generate(stack, "acme", &long, max_new, 0, || {
                decoding.store(true, Ordering::Release);
            });
            finished.store(true, Ordering::Release);
            eprintln!("the long request took {:?}", started.elapsed());
            out
        });
        let started = wait_until(Duration::from_secs(20), || {
            decoding.load(Ordering::Acquire).then_some(())
        });
        assert!(started.is_some(), "the long request did not start decoding");
        let slots = wait_until(Duration::from_secs(5), || {
            let s = stack.status().ok()?;
            (counter(&s, "decode_slots_used") == Some(1)).then_some(())
        });
        assert!(slots.is_some(), "the long request does not hold the slot");

        // It waits out admission_wait for the slot: PoolFull, saying so.
        let short = prompt("globex", 2, 40);
        let asked = Instant::now();
        let err = generate(stack, "globex", &short, 8, 0, || {}).expect_err("no slot for it");
        let took = asked.elapsed();
        let ClientError::Server { code, message } = &err else {
            panic!("not kvctld's error: {}", error_chain(&err));
        };
        assert_eq!(*code, ErrorCode::PoolFull, "{message}");
        assert!(
            message.contains(&format!(
                "no decode slot within {wait_ms} ms (deadlines.admission_wait)"
            )),
            "{message}"
        );
        assert!(!message.contains("transfer"), "{message}");
        let wait = Duration::from_millis(u64::from(wait_ms));
        assert!(
            took >= wait && took < wait + Duration::from_secs(3),
            "{took:?}"
        );

        // Its own deadline shorter than admission_wait: a Timeout, saying it waited for a
        // slot.
        let asked = Instant::now();
        let err = generate(stack, "globex", &short, 8, 150, || {}).expect_err("no slot for it");
        let took = asked.elapsed();
        let ClientError::Server { code, message } = &err else {
            panic!("not kvctld's error: {}", error_chain(&err));
        };
        assert_eq!(*code, ErrorCode::Timeout, "{message}");
        assert!(
            message.contains(
                "request deadline of 150 ms exceeded in admission, waiting for a decode slot"
            ),
            "{message}"
        );
        assert!(!message.contains("transfer"), "{message}");
        assert!(took < Duration::from_secs(3), "{took:?}");

        assert!(
            !finished.load(Ordering::Acquire),
            "the long request ended before the others were refused: the test proves nothing"
        );
        let out = holder.join().expect("the long request's thread");
        let out = out.unwrap_or_else(|e| panic!("the long request failed: {}", error_chain(&e)));
        assert_matches(&out, &expected(&model, &long, max_new), "the long request");
    });
    let s = wait_all_free(stack, &all_worker_ids(stack), Duration::from_secs(10));
    let decode = &stack.worker_ids(Role::Decode)[0];
    assert_eq!(
        worker_counter(&s, decode, "reserves"),
        Some(1),
        "a refused request reached decoded"
    );
    assert_eq!(counter(&s, "slot_timeouts"), Some(2));
    assert_eq!(counter(&s, "completed"), Some(1));
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}
