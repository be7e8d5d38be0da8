//! The worker side of the kvctld connection and the worker event loop, shared by prefilld and
//! decoded.
//!
//! A [`Link`] owns the one connection to kvctld: connect with backoff (100 ms doubling to
//! 1 s), `Hello` / `HelloAck`, `RegisterWorker` / `RegisterAck` (under the worker's id), then
//! frames in both directions. Reads go through a [`FrameReader`] (every layer of validation
//! before a frame reaches the worker); writes go through an [`Outbox`] that waits for
//! `WRITABLE` when the socket is full. Any protocol error, read error or write error drops the
//! connection: the worker is told ([`LinkEvent::Lost`]) and aborts everything it holds before
//! the link reconnects. A refusal of the registration is retried the same way, except
//! `Misconfigured`: retrying cannot help, so the loop ends with
//! [`LinkError::Misconfigured`] (the worker exits with its configuration exit code).
//!
//! [`serve`] is the one mio event loop of a worker: fixed tokens for the kvctld connection,
//! the waker (job threads and [`Shutdown`]) and SIGTERM/SIGINT. A stop is graceful:
//!
//! ```text
//! SIGTERM / SIGINT / Shutdown::request
//!   ├─ not registered ──────────────────────────────▶ stop
//!   └─ registered: send Drain{own id, drain: true}, keep serving every frame
//!        ├─ DrainReply (nothing in flight, no page lent) ─▶ stop
//!        ├─ deadlines.drain passed ───────────────────────▶ stop
//!        ├─ kvctld connection lost ───────────────────────▶ stop
//!        └─ a second signal or request ───────────────────▶ stop
//! stop: the worker aborts what it still holds (reporting Freed), the connection closes.
//! ```

use crate::config::Config;
use crate::metrics::{Board, WorkerSample, request_context_tokens};
use crate::model::ModelRunner;
use crate::outbox::{Flushed, Outbox};
use crate::pool::PoolUsage;
use crate::proto::{
    Drain, DrainReply, ErrorCode, Header, Message, PROTOCOL_VERSION, RegisterAck, RegisterWorker,
    Role, WorkerStatus,
};
use crate::sys::uds::{FrameReader, ReadOutcome};
use crate::{Generation, Owner, RequestId};
use log::{debug, error, info, warn};
use mio::net::UnixStream;
use mio::{Events, Interest, Poll, Registry, Token, Waker};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook_mio::v1_0::Signals;
use std::io;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The kvctld connection.
pub const CONN: Token = Token(0);
/// Job threads and [`Shutdown::request`] wake the loop through this token.
pub const WAKER: Token = Token(1);
/// SIGTERM / SIGINT.
pub const SIGNALS: Token = Token(2);

/// First reconnect delay.
pub const BACKOFF_START: Duration = Duration::from_millis(100);
/// Longest reconnect delay.
pub const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Frames queued for kvctld beyond which it is considered stuck and the connection dropped.
const MAX_OUTBOX_FRAMES: usize = 1 << 16;
/// Bytes queued for kvctld beyond which it is considered stuck (64 MiB: far more than a
/// worker sends between two reads of a live kvctld).
const MAX_OUTBOX_BYTES: usize = 64 << 20;

/// Errors that end a worker's event loop.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// Creating the poller or its waker failed.
    #[error("creating the event loop")]
    Setup(#[source] io::Error),
    /// Installing the SIGTERM / SIGINT handlers failed.
    #[error("installing the SIGTERM/SIGINT handlers")]
    Signals(#[source] io::Error),
    /// Waiting for events failed (other than EINTR).
    #[error("waiting for events")]
    Wait(#[source] io::Error),
    /// kvctld refused the registration as one it can never accept (`Misconfigured`).
    #[error("kvctld refused the registration of worker {id}: {message}")]
    Misconfigured { id: String, message: String },
}

impl LinkError {
    /// Whether the configuration, not the system, is at fault: retrying cannot help.
    pub fn is_config(&self) -> bool {
        matches!(self, LinkError::Misconfigured { .. })
    }
}

/// Stops a running worker from another thread (tests, embedding). Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Shutdown {
    inner: Arc<ShutdownInner>,
}

#[derive(Debug, Default)]
struct ShutdownInner {
    /// 0: running; 1: drain, then stop; 2: stop at once.
    level: AtomicU8,
    waker: Mutex<Option<Arc<Waker>>>,
}

impl Shutdown {
    /// A handle no one has requested yet.
    pub fn new() -> Shutdown {
        Shutdown::default()
    }

    /// Asks the worker to stop as on SIGTERM: drain first while registered, then stop; `run`
    /// then returns `Ok(())`. A second request stops at once, as a second signal does.
    pub fn request(&self) {
        let _ = self
            .inner
            .level
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |l| Some((l + 1).min(2)));
        self.wake();
    }

    /// Asks the worker to stop at once, without draining.
    pub fn request_now(&self) {
        self.inner.level.store(2, Ordering::SeqCst);
        self.wake();
    }

    /// Whether a stop was requested.
    pub fn is_requested(&self) -> bool {
        self.level() > 0
    }

    fn level(&self) -> u8 {
        self.inner.level.load(Ordering::SeqCst)
    }

    fn wake(&self) {
        let waker = self.inner.waker.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = waker.as_ref() {
            // A failed wake only delays the stop to the loop's next timer.
            let _ = w.wake();
        }
    }

    fn attach(&self, waker: Arc<Waker>) {
        *self.inner.waker.lock().unwrap_or_else(|e| e.into_inner()) = Some(waker);
    }
}

