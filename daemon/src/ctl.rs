//! kvctld: the control daemon.
//!
//! One mio event loop owns the control socket, every connection (clients and the two
//! workers), the admission ledger and the state of every request. Nothing here touches a
//! page: kvctld decides *which* request runs and in *what order* the workers act, and the
//! workers enforce page ownership themselves.
//!
//! A request goes `Queued -> Reserving -> Prefilling -> Pulling -> Decoding -> done`, each
//! stage with its own deadline, all under the request's deadline (see `libkv::proto` for the
//! messages). A rejected request never gets an owner on any worker: the rejection is answered
//! from `Submit` before anything is sent. Ledger pages lent for a request return only when
//! the worker that held them reports them `Freed` (no writer left) or dies.

use libkv::admission::{self, Ledger, Limits, Need, RequestSpec, Side};
use libkv::config::Config;
use libkv::proto::{
    self, Abort, DecodeReserve, Done, ErrorCode, Freed, Hello, HelloAck, Message, PoolReport,
    PrefillDone, PrefillEndpoint, PrefillPool, PrefillRun, PullKv, RegisterAck, RegisterWorker,
    Release, Role, StatusReply, Submit, TcpEndpoint, Tokens, Transport, WorkerStatus,
};
use libkv::sys::uds::{self, FrameReader, ReadOutcome};
use libkv::{Generation, Owner, RequestId};
use log::{debug, info, warn};
use mio::net::{UnixListener, UnixStream};
use mio::{Events, Interest, Poll, Token};
use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook_mio::v1_0::Signals;
use slab::Slab;
use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const LISTENER: Token = Token(0);
const SIGNALS: Token = Token(1);
const FIRST_CONN: usize = 16;
/// A client that does not read its output is cut off past this much queued output.
const MAX_OUTBOX_BYTES: usize = 16 << 20;
/// Most connections at once; more are refused at accept.
const MAX_CONNECTIONS: usize = 4096;

