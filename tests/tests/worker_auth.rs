//! Being allowed to connect is not being allowed to be a worker.
//!
//! A worker sees every tenant's prompts (PrefillRun) or a map of the whole prefill pool
//! (PrefillPool). A uid in `[control] allowed_uids`, or a peer running with kvctld's own
//! group (openaid's unit: its own user, `Group=kvfence`), may run requests, but only
//! kvctld's own uid, root and `[control] worker_uids` may register as a worker, even while
//! the real worker's slot is empty.

use kvctld::stack::{Daemon, Stack, StackOptions, default_bin_dir, wait_until, worker_connected};
use libkv::RequestId;
use libkv::config::Config;
use libkv::proto::{ErrorCode, Hello, Message, Role};
use libkv::sys::uds;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const NOBODY: u32 = 65534;

/// Run as uid 65534 by the test below (the test binary re-executes itself): tries to
/// register as a prefill worker and exits 0 only if kvctld refuses it as Unauthorized.
#[test]
#[ignore = "helper, run as another uid by an allowed_client_cannot_become_a_worker"]
fn impostor() {
    let Some(socket) = std::env::var_os("KVFENCE_IMPOSTOR_SOCKET") else {
        return;
    };
    let s = UnixStream::connect(&socket).expect("connect as an allowed client");
    let hello = Message::from(Hello::new(Role::Prefill))
        .encode(RequestId(0))
        .unwrap();
    // The refusal may arrive before or after the write; read it either way.
    let _ = uds::send_frame(&s, &hello, &[]);
    match uds::read_frame_timeout(&s, Duration::from_secs(5)) {
        Ok((_, Message::Error(e), _)) if e.code == ErrorCode::Unauthorized => {}
        other => panic!("an allowed client became a prefill worker: {other:?}"),
    }
}

#[test]
fn an_allowed_client_cannot_become_a_worker() {
    client_cannot_become_a_worker(|c| c.control.allowed_uids = vec![NOBODY], NOBODY);
}

/// No uid or gid listed: uid 65534 with kvctld's own group as its primary group is a
/// client (as openaid's unit runs), and still no worker.
#[test]
fn a_peer_of_kvctlds_own_group_is_a_client_and_no_worker() {
    client_cannot_become_a_worker(|_| {}, nix::unistd::getegid().as_raw());
}

/// uid 65534 with primary group `gid`, allowed as a client by `allow`: it is served, and
/// cannot take the prefill worker's empty slot.
fn client_cannot_become_a_worker(allow: impl FnOnce(&mut Config), gid: u32) {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: needs root to run a peer as uid {NOBODY}");
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("kvauth")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg = Config::embedded_default(dir.path().join("ctl.sock"));
    allow(&mut cfg);
    let mut stack = Stack::start(StackOptions::new(cfg, dir.path().join("stack")).unwrap())
        .unwrap_or_else(|e| panic!("{}", kvctld::stack::error_chain(&e)));
    let chmod = |p: &Path, mode| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap()
    };
    chmod(dir.path(), 0o755);
    chmod(stack.socket(), 0o777);
    let copy = |from: &Path, name: &str| {
        let to = dir.path().join(name);
        std::fs::copy(from, &to).unwrap();
        chmod(&to, 0o755);
        to
    };
    let kvctl = copy(&default_bin_dir().unwrap().join("kvctl"), "kvctl");
    let me = copy(&std::env::current_exe().unwrap(), "worker_auth");

    // As a client, uid 65534 is served.
    let out = Command::new(&kvctl)
        .arg("--socket")
        .arg(stack.socket())
        .args(["generate", "--tenant", "nobody", "--max-new", "5", "hello"])
        .uid(NOBODY)
        .gid(gid)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim_end(), "hello");

    // With the prefill slot empty, it still cannot take it.
    stack.kill(Daemon::Prefilld).unwrap();
    let empty = wait_until(Duration::from_secs(10), || {
        stack
            .status()
            .ok()
            .filter(|s| !worker_connected(s, Role::Prefill))
    });
    assert!(empty.is_some(), "prefilld still shown connected");
    let out = Command::new(&me)
        .args(["--exact", "impostor", "--ignored", "--nocapture"])
        .env("KVFENCE_IMPOSTOR_SOCKET", stack.socket())
        .uid(NOBODY)
        .gid(gid)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "impostor run: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let st = stack.status().unwrap();
    assert!(
        !worker_connected(&st, Role::Prefill),
        "an impostor holds the prefill slot"
    );
    // The real worker takes its slot back and requests are served again.
    stack.restart(Daemon::Prefilld).unwrap();
    let mut c = stack.client().unwrap();
    let ok = c
        .generate(
            "after",
            &libkv::model::tokenize(b"back again"),
            4,
            0,
            |_| {},
        )
        .unwrap();
    assert_eq!(libkv::model::detokenize(&ok.tokens), "back");
    let _ = stack.stop();
}