/// How `run` is driven.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Install SIGTERM / SIGINT handlers (the daemons do; in-process tests do not).
    pub handle_signals: bool,
    /// Another way to stop the worker.
    pub shutdown: Shutdown,
    /// The model to run instead of the one `[model]` names: what an engine that embeds the
    /// worker passes (its [`crate::engine::EngineRunner`]).
    pub model: Option<Arc<dyn ModelRunner>>,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            handle_signals: true,
            shutdown: Shutdown::new(),
            model: None,
        }
    }
}

/// Reconnect delays: 100 ms doubling to 1 s.
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff::new()
    }
}

impl Backoff {
    pub fn new() -> Backoff {
        Backoff {
            next: BACKOFF_START,
        }
    }

    /// The delay before the next attempt; doubles the one after, up to [`BACKOFF_MAX`].
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (d * 2).min(BACKOFF_MAX);
        d
    }

    pub fn reset(&mut self) {
        self.next = BACKOFF_START;
    }
}

/// What the link reports to its worker.
#[derive(Debug)]
pub enum LinkEvent {
    /// kvctld accepted the registration; requests may follow.
    Registered(RegisterAck),
    /// A frame from a registered connection, fully validated by the reader.
    Frame(Header, Message, Vec<OwnedFd>),
    /// The connection is gone; the worker must abort everything it holds.
    Lost,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// No connection; the next attempt is due at `retry_at`.
    Down { retry_at: Instant },
    /// `Hello` sent, waiting for `HelloAck` until `deadline`.
    Hello { deadline: Instant },
    /// `RegisterWorker` sent, waiting for `RegisterAck` until `deadline`.
    Register {
        deadline: Instant,
        generation: Generation,
    },
    /// Registered in `generation`.
    Ready { generation: Generation },
    /// kvctld refused the registration for good (`Link::refusal` says why); no retry.
    Refused,
}

/// Where a graceful stop stands on the current connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Draining {
    /// No `Drain` sent.
    No,
    /// `Drain` sent, no `DrainReply` yet.
    Asked,
    /// kvctld answered `DrainReply`: nothing is in flight on this worker.
    Drained,
}

#[derive(Debug)]
struct Conn {
    stream: UnixStream,
    reader: FrameReader,
    outbox: Outbox,
    /// Whether WRITABLE interest is registered.
    writable: bool,
    /// The reader paused with data possibly left in the socket.
    more: bool,
}

/// The connection to kvctld and its lifecycle.
#[derive(Debug)]
pub struct Link {
    socket: PathBuf,
    /// Reaches kvctld over mutual TLS instead of `socket` (`[tls] connect`).
    tls: Option<crate::tls::Connector>,
    /// Finds the leading kvctld in etcd before each connection (`[election]`); `tls` then
    /// reaches the address found.
    leader: Option<crate::leader::LeaderLookup>,
    /// How often the leader's key is read while registered (a tenth of the election's TTL).
    watch_every: Duration,
    /// Reads the leader's key while the loop runs, to leave a kvctld etcd no longer names.
    watch: Option<crate::leader::LeaderWatch>,
    /// The newest kvctld generation registered with, or named leader by etcd: an older
    /// kvctld is never served.
    fence: crate::fence::EpochFence,
    register: RegisterWorker,
    /// Attached (as a duplicate) to every `RegisterWorker`: prefill's read-only pool fd.
    register_fd: Option<OwnedFd>,
    handshake_timeout: Duration,
    /// Longest a graceful stop waits for kvctld's `DrainReply`.
    drain_timeout: Duration,
    backoff: Backoff,
    stage: Stage,
    conn: Option<Conn>,
    draining: Draining,
    /// Why kvctld refused the registration for good.
    refusal: Option<String>,
    frames_received: u64,
    /// The pool's page counts in the last `PoolReport` sent on this connection.
    last_report: Option<PoolUsage>,
    /// This worker's entry among the members in etcd (`[election]`), withdrawn on drop.
    membership: Option<crate::members::Publisher>,
    /// Where the worker's own `/metrics` reads its status, when `[metrics] listen` is set,
    /// with the context one request may need of the pool.
    metrics: Option<(Board<WorkerSample>, u64)>,
}

