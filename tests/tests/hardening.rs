//! kvctld against what an operator or a careless user does to it: a second kvctld on the
//! same socket, a socket taken over, socket activation, connections that say Hello and
//! then nothing (thousands, from one uid, while another uid is served), running out of file
//! descriptors, and users of `allowed_uids` outside systemd.
//!
//! The tests that need other uids run processes as uid 4242 (`kvflood`, `kvctl`) with
//! `setuid` in the child; they need root and say SKIPPED without it. Every wait is bounded;
//! build the binaries first (`cargo build --release --bins`).

use kvctld::client::{Client, ClientError};
use kvctld::stack::{Stack, StackOptions, error_chain};
use kvfence_tests::ops::{
    OTHER_GID, OTHER_UID, Reaped, STRANGER_UID, as_user, can_switch_uid, open_tempdir, rss_kib,
    run_bounded, spawn_kvctld, wait_for, write_config,
};
use kvfence_tests::{LogsOnPanic, bin_dir};
use libkv::RequestId;
use libkv::config::Config;
use libkv::model::{ReferenceModel, monolithic, tokenize};
use libkv::proto::{ErrorCode, Hello, Message, Role, Submit};
use libkv::sys::uds::{FrameReader, send_frame};
use nix::sys::signal::Signal;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const FLOOD: &str = env!("CARGO_BIN_EXE_kvflood");

fn socket_in(dir: &Path) -> PathBuf {
    dir.join("run").join("kvctld.sock")
}

fn status_ok(socket: &Path) -> bool {
    Client::connect(socket, Duration::from_secs(2))
        .and_then(|mut c| c.status())
        .is_ok()
}

fn kvctld_config(dir: &Path) -> (Config, PathBuf) {
    let cfg = Config::embedded_default(socket_in(dir));
    let path = dir.join("kvctld.toml");
    write_config(&path, &cfg);
    (cfg, path)
}

