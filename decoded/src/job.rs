//! Pull, verify and decode jobs, in two stages on two small fixed pools of threads.
//!
//! A job owns its request's [`Reservation`] and a cancel flag. Its pull and verification run
//! on the pull threads, so a pull never waits behind another request's decode: the transfer
//! deadline measures the transfer. The verified KV then goes to the decode threads, whose
//! queue is bounded only by the request's own deadline (a request that waits there past it
//! fails saying it waited for a decode thread). A job checks its cancel flag and its deadline
//! between pages and between decode steps, sends its frames (already encoded) back to the
//! event loop over a channel and wakes it, and ends with [`JobEvent::Ended`] once everything
//! it held is dropped, so the pages are back on the free list when the loop reports them
//! `Freed`.

use crate::Counters;
use crossbeam::channel::{Receiver, Sender};
use libkv::Owner;
use libkv::RequestId;
use libkv::memory::ForeignPool;
use libkv::model::ModelRunner;
use libkv::pool::{Reservation, WriteGrant};
use libkv::proto::Sampling;
use libkv::proto::TOKEN_BYTES;
use libkv::proto::{Done, Error, ErrorCode, Message, PageRequest, PullDone, RdmaReadDone, Tokens};
use libkv::rdma::{ClientSession, RdmaNode};
use libkv::tcp;
use libkv::verify::{Manifest, VerifiedKv, VerifyError};
use libkv::worker::add;
use log::debug;
use mio::Waker;
use std::fmt;
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Most tokens per `Tokens` frame.
pub(crate) const TOKENS_PER_FRAME: usize = 8;

/// Longest a generated token waits for the rest of its frame: a model slower than
/// `TOKENS_PER_FRAME` tokens in this time streams smaller frames, so a client sees each
/// token about when it exists. The first token always goes out alone, at once (time to
/// first token).
const FRAME_INTERVAL: Duration = Duration::from_millis(25);

/// One request's pull, verification and decode.
#[derive(Debug)]
pub(crate) struct Job {
    pub owner: Owner,
    pub res: Reservation,
    pub manifest: Manifest,
    pub max_new_tokens: u32,
    /// The prompt's last token, the input of the first decode step.
    pub last_token: u32,
    /// How to pick each new token.
    pub sampling: Sampling,
    pub cancel: Arc<AtomicBool>,
    /// When the pages were reserved (for `Done::elapsed_us`).
    pub since: Instant,
    /// Longest the pull may take.
    pub transfer: Duration,
    /// Longest decoding may take.
    pub decode: Duration,
    /// The request's own deadline; caps both.
    pub request_deadline: Instant,
    /// Where the pages come from: the mapped prefill pool or its page server.
    pub source: Arc<dyn PageSource>,
    /// The connection the job belongs to; frames of an older one are discarded.
    pub epoch: u64,
}

/// Where a job pulls prefill pages from. The job checks the manifest against the source's
/// pool, then the source copies the pages into the job's own grant, in manifest order,
/// calling `keep_going` between pages (and, on a network, while the peer is silent). Every
/// source lands the pages through the grant's [`Landing`](libkv::pool::Landing), which
/// digests each byte in decode's own pages as it arrives, so verification reads no page a
/// second time.
pub(crate) trait PageSource: Send + Sync + fmt::Debug {
    /// Pages in the prefill pool.
    fn pool_pages(&self) -> u32;
    /// Bytes per prefill page.
    fn page_bytes(&self) -> u64;
    /// Copies the manifest's pages into `grant`'s pages. `Err(None)` when `keep_going` said
    /// stop; `Err(Some)` with the code and reason of a failure.
    fn pull(
        &self,
        manifest: &Manifest,
        grant: &mut WriteGrant,
        keep_going: &(dyn Fn() -> bool + Sync),
    ) -> Result<(), Option<(ErrorCode, String)>>;
}

/// Threads a shared-memory pull of at least [`PARALLEL_PULL_BYTES`] is split over (the job's
/// own thread and helpers, each taking a run of the manifest's pages).
pub(crate) const PULL_THREADS: usize = 2;
/// The smallest pull worth splitting: below it, starting a helper costs more than it saves.
pub(crate) const PARALLEL_PULL_BYTES: u64 = 4 << 20;

impl PageSource for ForeignPool {
    fn pool_pages(&self) -> u32 {
        self.pages()
    }

    fn page_bytes(&self) -> u64 {
        ForeignPool::page_bytes(self)
    }

    fn pull(
        &self,
        manifest: &Manifest,
        grant: &mut WriteGrant,
        keep_going: &(dyn Fn() -> bool + Sync),
    ) -> Result<(), Option<(ErrorCode, String)>> {
        let landing = grant
            .landing(0..manifest.pages.len())
            .map_err(|e| Some((ErrorCode::Internal, e.to_string())))?;
        let bytes = manifest.pages.len() as u64 * ForeignPool::page_bytes(self);
        let threads = if bytes >= PARALLEL_PULL_BYTES {
            PULL_THREADS
        } else {
            1
        };
        match ForeignPool::pull(self, &manifest.pages, landing, threads, keep_going) {
            Ok(()) => Ok(()),
            Err(libkv::memory::PullError::Stopped) => Err(None),
            Err(e) => Err(Some((
                ErrorCode::BadRequest,
                format!("cannot pull from the prefill pool: {e}"),
            ))),
        }
    }
}

