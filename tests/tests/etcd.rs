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
//! And a cluster of three members serving clients over TLS with client certificates
//! (`--client-cert-auth`), named to the client as a list of `https://` endpoints: calls go
//! over TLS; when the member in use is killed, the next call is answered by another member
//! within the one timeout, the leader key and its lease still there; a client with the wrong
//! CA, without a client certificate, or speaking plain HTTP gets a clear error; a CA file that
//! does not exist is found before any call.
//!
//! Needs root, `ip netns` and `etcd`; without them it says SKIPPED and passes, except under
//! CI (`CI` set), where a missing etcd fails. Bounded in time.

use kvctld::stack::wait_until;
use kvfence_tests::certs::TestCa;
use kvfence_tests::etcd_server::{self, EtcdServer, MemberTls};
use kvfence_tests::hosts::{self, Hosts, Lan};
use libkv::config::{Election, EtcdList};
use libkv::etcd::{Etcd, EtcdError};
use std::path::Path;
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

/// `[election]` naming the members at `endpoints` over https://, with the CA `ca` and, when
/// given, a client certificate.
fn tls_election(endpoints: &[String], ca: &Path, client: Option<(&Path, &Path)>) -> Election {
    Election {
        etcd: Some(EtcdList::Many(
            endpoints.iter().map(|e| format!("https://{e}")).collect(),
        )),
        etcd_ca: Some(ca.to_path_buf()),
        etcd_cert: client.map(|c| c.0.to_path_buf()),
        etcd_key: client.map(|c| c.1.to_path_buf()),
        ..Election::default()
    }
}

