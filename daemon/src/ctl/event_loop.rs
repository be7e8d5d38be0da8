//! kvctld's event loop: the control socket, every connection, peer authentication and the
//! frames on the wire. The decisions are the core's ([`super::core`]): this loop turns
//! readable sockets into core events and the core's [`Action`]s into frames.
//!
//! One mio loop: fixed tokens for the listener, the signals and the TLS waker, connection
//! tokens from a slab. A peer is authenticated at accept: on the control socket by
//! SO_PEERCRED against the allow-lists, on TLS (`[tls] listen`, [`libkv::tls`]) by the name
//! its certificate is valid for. Its `Hello` says its role, and only kvctld's own uid, root,
//! `[control] worker_uids` and certificates of `[tls] workers` may be a worker. A TLS peer
//! arrives as a Unix stream from the TLS relay and is from then on a connection like any
//! other. Each connection has an [`Outbox`]; a peer that does not read its output is cut
//! off past [`MAX_OUTBOX_BYTES`], and one that says no `Hello` within the bootstrap deadline
//! is dropped.
//!
//! What a connection costs is bounded and paid with use: its reader and outbox free their
//! buffers whenever nothing is pending, so an idle connection holds its slab entry and
//! nothing else. A client connection with no request in flight that sends nothing for
//! `[control] idle_timeout_ms` is closed; one uid holds at most `[control]
//! max_connections_per_uid` connections and all together at most [`MAX_CONNECTIONS`]; more
//! are turned away at accept with an error frame. When kvctld runs out of file descriptors
//! (EMFILE, ENFILE) it closes a descriptor it keeps in reserve, accepts the waiting
//! connection, turns it away and opens the reserve again, so the backlog never fills with
//! connections nobody accepts; accepting resumes on its own once descriptors are free.

use super::core::{Action, Core};
use super::workers::ConnId;
use libkv::RequestId;
use libkv::config::Config;
use libkv::outbox::{Flushed, Outbox};
use libkv::proto::{self, ErrorCode, Hello, HelloAck, Message, Role};
use libkv::sys::uds::{self, FrameReader, ReadOutcome};
use log::{debug, info, warn};
use mio::net::{UnixListener, UnixStream};
use mio::{Events, Interest, Poll, Token, Waker};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook_mio::v1_0::Signals;
use slab::Slab;
use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

const LISTENER: Token = Token(0);
const SIGNALS: Token = Token(1);
/// The TLS relay has handed over connections ([`EventLoop::listen_tls`]).
const TLS_PEERS: Token = Token(2);
const FIRST_CONN: usize = 16;
/// A peer that does not read its output is cut off past this much queued output.
pub const MAX_OUTBOX_BYTES: usize = 16 << 20;
/// Most connections at once, every uid together; more are refused at accept.
pub const MAX_CONNECTIONS: usize = libkv::config::MAX_CONNECTIONS as usize;
/// How long accepting pauses when kvctld is out of file descriptors and has no reserve.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);
/// How often idle client connections are looked for.
const IDLE_CHECK: Duration = Duration::from_millis(250);

/// Counters of the coherence probe, which runs on a thread of its own.
#[derive(Debug, Default)]
pub struct ProbeCounters {
    pub runs: AtomicU64,
    pub mismatches: AtomicU64,
    pub errors: AtomicU64,
}

impl ProbeCounters {
    fn list(&self) -> Vec<(String, u64)> {
        [
            ("probe_runs", &self.runs),
            ("probe_mismatches", &self.mismatches),
            ("probe_errors", &self.errors),
        ]
        .into_iter()
        .map(|(n, v)| (n.to_owned(), v.load(Ordering::Relaxed)))
        .collect()
    }
}

/// Who is at the other end of a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Peer {
    /// On the control socket: its credentials (SO_PEERCRED at accept).
    Local { uid: u32, gid: u32 },
    /// Over TLS: the name of `[tls] workers` or `clients` its certificate is valid for
    /// (none: turned away at once), and whether that name may be a worker.
    Tls {
        name: Option<String>,
        worker: bool,
        remote: SocketAddr,
    },
}

