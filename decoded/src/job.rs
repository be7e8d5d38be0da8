//! A request's job: its pull and verification on the pull threads, then its decode on the
//! batcher thread ([`crate::batch`]).
//!
//! A job owns its request's [`Reservation`] and a cancel flag. `Decode` (in `lib.rs`) hands
//! it to [`JobPool::submit`], and one of [`PULL_THREADS`](crate::PULL_THREADS) pull threads
//! copies the manifest's pages from the prefill worker's [`PageSource`] (its mapped pool, or
//! its page server over TCP or RDMA) into the reservation's own pages, then verifies them.
//! Pulls run on threads of their own, so a pull never waits behind a decode: the transfer
//! deadline measures the transfer. The verified KV ([`Decoding`]) then goes to the batcher,
//! which decodes up to `[decode] max_batch` requests together, one model step over all of
//! them at a time; a request waits there for a slot at most until its request deadline (and
//! then fails saying it waited for a decode batch slot).
//!
//! Both stages check the cancel flag and the deadlines between pages and between decode
//! steps, send their frames (already encoded) back to the event loop over a channel and wake
//! it, and end the job with [`JobEvent::Ended`] once everything it held is dropped, so the
//! pages are back on the free list when the loop reports them `Freed`.

use crate::Counters;
use crate::batch::{self, Decoding};
use crossbeam::channel::{Receiver, Sender};
use libkv::Owner;
use libkv::RequestId;
use libkv::memory::ForeignPool;
use libkv::model::ModelRunner;
use libkv::pool::{Reservation, WriteGrant};
use libkv::proto::Sampling;
use libkv::proto::TOKEN_BYTES;
use libkv::proto::{Error, ErrorCode, Message, PageRequest, PullDone, RdmaReadDone};
use libkv::rdma::{ClientSession, RdmaNode};
use libkv::tcp;
use libkv::verify::{Manifest, VerifyError};
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

/// The job threads: pull threads fed by [`JobPool::submit`], and the batcher fed by the
/// pull threads with what they verified. Dropping it closes the pull channel and joins the
/// pull threads (each finishes its current pull first), whose senders closing ends the
/// batcher once every request it holds is over; it is joined too.
#[derive(Debug)]
pub(crate) struct JobPool {
    tx: Option<Sender<Job>>,
    pullers: Vec<JoinHandle<()>>,
    batcher: Option<JoinHandle<()>>,
}

impl JobPool {
    /// `pull_threads` pull threads and one batcher decoding up to `max_batch` requests
    /// together.
    pub(crate) fn start(
        pull_threads: usize,
        max_batch: usize,
        ctx: Arc<JobContext>,
    ) -> io::Result<JobPool> {
        let (tx, rx) = crossbeam::channel::unbounded::<Job>();
        let (decode_tx, decode_rx) = crossbeam::channel::unbounded::<Decoding>();
        let mut pool = JobPool {
            tx: Some(tx),
            pullers: Vec::with_capacity(pull_threads),
            batcher: None,
        };
        let batch_ctx = Arc::clone(&ctx);
        pool.batcher = Some(
            std::thread::Builder::new()
                .name("decoded-batch".into())
                .spawn(move || batch::run(&batch_ctx, max_batch, &decode_rx))?,
        );
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
        if let Some(t) = self.batcher.take() {
            let _ = t.join();
        }
    }
}

