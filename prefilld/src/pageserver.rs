//! The TCP page server: decoded pulls the pages prefilld holds, over TCP, on hosts without
//! shared memory or RDMA (`[transfer] transport = "tcp"`).
//!
//! One acceptor thread (its own small mio loop: the listener and a stop waker) and one
//! thread per connection, at most [`MAX_CONNECTIONS`]. A connection carries
//! `PageRequest`s one after another; each is answered with one `PageData` and the page bytes
//! per page, written straight from the pool, or with one `Error` after which the connection
//! is closed. A page is served only when all of these hold, checked before the first byte:
//!
//! - the request carries the token prefilld registered with kvctld;
//! - prefilld holds a reservation for exactly the request's owner (request and generation);
//! - every requested page is in that owner's manifest.
//!
//! Between pages the server checks that the owner is still held (a Release or Abort ends the
//! transfer with an error) and that the server is not stopping. While a connection sends an
//! owner's pages it holds an `Arc` of them: the event loop reports them `Freed` only after
//! the last sender let go, so no page is reused while it is on the wire.
//!
//! With `[transfer] transport = "rdma"` and a device, a connection may turn into an RDMA
//! session (`RdmaConnect`, with the token, both ways; see [`libkv::rdma::ServerSession`]).
//! A `PageRequest` then passes the same checks and is answered with `RdmaWindows`: read-only
//! windows over exactly the requested pages, bound on the session's QP. The connection
//! holds the owner's `Arc` until the windows are invalidated: after the reader's
//! `RdmaReadDone`, or at once when the owner is released, the transfer deadline passes or
//! the server stops. So no page is reused while a key to it is alive.

use crate::Counters;
use libkv::pool::Reservation;
use libkv::proto::{self, ErrorCode, Message, RdmaWindows, TOKEN_BYTES};
use libkv::rdma::{RdmaNode, ServerSession};
use libkv::tcp::{self, TcpError};
use libkv::{Owner, PageId, RequestId};
use log::{debug, warn};
use mio::net::TcpListener;
use mio::{Events, Interest, Poll, Token, Waker};
use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{FromRawFd, IntoRawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Most connections served at once; more are refused with an error.
pub const MAX_CONNECTIONS: usize = 32;

const LISTENER: Token = Token(0);
const STOP: Token = Token(1);

/// The pages prefilld keeps for one owner until Release, Abort or its deadline.
#[derive(Debug)]
pub(crate) struct Served {
    pub res: Reservation,
    /// The owner's manifest pages, the only pages served for it.
    pub pages: Vec<PageId>,
    pub expires: Instant,
}

/// The owners prefilld holds, shared by the event loop (which inserts and removes) and the
/// page server (which looks up and sends).
#[derive(Debug, Clone, Default)]
pub(crate) struct HeldMap(Arc<Mutex<HashMap<Owner, Arc<Served>>>>);

impl HeldMap {
    pub(crate) fn lock(&self) -> MutexGuard<'_, HashMap<Owner, Arc<Served>>> {
        // Updates under the lock are single inserts and removes: still consistent.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self, owner: &Owner) -> Option<Arc<Served>> {
        self.lock().get(owner).cloned()
    }

    fn still_holds(&self, owner: &Owner, served: &Arc<Served>) -> bool {
        self.lock()
            .get(owner)
            .is_some_and(|s| Arc::ptr_eq(s, served))
    }
}

/// Timeouts of the page server.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Longest a connection may wait for its next request.
    pub idle: Duration,
    /// Longest one request's pages may take to send.
    pub transfer: Duration,
}

/// What every connection thread shares.
#[derive(Debug)]
struct Shared {
    held: HeldMap,
    token: [u8; TOKEN_BYTES],
    stop: AtomicBool,
    active: AtomicUsize,
    /// Wakes prefilld's event loop when a sender lets go of an owner's pages.
    loop_waker: Arc<Waker>,
    counters: Arc<Counters>,
    limits: Limits,
    /// The RDMA device and the registered pool, when sessions are served.
    rdma: Option<Arc<RdmaNode>>,
}

/// A running page server; dropping it stops the acceptor and every connection and joins
/// their threads.
#[derive(Debug)]
pub(crate) struct PageServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop_waker: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

