//! Network faults on the TCP page path. Two hosts as network namespaces joined by veth: two
//! prefill workers in namespace A (198.51.100.1, page servers on free ports), two decode
//! workers in namespace B (198.51.100.2), kvctld in the root namespace (its Unix socket is
//! a path). While clients send requests, the link gets, one after the other: 1% and 5%
//! loss, 50 ms delay with 10 ms jitter, reordering, duplication (each with `tc netem` on
//! both ends), and the link going down mid-transfer and coming back. Then:
//!
//! - every request equals the monolithic output, or failed with an error a deadline
//!   explains (`Timeout`, `PoolFull`: never `WorkerLost`, since every worker stays up),
//!   within its deadline plus [`SLACK`];
//! - once the fault is gone the stack goes idle with every page of every worker free
//!   (waited for, bounded), and a fresh batch of requests all succeed and match.
//!
//! Where the kernel has no `sch_netem` (this machine's), the netem faults are skipped and
//! said so, the link faults still run; `tests/vm/rxe.sh` runs the whole campaign in a guest
//! with the stock kernel, where `KVFENCE_NETEM_REQUIRED` makes a missing netem a failure. Needs root and `ip netns` (else SKIPPED). Bounded: one round of
//! the six faults with [`PHASE`] of load each; `KVFENCE_NETFAULT_ROUNDS=N` runs N rounds (the
//! long run in the README). Build the binaries first (`cargo build --release --bins`).

use kvctld::client::ClientError;
use kvctld::stack::{Daemon, error_chain};
use kvfence_tests::hosts::{self, Hosts};
use kvfence_tests::idle;
use kvfence_tests::{
    Attempt, assert_matches, expected, model, prompt, start_stack_with, under_load,
};
use libkv::config::{Config, Transfer, TransportKind};
use libkv::proto::ErrorCode;
use std::collections::BTreeMap;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

const PREFILL_ADDR: &str = "198.51.100.1";
const DECODE_ADDR: &str = "198.51.100.2";
/// Load under each fault.
const PHASE: Duration = Duration::from_millis(2500);
/// What a request's deadline is.
const DEADLINE_MS: u32 = 6000;
/// Beyond its deadline, what a failed request may take to be told.
const SLACK: Duration = Duration::from_millis(2000);
/// How long the stack may take to go idle once a fault is gone.
const IDLE_WITHIN: Duration = Duration::from_secs(20);

/// The netem faults: name and `tc ... netem` arguments.
const NETEM: &[(&str, &[&str])] = &[
    ("1% loss", &["loss", "1%"]),
    ("5% loss", &["loss", "5%"]),
    ("50 ms delay, 10 ms jitter", &["delay", "50ms", "10ms"]),
    ("reordering", &["delay", "10ms", "reorder", "25%", "50%"]),
    ("5% duplication", &["duplicate", "5%"]),
];

