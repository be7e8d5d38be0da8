//! The worker side of the kvctld connection and the worker event loop, shared by prefilld and
//! decoded.
//!
//! A [`Link`] owns the one connection to kvctld: connect with backoff (100 ms doubling to
//! 1 s, for ever), `Hello` / `HelloAck`, `RegisterWorker` / `RegisterAck`, then frames in both
//! directions. Reads go through a [`FrameReader`] (every layer of validation before a frame
//! reaches the worker); writes go through an outbox that waits for `WRITABLE` when the socket
//! is full. Any protocol error, read error or write error drops the connection: the worker is
//! told ([`LinkEvent::Lost`]) and aborts everything it holds before the link reconnects.
//!
//! [`serve`] is the one mio event loop of a worker: fixed tokens for the kvctld connection,
//! the waker (job threads and [`Shutdown`]) and SIGTERM/SIGINT.

use crate::proto::{
    ErrorCode, Header, Message, PROTOCOL_VERSION, RegisterAck, RegisterWorker, Role,
};
use crate::sys::uds::{FrameReader, ReadOutcome, send_frame};
use crate::{Generation, RequestId};
use log::{debug, info, warn};
use mio::net::UnixStream;
use mio::{Events, Interest, Poll, Registry, Token, Waker};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook_mio::v1_0::Signals;
use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
}

/// Stops a running worker from another thread (tests, embedding). Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Shutdown {
    inner: Arc<ShutdownInner>,
}

#[derive(Debug, Default)]
struct ShutdownInner {
    requested: AtomicBool,
    waker: Mutex<Option<Arc<Waker>>>,
}

impl Shutdown {
    /// A handle no one has requested yet.
    pub fn new() -> Shutdown {
        Shutdown::default()
    }

    /// Asks the worker to stop as on SIGTERM; `run` then returns `Ok(())`.
    pub fn request(&self) {
        self.inner.requested.store(true, Ordering::SeqCst);
        let waker = self.inner.waker.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = waker.as_ref() {
            // A failed wake only delays the stop to the loop's next timer.
            let _ = w.wake();
        }
    }

    /// Whether a stop was requested.
    pub fn is_requested(&self) -> bool {
        self.inner.requested.load(Ordering::SeqCst)
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
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            handle_signals: true,
            shutdown: Shutdown::new(),
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
}

#[derive(Debug)]
struct Outgoing {
    bytes: Vec<u8>,
    fd: Option<OwnedFd>,
}

#[derive(Debug)]
struct Conn {
    stream: UnixStream,
    reader: FrameReader,
    outbox: VecDeque<Outgoing>,
    /// Whether WRITABLE interest is registered.
    writable: bool,
    /// The reader paused with data possibly left in the socket.
    more: bool,
}

/// The connection to kvctld and its lifecycle.
#[derive(Debug)]
pub struct Link {
    socket: PathBuf,
    register: RegisterWorker,
    /// Attached (as a duplicate) to every `RegisterWorker`: prefill's read-only pool fd.
    register_fd: Option<OwnedFd>,
    handshake_timeout: Duration,
    backoff: Backoff,
    stage: Stage,
    conn: Option<Conn>,
    frames_received: Arc<AtomicU64>,
}

impl Link {
    /// A link that will connect to `socket` and register with `register` (attaching a
    /// duplicate of `register_fd`, if any). Every frame received is counted in
    /// `frames_received`.
    pub fn new(
        socket: PathBuf,
        register: RegisterWorker,
        register_fd: Option<OwnedFd>,
        handshake_timeout: Duration,
        frames_received: Arc<AtomicU64>,
    ) -> Link {
        Link {
            socket,
            register,
            register_fd,
            handshake_timeout,
            backoff: Backoff::new(),
            stage: Stage::Down {
                retry_at: Instant::now(),
            },
            conn: None,
            frames_received,
        }
    }

    fn role(&self) -> Role {
        self.register.role
    }