impl PageServer {
    /// Binds `addr` and starts serving the owners in `held`, over TCP and, with `rdma`,
    /// RDMA sessions.
    pub(crate) fn start(
        addr: SocketAddr,
        token: [u8; TOKEN_BYTES],
        held: HeldMap,
        loop_waker: Arc<Waker>,
        counters: Arc<Counters>,
        limits: Limits,
        rdma: Option<Arc<RdmaNode>>,
    ) -> io::Result<PageServer> {
        let mut listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let poll = Poll::new()?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let stop_waker = Arc::new(Waker::new(poll.registry(), STOP)?);
        let shared = Arc::new(Shared {
            held,
            token,
            stop: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            loop_waker,
            counters,
            limits,
            rdma,
        });
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("prefilld-pages".into())
                .spawn(move || accept_loop(poll, listener, &shared))?
        };
        Ok(PageServer {
            addr,
            shared,
            stop_waker,
            thread: Some(thread),
        })
    }

    /// The address the server listens on (the port chosen when the config said 0).
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for PageServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let _ = self.stop_waker.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A page server outside prefilld's event loop serving fixed reservations, for benchmarks
/// of the page path. Dropping it stops the server and frees the pages.
#[derive(Debug)]
pub struct StandaloneServer {
    server: PageServer,
    held: HeldMap,
    _poll: Poll,
}

impl StandaloneServer {
    /// Serves the prompt pages of each reservation to whoever presents `token`.
    pub fn start(
        addr: SocketAddr,
        token: [u8; TOKEN_BYTES],
        reservations: Vec<Reservation>,
        transfer: Duration,
    ) -> io::Result<StandaloneServer> {
        let held = HeldMap::default();
        for res in reservations {
            let pages = res.pages()[..res.prompt_pages()].to_vec();
            let served = Served {
                res,
                pages,
                expires: Instant::now() + transfer,
            };
            held.lock().insert(served.res.owner(), Arc::new(served));
        }
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), Token(0))?);
        let limits = Limits {
            idle: transfer,
            transfer,
        };
        let server = PageServer::start(
            addr,
            token,
            held.clone(),
            waker,
            Arc::new(Counters::default()),
            limits,
            None,
        )?;
        Ok(StandaloneServer {
            server,
            held,
            _poll: poll,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// The pages served for `owner`.
    pub fn pages(&self, owner: &Owner) -> Option<Vec<PageId>> {
        self.held.get(owner).map(|s| s.pages.clone())
    }
}

fn accept_loop(mut poll: Poll, listener: TcpListener, shared: &Arc<Shared>) {
    let mut events = Events::with_capacity(16);
    let mut threads: Vec<JoinHandle<()>> = Vec::new();
    while !shared.stop.load(Ordering::SeqCst) {
        match poll.poll(&mut events, None) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                warn!("page server: waiting for connections: {e}");
                break;
            }
        }
        threads.retain(|t| !t.is_finished());
        loop {
            let stream = match listener.accept() {
                Ok((stream, peer)) => {
                    debug!("page server: connection from {peer}");
                    // SAFETY: `into_raw_fd` hands over the sole ownership of an open socket.
                    unsafe { TcpStream::from_raw_fd(stream.into_raw_fd()) }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // ECONNABORTED, EMFILE...: this connection is lost, the listener is not.
                    debug!("page server: accept: {e}");
                    break;
                }
            };
            if shared.active.load(Ordering::SeqCst) >= MAX_CONNECTIONS {
                libkv::worker::add(&shared.counters.page_connections_refused, 1);
                refuse_busy(&stream);
                continue;
            }
            libkv::worker::add(&shared.counters.page_connections, 1);
            shared.active.fetch_add(1, Ordering::SeqCst);
            let conn_shared = Arc::clone(shared);
            let spawned = std::thread::Builder::new()
                .name("prefilld-pages-conn".into())
                .spawn(move || {
                    serve_connection(&stream, &conn_shared);
                    conn_shared.active.fetch_sub(1, Ordering::SeqCst);
                });
            match spawned {
                Ok(t) => threads.push(t),
                Err(e) => {
                    shared.active.fetch_sub(1, Ordering::SeqCst);
                    warn!("page server: starting a connection thread: {e}");
                }
            }
        }
    }
    // Connections see the stop flag within one I/O slice.
    for t in threads {
        let _ = t.join();
    }
}

fn refuse_busy(stream: &TcpStream) {
    let _ = stream.set_nonblocking(true);
    let message = format!("the page server serves at most {MAX_CONNECTIONS} connections");
    if let Ok(bytes) = Message::from(proto::Error {
        code: ErrorCode::PoolFull,
        message,
    })
    .encode(RequestId(0))
    {
        let mut w = stream;
        let _ = io::Write::write(&mut w, &bytes);
    }
}

/// Why a request was refused: sent as an `Error` frame, then the connection closes.
struct Refusal {
    code: ErrorCode,
    message: String,
}

fn refusal(code: ErrorCode, message: String) -> Refusal {
    Refusal { code, message }
}