/// Idle connections kept per page server: one per pull thread, the most that can be busy on
/// one source at once, so a source never holds more than that many open connections idle.
const IDLE_CONNECTIONS: usize = crate::PULL_THREADS;
/// Longest a connection waits in the idle list before it is closed instead of reused. The
/// page server closes a connection that brought no request for its own idle time (the
/// request deadline); one it closed just as a job took it would fail that job's request for
/// nothing. Closed ones are also caught before reuse ([`still_open`]); this bounds the race.
const IDLE_REUSE_FOR: Duration = Duration::from_secs(1);

/// The idle connections of one page server, each with the time it went idle.
#[derive(Debug)]
struct IdleList<T>(Mutex<Vec<(Instant, T)>>);

impl<T> IdleList<T> {
    fn new() -> IdleList<T> {
        IdleList(Mutex::new(Vec::new()))
    }

    /// The most recently idle connection that is still fit for a request: idle less than
    /// [`IDLE_REUSE_FOR`] and, by `open`, not closed by the server. The others are dropped
    /// (closed) on the way.
    fn take(&self, open: impl Fn(&T) -> bool) -> Option<T> {
        loop {
            let next = self.0.lock().unwrap_or_else(|e| e.into_inner()).pop()?;
            let (since, conn) = next;
            if since.elapsed() < IDLE_REUSE_FOR && open(&conn) {
                return Some(conn);
            }
        }
    }

    /// Keeps `conn` for the next request, unless [`IDLE_CONNECTIONS`] are idle already.
    fn put(&self, conn: T) {
        let mut idle = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < IDLE_CONNECTIONS {
            idle.push((Instant::now(), conn));
        }
    }
}

/// Whether an idle page-server connection is still open: nothing to read (the server sends
/// only when asked), no end of stream, no error.
fn still_open(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return false;
    }
    let mut byte = [0u8; 1];
    let open = matches!(stream.peek(&mut byte), Err(e) if e.kind() == io::ErrorKind::WouldBlock);
    stream.set_nonblocking(false).is_ok() && open
}
/// Longest one connection attempt to the page server may take before the pull looks at its
/// deadline and, if it may go on, tries again (see [`connect`]).
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// One prefill worker's TCP page server. Connections are reused across requests (at most
/// [`IDLE_CONNECTIONS`] kept idle, per source, for at most [`IDLE_REUSE_FOR`]); one that saw
/// any error is dropped. Dropping
/// the source (the worker is gone or replaced, and no job still holds it) closes its idle
/// connections.
#[derive(Debug)]
pub(crate) struct TcpSource {
    addr: SocketAddr,
    token: [u8; TOKEN_BYTES],
    pool_pages: u32,
    page_bytes: u64,
    idle: IdleList<TcpStream>,
}

/// A new connection to the page server at `addr`. An attempt that times out (a SYN or its
/// answer lost, the link down for a moment) or finds no route (the link is down) is made
/// again while `keep_going` says the pull may go on: TCP itself would retransmit the SYN only
/// after a second, then three. A refused connection (nothing listens: the worker is gone)
/// fails at once.
fn connect(
    addr: SocketAddr,
    keep_going: &mut dyn FnMut() -> bool,
) -> Result<TcpStream, (ErrorCode, String)> {
    let lost = |e: std::io::Error| {
        let reason = format!("connecting to the prefill page server {addr}: {e}");
        (ErrorCode::WorkerLost, reason)
    };
    let s = loop {
        match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
            Ok(s) => break s,
            Err(e) if e.kind() == io::ErrorKind::TimedOut && keep_going() => {
                debug!("connecting to the prefill page server {addr}: {e}; trying again");
            }
            // No route for now (the link is down): the same, after a pause.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NetworkUnreachable | io::ErrorKind::HostUnreachable
                ) && keep_going() =>
            {
                debug!("connecting to the prefill page server {addr}: {e}; trying again");
                std::thread::sleep(tcp::IO_SLICE);
            }
            Err(e) => return Err(lost(e)),
        }
    };
    tcp::prepare(&s).map_err(|e| (ErrorCode::Internal, e.to_string()))?;
    Ok(s)
}

impl TcpSource {
    /// The page server at `addr` of a pool of `pool_pages` pages of `page_bytes` bytes.
    pub(crate) fn new(
        addr: SocketAddr,
        token: [u8; TOKEN_BYTES],
        pool_pages: u32,
        page_bytes: u64,
    ) -> TcpSource {
        TcpSource {
            addr,
            token,
            pool_pages,
            page_bytes,
            idle: IdleList::new(),
        }
    }