/// Why a job stopped early.
#[derive(Debug)]
pub(crate) enum Stop {
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

pub(crate) fn failed(code: ErrorCode, message: String) -> Stop {
    Stop::Failed { code, message }
}

/// What a stage sends about its job: frames for kvctld, encoded, through `ctx`.
pub(crate) fn emitter(ctx: &JobContext, owner: Owner, epoch: u64) -> impl Fn(Message) + '_ {
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
pub(crate) fn end(
    ctx: &JobContext,
    owner: Owner,
    epoch: u64,
    pages: u32,
    result: Result<(), Stop>,
) {
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
/// batcher (or end the job here).
fn run_pull(ctx: &JobContext, job: Job, decoders: &Sender<Decoding>) {
    let (owner, epoch) = (job.owner, job.epoch);
    let pages = u32::try_from(job.res.pages().len()).unwrap_or(u32::MAX);
    // `pull_and_verify` consumes the job: on failure its grant and reservation are dropped
    // (pages back on the free list) before `Ended` is sent.
    let result = match pull_and_verify(ctx, job, &emitter(ctx, owner, epoch)) {
        Ok(d) => match decoders.send(d) {
            Ok(()) => return,
            // The batcher is gone (stopping): the job ends with its pages.
            Err(e) => {
                drop(e.into_inner());
                Err(Stop::Cancelled)
            }
        },
        Err(stop) => Err(stop),
    };
    end(ctx, owner, epoch, pages, result);
}

/// `Err` when the job was cancelled or `deadline` passed (`what` says which stage).
pub(crate) fn check(
    cancel: &AtomicBool,
    owner: Owner,
    deadline: Instant,
    what: &str,
) -> Result<(), Stop> {
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

/// `d` in whole microseconds, for the time counters.
pub(crate) fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// What the job tests share: a model that records every batched step, and a job pool over
/// a prefill pool written in the test.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use libkv::PageGeometry;
    use libkv::model::{
        BatchStep, KvCache, ModelError, Output, PageWrite, ReferenceModel, monolithic_paged,
        tokenize,
    };
    use libkv::pool::{PagePool, PoolOptions};
    use libkv::proto::Done;
    use libkv::testkit::owner;
    use libkv::verify::page_digest;
    use std::collections::HashMap;

    /// The reference model, instrumented: every `sample_batch` call is recorded (the
    /// `(prompt_len, step)` of each request in it) and takes `step` of time (one batched
    /// forward, however many requests it steps); optionally it stops at a token, and fails
    /// one request (by prompt length) at one step.
    #[derive(Debug)]
    pub(crate) struct Probe {
        pub inner: ReferenceModel,
        pub step: Duration,
        pub stop: Option<u32>,
        pub fail: Option<(u32, u32)>,
        /// Panics in the step of this request (by prompt length) and step.
        pub panic: Option<(u32, u32)>,
        pub calls: Mutex<Vec<Vec<(u32, u32)>>>,
    }

    impl Probe {
        pub(crate) fn new(step: Duration) -> Probe {
            let g = libkv::testkit::test_config("/nonexistent".into()).geometry;
            Probe {
                inner: ReferenceModel::new(g).unwrap(),
                step,
                stop: None,
                fail: None,
                panic: None,
                calls: Mutex::new(Vec::new()),
            }
        }

        /// Every call so far.
        pub(crate) fn calls(&self) -> Vec<Vec<(u32, u32)>> {
            self.calls.lock().unwrap().clone()
        }
    }

    impl ModelRunner for Probe {
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
            if self.fail == Some((prompt_len, step)) {
                return Err(ModelError::Failed(format!("injected at step {step}")));
            }
            self.inner.step(kv, input, step, prompt_len)
        }
        fn sample_batch(&self, batch: &mut [BatchStep<'_>]) -> Vec<Result<u32, ModelError>> {
            let seen: Vec<(u32, u32)> = batch.iter().map(|b| (b.prompt_len, b.step)).collect();
            let panics = self.panic.is_some_and(|p| seen.contains(&p));
            self.calls.lock().unwrap().push(seen);
            assert!(!panics, "injected panic");
            std::thread::sleep(self.step);
            batch
                .iter_mut()
                .map(|b| self.sample(&mut *b.kv, b.input, b.step, b.prompt_len, b.sampling))
                .collect()
        }
        fn is_stop(&self, token: u32) -> bool {
            self.stop == Some(token)
        }
    }

    /// Something a job sent.
    #[derive(Debug)]
    pub(crate) enum Seen {
        Frame(u64, Message),
        Ended(u64),
    }

    /// One request as its frames told it.
    #[derive(Debug, Default)]
    pub(crate) struct Told {
        pub pulled: bool,
        pub tokens: Vec<u32>,
        pub frames: Vec<Vec<u32>>,
        pub done: Option<Done>,
        pub error: Option<Error>,
        pub ended: bool,
    }

    /// A job pool on a [`Probe`], pulling from a prefill pool the test writes.
    pub(crate) struct Harness {
        pub model: Arc<Probe>,
        prefill: PagePool,
        pub decode: PagePool,
        source: Arc<dyn PageSource>,
        pub jobs: Option<JobPool>,
        events: Receiver<JobEvent>,
        held: Vec<Reservation>,
        pub cancels: HashMap<u64, Arc<AtomicBool>>,
        prompts: HashMap<u64, (Vec<u32>, u32)>,
        /// Pages each request's decode reservation holds until it ends.
        holding: HashMap<u64, u32>,
        pub seen: Vec<Seen>,
    }

    impl Harness {
        /// A pool of 2 pull threads and a batcher of `max_batch` on `model`.
        pub(crate) fn new(model: Probe, max_batch: usize) -> Harness {
            let g = *model.geometry();
            let model = Arc::new(model);
            let prefill = PagePool::host(c"jobtest-prefill", g, 256, PoolOptions::default());
            let prefill = prefill.unwrap();
            let decode = PagePool::host(c"jobtest-decode", g, 512, PoolOptions::default());
            let decode = decode.unwrap();
            let fd = prefill.memory().share_fd().unwrap();
            let source: Arc<dyn PageSource> =
                Arc::new(ForeignPool::map(fd, g.bytes_per_page(), 256).unwrap());
            let poll = mio::Poll::new().unwrap();
            let waker = Arc::new(Waker::new(poll.registry(), mio::Token(0)).unwrap());
            let (events_tx, events) = crossbeam::channel::unbounded();
            let jobs = JobPool::start(
                2,
                max_batch,
                Arc::new(JobContext {
                    model: Arc::clone(&model) as Arc<dyn ModelRunner>,
                    counters: Arc::new(Counters::default()),
                    events: events_tx,
                    waker,
                }),
            )
            .unwrap();
            Harness {
                model,
                prefill,
                decode,
                source,
                jobs: Some(jobs),
                events,
                held: Vec::new(),
                cancels: HashMap::new(),
                prompts: HashMap::new(),
                holding: HashMap::new(),
                seen: Vec::new(),
            }
        }

        /// Prefills `prompt` for request `r` and submits its job (request deadline 60 s).
        pub(crate) fn submit(&mut self, r: u64, prompt: &[u8], max_new: u32) {
            self.submit_until(r, prompt, max_new, Duration::from_secs(60));
        }

        /// [`Harness::submit`] with a request deadline `deadline` from now.
        pub(crate) fn submit_until(
            &mut self,
            r: u64,
            prompt: &[u8],
            max_new: u32,
            deadline: Duration,
        ) {
            let prompt = tokenize(prompt);
            let n = u32::try_from(prompt.len()).unwrap();
            let mut pre = self.prefill.reserve(owner(r), n, u64::from(n)).unwrap();
            let mut grant = pre.grant_write().unwrap();
            self.model.inner.prefill(&prompt, &mut grant).unwrap();
            let digests = (0..grant.pages().len())
                .map(|i| page_digest(grant.page_mut(i).unwrap()))
                .collect();
            let pages = grant.pages().to_vec();
            drop(grant);
            self.held.push(pre);
            let res = self
                .decode
                .reserve(owner(r), n, u64::from(n + max_new))
                .unwrap();
            self.holding
                .insert(r, u32::try_from(res.pages().len()).unwrap());
            let cancel = Arc::new(AtomicBool::new(false));
            self.cancels.insert(r, Arc::clone(&cancel));
            let job = Job {
                owner: owner(r),
                res,
                manifest: Manifest {
                    owner: owner(r),
                    tokens: n,
                    pages,
                    digests,
                },
                max_new_tokens: max_new,
                last_token: *prompt.last().unwrap(),
                sampling: Sampling::GREEDY,
                cancel,
                since: Instant::now(),
                transfer: Duration::from_secs(1),
                decode: Duration::from_secs(60),
                request_deadline: Instant::now() + deadline,
                source: Arc::clone(&self.source),
                epoch: 1,
            };
            self.prompts.insert(r, (prompt, max_new));
            self.jobs.as_ref().unwrap().submit(job).unwrap();
        }

        /// Waits (at most 30 s) for the next thing a job sends, and keeps it in `seen`. At an
        /// `Ended`, checks that the job's pages are back on the free list already.
        pub(crate) fn next(&mut self) -> Option<&Seen> {
            let event = self.events.recv_timeout(Duration::from_secs(30)).ok()?;
            let seen = match event {
                JobEvent::Frame { bytes, .. } => {
                    let (h, m) = libkv::proto::decode_frame(&bytes, 0).expect("frame");
                    Seen::Frame(h.request_id.0, m)
                }
                JobEvent::Ended { owner, pages, .. } => {
                    let r = owner.request.0;
                    assert_eq!(Some(pages), self.holding.remove(&r), "pages of {r}");
                    let still: u32 = self.holding.values().sum();
                    let free = self.decode.usage().free;
                    assert!(
                        free >= self.decode.pages() - still,
                        "{r} ended with its pages still held: {free} free, {still} held by \
                         the others"
                    );
                    Seen::Ended(r)
                }
            };
            self.seen.push(seen);
            self.seen.last()
        }

        /// Waits until `until` holds of what was seen so far, at most 30 s.
        pub(crate) fn wait_for(&mut self, until: impl Fn(&HashMap<u64, Told>) -> bool) {
            let begun = Instant::now();
            while !until(&self.told()) {
                assert!(
                    begun.elapsed() < Duration::from_secs(30),
                    "not seen in 30 s: {:?}",
                    self.seen
                );
                assert!(
                    self.next().is_some(),
                    "no job event in 30 s: {:?}",
                    self.seen
                );
            }
        }

        /// Waits until every request submitted has ended.
        pub(crate) fn wait_all_ended(&mut self) -> HashMap<u64, Told> {
            let all: Vec<u64> = self.prompts.keys().copied().collect();
            self.wait_for(|t| all.iter().all(|r| t.get(r).is_some_and(|t| t.ended)));
            self.told()
        }

        /// Every request's frames, in order, checked for sequence: `PullDone` first, the
        /// first token alone, each frame's `first_index` the count of tokens before it, at
        /// most [`batch::TOKENS_PER_FRAME`] per frame, nothing after `Done` or `Error`.
        pub(crate) fn told(&self) -> HashMap<u64, Told> {
            let mut told: HashMap<u64, Told> = HashMap::new();
            for s in &self.seen {
                let (r, m) = match s {
                    Seen::Frame(r, m) => (*r, m),
                    Seen::Ended(r) => {
                        told.entry(*r).or_default().ended = true;
                        continue;
                    }
                };
                let t = told.entry(r).or_default();
                assert!(
                    t.done.is_none() && t.error.is_none(),
                    "{r}: {m:?} after its end"
                );
                assert!(!t.ended, "{r}: {m:?} after Ended");
                match m {
                    Message::PullDone(_) => t.pulled = true,
                    Message::Tokens(f) => {
                        assert!(t.pulled, "{r}: tokens before PullDone");
                        assert_eq!(f.first_index as usize, t.tokens.len(), "{r}");
                        assert!(!f.tokens.is_empty() && f.tokens.len() <= batch::TOKENS_PER_FRAME);
                        if t.frames.is_empty() {
                            assert_eq!(f.tokens.len(), 1, "{r}: the first token goes alone");
                        }
                        t.tokens.extend(&f.tokens);
                        t.frames.push(f.tokens.clone());
                    }
                    Message::Done(d) => t.done = Some(d.clone()),
                    Message::Error(e) => t.error = Some(e.clone()),
                    other => panic!("{r}: unexpected {other:?}"),
                }
            }
            told
        }

        /// What decoding request `r` alone gives: `decode_with` over the same model.
        pub(crate) fn expected(&self, r: u64) -> Output {
            let (prompt, max_new) = &self.prompts[&r];
            monolithic_paged(self.model.as_ref(), prompt, *max_new, &Sampling::GREEDY).unwrap()
        }

        /// Fails unless request `r` finished with exactly the output of decoding it alone.
        pub(crate) fn assert_alone_output(&self, told: &HashMap<u64, Told>, r: u64) {
            let t = &told[&r];
            let want = self.expected(r);
            let done = t
                .done
                .as_ref()
                .unwrap_or_else(|| panic!("{r} not done: {t:?}"));
            assert_eq!(t.tokens, want.tokens, "request {r}");
            assert_eq!(done.tokens as usize, want.tokens.len(), "request {r}");
            assert_eq!(done.signature, want.signature, "request {r}");
            assert!(t.error.is_none() && t.ended, "{r}: {t:?}");
        }
    }

    impl Drop for Harness {
        fn drop(&mut self) {
            drop(self.jobs.take());
            self.held.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{Harness, Probe};
    use super::*;
    use std::io::Read as _;
    use std::net::TcpListener;

    #[test]
    fn a_pull_does_not_wait_for_the_decodes_that_hold_every_batch_slot() {
        // Two decodes of 100 steps (20 ms each: 2 s) take both batch slots; the third's
        // pull must not wait for them: it is done, within its 1 s transfer deadline, while
        // they still decode, and its decode follows once a slot is free.
        let mut h = Harness::new(Probe::new(Duration::from_millis(20)), 2);
        h.submit(1, b"request 1 of the queueing test", 100);
        h.submit(2, b"request 2 of the queueing test!", 100);
        h.wait_for(|t| {
            [1, 2]
                .iter()
                .all(|r| t.get(r).is_some_and(|t| !t.tokens.is_empty()))
        });
        h.submit(3, b"request 3, short", 4);
        h.wait_for(|t| t.get(&3).is_some_and(|t| t.pulled));
        let told = h.told();
        assert!(
            told[&1].done.is_none() && told[&2].done.is_none(),
            "the third pull waited for a decode to finish: {:?}",
            h.seen
        );
        let told = h.wait_all_ended();
        for r in 1..=3 {
            h.assert_alone_output(&told, r);
        }
        assert!(
            h.model.calls().iter().all(|c| c.len() <= 2),
            "more than max_batch stepped at once"
        );
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