impl Link {
    /// A link that will connect to `cfg`'s control socket, or through `tls`, and register
    /// with `register` (attaching a duplicate of `register_fd`, if any). The handshake must
    /// finish within `deadlines.bootstrap`; a graceful stop waits at most `deadlines.drain`.
    pub fn new(
        cfg: &Config,
        register: RegisterWorker,
        register_fd: Option<OwnedFd>,
        tls: Option<crate::tls::Connector>,
    ) -> Link {
        Link {
            socket: cfg.control.socket.clone(),
            tls,
            leader: None,
            watch_every: Duration::ZERO,
            watch: None,
            fence: crate::fence::EpochFence::new(),
            register,
            register_fd,
            handshake_timeout: cfg.deadlines.bootstrap(),
            drain_timeout: cfg.deadlines.drain(),
            backoff: Backoff::new(),
            stage: Stage::Down {
                retry_at: Instant::now(),
            },
            conn: None,
            draining: Draining::No,
            refusal: None,
            frames_received: 0,
            last_report: None,
            metrics: None,
            membership: None,
        }
    }

    /// Where kvctld is reached, for messages.
    fn place(&self) -> String {
        match (&self.tls, &self.leader) {
            (Some(t), Some(l)) if t.addr().is_empty() => l.place(),
            (Some(t), _) => format!("tls://{}", t.addr()),
            (None, _) => self.socket.display().to_string(),
        }
    }

    /// Connects to the leader `lookup` finds in etcd (over the link's TLS connector)
    /// instead of a fixed address, and, while registered, leaves a kvctld as soon as etcd
    /// names a newer leader (read every tenth of `ttl`, the election's lease).
    pub fn follow_leader(&mut self, lookup: crate::leader::LeaderLookup, ttl: Duration) {
        self.leader = Some(lookup);
        self.watch_every = crate::leader::LeaderWatch::interval(ttl);
    }

    /// Starts reading the leader's key (when following one), waking the loop through
    /// `waker` when a newer leader appears.
    fn start_watch(&mut self, waker: &Arc<Waker>) {
        let Some(lookup) = self.leader.clone() else {
            return;
        };
        let waker = Arc::clone(waker);
        self.watch = crate::leader::LeaderWatch::start(lookup, self.watch_every, move || {
            let _ = waker.wake();
        });
    }

    /// Leaves the kvctld this worker registered with once etcd names a newer leader: a
    /// leader that stopped (SIGSTOP, a hung host) keeps its connections open, and every
    /// request would fail until it ran again. What the worker holds is aborted as on any
    /// lost connection; it then registers with the leader etcd names.
    fn leave_deposed(&mut self, registry: &Registry, out: &mut Vec<LinkEvent>) {
        let (Some(watch), Stage::Ready { generation }) = (&self.watch, self.stage) else {
            return;
        };
        let newest = watch.newest();
        if newest > generation.0 {
            let reason = format!(
                "etcd names a newer leader (generation {newest}; this kvctld's is {})",
                generation.0
            );
            self.lose(registry, &reason, out);
        }
    }

    /// Publishes this worker among the members in etcd for as long as the link lives.
    pub fn publish_membership(&mut self, cfg: &crate::config::Election) {
        let member = crate::members::Member::of(&self.register);
        self.membership = crate::members::Publisher::start(cfg, member);
    }

    /// The TLS connector to the leader etcd names now, whose epoch the fence then holds (a
    /// kvctld answering with an older generation is not the leader and is never served).
    fn leader_connector(&mut self) -> Result<crate::tls::Connector, String> {
        let (Some(lookup), Some(tls)) = (&self.leader, &self.tls) else {
            return Err("no leader lookup".into());
        };
        let leader = lookup.find().map_err(|e| crate::error_chain(&e))?;
        self.fence
            .observe(Generation(leader.epoch))
            .map_err(|e| format!("etcd names leader {}: {e}", leader.addr))?;
        let to = tls.to(&leader.addr);
        self.tls = Some(to.clone());
        Ok(to)
    }

    /// Publishes the worker's status on `board` from now on (see [`Link::publish`]).
    pub fn publish_to(&mut self, board: Board<WorkerSample>, cfg: &Config) {
        let context = request_context_tokens(
            self.register.role,
            cfg.limits.max_context,
            cfg.limits.max_new_tokens,
        );
        self.metrics = Some((board, context));
    }