    fn connection(
        &self,
        keep_going: &mut dyn FnMut() -> bool,
    ) -> Result<TcpStream, (ErrorCode, String)> {
        match self.idle.take(still_open) {
            Some(s) => Ok(s),
            None => connect(self.addr, keep_going),
        }
    }
}

impl PageSource for TcpSource {
    fn pool_pages(&self) -> u32 {
        self.pool_pages
    }

    fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    fn pull(
        &self,
        manifest: &Manifest,
        grant: &mut WriteGrant,
        keep_going: &(dyn Fn() -> bool + Sync),
    ) -> Result<(), Option<(ErrorCode, String)>> {
        let page_bytes = u32::try_from(self.page_bytes)
            .map_err(|_| Some((ErrorCode::Internal, "page over 4 GiB".to_owned())))?;
        let stream = self.connection(&mut || keep_going()).map_err(Some)?;
        let owner = manifest.owner;
        match tcp::fetch_pages(
            &stream,
            self.token,
            owner,
            &manifest.pages,
            page_bytes,
            grant,
            &mut || keep_going(),
        ) {
            Ok(()) => {
                self.idle.put(stream);
                Ok(())
            }
            Err(tcp::TcpError::Stopped) => Err(None),
            Err(tcp::TcpError::Refused { code, message }) => Err(Some((
                code,
                format!("the prefill page server refused {owner}: {message}"),
            ))),
            Err(e) => Err(Some((
                ErrorCode::WorkerLost,
                format!(
                    "pulling {owner} from {}: {}",
                    self.addr,
                    libkv::error_chain(&e)
                ),
            ))),
        }
    }
}

/// One prefill worker's page server, read with RDMA: each connection carries an RDMA
/// session (its QP pairs with one of the server's), set up once and reused across requests
/// (at most [`IDLE_CONNECTIONS`] kept idle, per source, for at most [`IDLE_REUSE_FOR`]). For
/// each request the server answers
/// with windows over the manifest's pages; the job reads them straight into its own grant,
/// says `RdmaReadDone`, and verifies as on any other transport. A connection that saw any
/// error is dropped, its QP destroyed first. Dropping the source closes its idle sessions.
#[derive(Debug)]
pub(crate) struct RdmaSource {
    addr: SocketAddr,
    token: [u8; TOKEN_BYTES],
    pool_pages: u32,
    page_bytes: u64,
    node: Arc<RdmaNode>,
    idle: IdleList<(TcpStream, ClientSession)>,
}

type Failure = Option<(ErrorCode, String)>;

impl RdmaSource {
    /// The page server at `addr`, read through `node`.
    pub(crate) fn new(
        addr: SocketAddr,
        token: [u8; TOKEN_BYTES],
        pool_pages: u32,
        page_bytes: u64,
        node: Arc<RdmaNode>,
    ) -> RdmaSource {
        RdmaSource {
            addr,
            token,
            pool_pages,
            page_bytes,
            node,
            idle: IdleList::new(),
        }
    }

    fn session(
        &self,
        keep_going: &mut dyn FnMut() -> bool,
    ) -> Result<(TcpStream, ClientSession), Failure> {
        if let Some(c) = self.idle.take(|(stream, _)| still_open(stream)) {
            return Ok(c);
        }
        let stream = connect(self.addr, keep_going).map_err(Some)?;
        let internal = |e: libkv::rdma::RdmaError| {
            Some((
                ErrorCode::Internal,
                format!("setting up an RDMA session: {}", libkv::error_chain(&e)),
            ))
        };
        let (mut session, mut hello) = ClientSession::new(&self.node).map_err(internal)?;
        hello.token = self.token;
        tcp::write_frame(&stream, RequestId(0), hello, keep_going).map_err(|e| self.lost(e))?;
        match tcp::read_frame(&stream, "waiting for RdmaConnect", keep_going) {
            Ok((_, Message::RdmaConnect(server))) => {
                session.connect(&server).map_err(internal)?;
                Ok((stream, session))
            }
            Ok((_, Message::Error(e))) => Err(Some((
                e.code,
                format!(
                    "the prefill page server refused an RDMA session: {}",
                    e.message
                ),
            ))),
            Ok((_, other)) => Err(Some((
                ErrorCode::WorkerLost,
                format!(
                    "{:?} instead of RdmaConnect from {}",
                    other.msg_type(),
                    self.addr
                ),
            ))),
            Err(e) => Err(self.lost(e)),
        }
    }

    fn lost(&self, e: tcp::TcpError) -> Failure {
        match e {
            tcp::TcpError::Stopped => None,
            e => Some((
                ErrorCode::WorkerLost,
                format!(
                    "RDMA session with {}: {}",
                    self.addr,
                    libkv::error_chain(&e)
                ),
            )),
        }
    }
}

