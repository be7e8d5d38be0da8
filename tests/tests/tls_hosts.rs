//! kvctld, prefilld, decoded and a client each on a host of its own, every one on the control
//! channel over mutual TLS: four network namespaces on one switch ([`Lan`]). kvctld
//! (192.0.2.1) listens for TLS peers on 192.0.2.1:7443; prefilld (192.0.2.2) and decoded
//! (192.0.2.3) reach it there over TCP and TLS; kvctl runs as a client on 192.0.2.4. Pages go
//! over TCP from prefilld's host to decoded's. Certificates are made at test time.
//!
//! Shown: requests equal the monolithic path; kvctl on the client's host over TLS sees both
//! workers and generates; a certificate of another CA, a certificate valid for no name kvctld lets in,
//! and a client's certificate trying to register as a decode worker are turned away with
//! clear errors, counted, and change nothing.
//!
//! Needs root and `ip netns` (iproute2); without them it says SKIPPED and passes. The test
//! creates the namespaces and removes them when it ends, passing or not. Build the binaries
//! first (`cargo build --release --bins`). Bounded in time.

use kvctld::stack::{Daemon, Stack, StackOptions, default_bin_dir, error_chain, wait_until};
use kvfence_tests::certs::TestCa;
use kvfence_tests::hosts::{self, Hosts, Lan};
use kvfence_tests::{counter, prompt, worker_counter};
use libkv::config::{Config, Transfer, TransportKind};
use libkv::model::{ReferenceModel, detokenize, monolithic, tokenize};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

const KVCTLD_HOST: &str = "192.0.2.1";
const PREFILL_HOST: &str = "192.0.2.2";
const DECODE_HOST: &str = "192.0.2.3";
const CLIENT_HOST: &str = "192.0.2.4";
const KVCTLD_TLS: &str = "192.0.2.1:7443";
const PREFILL: &str = "prefill-0.kvfence.test";
const DECODE: &str = "decode-0.kvfence.test";
const CLIENT: &str = "app.kvfence.test";
const TEST_BOUND: Duration = Duration::from_secs(90);
const WAIT: Duration = Duration::from_secs(15);

/// `kvctl --config CONFIG ARGS` in namespace `ns`.
fn kvctl_in(ns: &str, bin: &Path, config: &Path, args: &[&str]) -> Output {
    let mut cmd = Hosts::exec(ns);
    cmd.push(bin.join("kvctl").display().to_string());
    Command::new(&cmd[0])
        .args(&cmd[1..])
        .arg("--config")
        .arg(config)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running kvctl")
}