/// A connection the TLS relay hands to the loop, with who is at its other end.
type TlsHandover = (std::os::unix::net::UnixStream, Peer);

/// What one peer's connections are counted under, for `max_connections_per_uid`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum PeerKey {
    Uid(u32),
    Cert(String),
}

impl Peer {
    fn key(&self) -> PeerKey {
        match self {
            Peer::Local { uid, .. } => PeerKey::Uid(*uid),
            Peer::Tls { name, remote, .. } => {
                PeerKey::Cert(name.clone().unwrap_or_else(|| remote.to_string()))
            }
        }
    }
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Local { uid, .. } => write!(f, "uid {uid}"),
            Peer::Tls {
                name: Some(n),
                remote,
                ..
            } => write!(f, "TLS peer {n} ({remote})"),
            Peer::Tls {
                name: None, remote, ..
            } => write!(f, "TLS peer {remote}"),
        }
    }
}

struct Conn {
    stream: UnixStream,
    reader: FrameReader,
    out: Outbox,
    /// Whether WRITABLE interest is registered.
    writable: bool,
    role: Option<Role>,
    /// Close once the outbox is flushed (after a final error frame).
    closing: bool,
    /// Who the peer is (SO_PEERCRED or its certificate, at accept).
    peer: Peer,
    /// When it connected, for the Hello deadline.
    accepted: Instant,
    /// When it last sent a frame (or connected): a client's idle clock.
    last_frame: Instant,
    /// A prefill worker's read-only pool memfd, handed to decode workers.
    pool_fd: Option<OwnedFd>,
}

/// The event loop and the core it drives.
pub struct EventLoop {
    cfg: Config,
    poll: Poll,
    listener: Option<UnixListener>,
    conns: Slab<Conn>,
    core: Core,
    own_uid: u32,
    /// kvctld's own (effective) group: the control socket's group where none is configured.
    own_gid: u32,
    unauthorized: u64,
    probe: Arc<ProbeCounters>,
    /// Connections open per peer uid or certificate name.
    per_peer: HashMap<PeerKey, u32>,
    /// Connections the TLS relay handed over, waiting to be admitted; None without TLS.
    tls_peers: Option<(mpsc::Receiver<TlsHandover>, Arc<Waker>)>,
    tls_counters: Arc<libkv::tls::ListenerCounters>,
    /// A descriptor held in reserve for running out of them (see the module doc).
    reserve_fd: Option<File>,
    /// When to try accepting again after running out of descriptors with no reserve.
    accept_retry_at: Option<Instant>,
    next_idle_check: Instant,
    conn_counters: ConnCounters,
    /// Where the status goes for `/metrics`, when it is on, and when it goes next.
    metrics: Option<(crate::metrics::Snapshot, Instant)>,
    /// The lease this kvctld leads under, with `[election]`: nothing is admitted once its
    /// window closes.
    term: Option<super::leader::Term>,
    /// The members in etcd, with `[election]`: a registered worker whose lease lapsed is
    /// treated as lost.
    members: Option<(super::members::Watcher, super::members::Lapses)>,
    /// Workers treated as lost because their membership lapsed.
    workers_lapsed: u64,
}

/// Why [`EventLoop::serve`] returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// SIGTERM or SIGINT, and the drain finished.
    Stopped,
    /// The lease window closed: every request was failed, retryable, and kvctld must go.
    LostLeadership,
}

/// What the loop counts about connections, shown by status.
#[derive(Debug, Default)]
struct ConnCounters {
    /// Turned away: the uid already held `max_connections_per_uid`.
    refused_uid_limit: u64,
    /// Turned away: [`MAX_CONNECTIONS`] were open.
    refused_full: u64,
    /// Turned away: kvctld had no file descriptor left.
    refused_no_fds: u64,
    /// Client connections closed for being idle.
    idle_closed: u64,
}

/// The descriptor kept in reserve: `/dev/null`, opened read-only.
fn open_reserve() -> Option<File> {
    File::open("/dev/null").ok()
}

/// Whether an accept failed for want of file descriptors or kernel memory, which closing
/// connections cures, rather than for this connection.
fn out_of_descriptors(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(nix::libc::EMFILE | nix::libc::ENFILE | nix::libc::ENOBUFS | nix::libc::ENOMEM)
    )
}