impl PageSource for RdmaSource {
    fn pool_pages(&self) -> u32 {
        self.pool_pages
    }

    fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    fn pull(
        &self,
        manifest: &Manifest,
        grant: &mut WriteGrant,
        keep_going: &(dyn Fn() -> bool + Sync),
    ) -> Result<(), Failure> {
        let keep_going = &mut || keep_going();
        let owner = manifest.owner;
        let (stream, session) = self.session(keep_going)?;
        let request = PageRequest {
            token: self.token,
            owner,
            pages: manifest.pages.clone(),
        };
        tcp::write_frame(&stream, owner.request, request, keep_going).map_err(|e| self.lost(e))?;
        let windows = match tcp::read_frame(&stream, "waiting for RdmaWindows", keep_going) {
            Ok((_, Message::RdmaWindows(w))) if w.owner == owner => w,
            Ok((_, Message::Error(e))) => {
                return Err(Some((
                    e.code,
                    format!("the prefill page server refused {owner}: {}", e.message),
                )));
            }
            Ok((_, other)) => {
                return Err(Some((
                    ErrorCode::WorkerLost,
                    format!("{:?} instead of the windows of {owner}", other.msg_type()),
                )));
            }
            Err(e) => return Err(self.lost(e)),
        };
        let dst = grant
            .landing(0..manifest.pages.len())
            .map_err(|e| Some((ErrorCode::Internal, e.to_string())))?;
        let (session, _stats) = match session.read_into(&windows, dst, keep_going) {
            Ok(done) => done,
            Err(libkv::rdma::RdmaError::Stopped) => return Err(None),
            Err(e) => {
                return Err(Some((
                    ErrorCode::WorkerLost,
                    format!(
                        "reading the pages of {owner} over RDMA from {}: {}",
                        self.addr,
                        libkv::error_chain(&e)
                    ),
                )));
            }
        };
        tcp::write_frame(&stream, owner.request, RdmaReadDone { owner }, keep_going)
            .map_err(|e| self.lost(e))?;
        self.idle.put((stream, session));
        Ok(())
    }
}

/// What jobs send the event loop.
#[derive(Debug)]
pub(crate) enum JobEvent {
    /// A frame for kvctld, encoded.
    Frame { epoch: u64, bytes: Vec<u8> },
    /// The job is over and everything it held is dropped: `pages` pages are free again.
    Ended {
        epoch: u64,
        owner: Owner,
        pages: u32,
    },
}

/// What every job shares.
#[derive(Debug)]
pub(crate) struct JobContext {
    pub model: Arc<dyn ModelRunner>,
    pub counters: Arc<Counters>,
    pub events: Sender<JobEvent>,
    pub waker: Arc<Waker>,
}

/// The job threads: pull threads fed by [`JobPool::submit`], decode threads fed by the pull
/// threads with what they verified. Dropping it closes the pull channel and joins the pull
/// threads (each finishes its current pull first), whose senders closing ends the decode
/// threads once their queue is done; those are joined too.
#[derive(Debug)]
pub(crate) struct JobPool {
    tx: Option<Sender<Job>>,
    pullers: Vec<JoinHandle<()>>,
    decoders: Vec<JoinHandle<()>>,
}

impl JobPool {
    pub(crate) fn start(
        pull_threads: usize,
        decode_threads: usize,
        ctx: Arc<JobContext>,
    ) -> io::Result<JobPool> {
        let (tx, rx) = crossbeam::channel::unbounded::<Job>();
        let (decode_tx, decode_rx) = crossbeam::channel::unbounded::<Decoding>();
        let mut pool = JobPool {
            tx: Some(tx),
            pullers: Vec::with_capacity(pull_threads),
            decoders: Vec::with_capacity(decode_threads),
        };
        for i in 0..decode_threads {
            let (rx, ctx): (Receiver<Decoding>, _) = (decode_rx.clone(), Arc::clone(&ctx));
            let handle = std::thread::Builder::new()
                .name(format!("decoded-decode-{i}"))
                .spawn(move || {
                    for d in rx {
                        run_decode(&ctx, d);
                    }
                })?;
            pool.decoders.push(handle);
        }
        for i in 0..pull_threads {
            let (rx, ctx): (Receiver<Job>, _) = (rx.clone(), Arc::clone(&ctx));
            let decode_tx = decode_tx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("decoded-pull-{i}"))
                .spawn(move || {
                    for job in rx {
                        run_pull(&ctx, job, &decode_tx);
                    }
                })?;
            pool.pullers.push(handle);
        }
        Ok(pool)
    }

    /// Queues a job's pull; gives it back if the threads are gone.
    pub(crate) fn submit(&self, job: Job) -> Result<(), Box<Job>> {
        match &self.tx {
            Some(tx) => tx.send(job).map_err(|e| Box::new(e.into_inner())),
            None => Err(Box::new(job)),
        }
    }
}

