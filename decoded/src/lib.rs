//! decoded: the decode worker of kvfence.
//!
//! It owns a page pool on a sealed memfd that never leaves the process. For each request
//! kvctld sends `DecodeReserve` (decoded reserves prompt + new-token pages), then `PullKv`
//! with prefill's manifest: a job thread copies the named pages out of the prefill pool
//! (mapped read-only from the `PrefillPool` fd) into the reservation's own pages, verifies
//! them against the manifest's digests ([`libkv::pool::Reservation::verify`], the only way
//! to read KV), and decodes, streaming `Tokens` and a final `Done`. Pages go back to the free
//! list when the job ends, and only then is `Freed` reported.
//!
//! With a TCP prefill worker kvctld sends `PrefillEndpoint` instead of `PrefillPool`: jobs
//! then pull the same pages from prefilld's page server (see `libkv::tcp`), reading them
//! straight into the reservation's pages, and verify them the same way.
//!
//! One mio event loop (shared with prefilld, see `link.rs`) owns the kvctld connection;
//! jobs send their frames back to it over a channel and wake it with a `mio::Waker`.

mod job;
use libkv::link::{self, page_count, pool_error_code, refuse};

use crossbeam::channel::Receiver;
use job::{Job, JobContext, JobEvent, JobPool, PageSource, RdmaSource, TcpSource};
use libkv::config::{Backend, Config, DeadlineDurations};
use libkv::memory::{ForeignPool, HostMemory};
use libkv::model::{ModelError, ReferenceModel};
use libkv::pool::{PagePool, PoolError, PoolOptions, Reservation};
use libkv::proto::{
    DecodeReserve, DecodeReserved, ErrorCode, Freed, Header, Message, PrefillEndpoint, PrefillPool,
    PullKv, RegisterAck, RegisterWorker, Role, Transport,
};
use libkv::rdma::RdmaNode;
use libkv::{Generation, Owner, PageGeometry, RequestId};
use link::{Link, Worker};
use log::{debug, info, warn};
use mio::{Poll, Waker};
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

pub use link::{LinkError, RunOptions, Shutdown};

/// Exit code: stopped cleanly.
pub const EXIT_OK: u8 = 0;
/// Exit code: a runtime failure.
pub const EXIT_RUNTIME: u8 = 1;
/// Exit code: the configuration is invalid or cannot run in this build.
pub const EXIT_CONFIG: u8 = 2;

/// Job threads: pulls and decodes run here, never on the event loop.
pub const JOB_THREADS: usize = 2;