fn serve_connection(stream: &TcpStream, shared: &Shared) {
    if let Err(e) = stream
        .set_nonblocking(false)
        .map_err(|source| TcpError::Io {
            op: "setting blocking mode",
            source,
        })
        .and_then(|()| tcp::prepare(stream))
    {
        debug!("page server: {e}");
        return;
    }
    // Dropped on return, after any windows were invalidated and before the owner's pages.
    let mut session: Option<ServerSession> = None;
    loop {
        let since = Instant::now();
        let mut waiting =
            || !shared.stop.load(Ordering::SeqCst) && since.elapsed() < shared.limits.idle;
        let request = match tcp::read_frame(stream, "reading a page request", &mut waiting) {
            Ok((header, Message::PageRequest(r))) if header.request_id == r.owner.request => r,
            Ok((_, Message::RdmaConnect(c))) => match start_session(stream, shared, &session, &c) {
                Ok(s) => {
                    session = Some(s);
                    continue;
                }
                Err(r) => return send_refusal(stream, shared, r),
            },
            Ok((_, Message::PageRequest(r))) => {
                let reason = format!("frame id differs from the owner {}", r.owner);
                return send_refusal(stream, shared, refusal(ErrorCode::BadRequest, reason));
            }
            Ok((_, other)) => {
                let reason = format!("{:?} is not a page request", other.msg_type());
                return send_refusal(stream, shared, refusal(ErrorCode::BadRequest, reason));
            }
            Err(TcpError::Proto(e)) if e.should_reply() => {
                let reason = format!("invalid frame: {e}");
                return send_refusal(stream, shared, refusal(ErrorCode::BadRequest, reason));
            }
            Err(e) => {
                debug!("page server: connection ends: {e}");
                return;
            }
        };
        let owner = request.owner;
        let served = match check(shared, &request) {
            Ok(served) => served,
            Err(r) => return send_refusal(stream, shared, r),
        };
        let result = match session.as_mut() {
            Some(session) => expose_pages(stream, shared, session, owner, &served, &request.pages),
            None => send_pages(stream, shared, owner, &served, &request.pages),
        };
        if result.is_err() {
            // The connection ends: its QP goes before the pages do, so even a window whose
            // invalidation failed is unreachable (a type-2 key works only on its QP).
            session = None;
        }
        // Let the event loop free the pages if it released them meanwhile.
        drop(served);
        let _ = shared.loop_waker.wake();
        match result {
            Ok(()) => {}
            Err(Some(r)) => return send_refusal(stream, shared, r),
            Err(None) => return,
        }
    }
}

/// The checks before the first byte: token, owner held, every page in its manifest.
fn check(shared: &Shared, request: &proto::PageRequest) -> Result<Arc<Served>, Refusal> {
    if !tcp::token_eq(&request.token, &shared.token) {
        return Err(refusal(
            ErrorCode::Unauthorized,
            "wrong page server token".into(),
        ));
    }
    let owner = request.owner;
    let Some(served) = shared.held.get(&owner) else {
        return Err(refusal(
            ErrorCode::BadRequest,
            format!("no pages held for {owner}"),
        ));
    };
    let manifest: std::collections::HashSet<&PageId> = served.pages.iter().collect();
    if let Some(p) = request.pages.iter().find(|p| !manifest.contains(p)) {
        return Err(refusal(
            ErrorCode::BadRequest,
            format!("{p} is not in the manifest of {owner}"),
        ));
    }
    Ok(served)
}

/// Sends the pages; `Err(Some)` to refuse (owner released, a page unreadable), `Err(None)`
/// when the connection failed or the server stops.
fn send_pages(
    stream: &TcpStream,
    shared: &Shared,
    owner: Owner,
    served: &Arc<Served>,
    pages: &[PageId],
) -> Result<(), Option<Refusal>> {
    let deadline = Instant::now() + shared.limits.transfer;
    let mut sending = || !shared.stop.load(Ordering::SeqCst) && Instant::now() < deadline;
    let page_bytes = served.res.pool().page_bytes().max(1);
    // Whole pages per frame, up to a batch: one header and one vectored write per batch.
    let per_batch = usize::try_from(tcp::PAGE_BATCH_BYTES)
        .unwrap_or(usize::MAX)
        .checked_div(page_bytes)
        .unwrap_or(1)
        .max(1);
    for (b, batch) in pages.chunks(per_batch).enumerate() {
        if !shared.held.still_holds(&owner, served) {
            let reason = format!("{owner} was released during the transfer");
            return Err(Some(refusal(ErrorCode::WorkerLost, reason)));
        }
        let pages_read = served.res.read_pages(batch).map_err(|e| {
            Some(refusal(
                ErrorCode::Internal,
                format!("reading the pages of {owner}: {e}"),
            ))
        })?;
        let bytes = batch.len() * page_bytes;
        let (index, len) = (
            u32::try_from(b * per_batch).unwrap_or(u32::MAX),
            u32::try_from(bytes).unwrap_or(u32::MAX),
        );
        let header = tcp::page_header(owner, index, len).map_err(|_| None)?;
        let mut bufs: Vec<&[u8]> = Vec::with_capacity(batch.len() + 1);
        bufs.push(&header);
        bufs.extend(pages_read);
        if let Err(e) = tcp::write_full(stream, &bufs, &mut sending) {
            debug!("page server: sending pages of {owner}: {e}");
            return Err(None);
        }
        shared
            .counters
            .pages_served
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        shared
            .counters
            .bytes_served
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }
    Ok(())
}