/// A fault injected for one phase.
#[derive(Clone, Copy, Debug)]
enum Fault {
    Netem(&'static str, &'static [&'static str]),
    /// The link goes down mid-transfer and comes back after this long.
    LinkDown(Duration),
}

impl Fault {
    fn name(self) -> String {
        match self {
            Fault::Netem(name, _) => name.to_owned(),
            Fault::LinkDown(d) => format!("link down {} ms mid-transfer", d.as_millis()),
        }
    }

    /// Injects the fault for [`PHASE`], then takes it away.
    fn inject(self, hosts: &Hosts) {
        match self {
            Fault::Netem(_, args) => {
                hosts.netem(args).expect("netem");
                thread::sleep(PHASE);
                hosts.clear_netem().expect("clearing netem");
            }
            Fault::LinkDown(down) => {
                // Let transfers start, then cut them.
                thread::sleep(PHASE / 4);
                hosts.link(false).expect("link down");
                thread::sleep(down);
                hosts.link(true).expect("link up");
                thread::sleep(PHASE / 2);
            }
        }
    }
}

/// The `n`-th request of load thread `t`: tenants by thread, prompts from short to many
/// pages, so that some requests are mid-transfer whenever a fault comes.
fn job(t: usize, n: usize) -> (&'static str, Vec<u8>, u32) {
    let tenant = ["acme", "globex", "initech", "umbrella"][t % 4];
    let len = 40 + ((t * 7 + n * 13) % 10) * 400;
    (
        tenant,
        prompt(tenant, t * 1000 + n, len),
        4 + u32::try_from(n % 5).expect("small"),
    )
}

fn config(socket: &Path) -> Config {
    let mut c = Config::embedded_default(socket.to_path_buf());
    c.transfer = Transfer {
        transport: TransportKind::Tcp,
        listen: Some(format!("{PREFILL_ADDR}:0")),
    };
    c.deadlines.transfer = 3000;
    c.deadlines.request = DEADLINE_MS;
    c.control.admission_queue = 64;
    c.deadlines.admission_wait = 2000;
    c
}

/// What one phase came to: requests by outcome.
#[derive(Debug, Default)]
struct Tally {
    requests: usize,
    ok: usize,
    failed: BTreeMap<String, usize>,
    /// The first message of each kind of failure.
    examples: BTreeMap<String, String>,
    slowest_failure: Duration,
}

/// Checks one phase's requests: each equals the monolithic output or failed cleanly within
/// its deadline.
fn check(stack: &kvctld::stack::Stack, fault: &str, attempts: &[Attempt]) -> Tally {
    let model = model(stack);
    let mut t = Tally {
        requests: attempts.len(),
        ..Tally::default()
    };
    for a in attempts {
        let took = a.ended.duration_since(a.started);
        match &a.result {
            Ok(out) => {
                let want = expected(&model, &a.prompt, a.max_new);
                assert_matches(out, &want, &format!("{fault}: {}", a.what()));
                t.ok += 1;
            }
            Err(ClientError::Server { code, message }) => {
                // Every worker stays up: a slow or broken link may make a request miss its
                // deadline (or wait too long for room), never look like a lost worker.
                assert!(
                    matches!(code, ErrorCode::Timeout | ErrorCode::PoolFull),
                    "{fault}: {} failed with {code:?}, which no network fault explains: \
                     {message}",
                    a.what()
                );
                assert!(
                    took <= Duration::from_millis(u64::from(DEADLINE_MS)) + SLACK,
                    "{fault}: {} failed after {took:?}, past its deadline of {DEADLINE_MS} \
                     ms: {message}",
                    a.what()
                );
                *t.failed.entry(format!("{code:?}")).or_default() += 1;
                t.examples
                    .entry(format!("{code:?}"))
                    .or_insert_with(|| message.clone());
                t.slowest_failure = t.slowest_failure.max(took);
            }
            Err(e) => panic!(
                "{fault}: {} did not get a server's answer: {}",
                a.what(),
                error_chain(e)
            ),
        }
    }
    t
}

/// A batch of 8 concurrent requests on the healed link: all succeed and match.
fn serves_normally(stack: &kvctld::stack::Stack, after: &str) {
    let (_, attempts) = under_load(stack.socket(), 8, 1, DEADLINE_MS, job, |_| {});
    let model = model(stack);
    for a in &attempts {
        let out = a.result.as_ref().unwrap_or_else(|e| {
            panic!(
                "after {after}: {} failed on a healed link: {}",
                a.what(),
                error_chain(e)
            )
        });
        assert_matches(out, &expected(&model, &a.prompt, a.max_new), after);
    }
}

#[test]
fn network_faults_on_the_page_path_end_in_the_right_output_or_a_clear_error() {
    if let Some(why) = hosts::cannot_run() {
        eprintln!("SKIPPED: network fault campaign: {why}");
        return;
    }
    let hosts = Hosts::create("nf", PREFILL_ADDR, DECODE_ADDR).expect("creating the namespaces");
    let mut faults: Vec<Fault> = Vec::new();
    match hosts.netem_unavailable() {
        None => faults.extend(NETEM.iter().map(|(n, a)| Fault::Netem(n, a))),
        Some(why) if std::env::var_os("KVFENCE_NETEM_REQUIRED").is_some() => {
            panic!("netem is required here (KVFENCE_NETEM_REQUIRED) but unavailable: {why}")
        }
        Some(why) => eprintln!(
            "netfaults: netem unavailable here ({why}): the loss, delay, reordering and \
             duplication faults are skipped; tests/vm/rxe.sh runs them"
        ),
    }
    faults.push(Fault::LinkDown(Duration::from_millis(1500)));
    let rounds: usize = std::env::var("KVFENCE_NETFAULT_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);

    let (ns_a, ns_b) = (hosts.a.clone(), hosts.b.clone());
    let running = start_stack_with(
        "kvnf.",
        2,
        2,
        |c| *c = config(&c.control.socket),
        |opts| {
            for i in 0..2 {
                opts.wrap.insert(format!("prefill-{i}"), Hosts::exec(&ns_a));
                opts.wrap.insert(format!("decode-{i}"), Hosts::exec(&ns_b));
            }
        },
    );
    let stack = &running.stack;
    let begun = Instant::now();
    let mut totals = Tally::default();
    for round in 0..rounds {
        for fault in &faults {
            let name = fault.name();
            let (_, attempts) = under_load(stack.socket(), 6, usize::MAX, DEADLINE_MS, job, |_| {
                fault.inject(&hosts)
            });
            let t = check(stack, &name, &attempts);
            eprintln!(
                "netfaults: round {round}, {name}: {} requests, {} ok, failed {:?} (slowest \
                 failure {:?})",
                t.requests, t.ok, t.failed, t.slowest_failure
            );
            for (kind, message) in &t.examples {
                eprintln!("netfaults:   {kind}, e.g.: {message}");
            }
            assert!(t.requests > 0, "{name}: no request was sent");
            if let Err(e) = idle::wait_idle(stack, IDLE_WITHIN) {
                panic!(
                    "after {name}: {}\n{}",
                    e.message,
                    stack.log(Daemon::Decoded)
                );
            }
            serves_normally(stack, &name);
            totals.requests += t.requests;
            totals.ok += t.ok;
            for (k, n) in t.failed {
                *totals.failed.entry(k).or_default() += n;
            }
            totals.slowest_failure = totals.slowest_failure.max(t.slowest_failure);
        }
    }
    eprintln!(
        "netfaults: {rounds} rounds of {} faults in {:?}: {} requests, {} ok, failed {:?}, 0 \
         wrong outputs, every page free after each fault",
        faults.len(),
        begun.elapsed(),
        totals.requests,
        totals.ok,
        totals.failed
    );
}
