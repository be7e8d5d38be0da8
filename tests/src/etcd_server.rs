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

impl EtcdServer {
    pub fn start(ns: &str, host: &str, dir: &Path) -> EtcdServer {
        let log_path = dir.join("etcd.log");
        let log = std::fs::File::create(&log_path).expect("etcd log");
        let client = format!("http://{host}:2379");
        let peer = format!("http://{host}:2380");
        let mut cmd = Hosts::exec(ns);
        cmd.push("etcd".into());
        let child = Command::new(&cmd[0])
            .args(&cmd[1..])
            .args(["--name", "kvfence-test", "--data-dir"])
            .arg(dir.join("etcd-data"))
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("kvfence-test={peer}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("etcd log"))
            .stderr(log)
            .spawn()
            .expect("starting etcd");
        EtcdServer {
            child,
            log: log_path,
            endpoint: format!("{host}:2379"),
        }
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
