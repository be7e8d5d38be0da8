//! Integration tests live under tests/tests; this library holds what they share: where the
//! daemon binaries are, the logs printed when a test fails, counters read from kvctld's
//! status (its own and each worker's), and for the stacks of many workers their start, the
//! prompts and the monolithic reference they are checked against, a bounded load of
//! concurrent requests, and the wait until every page is free again.

pub mod certs;
pub mod etcd_server;
pub mod hosts;
pub mod idle;
pub mod ops;

use kvctld::client::{Client, ClientError, GenerateOutcome};
use kvctld::stack::{Stack, StackOptions, default_bin_dir, error_chain, find_worker, wait_until};
use libkv::config::{Config, Transfer, TransportKind};
use libkv::model::{Output, ReferenceModel, monolithic, tokenize};
use libkv::proto::{Role, StatusReply, Transport, WorkerStatus};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// The directory of the daemon binaries the tests spawn; fails with the command that
/// builds them when one is missing.
pub fn bin_dir() -> PathBuf {
    let dir = default_bin_dir().expect("locating the target directory");
    for name in ["kvctld", "prefilld", "decoded", "kvctl", "openaid"] {
        assert!(
            dir.join(name).is_file(),
            "{} is missing: these tests spawn the real daemons; run `cargo build --bins` \
             (`cargo build --release --bins` for `cargo test --release`) first",
            dir.join(name).display()
        );
    }
    dir
}

/// Prints the end of every daemon log in its directory (`kvctld.log` and one `<id>.log` per
/// worker) if the test panics, so a failure shows what the daemons saw.
#[derive(Debug)]
pub struct LogsOnPanic(pub PathBuf);

impl Drop for LogsOnPanic {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let mut logs: Vec<PathBuf> = std::fs::read_dir(&self.0)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        logs.sort();
        for path in logs {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(40)..].join("\n");
            eprintln!("---- {} (last 40 lines) ----\n{tail}", path.display());
        }
    }
}

/// One of kvctld's own counters (`StatusReply.counters`: `completed`, `in_flight`, ...).
pub fn counter(status: &StatusReply, name: &str) -> Option<u64> {
    lookup(&status.counters, name)
}

/// A counter the worker `id` reported in its last `PoolReport` (its `WorkerStatus.counters`:
/// prefilld's `prefill_runs`, `pages_served`, decoded's `pulls`, `pages_pulled`, ...);
/// `None` when kvctld does not list the worker or the worker has not reported it.
pub fn worker_counter(status: &StatusReply, id: &str, name: &str) -> Option<u64> {
    lookup(&find_worker(status, id)?.counters, name)
}

/// The sum of a counter over every connected worker of `role`.
pub fn role_counter(status: &StatusReply, role: Role, name: &str) -> u64 {
    status
        .workers
        .iter()
        .filter(|w| w.role == role && w.connected)
        .filter_map(|w| lookup(&w.counters, name))
        .sum()
}

fn lookup(counters: &[(String, u64)], name: &str) -> Option<u64> {
    counters.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
}

/// A running stack, its directory (removed last) and its logs (printed if the test fails).
/// Fields drop in order: the daemons are killed, then the logs are printed, then the
/// directory goes.
#[derive(Debug)]
pub struct Running {
    pub stack: Stack,
    pub logs: LogsOnPanic,
    pub dir: tempfile::TempDir,
}

/// Starts `prefill` prefill and `decode` decode workers under one kvctld, all on the
/// embedded default config changed by `tweak`, in a fresh directory under /tmp (the socket
/// path must stay short) named after `prefix`.
pub fn start_stack(
    prefix: &str,
    prefill: usize,
    decode: usize,
    tweak: impl FnOnce(&mut Config),
) -> Running {
    start_stack_with(prefix, prefill, decode, tweak, |_| {})
}