impl std::fmt::Debug for EventLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventLoop")
            .field("connections", &self.conns.len())
            .field("core", &self.core)
            .finish_non_exhaustive()
    }
}

impl EventLoop {
    pub fn new(
        cfg: Config,
        mut listener: UnixListener,
        core: Core,
        probe: Arc<ProbeCounters>,
        metrics: Option<crate::metrics::Snapshot>,
    ) -> io::Result<EventLoop> {
        let poll = Poll::new()?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        Ok(EventLoop {
            cfg,
            poll,
            listener: Some(listener),
            conns: Slab::new(),
            core,
            own_uid: nix::unistd::geteuid().as_raw(),
            own_gid: nix::unistd::getegid().as_raw(),
            unauthorized: 0,
            probe,
            per_peer: HashMap::new(),
            tls_peers: None,
            tls_counters: Arc::default(),
            reserve_fd: open_reserve(),
            accept_retry_at: None,
            next_idle_check: Instant::now() + IDLE_CHECK,
            conn_counters: ConnCounters::default(),
            metrics: metrics.map(|m| (m, Instant::now())),
            term: None,
            members: None,
            workers_lapsed: 0,
        })
    }

    /// Admits only while `term`'s window is open; when it closes, [`EventLoop::serve`]
    /// fails every request and returns [`Ended::LostLeadership`].
    pub fn lead(&mut self, term: super::leader::Term) {
        self.term = Some(term);
    }

    /// Watches the members in etcd through `watcher`: a registered worker whose membership
    /// lapsed is treated as lost.
    pub fn watch_members(&mut self, watcher: super::members::Watcher) {
        self.members = Some((watcher, super::members::Lapses::default()));
    }

    /// Closes the connection of every registered worker whose membership lapsed, as of the
    /// newest sighting of the members: the core fails its requests, and the worker, seeing
    /// its connection close, aborts what it holds before it registers again.
    fn check_members(&mut self, now: Instant) {
        let Some((watcher, lapses)) = &mut self.members else {
            return;
        };
        let Some(sighting) = watcher.take() else {
            return;
        };
        let workers = self.core.workers();
        let registered = [
            libkv::admission::Side::Prefill,
            libkv::admission::Side::Decode,
        ]
        .into_iter()
        .flat_map(|side| workers.iter(side).map(|(_, w)| (w.conn, w.id.as_str())));
        let lapsed = lapses.check(now, registered, &sighting);
        for (conn, why) in lapsed {
            warn!("{why}; treating it as lost");
            self.workers_lapsed += 1;
            let msg = Message::from(proto::Error {
                code: ErrorCode::WorkerLost,
                message: format!("kvctld treats this worker as lost: {why}"),
            });
            self.send(conn, RequestId(0), &msg, Vec::new());
            self.close(conn);
        }
    }

    /// Whether this kvctld may admit at `now`: always without an election.
    fn leads(&self, now: Instant) -> bool {
        self.term.as_ref().is_none_or(|t| t.may_admit(now))
    }

    /// The window closed: fail everything held (the clients retry with the next leader),
    /// send it, and stop.
    fn lose_leadership(&mut self) {
        let epoch = self.term.as_ref().map_or(0, |t| t.epoch().0);
        log::error!(
            "no longer leading: the lease of epoch {epoch} was not renewed in time; failing \
             {} requests and exiting",
            self.core.in_flight()
        );
        let message = format!(
            "kvctld lost its leadership (epoch {epoch}) with this request in flight: retry, \
             the next leader serves it"
        );
        self.core.abandon(Instant::now(), &message);
        self.apply();
        self.flush_all();
    }