impl Drop for JobPool {
    fn drop(&mut self) {
        self.tx = None;
        for t in self.pullers.drain(..) {
            let _ = t.join();
        }
        for t in self.decoders.drain(..) {
            let _ = t.join();
        }
    }
}

/// A job whose pages were pulled and verified, waiting for (or on) a decode thread.
#[derive(Debug)]
struct Decoding {
    owner: Owner,
    epoch: u64,
    kv: VerifiedKv,
    /// Pages the job holds (its whole reservation), freed when it ends.
    held: u32,
    prompt_tokens: u32,
    /// Pages transferred.
    pages: u32,
    page_bytes: u64,
    max_new_tokens: u32,
    last_token: u32,
    sampling: Sampling,
    cancel: Arc<AtomicBool>,
    since: Instant,
    decode: Duration,
    request_deadline: Instant,
    /// When the pull thread handed it over.
    queued: Instant,
}

/// Why a job stopped early.
#[derive(Debug)]
enum Stop {
    /// Its cancel flag was set (Abort, disconnect, shutdown): nothing to report.
    Cancelled,
    /// It failed: report `Error{code, message}`.
    Failed { code: ErrorCode, message: String },
}

impl From<libkv::model::ModelError> for Stop {
    fn from(e: libkv::model::ModelError) -> Stop {
        failed(ErrorCode::Internal, e.to_string())
    }
}

fn failed(code: ErrorCode, message: String) -> Stop {
    Stop::Failed { code, message }
}

/// What a stage sends about its job: frames for kvctld, encoded, through `ctx`.
fn emitter(ctx: &JobContext, owner: Owner, epoch: u64) -> impl Fn(Message) + '_ {
    move |msg: Message| match msg.encode(owner.request) {
        Ok(bytes) => {
            let _ = ctx.events.send(JobEvent::Frame { epoch, bytes });
            let _ = ctx.waker.wake();
        }
        Err(e) => debug!("cannot encode a frame for {owner}: {e}"),
    }
}

/// The end of a job, whichever stage it ended in: its error, if it failed, then `Ended`.
/// Everything the job held is dropped by then.
fn end(ctx: &JobContext, owner: Owner, epoch: u64, pages: u32, result: Result<(), Stop>) {
    match result {
        Ok(()) => debug!("{owner} done"),
        Err(Stop::Cancelled) => debug!("{owner} cancelled"),
        Err(Stop::Failed { code, message }) => {
            debug!("{owner} failed: {code}: {message}");
            emitter(ctx, owner, epoch)(Message::from(Error {
                code,
                message: libkv::worker::text(message),
            }));
        }
    }
    let _ = ctx.events.send(JobEvent::Ended {
        epoch,
        owner,
        pages,
    });
    let _ = ctx.waker.wake();
}

/// The first stage, on a pull thread: pull and verify, then hand the verified KV to the
/// decode threads (or end the job here).
fn run_pull(ctx: &JobContext, job: Job, decoders: &Sender<Decoding>) {
    let (owner, epoch) = (job.owner, job.epoch);
    let pages = u32::try_from(job.res.pages().len()).unwrap_or(u32::MAX);
    // `pull_and_verify` consumes the job: on failure its grant and reservation are dropped
    // (pages back on the free list) before `Ended` is sent.
    let result = match pull_and_verify(ctx, job, &emitter(ctx, owner, epoch)) {
        Ok(d) => match decoders.send(d) {
            Ok(()) => return,
            // The decode threads are gone (stopping): the job ends with its pages.
            Err(e) => {
                drop(e.into_inner());
                Err(Stop::Cancelled)
            }
        },
        Err(stop) => Err(stop),
    };
    end(ctx, owner, epoch, pages, result);
}

/// The second stage, on a decode thread.
fn run_decode(ctx: &JobContext, d: Decoding) {
    let (owner, epoch) = (d.owner, d.epoch);
    let pages = d.held;
    let result = decode(ctx, d, &emitter(ctx, owner, epoch));
    end(ctx, owner, epoch, pages, result);
}

/// `Err` when the job was cancelled or `deadline` passed (`what` says which stage).
fn check(cancel: &AtomicBool, owner: Owner, deadline: Instant, what: &str) -> Result<(), Stop> {
    if cancel.load(Ordering::Acquire) {
        Err(Stop::Cancelled)
    } else if Instant::now() >= deadline {
        Err(failed(
            ErrorCode::Timeout,
            format!("{what} of {owner} passed its deadline"),
        ))
    } else {
        Ok(())
    }
}