/// Answers an `RdmaConnect`: checks the token, creates and connects this side's QP, sends
/// its own `RdmaConnect` back.
fn start_session(
    stream: &TcpStream,
    shared: &Shared,
    current: &Option<ServerSession>,
    reader: &proto::RdmaConnect,
) -> Result<ServerSession, Refusal> {
    let Some(node) = &shared.rdma else {
        return Err(refusal(
            ErrorCode::BadRequest,
            "this page server has no RDMA".into(),
        ));
    };
    if current.is_some() {
        return Err(refusal(
            ErrorCode::BadRequest,
            "the connection already has an RDMA session".into(),
        ));
    }
    if !tcp::token_eq(&reader.token, &shared.token) {
        return Err(refusal(
            ErrorCode::Unauthorized,
            "wrong page server token".into(),
        ));
    }
    let (session, answer) = ServerSession::accept(node, reader).map_err(|e| {
        refusal(
            ErrorCode::Internal,
            format!("setting up the RDMA session: {}", libkv::error_chain(&e)),
        )
    })?;
    let start = Instant::now();
    let mut sending = || start.elapsed() < shared.limits.transfer;
    tcp::write_frame(stream, RequestId(0), answer, &mut sending)
        .map_err(|e| refusal(ErrorCode::Internal, format!("answering RdmaConnect: {e}")))?;
    shared
        .counters
        .rdma_sessions
        .fetch_add(1, Ordering::Relaxed);
    Ok(session)
}

/// Serves a request on an RDMA session: binds read-only windows over exactly `pages` (the
/// owner's, checked), sends them, and waits for the reader's `RdmaReadDone`. The windows are
/// invalidated before this returns, whatever happened: after the reads, or as soon as the
/// owner is released, the deadline passes or the server stops. `Err(None)` closes the
/// connection without a word (it failed, or a window could not be invalidated).
fn expose_pages(
    stream: &TcpStream,
    shared: &Shared,
    session: &mut ServerSession,
    owner: Owner,
    served: &Arc<Served>,
    pages: &[PageId],
) -> Result<(), Option<Refusal>> {
    let windows = session.expose(pages).map_err(|e| {
        Some(refusal(
            ErrorCode::Internal,
            format!("binding windows over the pages of {owner}: {e}"),
        ))
    })?;
    let bound = windows.len() as u64;
    shared
        .counters
        .windows_bound
        .fetch_add(bound, Ordering::Relaxed);
    let deadline = Instant::now() + shared.limits.transfer;
    let mut going = || {
        !shared.stop.load(Ordering::SeqCst)
            && Instant::now() < deadline
            && shared.held.still_holds(&owner, served)
    };
    let answer = RdmaWindows { owner, windows };
    let result = tcp::write_frame(stream, owner.request, answer, &mut going)
        .and_then(|()| tcp::read_frame(stream, "waiting for the reads", &mut going));
    // Whatever the reader does next, its keys die here, before the pages can be let go.
    let revoked = session.revoke();
    if let Err(e) = revoked {
        warn!("page server: invalidating the windows of {owner}: {e}; closing the session");
        return Err(None);
    }
    shared
        .counters
        .windows_revoked
        .fetch_add(bound, Ordering::Relaxed);
    match result {
        Ok((header, Message::RdmaReadDone(d)))
            if d.owner == owner && header.request_id == owner.request =>
        {
            let page_bytes = served.res.pool().page_bytes() as u64;
            let n = pages.len() as u64;
            shared.counters.pages_served.fetch_add(n, Ordering::Relaxed);
            shared
                .counters
                .bytes_served
                .fetch_add(n * page_bytes, Ordering::Relaxed);
            Ok(())
        }
        Ok((_, other)) => Err(Some(refusal(
            ErrorCode::BadRequest,
            format!("{:?} is not RdmaReadDone for {owner}", other.msg_type()),
        ))),
        Err(TcpError::Stopped) if !shared.held.still_holds(&owner, served) => {
            let reason = format!("{owner} was released during the transfer");
            Err(Some(refusal(ErrorCode::WorkerLost, reason)))
        }
        Err(TcpError::Stopped) if Instant::now() >= deadline => {
            let reason = format!("the reads of {owner} took longer than the transfer deadline");
            Err(Some(refusal(ErrorCode::Timeout, reason)))
        }
        Err(e) => {
            debug!("page server: RDMA session of {owner} ends: {e}");
            Err(None)
        }
    }
}