    /// Hands the worker's `/metrics` its status now: its pool's page counts, its counters
    /// (after the link's own) and its requests in flight, with whether it is registered
    /// and draining.
    fn publish(&self, load: Load) {
        let Some((board, context)) = &self.metrics else {
            return;
        };
        let u = load.usage;
        let mut counters = Vec::with_capacity(load.counters.len() + 1);
        counters.push(("frames_received".to_owned(), self.frames_received));
        counters.extend(load.counters);
        let status = WorkerStatus {
            id: self.register.id.clone(),
            role: self.register.role,
            connected: self.is_registered(),
            drain: self.draining != Draining::No,
            in_flight: load.in_flight,
            held_pages: u.total - u.free,
            transports: self.register.transports.clone(),
            served: 0,
            counters,
            pool_pages: self.register.pool_pages,
            tokens_per_page: self.register.geometry.tokens_per_page,
            free: u.free,
            reserved: u.reserved,
            writing: u.writing,
            readable: u.readable,
            draining: u.draining,
            max_batch: self.register.max_batch,
        };
        board.publish(WorkerSample {
            status,
            context_tokens: *context,
        });
    }

    /// Remembers the page counts of a `PoolReport` just sent.
    pub fn reported(&mut self, usage: PoolUsage) {
        self.last_report = Some(usage);
    }

    /// The page counts of the last `PoolReport` sent since registering, if any.
    pub fn last_reported(&self) -> Option<PoolUsage> {
        self.last_report
    }

    fn role(&self) -> Role {
        self.register.role
    }

    /// The id this worker registers under.
    pub fn id(&self) -> &str {
        &self.register.id
    }

    /// Frames received from kvctld, on every connection so far.
    pub fn frames_received(&self) -> u64 {
        self.frames_received
    }

    /// Whether the job of `owner` should stop: kvctld sent an `Abort` or a `Release` for it
    /// that the worker has not handled yet, or the connection to kvctld is gone (then
    /// everything is abandoned). A long job (a prefill) asks between chunks. Reads what the
    /// socket holds without blocking; the frames stay queued and the loop handles them as
    /// usual once the job returns.
    pub fn abandoned(&mut self, owner: Owner) -> bool {
        let Some(conn) = self.conn.as_mut() else {
            return true;
        };
        let outcome = conn.reader.read_from(&conn.stream);
        // Whatever was read is for the loop to handle next, without waiting for readiness.
        conn.more = true;
        if !matches!(
            outcome,
            Ok(ReadOutcome::WouldBlock
                | ReadOutcome::Progressed { .. }
                | ReadOutcome::Paused { .. })
        ) {
            return true;
        }
        conn.reader.queued().any(|(_, msg, _)| match msg {
            Message::Abort(m) => m.owner == owner,
            Message::Release(m) => m.owner == owner,
            _ => false,
        })
    }

    /// Whether kvctld accepted the registration on the current connection.
    pub fn is_registered(&self) -> bool {
        matches!(self.stage, Stage::Ready { .. })
    }

    /// Why kvctld refused the registration for good, once it has.
    pub fn refusal(&self) -> Option<&str> {
        self.refusal.as_deref()
    }

    /// When the loop must call [`Link::tick`] next, if ever. `may_connect` as for `tick`.
    fn timer(&self, may_connect: bool) -> Option<Instant> {
        match self.stage {
            Stage::Down { retry_at } => may_connect.then_some(retry_at),
            Stage::Hello { deadline } | Stage::Register { deadline, .. } => Some(deadline),
            Stage::Ready { .. } | Stage::Refused => None,
        }
    }