/// Why decoded stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The configured pool backend is not compiled in.
    #[error("backend {backend} is not available in this build")]
    BackendUnavailable { backend: &'static str },
    /// The page geometry cannot run the reference model.
    #[error("the page geometry cannot run the reference model")]
    Model(#[source] ModelError),
    /// Creating the pool's memory failed.
    #[error("creating {bytes} bytes of pool memory")]
    Memory {
        bytes: u64,
        #[source]
        source: io::Error,
    },
    /// Creating the page pool failed.
    #[error("creating the page pool")]
    Pool(#[source] PoolError),
    /// Starting the job threads failed.
    #[error("starting the job threads")]
    Threads(#[source] io::Error),
    /// The event loop failed.
    #[error("event loop")]
    EventLoop(#[from] LinkError),
    /// The configured RDMA device, port or GID cannot be used.
    #[error("opening the RDMA device of [rdma]")]
    Rdma(#[source] libkv::rdma::RdmaError),
}

impl WorkerError {
    /// Whether the error is the configuration's (exit [`EXIT_CONFIG`]) rather than the
    /// system's (exit [`EXIT_RUNTIME`]).
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            WorkerError::BackendUnavailable { .. } | WorkerError::Model(_)
        ) || matches!(self, WorkerError::Rdma(e) if e.is_config())
    }

    /// The documented exit code for this error.
    pub fn exit_code(&self) -> u8 {
        if self.is_config() {
            EXIT_CONFIG
        } else {
            EXIT_RUNTIME
        }
    }
}

pub use libkv::error_chain;

/// Counters reported in every `PoolReport` (names from the request flow). Shared with the
/// job threads.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    frames_received: Arc<AtomicU64>,
    reserves: AtomicU64,
    pulls: AtomicU64,
    pages_pulled: AtomicU64,
    bytes_pulled: AtomicU64,
    verified: AtomicU64,
    verify_failed: AtomicU64,
    tokens_generated: AtomicU64,
    aborts: AtomicU64,
    freed_pages: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> Vec<(String, u64)> {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        [
            ("frames_received", get(&self.frames_received)),
            ("reserves", get(&self.reserves)),
            ("pulls", get(&self.pulls)),
            ("pages_pulled", get(&self.pages_pulled)),
            ("bytes_pulled", get(&self.bytes_pulled)),
            ("verified", get(&self.verified)),
            ("verify_failed", get(&self.verify_failed)),
            ("tokens_generated", get(&self.tokens_generated)),
            ("aborts", get(&self.aborts)),
            ("freed_pages", get(&self.freed_pages)),
        ]
        .into_iter()
        .map(|(n, v)| (n.to_owned(), v))
        .collect()
    }
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// What decoded holds for an owner.
#[derive(Debug)]
enum Entry {
    /// Pages reserved, waiting for `PullKv` until `expires`.
    Reserved {
        res: Reservation,
        max_new_tokens: u32,
        since: Instant,
        expires: Instant,
    },
    /// A job owns the reservation; it reports `Ended` when its pages are free.
    Running { cancel: Arc<AtomicBool> },
}

/// The decode worker's state, driven by the event loop.
#[derive(Debug)]
struct Decode {
    geometry: PageGeometry,
    pool: PagePool,
    counters: Arc<Counters>,
    jobs: JobPool,
    events: Receiver<JobEvent>,
    held: HashMap<Owner, Entry>,
    generation: Option<Generation>,
    limits: Option<(u32, u32)>,
    /// The prefill pages' source, from `PrefillPool` or `PrefillEndpoint`.
    source: Option<Arc<dyn PageSource>>,
    /// The RDMA device with this pool registered, when `[transfer]` says RDMA and the host
    /// has it.
    rdma: Option<Arc<RdmaNode>>,
    /// Incremented at every lost connection; job frames of an older epoch are dropped.
    epoch: u64,
    deadlines: DeadlineDurations,
}

/// Runs decoded until SIGTERM/SIGINT or `opts.shutdown`.
pub fn run(cfg: Config, opts: RunOptions) -> Result<(), WorkerError> {
    if cfg.decode.backend == Backend::Cuda {
        return Err(WorkerError::BackendUnavailable { backend: "cuda" });
    }
    let model = ReferenceModel::new(cfg.geometry).map_err(WorkerError::Model)?;
    let bytes = cfg.decode.pool_bytes(&cfg.geometry);
    // The decode pool's fd never leaves this process: only the pool holds it.
    let memory = HostMemory::new(c"kvfence-decode", bytes)
        .map_err(|source| WorkerError::Memory { bytes, source })?;
    let pool = PagePool::new(
        cfg.geometry,
        cfg.decode.pool_pages,
        Box::new(memory),
        PoolOptions {
            poison: cfg.decode.poison,
            scrub: cfg.decode.scrub,
        },
    )
    .map_err(WorkerError::Pool)?;
    // Registered for local access only: RDMA reads land here, no peer gets a key to it.
    let rdma = libkv::rdma::open_node(&cfg, &pool, false).map_err(WorkerError::Rdma)?;
    let mut transports = vec![Transport::Shm, Transport::Tcp];
    if rdma.is_some() {
        transports.push(Transport::Rdma);
    }

    let poll = Poll::new().map_err(LinkError::Setup)?;
    let waker = Arc::new(Waker::new(poll.registry(), link::WAKER).map_err(LinkError::Setup)?);
    let counters = Arc::new(Counters::default());
    let (events_tx, events) = crossbeam::channel::unbounded();
    let jobs = JobPool::start(
        JOB_THREADS,
        Arc::new(JobContext {
            model,
            counters: Arc::clone(&counters),
            events: events_tx,
            waker: Arc::clone(&waker),
        }),
    )
    .map_err(WorkerError::Threads)?;
    let link = Link::new(
        cfg.control.socket.clone(),
        RegisterWorker {
            role: Role::Decode,
            geometry: cfg.geometry,
            pool_pages: cfg.decode.pool_pages,
            transports,
            endpoint: None,
        },
        None,
        cfg.deadlines.bootstrap(),
        Arc::clone(&counters.frames_received),
    );
    let mut worker = Decode {
        geometry: cfg.geometry,
        pool,
        counters,
        jobs,
        events,
        held: HashMap::new(),
        generation: None,
        limits: None,
        source: None,
        rdma,
        epoch: 0,
        deadlines: cfg.deadlines.as_durations(),
    };
    link::serve(poll, waker, link, &mut worker, &opts)?;
    Ok(())
}

impl Decode {
    /// Refuses an owner of another generation, or one that is not the frame's request.
    fn check_owner(&self, id: RequestId, owner: Owner) -> Result<(), String> {
        link::check_owner(self.generation, id, owner)
    }

    fn report(&self, link: &mut Link) {
        link::send_report(link, &self.pool, self.counters.snapshot());
    }

    /// Reports pages that are back on the free list: the caller dropped the reservation
    /// (no writer: only jobs write, and a job reports `Ended` after dropping its grant).
    fn freed(&self, link: &mut Link, owner: Owner, pages: u32) {
        add(&self.counters.freed_pages, u64::from(pages));
        link.send(owner.request, Freed { owner, pages });
        self.report(link);
    }

    fn reserve(&mut self, link: &mut Link, id: RequestId, m: DecodeReserve) {
        let owner = m.owner;
        if let Err(reason) = self.check_owner(id, owner) {
            return refuse(link, id, ErrorCode::BadRequest, reason);
        }
        if self.held.contains_key(&owner) {
            let reason = format!("duplicate DecodeReserve for {owner}");
            return refuse(link, id, ErrorCode::BadRequest, reason);
        }
        if let Some((max_context, max_new)) = self.limits
            && (m.prompt_tokens > max_context || m.max_new_tokens > max_new)
        {
            let reason = format!(
                "{} prompt tokens + {} new tokens exceed the limits {max_context} + {max_new}",
                m.prompt_tokens, m.max_new_tokens
            );
            refuse(link, id, ErrorCode::BadRequest, reason);
            return self.freed(link, owner, 0);
        }
        let capacity = u64::from(m.prompt_tokens) + u64::from(m.max_new_tokens);
        match self.pool.reserve(owner, m.prompt_tokens, capacity) {
            Ok(res) => {
                let pages = page_count(&res);
                debug!("reserved {pages} pages for {owner}");
                add(&self.counters.reserves, 1);
                let since = Instant::now();
                self.held.insert(
                    owner,
                    Entry::Reserved {
                        res,
                        max_new_tokens: m.max_new_tokens,
                        since,
                        expires: since + self.deadlines.request,
                    },
                );
                link.send(id, DecodeReserved { owner, pages });
                self.report(link);
            }
            Err(e) => {
                let reason = format!("reserving decode pages: {e}");
                refuse(link, id, pool_error_code(&e), reason);
                // One Freed per owner kvctld told us of, even with nothing reserved.
                self.freed(link, owner, 0);
            }
        }
    }

    fn pull(&mut self, link: &mut Link, id: RequestId, m: PullKv) {
        let owner = m.manifest.owner;
        if let Err(reason) = self.check_owner(id, owner) {
            return refuse(link, id, ErrorCode::BadRequest, reason);
        }
        let (res, max_new_tokens, since, expires) = match self.held.remove(&owner) {
            None => {
                let reason = format!("no reservation for {owner}");
                return refuse(link, id, ErrorCode::BadRequest, reason);
            }
            Some(running @ Entry::Running { .. }) => {
                self.held.insert(owner, running);
                let reason = format!("a pull for {owner} is already running");
                return refuse(link, id, ErrorCode::BadRequest, reason);
            }
            Some(Entry::Reserved {
                res,
                max_new_tokens,
                since,
                expires,
            }) => (res, max_new_tokens, since, expires),
        };
        // From here on a refusal ends the request: its pages are dropped and reported.
        let pages = page_count(&res);
        let fail = |this: &Self, link: &mut Link, res: Reservation, code, reason: String| {
            drop(res);
            refuse(link, id, code, reason);
            this.freed(link, owner, pages);
        };
        if m.max_new_tokens > max_new_tokens {
            let reason = format!(
                "PullKv asks for {} new tokens, {max_new_tokens} were reserved",
                m.max_new_tokens
            );
            return fail(self, link, res, ErrorCode::BadRequest, reason);
        }
        let Some(source) = self.source.clone() else {
            let reason = "no prefill pool mapped and no page server known".to_owned();
            return fail(self, link, res, ErrorCode::WorkerLost, reason);
        };
        let cancel = Arc::new(AtomicBool::new(false));
        let job = Job {
            owner,
            res,
            manifest: m.manifest,
            max_new_tokens: m.max_new_tokens,
            cancel: Arc::clone(&cancel),
            since,
            transfer: self.deadlines.transfer,
            decode: self.deadlines.decode,
            request_deadline: expires,
            source,
            epoch: self.epoch,
        };
        add(&self.counters.pulls, 1);
        match self.jobs.submit(job) {
            Ok(()) => {
                debug!("pulling {owner}");
                self.held.insert(owner, Entry::Running { cancel });
            }
            Err(job) => {
                let reason = "job threads are gone".to_owned();
                fail(self, link, job.res, ErrorCode::Internal, reason);
            }
        }
    }

    /// Abort (or Release): cancels a running job (it reports `Ended` when its pages are free)
    /// or drops a reservation at once.
    fn abort(&mut self, link: &mut Link, id: RequestId, owner: Owner, counted: bool) {
        if let Err(reason) = self.check_owner(id, owner) {
            // Abort for an owner this worker cannot hold is ignored (request flow, 8).
            debug!("ignoring Abort/Release for {owner}: {reason}");
            return;
        }
        if counted {
            add(&self.counters.aborts, 1);
        }
        match self.held.remove(&owner) {
            None => debug!("nothing held for {owner}; ignoring"),
            Some(Entry::Running { cancel }) => {
                debug!("cancelling the job of {owner}");
                cancel.store(true, Ordering::Release);
                self.held.insert(owner, Entry::Running { cancel });
            }
            Some(Entry::Reserved { res, .. }) => {
                let pages = page_count(&res);
                drop(res);
                debug!("dropped the reservation of {owner}");
                self.freed(link, owner, pages);
            }
        }
    }

    fn map_prefill_pool(&mut self, link: &mut Link, m: &PrefillPool, fds: &[OwnedFd]) {
        let refused = if m.geometry != self.geometry {
            Some(format!(
                "prefill pool geometry {:?} differs from this worker's {:?}",
                m.geometry, self.geometry
            ))
        } else if let Some(fd) = fds.first() {
            match ForeignPool::map(fd.as_fd(), self.geometry.bytes_per_page(), m.pool_pages) {
                Ok(foreign) => {
                    info!("mapped the prefill pool ({} pages)", m.pool_pages);
                    self.source = Some(Arc::new(foreign));
                    None
                }
                Err(e) => Some(format!("cannot map the prefill pool: {e}")),
            }
        } else {
            Some("PrefillPool without its fd".to_owned())
        };
        if let Some(reason) = refused {
            warn!("{reason}");
            refuse(link, RequestId(0), ErrorCode::BadRequest, reason);
        }
    }

    fn use_page_server(&mut self, link: &mut Link, m: PrefillEndpoint) {
        let refused = if m.geometry != self.geometry {
            Some(format!(
                "prefill pool geometry {:?} differs from this worker's {:?}",
                m.geometry, self.geometry
            ))
        } else {
            match m.endpoint.addr.parse() {
                Ok(addr) => {
                    let page_bytes = self.geometry.bytes_per_page();
                    self.source = Some(match (&self.rdma, m.rdma) {
                        (Some(node), true) => {
                            info!("reading prefill pages from {addr} over RDMA");
                            Arc::new(RdmaSource {
                                addr,
                                token: m.endpoint.token,
                                pool_pages: m.pool_pages,
                                page_bytes,
                                node: Arc::clone(node),
                                idle: std::sync::Mutex::new(Vec::new()),
                            })
                        }
                        _ => {
                            info!("pulling prefill pages from {addr} over TCP");
                            Arc::new(TcpSource {
                                addr,
                                token: m.endpoint.token,
                                pool_pages: m.pool_pages,
                                page_bytes,
                                idle: std::sync::Mutex::new(Vec::new()),
                            })
                        }
                    });
                    None
                }
                Err(e) => Some(format!("page server address {:?}: {e}", m.endpoint.addr)),
            }
        };
        if let Some(reason) = refused {
            warn!("{reason}");
            refuse(link, RequestId(0), ErrorCode::BadRequest, reason);
        }
    }

    /// Forwards one job event: frames of the current connection go to kvctld; an ended job
    /// of the current connection is reported `Freed`.
    fn job_event(&mut self, link: Option<&mut Link>, event: JobEvent) {
        match event {
            JobEvent::Frame { epoch, bytes } if epoch == self.epoch => {
                if let Some(link) = link {
                    link.send_encoded(bytes);
                }
            }
            JobEvent::Ended {
                epoch,
                owner,
                pages,
            } if epoch == self.epoch => {
                if matches!(self.held.get(&owner), Some(Entry::Running { .. })) {
                    self.held.remove(&owner);
                    if let Some(link) = link {
                        self.freed(link, owner, pages);
                    }
                }
            }
            _ => {}
        }
    }

    /// Aborts everything: cancels jobs, drops reservations (reported `Freed` on `link`),
    /// then waits up to the drain deadline for the jobs to end.
    fn settle(&mut self, mut link: Option<&mut Link>) {
        let owners: Vec<Owner> = self.held.keys().copied().collect();
        for owner in owners {
            match self.held.remove(&owner) {
                Some(Entry::Running { cancel }) => {
                    cancel.store(true, Ordering::Release);
                    self.held.insert(owner, Entry::Running { cancel });
                }
                Some(Entry::Reserved { res, .. }) => {
                    let pages = page_count(&res);
                    drop(res);
                    if let Some(link) = link.as_deref_mut() {
                        self.freed(link, owner, pages);
                    }
                }
                None => {}
            }
        }
        let deadline = Instant::now() + self.deadlines.drain;
        while !self.held.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(event) => self.job_event(link.as_deref_mut(), event),
                Err(_) => {
                    warn!(
                        "{} jobs still running after {} ms",
                        self.held.len(),
                        self.deadlines.drain.as_millis()
                    );
                    self.held.clear();
                }
            }
        }
    }
}

impl Worker for Decode {
    fn can_register(&self) -> bool {
        self.held.is_empty() && self.pool.usage().free == self.pool.pages()
    }

    fn on_registered(&mut self, link: &mut Link, ack: &RegisterAck) {
        self.generation = Some(ack.generation);
        self.limits = Some((ack.max_context, ack.max_new_tokens));
        self.report(link);
    }

    fn on_frame(&mut self, link: &mut Link, header: Header, msg: Message, fds: Vec<OwnedFd>) {
        let id = header.request_id;
        match msg {
            Message::DecodeReserve(m) => self.reserve(link, id, m),
            Message::PullKv(m) => self.pull(link, id, m),
            Message::Abort(m) => self.abort(link, id, m.owner, true),
            Message::Release(m) => self.abort(link, id, m.owner, false),
            Message::PrefillPool(m) => self.map_prefill_pool(link, &m, &fds),
            Message::PrefillEndpoint(m) => self.use_page_server(link, m),
            Message::Error(e) => debug!("kvctld reported for {id}: {}: {}", e.code, e.message),
            other => {
                let reason = format!("{:?} is not for a decode worker", other.msg_type());
                refuse(link, id, ErrorCode::BadRequest, reason);
            }
        }
    }

    fn on_lost(&mut self) {
        self.settle(None);
        self.epoch += 1;
        self.generation = None;
        self.limits = None;
        self.source = None;
    }

    fn on_wake(&mut self, link: &mut Link) {
        while let Ok(event) = self.events.try_recv() {
            self.job_event(Some(link), event);
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.held
            .values()
            .filter_map(|e| match e {
                Entry::Reserved { expires, .. } => Some(*expires),
                Entry::Running { .. } => None,
            })
            .min()
    }

    fn expire(&mut self, link: &mut Link, now: Instant) {
        let expired: Vec<Owner> = self
            .held
            .iter()
            .filter(|(_, e)| matches!(e, Entry::Reserved { expires, .. } if *expires <= now))
            .map(|(o, _)| *o)
            .collect();
        for owner in expired {
            if let Some(Entry::Reserved { res, .. }) = self.held.remove(&owner) {
                let pages = page_count(&res);
                drop(res);
                debug!("request deadline passed for {owner} before PullKv");
                self.freed(link, owner, pages);
            }
        }
    }

    fn shutdown(&mut self, link: &mut Link) {
        self.settle(Some(link));
    }
}

#[cfg(test)]
#[path = "../../prefilld/src/testkit.rs"]
mod testkit;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::{Daemon, FakeKvctld, GEN, Peer, WAIT, counter, owner, test_config};
    use libkv::PageId;
    use libkv::model::{ModelRunner, monolithic, tokenize};
    use libkv::proto::{Abort, PrefillDone, PrefillRun, PullDone, Release, Tokens};
    use libkv::verify::{Manifest, page_digest};

    const PROMPT: &[u8] = b"kvfence moves KV pages from prefill to decode, verified";

    fn expect_error(msg: Message, code: ErrorCode) -> String {
        match msg {
            Message::Error(e) if e.code == code => e.message,
            other => panic!("expected Error {code}, got {other:?}"),
        }
    }

    /// A prefill pool written in the test, standing in for prefilld.
    struct FakePrefill {
        pool: PagePool,
        fd: OwnedFd,
        model: ReferenceModel,
        held: Vec<Reservation>,
    }

    impl FakePrefill {
        fn new(cfg: &Config) -> FakePrefill {
            let bytes = cfg.prefill.pool_bytes(&cfg.geometry);
            let memory = HostMemory::new(c"test-prefill", bytes).unwrap();
            let fd = memory.read_only_fd().unwrap();
            let pool = PagePool::new(
                cfg.geometry,
                cfg.prefill.pool_pages,
                Box::new(memory),
                PoolOptions::default(),
            )
            .unwrap();
            FakePrefill {
                pool,
                fd,
                model: ReferenceModel::new(cfg.geometry).unwrap(),
                held: Vec::new(),
            }
        }

        fn prefill(&mut self, owner: Owner, prompt: &[u8]) -> Manifest {
            let tokens = tokenize(prompt);
            let n = u32::try_from(tokens.len()).unwrap();
            let mut res = self.pool.reserve(owner, n, u64::from(n)).unwrap();
            let mut grant = res.grant_write().unwrap();
            self.model.prefill(&tokens, &mut grant).unwrap();
            let digests = (0..grant.pages().len())
                .map(|i| page_digest(grant.page_mut(i).unwrap()))
                .collect();
            let pages = grant.pages().to_vec();
            drop(grant);
            self.held.push(res);
            Manifest {
                owner,
                tokens: n,
                pages,
                digests,
            }
        }

        fn give_pool(&self, peer: &Peer, cfg: &Config) {
            peer.send_fd(
                RequestId(0),
                PrefillPool {
                    geometry: cfg.geometry,
                    pool_pages: cfg.prefill.pool_pages,
                },
                Some(&self.fd),
            );
        }
    }

    /// A decoded registered with a fake kvctld that handed it `prefill`'s pool.
    fn start(
        cfg_edit: impl FnOnce(&mut Config),
    ) -> (FakeKvctld, Config, Daemon, Peer, FakePrefill) {
        let kvctld = FakeKvctld::new();
        let mut cfg = test_config(kvctld.socket.clone());
        cfg_edit(&mut cfg);
        let daemon = Daemon::start(cfg.clone());
        let mut peer = kvctld.accept();
        let (reg, fd) = peer.handshake(&cfg);
        assert_eq!(reg.role, Role::Decode);
        assert!(fd.is_none(), "decode's pool fd never leaves decoded");
        let prefill = FakePrefill::new(&cfg);
        prefill.give_pool(&peer, &cfg);
        (kvctld, cfg, daemon, peer, prefill)
    }

    fn reserve(peer: &mut Peer, request: u64, prompt_tokens: u32, max_new_tokens: u32) -> u32 {
        peer.send(
            RequestId(request),
            DecodeReserve {
                owner: owner(request),
                prompt_tokens,
                max_new_tokens,
            },
        );
        let (h, msg) = peer.next();
        assert_eq!(h.request_id, RequestId(request));
        match msg {
            Message::DecodeReserved(r) if r.owner == owner(request) => r.pages,
            other => panic!("expected DecodeReserved, got {other:?}"),
        }
    }

    /// Reads Freed for `request`, then checks the pool is empty again.
    fn expect_freed(
        peer: &mut Peer,
        cfg: &Config,
        request: u64,
        pages: u32,
    ) -> libkv::proto::PoolReport {
        let (h, msg) = peer.next();
        assert_eq!(h.request_id, RequestId(request));
        assert_eq!(
            msg,
            Message::Freed(Freed {
                owner: owner(request),
                pages
            })
        );
        let report = peer.pool_report();
        assert_eq!(report.free, cfg.decode.pool_pages);
        report
    }

    #[test]
    fn prefilld_and_decoded_reproduce_the_monolithic_output() {
        let kvctld = FakeKvctld::new();
        let cfg = test_config(kvctld.socket.clone());
        let decoded = Daemon::start(cfg.clone());
        let prefill_opts = prefilld::RunOptions {
            handle_signals: false,
            shutdown: prefilld::Shutdown::new(),
        };
        let prefill_stop = prefill_opts.shutdown.clone();
        let prefill_cfg = cfg.clone();
        let (tx, prefill_done) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(prefilld::run(prefill_cfg, prefill_opts).is_ok());
        });

        let (mut a, mut b) = (kvctld.accept(), kvctld.accept());
        let (reg_a, fd_a) = a.handshake(&cfg);
        let (_, fd_b) = b.handshake(&cfg);
        let (mut pre, mut dec, pool_fd) = if reg_a.role == Role::Prefill {
            (a, b, fd_a)
        } else {
            (b, a, fd_b)
        };
        let pool_fd = pool_fd.expect("prefill pool fd");
        dec.send_fd(
            RequestId(0),
            PrefillPool {
                geometry: cfg.geometry,
                pool_pages: cfg.prefill.pool_pages,
            },
            Some(&pool_fd),
        );

        let n = u32::try_from(PROMPT.len()).unwrap();
        let max_new = 20;
        let id = RequestId(11);
        let pages = reserve(&mut dec, 11, n, max_new);
        assert_eq!(
            u64::from(pages),
            cfg.geometry.pages_for_tokens(u64::from(n + max_new))
        );
        pre.send(
            id,
            PrefillRun {
                owner: owner(11),
                prompt: PROMPT.to_vec(),
            },
        );
        let Message::PrefillDone(PrefillDone { manifest }) = pre.next().1 else {
            panic!("expected PrefillDone");
        };
        let prefill_pages = u32::try_from(manifest.pages.len()).unwrap();
        dec.send(
            id,
            PullKv {
                manifest,
                max_new_tokens: max_new,
            },
        );
        assert_eq!(
            dec.next().1,
            Message::PullDone(PullDone { owner: owner(11) })
        );
        pre.send(id, Release { owner: owner(11) });
        let (_, freed) = pre.next();
        assert_eq!(
            freed,
            Message::Freed(Freed {
                owner: owner(11),
                pages: prefill_pages
            })
        );

        let mut tokens = Vec::new();
        let done = loop {
            let (h, msg) = dec.next();
            assert_eq!(h.request_id, id);
            match msg {
                Message::Tokens(Tokens {
                    first_index,
                    tokens: t,
                }) => {
                    assert_eq!(first_index as usize, tokens.len());
                    assert!(t.len() <= job::TOKENS_PER_FRAME);
                    tokens.extend(t);
                }
                Message::Done(d) => break d,
                other => panic!("unexpected {other:?}"),
            }
        };
        let model = ReferenceModel::new(cfg.geometry).unwrap();
        let expected = monolithic(&model, &tokenize(PROMPT), max_new).unwrap();
        assert_eq!(tokens, expected.tokens);
        assert_eq!(done.tokens, max_new);
        assert_eq!(done.signature, expected.signature);
        assert_eq!(done.pages_transferred, prefill_pages);
        assert_eq!(
            done.bytes_transferred,
            u64::from(prefill_pages) * cfg.geometry.bytes_per_page()
        );
        let report = expect_freed(&mut dec, &cfg, 11, pages);
        assert_eq!(counter(&report, "verified"), 1);
        assert_eq!(counter(&report, "pages_pulled"), u64::from(prefill_pages));
        assert_eq!(counter(&report, "tokens_generated"), u64::from(max_new));
        assert_eq!(counter(&report, "freed_pages"), u64::from(pages));

        prefill_stop.request();
        assert!(prefill_done.recv_timeout(WAIT).unwrap());
        decoded.stop().unwrap();
    }

    #[test]
    fn short_manifest_fails_verification_without_tokens() {
        let (_k, cfg, daemon, mut peer, mut prefill) = start(|_| {});
        let n = u32::try_from(PROMPT.len()).unwrap();
        let pages = reserve(&mut peer, 1, n, 8);
        // Prefill of one token fewer than reserved: same page count, fewer tokens.
        let manifest = prefill.prefill(owner(1), &PROMPT[1..]);
        peer.send(
            RequestId(1),
            PullKv {
                manifest,
                max_new_tokens: 8,
            },
        );
        let reason = expect_error(peer.next().1, ErrorCode::VerifyFailed);
        assert!(reason.contains("tokens"), "{reason}");
        // No PullDone, no Tokens: the next frame is Freed.
        let report = expect_freed(&mut peer, &cfg, 1, pages);
        assert_eq!(counter(&report, "verify_failed"), 1);
        assert_eq!(counter(&report, "verified"), 0);
        assert_eq!(counter(&report, "tokens_generated"), 0);

        // A manifest whose digest does not match the pulled bytes fails the same way.
        let pages = reserve(&mut peer, 2, n, 8);
        let mut manifest = prefill.prefill(owner(2), PROMPT);
        manifest.digests[0] ^= 1;
        peer.send(
            RequestId(2),
            PullKv {
                manifest,
                max_new_tokens: 8,
            },
        );
        let reason = expect_error(peer.next().1, ErrorCode::VerifyFailed);
        assert!(reason.contains("digest"), "{reason}");
        let report = expect_freed(&mut peer, &cfg, 2, pages);
        assert_eq!(counter(&report, "verify_failed"), 2);
        daemon.stop().unwrap();
    }

    #[test]
    fn manifest_naming_pages_outside_the_prefill_pool_is_refused() {
        let (_k, cfg, daemon, mut peer, mut prefill) = start(|_| {});
        let n = u32::try_from(PROMPT.len()).unwrap();
        let pages = reserve(&mut peer, 1, n, 8);
        let mut manifest = prefill.prefill(owner(1), PROMPT);
        manifest.pages[1] = PageId(cfg.prefill.pool_pages);
        peer.send(
            RequestId(1),
            PullKv {
                manifest: manifest.clone(),
                max_new_tokens: 8,
            },
        );
        let reason = expect_error(peer.next().1, ErrorCode::BadRequest);
        assert!(reason.contains("outside the prefill pool"), "{reason}");
        let report = expect_freed(&mut peer, &cfg, 1, pages);
        assert_eq!(counter(&report, "pages_pulled"), 0);

        // More pages than the reservation's prompt pages.
        let pages = reserve(&mut peer, 2, 1, 8);
        let mut manifest = prefill.prefill(owner(2), PROMPT);
        manifest.owner = owner(2);
        peer.send(
            RequestId(2),
            PullKv {
                manifest,
                max_new_tokens: 8,
            },
        );
        expect_error(peer.next().1, ErrorCode::BadRequest);
        expect_freed(&mut peer, &cfg, 2, pages);
        daemon.stop().unwrap();
    }

    #[test]
    fn untrusted_frames_get_errors_and_serving_continues() {
        let (_k, cfg, daemon, mut peer, mut prefill) = start(|_| {});
        let n = u32::try_from(PROMPT.len()).unwrap();
        // PullKv for an owner never reserved.
        let manifest = prefill.prefill(owner(5), PROMPT);
        peer.send(
            RequestId(5),
            PullKv {
                manifest: manifest.clone(),
                max_new_tokens: 4,
            },
        );
        let reason = expect_error(peer.next().1, ErrorCode::BadRequest);
        assert!(reason.contains("no reservation"), "{reason}");
        // Another generation.
        let stale = Owner {
            request: RequestId(6),
            generation: Generation(GEN.0 + 1),
        };
        peer.send(
            RequestId(6),
            DecodeReserve {
                owner: stale,
                prompt_tokens: n,
                max_new_tokens: 4,
            },
        );
        expect_error(peer.next().1, ErrorCode::BadRequest);
        // Over the limits from RegisterAck.
        peer.send(
            RequestId(7),
            DecodeReserve {
                owner: owner(7),
                prompt_tokens: cfg.limits.max_context + 1,
                max_new_tokens: 4,
            },
        );
        expect_error(peer.next().1, ErrorCode::BadRequest);
        // Nothing was reserved, and kvctld hears so: one Freed of 0 pages.
        expect_freed(&mut peer, &cfg, 7, 0);
        // A duplicate DecodeReserve leaves the first reservation in place.
        let pages = reserve(&mut peer, 5, n, 4);
        peer.send(
            RequestId(5),
            DecodeReserve {
                owner: owner(5),
                prompt_tokens: n,
                max_new_tokens: 4,
            },
        );
        let reason = expect_error(peer.next().1, ErrorCode::BadRequest);
        assert!(reason.contains("duplicate"), "{reason}");
        // A message for the other role.
        peer.send(
            RequestId(5),
            PrefillRun {
                owner: owner(5),
                prompt: PROMPT.to_vec(),
            },
        );
        expect_error(peer.next().1, ErrorCode::BadRequest);
        // The first reservation still serves its request.
        peer.send(
            RequestId(5),
            PullKv {
                manifest,
                max_new_tokens: 4,
            },
        );
        assert!(matches!(peer.next().1, Message::PullDone(_)));
        assert!(matches!(peer.next().1, Message::Tokens(t) if t.tokens.len() == 4));
        assert!(matches!(peer.next().1, Message::Done(_)));
        let report = expect_freed(&mut peer, &cfg, 5, pages);
        assert_eq!(counter(&report, "reserves"), 1);
        daemon.stop().unwrap();
    }

    #[test]
    fn abort_frees_reserved_and_running_requests_once() {
        let (_k, cfg, daemon, mut peer, mut prefill) = start(|_| {});
        let abort = |request| Abort {
            owner: owner(request),
            code: ErrorCode::Timeout,
            reason: "test".into(),
        };
        let n = u32::try_from(PROMPT.len()).unwrap();
        // Aborted while only reserved.
        let pages = reserve(&mut peer, 1, n, 8);
        peer.send(RequestId(1), abort(1));
        expect_freed(&mut peer, &cfg, 1, pages);
        // Aborted while its job runs (or just after it finished): one Freed either way.
        let max_new = cfg.limits.max_new_tokens;
        let pages = reserve(&mut peer, 2, n, max_new);
        let manifest = prefill.prefill(owner(2), PROMPT);
        peer.send(
            RequestId(2),
            PullKv {
                manifest,
                max_new_tokens: max_new,
            },
        );
        peer.send(RequestId(2), abort(2));
        peer.send(RequestId(2), abort(2));
        let report = loop {
            let (h, msg) = peer.next();
            assert_eq!(h.request_id, RequestId(2));
            match msg {
                Message::PullDone(_) | Message::Tokens(_) | Message::Done(_) => {}
                Message::Freed(f) => {
                    assert_eq!(
                        f,
                        Freed {
                            owner: owner(2),
                            pages
                        }
                    );
                    break peer.pool_report();
                }
                other => panic!("unexpected {other:?}"),
            }
        };
        assert_eq!(report.free, cfg.decode.pool_pages);
        // Nothing more for request 2: the next frame answers the next request.
        let pages = reserve(&mut peer, 3, n, 8);
        peer.send(RequestId(3), Release { owner: owner(3) });
        let report = expect_freed(&mut peer, &cfg, 3, pages);
        // Counted here, not at request 2's Freed: the job may end (and its Freed and report
        // go out) before the loop reads the second Abort; frames are handled in order, so
        // both were by the time request 3 is answered.
        assert_eq!(counter(&report, "aborts"), 3);
        daemon.stop().unwrap();
    }

    #[test]
    fn lost_connection_drops_everything_and_reregisters_empty() {
        let (kvctld, cfg, daemon, mut peer, _prefill) = start(|_| {});
        let n = u32::try_from(PROMPT.len()).unwrap();
        reserve(&mut peer, 1, n, 8);
        drop(peer);
        let mut peer = kvctld.accept();
        // handshake() checks the pool is all free again.
        peer.handshake(&cfg);
        // No prefill pool is mapped on the new connection.
        reserve(&mut peer, 2, n, 8);
        let manifest = FakePrefill::new(&cfg).prefill(owner(2), PROMPT);
        peer.send(
            RequestId(2),
            PullKv {
                manifest,
                max_new_tokens: 8,
            },
        );
        expect_error(peer.next().1, ErrorCode::WorkerLost);
        daemon.stop().unwrap();
    }

    #[test]
    fn unpulled_reservation_expires_and_stop_frees_the_rest() {
        let (_k, cfg, daemon, mut peer, _prefill) = start(|cfg| {
            cfg.deadlines.bootstrap = 100;
            cfg.deadlines.transfer = 100;
            cfg.deadlines.request = 300;
        });
        let n = u32::try_from(PROMPT.len()).unwrap();
        let started = Instant::now();
        let pages = reserve(&mut peer, 1, n, 8);
        expect_freed(&mut peer, &cfg, 1, pages);
        assert!(started.elapsed() >= std::time::Duration::from_millis(300));
        // Held at stop: reported freed before the connection closes.
        let pages = reserve(&mut peer, 2, n, 8);
        daemon.stop().unwrap();
        expect_freed(&mut peer, &cfg, 2, pages);
        peer.expect_closed();
    }

    #[test]
    fn cuda_backend_is_a_config_error() {
        let mut cfg = test_config("/nonexistent/kvctld.sock".into());
        cfg.decode.backend = Backend::Cuda;
        let err = run(cfg, RunOptions::default()).unwrap_err();
        assert_eq!(err.exit_code(), EXIT_CONFIG);
        assert_eq!(
            error_chain(&err),
            "backend cuda is not available in this build"
        );
    }
}