fn pull_and_verify(ctx: &JobContext, job: Job, emit: &dyn Fn(Message)) -> Result<Decoding, Stop> {
    let Job {
        owner,
        mut res,
        manifest,
        max_new_tokens,
        last_token,
        sampling,
        cancel,
        since,
        transfer,
        decode,
        request_deadline,
        source,
        epoch,
    } = job;
    let counters = &ctx.counters;
    let held = u32::try_from(res.pages().len()).unwrap_or(u32::MAX);
    let pull_deadline = (Instant::now() + transfer).min(request_deadline);
    check(&cancel, owner, pull_deadline, "pull")?;

    // The manifest is untrusted: it may name only pages of the prefill pool, and no more
    // than the reservation's prompt pages (the targets are the reservation's own pages).
    let prompt_pages = res.prompt_pages();
    if manifest.pages.len() > prompt_pages {
        return Err(failed(
            ErrorCode::BadRequest,
            format!(
                "manifest lists {} pages, the reservation holds {prompt_pages} prompt pages",
                manifest.pages.len()
            ),
        ));
    }
    if let Some(p) = manifest.pages.iter().find(|p| p.0 >= source.pool_pages()) {
        return Err(failed(
            ErrorCode::BadRequest,
            format!(
                "manifest names {p}, outside the prefill pool of {} pages",
                source.pool_pages()
            ),
        ));
    }
    let page_bytes = res.pool().page_bytes() as u64;
    if source.page_bytes() != page_bytes {
        return Err(failed(
            ErrorCode::Internal,
            format!(
                "prefill pages are {} bytes, decode pages {page_bytes}",
                source.page_bytes()
            ),
        ));
    }
    {
        let internal = |e: libkv::pool::PoolError| failed(ErrorCode::Internal, e.to_string());
        let mut grant = res.grant_write().map_err(internal)?;
        let keep_going = || check(&cancel, owner, pull_deadline, "pull").is_ok();
        let pull_start = Instant::now();
        let pulled = source.pull(&manifest, &mut grant, &keep_going);
        add(&counters.pull_us, micros(pull_start.elapsed()));
        match pulled {
            Ok(()) => {}
            // Stopped: say why (cancelled or past the deadline).
            Err(None) => {
                check(&cancel, owner, pull_deadline, "pull")?;
                return Err(Stop::Cancelled);
            }
            Err(Some((code, message))) => {
                // A cancel or a deadline may be why the source failed; they take precedence.
                check(&cancel, owner, pull_deadline, "pull")?;
                return Err(failed(code, message));
            }
        }
        let pulled = manifest.pages.len() as u64;
        add(&counters.pages_pulled, pulled);
        add(&counters.bytes_pulled, pulled * page_bytes);
    }
    let verify_start = Instant::now();
    let verified = res.verify(&manifest);
    add(&counters.verify_us, micros(verify_start.elapsed()));
    let kv = match verified {
        Ok(kv) => kv,
        Err(e) => {
            add(&counters.verify_failed, 1);
            add(
                match e {
                    VerifyError::TokenCount { .. }
                    | VerifyError::PageCount { .. }
                    | VerifyError::DigestCount { .. } => &counters.verify_failed_coverage,
                    VerifyError::OwnerMismatch { .. }
                    | VerifyError::NotOwned { .. }
                    | VerifyError::WrongState { .. }
                    | VerifyError::Pool(_) => &counters.verify_failed_ownership,
                    VerifyError::WriterActive => &counters.verify_failed_writer,
                    VerifyError::Digest { .. } => &counters.verify_failed_digest,
                },
                1,
            );
            return Err(failed(ErrorCode::VerifyFailed, e.to_string()));
        }
    };
    add(&counters.verified, 1);
    emit(PullDone { owner }.into());
    Ok(Decoding {
        owner,
        epoch,
        kv,
        held,
        prompt_tokens: manifest.tokens,
        pages: u32::try_from(manifest.pages.len()).unwrap_or(u32::MAX),
        page_bytes,
        max_new_tokens,
        last_token,
        sampling,
        cancel,
        since,
        decode,
        request_deadline,
        queued: Instant::now(),
    })
}