    fn read_pending(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| c.more)
    }

    /// Connects when a retry is due and `may_connect` (the worker holds nothing), and gives
    /// up on a handshake that took too long.
    fn tick(
        &mut self,
        registry: &Registry,
        now: Instant,
        may_connect: bool,
        out: &mut Vec<LinkEvent>,
    ) {
        match self.stage {
            Stage::Down { retry_at } if may_connect && now >= retry_at => self.connect(registry),
            Stage::Hello { deadline } | Stage::Register { deadline, .. } if now >= deadline => {
                let reason = format!(
                    "no answer to the handshake within {} ms",
                    self.handshake_timeout.as_millis()
                );
                self.lose(registry, &reason, out);
            }
            _ => {}
        }
    }

    fn connect(&mut self, registry: &Registry) {
        let now = Instant::now();
        let tls = match (&self.leader, &self.tls) {
            (Some(_), _) => self.leader_connector().map(Some),
            (None, tls) => Ok(tls.clone()),
        };
        let connected = match tls {
            Err(e) => Err(e),
            Ok(None) => UnixStream::connect(&self.socket).map_err(|e| e.to_string()),
            // The TLS handshake blocks this loop for at most the handshake deadline; only
            // while kvctld is out of reach, when no request can be running anyway.
            Ok(Some(tls)) => tls
                .connect(self.handshake_timeout)
                .map_err(|e| e.to_string())
                .and_then(|s| {
                    s.set_nonblocking(true).map_err(|e| e.to_string())?;
                    Ok(UnixStream::from_std(s))
                }),
        };
        let mut stream = match connected {
            Ok(s) => s,
            Err(e) => {
                let delay = self.backoff.next_delay();
                debug!(
                    "kvctld at {} not reachable ({e}); retrying in {} ms",
                    self.place(),
                    delay.as_millis()
                );
                self.stage = Stage::Down {
                    retry_at: now + delay,
                };
                return;
            }
        };
        if let Err(e) = registry.register(&mut stream, CONN, Interest::READABLE) {
            let delay = self.backoff.next_delay();
            warn!("cannot poll the kvctld connection: {e}");
            self.stage = Stage::Down {
                retry_at: now + delay,
            };
            return;
        }
        debug!("connected to kvctld at {}", self.place());
        self.conn = Some(Conn {
            stream,
            reader: FrameReader::new(),
            outbox: Outbox::new(),
            writable: false,
            more: false,
        });
        self.draining = Draining::No;
        self.stage = Stage::Hello {
            deadline: now + self.handshake_timeout,
        };
        self.queue(
            RequestId(0),
            &crate::proto::Hello::new(self.role()).into(),
            Vec::new(),
        );
    }

    /// Drops the connection (if any) and schedules the next attempt.
    fn lose(&mut self, registry: &Registry, reason: &str, out: &mut Vec<LinkEvent>) {
        let was_ready = self.is_registered();
        self.drop_conn(registry, out);
        let delay = self.backoff.next_delay();
        if was_ready {
            info!(
                "disconnected from kvctld: {reason}; reconnecting in {} ms",
                delay.as_millis()
            );
        } else {
            debug!(
                "kvctld handshake failed: {reason}; retrying in {} ms",
                delay.as_millis()
            );
        }
        self.stage = Stage::Down {
            retry_at: Instant::now() + delay,
        };
    }

    fn drop_conn(&mut self, registry: &Registry, out: &mut Vec<LinkEvent>) {
        if let Some(mut conn) = self.conn.take() {
            // The socket closes when dropped; deregistering first keeps the poller clean.
            let _ = registry.deregister(&mut conn.stream);
            out.push(LinkEvent::Lost);
        }
        self.draining = Draining::No;
    }

    /// Queues `msg` for kvctld while registered; drops it otherwise (there is no one to
    /// tell: the worker aborts everything when the link is lost).
    pub fn send(&mut self, id: RequestId, msg: impl Into<Message>) {
        if !self.is_registered() {
            return;
        }
        self.queue(id, &msg.into(), Vec::new());
    }

    /// Queues a frame a job thread encoded, while registered.
    pub fn send_encoded(&mut self, bytes: Vec<u8>) {
        if !self.is_registered() {
            return;
        }
        if let Some(conn) = self.conn.as_mut() {
            conn.outbox.push(bytes, Vec::new());
        }
    }

    fn queue(&mut self, id: RequestId, msg: &Message, fds: Vec<OwnedFd>) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        match msg.encode(id) {
            Ok(bytes) => conn.outbox.push(bytes, fds),
            Err(e) => warn!("cannot encode a {:?} frame: {e}", msg.msg_type()),
        }
    }

    /// Asks kvctld to send this worker no new requests (`Drain` for its own id). Returns
    /// false, sending nothing, when not registered.
    fn start_drain(&mut self) -> bool {
        if !self.is_registered() {
            return false;
        }
        let drain = Drain {
            worker: self.register.id.clone(),
            drain: true,
        };
        self.send(RequestId(0), drain);
        self.draining = Draining::Asked;
        true
    }

    /// Whether kvctld answered this connection's `Drain`.
    fn drained(&self) -> bool {
        self.draining == Draining::Drained
    }

    /// Writes queued frames until the socket is full (then waits for WRITABLE).
    fn flush(&mut self, registry: &Registry, out: &mut Vec<LinkEvent>) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        if conn.outbox.len() > MAX_OUTBOX_FRAMES || conn.outbox.bytes() > MAX_OUTBOX_BYTES {
            let reason = format!(
                "kvctld is not reading: {} frames ({} bytes) queued",
                conn.outbox.len(),
                conn.outbox.bytes()
            );
            self.lose(registry, &reason, out);
            return;
        }
        let mut failed = match conn.outbox.flush(&conn.stream) {
            Ok(Flushed::Empty | Flushed::Pending) => None,
            Err(e) => Some(format!("writing to kvctld: {e}")),
        };
        if failed.is_none() {
            let want = !conn.outbox.is_empty();
            if want != conn.writable {
                let interest = if want {
                    Interest::READABLE | Interest::WRITABLE
                } else {
                    Interest::READABLE
                };
                match registry.reregister(&mut conn.stream, CONN, interest) {
                    Ok(()) => conn.writable = want,
                    Err(e) => failed = Some(format!("polling the kvctld connection: {e}")),
                }
            }
        }
        if let Some(reason) = failed {
            self.lose(registry, &reason, out);
        }
    }

    /// Reads what the socket has (one [`FrameReader::read_from`] round) and handles every
    /// complete frame.
    fn on_readable(&mut self, registry: &Registry, out: &mut Vec<LinkEvent>) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        conn.more = false;
        let outcome = conn.reader.read_from(&conn.stream);
        let mut frames = Vec::new();
        let mut failure = None;
        loop {
            match conn.reader.next_frame() {
                Ok(Some(frame)) => frames.push(frame),
                Ok(None) => break,
                Err(e) => {
                    if let Some(reply) = e.reply() {
                        // Best effort, after what is queued (never inside a half-written
                        // frame): the connection is dropped either way.
                        if let Ok(bytes) = Message::from(reply).encode(RequestId(0)) {
                            conn.outbox.push(bytes, Vec::new());
                            let _ = conn.outbox.flush(&conn.stream);
                        }
                    }
                    failure = Some(format!("protocol error from kvctld: {e}"));
                    break;
                }
            }
        }
        for (header, msg, fds) in frames {
            self.frames_received += 1;
            if self.conn.is_none() {
                break;
            }
            self.handle(registry, header, msg, fds, out);
        }
        if self.conn.is_none() {
            return;
        }
        let failure = failure.or(match outcome {
            Ok(ReadOutcome::Eof) => Some("kvctld closed the connection".to_owned()),
            Ok(ReadOutcome::Failed) => Some("kvctld sent an invalid frame".to_owned()),
            Ok(ReadOutcome::Paused { .. }) => {
                if let Some(conn) = self.conn.as_mut() {
                    conn.more = true;
                }
                None
            }
            Ok(ReadOutcome::WouldBlock | ReadOutcome::Progressed { .. }) => None,
            Err(e) => Some(format!("reading from kvctld: {e}")),
        });
        if let Some(reason) = failure {
            self.lose(registry, &reason, out);
        }
    }

    fn handle(
        &mut self,
        registry: &Registry,
        header: Header,
        msg: Message,
        fds: Vec<OwnedFd>,
        out: &mut Vec<LinkEvent>,
    ) {
        let refused = |what: &str, msg: &Message| match msg {
            Message::Error(e) => format!("kvctld refused the {what}: {}: {}", e.code, e.message),
            other => format!("unexpected {:?} in answer to the {what}", other.msg_type()),
        };
        match (self.stage, msg) {
            (Stage::Ready { .. }, Message::DrainReply(reply)) => self.drain_reply(&reply),
            (Stage::Ready { .. }, msg) => out.push(LinkEvent::Frame(header, msg, fds)),
            (Stage::Hello { .. }, Message::HelloAck(ack))
                if ack.version == PROTOCOL_VERSION && self.fence.check(ack.generation).is_err() =>
            {
                // a kvctld older than one this worker registered with: never act for it
                let reason = self
                    .fence
                    .check(ack.generation)
                    .err()
                    .map(|e| e.to_string())
                    .unwrap_or_default();
                warn!("{reason}");
                self.lose(registry, &reason, out);
            }
            (Stage::Hello { .. }, Message::HelloAck(ack)) if ack.version == PROTOCOL_VERSION => {
                let fds = match self.register_fd.as_ref().map(OwnedFd::try_clone) {
                    None => Vec::new(),
                    Some(Ok(fd)) => vec![fd],
                    Some(Err(e)) => {
                        let reason = format!("duplicating the pool fd: {e}");
                        self.lose(registry, &reason, out);
                        return;
                    }
                };
                let register = Message::from(self.register.clone());
                self.queue(RequestId(0), &register, fds);
                self.stage = Stage::Register {
                    deadline: Instant::now() + self.handshake_timeout,
                    generation: ack.generation,
                };
            }
            (Stage::Hello { .. }, Message::HelloAck(ack)) => {
                let reason = format!(
                    "kvctld chose protocol version {}, this build speaks {PROTOCOL_VERSION}",
                    ack.version
                );
                self.lose(registry, &reason, out);
            }
            (Stage::Register { generation, .. }, Message::RegisterAck(ack)) => {
                if ack.generation != generation {
                    let reason = format!(
                        "RegisterAck generation {} differs from HelloAck generation {}",
                        ack.generation.0, generation.0
                    );
                    self.lose(registry, &reason, out);
                    return;
                }
                if let Err(e) = self.fence.observe(generation) {
                    self.lose(registry, &e.to_string(), out);
                    return;
                }
                info!(
                    "registered with kvctld as {:?} worker {} (generation {})",
                    self.role(),
                    self.register.id,
                    generation.0
                );
                self.backoff.reset();
                self.stage = Stage::Ready { generation };
                out.push(LinkEvent::Registered(ack));
            }
            (Stage::Hello { .. } | Stage::Register { .. }, Message::Error(e))
                if e.code == ErrorCode::Misconfigured =>
            {
                error!(
                    "kvctld refused worker {} for good: {}; not retrying",
                    self.register.id, e.message
                );
                self.drop_conn(registry, out);
                self.refusal = Some(e.message);
                self.stage = Stage::Refused;
            }
            (Stage::Hello { .. }, msg) => {
                let reason = refused("Hello", &msg);
                if matches!(&msg, Message::Error(e) if e.code == ErrorCode::Unauthorized) {
                    warn!("{reason}");
                }
                self.lose(registry, &reason, out);
            }
            (Stage::Register { .. }, msg) => {
                let reason = refused("registration", &msg);
                if matches!(msg, Message::Error(_)) {
                    warn!("{reason}");
                }
                self.lose(registry, &reason, out);
            }
            (Stage::Down { .. } | Stage::Refused, _) => {}
        }
    }

    /// kvctld's answer to this worker's `Drain`, sent once nothing is in flight on it and no
    /// page is lent against its pool.
    fn drain_reply(&mut self, reply: &DrainReply) {
        if self.draining == Draining::No {
            debug!("DrainReply without a Drain; ignoring");
        } else if reply.worker.id != self.register.id {
            warn!(
                "DrainReply for worker {}, this is {}; ignoring",
                reply.worker.id, self.register.id
            );
        } else {
            debug!(
                "kvctld drained worker {} ({} in flight, {} pages lent)",
                reply.worker.id, reply.worker.in_flight, reply.worker.held_pages
            );
            self.draining = Draining::Drained;
        }
    }

    /// Sends what is queued (best effort) and closes the connection.
    fn close(&mut self, registry: &Registry) {
        let mut out = Vec::new();
        self.flush(registry, &mut out);
        if let Some(mut conn) = self.conn.take() {
            let _ = registry.deregister(&mut conn.stream);
            if !conn.outbox.is_empty() {
                debug!("{} frames for kvctld dropped at exit", conn.outbox.len());
            }
        }
    }
}

