//! One control plane across hosts, led by one of two kvctld instances elected through etcd
//! (`[election]`), each on a host of its own; five network namespaces on one switch
//! ([`Lan`]):
//!
//! | host      | runs                                        |
//! |-----------|---------------------------------------------|
//! | 192.0.2.1 | etcd, and kvctl as a client                 |
//! | 192.0.2.2 | kvctld `a` (TLS on :7443)                   |
//! | 192.0.2.3 | kvctld `b` (TLS on :7443)                   |
//! | 192.0.2.4 | prefilld (pages over TCP on :7471)          |
//! | 192.0.2.5 | decoded                                     |
//!
//! The workers and kvctl find the leader in etcd and reach it over mutual TLS; the test
//! itself reads each kvctld's status on its Unix socket (the namespaces share one
//! filesystem), which a standby has not bound.
//!
//! Shown, with a lease of 2 s:
//! - requests equal the monolithic path, from the test and from kvctl on another host;
//! - **takeover**: the leader is SIGKILLed 20 times under a load of concurrent requests; each
//!   time the standby leads and both workers re-register with it, new requests succeed,
//!   every request either equals the monolithic path or fails with a retryable error, and
//!   no page is left held. Each takeover's time is printed (`takeover:` lines; a summary
//!   with the median and maximum): a benchmark, not a timed assertion;
//! - **SIGSTOP**: the leader is stopped for 30 s under load; the workers leave it as soon
//!   as etcd names the standby (they watch the leader's key), requests are served during
//!   the stop (`sigstop:` line: how soon, how many), and once resumed the old leader exits;
//! - **partition**: the leader's link goes down; it fails what it holds and exits before
//!   the standby can win (before its lease expired at etcd), the standby leads, and once
//!   the link is back there is still one leader;
//! - **etcd stopped**: the leader stops admitting (it exits) once it cannot renew; when etcd
//!   is back a kvctld leads again and serves;
//! - **membership**: `kvctl status` lists the leader and every worker as published in etcd;
//!   a worker that stops renewing its own lease (SIGSTOP) is treated as lost by the leader,
//!   and serves again after it registers anew.
//!
//! Needs root, `ip netns` and etcd; without them it says SKIPPED and passes (under CI a
//! missing etcd fails). Build the binaries first (`cargo build --release --bins`). Bounded:
//! every wait has a limit, and the whole test must end within [`TEST_BOUND`].

use kvctld::client::{Client, ClientError};
use kvctld::stack::{default_bin_dir, error_chain, wait_until};
use kvfence_tests::certs::{KVCTLD_NAME, TestCa};
use kvfence_tests::etcd_server::{self, EtcdServer};
use kvfence_tests::hosts::{self, Hosts, Lan};
use kvfence_tests::{counter, worker_idle_and_free};
use libkv::config::{Config, Election, Transfer, TransportKind};
use libkv::model::{Output, ReferenceModel, detokenize, monolithic, tokenize};
use libkv::proto::{ErrorCode, StatusReply};
use nix::sys::signal::{Signal, kill};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

const ETCD_HOST: &str = "192.0.2.1";
const KVCTLD_HOSTS: [&str; 2] = ["192.0.2.2", "192.0.2.3"];
const PREFILL_HOST: &str = "192.0.2.4";
const DECODE_HOST: &str = "192.0.2.5";
const PREFILL: &str = "prefill-0.kvfence.test";
const DECODE: &str = "decode-0.kvfence.test";
const CLIENT: &str = "app.kvfence.test";
const TTL_S: u32 = 2;
const KILLS: usize = 20;
/// Generous: a takeover that has not happened by then never will.
const WAIT: Duration = Duration::from_secs(30);
/// How long the leader is stopped (SIGSTOP) under load.
const STOP_FOR: Duration = Duration::from_secs(30);
const TEST_BOUND: Duration = Duration::from_secs(600);

/// The lan's host index of each role.
const ETCD: usize = 0;
const KVCTLD: [usize; 2] = [1, 2];
const PREFILLD: usize = 3;
const DECODED: usize = 4;

