//! Pull, verify and decode jobs, run on a small fixed pool of threads.
//!
//! A job owns its request's [`Reservation`] and a cancel flag. It checks the flag and its
//! deadline between pages and between decode steps, sends its frames (already encoded) back
//! to the event loop over a channel and wakes it, and ends with [`JobEvent::Ended`] once
//! everything it held is dropped, so the pages are back on the free list when the loop
//! reports them `Freed`.

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

/// Idle connections kept per page server: one per job thread, the most that can be busy on
/// one source at once, so a source never holds more than that many open connections idle.
const IDLE_CONNECTIONS: usize = crate::JOB_THREADS;
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

/// A fixed pool of job threads fed by a channel. Dropping it closes the channel and joins
/// the threads (each finishes its current job first).
#[derive(Debug)]
pub(crate) struct JobPool {
    tx: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl JobPool {
    pub(crate) fn start(threads: usize, ctx: Arc<JobContext>) -> io::Result<JobPool> {
        let (tx, rx) = crossbeam::channel::unbounded::<Job>();
        let mut pool = JobPool {
            tx: Some(tx),
            threads: Vec::with_capacity(threads),
        };
        for i in 0..threads {
            let (rx, ctx): (Receiver<Job>, _) = (rx.clone(), Arc::clone(&ctx));
            let handle = std::thread::Builder::new()
                .name(format!("decoded-job-{i}"))
                .spawn(move || {
                    for job in rx {
                        run_job(&ctx, job);
                    }
                })?;
            pool.threads.push(handle);
        }
        Ok(pool)
    }

    /// Queues a job; gives it back if the threads are gone.
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
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
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

fn run_job(ctx: &JobContext, job: Job) {
    let (owner, epoch) = (job.owner, job.epoch);
    let pages = u32::try_from(job.res.pages().len()).unwrap_or(u32::MAX);
    let emit = |msg: Message| match msg.encode(owner.request) {
        Ok(bytes) => {
            let _ = ctx.events.send(JobEvent::Frame { epoch, bytes });
            let _ = ctx.waker.wake();
        }
        Err(e) => debug!("cannot encode a frame for {owner}: {e}"),
    };
    // `execute` consumes the job: its grant, reservation and verified pages are all dropped
    // (pages back on the free list) before `Ended` is sent.
    match execute(ctx, job, &emit) {
        Ok(()) => debug!("{owner} done"),
        Err(Stop::Cancelled) => debug!("{owner} cancelled"),
        Err(Stop::Failed { code, message }) => {
            debug!("{owner} failed: {code}: {message}");
            emit(Message::from(Error {
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

fn execute(ctx: &JobContext, job: Job, emit: &dyn Fn(Message)) -> Result<(), Stop> {
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
        ..
    } = job;
    let check = |deadline: Instant, what: &str| {
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
    };
    let counters = &ctx.counters;
    let pull_deadline = (Instant::now() + transfer).min(request_deadline);
    check(pull_deadline, "pull")?;

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
        let keep_going = || check(pull_deadline, "pull").is_ok();
        let pull_start = Instant::now();
        let pulled = source.pull(&manifest, &mut grant, &keep_going);
        add(&counters.pull_us, micros(pull_start.elapsed()));
        match pulled {
            Ok(()) => {}
            // Stopped: say why (cancelled or past the deadline).
            Err(None) => {
                check(pull_deadline, "pull")?;
                return Err(Stop::Cancelled);
            }
            Err(Some((code, message))) => {
                // A cancel or a deadline may be why the source failed; they take precedence.
                check(pull_deadline, "pull")?;
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
    let mut kv = match verified {
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

    let decode_deadline = (Instant::now() + decode).min(request_deadline);
    let model: &dyn ModelRunner = ctx.model.as_ref();
    let mut batch = Vec::with_capacity(TOKENS_PER_FRAME);
    let mut first_index = 0u32;
    let mut last_frame = Instant::now();
    check(decode_deadline, "decode")?;
    let output = libkv::model::decode_with(
        model,
        &mut kv,
        manifest.tokens,
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
            check(decode_deadline, "decode")
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
    let signature = output.signature;
    let pages = u32::try_from(manifest.pages.len()).unwrap_or(u32::MAX);
    emit(
        Done {
            tokens: u32::try_from(output.tokens.len()).unwrap_or(u32::MAX),
            signature,
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
    use std::io::Read as _;
    use std::net::TcpListener;

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