fn decode(ctx: &JobContext, d: Decoding, emit: &dyn Fn(Message)) -> Result<(), Stop> {
    let Decoding {
        owner,
        mut kv,
        prompt_tokens,
        pages,
        page_bytes,
        max_new_tokens,
        last_token,
        sampling,
        cancel,
        since,
        decode,
        request_deadline,
        queued,
        ..
    } = d;
    let counters = &ctx.counters;
    let waited = queued.elapsed();
    add(&counters.decode_wait_us, micros(waited));
    if cancel.load(Ordering::Acquire) {
        return Err(Stop::Cancelled);
    }
    if Instant::now() >= request_deadline {
        return Err(failed(
            ErrorCode::Timeout,
            format!(
                "{owner} waited {} ms for a decode thread (all were decoding other requests) \
                 and passed its request deadline",
                waited.as_millis()
            ),
        ));
    }
    // The decode deadline counts from the first step, not from the wait for a thread.
    let decode_deadline = (Instant::now() + decode).min(request_deadline);
    let model: &dyn ModelRunner = ctx.model.as_ref();
    let mut batch = Vec::with_capacity(TOKENS_PER_FRAME);
    let mut first_index = 0u32;
    let mut last_frame = Instant::now();
    let output = libkv::model::decode_with(
        model,
        &mut kv,
        prompt_tokens,
        last_token,
        max_new_tokens,
        &sampling,
        |step, token| {
            add(&counters.tokens_generated, 1);
            batch.push(token);
            if step == 0
                || batch.len() == TOKENS_PER_FRAME
                || step + 1 == max_new_tokens
                || last_frame.elapsed() >= FRAME_INTERVAL
            {
                last_frame = Instant::now();
                let tokens = std::mem::replace(&mut batch, Vec::with_capacity(TOKENS_PER_FRAME));
                emit(
                    Tokens {
                        first_index,
                        tokens,
                    }
                    .into(),
                );
                first_index = step + 1;
            }
            check(&cancel, owner, decode_deadline, "decode")
        },
    )?;
    if !batch.is_empty() {
        // The model stopped (end of turn) before max_new_tokens: the last frame is short.
        emit(
            Tokens {
                first_index,
                tokens: batch,
            }
            .into(),
        );
    }
    emit(
        Done {
            tokens: u32::try_from(output.tokens.len()).unwrap_or(u32::MAX),
            signature: output.signature,
            pages_transferred: pages,
            bytes_transferred: u64::from(pages) * page_bytes,
            elapsed_us: u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX),
            // kvctld fills in who served the request.
            prefill_worker: String::new(),
            decode_worker: String::new(),
        }
        .into(),
    );
    drop(kv);
    Ok(())
}