/// What a worker says of itself for its `/metrics` ([`Worker::load`]).
#[derive(Clone, Debug)]
pub struct Load {
    pub usage: PoolUsage,
    pub counters: Vec<(String, u64)>,
    pub in_flight: u32,
}

/// What a worker does with the link's events; [`serve`] drives it.
pub trait Worker {
    /// Whether the worker holds nothing (all pages free, no job), so it may register.
    fn can_register(&self) -> bool;
    /// kvctld accepted the registration: remember the generation, send a `PoolReport`.
    fn on_registered(&mut self, link: &mut Link, ack: &RegisterAck);
    /// A frame from kvctld while registered.
    fn on_frame(&mut self, link: &mut Link, header: Header, msg: Message, fds: Vec<OwnedFd>);
    /// The connection is gone: abort everything held, wait for jobs to end.
    fn on_lost(&mut self);
    /// The waker fired (or the loop went round): take what job threads sent.
    fn on_wake(&mut self, _link: &mut Link) {}
    /// The earliest deadline of anything held.
    fn next_deadline(&self) -> Option<Instant>;
    /// Ends what passed its deadline.
    fn expire(&mut self, link: &mut Link, now: Instant);
    /// Sends a `PoolReport` if the pool's page counts changed since the last one: pages
    /// move between reserved, writing and readable without an event that reports them.
    /// Called every [`REPORT_EVERY`] while registered.
    fn refresh_report(&mut self, _link: &mut Link) {}
    /// The pool's page counts, the worker's counters and its requests now, for its own
    /// `/metrics` (asked every [`REPORT_EVERY`] when that is on).
    fn load(&self) -> Load;
    /// Stop: abort everything (reporting `Freed` while the link is up), within the drain time.
    fn shutdown(&mut self, link: &mut Link);
}