/// [`start_stack`], with the options changed by `options` before the start (a config of
/// its own for some worker, a wrapper command, timeouts).
pub fn start_stack_with(
    prefix: &str,
    prefill: usize,
    decode: usize,
    tweak: impl FnOnce(&mut Config),
    options: impl FnOnce(&mut StackOptions),
) -> Running {
    let bin_dir = bin_dir();
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/tmp")
        .expect("temp dir");
    let mut config = Config::embedded_default(dir.path().join("kvctld.sock"));
    tweak(&mut config);
    let mut opts = StackOptions::new(config, dir.path().to_path_buf())
        .expect("options")
        .with_workers(prefill, decode);
    opts.bin_dir = bin_dir;
    options(&mut opts);
    let logs = LogsOnPanic(dir.path().to_path_buf());
    let stack = Stack::start(opts)
        .unwrap_or_else(|e| panic!("starting {prefill} + {decode} workers: {}", error_chain(&e)));
    Running { stack, logs, dir }
}

/// The TCP transport on loopback: every prefill worker serves its pages on a free port of
/// 127.0.0.1.
pub fn tcp(config: &mut Config) {
    config.transfer = Transfer {
        transport: TransportKind::Tcp,
        listen: Some("127.0.0.1:0".into()),
    };
}

/// How the pages moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Moved {
    /// Shared memory: prefilld's page server served nothing.
    Shm,
    /// Over TCP: pages served, no RDMA session.
    Tcp,
    /// With RDMA reads: pages served through windows, every window invalidated.
    Rdma,
}

/// Fails unless the prefill workers' counters say the pages moved as `moved` says. A
/// worker reports its counters after the fact (prefilld once the pages it served are
/// released), so the counters are waited for, bounded, never read once.
pub fn assert_transport(stack: &Stack, moved: Moved) {
    let want = match moved {
        Moved::Shm => Transport::Shm,
        Moved::Tcp => Transport::Tcp,
        Moved::Rdma => Transport::Rdma,
    };
    let check = |s: &StatusReply| -> Result<(), String> {
        let get = |name: &str| role_counter(s, Role::Prefill, name);
        let served = get("pages_served");
        let (sessions, bound, revoked) = (
            get("rdma_sessions"),
            get("windows_bound"),
            get("windows_revoked"),
        );
        let what = format!(
            "{served} pages served, {sessions} RDMA sessions, {bound} windows bound, \
             {revoked} invalidated"
        );
        if s.transport != Some(want) {
            return Err(format!("kvctld reports the transport {:?}", s.transport));
        }
        let ok = match moved {
            Moved::Shm => served == 0,
            Moved::Tcp => served > 0 && sessions == 0,
            Moved::Rdma => served > 0 && sessions > 0 && bound > 0 && bound == revoked,
        };
        if ok { Ok(()) } else { Err(what) }
    };
    let mut last = String::new();
    let done = wait_until(Duration::from_secs(10), || {
        let s = stack.status().ok()?;
        match check(&s) {
            Ok(()) => Some(()),
            Err(e) => {
                last = e;
                None
            }
        }
    });
    assert!(done.is_some(), "pages did not move as {moved:?}: {last}");
}