fn send_refusal(stream: &TcpStream, shared: &Shared, r: Refusal) {
    debug!("page server: refusing: {}: {}", r.code, r.message);
    shared
        .counters
        .page_requests_refused
        .fetch_add(1, Ordering::Relaxed);
    let start = Instant::now();
    let mut briefly = || start.elapsed() < Duration::from_secs(1);
    let error = proto::Error {
        code: r.code,
        message: libkv::worker::text(r.message),
    };
    let _ = tcp::write_frame(stream, RequestId(0), error, &mut briefly);
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;
    use libkv::config::{PoisonMode, Scrub};
    use libkv::pool::{PagePool, PoolOptions};
    use libkv::tcp::fetch_pages;
    use libkv::{Dtype, Generation, PageGeometry};
    use std::io::{Read, Write};

    const TOKEN: [u8; TOKEN_BYTES] = [0x5a; TOKEN_BYTES];

    fn owner(request: u64, generation: u64) -> Owner {
        Owner {
            request: RequestId(request),
            generation: Generation(generation),
        }
    }

    struct Fixture {
        pool: PagePool,
        held: HeldMap,
        server: PageServer,
        counters: Arc<Counters>,
        _poll: Poll,
    }

    fn geometry() -> PageGeometry {
        PageGeometry {
            tokens_per_page: 4,
            layers: 1,
            kv_heads: 1,
            head_dim: 8,
            dtype: Dtype::Bf16,
        }
    }

    /// A pool with owners 1 and 2 (generation 7) held, each page filled with its owner's
    /// request id, and a server on a free loopback port.
    fn fixture() -> Fixture {
        fixture_with(|_| None, "127.0.0.1")
    }

    /// As [`fixture`], serving RDMA sessions with the node `rdma` makes over the pool, on
    /// `ip`.
    fn fixture_with(rdma: impl FnOnce(&PagePool) -> Option<Arc<RdmaNode>>, ip: &str) -> Fixture {
        let options = PoolOptions {
            poison: PoisonMode::Owner,
            scrub: Scrub::Off,
        };
        let pool = PagePool::host(c"kvtest-pages", geometry(), 16, options).unwrap();
        let held = HeldMap::default();
        for r in [1, 2] {
            let mut res = pool.reserve(owner(r, 7), 8, 8).unwrap();
            let mut grant = res.grant_write().unwrap();
            for i in 0..grant.pages().len() {
                grant.page_mut(i).unwrap().fill(u8::try_from(r).unwrap());
            }
            drop(grant);
            assert!(!res.has_writer());
            let pages = res.pages().to_vec();
            let served = Served {
                res,
                pages,
                expires: Instant::now() + Duration::from_secs(60),
            };
            held.lock().insert(owner(r, 7), Arc::new(served));
        }
        let poll = Poll::new().unwrap();
        let waker = Arc::new(Waker::new(poll.registry(), Token(9)).unwrap());
        let limits = Limits {
            idle: Duration::from_secs(5),
            transfer: Duration::from_secs(5),
        };
        let counters = Arc::new(Counters::default());
        let node = rdma(&pool);
        let server = PageServer::start(
            format!("{ip}:0").parse().unwrap(),
            TOKEN,
            held.clone(),
            waker,
            Arc::clone(&counters),
            limits,
            node,
        )
        .unwrap();
        Fixture {
            pool,
            held,
            server,
            counters,
            _poll: poll,
        }
    }

    fn connect(f: &Fixture) -> TcpStream {
        let s = TcpStream::connect(f.server.local_addr()).unwrap();
        tcp::prepare(&s).unwrap();
        s
    }

    fn pages_of(f: &Fixture, o: Owner) -> Vec<PageId> {
        f.held.get(&o).unwrap().pages.clone()
    }

    fn pull(
        stream: &TcpStream,
        token: [u8; TOKEN_BYTES],
        o: Owner,
        pages: &[PageId],
    ) -> (Result<(), TcpError>, Vec<Vec<u8>>) {
        let page_bytes = 4 * 2 * 8 * 2;
        let mut bufs = vec![vec![0u8; page_bytes]; pages.len()];
        let start = Instant::now();
        let r = fetch_pages(
            stream,
            token,
            o,
            pages,
            u32::try_from(page_bytes).unwrap(),
            &mut bufs,
            &mut || start.elapsed() < Duration::from_secs(5),
        );
        (r, bufs)
    }

    /// The refusal's code and message; the connection then carries nothing more.
    fn refused(
        stream: &TcpStream,
        r: Result<(), TcpError>,
        bufs: &[Vec<u8>],
    ) -> (ErrorCode, String) {
        assert!(
            bufs.iter().flatten().all(|&b| b == 0),
            "page bytes were sent"
        );
        let (code, message) = match r {
            Err(TcpError::Refused { code, message }) => (code, message),
            other => panic!("expected a refusal, got {other:?}"),
        };
        let mut rest = Vec::new();
        let mut s = stream;
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let n = s.read_to_end(&mut rest).unwrap_or(0);
        assert_eq!(n, 0, "bytes after the error: {rest:?}");
        (code, message)
    }

    #[test]
    fn serves_the_owners_pages_on_one_connection_for_many_requests() {
        let f = fixture();
        let s = connect(&f);
        for r in [1u8, 2, 1] {
            let o = owner(u64::from(r), 7);
            let (res, bufs) = pull(&s, TOKEN, o, &pages_of(&f, o));
            res.unwrap();
            assert!(bufs.iter().flatten().all(|&b| b == r));
        }
        // A subset, in another order, is fine too.
        let mut pages = pages_of(&f, owner(2, 7));
        pages.reverse();
        pages.truncate(1);
        let (res, bufs) = pull(&s, TOKEN, owner(2, 7), &pages);
        res.unwrap();
        assert!(bufs[0].iter().all(|&b| b == 2));
    }

    #[test]
    fn another_owners_page_gets_an_error_and_nothing_else() {
        let f = fixture();
        let theirs = pages_of(&f, owner(2, 7));
        let mut mixed = pages_of(&f, owner(1, 7));
        mixed.push(theirs[0]);
        let s = connect(&f);
        let (r, bufs) = pull(&s, TOKEN, owner(1, 7), &mixed);
        let (code, message) = refused(&s, r, &bufs);
        assert_eq!(code, ErrorCode::BadRequest);
        assert!(message.contains("not in the manifest"), "{message}");
        // A page no one holds.
        let s = connect(&f);
        let (r, bufs) = pull(&s, TOKEN, owner(1, 7), &[PageId(15)]);
        refused(&s, r, &bufs);
    }

    #[test]
    fn unknown_owner_other_generation_and_bad_token_are_refused() {
        let f = fixture();
        for (token, o, want) in [
            (TOKEN, owner(3, 7), ErrorCode::BadRequest),
            (TOKEN, owner(1, 8), ErrorCode::BadRequest),
            ([0; TOKEN_BYTES], owner(1, 7), ErrorCode::Unauthorized),
        ] {
            let s = connect(&f);
            let (r, bufs) = pull(&s, token, o, &pages_of(&f, owner(1, 7)));
            let (code, message) = refused(&s, r, &bufs);
            assert_eq!(code, want, "{o}: {message}");
        }
    }

    #[test]
    fn freed_owner_is_refused_and_its_pages_are_free() {
        let f = fixture();
        let pages = pages_of(&f, owner(1, 7));
        let served = f.held.lock().remove(&owner(1, 7)).unwrap();
        drop(served);
        assert_eq!(f.pool.usage().free, 16 - 2);
        let s = connect(&f);
        let (r, bufs) = pull(&s, TOKEN, owner(1, 7), &pages);
        let (_, message) = refused(&s, r, &bufs);
        assert!(message.contains("no pages held"), "{message}");
    }

    #[test]
    fn garbage_gets_an_error_and_the_server_keeps_serving() {
        let f = fixture();
        let mut s = connect(&f);
        s.write_all(&[0xAB; 24]).unwrap();
        let mut rest = Vec::new();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let _ = s.read_to_end(&mut rest);
        assert!(rest.is_empty(), "bad magic gets no reply: {rest:?}");
        // A well-formed frame of another type: an Error frame, then close.
        let s = connect(&f);
        let frame = Message::from(proto::StatusQuery {})
            .encode(RequestId(0))
            .unwrap();
        (&s).write_all(&frame).unwrap();
        let start = Instant::now();
        let (_, msg) = tcp::read_frame(&s, "reply", &mut || {
            start.elapsed() < Duration::from_secs(2)
        })
        .unwrap();
        assert!(matches!(msg, Message::Error(e) if e.code == ErrorCode::BadRequest));
        let s = connect(&f);
        let o = owner(1, 7);
        pull(&s, TOKEN, o, &pages_of(&f, o)).0.unwrap();
    }

    #[test]
    fn connections_beyond_the_limit_are_refused_and_stop_is_prompt() {
        let f = fixture();
        let idle: Vec<TcpStream> = (0..MAX_CONNECTIONS).map(|_| connect(&f)).collect();
        // Wait until every idle connection is counted, then one more is refused.
        let start = Instant::now();
        while f.server.shared.active.load(Ordering::SeqCst) < MAX_CONNECTIONS {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "connections not counted"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let s = connect(&f);
        let (r, bufs) = pull(&s, TOKEN, owner(1, 7), &pages_of(&f, owner(1, 7)));
        let (code, _) = refused(&s, r, &bufs);
        assert_eq!(code, ErrorCode::PoolFull);
        let counters = &f.server.shared.counters;
        assert_eq!(
            counters.page_connections.load(Ordering::SeqCst),
            MAX_CONNECTIONS as u64
        );
        assert_eq!(counters.page_connections_refused.load(Ordering::SeqCst), 1);
        let start = Instant::now();
        drop(f.server);
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "stop took {:?}",
            start.elapsed()
        );
        drop(idle);
    }

    /// RDMA sessions against the device of `KVFENCE_RDMA_DEVICE` (tests/vm/rxe.sh runs
    /// them on soft-RoCE); each test says SKIPPED and passes where there is none.
    mod rdma {
        use super::*;
        use libkv::config::RdmaConfig;
        use libkv::proto::{RdmaConnect, RdmaReadDone};
        use libkv::rdma::{ClientSession, RdmaError};

        struct Reader {
            f: Fixture,
            stream: TcpStream,
            session: ClientSession,
            decode: PagePool,
        }

        fn config() -> Option<(RdmaConfig, String)> {
            let Ok(device) = std::env::var("KVFENCE_RDMA_DEVICE") else {
                eprintln!("SKIPPED: no RDMA device (set KVFENCE_RDMA_DEVICE)");
                return None;
            };
            let mut cfg = RdmaConfig::for_device(device);
            if let Ok(g) = std::env::var("KVFENCE_RDMA_GID_INDEX") {
                cfg.gid_index = g.parse().unwrap();
            }
            let ip = std::env::var("KVFENCE_RDMA_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
            Some((cfg, ip))
        }

        fn wait(what: &str, mut done: impl FnMut() -> bool) {
            let start = Instant::now();
            while !done() {
                assert!(start.elapsed() < Duration::from_secs(10), "{what}");
                std::thread::sleep(Duration::from_millis(5));
            }
        }

        /// The fixture serving RDMA, and a reader with its own local-only pool and a
        /// session set up with the right token.
        fn reader() -> Option<Reader> {
            let (cfg, ip) = config()?;
            let server_cfg = cfg.clone();
            let f = fixture_with(
                |pool| Some(Arc::new(RdmaNode::open(&server_cfg, pool, true).unwrap())),
                &ip,
            );
            let options = PoolOptions {
                poison: PoisonMode::Off,
                scrub: Scrub::Off,
            };
            let decode = PagePool::host(c"kvtest-decode", geometry(), 16, options).unwrap();
            let node = Arc::new(RdmaNode::open(&cfg, &decode, false).unwrap());
            let stream = connect(&f);
            let (mut session, mut hello) = ClientSession::new(&node).unwrap();
            hello.token = TOKEN;
            let mut going = || true;
            tcp::write_frame(&stream, RequestId(0), hello, &mut going).unwrap();
            let (_, answer) = tcp::read_frame(&stream, "answer", &mut going).unwrap();
            let Message::RdmaConnect(server) = answer else {
                panic!("expected RdmaConnect, got {answer:?}");
            };
            session.connect(&server).unwrap();
            Some(Reader {
                f,
                stream,
                session,
                decode,
            })
        }

        fn ask(r: &Reader, o: Owner, pages: &[PageId]) -> Message {
            let request = proto::PageRequest {
                token: TOKEN,
                owner: o,
                pages: pages.to_vec(),
            };
            let mut going = || true;
            tcp::write_frame(&r.stream, o.request, request, &mut going).unwrap();
            tcp::read_frame(&r.stream, "windows", &mut going).unwrap().1
        }

        fn counter(f: &Fixture, c: fn(&Counters) -> &std::sync::atomic::AtomicU64) -> u64 {
            c(&f.counters).load(Ordering::SeqCst)
        }

        #[test]
        fn a_session_reads_exactly_the_owners_pages_and_its_keys_die_after() {
            let Some(r) = reader() else { return };
            let o = owner(1, 7);
            let pages = pages_of(&r.f, o);
            let Message::RdmaWindows(windows) = ask(&r, o, &pages) else {
                panic!("no windows");
            };
            assert_eq!(windows.pages(), pages.len() as u64);
            let mut res = r.decode.reserve(o, 8, 8).unwrap();
            let mut grant = res.grant_write().unwrap();
            let n = pages.len();
            let dst = grant.pages_mut(0..n).unwrap();
            let mut going = || true;
            let (session, stats) = r.session.read(&windows, dst, &mut going).unwrap();
            assert!(
                stats.reads >= 1 && stats.bytes == n as u64 * 128,
                "{stats:?}"
            );
            for i in 0..n {
                assert!(
                    grant.page_mut(i).unwrap().iter().all(|&b| b == 1),
                    "page {i}"
                );
            }
            tcp::write_frame(&r.stream, o.request, RdmaReadDone { owner: o }, &mut going).unwrap();
            wait("windows invalidated", || {
                counter(&r.f, |c| &c.windows_revoked) == counter(&r.f, |c| &c.windows_bound)
            });
            assert!(counter(&r.f, |c| &c.windows_bound) >= 1);
            // The same keys, after RdmaReadDone: refused by the NIC, nothing lands.
            for i in 0..n {
                grant.page_mut(i).unwrap().fill(0xcc);
            }
            let dst = grant.pages_mut(0..n).unwrap();
            match session.read(&windows, dst, &mut going) {
                Err(RdmaError::Completion { status, .. }) => {
                    assert_eq!(status, 10, "remote access error")
                }
                other => panic!("a read through dead keys: {other:?}"),
            }
            for i in 0..n {
                assert!(
                    grant.page_mut(i).unwrap().iter().all(|&b| b == 0xcc),
                    "page {i} touched"
                );
            }
            eprintln!("read through invalidated windows: remote access error, pages untouched");
        }

        #[test]
        fn release_during_the_reads_kills_the_keys_before_the_pages_are_freed() {
            let Some(r) = reader() else { return };
            let o = owner(1, 7);
            let pages = pages_of(&r.f, o);
            let Message::RdmaWindows(windows) = ask(&r, o, &pages) else {
                panic!("no windows");
            };
            let free_before = r.f.pool.usage().free;
            // kvctld's Release: the event loop drops the owner; the connection still holds
            // the pages and must invalidate the windows before letting go of them.
            drop(r.f.held.lock().remove(&o));
            let n = pages.len();
            wait("pages freed after the release", || {
                r.f.pool.usage().free as usize == free_before as usize + n
            });
            assert_eq!(
                counter(&r.f, |c| &c.windows_revoked),
                counter(&r.f, |c| &c.windows_bound),
                "pages were freed while a window over them was alive"
            );
            let mut going = || true;
            match tcp::read_frame(&r.stream, "refusal", &mut going) {
                Ok((_, Message::Error(e))) => {
                    assert_eq!(e.code, ErrorCode::WorkerLost, "{}", e.message)
                }
                other => panic!("expected an error after the release, got {other:?}"),
            }
            // A late read through the old keys fails and lands nothing: the keys are dead
            // and the server has closed the session, so the NIC answers with a remote
            // access error (10) or, once the server's QP is gone, retries exhausted (12).
            let mut res = r.decode.reserve(o, 8, 8).unwrap();
            let mut grant = res.grant_write().unwrap();
            for i in 0..n {
                grant.page_mut(i).unwrap().fill(0xcc);
            }
            let dst = grant.pages_mut(0..n).unwrap();
            match r.session.read(&windows, dst, &mut going) {
                Err(RdmaError::Completion { status, .. }) => {
                    assert!(matches!(status, 10 | 12), "status {status}");
                }
                other => panic!("a late read: {other:?}"),
            }
            for i in 0..n {
                assert!(
                    grant.page_mut(i).unwrap().iter().all(|&b| b == 0xcc),
                    "page {i} touched"
                );
            }
        }

        #[test]
        fn sessions_need_the_token_and_windows_only_the_manifest() {
            let Some(r) = reader() else { return };
            // another owner's page in the request: refused before any window is bound
            let mut mixed = pages_of(&r.f, owner(1, 7));
            mixed.push(pages_of(&r.f, owner(2, 7))[0]);
            match ask(&r, owner(1, 7), &mixed) {
                Message::Error(e) => assert_eq!(e.code, ErrorCode::BadRequest, "{}", e.message),
                other => panic!("expected a refusal, got {other:?}"),
            }
            assert_eq!(counter(&r.f, |c| &c.windows_bound), 0);
            // a session with a wrong token
            let s = connect(&r.f);
            let hello = RdmaConnect {
                token: [0; TOKEN_BYTES],
                qp_num: 7,
                psn: 1,
                gid: [1; 16],
            };
            let mut going = || true;
            tcp::write_frame(&s, RequestId(0), hello, &mut going).unwrap();
            match tcp::read_frame(&s, "refusal", &mut going) {
                Ok((_, Message::Error(e))) => assert_eq!(e.code, ErrorCode::Unauthorized),
                other => panic!("expected a refusal, got {other:?}"),
            }
            assert_eq!(counter(&r.f, |c| &c.rdma_sessions), 1);
        }
    }
}