    /// When the loop must call [`Link::tick`] next, if ever. `may_connect` as for `tick`.
    fn timer(&self, may_connect: bool) -> Option<Instant> {
        match self.stage {
            Stage::Down { retry_at } => may_connect.then_some(retry_at),
            Stage::Hello { deadline } | Stage::Register { deadline, .. } => Some(deadline),
            Stage::Ready { .. } => None,
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
        let mut stream = match UnixStream::connect(&self.socket) {
            Ok(s) => s,
            Err(e) => {
                let delay = self.backoff.next_delay();
                debug!(
                    "kvctld at {} not reachable ({e}); retrying in {} ms",
                    self.socket.display(),
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
        debug!("connected to kvctld at {}", self.socket.display());
        self.conn = Some(Conn {
            stream,
            reader: FrameReader::new(),
            outbox: VecDeque::new(),
            writable: false,
            more: false,
        });
        self.stage = Stage::Hello {
            deadline: now + self.handshake_timeout,
        };
        self.queue(
            RequestId(0),
            &crate::proto::Hello::new(self.role()).into(),
            None,
        );
    }

    /// Drops the connection (if any) and schedules the next attempt.
    fn lose(&mut self, registry: &Registry, reason: &str, out: &mut Vec<LinkEvent>) {
        let was_ready = matches!(self.stage, Stage::Ready { .. });
        if let Some(mut conn) = self.conn.take() {
            // The socket closes when dropped; deregistering first keeps the poller clean.
            let _ = registry.deregister(&mut conn.stream);
            out.push(LinkEvent::Lost);
        }
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

    /// Queues `msg` for kvctld while registered; drops it otherwise (there is no one to
    /// tell: the worker aborts everything when the link is lost).
    pub fn send(&mut self, id: RequestId, msg: impl Into<Message>) {
        if !matches!(self.stage, Stage::Ready { .. }) {
            return;
        }
        self.queue(id, &msg.into(), None);
    }

    /// Queues a frame a job thread encoded, while registered.
    #[allow(
        dead_code,
        reason = "decoded's jobs use it; prefilld compiles this file too"
    )]
    pub fn send_encoded(&mut self, bytes: Vec<u8>) {
        if !matches!(self.stage, Stage::Ready { .. }) {
            return;
        }
        if let Some(conn) = self.conn.as_mut() {
            conn.outbox.push_back(Outgoing { bytes, fd: None });
        }
    }

    fn queue(&mut self, id: RequestId, msg: &Message, fd: Option<OwnedFd>) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        match msg.encode(id) {
            Ok(bytes) => conn.outbox.push_back(Outgoing { bytes, fd }),
            Err(e) => warn!("cannot encode a {:?} frame: {e}", msg.msg_type()),
        }
    }

    /// Writes queued frames until the socket is full (then waits for WRITABLE).
    fn flush(&mut self, registry: &Registry, out: &mut Vec<LinkEvent>) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        if conn.outbox.len() > MAX_OUTBOX_FRAMES {
            let reason = format!("kvctld is not reading: {} frames queued", conn.outbox.len());
            self.lose(registry, &reason, out);
            return;
        }
        let mut failed = None;
        while let Some(front) = conn.outbox.front() {
            let fds: Vec<BorrowedFd<'_>> = front.fd.iter().map(AsFd::as_fd).collect();
            match send_frame(&conn.stream, &front.bytes, &fds) {
                Ok(()) => {
                    conn.outbox.pop_front();
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    failed = Some(format!("writing to kvctld: {e}"));
                    break;
                }
            }
        }
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
                        // Best effort: the connection is dropped either way.
                        if let Ok(bytes) = Message::from(reply).encode(RequestId(0)) {
                            let _ = send_frame(&conn.stream, &bytes, &[]);
                        }
                    }
                    failure = Some(format!("protocol error from kvctld: {e}"));
                    break;
                }
            }
        }
        for (header, msg, fds) in frames {
            self.frames_received.fetch_add(1, Ordering::Relaxed);
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
            (Stage::Ready { .. }, msg) => out.push(LinkEvent::Frame(header, msg, fds)),
            (Stage::Hello { .. }, Message::HelloAck(ack)) if ack.version == PROTOCOL_VERSION => {
                let fd = match self.register_fd.as_ref().map(OwnedFd::try_clone) {
                    None => None,
                    Some(Ok(fd)) => Some(fd),
                    Some(Err(e)) => {
                        let reason = format!("duplicating the pool fd: {e}");
                        self.lose(registry, &reason, out);
                        return;
                    }
                };
                let register = Message::from(self.register.clone());
                self.queue(RequestId(0), &register, fd);
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
                info!(
                    "registered with kvctld as {:?} worker (generation {})",
                    self.role(),
                    generation.0
                );
                self.backoff.reset();
                self.stage = Stage::Ready { generation };
                out.push(LinkEvent::Registered(ack));
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
            (Stage::Down { .. }, _) => {}
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

/// The worker's event loop: runs until SIGTERM/SIGINT (if `opts.handle_signals`) or
/// `opts.shutdown`, then lets the worker abort what it holds and returns.
pub fn serve(
    mut poll: Poll,
    waker: Arc<Waker>,
    mut link: Link,
    worker: &mut impl Worker,
    opts: &RunOptions,
) -> Result<(), LinkError> {
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
    loop {
        if opts.shutdown.is_requested() {
            info!("stop requested");
            break;
        }
        let now = Instant::now();
        let may_connect = worker.can_register();
        link.tick(poll.registry(), now, may_connect, &mut out);
        dispatch(&mut link, worker, &mut out);
        worker.expire(&mut link, now);
        link.flush(poll.registry(), &mut out);
        dispatch(&mut link, worker, &mut out);

        let timeout = if link.read_pending() {
            Some(Duration::ZERO)
        } else {
            [link.timer(worker.can_register()), worker.next_deadline()]
                .into_iter()
                .flatten()
                .min()
                .map(|t| t.saturating_duration_since(Instant::now()))
        };
        match poll.poll(&mut events, timeout) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(LinkError::Wait(e)),
        }
        let (mut readable, mut stop) = (link.read_pending(), false);
        for event in events.iter() {
            match event.token() {
                CONN => {
                    readable |= event.is_readable() || event.is_read_closed() || event.is_error();
                }
                SIGNALS => {
                    if let Some(s) = signals.as_mut() {
                        for sig in s.pending() {
                            info!("received signal {sig}, stopping");
                            stop = true;
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
        worker.on_wake(&mut link);
        link.flush(poll.registry(), &mut out);
        dispatch(&mut link, worker, &mut out);
        if stop {
            break;
        }
    }
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    worker.shutdown(&mut link);
    link.close(poll.registry());
    if let Some(mut s) = signals {
        let _ = poll.registry().deregister(&mut s);
    }
    Ok(())
}

/// Cuts `s` to at most [`crate::proto::MAX_TEXT_BYTES`] on a character boundary, for the
/// text of an `Error` or `Abort`.
pub fn text(s: String) -> String {
    if s.len() <= crate::proto::MAX_TEXT_BYTES {
        return s;
    }
    let mut end = crate::proto::MAX_TEXT_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// Answers `Error{code, message}` for request `id`.
pub fn refuse(link: &mut Link, id: RequestId, code: crate::proto::ErrorCode, message: String) {
    debug!("refusing {id}: {code}: {message}");
    link.send(
        id,
        crate::proto::Error {
            code,
            message: text(message),
        },
    );
}

/// The error code a worker answers for a reservation its pool refused.
pub fn pool_error_code(e: &crate::pool::PoolError) -> crate::proto::ErrorCode {
    use crate::pool::PoolError;
    use crate::proto::ErrorCode;
    match e {
        PoolError::Full { .. } => ErrorCode::PoolFull,
        PoolError::NeverFits { .. } => ErrorCode::BadRequest,
        _ => ErrorCode::Internal,
    }
}

/// Pages of a reservation, as the wire counts them.
pub fn page_count(res: &crate::pool::Reservation) -> u32 {
    u32::try_from(res.pages().len()).unwrap_or(u32::MAX)
}

/// Refuses an owner of another generation than `current` (the one kvctld registered this
/// worker under), or one that is not the frame's request `id`.
pub fn check_owner(
    current: Option<Generation>,
    id: RequestId,
    owner: crate::Owner,
) -> Result<(), String> {
    match current {
        Some(g) if g == owner.generation => {}
        Some(g) => {
            return Err(format!(
                "owner {owner} is not of the current generation {}",
                g.0
            ));
        }
        None => return Err("not registered".to_owned()),
    }
    if owner.request != id {
        return Err(format!("frame for {id} names owner {owner}"));
    }
    Ok(())
}

/// Sends kvctld the pool's page counts by state and the worker's counters.
pub fn send_report(link: &mut Link, pool: &crate::pool::PagePool, counters: Vec<(String, u64)>) {
    let u = pool.usage();
    link.send(
        RequestId(0),
        crate::proto::PoolReport {
            free: u.free,
            reserved: u.reserved,
            writing: u.writing,
            readable: u.readable,
            draining: u.draining,
            counters,
        },
    );
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
}
