//! Two hosts without shared memory, as two network namespaces joined by a veth pair:
//! prefilld runs in namespace A (192.0.2.1/24), decoded in namespace B (192.0.2.2/24), kvctld
//! in the root namespace (its Unix socket is a path, which namespaces do not separate). Pages
//! can only travel over TCP from 192.0.2.1 to 192.0.2.2.
//!
//! The test creates the namespaces and removes them when it ends, passing or not. It needs
//! root and `ip netns` (iproute2); without them it says SKIPPED and passes. Bounded in time
//! like the other stack tests; build the binaries first (`cargo build --release --bins`).

use kvctld::client::GenerateOutcome;
use kvctld::stack::{Daemon, Stack, StackOptions, default_bin_dir, error_chain};
use kvfence_tests::hosts::{self, Hosts};
use kvfence_tests::{prompt, worker_counter};
use libkv::config::{Config, Transfer, TransportKind};
use libkv::model::{ReferenceModel, monolithic, tokenize};
use std::thread;
use std::time::{Duration, Instant};

const PREFILL_ADDR: &str = "192.0.2.1";
const DECODE_ADDR: &str = "192.0.2.2";
const TEST_BOUND: Duration = Duration::from_secs(60);

#[test]
fn prefilld_and_decoded_on_two_network_namespaces_pull_over_tcp() {
    if let Some(why) = hosts::cannot_run() {
        eprintln!("SKIPPED: two-namespace TCP test: {why}");
        return;
    }
    let begun = Instant::now();
    let bin_dir = default_bin_dir().expect("target directory");
    for d in Daemon::ALL {
        assert!(
            bin_dir.join(d.binary()).is_file(),
            "{} missing: run `cargo build --release --bins` first",
            d.binary()
        );
    }
    let hosts = match Hosts::create("ns", PREFILL_ADDR, DECODE_ADDR) {
        Ok(h) => h,
        Err(e) => panic!("creating the namespaces: {e}"),
    };
    let dir = tempfile::Builder::new()
        .prefix("kvns.")
        .tempdir_in("/tmp")
        .expect("temp dir");
    let mut config = Config::embedded_default(dir.path().join("kvctld.sock"));
    config.transfer = Transfer {
        transport: TransportKind::Tcp,
        listen: Some(format!("{PREFILL_ADDR}:7470")),
    };
    let mut opts = StackOptions::new(config, dir.path().to_path_buf()).expect("options");
    opts.bin_dir = bin_dir;
    opts.wrap
        .insert(Daemon::Prefilld.name().to_owned(), Hosts::exec(&hosts.a));
    opts.wrap
        .insert(Daemon::Decoded.name().to_owned(), Hosts::exec(&hosts.b));
    let stack = Stack::start(opts).unwrap_or_else(|e| {
        let logs: String = Daemon::ALL
            .iter()
            .map(|d| {
                std::fs::read_to_string(dir.path().join(format!("{}.log", d.name())))
                    .unwrap_or_default()
            })
            .collect();
        panic!("starting the stack: {}\n{logs}", error_chain(&e))
    });

    let model = ReferenceModel::new(stack.config().geometry).expect("model");
    let jobs: Vec<(&str, Vec<u8>, u32)> = (0..12)
        .map(|i| {
            let tenant = ["acme", "globex", "initech"][i % 3];
            (
                tenant,
                prompt(tenant, i, 20 + i * 151),
                8 + u32::try_from(i).unwrap(),
            )
        })
        .collect();
    let results: Vec<Result<GenerateOutcome, String>> = thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|(tenant, p, max_new)| {
                let stack = &stack;
                s.spawn(move || {
                    let mut client = stack.client().map_err(|e| error_chain(&e))?;
                    client
                        .generate(tenant, &libkv::model::tokenize(p), *max_new, 10_000, |_| {})
                        .map_err(|e| error_chain(&e))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for ((tenant, p, max_new), result) in jobs.iter().zip(results) {
        let out = result.unwrap_or_else(|e| {
            panic!(
                "{tenant} request failed: {e}\n{}",
                stack.log(Daemon::Decoded)
            )
        });
        let want = monolithic(&model, &tokenize(p), *max_new).expect("monolithic");
        assert_eq!(out.tokens, want.tokens, "{tenant}: tokens differ");
        assert_eq!(
            out.done.signature, want.signature,
            "{tenant}: signature differs"
        );
    }
    let status = stack.status().expect("status");
    let served = worker_counter(&status, Daemon::Prefilld.name(), "pages_served").unwrap_or(0);
    let pulled = worker_counter(&status, Daemon::Decoded.name(), "pages_pulled").unwrap_or(0);
    assert!(
        served > 0 && pulled > 0,
        "no page went over TCP: prefill-0 served {served}, decode-0 pulled {pulled}"
    );
    assert!(
        stack
            .log(Daemon::Prefilld)
            .contains(&format!("{PREFILL_ADDR}:7470")),
        "prefilld did not serve on {PREFILL_ADDR}"
    );
    drop(stack);
    drop(hosts);
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}