fn log_of(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

// ---- one socket path, one kvctld ---------------------------------------------------------

#[test]
fn a_second_kvctld_on_a_live_socket_refuses_and_the_first_keeps_serving() {
    let dir = open_tempdir("kvhard.");
    let _logs = LogsOnPanic(dir.path().to_path_buf());
    let cfg = Config::embedded_default(socket_in(dir.path()));
    let opts = StackOptions::new(cfg, dir.path().to_path_buf()).expect("options");
    let stack = Stack::start(opts).unwrap_or_else(|e| panic!("stack: {}", error_chain(&e)));
    let before = std::fs::metadata(stack.socket()).expect("socket").ino();

    let log = dir.path().join("second.log");
    let mut second = spawn_kvctld(&bin_dir(), stack.config_path(), &log);
    let status = second.wait_timeout(Duration::from_secs(10));
    let text = log_of(&log);
    assert!(
        status.is_some(),
        "a second kvctld on the live socket kept running:\n{text}"
    );
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{text}");
    assert!(
        text.contains("another kvctld") && text.contains("kvctld.sock"),
        "the refusal does not say why: {text}"
    );
    // The first daemon and its socket are untouched and still serve the stack.
    assert_eq!(
        std::fs::metadata(stack.socket()).expect("socket").ino(),
        before
    );
    let status = stack.status().expect("status from the first kvctld");
    assert_eq!(status.workers.len(), 2, "{status:?}");
    assert!(status.workers.iter().all(|w| w.connected), "{status:?}");
    let model = ReferenceModel::new(stack.config().geometry).expect("model");
    let prompt = b"still served by the first kvctld";
    let out = stack
        .client()
        .and_then(|mut c| c.generate("acme", &libkv::model::tokenize(prompt), 8, 0, |_| {}))
        .unwrap_or_else(|e| panic!("generate: {}", error_chain(&e)));
    let want = monolithic(&model, &tokenize(prompt), 8).expect("monolithic");
    assert_eq!(out.tokens, want.tokens);
}

#[test]
fn a_kvctld_started_beside_one_without_the_lock_refuses_a_live_socket() {
    // A live socket with no lock held (a kvctld of an older build, or the service manager's
    // socket): the connect probe sees it accept and refuses to replace it.
    let dir = open_tempdir("kvhard.");
    let (cfg, path) = kvctld_config(dir.path());
    std::fs::create_dir_all(cfg.control.socket.parent().unwrap()).unwrap();
    let other = UnixListener::bind(&cfg.control.socket).expect("bind");
    let ino = std::fs::metadata(&cfg.control.socket).unwrap().ino();
    let log = dir.path().join("kvctld.log");
    let mut k = spawn_kvctld(&bin_dir(), &path, &log);
    let status = k.wait_timeout(Duration::from_secs(10));
    let text = log_of(&log);
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{text}");
    assert!(text.contains("live socket"), "{text}");
    assert_eq!(std::fs::metadata(&cfg.control.socket).unwrap().ino(), ino);
    drop(other);
}

#[test]
fn the_socket_of_a_dead_kvctld_is_replaced() {
    let dir = open_tempdir("kvhard.");
    let (cfg, path) = kvctld_config(dir.path());
    let log = dir.path().join("kvctld.log");
    let mut first = spawn_kvctld(&bin_dir(), &path, &log);
    assert!(
        wait_for(Duration::from_secs(10), || status_ok(&cfg.control.socket)),
        "kvctld did not serve: {}",
        log_of(&log)
    );
    first.signal(Signal::SIGKILL);
    assert!(first.wait_timeout(Duration::from_secs(5)).is_some());
    let meta = std::fs::symlink_metadata(&cfg.control.socket).expect("the dead one's socket");
    assert!(meta.file_type().is_socket());
    let log2 = dir.path().join("kvctld-2.log");
    let mut second = spawn_kvctld(&bin_dir(), &path, &log2);
    assert!(
        wait_for(Duration::from_secs(10), || status_ok(&cfg.control.socket)),
        "a kvctld after a dead one did not serve: {}",
        log_of(&log2)
    );
    assert!(log_of(&log2).contains("replacing the stale socket"));
    second.signal(Signal::SIGTERM);
    assert!(second.wait_timeout(Duration::from_secs(10)).is_some());
    // Its own socket, removed at exit; the lock file stays.
    assert!(!cfg.control.socket.exists());
    assert!(kvctld::ctl::lock_path(&cfg.control.socket).exists());
}

#[test]
fn kvctld_at_exit_leaves_a_socket_that_is_no_longer_its_own() {
    let dir = open_tempdir("kvhard.");
    let (cfg, path) = kvctld_config(dir.path());
    let log = dir.path().join("kvctld.log");
    let mut k = spawn_kvctld(&bin_dir(), &path, &log);
    assert!(wait_for(Duration::from_secs(10), || status_ok(
        &cfg.control.socket
    )));
    // Someone else now owns the path (an operator moved the daemon's socket aside).
    std::fs::remove_file(&cfg.control.socket).unwrap();
    let replacement = UnixListener::bind(&cfg.control.socket).expect("bind");
    let ino = std::fs::metadata(&cfg.control.socket).unwrap().ino();
    k.signal(Signal::SIGTERM);
    let status = k.wait_timeout(Duration::from_secs(10));
    assert!(status.is_some_and(|s| s.success()), "{}", log_of(&log));
    let meta = std::fs::symlink_metadata(&cfg.control.socket)
        .unwrap_or_else(|e| panic!("kvctld removed a socket that was not its own: {e}"));
    assert_eq!(meta.ino(), ino);
    assert!(UnixStream::connect(&cfg.control.socket).is_ok());
    drop(replacement);
}

#[test]
fn a_socket_passed_by_the_service_manager_is_served_and_kept() {
    let dir = open_tempdir("kvhard.");
    let (cfg, path) = kvctld_config(dir.path());
    std::fs::create_dir_all(cfg.control.socket.parent().unwrap()).unwrap();
    let listener = UnixListener::bind(&cfg.control.socket).expect("bind");
    let ino = std::fs::metadata(&cfg.control.socket).unwrap().ino();
    let log = dir.path().join("kvctld.log");
    let out = std::fs::File::create(&log).unwrap();
    // As systemd does: the listening socket as fd 3, LISTEN_FDS=1, LISTEN_PID the daemon's.
    let child = Command::new("sh")
        .arg("-c")
        .arg(r#"exec 3<&0 0</dev/null; LISTEN_FDS=1 LISTEN_PID=$$ exec "$0" --config "$1""#)
        .arg(bin_dir().join("kvctld"))
        .arg(&path)
        .env("RUST_LOG", "info")
        .stdin(Stdio::from(std::os::fd::OwnedFd::from(listener)))
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .expect("spawning kvctld");
    let mut k = Reaped(child);
    assert!(
        wait_for(Duration::from_secs(10), || status_ok(&cfg.control.socket)),
        "{}",
        log_of(&log)
    );
    assert!(log_of(&log).contains("passed by the service manager"));
    // A kvctld started by hand beside it refuses: the activated one holds the lock.
    let log2 = dir.path().join("by-hand.log");
    let mut by_hand = spawn_kvctld(&bin_dir(), &path, &log2);
    let status = by_hand.wait_timeout(Duration::from_secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{}", log_of(&log2));
    assert!(status_ok(&cfg.control.socket));
    k.signal(Signal::SIGTERM);
    assert!(k.wait_timeout(Duration::from_secs(10)).is_some());
    // The socket unit's socket stays where it is.
    assert_eq!(
        std::fs::symlink_metadata(&cfg.control.socket)
            .expect("kvctld removed the service manager's socket")
            .ino(),
        ino
    );
}

// ---- what connections cost ------------------------------------------------------------

fn hello(stream: &UnixStream) {
    let frame = Message::from(Hello::new(Role::Client))
        .encode(RequestId(0))
        .unwrap();
    send_frame(stream, &frame, &[]).unwrap();
    let (_, msg, _) = FrameReader::new()
        .read_frame(stream, Some(Duration::from_secs(5)))
        .expect("HelloAck");
    assert!(matches!(msg, Message::HelloAck(_)), "{msg:?}");
}

/// Connections that each sent one large frame and then went quiet hold no buffer: before,
/// every one kept 64 KiB of reader buffer for as long as it stayed open.
#[test]
fn quiet_connections_hold_no_buffers_after_a_large_frame() {
    const CONNS: usize = 256;
    let dir = open_tempdir("kvhard.");
    let (cfg, path) = kvctld_config(dir.path());
    let log = dir.path().join("kvctld.log");
    let k = spawn_kvctld(&bin_dir(), &path, &log);
    assert!(wait_for(Duration::from_secs(10), || status_ok(
        &cfg.control.socket
    )));
    let base = rss_kib(k.pid());
    // A prompt far over max_context (4096): rejected, the connection stays open. Token ids
    // of 28 bits take 4 bytes each on the wire: a frame of 512 KiB.
    let submit = Message::from(Submit {
        tenant: "acme".into(),
        prompt: vec![0x0FFF_FFFF; libkv::proto::MAX_PROMPT_TOKENS],
        max_new_tokens: 8,
        deadline_ms: 0,
        sampling: libkv::proto::Sampling::GREEDY,
    })
    .encode(RequestId(0))
    .unwrap();
    let mut conns = Vec::with_capacity(CONNS);
    for _ in 0..CONNS {
        let s = UnixStream::connect(&cfg.control.socket).unwrap();
        hello(&s);
        send_frame(&s, &submit, &[]).unwrap();
        let (_, msg, _) = FrameReader::new()
            .read_frame(&s, Some(Duration::from_secs(5)))
            .expect("answer");
        assert!(
            matches!(&msg, Message::Error(e) if e.code == ErrorCode::Rejected),
            "{msg:?}"
        );
        conns.push(s);
    }
    let held = rss_kib(k.pid());
    let grown = held.saturating_sub(base);
    eprintln!(
        "kvctld RSS: {base} KiB before, {held} KiB with {CONNS} quiet connections that each \
         sent 512 KiB ({} bytes per connection)",
        grown * 1024 / CONNS as u64
    );
    assert!(
        grown < 4 * 1024,
        "{CONNS} quiet connections grew kvctld by {grown} KiB"
    );
    drop(conns);
}

fn flood_config(dir: &Path) -> Config {
    let mut cfg = Config::embedded_default(socket_in(dir));
    cfg.control.allowed_uids = vec![OTHER_UID];
    cfg.control.socket_mode = 0o666;
    cfg
}

/// Runs kvflood as [`OTHER_UID`]; returns the child and a reader of its JSON lines.
fn flood(
    socket: &Path,
    connections: usize,
    hold_ms: u64,
) -> (Reaped, BufReader<std::process::ChildStdout>) {
    flood_as(socket, connections, hold_ms, Some((OTHER_UID, OTHER_GID)))
}

/// Runs kvflood as `user` (uid, gid), or as this process's user.
fn flood_as(
    socket: &Path,
    connections: usize,
    hold_ms: u64,
    user: Option<(u32, u32)>,
) -> (Reaped, BufReader<std::process::ChildStdout>) {
    let mut cmd = Command::new(FLOOD);
    cmd.arg("--socket")
        .arg(socket)
        .arg("--connections")
        .arg(connections.to_string())
        .arg("--hello")
        .arg("--hold-ms")
        .arg(hold_ms.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some((uid, gid)) = user {
        as_user(&mut cmd, uid, gid);
    }
    let mut child = cmd.spawn().expect("spawning kvflood");
    let out = BufReader::new(child.stdout.take().unwrap());
    (Reaped(child), out)
}

fn json_line(r: &mut BufReader<std::process::ChildStdout>) -> serde_json::Value {
    let mut line = String::new();
    r.read_line(&mut line).expect("kvflood output");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("kvflood said {line:?}: {e}"))
}

fn counter(v: &serde_json::Value, name: &str) -> u64 {
    v.get(name).and_then(serde_json::Value::as_u64).unwrap_or(0)
}

fn kvctld_counter(stack: &Stack, name: &str) -> u64 {
    stack
        .status()
        .map(|s| {
            s.counters
                .iter()
                .find(|(n, _)| n == name)
                .map_or(0, |(_, v)| *v)
        })
        .unwrap_or(0)
}

/// Several thousand connections from one uid that say Hello and then nothing: that uid gets
/// `max_connections_per_uid` of them, the rest are turned away, another uid's requests keep
/// succeeding throughout, and the idle ones are closed after `idle_timeout_ms`.
#[test]
fn a_flood_of_idle_connections_from_one_uid_leaves_the_others_served() {
    if !can_switch_uid() {
        eprintln!("SKIPPED: the flood runs as uid {OTHER_UID}, which needs root");
        return;
    }
    const FLOODERS: usize = 4200;
    const PER_UID: u32 = 512;
    let dir = open_tempdir("kvhard.");
    let _logs = LogsOnPanic(dir.path().to_path_buf());
    let mut cfg = flood_config(dir.path());
    cfg.control.max_connections_per_uid = PER_UID;
    cfg.control.idle_timeout_ms = 4000;
    let opts = StackOptions::new(cfg, dir.path().to_path_buf()).expect("options");
    let stack = Stack::start(opts).unwrap_or_else(|e| panic!("stack: {}", error_chain(&e)));
    let pid = stack.pid("kvctld").expect("kvctld pid");
    let model = ReferenceModel::new(stack.config().geometry).expect("model");
    let one_request = |i: usize| -> Result<(), String> {
        let prompt = format!("request {i} of a uid that is not flooding");
        let out = stack
            .client()
            .and_then(|mut c| {
                c.generate(
                    "acme",
                    &libkv::model::tokenize(prompt.as_bytes()),
                    8,
                    5000,
                    |_| {},
                )
            })
            .map_err(|e| error_chain(&e))?;
        let want = monolithic(&model, &tokenize(prompt.as_bytes()), 8).expect("monolithic");
        (out.tokens == want.tokens)
            .then_some(())
            .ok_or_else(|| "output differs".to_owned())
    };
    one_request(0).expect("before the flood");
    let before = rss_kib(pid);

    let begun = Instant::now();
    let (mut flooder, mut out) = flood(stack.socket(), FLOODERS, 12_000);
    let holding = json_line(&mut out);
    let opened_in = begun.elapsed();
    let during = rss_kib(pid);
    assert_eq!(
        counter(&holding, "hello_ack"),
        u64::from(PER_UID),
        "{holding}"
    );
    assert_eq!(
        counter(&holding, "hello_ack")
            + counter(&holding, "turned_away")
            + counter(&holding, "backlog_full"),
        FLOODERS as u64,
        "{holding}"
    );
    // Another uid (root here) is served while the flood holds its connections.
    let served_during: Vec<Result<(), String>> = (1..=20).map(one_request).collect();
    for (i, r) in served_during.iter().enumerate() {
        assert!(r.is_ok(), "request {i} during the flood: {r:?}");
    }
    assert!(kvctld_counter(&stack, "connections_refused_uid_limit") > 0);

    // The flood's connections are closed once idle past idle_timeout_ms.
    let done = json_line(&mut out);
    assert_eq!(
        counter(&done, "closed_by_kvctld"),
        u64::from(PER_UID),
        "{done}"
    );
    assert!(flooder.wait_timeout(Duration::from_secs(10)).is_some());
    assert!(wait_for(Duration::from_secs(5), || kvctld_counter(
        &stack,
        "connections_closed_idle"
    ) >= u64::from(PER_UID)));
    let after = rss_kib(pid);
    one_request(99).expect("after the flood");
    eprintln!(
        "flood of {FLOODERS} idle connections from uid {OTHER_UID} (opened in {opened_in:?}): \
         {} accepted, {} turned away, {} found the backlog full; kvctld RSS {before} KiB \
         before, {during} KiB during, {after} KiB after; 20 of 20 requests of uid 0 served \
         during the flood",
        counter(&holding, "hello_ack"),
        counter(&holding, "turned_away"),
        counter(&holding, "backlog_full"),
    );
    assert!(begun.elapsed() < Duration::from_secs(60));
}

/// Many Hello'd idle connections cost little each (the README's figure): kvctld's RSS with
/// 4000 of them.
#[test]
fn idle_connections_cost_little_each() {
    if !can_switch_uid() {
        eprintln!("SKIPPED: the connections come from uid {OTHER_UID}, which needs root");
        return;
    }
    const CONNS: usize = 4000;
    let dir = open_tempdir("kvhard.");
    let mut cfg = flood_config(dir.path());
    cfg.control.max_connections_per_uid = libkv::config::MAX_CONNECTIONS;
    cfg.control.idle_timeout_ms = 0;
    let path = dir.path().join("kvctld.toml");
    write_config(&path, &cfg);
    let log = dir.path().join("kvctld.log");
    let k = spawn_kvctld(&bin_dir(), &path, &log);
    assert!(wait_for(Duration::from_secs(10), || status_ok(
        &cfg.control.socket
    )));
    let before = rss_kib(k.pid());
    let (mut flooder, mut out) = flood(&cfg.control.socket, CONNS, 1500);
    let holding = json_line(&mut out);
    let during = rss_kib(k.pid());
    assert_eq!(counter(&holding, "hello_ack"), CONNS as u64, "{holding}");
    let _ = json_line(&mut out);
    assert!(flooder.wait_timeout(Duration::from_secs(10)).is_some());
    assert!(wait_for(Duration::from_secs(5), || {
        Client::connect(&cfg.control.socket, Duration::from_secs(2))
            .and_then(|mut c| c.status())
            .is_ok_and(|s| {
                s.counters
                    .iter()
                    .any(|(n, v)| n == "connections" && *v == 1)
            })
    }));
    let after = rss_kib(k.pid());
    let per = (during.saturating_sub(before)) * 1024 / CONNS as u64;
    eprintln!(
        "{CONNS} idle Hello'd connections: kvctld RSS {before} KiB before, {during} KiB \
         with them open ({per} bytes each), {after} KiB after they closed"
    );
    assert!(per < 4096, "{per} bytes per idle connection");
}

/// A client connection with no request in flight is closed after `idle_timeout_ms`, with an
/// error frame naming the key; one whose request is in flight is not, however long the
/// request takes.
#[test]
fn an_idle_client_is_closed_but_not_one_with_a_request_in_flight() {
    let dir = open_tempdir("kvhard.");
    let _logs = LogsOnPanic(dir.path().to_path_buf());
    let mut cfg = Config::embedded_default(socket_in(dir.path()));
    cfg.control.idle_timeout_ms = 400;
    let opts = StackOptions::new(cfg, dir.path().to_path_buf()).expect("options");
    let mut stack = Stack::start(opts).unwrap_or_else(|e| panic!("stack: {}", error_chain(&e)));

    let idle = UnixStream::connect(stack.socket()).unwrap();
    hello(&idle);
    let t = Instant::now();
    let got = FrameReader::new().read_frame(&idle, Some(Duration::from_secs(5)));
    let waited = t.elapsed();
    match got {
        Ok((_, Message::Error(e), _)) => {
            assert_eq!(e.code, ErrorCode::Timeout);
            assert!(
                e.message.contains("control.idle_timeout_ms"),
                "{}",
                e.message
            );
        }
        other => panic!("an idle connection was not closed with an error: {other:?}"),
    }
    assert!(
        waited >= Duration::from_millis(350) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    assert!(matches!(
        FrameReader::new().read_frame(&idle, Some(Duration::from_secs(2))),
        Err(libkv::sys::uds::UdsError::Closed)
    ));

    // A request that waits longer than the idle timeout: decoded is stopped, so the
    // reservation never comes; the request fails on its stage deadline (bootstrap, 1000 ms),
    // not because its connection was idle.
    stack.signal("decode-0", Signal::SIGSTOP).unwrap();
    let mut client = stack.client().unwrap();
    let r = client.generate(
        "acme",
        &libkv::model::tokenize(b"a request that outlives the idle timeout"),
        8,
        5000,
        |_| {},
    );
    stack.signal("decode-0", Signal::SIGCONT).unwrap();
    match r {
        Err(ClientError::Server { code, message }) => {
            assert_eq!(code, ErrorCode::Timeout, "{message}");
            assert!(message.contains("deadlines.bootstrap"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

/// kvctld under a low open-files limit, flooded past it: each connection it cannot hold is
/// turned away at once, and once the flood is gone it accepts again (before, the backlog
/// stayed full of connections nobody accepted and the next client waited in vain).
#[test]
fn accepting_resumes_after_running_out_of_descriptors() {
    let dir = open_tempdir("kvhard.");
    let _logs = LogsOnPanic(dir.path().to_path_buf());
    let mut cfg = Config::embedded_default(socket_in(dir.path()));
    cfg.control.max_connections_per_uid = libkv::config::MAX_CONNECTIONS;
    cfg.control.idle_timeout_ms = 0;
    let mut opts = StackOptions::new(cfg, dir.path().to_path_buf()).expect("options");
    opts.wrap.insert(
        "kvctld".into(),
        ["sh", "-c", r#"ulimit -n 128 && exec "$@""#, "sh"]
            .map(String::from)
            .to_vec(),
    );
    let stack = Stack::start(opts).unwrap_or_else(|e| panic!("stack: {}", error_chain(&e)));
    // The flood is this test's own uid (the limit per uid is the most there is).
    let (mut flooder, mut out) = flood_as(stack.socket(), 1500, 1000, None);
    let holding = json_line(&mut out);
    let accepted = counter(&holding, "hello_ack");
    assert!(accepted < 128, "{holding}");
    assert!(
        counter(&holding, "turned_away") > 0,
        "nothing was turned away while out of descriptors: {holding}"
    );
    let _ = json_line(&mut out);
    assert!(flooder.wait_timeout(Duration::from_secs(10)).is_some());
    // The flood is gone: the next client gets its answer at once.
    let mut kvctl = Command::new(bin_dir().join("kvctl"));
    kvctl.arg("--socket").arg(stack.socket()).arg("status");
    let ran = run_bounded(&mut kvctl, None, Duration::from_secs(8));
    assert!(
        ran.ok() && ran.elapsed < Duration::from_secs(3),
        "{}",
        kvfence_tests::ops::describe("kvctl status after the flood", &ran)
    );
    assert!(kvctld_counter(&stack, "connections_refused_no_fds") > 0);
}

// ---- allowed_uids outside systemd ------------------------------------------------------

/// kvctld started by hand (no systemd) with `allowed_uids` and a socket group: a listed uid
/// in that group connects; before, kvctld made the directory and socket root's only and the
/// allowed user got "Permission denied".
#[test]
fn allowed_uids_can_connect_to_a_socket_kvctld_made() {
    if !can_switch_uid() {
        eprintln!("SKIPPED: the client runs as uid {OTHER_UID}, which needs root");
        return;
    }
    let dir = open_tempdir("kvhard.");
    let _logs = LogsOnPanic(dir.path().to_path_buf());
    let mut cfg = Config::embedded_default(socket_in(dir.path()));
    cfg.control.allowed_uids = vec![OTHER_UID];
    cfg.control.socket_group = Some(OTHER_GID.to_string());
    let opts = StackOptions::new(cfg, dir.path().to_path_buf()).expect("options");
    let stack = Stack::start(opts).unwrap_or_else(|e| panic!("stack: {}", error_chain(&e)));
    let run_dir = stack.socket().parent().unwrap();
    let dmeta = std::fs::metadata(run_dir).unwrap();
    assert_eq!(dmeta.permissions().mode() & 0o7777, 0o750);
    assert_eq!(dmeta.gid(), OTHER_GID);
    let smeta = std::fs::metadata(stack.socket()).unwrap();
    assert_eq!(smeta.permissions().mode() & 0o7777, 0o660);
    assert_eq!(smeta.gid(), OTHER_GID);

    let kvctl = |uid: u32, gid: u32, args: &[&str]| {
        let mut cmd = Command::new(bin_dir().join("kvctl"));
        cmd.arg("--socket").arg(stack.socket()).args(args);
        as_user(&mut cmd, uid, gid);
        run_bounded(&mut cmd, None, Duration::from_secs(20))
    };
    let ran = kvctl(OTHER_UID, OTHER_GID, &["status"]);
    assert!(
        ran.ok(),
        "{}",
        kvfence_tests::ops::describe("allowed uid", &ran)
    );
    let ran = kvctl(
        OTHER_UID,
        OTHER_GID,
        &["generate", "--tenant", "acme", "an allowed user's prompt"],
    );
    assert!(
        ran.ok(),
        "{}",
        kvfence_tests::ops::describe("allowed uid", &ran)
    );
    // A uid neither allowed nor in the group cannot open the socket file.
    let ran = kvctl(STRANGER_UID, STRANGER_UID, &["status"]);
    assert_eq!(
        ran.code(),
        Some(6),
        "{}",
        kvfence_tests::ops::describe("stranger", &ran)
    );
    // Nor can an allowed uid outside the group: the file mode is the first gate.
    let ran = kvctl(OTHER_UID, STRANGER_UID, &["status"]);
    assert_eq!(
        ran.code(),
        Some(6),
        "{}",
        kvfence_tests::ops::describe("no group", &ran)
    );
}

/// With `socket_mode = 0o666` a uid that may open the file but is not in `allowed_uids` is
/// turned away by kvctld itself, with a message saying so.
#[test]
fn a_world_writable_socket_still_refuses_uids_not_allowed() {
    if !can_switch_uid() {
        eprintln!("SKIPPED: the client runs as uid {STRANGER_UID}, which needs root");
        return;
    }
    let dir = open_tempdir("kvhard.");
    let mut cfg = flood_config(dir.path());
    cfg.control.socket_mode = 0o666;
    let path = dir.path().join("kvctld.toml");
    write_config(&path, &cfg);
    let log = dir.path().join("kvctld.log");
    let _k = spawn_kvctld(&bin_dir(), &path, &log);
    assert!(wait_for(Duration::from_secs(10), || status_ok(
        &cfg.control.socket
    )));
    let dmeta = std::fs::metadata(cfg.control.socket.parent().unwrap()).unwrap();
    assert_eq!(dmeta.permissions().mode() & 0o7777, 0o755);
    let mut cmd = Command::new(bin_dir().join("kvctl"));
    cmd.arg("--socket").arg(&cfg.control.socket).arg("status");
    as_user(&mut cmd, STRANGER_UID, STRANGER_UID);
    let ran = run_bounded(&mut cmd, None, Duration::from_secs(10));
    assert_eq!(
        ran.code(),
        Some(6),
        "{}",
        kvfence_tests::ops::describe("stranger", &ran)
    );
    assert!(ran.stderr.contains("not allowed"), "{}", ran.stderr);
    let mut cmd = Command::new(bin_dir().join("kvctl"));
    cmd.arg("--socket").arg(&cfg.control.socket).arg("status");
    as_user(&mut cmd, OTHER_UID, OTHER_GID);
    let ran = run_bounded(&mut cmd, None, Duration::from_secs(10));
    assert!(
        ran.ok(),
        "{}",
        kvfence_tests::ops::describe("allowed", &ran)
    );
}