fn text(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn kvctld_its_workers_and_a_client_on_four_hosts_over_mutual_tls() {
    if let Some(why) = hosts::cannot_run() {
        eprintln!("SKIPPED: mutual TLS across namespaces: {why}");
        return;
    }
    let begun = Instant::now();
    let bin = default_bin_dir().expect("target directory");
    for d in Daemon::ALL.iter().map(|d| d.binary()).chain(["kvctl"]) {
        assert!(
            bin.join(d).is_file(),
            "{d} missing: run `cargo build --release --bins` first"
        );
    }
    let lan = Lan::create(
        "tls",
        &[KVCTLD_HOST, PREFILL_HOST, DECODE_HOST, CLIENT_HOST],
    )
    .unwrap_or_else(|e| panic!("namespaces: {e}"));
    let (kvctld_ns, prefill_ns, decode_ns, client_ns) =
        (&lan.hosts[0], &lan.hosts[1], &lan.hosts[2], &lan.hosts[3]);
    let dir = tempfile::Builder::new()
        .prefix("kvtls.")
        .tempdir_in("/tmp")
        .expect("temp dir");
    let d = dir.path();
    let ca = TestCa::new(d, "ca");
    let rogue = TestCa::new(d, "rogue-ca");
    let server = ca.issue("kvctld", &[kvfence_tests::certs::KVCTLD_NAME]);

    let mut config = Config::embedded_default(d.join("kvctld.sock"));
    config.transfer = Transfer {
        transport: TransportKind::Tcp,
        listen: Some(format!("{PREFILL_HOST}:7471")),
    };
    let mut kvctld = config.clone();
    kvctld.tls = ca.kvctld(&server, KVCTLD_TLS, &[PREFILL, DECODE], &[CLIENT]);
    // Each peer's own config: its certificate, and kvctld's TLS address.
    let peer_config = |stem: &str, names: &[&str], ca_of_leaf: &TestCa| {
        let leaf = ca_of_leaf.issue(stem, names);
        let mut c = config.clone();
        c.tls = ca.peer(&leaf, KVCTLD_TLS);
        c
    };
    let mut opts = StackOptions::new(kvctld, d.to_path_buf()).expect("options");
    opts.bin_dir = bin.clone();
    opts.worker_configs.insert(
        "prefill-0".into(),
        peer_config("prefill-0", &[PREFILL], &ca),
    );
    opts.worker_configs
        .insert("decode-0".into(), peer_config("decode-0", &[DECODE], &ca));
    opts.wrap.insert("kvctld".into(), Hosts::exec(kvctld_ns));
    opts.wrap
        .insert("prefill-0".into(), Hosts::exec(prefill_ns));
    opts.wrap.insert("decode-0".into(), Hosts::exec(decode_ns));
    let stack = Stack::start(opts).unwrap_or_else(|e| {
        let logs: String = ["kvctld", "prefill-0", "decode-0"]
            .iter()
            .map(|n| std::fs::read_to_string(d.join(format!("{n}.log"))).unwrap_or_default())
            .collect();
        panic!("starting the stack: {}\n{logs}", error_chain(&e))
    });
    assert!(
        stack
            .log("kvctld")
            .contains(&format!("serving TLS peers on {KVCTLD_TLS}")),
        "{}",
        stack.log("kvctld")
    );

    // Both workers reached kvctld over TLS (their configs connect there, not to the socket,
    // which the test itself uses from the root namespace).
    let status = stack.status().expect("status");
    // At least two: a worker whose handshake ran past its deadline on a loaded machine
    // connects again, and each connection counts.
    assert!(
        counter(&status, "tls_accepted").is_some_and(|n| n >= 2),
        "{status:?}"
    );

    // Requests equal the monolithic path.
    let model = ReferenceModel::new(stack.config().geometry).expect("model");
    let jobs: Vec<(&str, Vec<u8>, u32)> = (0..8)
        .map(|i| {
            let tenant = ["acme", "globex"][i % 2];
            (
                tenant,
                prompt(tenant, i, 20 + i * 97),
                6 + u32::try_from(i).unwrap(),
            )
        })
        .collect();
    thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|(tenant, p, max_new)| {
                let stack = &stack;
                s.spawn(move || {
                    let mut client = stack.client().map_err(|e| error_chain(&e))?;
                    client
                        .generate(tenant, &tokenize(p), *max_new, 10_000, |_| {})
                        .map_err(|e| error_chain(&e))
                })
            })
            .collect();
        for (h, (tenant, p, max_new)) in handles.into_iter().zip(&jobs) {
            let out = h
                .join()
                .unwrap()
                .unwrap_or_else(|e| panic!("{tenant}: {e}\n{}", stack.log("decode-0")));
            let want = monolithic(&model, &tokenize(p), *max_new).expect("monolithic");
            assert_eq!(out.tokens, want.tokens, "{tenant}: tokens");
            assert_eq!(out.done.signature, want.signature, "{tenant}: signature");
        }
    });
    let status = stack.status().expect("status");
    let pulled = worker_counter(&status, "decode-0", "pages_pulled").unwrap_or(0);
    assert!(pulled > 0, "no page went over TCP");

    // kvctl on the client's host, over TLS: it sees both workers, and generates.
    let client_cfg = d.join("client.toml");
    let write = |path: &Path, c: &Config| {
        std::fs::write(path, toml::to_string(c).expect("toml")).expect("writing a config")
    };
    write(&client_cfg, &peer_config("client", &[CLIENT], &ca));
    let out = kvctl_in(client_ns, &bin, &client_cfg, &["status"]);
    assert!(out.status.success(), "{}", text(&out));
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains("prefill-0") && shown.contains("decode-0"),
        "{shown}"
    );
    let want = monolithic(&model, &tokenize(b"hello over tls"), 5).expect("monolithic");
    let out = kvctl_in(
        client_ns,
        &bin,
        &client_cfg,
        &[
            "generate",
            "--tenant",
            "acme",
            "--max-new",
            "5",
            "hello over tls",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim_end(),
        detokenize(&want.tokens).trim_end()
    );
    // A client may not drain: that is for workers' and operators' names.
    let out = kvctl_in(client_ns, &bin, &client_cfg, &["drain", "decode-0"]);
    assert!(
        !out.status.success(),
        "a client drained a worker: {}",
        text(&out)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("may not drain"),
        "{}",
        text(&out)
    );

    // Turned away: a certificate of another CA (in the handshake), one valid for no name
    // kvctld lets in (by kvctld's loop); each with the reason, each counted.
    let refused_before = counter(&stack.status().unwrap(), "tls_refused").unwrap_or(0);
    let rogue_cfg = d.join("rogue.toml");
    write(&rogue_cfg, &peer_config("rogue", &[CLIENT], &rogue));
    let out = kvctl_in(client_ns, &bin, &rogue_cfg, &["status"]);
    assert_eq!(out.status.code(), Some(6), "not allowed: {}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ended the TLS session"), "{}", text(&out));
    assert!(
        wait_until(WAIT, || {
            let s = stack.status().ok()?;
            (counter(&s, "tls_refused")? > refused_before).then_some(())
        })
        .is_some(),
        "kvctld did not count the refused certificate"
    );
    let unauthorized_before = counter(&stack.status().unwrap(), "unauthorized").unwrap_or(0);
    let stranger_cfg = d.join("stranger.toml");
    write(
        &stranger_cfg,
        &peer_config("stranger", &["stranger.kvfence.test"], &ca),
    );
    let out = kvctl_in(client_ns, &bin, &stranger_cfg, &["status"]);
    assert_eq!(out.status.code(), Some(6), "not allowed: {}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("for no name kvctld lets in"),
        "{}",
        text(&out)
    );

    // A client's certificate trying to register as a decode worker: refused as Unauthorized
    // and retried (as any refused worker is), never registered.
    let impostor_cfg = d.join("impostor.toml");
    write(&impostor_cfg, &peer_config("impostor", &[CLIENT], &ca));
    let mut cmd = Hosts::exec(decode_ns);
    cmd.push(bin.join("decoded").display().to_string());
    let log = std::fs::File::create(d.join("impostor.log")).unwrap();
    let mut impostor = Command::new(&cmd[0])
        .args(&cmd[1..])
        .arg("--config")
        .arg(&impostor_cfg)
        .args(["--id", "decode-1"])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("starting the impostor");
    let refused = wait_until(WAIT, || {
        let s = stack.status().ok()?;
        (counter(&s, "unauthorized")? >= unauthorized_before + 2).then_some(())
    });
    let impostor_log = || std::fs::read_to_string(d.join("impostor.log")).unwrap_or_default();
    let said = wait_until(WAIT, || {
        impostor_log()
            .contains("is not allowed to be a worker")
            .then_some(())
    });
    let status = stack.status().expect("status");
    let _ = impostor.kill();
    let _ = impostor.wait();
    assert!(refused.is_some(), "kvctld did not refuse the impostor");
    assert!(
        said.is_some(),
        "the impostor was not told why: {}",
        impostor_log()
    );
    assert!(
        status.workers.iter().all(|w| w.id != "decode-1"),
        "a client's certificate registered a worker: {status:?}"
    );

    drop(stack);
    drop(lan);
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}