struct Cluster {
    bin: PathBuf,
    /// Behind a lock so that the load's threads share the cluster while kvctlds are
    /// killed and started.
    kvctld: Mutex<[Option<Child>; 2]>,
    workers: Vec<Child>,
    // dropped in this order after the processes: etcd, the namespaces, the files
    etcd: EtcdServer,
    lan: Lan,
    dir: tempfile::TempDir,
}

impl Cluster {
    fn d(&self) -> &Path {
        self.dir.path()
    }

    fn socket(&self, i: usize) -> PathBuf {
        self.d().join(format!("kvctld-{i}.sock"))
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.d().join(format!("{name}.log"))).unwrap_or_default()
    }

    /// `binary --config DIR/NAME.toml ARGS` on host `host`, its output appended to NAME.log.
    fn spawn(&self, host: usize, binary: &str, name: &str, args: &[&str]) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.d().join(format!("{name}.log")))
            .expect("log file");
        let mut cmd = Hosts::exec(&self.lan.hosts[host]);
        cmd.push(self.bin.join(binary).display().to_string());
        Command::new(&cmd[0])
            .args(&cmd[1..])
            .arg("--config")
            .arg(self.d().join(format!("{name}.toml")))
            .args(args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {binary}: {e}"))
    }

    fn start_kvctld(&self, i: usize) {
        let child = self.spawn(KVCTLD[i], "kvctld", &format!("kvctld-{i}"), &[]);
        self.kvctld.lock().unwrap()[i] = Some(child);
    }

    /// The status of kvctld `i` on its socket: only a leader has bound it.
    fn status_of(&self, i: usize) -> Option<StatusReply> {
        let mut c = Client::connect(&self.socket(i), Duration::from_secs(2)).ok()?;
        c.status().ok()
    }

    /// The leader, once one has both workers registered.
    fn serving_leader(&self, within: Duration) -> Option<usize> {
        wait_until(within, || {
            (0..2).find(|&i| self.status_of(i).is_some_and(|s| both_registered(&s)))
        })
    }

    /// SIGKILLs kvctld `i` and reaps it.
    fn kill_kvctld(&self, i: usize) {
        let child = self.kvctld.lock().unwrap()[i].take();
        if let Some(mut c) = child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The process id of kvctld `i`, which must be running.
    fn kvctld_pid(&self, i: usize) -> nix::unistd::Pid {
        let all = self.kvctld.lock().unwrap();
        let pid = all[i].as_ref().expect("kvctld running").id();
        nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid"))
    }

    /// Whether kvctld `i` has exited on its own by now (reaped if so).
    fn exited(&self, i: usize) -> bool {
        let mut all = self.kvctld.lock().unwrap();
        match all[i].as_mut().map(Child::try_wait) {
            Some(Ok(Some(_))) | None => {
                all[i] = None;
                true
            }
            _ => false,
        }
    }

    /// How many kvctld lines of the log of `i` contain `what`.
    fn said(&self, i: usize, what: &str) -> usize {
        self.log(&format!("kvctld-{i}")).matches(what).count()
    }

    fn logs(&self) -> String {
        ["kvctld-0", "kvctld-1", "prefill-0", "decode-0"]
            .iter()
            .map(|n| {
                let text = self.log(n);
                let tail: Vec<&str> = text.lines().rev().take(25).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                format!("--- {n} ---\n{}\n", tail.join("\n"))
            })
            .collect::<String>()
            + &format!("--- etcd ---\n{}\n", self.etcd.log_tail(10))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let kvctld = self.kvctld.get_mut().unwrap_or_else(|e| e.into_inner());
        for c in kvctld.iter_mut().flatten().chain(self.workers.iter_mut()) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn both_registered(s: &StatusReply) -> bool {
    ["prefill-0", "decode-0"]
        .iter()
        .all(|id| s.workers.iter().any(|w| w.id == *id && w.connected))
}

fn write(path: &Path, c: &Config) {
    std::fs::write(path, toml::to_string(c).expect("toml")).expect("writing a config");
}

/// Starts etcd, both kvctld (0 first, so it leads), the workers; waits until 0 serves.
fn start() -> Cluster {
    let bin = default_bin_dir().expect("target directory");
    for d in ["kvctld", "prefilld", "decoded", "kvctl"] {
        assert!(
            bin.join(d).is_file(),
            "{d} missing: run `cargo build --release --bins` first"
        );
    }
    let lan = Lan::create(
        "tko",
        &[
            ETCD_HOST,
            KVCTLD_HOSTS[0],
            KVCTLD_HOSTS[1],
            PREFILL_HOST,
            DECODE_HOST,
        ],
    )
    .unwrap_or_else(|e| panic!("namespaces: {e}"));
    let dir = tempfile::Builder::new()
        .prefix("kvtko.")
        .tempdir_in("/tmp")
        .expect("temp dir");
    let etcd = EtcdServer::start(&lan.hosts[ETCD], ETCD_HOST, dir.path());
    let d = dir.path();
    let ca = TestCa::new(d, "ca");
    let server = ca.issue("kvctld", &[KVCTLD_NAME]);

    let mut base = Config::embedded_default(d.join("unused.sock"));
    base.transfer = Transfer {
        transport: TransportKind::Tcp,
        listen: Some(format!("{PREFILL_HOST}:7471")),
    };
    base.election = Election {
        etcd: Some(etcd.endpoint.clone().into()),
        ttl_s: TTL_S,
        margin_ms: 600,
        ..Election::default()
    };
    for (i, host) in KVCTLD_HOSTS.iter().enumerate() {
        let mut c = base.clone();
        c.control.socket = d.join(format!("kvctld-{i}.sock"));
        c.tls = ca.kvctld(
            &server,
            &format!("{host}:7443"),
            &[PREFILL, DECODE],
            &[CLIENT],
        );
        c.tls.server_name = Some(KVCTLD_NAME.into());
        write(&d.join(format!("kvctld-{i}.toml")), &c);
    }
    // The peers: a certificate each; the leader's address comes from etcd.
    for (stem, name) in [
        ("prefill-0", PREFILL),
        ("decode-0", DECODE),
        ("client", CLIENT),
    ] {
        let mut c = base.clone();
        c.tls = ca.peer(&ca.issue(stem, &[name]), "unused:1");
        c.tls.connect = None;
        write(&d.join(format!("{stem}.toml")), &c);
    }
    let mut cluster = Cluster {
        bin,
        kvctld: Mutex::new([None, None]),
        workers: Vec::new(),
        etcd,
        lan,
        dir,
    };
    cluster.start_kvctld(0);
    let led = wait_until(WAIT, || cluster.status_of(0));
    assert!(led.is_some(), "kvctld 0 did not lead:\n{}", cluster.logs());
    cluster.start_kvctld(1);
    let prefill = cluster.spawn(PREFILLD, "prefilld", "prefill-0", &["--id", "prefill-0"]);
    let decode = cluster.spawn(DECODED, "decoded", "decode-0", &["--id", "decode-0"]);
    cluster.workers = vec![prefill, decode];
    assert_eq!(
        cluster.serving_leader(WAIT),
        Some(0),
        "the workers did not register with kvctld 0:\n{}",
        cluster.logs()
    );
    let standby = wait_until(WAIT, || (cluster.said(1, "standby:") > 0).then_some(()));
    assert!(
        standby.is_some(),
        "kvctld 1 is no standby:\n{}",
        cluster.logs()
    );
    cluster
}

/// The prompts of the load, with their monolithic outputs.
fn jobs(model: &ReferenceModel) -> Vec<(Vec<u32>, u32, Output)> {
    (0..6)
        .map(|i| {
            let p = kvfence_tests::prompt("acme", i, 10 + i * 61);
            let max_new = 4 + u32::try_from(i).unwrap();
            let want = monolithic(model, &tokenize(&p), max_new).expect("monolithic");
            (tokenize(&p), max_new, want)
        })
        .collect()
}

/// Whether a failed request failed the way a request on a leader that went away may:
/// the connection closed or refused, or an error that says to retry. Never a verification
/// failure, an internal error or a refusal of the request itself.
fn retryable(e: &ClientError) -> bool {
    match e.server_code() {
        Some(code) => matches!(
            code,
            ErrorCode::ShuttingDown | ErrorCode::WorkerLost | ErrorCode::PoolFull
        ),
        None => !matches!(
            e,
            ClientError::Unexpected { .. } | ClientError::BadReply { .. }
        ),
    }
}

/// What the load saw.
#[derive(Debug, Default)]
struct Seen {
    equal: u64,
    retryable: u64,
    /// Wrong output or a non-retryable error: each one fails the test.
    wrong: Vec<String>,
}

/// Requests from `threads` threads, each to whichever kvctld leads, until `stop`.
fn load<'a>(
    s: &'a thread::Scope<'a, '_>,
    cluster: &'a Cluster,
    jobs: &'a [(Vec<u32>, u32, Output)],
    stop: &'a AtomicBool,
    seen: &'a Mutex<Seen>,
) {
    for t in 0..2 {
        s.spawn(move || {
            let mut n = t;
            // the kvctld that answered last is asked first: a stopped one costs a
            // handshake's timeout each time it is tried
            let mut last = 0;
            while !stop.load(Ordering::Relaxed) {
                let (prompt, max_new, want) = &jobs[n % jobs.len()];
                n += 1;
                let leader = [last, 1 - last].into_iter().find(|&i| {
                    cluster.socket(i).exists() && {
                        Client::connect(&cluster.socket(i), Duration::from_secs(1)).is_ok()
                    }
                });
                let Some(i) = leader else {
                    thread::sleep(Duration::from_millis(20));
                    continue;
                };
                last = i;
                let out = Client::connect(&cluster.socket(i), Duration::from_secs(2))
                    .and_then(|mut c| c.generate("acme", prompt, *max_new, 10_000, |_| {}));
                let mut seen = seen.lock().unwrap();
                match out {
                    Ok(o) if o.tokens == want.tokens && o.done.signature == want.signature => {
                        seen.equal += 1;
                    }
                    Ok(o) => seen.wrong.push(format!(
                        "output differs from the monolithic path: {:?} vs {:?}",
                        o.tokens, want.tokens
                    )),
                    Err(e) if retryable(&e) => {
                        seen.retryable += 1;
                        drop(seen);
                        thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => seen.wrong.push(error_chain(&e)),
                }
            }
        });
    }
}

/// Every page free on the workers, as the leader sees them, and nothing in flight.
fn wait_all_free(cluster: &Cluster, leader: usize) {
    let mut last = None;
    let free = wait_until(WAIT, || {
        let s = cluster.status_of(leader)?;
        let done = ["prefill-0", "decode-0"].iter().all(|id| {
            s.workers
                .iter()
                .any(|w| w.id == *id && worker_idle_and_free(w))
        }) && counter(&s, "in_flight") == Some(0);
        last = Some(s);
        done.then_some(())
    });
    assert!(
        free.is_some(),
        "pages still held after the load: {last:#?}\n{}",
        cluster.logs()
    );
}

fn kvctl(cluster: &Cluster, args: &[&str]) -> std::process::Output {
    let mut cmd = Hosts::exec(&cluster.lan.hosts[ETCD]);
    cmd.push(cluster.bin.join("kvctl").display().to_string());
    Command::new(&cmd[0])
        .args(&cmd[1..])
        .arg("--config")
        .arg(cluster.d().join("client.toml"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running kvctl")
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[test]
fn two_kvctld_elected_through_etcd_take_over_from_each_other() {
    if let Some(why) = hosts::cannot_run() {
        eprintln!("SKIPPED: takeover: {why}");
        return;
    }
    if !etcd_server::available() {
        eprintln!("SKIPPED: takeover: no etcd (apt install etcd-server)");
        return;
    }
    let begun = Instant::now();
    let cluster = start();
    let model =
        ReferenceModel::new(Config::embedded_default(PathBuf::new()).geometry).expect("model");
    let jobs = jobs(&model);

    // Requests equal the monolithic path: from here, and from kvctl on etcd's host, which
    // finds the leader in etcd and reaches it over TLS.
    for (prompt, max_new, want) in &jobs {
        let out = Client::connect(&cluster.socket(0), Duration::from_secs(2))
            .and_then(|mut c| c.generate("acme", prompt, *max_new, 10_000, |_| {}))
            .unwrap_or_else(|e| panic!("{}\n{}", error_chain(&e), cluster.logs()));
        assert_eq!(out.tokens, want.tokens);
        assert_eq!(out.done.signature, want.signature);
    }
    let want = monolithic(&model, &tokenize(b"who leads"), 5).expect("monolithic");
    let generate = [
        "generate",
        "--tenant",
        "acme",
        "--max-new",
        "5",
        "who leads",
    ];
    let out = kvctl(&cluster, &generate);
    assert!(out.status.success(), "{out:?}\n{}", cluster.logs());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim_end(),
        detokenize(&want.tokens).trim_end()
    );

    // Takeover: SIGKILL the leader under load, KILLS times. Each time: the standby leads
    // (binds its socket) and both workers register with it; then the killed one starts
    // again, as the next standby.
    let stop = AtomicBool::new(false);
    let seen = Mutex::new(Seen::default());
    let mut leads: Vec<Duration> = Vec::new();
    let mut serves: Vec<Duration> = Vec::new();
    let mut leader = 0;
    thread::scope(|s| {
        load(s, &cluster, &jobs, &stop, &seen);
        for kill in 0..KILLS {
            let standby = 1 - leader;
            let before = seen.lock().unwrap().equal;
            let _ = wait_until(WAIT, || (seen.lock().unwrap().equal > before).then_some(()));
            let t0 = Instant::now();
            cluster.kill_kvctld(leader);
            let led = wait_until(WAIT, || cluster.status_of(standby).map(|_| t0.elapsed()));
            let served = cluster.serving_leader(WAIT).map(|_| t0.elapsed());
            let (Some(led), Some(served)) = (led, served) else {
                stop.store(true, Ordering::Relaxed);
                panic!(
                    "kill {kill}: kvctld {standby} did not take over:\n{}",
                    cluster.logs()
                );
            };
            eprintln!(
                "takeover: kill {kill}: kvctld {standby} leads after {} ms, serves both \
                 workers after {} ms",
                led.as_millis(),
                served.as_millis()
            );
            leads.push(led);
            serves.push(served);
            // New requests succeed on the new leader.
            let after = seen.lock().unwrap().equal;
            let more = wait_until(WAIT, || (seen.lock().unwrap().equal > after).then_some(()));
            if more.is_none() {
                stop.store(true, Ordering::Relaxed);
                panic!(
                    "kill {kill}: no request succeeded after the takeover:\n{}",
                    cluster.logs()
                );
            }
            let said = cluster.said(leader, "standby:");
            cluster.start_kvctld(leader);
            let standing_by = wait_until(WAIT, || {
                (cluster.said(leader, "standby:") > said).then_some(())
            });
            if standing_by.is_none() {
                stop.store(true, Ordering::Relaxed);
                panic!(
                    "kill {kill}: kvctld {leader} did not stand by again:\n{}",
                    cluster.logs()
                );
            }
            leader = standby;
        }
        stop.store(true, Ordering::Relaxed);
    });
    let seen = seen.into_inner().unwrap();
    assert!(
        seen.wrong.is_empty(),
        "{:#?}\n{}",
        seen.wrong,
        cluster.logs()
    );
    wait_all_free(&cluster, leader);
    let (lead_median, serve_median) = (median(&mut leads), median(&mut serves));
    let ttl_plus_1 = Duration::from_secs(u64::from(TTL_S) + 1);
    eprintln!(
        "takeover summary: {KILLS} kills, lease {TTL_S} s: leads after median {} ms, max {} ms \
         ({} of {KILLS} within TTL + 1 s); serves both workers after median {} ms, max {} ms; \
         load: {} requests equal, {} failed retryably",
        lead_median.as_millis(),
        leads.last().unwrap().as_millis(),
        leads.iter().filter(|&&t| t <= ttl_plus_1).count(),
        serve_median.as_millis(),
        serves.last().unwrap().as_millis(),
        seen.equal,
        seen.retryable
    );
    // Every worker registered again after every kill (and no more often: once per epoch).
    for w in ["prefill-0", "decode-0"] {
        let registered = cluster.log(w).matches("registered with kvctld").count();
        assert!(
            registered > KILLS,
            "{w} registered {registered} times:\n{}",
            cluster.logs()
        );
    }

    // SIGSTOP of the leader under load, for STOP_FOR: a stopped process keeps its sockets
    // open (the kernel still answers for them) and renews nothing. Its lease lapses, the
    // standby wins, and the workers leave the stopped leader as soon as etcd names the new
    // one, so requests are served through the stop. Once it runs again it finds its lease
    // gone and exits.
    let standby = 1 - leader;
    let stopped_pid = cluster.kvctld_pid(leader);
    let stop = AtomicBool::new(false);
    let seen = Mutex::new(Seen::default());
    let (led, moved, served, during) = thread::scope(|s| {
        load(s, &cluster, &jobs, &stop, &seen);
        let before = seen.lock().unwrap().equal;
        let _ = wait_until(WAIT, || (seen.lock().unwrap().equal > before).then_some(()));
        kill(stopped_pid, Signal::SIGSTOP).expect("stopping the leader");
        let t0 = Instant::now();
        let at_stop = seen.lock().unwrap().equal;
        let led = wait_until(STOP_FOR, || {
            cluster.status_of(standby).map(|_| t0.elapsed())
        });
        let moved = wait_until(STOP_FOR.saturating_sub(t0.elapsed()), || {
            let s = cluster.status_of(standby)?;
            both_registered(&s).then(|| t0.elapsed())
        });
        // A new client after the move is served by the standby. (The load's requests that
        // were on the stopped leader fail retryably at their deadline.)
        let (prompt, max_new, want) = &jobs[0];
        let served = moved.and_then(|_| {
            wait_until(STOP_FOR.saturating_sub(t0.elapsed()), || {
                let out = Client::connect(&cluster.socket(standby), Duration::from_secs(1))
                    .and_then(|mut c| c.generate("acme", prompt, *max_new, 10_000, |_| {}))
                    .ok()?;
                (out.tokens == want.tokens).then(|| t0.elapsed())
            })
        });
        // requests served by each second of the stop, for the log
        let mut by_second = Vec::new();
        while t0.elapsed() < STOP_FOR {
            thread::sleep(Duration::from_secs(1).min(STOP_FOR.saturating_sub(t0.elapsed())));
            by_second.push(seen.lock().unwrap().equal - at_stop);
        }
        eprintln!("sigstop: requests served by each second of the stop: {by_second:?}");
        let during = seen.lock().unwrap().equal - at_stop;
        kill(stopped_pid, Signal::SIGCONT).expect("resuming the leader");
        stop.store(true, Ordering::Relaxed);
        (led, moved, served, during)
    });
    let seen = seen.into_inner().unwrap();
    assert!(
        seen.wrong.is_empty(),
        "{:#?}\n{}",
        seen.wrong,
        cluster.logs()
    );
    let (Some(led), Some(moved), Some(served)) = (led, moved, served) else {
        panic!(
            "SIGSTOP of kvctld {leader} for {} s: the workers stayed with it (standby \
             led {led:?}, moved {moved:?}, served again {served:?}, {during} requests served):\n{}",
            STOP_FOR.as_secs(),
            cluster.logs()
        );
    };
    eprintln!(
        "sigstop: leader stopped for {} s under load (lease {TTL_S} s): kvctld {standby} leads \
         after {} ms, both workers with it after {} ms, a new request served after {} ms (goal: < TTL + 1 s \
         = {} ms); {during} requests served during the stop, {} failed retryably",
        STOP_FOR.as_secs(),
        led.as_millis(),
        moved.as_millis(),
        served.as_millis(),
        (TTL_S + 1) * 1000,
        seen.retryable
    );
    assert!(
        during > 0,
        "nothing served during the stop:\n{}",
        cluster.logs()
    );
    for w in ["prefill-0", "decode-0"] {
        assert!(
            cluster.log(w).contains("etcd names a newer leader"),
            "{w} did not leave the stopped leader for etcd's:\n{}",
            cluster.logs()
        );
    }
    // Running again, the old leader finds its lease gone: it exits, and stands by anew.
    let gone = wait_until(WAIT, || cluster.exited(leader).then_some(()));
    assert!(
        gone.is_some(),
        "the resumed leader kept running:\n{}",
        cluster.logs()
    );
    assert_eq!(
        cluster.serving_leader(WAIT),
        Some(standby),
        "{}",
        cluster.logs()
    );
    let said = cluster.said(leader, "standby:");
    cluster.start_kvctld(leader);
    let standing_by = wait_until(WAIT, || {
        (cluster.said(leader, "standby:") > said).then_some(())
    });
    assert!(standing_by.is_some(), "{}", cluster.logs());
    wait_all_free(&cluster, standby);
    leader = standby;

    // Partition: the leader's host is cut off. Its renewals fail; it stops admitting and
    // exits before its lease can have expired at etcd (the standby cannot win before that).
    let standby = 1 - leader;
    let epoch_before = cluster.said(standby, "elected leader");
    cluster.lan.link(KVCTLD[leader], false).expect("link down");
    let cut = Instant::now();
    let mut exited_at = None;
    let mut standby_led_at = None;
    let _ = wait_until(WAIT, || {
        if exited_at.is_none() && cluster.exited(leader) {
            exited_at = Some(cut.elapsed());
        }
        if standby_led_at.is_none() && cluster.status_of(standby).is_some() {
            standby_led_at = Some(cut.elapsed());
        }
        (exited_at.is_some() && standby_led_at.is_some()).then_some(())
    });
    let (Some(exited_at), Some(standby_led_at)) = (exited_at, standby_led_at) else {
        panic!(
            "partition: leader exited {exited_at:?}, standby led {standby_led_at:?}:\n{}",
            cluster.logs()
        );
    };
    eprintln!(
        "partition: the cut-off leader exited after {} ms, the standby led after {} ms",
        exited_at.as_millis(),
        standby_led_at.as_millis()
    );
    assert!(
        exited_at < standby_led_at,
        "the partitioned leader still served when the standby won:\n{}",
        cluster.logs()
    );
    assert!(
        cluster.said(leader, "no longer leading") > 0,
        "{}",
        cluster.logs()
    );
    assert_eq!(cluster.said(standby, "elected leader"), epoch_before + 1);
    assert_eq!(
        cluster.serving_leader(WAIT),
        Some(standby),
        "{}",
        cluster.logs()
    );
    // The link back, the old leader started again: it stands by; one leader.
    cluster.lan.link(KVCTLD[leader], true).expect("link up");
    let said = cluster.said(leader, "standby:");
    cluster.start_kvctld(leader);
    let standing_by = wait_until(WAIT, || {
        (cluster.said(leader, "standby:") > said).then_some(())
    });
    assert!(standing_by.is_some(), "{}", cluster.logs());
    assert!(
        cluster.status_of(leader).is_none(),
        "two leaders:\n{}",
        cluster.logs()
    );
    let out = kvctl(&cluster, &generate);
    assert!(out.status.success(), "{out:?}\n{}", cluster.logs());
    leader = standby;

    // etcd stopped: the leader cannot renew, stops admitting and exits; nothing leads
    // while etcd is away; when it is back a kvctld leads and serves again.
    let pid = cluster.etcd.pid();
    kill(pid, Signal::SIGSTOP).expect("stopping etcd");
    let gone = wait_until(WAIT, || cluster.exited(leader).then_some(()));
    if gone.is_none() {
        let _ = kill(pid, Signal::SIGCONT);
        panic!("the leader kept leading without etcd:\n{}", cluster.logs());
    }
    assert!(
        cluster.said(leader, "no longer leading") > 0,
        "{}",
        cluster.logs()
    );
    assert!(cluster.status_of(leader).is_none());
    cluster.start_kvctld(leader);
    // Both campaign while etcd is stopped; neither leads.
    thread::sleep(Duration::from_secs(u64::from(TTL_S)));
    assert!(
        (0..2).all(|i| cluster.status_of(i).is_none()),
        "a kvctld led without etcd:\n{}",
        cluster.logs()
    );
    kill(pid, Signal::SIGCONT).expect("resuming etcd");
    let back = cluster.serving_leader(WAIT);
    assert!(
        back.is_some(),
        "no leader after etcd came back:\n{}",
        cluster.logs()
    );
    let out = kvctl(&cluster, &generate);
    assert!(out.status.success(), "{out:?}\n{}", cluster.logs());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim_end(),
        detokenize(&want.tokens).trim_end()
    );
    let leader = back.unwrap();
    wait_all_free(&cluster, leader);

    // Membership: each worker published itself in etcd under its own lease; kvctl status
    // on etcd's host lists the leader and both workers, registered with it.
    let members = |cluster: &Cluster| {
        let out = kvctl(cluster, &["status", "--json"]);
        assert!(out.status.success(), "{out:?}\n{}", cluster.logs());
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status json");
        v["cluster"].clone()
    };
    let entry = |c: &serde_json::Value, id: &str| {
        c["members"]
            .as_array()
            .and_then(|m| m.iter().find(|m| m["id"] == id).cloned())
    };
    // etcd was stopped for longer than the workers' leases: it may expire them as it resumes,
    // and each worker then publishes itself again under a new lease. Wait for that.
    let listed = wait_until(WAIT, || {
        let listed = members(&cluster);
        ["prefill-0", "decode-0"]
            .iter()
            .all(|id| entry(&listed, id).is_some_and(|m| m["registered"] == true))
            .then_some(listed)
    })
    .unwrap_or_else(|| panic!("the workers are not listed: {:#}", members(&cluster)));
    assert_eq!(
        listed["leader"]["addr"],
        format!("{}:7443", KVCTLD_HOSTS[leader]),
        "{listed:#}"
    );
    for (i, (id, role)) in [("prefill-0", "prefill"), ("decode-0", "decode")]
        .into_iter()
        .enumerate()
    {
        let m = entry(&listed, id).unwrap_or_else(|| panic!("{id} not listed: {listed:#}"));
        assert_eq!(m["role"], role, "{m:#}");
        assert_eq!(m["registered"], true, "{m:#}");
        assert_eq!(m["pid"], cluster.workers[i].id(), "{m:#}");
    }
    let prefill = entry(&listed, "prefill-0").unwrap();
    assert_eq!(prefill["endpoint"], format!("{PREFILL_HOST}:7471"));
    let text = kvctl(&cluster, &["status"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("cluster in etcd") && text.contains("decode-0"),
        "{text}"
    );

    // A worker that stops renewing its lease while its kvctld connection stays up (SIGSTOP:
    // the kernel still answers for its sockets) is treated as lost once the lease lapses;
    // once it runs again it registers anew and serves.
    let decode_pid =
        nix::unistd::Pid::from_raw(i32::try_from(cluster.workers[1].id()).expect("pid"));
    kill(decode_pid, Signal::SIGSTOP).expect("stopping decoded");
    let stopped = Instant::now();
    let lost = wait_until(WAIT, || {
        let s = cluster.status_of(leader)?;
        let gone = !s.workers.iter().any(|w| w.id == "decode-0" && w.connected);
        gone.then(|| stopped.elapsed())
    });
    let unlisted = wait_until(WAIT, || {
        entry(&members(&cluster), "decode-0")
            .is_none()
            .then_some(())
    });
    let _ = kill(decode_pid, Signal::SIGCONT);
    let Some(lost) = lost else {
        panic!("a stopped decoded is still registered:\n{}", cluster.logs());
    };
    assert!(unlisted.is_some(), "{:#}", members(&cluster));
    eprintln!(
        "membership: a stopped worker was treated as lost after {} ms (lease {TTL_S} s)",
        lost.as_millis()
    );
    assert!(
        cluster.said(leader, "worker decode-0: its key in etcd") > 0,
        "{}",
        cluster.logs()
    );
    assert_eq!(
        cluster.serving_leader(WAIT),
        Some(leader),
        "{}",
        cluster.logs()
    );
    let listed = wait_until(WAIT, || {
        let c = members(&cluster);
        entry(&c, "decode-0")
            .is_some_and(|m| m["registered"] == true)
            .then_some(c)
    });
    assert!(listed.is_some(), "{:#}", members(&cluster));
    let out = kvctl(&cluster, &generate);
    assert!(out.status.success(), "{out:?}\n{}", cluster.logs());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim_end(),
        detokenize(&want.tokens).trim_end()
    );
    wait_all_free(&cluster, leader);

    drop(cluster);
    assert!(begun.elapsed() < TEST_BOUND, "took {:?}", begun.elapsed());
}