fn dispatch(link: &mut Link, worker: &mut impl Worker, out: &mut Vec<LinkEvent>) {
    for event in std::mem::take(out) {
        match event {
            LinkEvent::Registered(ack) => {
                worker.on_registered(link, &ack);
                // Readiness for the service manager: the pool is allocated, registered with
                // kvctld and serving. Harmless without one (no NOTIFY_SOCKET).
                let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
            }
            LinkEvent::Frame(header, msg, fds) => worker.on_frame(link, header, msg, fds),
            LinkEvent::Lost => worker.on_lost(),
        }
    }
}

/// Whether the loop goes on, and if not, why.
fn stop_reason(
    link: &mut Link,
    requests: u8,
    drain_deadline: &mut Option<Instant>,
    now: Instant,
) -> Option<String> {
    if requests >= 2 {
        return Some("a second stop request: stopping now".to_owned());
    }
    if requests == 0 {
        return None;
    }
    let Some(deadline) = *drain_deadline else {
        if !link.start_drain() {
            return Some("stop requested while not registered: stopping now".to_owned());
        }
        info!(
            "stop requested: draining worker {} (up to {} ms)",
            link.id(),
            link.drain_timeout.as_millis()
        );
        *drain_deadline = Some(now + link.drain_timeout);
        // The service manager hears of the stop now, not when the drain ends.
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
        return None;
    };
    if link.drained() {
        Some("kvctld drained this worker: stopping".to_owned())
    } else if !link.is_registered() {
        Some("the kvctld connection ended while draining: stopping".to_owned())
    } else if now >= deadline {
        Some(format!(
            "no DrainReply within {} ms: stopping",
            link.drain_timeout.as_millis()
        ))
    } else {
        None
    }
}