/// The calls against the TLS cluster, run inside its namespace by the test below:
/// `KVFENCE_ETCD_DIR` holds the certificates, `KVFENCE_ETCD_MEMBERS` is `ENDPOINT=PID,...`.
#[test]
#[ignore = "helper, run inside the etcd namespace by a_tls_cluster_of_three_survives_the_member_in_use"]
fn etcd_tls_cluster_helper() {
    let (Ok(dir), Ok(members)) = (
        std::env::var("KVFENCE_ETCD_DIR"),
        std::env::var("KVFENCE_ETCD_MEMBERS"),
    ) else {
        return;
    };
    let dir = Path::new(&dir);
    let members: Vec<(String, i32)> = members
        .split(',')
        .map(|m| {
            let (e, pid) = m.split_once('=').expect("ENDPOINT=PID");
            (e.to_owned(), pid.parse().expect("pid"))
        })
        .collect();
    let endpoints: Vec<String> = members.iter().map(|m| m.0.clone()).collect();
    let (ca, cert, client_key) = (
        dir.join("ca.pem"),
        dir.join("client.pem"),
        dir.join("client.key"),
    );
    let timeout = Duration::from_secs(3);
    let cfg = tls_election(&endpoints, &ca, Some((&cert, &client_key)));
    libkv::etcd::check(&cfg).expect("the TLS files");
    let etcd = Etcd::for_election(&cfg, timeout).expect("election on");
    assert_eq!(
        etcd.endpoints(),
        endpoints
            .iter()
            .map(|e| format!("https://{e}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let lease = wait_until(WAIT, || etcd.grant(10).ok()).expect("the cluster granted no lease");
    let key = b"kvfence/leader";
    let epoch = etcd
        .create(key, b"kvctld-a", Some(lease))
        .unwrap()
        .expect("the first candidate wins");
    let used = etcd.endpoint().to_owned();

    // The member in use dies: the next calls are another member's, within the timeout.
    let pid = members.iter().find(|m| m.0 == used).expect("in use").1;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("killing the member in use");
    // When the member killed led the cluster, the two left first elect a raft leader (etcd's
    // election timeout is 1 s) and answer "no leader" until then: the client's callers
    // retry, as kvctld's and the workers' loops do.
    let t = Instant::now();
    let held = wait_until(Duration::from_secs(10), || etcd.get(key).ok())
        .expect("no other member answered within 10 s");
    let took = t.elapsed();
    let held = held.expect("the leader key survives its member");
    assert_eq!(
        (held.value.as_slice(), held.create_revision, held.lease),
        (b"kvctld-a".as_slice(), epoch, Some(lease))
    );
    assert_ne!(etcd.endpoint(), used, "still calling the dead member");
    assert!(
        etcd.keep_alive(lease).unwrap().is_some(),
        "the lease lapsed"
    );
    let b = etcd.grant(10).unwrap();
    assert_eq!(etcd.create(key, b"kvctld-b", Some(b)).unwrap(), None);
    eprintln!(
        "etcd-tls: member {used} killed; {} answered {} ms later",
        etcd.endpoint(),
        took.as_millis()
    );

    // What must fail does, and says why.
    let live: Vec<String> = endpoints.iter().filter(|e| **e != used).cloned().collect();
    let other = TestCa::new(dir, "other-ca");
    for (what, cfg, says) in [
        (
            "the wrong CA",
            tls_election(&live, &other.path(), Some((&cert, &client_key))),
            "TLS handshake",
        ),
        ("no client certificate", tls_election(&live, &ca, None), ""),
    ] {
        let e = Etcd::for_election(&cfg, timeout).expect("election on");
        let err = e.get(key).expect_err(what);
        assert!(
            matches!(err, EtcdError::NoneAnswered { .. }) && err.to_string().contains(says),
            "{what}: {err}"
        );
    }
    let plain = Etcd::new(live[0].clone(), timeout);
    assert!(
        plain.get(key).is_err(),
        "plain HTTP to a TLS member answered"
    );
    let missing = tls_election(&live, &dir.join("nowhere.pem"), None);
    let err = libkv::etcd::check(&missing).expect_err("a CA file that is not there");
    assert!(err.to_string().contains("nowhere.pem"), "{err}");
    let e = Etcd::for_election(&missing, timeout).expect("election on");
    assert!(matches!(e.get(key), Err(EtcdError::Tls { .. })));
}

#[test]
fn a_tls_cluster_of_three_survives_the_member_in_use() {
    if let Some(why) = hosts::cannot_run() {
        eprintln!("SKIPPED: etcd TLS test: {why}");
        return;
    }
    if !etcd_server::available() {
        eprintln!("SKIPPED: etcd TLS test: no etcd (apt install etcd-server)");
        return;
    }
    let lan = Lan::create("etls", &[HOST]).unwrap_or_else(|e| panic!("namespace: {e}"));
    let ns = &lan.hosts[0];
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = TestCa::new(dir.path(), "ca");
    let server = ca.issue("etcd", &[HOST]);
    let client = ca.issue("client", &["kvctld.kvfence.test"]);
    assert_eq!(client.cert, dir.path().join("client.pem"));
    let tls = MemberTls {
        cert: server.cert,
        key: server.key,
        ca: ca.path(),
    };
    let cluster = EtcdServer::cluster(ns, HOST, dir.path(), 3, Some(&tls));
    let members = cluster
        .iter()
        .map(|m| format!("{}={}", m.endpoint, m.pid()))
        .collect::<Vec<_>>()
        .join(",");
    let mut helper = Hosts::exec(ns);
    helper.push(std::env::current_exe().unwrap().display().to_string());
    let out = Command::new(&helper[0])
        .args(&helper[1..])
        .args([
            "--exact",
            "etcd_tls_cluster_helper",
            "--ignored",
            "--nocapture",
        ])
        .env("KVFENCE_ETCD_DIR", dir.path())
        .env("KVFENCE_ETCD_MEMBERS", members)
        .stdin(Stdio::null())
        .output()
        .expect("running the helper");
    let logs: String = cluster
        .iter()
        .map(|m| format!("--- {} ---\n{}\n", m.endpoint, m.log_tail(15)))
        .collect();
    assert!(
        out.status.success(),
        "{}\n{}\n{logs}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("1 passed"),
        "the helper did not run: {stdout}"
    );
    for line in String::from_utf8_lossy(&out.stderr).lines() {
        if line.starts_with("etcd-tls:") {
            eprintln!("{line}");
        }
    }
    drop(cluster);
    drop(lan);
}