/// `d` in whole microseconds, for the time counters.
fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use libkv::PageGeometry;
    use libkv::model::{KvCache, ModelError, PageWrite, ReferenceModel, tokenize};
    use libkv::pool::{PagePool, PoolOptions};
    use libkv::testkit::owner;
    use libkv::verify::page_digest;
    use std::io::Read as _;
    use std::net::TcpListener;

    /// The reference model, each decode step slowed to `step` (a model busy computing).
    #[derive(Debug)]
    struct Slow {
        inner: ReferenceModel,
        step: Duration,
    }

    impl ModelRunner for Slow {
        fn geometry(&self) -> &PageGeometry {
            self.inner.geometry()
        }
        fn vocab(&self) -> u32 {
            self.inner.vocab()
        }
        fn model_id(&self) -> String {
            self.inner.model_id()
        }
        fn prefill_chunked(
            &self,
            prompt: &[u32],
            pages: &mut dyn PageWrite,
            keep_going: &mut dyn FnMut(usize) -> bool,
        ) -> Result<bool, ModelError> {
            self.inner.prefill_chunked(prompt, pages, keep_going)
        }
        fn step(
            &self,
            kv: &mut dyn KvCache,
            input: u32,
            step: u32,
            prompt_len: u32,
        ) -> Result<u32, ModelError> {
            std::thread::sleep(self.step);
            self.inner.step(kv, input, step, prompt_len)
        }
    }

    /// What one job's frames said, in order.
    fn frames(events: &Receiver<JobEvent>, until: usize) -> Vec<(u64, Message)> {
        let mut out = Vec::new();
        let mut ended = 0;
        while ended < until {
            match events
                .recv_timeout(Duration::from_secs(30))
                .expect("a job event")
            {
                JobEvent::Frame { bytes, .. } => {
                    let (h, m) = libkv::proto::decode_frame(&bytes, 0).expect("frame");
                    out.push((h.request_id.0, m));
                }
                JobEvent::Ended { .. } => ended += 1,
            }
        }
        out
    }

    #[test]
    fn a_pull_does_not_wait_for_the_decodes_that_hold_every_decode_thread() {
        let g = libkv::testkit::test_config("/nonexistent".into()).geometry;
        let model = Arc::new(Slow {
            inner: ReferenceModel::new(g).unwrap(),
            step: Duration::from_millis(20),
        });
        let prefill = PagePool::host(c"jobtest-prefill", g, 64, PoolOptions::default()).unwrap();
        let decode = PagePool::host(c"jobtest-decode", g, 64, PoolOptions::default()).unwrap();
        let source: Arc<dyn PageSource> = Arc::new(
            ForeignPool::map(prefill.memory().share_fd().unwrap(), g.bytes_per_page(), 64).unwrap(),
        );
        let poll = mio::Poll::new().unwrap();
        let waker = Arc::new(Waker::new(poll.registry(), mio::Token(0)).unwrap());
        let (events_tx, events) = crossbeam::channel::unbounded();
        let jobs = JobPool::start(
            2,
            2,
            Arc::new(JobContext {
                model: model.clone(),
                counters: Arc::new(Counters::default()),
                events: events_tx,
                waker,
            }),
        )
        .unwrap();
        let mut held = Vec::new();
        let job = |r: u64, max_new: u32, held: &mut Vec<Reservation>| {
            let prompt = tokenize(format!("request {r} of the queueing test").as_bytes());
            let n = u32::try_from(prompt.len()).unwrap();
            let mut pre = prefill.reserve(owner(r), n, u64::from(n)).unwrap();
            let mut grant = pre.grant_write().unwrap();
            model.inner.prefill(&prompt, &mut grant).unwrap();
            let digests = (0..grant.pages().len())
                .map(|i| page_digest(grant.page_mut(i).unwrap()))
                .collect();
            let pages = grant.pages().to_vec();
            drop(grant);
            held.push(pre);
            Job {
                owner: owner(r),
                res: decode.reserve(owner(r), n, u64::from(n + max_new)).unwrap(),
                manifest: Manifest {
                    owner: owner(r),
                    tokens: n,
                    pages,
                    digests,
                },
                max_new_tokens: max_new,
                last_token: *prompt.last().unwrap(),
                sampling: Sampling::GREEDY,
                cancel: Arc::new(AtomicBool::new(false)),
                since: Instant::now(),
                transfer: Duration::from_secs(1),
                decode: Duration::from_secs(60),
                request_deadline: Instant::now() + Duration::from_secs(60),
                source: Arc::clone(&source),
                epoch: 1,
            }
        };
        // Two decodes of 100 steps (2 s each) take both decode threads; the third's pull
        // must not wait for them: it is done, within its 1 s transfer deadline, while they
        // still decode, and its decode follows.
        for r in [1, 2] {
            jobs.submit(job(r, 100, &mut held)).unwrap();
        }
        let mut seen = Vec::new();
        let busy = Instant::now();
        loop {
            let decoding: std::collections::HashSet<u64> = seen
                .iter()
                .filter(|(_, m)| matches!(m, Message::Tokens(_)))
                .map(|(r, _)| *r)
                .collect();
            if decoding.len() == 2 {
                break;
            }
            assert!(
                busy.elapsed() < Duration::from_secs(10),
                "the decodes did not start"
            );
            if let Ok(JobEvent::Frame { bytes, .. }) =
                events.recv_timeout(Duration::from_millis(100))
            {
                let (h, m) = libkv::proto::decode_frame(&bytes, 0).expect("frame");
                seen.push((h.request_id.0, m));
            }
        }
        jobs.submit(job(3, 4, &mut held)).unwrap();
        seen.extend(frames(&events, 3));
        let at = |want: &dyn Fn(u64, &Message) -> bool| {
            seen.iter()
                .position(|(r, m)| want(*r, m))
                .unwrap_or_else(|| panic!("not seen in {seen:?}"))
        };
        let third_pulled = at(&|r, m| r == 3 && matches!(m, Message::PullDone(_)));
        let first_done = at(&|r, m| r <= 2 && matches!(m, Message::Done(_)));
        assert!(
            third_pulled < first_done,
            "the third pull waited for a decode to finish: {seen:?}"
        );
        for r in 1..=3 {
            assert!(
                seen.iter()
                    .any(|(id, m)| *id == r && matches!(m, Message::Done(_))),
                "request {r} did not finish: {seen:?}"
            );
        }
        drop(jobs);
        drop(held);
    }

    /// A connected pair on loopback: (the client's end, the server's end).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server, _) = l.accept().unwrap();
        (client, server)
    }

    #[test]
    fn a_connection_the_server_closed_is_not_reused() {
        let (client, server) = pair();
        let idle = IdleList::new();
        idle.put(client);
        drop(server);
        // The end of stream reaches the client's socket at once on loopback; wait for it.
        let deadline = Instant::now() + Duration::from_secs(5);
        let (probe, _keep) = pair();
        while Instant::now() < deadline {
            if let Some(c) = idle.take(still_open) {
                // Still open: the FIN is not in yet. Put it back and look again.
                idle.put(c);
                std::thread::sleep(Duration::from_millis(5));
            } else {
                break;
            }
        }
        assert!(
            idle.take(still_open).is_none(),
            "a closed connection was handed out"
        );
        // An open one is reused, and still usable as a blocking stream afterwards.
        idle.put(probe);
        let c = idle.take(still_open).expect("an open connection is reused");
        assert!(c.set_read_timeout(Some(Duration::from_millis(1))).is_ok());
        let mut b = [0u8; 1];
        let r = (&c).read(&mut b);
        assert!(
            matches!(&r, Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::TimedOut),
            "the stream stayed blocking with its timeout: {r:?}"
        );
    }

    #[test]
    fn a_connection_idle_too_long_is_closed_not_reused() {
        let (client, _server) = pair();
        let idle = IdleList::new();
        idle.put(client);
        std::thread::sleep(IDLE_REUSE_FOR + Duration::from_millis(50));
        assert!(idle.take(still_open).is_none());
    }

    #[test]
    fn at_most_idle_connections_are_kept() {
        let idle = IdleList::new();
        for _ in 0..IDLE_CONNECTIONS + 3 {
            idle.put(pair());
        }
        let mut n = 0;
        while idle.take(|_| true).is_some() {
            n += 1;
        }
        assert_eq!(n, IDLE_CONNECTIONS);
    }
}