/// How often a registered worker looks whether its pool changed unreported.
pub const REPORT_EVERY: Duration = Duration::from_millis(250);

/// The worker's event loop: runs until stopped (see the module doc: SIGTERM/SIGINT if
/// `opts.handle_signals`, or `opts.shutdown`; registered, it drains first), then lets the
/// worker abort what it holds and returns. Ends with [`LinkError::Misconfigured`] when kvctld
/// refuses the registration for good.
pub fn serve(
    mut poll: Poll,
    waker: Arc<Waker>,
    mut link: Link,
    worker: &mut impl Worker,
    opts: &RunOptions,
) -> Result<(), LinkError> {
    link.start_watch(&waker);
    opts.shutdown.attach(waker);
    let mut signals = if opts.handle_signals {
        let mut s = Signals::new([SIGTERM, SIGINT]).map_err(LinkError::Signals)?;
        poll.registry()
            .register(&mut s, SIGNALS, Interest::READABLE)
            .map_err(LinkError::Signals)?;
        Some(s)
    } else {
        None
    };
    let mut events = Events::with_capacity(64);
    let mut out = Vec::new();
    let mut signalled = 0u8;
    let mut drain_deadline = None;
    let mut next_refresh = Instant::now() + REPORT_EVERY;
    let result = loop {
        if let Some(message) = link.refusal() {
            break Err(LinkError::Misconfigured {
                id: link.id().to_owned(),
                message: message.to_owned(),
            });
        }
        let requests = opts.shutdown.level().saturating_add(signalled);
        if let Some(reason) = stop_reason(&mut link, requests, &mut drain_deadline, Instant::now())
        {
            info!("{reason}");
            break Ok(());
        }
        let now = Instant::now();
        let may_connect = worker.can_register() && drain_deadline.is_none();
        link.tick(poll.registry(), now, may_connect, &mut out);
        dispatch(&mut link, worker, &mut out);
        worker.expire(&mut link, now);
        if now >= next_refresh {
            if link.is_registered() {
                worker.refresh_report(&mut link);
            }
            if link.metrics.is_some() {
                link.publish(worker.load());
            }
            next_refresh = now + REPORT_EVERY;
        }
        link.flush(poll.registry(), &mut out);
        dispatch(&mut link, worker, &mut out);

        let timeout = if link.read_pending() {
            Some(Duration::ZERO)
        } else {
            [
                link.timer(worker.can_register()),
                worker.next_deadline(),
                drain_deadline,
                (link.is_registered() || link.metrics.is_some()).then_some(next_refresh),
            ]
            .into_iter()
            .flatten()
            .min()
            .map(|t| t.saturating_duration_since(Instant::now()))
        };
        match poll.poll(&mut events, timeout) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => break Err(LinkError::Wait(e)),
        }
        let mut readable = link.read_pending();
        for event in events.iter() {
            match event.token() {
                CONN => {
                    readable |= event.is_readable() || event.is_read_closed() || event.is_error();
                }
                SIGNALS => {
                    if let Some(s) = signals.as_mut() {
                        for sig in s.pending() {
                            info!("received signal {sig}");
                            signalled = signalled.saturating_add(1);
                        }
                    }
                }
                _ => {}
            }
        }
        if readable {
            link.on_readable(poll.registry(), &mut out);
            dispatch(&mut link, worker, &mut out);
        }
        link.leave_deposed(poll.registry(), &mut out);
        dispatch(&mut link, worker, &mut out);
        worker.on_wake(&mut link);
        link.flush(poll.registry(), &mut out);
        dispatch(&mut link, worker, &mut out);
    };
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    worker.shutdown(&mut link);
    link.close(poll.registry());
    if let Some(mut s) = signals {
        let _ = poll.registry().deregister(&mut s);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_one_second() {
        let mut b = Backoff::new();
        let delays: Vec<u128> = (0..6).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 800, 1000, 1000]);
        b.reset();
        assert_eq!(b.next_delay(), BACKOFF_START);
    }

    #[test]
    fn a_second_request_stops_at_once() {
        let s = Shutdown::new();
        assert!(!s.is_requested());
        s.request();
        assert_eq!(s.level(), 1);
        s.request();
        s.request();
        assert_eq!(s.level(), 2);
        let s = Shutdown::new();
        s.request_now();
        assert_eq!(s.level(), 2);
    }
}
