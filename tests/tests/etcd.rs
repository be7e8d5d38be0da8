//! libkv's etcd client ([`libkv::etcd`]) against a real etcd v3 server (Debian's
//! `etcd-server`), started by the test in a network namespace of its own (192.0.2.1, ports
//! 2379/2380, so nothing else on the machine is in the way) and stopped when it ends. The
//! calls run in a helper that the test re-executes inside the namespace.
//!
//! Shown: an election (a put only while the key is absent, under a lease) has one winner; the
//! winner's key goes with its lease, revoked or lapsed, and the next winner's revision (its
//! epoch) is larger; keep-alive says when a lease is gone; a prefix range lists members; an
//! unreachable etcd is a clear error within the timeout.
//!
//! Needs root, `ip netns` and `etcd`; without them it says SKIPPED and passes, except under
//! CI (`CI` set), where a missing etcd fails. Bounded in time.

use kvctld::stack::wait_until;
use kvfence_tests::etcd_server::{self, EtcdServer};
use kvfence_tests::hosts::{self, Hosts, Lan};
use libkv::etcd::{Etcd, EtcdError};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const HOST: &str = "192.0.2.1";
const WAIT: Duration = Duration::from_secs(20);

/// The calls, run inside the namespace by the test below (`KVFENCE_ETCD` = the endpoint).
#[test]
#[ignore = "helper, run inside the etcd namespace by an_election_and_members_in_a_real_etcd"]
fn etcd_helper() {
    let Ok(endpoint) = std::env::var("KVFENCE_ETCD") else {
        return;
    };
    let etcd = Etcd::new(endpoint, Duration::from_secs(2));
    // etcd is up once it grants a lease
    let a = wait_until(WAIT, || etcd.grant(5).ok()).expect("etcd answered no grant");

    let key = b"kvfence/leader";
    let first = etcd.create(key, b"kvctld-a", Some(a)).unwrap();
    let first = first.expect("the first candidate wins");
    let b = etcd.grant(5).unwrap();
    assert_eq!(
        etcd.create(key, b"kvctld-b", Some(b)).unwrap(),
        None,
        "a second candidate must not win while the key exists"
    );
    let held = etcd.get(key).unwrap().expect("the leader key");
    assert_eq!(held.value, b"kvctld-a");
    assert_eq!(held.lease, Some(a));
    assert_eq!(held.create_revision, first);
    assert!(etcd.keep_alive(a).unwrap().is_some_and(|ttl| ttl > 0));

    // The leader's lease ends: its key goes, and the next winner's epoch is larger.
    etcd.revoke(a).unwrap();
    assert_eq!(etcd.get(key).unwrap(), None);
    assert_eq!(etcd.keep_alive(a).unwrap(), None, "a revoked lease is gone");
    let second = etcd.create(key, b"kvctld-b", Some(b)).unwrap();
    let second = second.expect("the standby wins");
    assert!(second > first, "epochs grow: {second} after {first}");

    // Members under leases of their own; one lapses without keep-alive.
    let w0 = etcd.grant(30).unwrap();
    let w1 = etcd.grant(1).unwrap();
    etcd.put(b"kvfence/workers/prefill-0", b"prefill", Some(w0))
        .unwrap();
    etcd.put(b"kvfence/workers/decode-0", b"decode", Some(w1))
        .unwrap();
    etcd.put(b"kvfence/workersX", b"not a member", None)
        .unwrap();
    let members = |e: &Etcd| -> Vec<Vec<u8>> {
        e.prefix(b"kvfence/workers/")
            .unwrap()
            .into_iter()
            .map(|kv| kv.key)
            .collect()
    };
    assert_eq!(
        members(&etcd),
        vec![
            b"kvfence/workers/decode-0".to_vec(),
            b"kvfence/workers/prefill-0".to_vec()
        ]
    );
    let lapsed = wait_until(WAIT, || (members(&etcd).len() == 1).then_some(()));
    assert!(lapsed.is_some(), "decode-0's lease did not lapse");
    assert_eq!(members(&etcd), vec![b"kvfence/workers/prefill-0".to_vec()]);
    assert_eq!(etcd.keep_alive(w1).unwrap(), None);
    etcd.delete(b"kvfence/workers/prefill-0").unwrap();
    assert!(members(&etcd).is_empty());

    // Nothing listens there: a clear error, within the timeout.
    let gone = Etcd::new(format!("{HOST}:1"), Duration::from_secs(1));
    let t = Instant::now();
    let err = gone.grant(5).unwrap_err();
    assert!(matches!(err, EtcdError::Unreachable { .. }), "{err}");
    assert!(err.to_string().contains(&format!("{HOST}:1")), "{err}");
    assert!(t.elapsed() < Duration::from_secs(3));
}

#[test]
fn an_election_and_members_in_a_real_etcd() {
    if let Some(why) = hosts::cannot_run() {
        eprintln!("SKIPPED: etcd test: {why}");
        return;
    }
    if !etcd_server::available() {
        eprintln!("SKIPPED: etcd test: no etcd (apt install etcd-server)");
        return;
    }
    let lan = Lan::create("etcd", &[HOST]).unwrap_or_else(|e| panic!("namespace: {e}"));
    let ns = &lan.hosts[0];
    let dir = tempfile::tempdir().expect("temp dir");
    let etcd = EtcdServer::start(ns, HOST, dir.path());
    let mut helper = Hosts::exec(ns);
    helper.push(std::env::current_exe().unwrap().display().to_string());
    let out = Command::new(&helper[0])
        .args(&helper[1..])
        .args(["--exact", "etcd_helper", "--ignored", "--nocapture"])
        .env("KVFENCE_ETCD", format!("{HOST}:2379"))
        .stdin(Stdio::null())
        .output()
        .expect("running the helper");
    assert!(
        out.status.success(),
        "{}\n{}\n--- etcd ---\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        etcd.log_tail(20)
    );
    drop(etcd);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "the helper did not run: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    drop(lan);
}