    /// Listens for peers over mutual TLS on `[tls] listen`, when it is set; returns the
    /// address bound. Each peer whose handshake completes is admitted on this loop's thread.
    pub fn listen_tls(&mut self) -> Result<Option<SocketAddr>, libkv::tls::TlsError> {
        if self.cfg.tls.listen.is_none() {
            return Ok(None);
        }
        let waker = Arc::new(
            Waker::new(self.poll.registry(), TLS_PEERS)
                .map_err(|e| libkv::tls::TlsError::Setup(format!("waker: {e}")))?,
        );
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        let wake = Arc::clone(&waker);
        let bound = libkv::tls::listen(
            &self.cfg.tls,
            self.cfg.deadlines.bootstrap(),
            Arc::clone(&self.tls_counters),
            move |stream, p: libkv::tls::TlsPeer| {
                let peer = Peer::Tls {
                    name: p.name,
                    worker: p.worker,
                    remote: p.remote,
                };
                let sent = tx.lock().map(|tx| tx.send((stream, peer)).is_ok());
                if sent.unwrap_or(false) {
                    let _ = wake.wake();
                }
            },
        )?;
        self.tls_peers = Some((rx, waker));
        Ok(bound)
    }

    /// Runs until SIGTERM or SIGINT, then drains: no new requests, those in flight may
    /// finish within the drain deadline.
    pub fn serve(&mut self) -> io::Result<Ended> {
        let mut signals = Signals::new([SIGTERM, SIGINT])?;
        self.poll
            .registry()
            .register(&mut signals, SIGNALS, Interest::READABLE)?;
        let mut events = Events::with_capacity(256);
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
        loop {
            let now = Instant::now();
            let next = [
                self.core.next_deadline(),
                self.accept_retry_at,
                Some(self.next_idle_check),
                self.metrics.as_ref().map(|(_, at)| *at),
                self.term.as_ref().and_then(|t| t.valid_until()),
            ]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(now + Duration::from_secs(1))
            .min(now + Duration::from_secs(1));
            let timeout = next.saturating_duration_since(now) + Duration::from_millis(1);
            if let Err(e) = self.poll.poll(&mut events, Some(timeout)) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            for ev in &events {
                match ev.token() {
                    LISTENER => self.accept(),
                    TLS_PEERS => self.accept_tls(),
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
            let now = Instant::now();
            if !self.leads(now) {
                self.lose_leadership();
                return Ok(Ended::LostLeadership);
            }
            if self.accept_retry_at.is_some_and(|t| now >= t) {
                self.accept_retry_at = None;
                self.accept();
            }
            self.expire_hellos(now);
            self.check_members(now);
            if now >= self.next_idle_check {
                self.next_idle_check = now + IDLE_CHECK;
                self.expire_idle(now);
            }
            self.core.tick(now);
            self.apply();
            self.publish_metrics(now);
            if self.core.shutdown_due(Instant::now()) {
                self.apply();
                self.flush_all();
                info!("kvctld stopped");
                return Ok(Ended::Stopped);
            }
        }
    }

    /// Hands the status to the `/metrics` thread, every [`crate::metrics::REFRESH`].
    fn publish_metrics(&mut self, now: Instant) {
        let due = matches!(&self.metrics, Some((_, at)) if now >= *at);
        if !due {
            return;
        }
        let status = self.core.status(&self.loop_counters());
        let latencies = self.core.latencies().clone();
        if let Some((snapshot, at)) = &mut self.metrics {
            snapshot.publish(status, latencies);
            *at = now + crate::metrics::REFRESH;
        }
    }

    fn start_drain(&mut self) {
        if let Some(mut l) = self.listener.take() {
            let _ = self.poll.registry().deregister(&mut l);
        }
        self.core.start_shutdown(Instant::now());
        self.apply();
    }

    // ---- the core's actions ------------------------------------------------------------

    /// Sends what the core decided.
    fn apply(&mut self) {
        for action in self.core.take_actions() {
            match action {
                Action::Send { conn, id, msg } => self.send(conn, id, &msg, Vec::new()),
                Action::SendPool { conn, msg, pool_of } => {
                    let fd = self
                        .conns
                        .get(pool_of)
                        .and_then(|c| c.pool_fd.as_ref())
                        .and_then(|fd| fd.as_fd().try_clone_to_owned().ok());
                    match fd {
                        Some(fd) => self.send(conn, RequestId(0), &msg.into(), vec![fd]),
                        None => warn!(
                            "cannot duplicate the pool fd of prefill worker {}",
                            msg.worker
                        ),
                    }
                }
                Action::Refuse { conn, error } => {
                    self.send(conn, RequestId(0), &error.into(), Vec::new());
                    self.close_after_flush(conn);
                }
            }
        }
    }

    // ---- connections -------------------------------------------------------------------

    /// Who may connect as a client: root, kvctld's own uid, a peer whose primary group is
    /// kvctld's own (a service run with `Group=kvfence` under a user of its own, such as
    /// openaid), and the configured uids and gids. Only `may_be_worker` decides who may
    /// register as a worker.
    /// A TLS peer may connect when its certificate is valid for a name of `[tls] workers`
    /// or `clients`.
    fn allowed(&self, peer: &Peer) -> bool {
        let c = &self.cfg.control;
        match *peer {
            Peer::Local { uid, gid } => {
                uid == 0
                    || uid == self.own_uid
                    || gid == self.own_gid
                    || c.allowed_uids.contains(&uid)
                    || c.allowed_gids.contains(&gid)
            }
            Peer::Tls { ref name, .. } => name.is_some(),
        }
    }

    /// Workers see every tenant's prompts and KV: only kvctld's own uid, root, the
    /// configured worker uids and certificates of `[tls] workers` may register as one.
    fn may_be_worker(&self, peer: &Peer) -> bool {
        match *peer {
            Peer::Local { uid, .. } => {
                uid == 0 || uid == self.own_uid || self.cfg.control.worker_uids.contains(&uid)
            }
            Peer::Tls { worker, .. } => worker,
        }
    }

    /// Sends one error frame on a connection that is not kept (best effort).
    fn turn_away(stream: &UnixStream, code: ErrorCode, message: String) {
        let msg = Message::from(proto::Error { code, message });
        if let Ok(frame) = msg.encode(RequestId(0)) {
            let _ = uds::send_frame(stream, &frame, &[]);
        }
    }

    fn accept(&mut self) {
        loop {
            let Some(listener) = self.listener.as_ref() else {
                return;
            };
            let (stream, _) = match listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if out_of_descriptors(&e) => {
                    self.turn_away_while_out_of_descriptors(&e);
                    return;
                }
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
            let peer = Peer::Local { uid, gid };
            if !self.allowed(&peer) {
                self.unauthorized += 1;
                warn!(
                    "refused connection from uid {uid} gid {gid} (pid {})",
                    cred.pid
                );
                let msg = format!("uid {uid} is not allowed on this socket");
                Self::turn_away(&stream, ErrorCode::Unauthorized, msg);
                continue;
            }
            self.admit(stream, peer);
        }
    }

    /// Admits the connections the TLS relay handed over; a certificate valid for no name
    /// of `[tls] workers` or `clients` is turned away with the reason.
    fn accept_tls(&mut self) {
        let Some((rx, _)) = &self.tls_peers else {
            return;
        };
        let waiting: Vec<_> = rx.try_iter().collect();
        for (stream, peer) in waiting {
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            let stream = UnixStream::from_std(stream);
            if !self.allowed(&peer) {
                self.unauthorized += 1;
                warn!("refused {peer}: its certificate names none of [tls] workers or clients");
                let msg = format!(
                    "{peer}: the certificate is valid, but for no name kvctld lets in \
                     ([tls] workers, clients)"
                );
                Self::turn_away(&stream, ErrorCode::Unauthorized, msg);
                continue;
            }
            self.admit(stream, peer);
        }
    }

    /// Takes an authenticated peer's connection, unless its peer or kvctld as a whole holds
    /// the most connections allowed.
    fn admit(&mut self, mut stream: UnixStream, peer: Peer) {
        let limit = self.cfg.control.max_connections_per_uid;
        let key = peer.key();
        let held = self.per_peer.get(&key).copied().unwrap_or(0);
        if held >= limit {
            self.conn_counters.refused_uid_limit += 1;
            debug!("refused connection: {peer} holds {held} connections");
            let msg = format!(
                "{peer} has {held} connections open, the most one peer may hold \
                 (control.max_connections_per_uid); close some and try again"
            );
            Self::turn_away(&stream, ErrorCode::PoolFull, msg);
            return;
        }
        if self.conns.len() >= MAX_CONNECTIONS {
            self.conn_counters.refused_full += 1;
            debug!("refused connection: {MAX_CONNECTIONS} connections open");
            let msg = format!("kvctld has {MAX_CONNECTIONS} connections open; try again");
            Self::turn_away(&stream, ErrorCode::PoolFull, msg);
            return;
        }
        let entry = self.conns.vacant_entry();
        let conn_id = entry.key();
        if let Err(e) = self.poll.registry().register(
            &mut stream,
            Token(conn_id + FIRST_CONN),
            Interest::READABLE,
        ) {
            warn!("registering connection failed: {e}");
            return;
        }
        let now = Instant::now();
        debug!("connection {conn_id} from {peer}");
        entry.insert(Conn {
            stream,
            reader: FrameReader::new(),
            out: Outbox::new(),
            writable: false,
            role: None,
            closing: false,
            peer,
            accepted: now,
            last_frame: now,
            pool_fd: None,
        });
        *self.per_peer.entry(key).or_insert(0) += 1;
    }

    /// Accept failed for want of descriptors: accepts each waiting connection on the
    /// reserve descriptor and turns it away, until none waits. Without a reserve (it could
    /// not be opened again), accepting is retried after [`ACCEPT_RETRY`]: the listener
    /// reports no new readiness for connections already waiting.
    fn turn_away_while_out_of_descriptors(&mut self, first: &io::Error) {
        if self.conn_counters.refused_no_fds == 0 || self.reserve_fd.is_none() {
            warn!(
                "accepting: {first}; turning new connections away until descriptors are free \
                 ({} connections open)",
                self.conns.len()
            );
        }
        loop {
            if self.reserve_fd.take().is_none() {
                self.accept_retry_at = Some(Instant::now() + ACCEPT_RETRY);
                return;
            }
            let Some(listener) = self.listener.as_ref() else {
                return;
            };
            let accepted = listener.accept();
            match accepted {
                Ok((stream, _)) => {
                    self.conn_counters.refused_no_fds += 1;
                    let msg = format!(
                        "kvctld is out of file descriptors ({} connections open); try again",
                        self.conns.len()
                    );
                    Self::turn_away(&stream, ErrorCode::PoolFull, msg);
                    drop(stream);
                    self.reserve_fd = open_reserve();
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                    self.reserve_fd = open_reserve();
                }
                Err(e) => {
                    self.reserve_fd = open_reserve();
                    if e.kind() != io::ErrorKind::WouldBlock {
                        debug!("accepting on the reserve descriptor: {e}");
                        self.accept_retry_at = Some(Instant::now() + ACCEPT_RETRY);
                    }
                    return;
                }
            }
        }
    }

    fn read(&mut self, key: ConnId) {
        loop {
            let Some(conn) = self.conns.get_mut(key) else {
                return;
            };
            let outcome = match conn.reader.read_from(&conn.stream) {
                Ok(o) => o,
                Err(e) => {
                    debug!("connection {key}: read failed: {e}");
                    self.core.count_protocol_error();
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
                        conn.last_frame = Instant::now();
                        self.handle(key, header.request_id, msg, fds);
                        self.apply();
                    }
                    Ok(None) => break,
                    Err(e) => {
                        self.core.count_protocol_error();
                        debug!("connection {key}: {e}");
                        if let Some(reply) = e.reply() {
                            self.send(key, RequestId(0), &reply.into(), Vec::new());
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
                ReadOutcome::WouldBlock | ReadOutcome::Progressed { .. } => {
                    if let Some(conn) = self.conns.get_mut(key) {
                        conn.reader.shrink_idle();
                    }
                    return;
                }
            }
        }
    }

    fn send(&mut self, key: ConnId, id: RequestId, msg: &Message, fds: Vec<OwnedFd>) {
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
        conn.out.push(frame, fds);
        if conn.out.bytes() > MAX_OUTBOX_BYTES {
            warn!("connection {key} does not read its output; closing it");
            self.close(key);
            return;
        }
        self.flush(key);
    }

    fn flush(&mut self, key: ConnId) {
        let Some(conn) = self.conns.get_mut(key) else {
            return;
        };
        let flushed = match conn.out.flush(&conn.stream) {
            Ok(f) => f,
            Err(e) => {
                debug!("connection {key}: write failed: {e}");
                self.close(key);
                return;
            }
        };
        let want_write = flushed == Flushed::Pending;
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
        if !want_write {
            conn.out.shrink_idle();
            if conn.closing {
                self.close(key);
            }
        }
    }

    fn flush_all(&mut self) {
        let keys: Vec<ConnId> = self.conns.iter().map(|(k, _)| k).collect();
        for k in keys {
            // Best effort, bounded: a frame that does not fit the socket now is dropped.
            self.flush(k);
        }
    }

    fn close_after_flush(&mut self, key: ConnId) {
        if let Some(conn) = self.conns.get_mut(key) {
            conn.closing = true;
        }
        self.flush(key);
    }

    fn close(&mut self, key: ConnId) {
        let Some(mut conn) = self.conns.try_remove(key) else {
            return;
        };
        let _ = self.poll.registry().deregister(&mut conn.stream);
        let peer_key = conn.peer.key();
        if let Some(n) = self.per_peer.get_mut(&peer_key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_peer.remove(&peer_key);
            }
        }
        if self.reserve_fd.is_none() {
            self.reserve_fd = open_reserve();
        }
        debug!("connection {key} closed");
        self.core.conn_closed(key, Instant::now());
        self.apply();
    }

    fn protocol_error(&mut self, key: ConnId, id: RequestId, message: String) {
        self.core.count_protocol_error();
        debug!("connection {key}: {message}");
        let msg = Message::from(proto::Error {
            code: ErrorCode::BadRequest,
            message,
        });
        self.send(key, id, &msg, Vec::new());
        self.close_after_flush(key);
    }

    /// Drops connections that said no `Hello` within the bootstrap deadline.
    fn expire_hellos(&mut self, now: Instant) {
        let hello_by = self.cfg.deadlines.bootstrap();
        let silent: Vec<ConnId> = self
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
            let msg = "no Hello within the bootstrap deadline".into();
            self.protocol_error(key, RequestId(0), msg);
        }
    }

    /// Closes client connections with no request in flight that sent no frame within
    /// `[control] idle_timeout_ms`, after an error frame that says why.
    fn expire_idle(&mut self, now: Instant) {
        let Some(idle_for) = self.cfg.control.idle_timeout() else {
            return;
        };
        let mut busy = None;
        let idle: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| {
                c.role == Some(Role::Client)
                    && !c.closing
                    && now.saturating_duration_since(c.last_frame) >= idle_for
            })
            .map(|(k, _)| k)
            .collect();
        for key in idle {
            let busy = busy.get_or_insert_with(|| self.core.busy_clients());
            if busy.contains(&key) {
                continue;
            }
            self.conn_counters.idle_closed += 1;
            debug!(
                "connection {key}: idle for {} ms; closing it",
                idle_for.as_millis()
            );
            let msg = Message::from(proto::Error {
                code: ErrorCode::Timeout,
                message: format!(
                    "closed after {} ms with no request (control.idle_timeout_ms); connect again",
                    idle_for.as_millis()
                ),
            });
            self.send(key, RequestId(0), &msg, Vec::new());
            self.close_after_flush(key);
        }
    }

    /// The loop's own counters, shown by status after the core's.
    fn loop_counters(&self) -> Vec<(String, u64)> {
        let c = &self.conn_counters;
        let mut list = self.probe.list();
        list.extend(
            [
                ("unauthorized", self.unauthorized),
                ("connections", self.conns.len() as u64),
                ("connections_refused_uid_limit", c.refused_uid_limit),
                ("connections_refused_full", c.refused_full),
                ("connections_refused_no_fds", c.refused_no_fds),
                ("connections_closed_idle", c.idle_closed),
                ("workers_lapsed", self.workers_lapsed),
                (
                    "tls_accepted",
                    self.tls_counters.accepted.load(Ordering::Relaxed),
                ),
                (
                    "tls_refused",
                    self.tls_counters.refused.load(Ordering::Relaxed),
                ),
            ]
            .into_iter()
            .map(|(n, v)| (n.to_owned(), v)),
        );
        list
    }

    // ---- frames ------------------------------------------------------------------------

    fn handle(&mut self, key: ConnId, id: RequestId, msg: Message, mut fds: Vec<OwnedFd>) {
        let Some(conn) = self.conns.get(key) else {
            return;
        };
        if conn.closing {
            return;
        }
        let now = Instant::now();
        match (conn.role, msg) {
            (None, Message::Hello(h)) => self.hello(key, &h),
            (None, other) => {
                let msg = format!("expected Hello, got {:?}", other.msg_type());
                self.protocol_error(key, id, msg);
            }
            (Some(Role::Client), Message::Submit(_)) if !self.leads(now) => {
                // the window closed since the loop last looked: the loop fails it at once
                let e = proto::Error {
                    code: ErrorCode::ShuttingDown,
                    message: "kvctld is no longer the leader: retry with the next one".into(),
                };
                self.send(key, id, &e.into(), Vec::new());
            }
            (Some(Role::Client), Message::Submit(s)) => self.core.submit(key, s, now),
            (Some(Role::Client), Message::StatusQuery(_)) => {
                let extra = self.loop_counters();
                let reply = self.core.status(&extra);
                self.send(key, id, &reply.into(), Vec::new());
            }
            (Some(Role::Client), Message::Drain(d)) => {
                // Draining takes capacity away from every tenant: operators only.
                let peer = conn.peer.clone();
                if self.may_be_worker(&peer) {
                    self.core.client_drain(key, id, &d, now);
                } else {
                    self.unauthorized += 1;
                    let e = proto::Error {
                        code: ErrorCode::Unauthorized,
                        message: format!(
                            "{peer} may not drain workers (root, kvctld's uid, \
                             control.worker_uids or a certificate of [tls] workers may)"
                        ),
                    };
                    self.send(key, id, &e.into(), Vec::new());
                }
            }
            (Some(Role::Client), other) => {
                let msg = format!("a client may not send {:?}", other.msg_type());
                self.protocol_error(key, id, msg);
            }
            (Some(role), Message::RegisterWorker(r)) if r.role != role => {
                let msg = format!("a {role:?} peer may not register as a {:?} worker", r.role);
                self.protocol_error(key, id, msg);
            }
            (Some(_), Message::RegisterWorker(r)) if !self.core.is_worker(key) => {
                // A prefill worker on shared memory attaches its pool: it must be read-only.
                let fd = fds.pop();
                let fd_ok = fd
                    .as_ref()
                    .is_some_and(|fd| libkv::sys::memfd::is_writable(fd).is_ok_and(|w| !w));
                if let Some(c) = self.conns.get_mut(key) {
                    c.pool_fd = fd;
                }
                let _ = self.core.register(key, r, fd_ok, now);
            }
            (Some(_), _) if !self.core.is_worker(key) => {
                let msg = "a worker must register first".into();
                self.protocol_error(key, id, msg);
            }
            (Some(_), msg) => self.core.worker_frame(key, id, msg, now),
        }
    }

    fn hello(&mut self, key: ConnId, h: &Hello) {
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
        if self.core.is_stopping() {
            let msg = proto::Error {
                code: ErrorCode::ShuttingDown,
                message: "kvctld is stopping".into(),
            };
            self.send(key, RequestId(0), &msg.into(), Vec::new());
            self.close_after_flush(key);
            return;
        }
        let Some(peer) = self.conns.get(key).map(|c| c.peer.clone()) else {
            return;
        };
        if matches!(h.role, Role::Prefill | Role::Decode) && !self.may_be_worker(&peer) {
            self.unauthorized += 1;
            warn!(
                "{peer} may connect but not register as a {:?} worker",
                h.role
            );
            let msg = proto::Error {
                code: ErrorCode::Unauthorized,
                message: format!("{peer} is not allowed to be a worker"),
            };
            self.send(key, RequestId(0), &msg.into(), Vec::new());
            self.close_after_flush(key);
            return;
        }
        if let Some(conn) = self.conns.get_mut(key) {
            conn.role = Some(h.role);
        }
        let ack = HelloAck {
            version,
            generation: self.core.generation(),
        };
        self.send(key, RequestId(0), &ack.into(), Vec::new());
    }
}