/// The RDMA device named by `KVFENCE_RDMA_DEVICE` (GID index `KVFENCE_RDMA_GID_INDEX`,
/// default 1) and the address its page server listens on, `KVFENCE_RDMA_ADDR` (the
/// device's IPv4 address): `None` after saying SKIPPED when no device is configured.
/// tests/vm/rxe.sh runs the tests that use it on soft-RoCE.
pub fn rdma_device() -> Option<(String, u32, String)> {
    let Ok(device) = std::env::var("KVFENCE_RDMA_DEVICE") else {
        eprintln!("SKIPPED: no RDMA device (set KVFENCE_RDMA_DEVICE)");
        return None;
    };
    let gid = std::env::var("KVFENCE_RDMA_GID_INDEX").map_or(1, |g| g.parse().expect("GID index"));
    let addr = std::env::var("KVFENCE_RDMA_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
    Some((device, gid, addr))
}

/// The RDMA transport on [`rdma_device`]'s device.
///
/// # Panics
/// If no device is configured (callers check [`rdma_device`] first).
pub fn rdma(config: &mut Config) {
    let (device, gid_index, addr) = rdma_device().expect("an RDMA device");
    config.transfer = Transfer {
        transport: TransportKind::Rdma,
        listen: Some(format!("{addr}:0")),
    };
    let mut r = libkv::config::RdmaConfig::for_device(device);
    r.gid_index = gid_index;
    config.rdma = Some(r);
}

/// A prompt of `len` bytes (tokens) for `tenant`, starting with the tenant's secret.
pub fn prompt(tenant: &str, index: usize, len: usize) -> Vec<u8> {
    let mut p = format!("[{tenant} secret s3cr3t-{tenant}-{index:04}] ").into_bytes();
    let filler = format!("{tenant} data {index} ");
    while p.len() < len {
        p.extend_from_slice(filler.as_bytes());
    }
    p.truncate(len.max(1));
    p
}

/// The reference model of the stack's geometry.
pub fn model(stack: &Stack) -> ReferenceModel {
    ReferenceModel::new(stack.config().geometry).expect("reference model")
}

/// What the monolithic path (no transfer at all) outputs for `prompt`.
pub fn expected(model: &ReferenceModel, prompt: &[u8], max_new: u32) -> Output {
    monolithic(model, &tokenize(prompt), max_new).expect("monolithic")
}

/// Fails unless a served request's tokens and signature are the monolithic path's.
pub fn assert_matches(out: &GenerateOutcome, want: &Output, what: &str) {
    assert_eq!(
        out.tokens, want.tokens,
        "{what}: tokens differ from monolithic"
    );
    assert_eq!(
        out.done.signature, want.signature,
        "{what}: signature differs from monolithic"
    );
}

/// Whether the worker holds nothing: connected, every page of its pool free by its own
/// report, none lent by kvctld's ledger, no request on it.
pub fn worker_idle_and_free(w: &WorkerStatus) -> bool {
    w.connected
        && w.pool_pages > 0
        && w.free == w.pool_pages
        && w.reserved == 0
        && w.writing == 0
        && w.readable == 0
        && w.draining == 0
        && w.held_pages == 0
        && w.in_flight == 0
}

/// Waits until every worker in `ids` is connected and holds nothing
/// ([`worker_idle_and_free`]), and kvctld has no request in flight or queued; fails with
/// the last status otherwise. Returns that status.
pub fn wait_all_free(stack: &Stack, ids: &[String], within: Duration) -> StatusReply {
    let mut last = None;
    let done = wait_until(within, || {
        let s = stack.status().ok()?;
        let free = ids
            .iter()
            .all(|id| find_worker(&s, id).is_some_and(worker_idle_and_free))
            && counter(&s, "in_flight") == Some(0)
            && counter(&s, "queue_len") == Some(0);
        if free {
            return Some(s);
        }
        last = Some(s);
        None
    });
    done.unwrap_or_else(|| {
        panic!(
            "pages or requests still held {within:?} after the load ended: {:#?}",
            last
        )
    })
}

/// Every worker id of the stack, prefill then decode.
pub fn all_worker_ids(stack: &Stack) -> Vec<String> {
    let mut ids = stack.worker_ids(Role::Prefill);
    ids.extend(stack.worker_ids(Role::Decode));
    ids
}

/// One request of a load run by [`under_load`].
#[derive(Debug)]
pub struct Attempt {
    /// The load thread that sent it.
    pub thread: usize,
    pub tenant: &'static str,
    pub prompt: Vec<u8>,
    pub max_new: u32,
    /// When it was submitted (before connecting) and when its answer was in.
    pub started: Instant,
    pub ended: Instant,
    pub result: Result<GenerateOutcome, ClientError>,
}

impl Attempt {
    /// The request, for messages.
    pub fn what(&self) -> String {
        format!(
            "{} request of {} tokens + {} (load thread {})",
            self.tenant,
            self.prompt.len(),
            self.max_new,
            self.thread
        )
    }
}

/// What a load sends: the `n`-th request of thread `t` (tenant, prompt, new tokens).
pub type Job = fn(usize, usize) -> (&'static str, Vec<u8>, u32);

/// Runs `body` while `threads` threads send requests of `job` to kvctld at `socket`, one at
/// a time each on a fresh connection, with a deadline of `deadline_ms`, until `body`
/// returns or panics (or each has sent `per_thread`); returns what `body` returned and
/// every request sent. `body` sees the requests answered so far.
pub fn under_load<R>(
    socket: &Path,
    threads: usize,
    per_thread: usize,
    deadline_ms: u32,
    job: Job,
    body: impl FnOnce(&Mutex<Vec<Attempt>>) -> R,
) -> (R, Vec<Attempt>) {
    /// Stops the load when dropped, so a panicking `body` ends it too.
    struct Stop<'a>(&'a AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let stop = AtomicBool::new(false);
    let attempts = Mutex::new(Vec::new());
    let r = thread::scope(|s| {
        for t in 0..threads {
            let (stop, attempts) = (&stop, &attempts);
            s.spawn(move || {
                for n in 0..per_thread {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let (tenant, prompt, max_new) = job(t, n);
                    let started = Instant::now();
                    let result =
                        Client::connect(socket, Duration::from_secs(5)).and_then(|mut c| {
                            c.generate(
                                tenant,
                                &libkv::model::tokenize(&prompt),
                                max_new,
                                deadline_ms,
                                |_| {},
                            )
                        });
                    let attempt = Attempt {
                        thread: t,
                        tenant,
                        prompt,
                        max_new,
                        started,
                        ended: Instant::now(),
                        result,
                    };
                    attempts.lock().expect("attempts").push(attempt);
                }
            });
        }
        let _stop = Stop(&stop);
        body(&attempts)
    });
    (r, attempts.into_inner().expect("attempts"))
}

/// The counter that shows the worker `id` did its part of a request.
pub fn work_counter(id: &str) -> &'static str {
    if id.starts_with("prefill") {
        "prefill_runs"
    } else {
        "pulls"
    }
}

/// Sends rounds of 4 concurrent requests (at most 5 rounds) until the freshly restarted
/// worker `id` served some, each equal to the monolithic path; fails unless it is connected
/// and undrained, and its `served` and its own [`work_counter`] grew from zero.
pub fn serves_again(stack: &Stack, model: &ReferenceModel, id: &str) {
    let s = stack.status().expect("status");
    let w = find_worker(&s, id).expect("listed");
    assert!(w.connected, "{id} not connected after its restart");
    assert!(!w.drain, "{id} came back drained: {w:?}");
    assert_eq!(w.served, 0, "{id} restarted with a served count");
    let mut served_on_it = 0;
    for round in 0..5 {
        let outs: Vec<GenerateOutcome> = thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|i| {
                    s.spawn(move || {
                        let p = prompt("rejoin", round * 10 + i, 300 + i * 200);
                        let out = stack
                            .client()
                            .expect("client")
                            .generate("rejoin", &libkv::model::tokenize(&p), 32, 10_000, |_| {})
                            .unwrap_or_else(|e| {
                                panic!("request after {id} rejoined: {}", error_chain(&e))
                            });
                        assert_matches(&out, &expected(model, &p, 32), "request after rejoin");
                        out
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("request"))
                .collect()
        });
        served_on_it += outs
            .iter()
            .filter(|o| o.pair.prefill == id || o.pair.decode == id)
            .count();
        if served_on_it > 0 {
            break;
        }
    }
    assert!(
        served_on_it > 0,
        "{id} served nothing in 5 rounds after it rejoined"
    );
    let name = work_counter(id);
    let grew = wait_until(Duration::from_secs(5), || {
        let s = stack.status().ok()?;
        let w = find_worker(&s, id)?;
        let work = worker_counter(&s, id, name).unwrap_or(0);
        (w.served >= served_on_it as u64 && work >= served_on_it as u64).then_some(())
    });
    assert!(
        grew.is_some(),
        "{id}: served and {name} did not grow to {served_on_it}: {:?}",
        stack.status().map(|s| find_worker(&s, id).cloned())
    );
}

/// The `IP:PORT` of the `/metrics` endpoint a daemon logged (`metrics on http://ADDR/metrics`:
/// it binds port 0 in the tests).
pub fn metrics_addr(log: &str) -> Option<String> {
    let rest = log.split("metrics on http://").nth(1)?;
    Some(rest.split('/').next()?.to_owned())
}

/// One scrape of `addr`: the body of `GET /metrics` when it answered 200.
pub fn scrape(addr: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET /metrics HTTP/1.0\r\nHost: kvfence\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    (head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200")).then(|| body.to_owned())
}
