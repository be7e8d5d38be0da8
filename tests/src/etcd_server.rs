//! An etcd v3 server (Debian's `etcd-server`) run by a test inside one of its network
//! namespaces, stopped when dropped.

use crate::hosts::Hosts;
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// Whether `etcd` is on the PATH. Under CI (`CI` set) a missing etcd fails the test that
/// asks: `.ci/run` installs it.
pub fn available() -> bool {
    let found = Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found || std::env::var_os("CI").is_none(),
        "etcd is missing: .ci/run installs etcd-server"
    );
    found
}

/// One etcd member on `host` (client port 2379, peer port 2380) in namespace `ns`, with its
/// data and log (`etcd.log`) under `dir`.
#[derive(Debug)]
pub struct EtcdServer {
    child: Child,
    log: std::path::PathBuf,
    /// `HOST:PORT` of its client URL.
    pub endpoint: String,
}

/// The certificate, key and CA of members that serve clients over TLS and require a
/// client certificate signed by the same CA.
#[derive(Clone, Debug)]
pub struct MemberTls {
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
    pub ca: std::path::PathBuf,
}

impl EtcdServer {
    pub fn start(ns: &str, host: &str, dir: &Path) -> EtcdServer {
        EtcdServer::cluster(ns, host, dir, 1, None).remove(0)
    }

    /// A cluster of `n` members on `host`, member `i` on client port 2379 + 10000 i and
    /// peer port 2380 + 10000 i, each with its data and log (`etcd-i.log`) under `dir`;
    /// with `tls`, clients reach them over https:// only.
    pub fn cluster(
        ns: &str,
        host: &str,
        dir: &Path,
        n: usize,
        tls: Option<&MemberTls>,
    ) -> Vec<EtcdServer> {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let port = |i: usize, base: usize| base + 10_000 * i;
        let name = |i: usize| format!("kvfence-test-{i}");
        let peer = |i: usize| format!("http://{host}:{}", port(i, 2380));
        let initial = (0..n)
            .map(|i| format!("{}={}", name(i), peer(i)))
            .collect::<Vec<_>>()
            .join(",");
        (0..n)
            .map(|i| {
                let log_path = if n == 1 {
                    dir.join("etcd.log")
                } else {
                    dir.join(format!("etcd-{i}.log"))
                };
                let log = std::fs::File::create(&log_path).expect("etcd log");
                let client = format!("{scheme}://{host}:{}", port(i, 2379));
                let mut cmd = Hosts::exec(ns);
                cmd.push("etcd".into());
                let mut etcd = Command::new(&cmd[0]);
                etcd.args(&cmd[1..])
                    .args(["--name", &name(i), "--data-dir"])
                    .arg(dir.join(format!("etcd-data-{i}")))
                    .args([
                        "--listen-client-urls",
                        &client,
                        "--advertise-client-urls",
                        &client,
                    ])
                    .args([
                        "--listen-peer-urls",
                        &peer(i),
                        "--initial-advertise-peer-urls",
                        &peer(i),
                    ])
                    .args(["--initial-cluster", &initial]);
                if let Some(t) = tls {
                    etcd.arg("--cert-file")
                        .arg(&t.cert)
                        .arg("--key-file")
                        .arg(&t.key)
                        .arg("--trusted-ca-file")
                        .arg(&t.ca)
                        .arg("--client-cert-auth");
                }
                let child = etcd
                    .stdin(Stdio::null())
                    .stdout(log.try_clone().expect("etcd log"))
                    .stderr(log)
                    .spawn()
                    .expect("starting etcd");
                EtcdServer {
                    child,
                    log: log_path,
                    endpoint: format!("{host}:{}", port(i, 2379)),
                }
            })
            .collect()
    }

    /// The pid of `ip netns exec`, which execs etcd: etcd's own.
    pub fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).expect("pid"))
    }

    /// The last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut tail: Vec<&str> = text.lines().rev().take(lines).collect();
        tail.reverse();
        tail.join("\n")
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(self.pid(), nix::sys::signal::Signal::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