/// Errors that stop kvctld.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    #[error("creating socket directory {path}")]
    SocketDir { path: PathBuf, source: io::Error },
    #[error("binding control socket {path}")]
    Bind { path: PathBuf, source: io::Error },
    #[error("setting up the event loop")]
    Poll(#[source] io::Error),
    #[error("installing signal handlers")]
    Signals(#[source] io::Error),
}

/// kvctld's counters (atomics so a status reply reads them without ceremony).
#[derive(Debug, Default)]
pub struct Counters {
    submitted: AtomicU64,
    admitted: AtomicU64,
    rejected: AtomicU64,
    queued: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    timeouts: AtomicU64,
    worker_lost: AtomicU64,
    verify_failed: AtomicU64,
    client_gone: AtomicU64,
    bootstraps: AtomicU64,
    transfers: AtomicU64,
    pages_transferred: AtomicU64,
    bytes_transferred: AtomicU64,
    protocol_errors: AtomicU64,
    unauthorized: AtomicU64,
    probe_runs: AtomicU64,
    probe_mismatches: AtomicU64,
    probe_errors: AtomicU64,
}

impl Counters {
    fn list(&self) -> Vec<(String, u64)> {
        let c = |name: &str, v: &AtomicU64| (name.to_owned(), v.load(Ordering::Relaxed));
        vec![
            c("submitted", &self.submitted),
            c("admitted", &self.admitted),
            c("rejected", &self.rejected),
            c("queued", &self.queued),
            c("completed", &self.completed),
            c("failed", &self.failed),
            c("timeouts", &self.timeouts),
            c("worker_lost", &self.worker_lost),
            c("verify_failed", &self.verify_failed),
            c("client_gone", &self.client_gone),
            c("bootstraps", &self.bootstraps),
            c("transfers", &self.transfers),
            c("pages_transferred", &self.pages_transferred),
            c("bytes_transferred", &self.bytes_transferred),
            c("protocol_errors", &self.protocol_errors),
            c("unauthorized", &self.unauthorized),
            c("probe_runs", &self.probe_runs),
            c("probe_mismatches", &self.probe_mismatches),
            c("probe_errors", &self.probe_errors),
        ]
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

struct Outgoing {
    bytes: Vec<u8>,
    fds: Vec<OwnedFd>,
    sent: usize,
}

struct Conn {
    stream: UnixStream,
    reader: FrameReader,
    out: VecDeque<Outgoing>,
    out_bytes: usize,
    writable: bool,
    role: Option<Role>,
    registered: bool,
    /// Close once the outbox is flushed (after a final error frame).
    closing: bool,
    /// The peer's uid (SO_PEERCRED at accept).
    uid: u32,
    /// When it connected: a peer that has not said Hello within the bootstrap deadline is
    /// dropped, so idle connections cannot pile up.
    accepted: Instant,
}

struct Worker {
    conn: usize,
    pool_pages: u32,
    report: Option<PoolReport>,
    /// The prefill pool, read-only, to hand to decoded (shared memory).
    pool_fd: Option<OwnedFd>,
    /// The prefill page server, to hand to decoded (TCP).
    endpoint: Option<TcpEndpoint>,
    /// Transports the worker registered.
    transports: Vec<Transport>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Queued,
    Reserving,
    Prefilling,
    Pulling,
    Decoding,
}

impl Stage {
    fn name(self) -> &'static str {
        match self {
            Stage::Queued => "admission",
            Stage::Reserving => "decode reservation",
            Stage::Prefilling => "prefill",
            Stage::Pulling => "transfer",
            Stage::Decoding => "decode",
        }
    }
}

struct Request {
    client: usize,
    spec: RequestSpec,
    prompt: Vec<u8>,
    need: Need,
    stage: Stage,
    /// Worker connections this request was sent to, per side.
    sent_prefill: Option<usize>,
    sent_decode: Option<usize>,
    stage_deadline: Instant,
    stage_budget: Duration,
    /// When the current stage began (for the bootstrap round-trip figures).
    stage_started: Instant,
    deadline: Instant,
}

/// Ledger pages lent for a request and not yet reported free, per side, with the worker
/// connection that holds them.
#[derive(Default)]
struct Held {
    prefill: Option<(usize, u32)>,
    decode: Option<(usize, u32)>,
}

struct Ctl {
    cfg: Config,
    generation: Generation,
    limits: Limits,
    poll: Poll,
    listener: Option<UnixListener>,
    conns: Slab<Conn>,
    prefill: Option<Worker>,
    decode: Option<Worker>,
    ledger: Ledger,
    requests: HashMap<RequestId, Request>,
    held: HashMap<RequestId, Held>,
    queue: VecDeque<RequestId>,
    next_id: u64,
    counters: Arc<Counters>,
    own_uid: u32,
    draining_since: Option<Instant>,
    /// The listening socket came from the service manager, which owns its file.
    activated: bool,
    /// Prefill aborts held back until decoded stops reading the pages (see `fail`).
    deferred: HashMap<RequestId, (usize, Abort)>,
    /// DecodeReserve to DecodeReserved: the bootstrap round trip through decoded.
    bootstrap_rtt: Samples,
}

/// The last few thousand durations of something, for percentiles in status.
#[derive(Debug, Default)]
struct Samples {
    us: VecDeque<u64>,
}

impl Samples {
    const KEEP: usize = 4096;

    fn record(&mut self, d: Duration) {
        if self.us.len() == Self::KEEP {
            self.us.pop_front();
        }
        self.us
            .push_back(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    }

    /// The `q`-quantile (0..=1) of the kept samples, in microseconds.
    fn quantile(&self, q: f64) -> Option<u64> {
        let mut v: Vec<u64> = self.us.iter().copied().collect();
        v.sort_unstable();
        let last = v.len().checked_sub(1)?;
        // q in [0, 1] and last < 4096: the product fits and rounds to an index.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let i = ((last as f64) * q).round() as usize;
        v.get(i.min(last)).copied()
    }
}

/// Runs kvctld until SIGTERM or SIGINT, then drains.
pub fn run(cfg: Config) -> Result<(), CtlError> {
    let (listener, activated) = match activated_listener()? {
        Some(l) => (l, true),
        None => (bind(&cfg.control.socket)?, false),
    };
    let mut ctl = Ctl::new(cfg, listener)?;
    ctl.activated = activated;
    if let Some(every) = ctl.cfg.probe.interval() {
        start_probe(&ctl.cfg, every, Arc::clone(&ctl.counters));
    }
    ctl.serve()
}

/// Runs the coherence probe every `every` on a thread of its own, as a client of this
/// kvctld. A mismatch is logged at error level and counted (`probe_mismatches`).
fn start_probe(cfg: &Config, every: Duration, counters: Arc<Counters>) {
    let socket = cfg.control.socket.clone();
    let geometry = cfg.geometry;
    let timeout = cfg.deadlines.request() + cfg.deadlines.admission_wait();
    info!("coherence probe every {} s", every.as_secs());
    let spawned = std::thread::Builder::new()
        .name("probe".into())
        .spawn(move || {
            loop {
                std::thread::sleep(every);
                bump(&counters.probe_runs);
                match crate::probe::run_probe(&socket, geometry, 16, timeout) {
                    Ok(r) if !r.mismatches.is_empty() => {
                        counters
                            .probe_mismatches
                            .fetch_add(r.mismatches.len() as u64, Ordering::Relaxed);
                        for m in &r.mismatches {
                            log::error!(
                                "coherence probe: output differs from the monolithic path: {m}"
                            );
                        }
                    }
                    Ok(r) if !r.errors.is_empty() => {
                        counters
                            .probe_errors
                            .fetch_add(r.errors.len() as u64, Ordering::Relaxed);
                        warn!(
                            "coherence probe: {} canaries failed: {}",
                            r.errors.len(),
                            r.errors[0]
                        );
                    }
                    Ok(_) => debug!("coherence probe: all canaries matched"),
                    Err(e) => {
                        bump(&counters.probe_errors);
                        warn!("coherence probe could not run: {e}");
                    }
                }
            }
        });
    if let Err(e) = spawned {
        warn!("cannot start the coherence probe: {e}");
    }
}

/// The listening socket systemd passed (socket activation), if any.
fn activated_listener() -> Result<Option<UnixListener>, CtlError> {
    let fds: Vec<_> = match sd_notify::listen_fds() {
        Ok(fds) => fds.collect(),
        Err(_) => return Ok(None),
    };
    let [fd] = fds[..] else {
        if !fds.is_empty() {
            warn!(
                "{} sockets passed by the service manager, expected 1; binding my own",
                fds.len()
            );
        }
        return Ok(None);
    };
    // SAFETY: `listen_fds` checked LISTEN_PID against our pid, so the service manager passed
    // this fd to this process, and nothing else in kvctld has taken ownership of it.
    let std_listener = unsafe { std::os::unix::net::UnixListener::from_raw_fd(fd) };
    std_listener.set_nonblocking(true).map_err(CtlError::Poll)?;
    info!("using the control socket passed by the service manager");
    Ok(Some(UnixListener::from_std(std_listener)))
}

fn bind(path: &Path) -> Result<UnixListener, CtlError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && !dir.exists()
    {
        std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750)))
            .map_err(|source| CtlError::SocketDir {
                path: dir.to_owned(),
                source,
            })?;
    }
    // A socket file left by an earlier run would make bind fail; only a socket is removed.
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if meta.file_type().is_socket() {
            let _ = std::fs::remove_file(path);
        }
    }
    let listener = UnixListener::bind(path).map_err(|source| CtlError::Bind {
        path: path.to_owned(),
        source,
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(|source| {
        CtlError::Bind {
            path: path.to_owned(),
            source,
        }
    })?;
    Ok(listener)
}

/// Whether the fault `name` is switched on in `KVFENCE_FAULT` (comma-separated). Only in
/// builds with the `fault-injection` feature, which exist to prove the test suite catches a
/// broken build; release builds have no such switch.
#[cfg(feature = "fault-injection")]
fn fault_active(name: &str) -> bool {
    std::env::var("KVFENCE_FAULT").is_ok_and(|v| v.split(',').any(|f| f.trim() == name))
}

fn generation_now() -> Generation {
    let micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    Generation(micros)
}

impl Ctl {
    fn new(cfg: Config, mut listener: UnixListener) -> Result<Ctl, CtlError> {
        let poll = Poll::new().map_err(CtlError::Poll)?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)
            .map_err(CtlError::Poll)?;
        let limits = Limits {
            geometry: cfg.geometry,
            max_context: cfg.limits.max_context,
            max_new_tokens: cfg.limits.max_new_tokens,
            prefill_pages: cfg.prefill.pool_pages,
            decode_pages: cfg.decode.pool_pages,
        };
        let generation = generation_now();
        info!(
            "kvctld generation {} serving {} (max context {}, prefill {} pages, decode {} pages)",
            generation.0,
            cfg.control.socket.display(),
            limits.max_context,
            limits.prefill_pages,
            limits.decode_pages
        );
        Ok(Ctl {
            generation,
            limits,
            poll,
            listener: Some(listener),
            conns: Slab::new(),
            prefill: None,
            decode: None,
            ledger: Ledger {
                prefill_free: 0,
                decode_free: 0,
            },
            requests: HashMap::new(),
            held: HashMap::new(),
            queue: VecDeque::new(),
            next_id: 1,
            counters: Arc::new(Counters::default()),
            own_uid: nix::unistd::geteuid().as_raw(),
            draining_since: None,
            activated: false,
            deferred: HashMap::new(),
            bootstrap_rtt: Samples::default(),
            cfg,
        })
    }

    fn serve(&mut self) -> Result<(), CtlError> {
        let mut signals = Signals::new([SIGTERM, SIGINT]).map_err(CtlError::Signals)?;
        self.poll
            .registry()
            .register(&mut signals, SIGNALS, Interest::READABLE)
            .map_err(CtlError::Poll)?;
        let mut events = Events::with_capacity(256);
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
        loop {
            let timeout = self.next_timeout();
            if let Err(e) = self.poll.poll(&mut events, Some(timeout)) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(CtlError::Poll(e));
            }
            for ev in &events {
                match ev.token() {
                    LISTENER => self.accept(),
                    SIGNALS => {
                        if signals.pending().next().is_some() {
                            self.start_drain();
                        }
                    }
                    Token(t) => {
                        let key = t - FIRST_CONN;
                        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                            self.read(key);
                        }
                        if ev.is_writable() {
                            self.flush(key);
                        }
                    }
                }
            }
            self.expire(Instant::now());
            if let Some(since) = self.draining_since
                && (self.requests.is_empty() || since.elapsed() >= self.cfg.deadlines.drain())
            {
                let ids: Vec<RequestId> = self.requests.keys().copied().collect();
                for id in ids {
                    self.fail(id, ErrorCode::ShuttingDown, "kvctld is stopping".into());
                }
                self.flush_all();
                info!("kvctld stopped");
                if !self.activated {
                    let _ = std::fs::remove_file(&self.cfg.control.socket);
                }
                return Ok(());
            }
        }
    }

    fn start_drain(&mut self) {
        if self.draining_since.is_some() {
            return;
        }
        info!(
            "draining: no new requests, {} in flight",
            self.requests.len()
        );
        self.draining_since = Some(Instant::now());
        if let Some(mut l) = self.listener.take() {
            let _ = self.poll.registry().deregister(&mut l);
        }
        let queued: Vec<RequestId> = self.queue.drain(..).collect();
        for id in queued {
            self.fail(id, ErrorCode::ShuttingDown, "kvctld is stopping".into());
        }
    }

    fn next_timeout(&self) -> Duration {
        let now = Instant::now();
        let mut next = now + Duration::from_secs(1);
        for r in self.requests.values() {
            next = next.min(r.stage_deadline).min(r.deadline);
        }
        next.saturating_duration_since(now) + Duration::from_millis(1)
    }

    // ---- connections -------------------------------------------------------------------

    fn allowed(&self, uid: u32, gid: u32) -> bool {
        let c = &self.cfg.control;
        uid == 0
            || uid == self.own_uid
            || c.allowed_uids.contains(&uid)
            || c.allowed_gids.contains(&gid)
    }

    /// Workers see every tenant's prompts and KV: only kvctld's own uid, root and the
    /// configured worker uids may register as one.
    fn may_be_worker(&self, uid: u32) -> bool {
        uid == 0 || uid == self.own_uid || self.cfg.control.worker_uids.contains(&uid)
    }

    fn accept(&mut self) {
        loop {
            let Some(listener) = self.listener.as_ref() else {
                return;
            };
            let (mut stream, _) = match listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    warn!("accept failed: {e}");
                    return;
                }
            };
            let cred = match uds::peer_credentials(&stream) {
                Ok(c) => c,
                Err(e) => {
                    warn!("reading peer credentials failed: {e}");
                    continue;
                }
            };
            let (uid, gid) = (cred.uid.as_raw(), cred.gid.as_raw());
            if !self.allowed(uid, gid) {
                bump(&self.counters.unauthorized);
                warn!(
                    "refused connection from uid {uid} gid {gid} (pid {})",
                    cred.pid
                );
                let msg = Message::from(proto::Error {
                    code: ErrorCode::Unauthorized,
                    message: format!("uid {uid} is not allowed on this socket"),
                });
                if let Ok(frame) = msg.encode(RequestId(0)) {
                    let _ = uds::send_frame(&stream, &frame, &[]);
                }
                continue;
            }
            if self.conns.len() >= MAX_CONNECTIONS {
                debug!("refused connection: {MAX_CONNECTIONS} connections open");
                let msg = Message::from(proto::Error {
                    code: ErrorCode::PoolFull,
                    message: format!("kvctld has {MAX_CONNECTIONS} connections open; try again"),
                });
                if let Ok(frame) = msg.encode(RequestId(0)) {
                    let _ = uds::send_frame(&stream, &frame, &[]);
                }
                continue;
            }
            let entry = self.conns.vacant_entry();
            let key = entry.key();
            if let Err(e) = self.poll.registry().register(
                &mut stream,
                Token(key + FIRST_CONN),
                Interest::READABLE,
            ) {
                warn!("registering connection failed: {e}");
                continue;
            }
            entry.insert(Conn {
                stream,
                reader: FrameReader::new(),
                out: VecDeque::new(),
                out_bytes: 0,
                writable: false,
                role: None,
                registered: false,
                closing: false,
                uid,
                accepted: Instant::now(),
            });
            debug!("connection {key} from uid {uid}");
        }
    }

    fn read(&mut self, key: usize) {
        loop {
            let Some(conn) = self.conns.get_mut(key) else {
                return;
            };
            let outcome = match conn.reader.read_from(&conn.stream) {
                Ok(o) => o,
                Err(e) => {
                    debug!("connection {key}: read failed: {e}");
                    bump(&self.counters.protocol_errors);
                    self.close(key);
                    return;
                }
            };
            loop {
                let Some(conn) = self.conns.get_mut(key) else {
                    return;
                };
                match conn.reader.next_frame() {
                    Ok(Some((header, msg, fds))) => {
                        self.handle(key, header.request_id, msg, fds);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        bump(&self.counters.protocol_errors);
                        debug!("connection {key}: {e}");
                        if let Some(reply) = e.reply() {
                            self.send(key, RequestId(0), Message::from(reply), Vec::new());
                        }
                        self.close_after_flush(key);
                        return;
                    }
                }
            }
            match outcome {
                ReadOutcome::Paused { .. } => continue,
                ReadOutcome::Eof | ReadOutcome::Failed => {
                    self.close(key);
                    return;
                }
                ReadOutcome::WouldBlock | ReadOutcome::Progressed { .. } => return,
            }
        }
    }

    fn send(&mut self, key: usize, id: RequestId, msg: Message, fds: Vec<OwnedFd>) {
        let frame = match msg.encode(id) {
            Ok(f) => f,
            Err(e) => {
                warn!("encoding {:?} failed: {e}", msg.msg_type());
                return;
            }
        };
        let Some(conn) = self.conns.get_mut(key) else {
            return;
        };
        conn.out_bytes += frame.len();
        conn.out.push_back(Outgoing {
            bytes: frame,
            fds,
            sent: 0,
        });
        if conn.out_bytes > MAX_OUTBOX_BYTES {
            warn!("connection {key} does not read its output; closing it");
            self.close(key);
            return;
        }
        self.flush(key);
    }

    fn flush(&mut self, key: usize) {
        let Some(conn) = self.conns.get_mut(key) else {
            return;
        };
        let mut failed = false;
        while let Some(front) = conn.out.front_mut() {
            let rest = &front.bytes[front.sent..];
            let iov = [IoSlice::new(rest)];
            let raw: Vec<_> = front.fds.iter().map(AsRawFd::as_raw_fd).collect();
            let cmsg = [ControlMessage::ScmRights(&raw)];
            let cmsgs: &[ControlMessage<'_>] = if front.sent == 0 && !raw.is_empty() {
                &cmsg
            } else {
                &[]
            };
            match sendmsg::<()>(
                conn.stream.as_raw_fd(),
                &iov,
                cmsgs,
                MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
                None,
            ) {
                Ok(n) => {
                    front.sent += n;
                    if front.sent >= front.bytes.len() {
                        conn.out_bytes -= front.bytes.len();
                        conn.out.pop_front();
                    }
                }
                Err(nix::errno::Errno::EINTR) => {}
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => {
                    debug!("connection {key}: write failed: {e}");
                    failed = true;
                    break;
                }
            }
        }
        if failed {
            self.close(key);
            return;
        }
        let want_write = !conn.out.is_empty();
        if want_write != conn.writable {
            let interest = if want_write {
                Interest::READABLE | Interest::WRITABLE
            } else {
                Interest::READABLE
            };
            let _ = self.poll.registry().reregister(
                &mut conn.stream,
                Token(key + FIRST_CONN),
                interest,
            );
            conn.writable = want_write;
        }
        if !want_write && conn.closing {
            self.close(key);
        }
    }

    fn flush_all(&mut self) {
        let keys: Vec<usize> = self.conns.iter().map(|(k, _)| k).collect();
        for k in keys {
            // Best effort, bounded: a frame that does not fit the socket now is dropped.
            self.flush(k);
        }
    }

    fn close_after_flush(&mut self, key: usize) {
        if let Some(conn) = self.conns.get_mut(key) {
            conn.closing = true;
            let _ = self.poll.registry().reregister(
                &mut conn.stream,
                Token(key + FIRST_CONN),
                Interest::WRITABLE,
            );
            conn.writable = true;
        }
        self.flush(key);
    }

    fn close(&mut self, key: usize) {
        let Some(mut conn) = self.conns.try_remove(key) else {
            return;
        };
        let _ = self.poll.registry().deregister(&mut conn.stream);
        debug!("connection {key} closed");
        match conn.role {
            Some(Role::Prefill) if conn.registered => self.worker_lost(Side::Prefill, key),
            Some(Role::Decode) if conn.registered => self.worker_lost(Side::Decode, key),
            Some(Role::Client) => self.client_lost(key),
            _ => {}
        }
    }

    fn protocol_error(&mut self, key: usize, id: RequestId, message: String) {
        bump(&self.counters.protocol_errors);
        debug!("connection {key}: {message}");
        let msg = Message::from(proto::Error {
            code: ErrorCode::BadRequest,
            message,
        });
        self.send(key, id, msg, Vec::new());
        self.close_after_flush(key);
    }

    // ---- frames ------------------------------------------------------------------------

    fn handle(&mut self, key: usize, id: RequestId, msg: Message, fds: Vec<OwnedFd>) {
        let Some(conn) = self.conns.get(key) else {
            return;
        };
        if conn.closing {
            return;
        }
        let role = conn.role;
        match (role, msg) {
            (None, Message::Hello(h)) => self.hello(key, &h),
            (None, other) => {
                self.protocol_error(
                    key,
                    id,
                    format!("expected Hello, got {:?}", other.msg_type()),
                );
            }
            (Some(Role::Client), Message::Submit(s)) => self.submit(key, s),
            (Some(Role::Client), Message::StatusQuery(_)) => {
                let reply = self.status();
                self.send(key, id, reply.into(), Vec::new());
            }
            (Some(r @ (Role::Prefill | Role::Decode)), msg) => {
                self.worker_frame(key, r, id, msg, fds)
            }
            (Some(Role::Client), other) => {
                self.protocol_error(
                    key,
                    id,
                    format!("a client may not send {:?}", other.msg_type()),
                );
            }
        }
    }

    fn hello(&mut self, key: usize, h: &Hello) {
        let Some(version) = h.negotiate() else {
            let msg = format!(
                "protocol versions {}..={} not supported (this kvctld speaks {})",
                h.min_version,
                h.max_version,
                proto::PROTOCOL_VERSION
            );
            self.protocol_error(key, RequestId(0), msg);
            return;
        };
        if self.draining_since.is_some() {
            let msg = proto::Error {
                code: ErrorCode::ShuttingDown,
                message: "kvctld is stopping".into(),
            };
            self.send(key, RequestId(0), msg.into(), Vec::new());
            self.close_after_flush(key);
            return;
        }
        let uid = self.conns.get(key).map_or(u32::MAX, |c| c.uid);
        if matches!(h.role, Role::Prefill | Role::Decode) && !self.may_be_worker(uid) {
            bump(&self.counters.unauthorized);
            warn!(
                "uid {uid} may connect but not register as a {:?} worker",
                h.role
            );
            let msg = proto::Error {
                code: ErrorCode::Unauthorized,
                message: format!("uid {uid} is not allowed to be a worker"),
            };
            self.send(key, RequestId(0), msg.into(), Vec::new());
            self.close_after_flush(key);
            return;
        }
        if let Some(conn) = self.conns.get_mut(key) {
            conn.role = Some(h.role);
        }
        let ack = HelloAck {
            version,
            generation: self.generation,
        };
        self.send(key, RequestId(0), ack.into(), Vec::new());
    }

    fn worker_frame(
        &mut self,
        key: usize,
        role: Role,
        id: RequestId,
        msg: Message,
        fds: Vec<OwnedFd>,
    ) {
        let registered = self.conns.get(key).is_some_and(|c| c.registered);
        let side = if role == Role::Prefill {
            Side::Prefill
        } else {
            Side::Decode
        };
        match msg {
            Message::RegisterWorker(r) if !registered => self.register(key, side, r, fds),
            _ if !registered => {
                self.protocol_error(key, id, "a worker must register first".into());
            }
            Message::PoolReport(r) => {
                if let Some(w) = self.worker_mut(side) {
                    w.report = Some(r);
                }
            }
            Message::Freed(f) => self.freed(side, key, f),
            Message::DecodeReserved(r) if side == Side::Decode => {
                self.advance(id, r.owner, Stage::Reserving, key)
            }
            Message::PrefillDone(d) if side == Side::Prefill => self.prefill_done(id, key, d),
            Message::PullDone(p) if side == Side::Decode => {
                self.advance(id, p.owner, Stage::Pulling, key)
            }
            Message::Tokens(t) if side == Side::Decode => self.tokens(id, key, t),
            Message::Done(d) if side == Side::Decode => self.done(id, key, d),
            Message::Error(e) => {
                if self.owned_by(id, side, key) {
                    if e.code == ErrorCode::VerifyFailed {
                        bump(&self.counters.verify_failed);
                    }
                    let msg = format!("{side} worker: {}", e.message);
                    self.fail(id, e.code, msg);
                }
            }
            other => {
                self.protocol_error(
                    key,
                    id,
                    format!("a {side} worker may not send {:?}", other.msg_type()),
                );
            }
        }
    }

    fn worker_mut(&mut self, side: Side) -> Option<&mut Worker> {
        match side {
            Side::Prefill => self.prefill.as_mut(),
            Side::Decode => self.decode.as_mut(),
        }
    }

    fn worker_conn(&self, side: Side) -> Option<usize> {
        match side {
            Side::Prefill => self.prefill.as_ref().map(|w| w.conn),
            Side::Decode => self.decode.as_ref().map(|w| w.conn),
        }
    }

    fn register(&mut self, key: usize, side: Side, r: RegisterWorker, mut fds: Vec<OwnedFd>) {
        let want_pages = self.cfg.pool(side).pool_pages;
        if r.geometry != self.cfg.geometry || r.pool_pages != want_pages {
            let msg = format!(
                "{side} worker pool ({} pages, {:?}) does not match the configuration ({} pages, {:?})",
                r.pool_pages, r.geometry, want_pages, self.cfg.geometry
            );
            warn!("{msg}");
            self.protocol_error(key, RequestId(0), msg);
            return;
        }
        if self.worker_conn(side).is_some() {
            self.protocol_error(
                key,
                RequestId(0),
                format!("a {side} worker is already registered"),
            );
            return;
        }
        let pool_fd = if side == Side::Prefill {
            fds.pop()
        } else {
            None
        };
        // A prefill worker on TCP names its page server and sends no fd (the frame's fd
        // count was checked against that); on shared memory its fd must be read-only.
        if side == Side::Prefill && r.endpoint.is_none() {
            match pool_fd.as_ref().map(libkv::sys::memfd::is_writable) {
                Some(Ok(false)) => {}
                _ => {
                    self.protocol_error(
                        key,
                        RequestId(0),
                        "the prefill pool fd must be read-only".into(),
                    );
                    return;
                }
            }
        }
        let worker = Worker {
            conn: key,
            pool_pages: r.pool_pages,
            report: None,
            pool_fd,
            endpoint: r.endpoint,
            transports: r.transports,
        };
        match side {
            Side::Prefill => {
                self.prefill = Some(worker);
                self.ledger.prefill_free = r.pool_pages;
            }
            Side::Decode => {
                self.decode = Some(worker);
                self.ledger.decode_free = r.pool_pages;
            }
        }
        if let Some(conn) = self.conns.get_mut(key) {
            conn.registered = true;
        }
        info!("{side} worker registered ({} pages)", r.pool_pages);
        let ack = RegisterAck {
            generation: self.generation,
            max_context: self.limits.max_context,
            max_new_tokens: self.limits.max_new_tokens,
        };
        self.send(key, RequestId(0), ack.into(), Vec::new());
        self.share_prefill_pool();
        self.try_admit();
    }

    /// Hands decoded the prefill pool (read-only, shared memory) or the prefill page server
    /// (TCP) whenever both workers are registered.
    fn share_prefill_pool(&mut self) {
        let (Some(p), Some(d)) = (self.prefill.as_ref(), self.decode.as_ref()) else {
            return;
        };
        if let Some(endpoint) = &p.endpoint {
            if !d.transports.contains(&Transport::Tcp) {
                warn!(
                    "the prefill worker serves pages over TCP, which the decode worker cannot use"
                );
                return;
            }
            // RDMA only when both workers opened a device; otherwise the same page server
            // moves the pages over TCP.
            let rdma =
                p.transports.contains(&Transport::Rdma) && d.transports.contains(&Transport::Rdma);
            info!(
                "decode pulls from the prefill page server {} over {}",
                endpoint.addr,
                if rdma { "RDMA" } else { "TCP" }
            );
            let msg = PrefillEndpoint {
                geometry: self.cfg.geometry,
                pool_pages: p.pool_pages,
                endpoint: endpoint.clone(),
                rdma,
            };
            let dkey = d.conn;
            self.send(dkey, RequestId(0), msg.into(), Vec::new());
            return;
        }
        let Some(fd) = p
            .pool_fd
            .as_ref()
            .and_then(|fd| fd.as_fd().try_clone_to_owned().ok())
        else {
            warn!("cannot duplicate the prefill pool fd");
            return;
        };
        let msg = PrefillPool {
            geometry: self.cfg.geometry,
            pool_pages: p.pool_pages,
        };
        let dkey = d.conn;
        self.send(dkey, RequestId(0), msg.into(), vec![fd]);
    }

    fn worker_lost(&mut self, side: Side, key: usize) {
        if self.worker_conn(side) != Some(key) {
            return;
        }
        warn!("{side} worker lost");
        // No reader is left on decode's side; a lost prefill needs no abort.
        let deferred: Vec<(RequestId, (usize, Abort))> = self.deferred.drain().collect();
        for (id, (k, abort)) in deferred {
            if side == Side::Decode && k != key {
                self.send(k, id, abort.into(), Vec::new());
            }
        }
        match side {
            Side::Prefill => {
                self.prefill = None;
                self.ledger.prefill_free = 0;
            }
            Side::Decode => {
                self.decode = None;
                self.ledger.decode_free = 0;
            }
        }
        // Requests it was told of, or that hold ledger pages lent against its pool, fail.
        let on_side = |h: &Held| match side {
            Side::Prefill => h.prefill,
            Side::Decode => h.decode,
        };
        let hit: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(id, r)| {
                let sent = match side {
                    Side::Prefill => r.sent_prefill,
                    Side::Decode => r.sent_decode,
                };
                sent == Some(key)
                    || self
                        .held
                        .get(id)
                        .and_then(on_side)
                        .is_some_and(|(k, _)| k == key)
            })
            .map(|(id, _)| *id)
            .collect();
        // Its pages went with its process: nothing of them is lent any more.
        for h in self.held.values_mut() {
            let slot = match side {
                Side::Prefill => &mut h.prefill,
                Side::Decode => &mut h.decode,
            };
            if slot.is_some_and(|(k, _)| k == key) {
                *slot = None;
            }
        }
        self.held
            .retain(|_, h| h.prefill.is_some() || h.decode.is_some());
        for id in hit {
            bump(&self.counters.worker_lost);
            self.fail(
                id,
                ErrorCode::WorkerLost,
                format!("the {side} worker was lost"),
            );
        }
    }

    fn client_lost(&mut self, key: usize) {
        let mine: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, r)| r.client == key)
            .map(|(id, _)| *id)
            .collect();
        for id in mine {
            bump(&self.counters.client_gone);
            self.fail(id, ErrorCode::Internal, "client disconnected".into());
        }
    }

    // ---- requests ----------------------------------------------------------------------

    fn submit(&mut self, key: usize, s: Submit) {
        bump(&self.counters.submitted);
        let id = RequestId(self.next_id);
        self.next_id += 1;
        if self.draining_since.is_some() {
            let e = proto::Error {
                code: ErrorCode::ShuttingDown,
                message: "kvctld is stopping".into(),
            };
            self.send(key, id, e.into(), Vec::new());
            return;
        }
        let prompt_tokens = u32::try_from(s.prompt.len()).unwrap_or(u32::MAX);
        let spec = RequestSpec {
            tenant: s.tenant,
            prompt_tokens,
            max_new_tokens: s.max_new_tokens,
        };
        #[cfg_attr(not(feature = "fault-injection"), allow(unused_mut))]
        let mut prompt = s.prompt;
        let need = match admission::need(&spec, &self.limits) {
            Ok(n) => n,
            #[cfg(feature = "fault-injection")]
            Err(admission::Rejection::PromptExceedsContext { .. })
                if fault_active("placeholder") =>
            {
                // The incident, on purpose: the over-long prompt is replaced by a one-token
                // placeholder for prefill while decode still reserves the whole prompt.
                prompt.truncate(1);
                let g = &self.limits.geometry;
                let pages = |t: u64| u32::try_from(g.pages_for_tokens(t)).unwrap_or(u32::MAX);
                Need {
                    prefill_pages: 1,
                    decode_pages: pages(
                        u64::from(spec.prompt_tokens) + u64::from(spec.max_new_tokens),
                    ),
                }
            }
            Err(reason) => {
                // Terminal: answered here, before any worker hears of the request.
                bump(&self.counters.rejected);
                debug!("{id} of tenant {} rejected: {reason}", spec.tenant);
                let e = proto::Error {
                    code: ErrorCode::Rejected,
                    message: reason.to_string(),
                };
                self.send(key, id, e.into(), Vec::new());
                return;
            }
        };
        if self.queue.len() >= self.cfg.control.admission_queue as usize {
            let e = proto::Error {
                code: ErrorCode::PoolFull,
                message: format!("admission queue is full ({} waiting)", self.queue.len()),
            };
            self.send(key, id, e.into(), Vec::new());
            return;
        }
        let now = Instant::now();
        let budget = self.cfg.deadlines.request();
        let asked = Duration::from_millis(u64::from(s.deadline_ms));
        let total = if s.deadline_ms == 0 {
            budget
        } else {
            asked.min(budget)
        };
        let wait = self.cfg.deadlines.admission_wait();
        self.requests.insert(
            id,
            Request {
                client: key,
                spec,
                prompt,
                need,
                stage: Stage::Queued,
                sent_prefill: None,
                sent_decode: None,
                stage_deadline: now + wait,
                stage_budget: wait,
                stage_started: now,
                deadline: now + total,
            },
        );
        self.queue.push_back(id);
        bump(&self.counters.queued);
        self.try_admit();
    }

    fn try_admit(&mut self) {
        while let Some(&id) = self.queue.front() {
            let (Some(p), Some(d)) = (
                self.worker_conn(Side::Prefill),
                self.worker_conn(Side::Decode),
            ) else {
                return;
            };
            let Some(r) = self.requests.get(&id) else {
                self.queue.pop_front();
                continue;
            };
            if self.ledger.take(r.need).is_err() {
                return;
            }
            self.queue.pop_front();
            bump(&self.counters.admitted);
            bump(&self.counters.bootstraps);
            let need = r.need;
            self.held.insert(
                id,
                Held {
                    prefill: Some((p, need.prefill_pages)),
                    decode: Some((d, need.decode_pages)),
                },
            );
            let owner = Owner {
                request: id,
                generation: self.generation,
            };
            let budget = self.cfg.deadlines.bootstrap();
            let Some(r) = self.requests.get_mut(&id) else {
                continue;
            };
            r.stage = Stage::Reserving;
            r.sent_decode = Some(d);
            r.stage_started = Instant::now();
            r.stage_deadline = r.stage_started + budget;
            r.stage_budget = budget;
            let msg = DecodeReserve {
                owner,
                prompt_tokens: r.spec.prompt_tokens,
                max_new_tokens: r.spec.max_new_tokens,
            };
            self.send(d, id, msg.into(), Vec::new());
        }
    }

    /// Whether a frame about `id` from worker connection `key` concerns a live request that
    /// was sent to that worker.
    fn owned_by(&self, id: RequestId, side: Side, key: usize) -> bool {
        self.requests.get(&id).is_some_and(|r| match side {
            Side::Prefill => r.sent_prefill == Some(key),
            Side::Decode => r.sent_decode == Some(key),
        })
    }

    fn check_owner(&self, id: RequestId, owner: Owner) -> bool {
        owner.request == id && owner.generation == self.generation
    }

    fn advance(&mut self, id: RequestId, owner: Owner, from: Stage, key: usize) {
        let side = if from == Stage::Reserving || from == Stage::Pulling {
            Side::Decode
        } else {
            Side::Prefill
        };
        if !self.check_owner(id, owner) || !self.owned_by(id, side, key) {
            // Late frame of a request that already ended: nothing to do.
            debug!("{id}: stale {from:?} reply ignored");
            return;
        }
        let Some(r) = self.requests.get_mut(&id) else {
            return;
        };
        if r.stage != from {
            let msg = format!("{id}: reply for stage {from:?} in stage {:?}", r.stage);
            self.fail(id, ErrorCode::Internal, msg);
            return;
        }
        match from {
            Stage::Reserving => {
                let rtt = r.stage_started.elapsed();
                self.bootstrap_rtt.record(rtt);
                let Some(p) = self.worker_conn(Side::Prefill) else {
                    self.fail(id, ErrorCode::WorkerLost, "no prefill worker".into());
                    return;
                };
                let budget = self.cfg.deadlines.bootstrap();
                let Some(r) = self.requests.get_mut(&id) else {
                    return;
                };
                if let Some(h) = self.held.get_mut(&id) {
                    h.prefill = h.prefill.map(|(_, n)| (p, n));
                }
                r.stage = Stage::Prefilling;
                r.sent_prefill = Some(p);
                r.stage_deadline = Instant::now() + budget;
                r.stage_budget = budget;
                let msg = PrefillRun {
                    owner,
                    prompt: r.prompt.clone(),
                };
                self.send(p, id, msg.into(), Vec::new());
            }
            Stage::Pulling => {
                let budget = self.cfg.deadlines.decode();
                r.stage = Stage::Decoding;
                r.stage_deadline = Instant::now() + budget;
                r.stage_budget = budget;
                // Decode holds verified copies now: prefill's pages can go.
                if let Some(p) = r.sent_prefill {
                    self.send(p, id, Release { owner }.into(), Vec::new());
                }
            }
            _ => {}
        }
    }

    fn prefill_done(&mut self, id: RequestId, key: usize, d: PrefillDone) {
        let m = d.manifest;
        if !self.check_owner(id, m.owner) || !self.owned_by(id, Side::Prefill, key) {
            debug!("{id}: stale PrefillDone ignored");
            return;
        }
        let Some(r) = self.requests.get_mut(&id) else {
            return;
        };
        if r.stage != Stage::Prefilling {
            self.fail(id, ErrorCode::Internal, "PrefillDone out of order".into());
            return;
        }
        // Defence in depth; decoded verifies it all again against its own reservation.
        if m.tokens != r.spec.prompt_tokens {
            bump(&self.counters.verify_failed);
            let msg = format!(
                "prefill manifest covers {} tokens, the request has {}",
                m.tokens, r.spec.prompt_tokens
            );
            self.fail(id, ErrorCode::VerifyFailed, msg);
            return;
        }
        let Some(dkey) = r.sent_decode else { return };
        let budget = self.cfg.deadlines.transfer();
        r.stage = Stage::Pulling;
        r.stage_deadline = Instant::now() + budget;
        r.stage_budget = budget;
        let pages = u64::try_from(m.pages.len()).unwrap_or(u64::MAX);
        let max_new = r.spec.max_new_tokens;
        bump(&self.counters.transfers);
        self.counters
            .pages_transferred
            .fetch_add(pages, Ordering::Relaxed);
        self.counters.bytes_transferred.fetch_add(
            pages.saturating_mul(self.cfg.geometry.bytes_per_page()),
            Ordering::Relaxed,
        );
        self.send(
            dkey,
            id,
            PullKv {
                manifest: m,
                max_new_tokens: max_new,
            }
            .into(),
            Vec::new(),
        );
    }

    fn tokens(&mut self, id: RequestId, key: usize, t: Tokens) {
        if !self.owned_by(id, Side::Decode, key) {
            return;
        }
        let Some(r) = self.requests.get(&id) else {
            return;
        };
        if r.stage != Stage::Decoding {
            self.fail(
                id,
                ErrorCode::Internal,
                "tokens before verified transfer".into(),
            );
            return;
        }
        let client = r.client;
        self.send(client, id, t.into(), Vec::new());
    }

    fn done(&mut self, id: RequestId, key: usize, d: Done) {
        if !self.owned_by(id, Side::Decode, key) {
            return;
        }
        let Some(r) = self.requests.get(&id) else {
            return;
        };
        if r.stage != Stage::Decoding {
            self.fail(
                id,
                ErrorCode::Internal,
                "Done before verified transfer".into(),
            );
            return;
        }
        let client = r.client;
        self.requests.remove(&id);
        bump(&self.counters.completed);
        self.send(client, id, d.into(), Vec::new());
    }

    fn freed(&mut self, side: Side, key: usize, f: Freed) {
        let id = f.owner.request;
        if f.owner.generation != self.generation {
            return;
        }
        let Some(h) = self.held.get_mut(&id) else {
            return;
        };
        let slot = match side {
            Side::Prefill => &mut h.prefill,
            Side::Decode => &mut h.decode,
        };
        if let Some((k, pages)) = *slot
            && k == key
        {
            *slot = None;
            self.ledger.give_back(side, pages);
        }
        if h.prefill.is_none() && h.decode.is_none() {
            self.held.remove(&id);
        }
        if side == Side::Decode
            && let Some((k, abort)) = self.deferred.remove(&id)
        {
            self.send(k, id, abort.into(), Vec::new());
        }
        self.try_admit();
    }

    /// Ends a request with an error to its client and aborts it on the workers that were
    /// told of it. Ledger pages of a side that never heard of it return at once; the others
    /// return when that worker reports them freed.
    fn fail(&mut self, id: RequestId, code: ErrorCode, message: String) {
        let Some(r) = self.requests.remove(&id) else {
            return;
        };
        bump(&self.counters.failed);
        if r.stage == Stage::Queued {
            self.queue.retain(|q| *q != id);
        }
        debug!("{id} failed in {}: {message}", r.stage.name());
        let owner = Owner {
            request: id,
            generation: self.generation,
        };
        // While decoded may still be copying prefill's pages (a pull in flight), prefill must
        // not free them: they would be reused under the copy. Its Abort waits for decoded's
        // Freed (or for decoded to be gone).
        let decode_reading = r.stage == Stage::Pulling
            && r.sent_decode.is_some_and(|k| self.conns.contains(k))
            && self.held.get(&id).is_some_and(|h| h.decode.is_some());
        for (side, sent) in [
            (Side::Decode, r.sent_decode),
            (Side::Prefill, r.sent_prefill),
        ] {
            match sent {
                Some(k) if self.conns.contains(k) => {
                    let abort = Abort {
                        owner,
                        code,
                        reason: message.clone(),
                    };
                    if side == Side::Prefill && decode_reading {
                        self.deferred.insert(id, (k, abort));
                    } else {
                        self.send(k, id, abort.into(), Vec::new());
                    }
                }
                _ => {
                    // Never told, or gone: nothing on that side holds pages for it.
                    if let Some(h) = self.held.get_mut(&id) {
                        let slot = match side {
                            Side::Prefill => &mut h.prefill,
                            Side::Decode => &mut h.decode,
                        };
                        if let Some((k, pages)) = slot.take()
                            && (sent.is_none() || !self.conns.contains(k))
                            && self.worker_conn(side) == Some(k)
                        {
                            self.ledger.give_back(side, pages);
                        }
                    }
                }
            }
        }
        if self
            .held
            .get(&id)
            .is_some_and(|h| h.prefill.is_none() && h.decode.is_none())
        {
            self.held.remove(&id);
        }
        if self.conns.contains(r.client) {
            let e = proto::Error { code, message };
            self.send(r.client, id, e.into(), Vec::new());
        }
        self.try_admit();
    }

    fn expire(&mut self, now: Instant) {
        let hello_by = self.cfg.deadlines.bootstrap();
        let silent: Vec<usize> = self
            .conns
            .iter()
            .filter(|(_, c)| c.role.is_none() && !c.closing && now - c.accepted >= hello_by)
            .map(|(k, _)| k)
            .collect();
        for key in silent {
            debug!(
                "connection {key} said no Hello within {} ms",
                hello_by.as_millis()
            );
            self.protocol_error(
                key,
                RequestId(0),
                "no Hello within the bootstrap deadline".into(),
            );
        }
        let due: Vec<(RequestId, Stage, Duration, bool)> = self
            .requests
            .iter()
            .filter(|(_, r)| now >= r.stage_deadline || now >= r.deadline)
            .map(|(id, r)| (*id, r.stage, r.stage_budget, now >= r.deadline))
            .collect();
        for (id, stage, budget, whole) in due {
            bump(&self.counters.timeouts);
            let (code, msg) = match (stage, whole) {
                (_, true) => (ErrorCode::Timeout, "request deadline exceeded".to_owned()),
                (Stage::Queued, false) if self.prefill.is_none() || self.decode.is_none() => (
                    ErrorCode::WorkerLost,
                    format!(
                        "no prefill and decode workers registered within {} ms",
                        budget.as_millis()
                    ),
                ),
                (Stage::Queued, false) => (
                    ErrorCode::PoolFull,
                    format!("no pool capacity within {} ms", budget.as_millis()),
                ),
                (s, false) => (
                    ErrorCode::Timeout,
                    format!(
                        "{} exceeded its deadline of {} ms",
                        s.name(),
                        budget.as_millis()
                    ),
                ),
            };
            self.fail(id, code, msg);
        }
    }

    fn status(&self) -> StatusReply {
        let mut workers = Vec::new();
        for (role, side, w) in [
            (Role::Prefill, Side::Prefill, self.prefill.as_ref()),
            (Role::Decode, Side::Decode, self.decode.as_ref()),
        ] {
            let pool_pages = w.map_or(self.cfg.pool(side).pool_pages, |w| w.pool_pages);
            let r = w.and_then(|w| w.report.as_ref());
            workers.push(WorkerStatus {
                role,
                connected: w.is_some(),
                pool_pages,
                tokens_per_page: self.cfg.geometry.tokens_per_page,
                free: r.map_or(0, |r| r.free),
                reserved: r.map_or(0, |r| r.reserved),
                writing: r.map_or(0, |r| r.writing),
                readable: r.map_or(0, |r| r.readable),
                draining: r.map_or(0, |r| r.draining),
            });
        }
        let mut counters = self.counters.list();
        counters.push(("in_flight".into(), self.requests.len() as u64));
        for (name, q) in [
            ("bootstrap_rtt_p50_us", 0.5),
            ("bootstrap_rtt_p99_us", 0.99),
        ] {
            if let Some(v) = self.bootstrap_rtt.quantile(q) {
                counters.push((name.into(), v));
            }
        }
        counters.push(("queue_len".into(), self.queue.len() as u64));
        counters.push((
            "ledger.prefill_free".into(),
            u64::from(self.ledger.prefill_free),
        ));
        counters.push((
            "ledger.decode_free".into(),
            u64::from(self.ledger.decode_free),
        ));
        for (prefix, w) in [
            ("prefilld.", self.prefill.as_ref()),
            ("decoded.", self.decode.as_ref()),
        ] {
            if let Some(r) = w.and_then(|w| w.report.as_ref()) {
                for (name, v) in &r.counters {
                    if counters.len() < proto::MAX_COUNTERS {
                        counters.push((format!("{prefix}{name}"), *v));
                    }
                }
            }
        }
        counters.truncate(proto::MAX_COUNTERS);
        let transport = match (self.prefill.as_ref(), self.decode.as_ref()) {
            (Some(p), Some(d)) => Some(match &p.endpoint {
                None => Transport::Shm,
                Some(_)
                    if p.transports.contains(&Transport::Rdma)
                        && d.transports.contains(&Transport::Rdma) =>
                {
                    Transport::Rdma
                }
                Some(_) => Transport::Tcp,
            }),
            _ => None,
        };
        StatusReply {
            generation: self.generation,
            max_context: self.limits.max_context,
            max_new_tokens: self.limits.max_new_tokens,
            workers,
            counters,
            transport,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_names_are_for_humans() {
        assert_eq!(Stage::Pulling.name(), "transfer");
        assert_eq!(Stage::Queued.name(), "admission");
    }
}
