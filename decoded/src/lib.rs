//! decoded: the decode worker of kvfence.
//!
//! It owns a page pool on a sealed memfd that never leaves the process. For each request
//! kvctld sends `DecodeReserve` (decoded reserves prompt + new-token pages), then `PullKv`
//! with prefill's manifest and the id of the prefill worker that holds the pages: a pull thread
//! copies the named pages out of that worker's pool into the reservation's own pages and
//! verifies them against the manifest's digests ([`libkv::pool::Reservation::verify`], the
//! only way to read KV); the batcher then decodes it together with the other verified
//! requests, up to `[decode] max_batch` at a time (continuous batching, `batch.rs`),
//! streaming `Tokens` and a final `Done`. Pages go back to the free list when the job ends,
//! and only then is `Freed` reported.
//!
//! kvctld may pair a decode worker with many prefill workers. It tells decoded of each one
//! under its worker id: `PrefillPool` (shared memory: the pool's read-only memfd, mapped
//! here) or `PrefillEndpoint` (TCP or RDMA: prefilld's page server, see `libkv::tcp`, read
//! straight into the reservation's pages), and `PrefillGone` when it is gone. A new one
//! under a known id replaces the old source (that worker restarted). A `PullKv` names its
//! source; decoded pulls from no pool or endpoint kvctld did not give it, and a pull naming
//! an unknown one fails with `WorkerLost`. Jobs already running keep the source they started
//! with until they end; a lost kvctld connection forgets every source.
//!
//! One mio event loop ([`libkv::worker::serve`], shared with prefilld) owns the kvctld
//! connection; jobs send their frames back to it over a channel and wake it with a
//! `mio::Waker`.

mod batch;
mod job;

use crossbeam::channel::Receiver;
use job::{Job, JobContext, JobEvent, JobPool, PageSource, RdmaSource, TcpSource};
use libkv::config::{Config, DeadlineDurations, Side};
use libkv::memory::ForeignPool;
use libkv::pool::{PagePool, Reservation};
use libkv::proto::{
    DecodeReserve, DecodeReserved, ErrorCode, Freed, Header, Message, PrefillEndpoint, PrefillPool,
    PullKv, RegisterAck, Transport,
};
use libkv::rdma::RdmaNode;
use libkv::worker::{self, Link, Load, Startup, Worker, add, page_count, pool_error_code, refuse};
use libkv::{Generation, Owner, PageGeometry, RequestId};
use log::{debug, info, warn};
use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

pub use libkv::worker::{RunOptions, Shutdown, WorkerError};

/// Pull threads: pulls and verification run here, never on the event loop, and never
/// behind a decode. Decoding runs on one more thread, the batcher, which steps up to
/// `[decode] max_batch` verified requests together.
pub const PULL_THREADS: usize = 2;

libkv::worker_counters! {
    /// Counters reported in every `PoolReport`, after the link's `frames_received`. Shared
    /// with the job threads.
    pub(crate) struct Counters {
        reserves,
        pulls,
        pages_pulled,
        bytes_pulled,
        verified,
        verify_failed,
        /// Verification failures by reason (they add up to `verify_failed`): the manifest's
        /// tokens, pages or digests do not cover the reservation; a page is not the request's
        /// or not in the state to be read; a writer may still touch the pages; a digest
        /// differs.
        verify_failed_coverage,
        verify_failed_ownership,
        verify_failed_writer,
        verify_failed_digest,
        tokens_generated,
        aborts,
        freed_pages,
        /// Microseconds spent pulling pages, and verifying them, over all requests: two
        /// readings give the split of a transfer (`kvttftbench`).
        pull_us,
        verify_us,
        /// Time verified requests waited for a decode batch slot (from verified to their
        /// first step, or to leaving without one).
        decode_wait_us,
        /// Batched decode steps (one `sample_batch` call each) and the requests they
        /// stepped: `decode_batch_requests / decode_batch_steps` is the mean batch size.
        decode_batch_steps,
        decode_batch_requests,
        /// Microseconds spent in those steps: `decode_step_us / decode_batch_steps` is the
        /// mean time of one step.
        decode_step_us,
    }
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
    /// The prefill pages' sources by prefill worker id, from `PrefillPool` or
    /// `PrefillEndpoint`; only these are ever pulled from.
    sources: HashMap<String, Arc<dyn PageSource>>,
    /// The RDMA device with this pool registered, when `[transfer]` says RDMA and the host
    /// has it.
    rdma: Option<Arc<RdmaNode>>,
    /// Incremented at every lost connection; job frames of an older epoch are dropped.
    epoch: u64,
    deadlines: DeadlineDurations,
}

/// Runs decoded until stopped (SIGTERM/SIGINT or `opts.shutdown`; registered, it drains
/// first), or until kvctld refuses its registration for good.
pub fn run(cfg: Config, opts: RunOptions) -> Result<(), WorkerError> {
    // The decode pool's fd never leaves this process: only the pool holds it. Registered
    // with RDMA for local access only: reads land here, no peer gets a key to it.
    // An engine embedding the worker brings its own runner; otherwise `[model]` says.
    let model = llama::worker_runner(opts.model.as_ref(), &cfg.model, cfg.geometry)
        .map_err(|e| WorkerError::ModelLoad(e.into()))?;
    let mut start = Startup::new(&cfg, Side::Decode, model)?;
    let mut transports = vec![Transport::Shm, Transport::Tcp];
    if start.rdma.is_some() {
        transports.push(Transport::Rdma);
    }
    let register = start.registration(transports, None);
    let link = start.link(&cfg, register)?;
    let Startup {
        model,
        pool,
        rdma,
        poll,
        waker,
        ..
    } = start;
    let counters = Arc::new(Counters::default());
    let (events_tx, events) = crossbeam::channel::unbounded();
    let jobs = JobPool::start(
        PULL_THREADS,
        cfg.decode.max_batch() as usize,
        Arc::new(JobContext {
            model,
            counters: Arc::clone(&counters),
            events: events_tx,
            waker: Arc::clone(&waker),
        }),
    )
    .map_err(WorkerError::Threads)?;
    let mut worker = Decode {
        geometry: cfg.geometry,
        pool,
        counters,
        jobs,
        events,
        held: HashMap::new(),
        generation: None,
        limits: None,
        sources: HashMap::new(),
        rdma,
        epoch: 0,
        deadlines: cfg.deadlines.as_durations(),
    };
    worker::serve(poll, waker, link, &mut worker, &opts)?;
    Ok(())
}

impl Decode {
    /// Refuses an owner of another generation, or one that is not the frame's request.
    fn check_owner(&self, id: RequestId, owner: Owner) -> Result<(), String> {
        worker::check_owner(self.generation, id, owner)
    }

    fn report(&self, link: &mut Link) {
        worker::send_report(link, &self.pool, self.counters.snapshot());
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
        let Some(source) = self.sources.get(&m.source).cloned() else {
            let reason = format!("no prefill worker {} known", m.source);
            return fail(self, link, res, ErrorCode::WorkerLost, reason);
        };
        let cancel = Arc::new(AtomicBool::new(false));
        let job = Job {
            owner,
            res,
            manifest: m.manifest,
            max_new_tokens: m.max_new_tokens,
            last_token: m.last_token,
            sampling: m.sampling,
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

    /// The geometry check every prefill source passes: its pages must be this pool's.
    fn check_geometry(&self, geometry: &PageGeometry) -> Result<(), String> {
        if *geometry == self.geometry {
            Ok(())
        } else {
            Err(format!(
                "prefill pool geometry {geometry:?} differs from this worker's {:?}",
                self.geometry
            ))
        }
    }

    /// Makes `source` the source of prefill worker `worker`, replacing the one it had (that
    /// worker restarted), or, with `Err`, forgets it and answers kvctld why.
    fn set_source(
        &mut self,
        link: &mut Link,
        worker: String,
        source: Result<Arc<dyn PageSource>, String>,
    ) {
        match source {
            Ok(source) => {
                if self.sources.insert(worker.clone(), source).is_some() {
                    info!("prefill worker {worker}: the new source replaces the old one");
                }
            }
            Err(reason) => {
                let reason = format!("prefill worker {worker}: {reason}");
                warn!("{reason}");
                self.sources.remove(&worker);
                refuse(link, RequestId(0), ErrorCode::BadRequest, reason);
            }
        }
    }

    fn map_prefill_pool(&mut self, link: &mut Link, m: PrefillPool, fds: &[OwnedFd]) {
        let source = self.check_geometry(&m.geometry).and_then(|()| {
            let fd = fds.first().ok_or("PrefillPool without its fd")?;
            let foreign =
                ForeignPool::map(fd.as_fd(), self.geometry.bytes_per_page(), m.pool_pages)
                    .map_err(|e| format!("cannot map the prefill pool: {e}"))?;
            info!(
                "mapped the pool of prefill worker {} ({} pages)",
                m.worker, m.pool_pages
            );
            Ok(Arc::new(foreign) as Arc<dyn PageSource>)
        });
        self.set_source(link, m.worker, source);
    }

    fn use_page_server(&mut self, link: &mut Link, m: PrefillEndpoint) {
        let source = self.check_geometry(&m.geometry).and_then(|()| {
            let addr = m
                .endpoint
                .addr
                .parse()
                .map_err(|e| format!("page server address {:?}: {e}", m.endpoint.addr))?;
            let page_bytes = self.geometry.bytes_per_page();
            let (token, pages) = (m.endpoint.token, m.pool_pages);
            Ok(match (&self.rdma, m.rdma) {
                (Some(node), true) => {
                    info!(
                        "reading the pages of prefill worker {} from {addr} over RDMA",
                        m.worker
                    );
                    let node = Arc::clone(node);
                    Arc::new(RdmaSource::new(addr, token, pages, page_bytes, node))
                        as Arc<dyn PageSource>
                }
                _ => {
                    info!(
                        "pulling the pages of prefill worker {} from {addr} over TCP",
                        m.worker
                    );
                    Arc::new(TcpSource::new(addr, token, pages, page_bytes))
                }
            })
        });
        self.set_source(link, m.worker, source);
    }

    /// `PrefillGone`: forgets that worker's source (unmapping its pool and closing its idle
    /// page-server connections once no running job holds it).
    fn forget_source(&mut self, worker: &str) {
        if self.sources.remove(worker).is_some() {
            info!("prefill worker {worker} is gone; forgot its source");
        } else {
            debug!("PrefillGone for {worker}, which this worker did not know");
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
    fn refresh_report(&mut self, link: &mut Link) {
        worker::report_if_changed(link, &self.pool, || self.counters.snapshot());
    }

    fn load(&self) -> Load {
        Load {
            usage: self.pool.usage(),
            counters: self.counters.snapshot(),
            in_flight: u32::try_from(self.held.len()).unwrap_or(u32::MAX),
        }
    }

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
            Message::PrefillPool(m) => self.map_prefill_pool(link, m, &fds),
            Message::PrefillEndpoint(m) => self.use_page_server(link, m),
            Message::PrefillGone(m) => self.forget_source(&m.worker),
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
        self.sources.clear();
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
mod tests {
    use super::*;
    use libkv::PageId;
    use libkv::config::{Backend, TransportKind};
    use libkv::memory::HostMemory;
    use libkv::model::{ModelRunner, ReferenceModel, monolithic, tokenize};
    use libkv::pool::PoolOptions;
    use libkv::proto::{
        Abort, Done, Drain, PrefillDone, PrefillGone, PrefillRun, PullDone, Release, Role, Tokens,
    };
    use libkv::testkit::{self, FakeKvctld, GEN, Peer, counter, drain_reply, owner, test_config};
    use libkv::verify::{Manifest, page_digest};
    use libkv::worker::{EXIT_CONFIG, LinkError};

    const PROMPT: &[u8] = b"kvfence moves KV pages from prefill to decode, verified";
    /// The id of the prefill worker [`start`] hands decoded.
    const SOURCE: &str = "prefill-0";

    fn start_daemon(cfg: Config) -> testkit::Daemon {
        testkit::Daemon::start(run, cfg)
    }

    fn expect_error(msg: Message, code: ErrorCode) -> String {
        match msg {
            Message::Error(e) if e.code == code => e.message,
            other => panic!("expected Error {code}, got {other:?}"),
        }
    }

    /// A prefill pool written in the test, standing in for prefilld.
    struct FakePrefill {
        id: String,
        pool: PagePool,
        fd: OwnedFd,
        model: ReferenceModel,
        held: Vec<Reservation>,
    }

    impl FakePrefill {
        fn new(cfg: &Config) -> FakePrefill {
            FakePrefill::with_id(cfg, SOURCE)
        }

        fn with_id(cfg: &Config, id: &str) -> FakePrefill {
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
                id: id.to_owned(),
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
                    worker: self.id.clone(),
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
    ) -> (FakeKvctld, Config, testkit::Daemon, Peer, FakePrefill) {
        let kvctld = FakeKvctld::new();
        let mut cfg = test_config(kvctld.socket.clone());
        cfg_edit(&mut cfg);
        let daemon = start_daemon(cfg.clone());
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
        let (h, msg) = peer.next_frame();
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
        let (h, msg) = peer.next_frame();
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
        let mut prefill_cfg = cfg.clone();
        prefill_cfg.worker.id = Some(SOURCE.into());
        let prefilld = testkit::Daemon::start(prefilld::run, prefill_cfg);
        let mut pre = kvctld.accept();
        let (reg, pool_fd) = pre.handshake(&cfg);
        assert_eq!((reg.role, reg.id.as_str()), (Role::Prefill, SOURCE));
        let decoded = start_daemon(cfg.clone());
        let mut dec = kvctld.accept();
        let (reg, _) = dec.handshake(&cfg);
        assert_eq!((reg.role, reg.id.as_str()), (Role::Decode, "decode"));
        let pool_fd = pool_fd.expect("prefill pool fd");
        dec.send_fd(
            RequestId(0),
            PrefillPool {
                worker: SOURCE.into(),
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
                prompt: libkv::model::tokenize(PROMPT),
            },
        );
        let Message::PrefillDone(PrefillDone { manifest }) = pre.next_frame().1 else {
            panic!("expected PrefillDone");
        };
        let prefill_pages = u32::try_from(manifest.pages.len()).unwrap();
        dec.send(
            id,
            PullKv {
                source: SOURCE.into(),
                manifest,
                max_new_tokens: max_new,
                sampling: libkv::proto::Sampling::GREEDY,
                last_token: 0,
            },
        );
        assert_eq!(
            dec.next_frame().1,
            Message::PullDone(PullDone { owner: owner(11) })
        );
        pre.send(id, Release { owner: owner(11) });
        let (_, freed) = pre.next_frame();
        assert_eq!(
            freed,
            Message::Freed(Freed {
                owner: owner(11),
                pages: prefill_pages
            })
        );

        let mut tokens = Vec::new();
        let done = loop {
            let (h, msg) = dec.next_frame();
            assert_eq!(h.request_id, id);
            match msg {
                Message::Tokens(Tokens {
                    first_index,
                    tokens: t,
                }) => {
                    assert_eq!(first_index as usize, tokens.len());
                    assert!(t.len() <= batch::TOKENS_PER_FRAME);
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

        prefilld.stop().unwrap();
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
                source: SOURCE.into(),
                manifest,
                max_new_tokens: 8,
                sampling: libkv::proto::Sampling::GREEDY,
                last_token: 0,
            },
        );
        let reason = expect_error(peer.next_frame().1, ErrorCode::VerifyFailed);
        assert!(reason.contains("tokens"), "{reason}");
        // No PullDone, no Tokens: the next frame is Freed.
        let report = expect_freed(&mut peer, &cfg, 1, pages);
        assert_eq!(counter(&report, "verify_failed"), 1);
        assert_eq!(counter(&report, "verify_failed_coverage"), 1);
        assert_eq!(counter(&report, "verify_failed_digest"), 0);
        assert_eq!(counter(&report, "verified"), 0);
        assert_eq!(counter(&report, "tokens_generated"), 0);

        // A manifest whose digest does not match the pulled bytes fails the same way.
        let pages = reserve(&mut peer, 2, n, 8);
        let mut manifest = prefill.prefill(owner(2), PROMPT);
        manifest.digests[0] ^= 1;
        peer.send(
            RequestId(2),
            PullKv {
                source: SOURCE.into(),
                manifest,
                max_new_tokens: 8,
                sampling: libkv::proto::Sampling::GREEDY,
                last_token: 0,
            },
        );
        let reason = expect_error(peer.next_frame().1, ErrorCode::VerifyFailed);
        assert!(reason.contains("digest"), "{reason}");
        let report = expect_freed(&mut peer, &cfg, 2, pages);
        assert_eq!(counter(&report, "verify_failed"), 2);
        assert_eq!(counter(&report, "verify_failed_coverage"), 1);
        assert_eq!(counter(&report, "verify_failed_digest"), 1);
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
                source: SOURCE.into(),
                manifest: manifest.clone(),
                max_new_tokens: 8,
                sampling: libkv::proto::Sampling::GREEDY,
                last_token: 0,
            },
        );
        let reason = expect_error(peer.next_frame().1, ErrorCode::BadRequest);
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
                source: SOURCE.into(),
                manifest,
                max_new_tokens: 8,
                sampling: libkv::proto::Sampling::GREEDY,
                last_token: 0,
            },
        );
        expect_error(peer.next_frame().1, ErrorCode::BadRequest);
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
                source: SOURCE.into(),
                manifest: manifest.clone(),
                max_new_tokens: 4,
                sampling: libkv::proto::Sampling::GREEDY,
                last_token: 0,
            },
        );
        let reason = expect_error(peer.next_frame().1, ErrorCode::BadRequest);
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
        expect_error(peer.next_frame().1, ErrorCode::BadRequest);
        // Over the limits from RegisterAck.
        peer.send(
            RequestId(7),
            DecodeReserve {
                owner: owner(7),
                prompt_tokens: cfg.limits.max_context + 1,
                max_new_tokens: 4,
            },
        );
        expect_error(peer.next_frame().1, ErrorCode::BadRequest);
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
        let reason = expect_error(peer.next_frame().1, ErrorCode::BadRequest);
        assert!(reason.contains("duplicate"), "{reason}");
        // A message for the other role.
        peer.send(
            RequestId(5),
            PrefillRun {
                owner: owner(5),
                prompt: libkv::model::tokenize(PROMPT),
            },
        );
        expect_error(peer.next_frame().1, ErrorCode::BadRequest);
        // The first reservation still serves its request.
        peer.send(
            RequestId(5),
            PullKv {
                source: SOURCE.into(),
                manifest,
                max_new_tokens: 4,
                sampling: libkv::proto::Sampling::GREEDY,
                last_token: 0,
            },
        );
        assert!(matches!(peer.next_frame().1, Message::PullDone(_)));
        // The first token goes out alone, the rest in frames of up to TOKENS_PER_FRAME.
        let mut tokens = 0;
        loop {
            match peer.next_frame().1 {
                Message::Tokens(t) => tokens += t.tokens.len(),
                Message::Done(_) => break,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(tokens, 4);
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
                source: SOURCE.into(),
                manifest,
                max_new_tokens: max_new,
                sampling: libkv::proto::Sampling::GREEDY,
                last_token: 0,
            },
        );
        peer.send(RequestId(2), abort(2));
        peer.send(RequestId(2), abort(2));
        let report = loop {
            let (h, msg) = peer.next_frame();
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
                source: SOURCE.into(),
                manifest,
                max_new_tokens: 8,
                sampling: libkv::proto::Sampling::GREEDY,
                last_token: 0,
            },
        );
        expect_error(peer.next_frame().1, ErrorCode::WorkerLost);
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
    fn cuda_backend_refuses_to_start_naming_what_is_missing() {
        let mut cfg = test_config("/nonexistent/kvctld.sock".into());
        cfg.decode.backend = Backend::Cuda;
        let err = run(cfg, RunOptions::default()).unwrap_err();
        assert_eq!(err.exit_code(), EXIT_CONFIG);
        let chain = libkv::error_chain(&err);
        if libkv::memory::cuda::driver_present() {
            // A host with a driver: the model of [model] runs on the CPU.
            assert!(chain.contains("runs on the host CPU"), "{chain}");
        } else {
            assert_eq!(
                chain,
                "[decode] backend = \"cuda\" (cuda_device = 0) cannot run on this host; set \
                 backend = \"host\" to run the pool in host memory: the CUDA driver library \
                 libcuda.so.1 cannot be loaded: no NVIDIA driver is installed on this host, or \
                 it is not on the loader path"
            );
        }
    }

    fn pull_msg(source: &str, manifest: Manifest, max_new_tokens: u32) -> PullKv {
        PullKv {
            source: source.into(),
            manifest,
            max_new_tokens,
            sampling: libkv::proto::Sampling::GREEDY,
            last_token: 0,
        }
    }

    /// Reads PullDone, the Tokens and Done of `request`; returns the tokens and Done.
    fn decoded_output(peer: &mut Peer, request: u64) -> (Vec<u32>, Done) {
        let (h, msg) = peer.next_frame();
        assert_eq!(h.request_id, RequestId(request));
        assert_eq!(
            msg,
            Message::PullDone(PullDone {
                owner: owner(request)
            })
        );
        let mut tokens = Vec::new();
        loop {
            let (h, msg) = peer.next_frame();
            assert_eq!(h.request_id, RequestId(request));
            match msg {
                Message::Tokens(t) => {
                    assert_eq!(t.first_index as usize, tokens.len());
                    tokens.extend(t.tokens);
                }
                Message::Done(d) => return (tokens, d),
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    /// The output a monolithic run gives for `prompt`.
    fn expected(cfg: &Config, prompt: &[u8], max_new: u32) -> (Vec<u32>, u64) {
        let model = ReferenceModel::new(cfg.geometry).unwrap();
        let out = monolithic(&model, &tokenize(prompt), max_new).unwrap();
        (out.tokens, out.signature)
    }

    /// Pulls `request` (reserved for `prompt`) from `source`, checks the output against a
    /// monolithic run, then the Freed.
    fn pull_and_check(
        peer: &mut Peer,
        cfg: &Config,
        (request, pages): (u64, u32),
        source: &str,
        manifest: Manifest,
        prompt: &[u8],
    ) {
        let max_new = 8;
        peer.send(RequestId(request), pull_msg(source, manifest, max_new));
        let (tokens, done) = decoded_output(peer, request);
        let (want, signature) = expected(cfg, prompt, max_new);
        assert_eq!(tokens, want, "request {request} from {source}");
        assert_eq!(done.signature, signature);
        assert!(done.prefill_worker.is_empty() && done.decode_worker.is_empty());
        expect_freed(peer, cfg, request, pages);
    }

    const OTHER_PROMPT: &[u8] = b"a second prefill worker holds a different prompt's KV";

    #[test]
    fn each_pull_reads_the_pool_its_pull_names() {
        let (_k, cfg, daemon, mut peer, mut a) = start(|_| {});
        let mut b = FakePrefill::with_id(&cfg, "prefill-1");
        b.give_pool(&peer, &cfg);
        // The same page ids in both pools, holding different KV.
        let in_a = a.prefill(owner(1), PROMPT);
        let in_b = b.prefill(owner(2), OTHER_PROMPT);
        assert_eq!(in_a.pages, in_b.pages);
        let tokens = |p: &[u8]| u32::try_from(tokenize(p).len()).unwrap();
        let pages = reserve(&mut peer, 1, tokens(PROMPT), 8);
        pull_and_check(&mut peer, &cfg, (1, pages), SOURCE, in_a, PROMPT);
        let pages = reserve(&mut peer, 2, tokens(OTHER_PROMPT), 8);
        pull_and_check(&mut peer, &cfg, (2, pages), "prefill-1", in_b, OTHER_PROMPT);

        // A manifest read from the wrong pool fails verification: never the other's KV.
        let in_b = b.prefill(owner(3), OTHER_PROMPT);
        let pages = reserve(&mut peer, 3, tokens(OTHER_PROMPT), 8);
        peer.send(RequestId(3), pull_msg(SOURCE, in_b, 8));
        expect_error(peer.next_frame().1, ErrorCode::VerifyFailed);
        let report = expect_freed(&mut peer, &cfg, 3, pages);
        assert_eq!(counter(&report, "verified"), 2);
        daemon.stop().unwrap();
    }

    #[test]
    fn a_pull_from_an_unknown_or_gone_source_fails_and_frees_its_pages() {
        let (_k, cfg, daemon, mut peer, mut prefill) = start(|_| {});
        let n = u32::try_from(PROMPT.len()).unwrap();
        let manifest = prefill.prefill(owner(1), PROMPT);
        let pages = reserve(&mut peer, 1, n, 8);
        peer.send(RequestId(1), pull_msg("prefill-9", manifest, 8));
        let reason = expect_error(peer.next_frame().1, ErrorCode::WorkerLost);
        assert_eq!(reason, "no prefill worker prefill-9 known");
        expect_freed(&mut peer, &cfg, 1, pages);

        peer.send(
            RequestId(0),
            PrefillGone {
                worker: SOURCE.into(),
            },
        );
        let manifest = prefill.prefill(owner(2), PROMPT);
        let pages = reserve(&mut peer, 2, n, 8);
        peer.send(RequestId(2), pull_msg(SOURCE, manifest, 8));
        let reason = expect_error(peer.next_frame().1, ErrorCode::WorkerLost);
        assert_eq!(reason, format!("no prefill worker {SOURCE} known"));
        let report = expect_freed(&mut peer, &cfg, 2, pages);
        assert_eq!(counter(&report, "pages_pulled"), 0);
        daemon.stop().unwrap();
    }

    #[test]
    fn a_replaced_source_serves_the_next_pull() {
        let (_k, cfg, daemon, mut peer, _old) = start(|_| {});
        // The prefill worker restarted with a new pool under the same id; the old pool holds
        // nothing, so only a pull from the new one verifies.
        let mut new = FakePrefill::new(&cfg);
        new.give_pool(&peer, &cfg);
        let manifest = new.prefill(owner(1), PROMPT);
        let pages = reserve(&mut peer, 1, u32::try_from(PROMPT.len()).unwrap(), 8);
        pull_and_check(&mut peer, &cfg, (1, pages), SOURCE, manifest, PROMPT);
        daemon.stop().unwrap();
    }

    #[test]
    fn it_registers_its_batch_slots() {
        for (set, want) in [(None, libkv::config::DEFAULT_MAX_BATCH), (Some(3), 3)] {
            let kvctld = FakeKvctld::new();
            let mut cfg = test_config(kvctld.socket.clone());
            cfg.decode.max_batch = set;
            let daemon = start_daemon(cfg.clone());
            let mut peer = kvctld.accept();
            let (reg, _) = peer.handshake(&cfg);
            assert_eq!(reg.max_batch, want, "[decode] max_batch = {set:?}");
            daemon.stop().unwrap();
        }
    }

    #[test]
    fn a_refusal_for_good_ends_run_with_the_config_exit_code() {
        let kvctld = FakeKvctld::new();
        let cfg = test_config(kvctld.socket.clone());
        let daemon = start_daemon(cfg);
        let mut peer = kvctld.accept();
        let (reg, _) = peer.hello();
        assert_eq!(reg.id, "decode");
        peer.send(
            RequestId(0),
            libkv::proto::Error {
                code: ErrorCode::Misconfigured,
                message: "geometry differs".into(),
            },
        );
        let err = daemon.wait().unwrap_err();
        assert!(
            matches!(&err, WorkerError::Link(LinkError::Misconfigured { .. })),
            "{err:?}"
        );
        assert_eq!(err.exit_code(), EXIT_CONFIG);
        peer.expect_closed();
    }

    #[test]
    fn stop_drains_the_request_in_flight_and_ends_at_drain_reply() {
        let kvctld = FakeKvctld::new();
        let mut cfg = test_config(kvctld.socket.clone());
        cfg.worker.id = Some("decode@gpu1".into());
        // Far beyond testkit::WAIT: stopping in time means stopping at the DrainReply.
        cfg.deadlines.drain = 600_000;
        cfg.validate().unwrap();
        let daemon = start_daemon(cfg.clone());
        let mut peer = kvctld.accept();
        let (reg, _) = peer.handshake(&cfg);
        assert_eq!(reg.id, "decode@gpu1");
        let mut prefill = FakePrefill::new(&cfg);
        prefill.give_pool(&peer, &cfg);
        let n = u32::try_from(PROMPT.len()).unwrap();
        let pages = reserve(&mut peer, 1, n, 8);
        daemon.request_stop();
        let (h, msg) = peer.next_frame();
        assert_eq!(h.request_id, RequestId(0));
        assert_eq!(
            msg,
            Message::Drain(Drain {
                worker: "decode@gpu1".into(),
                drain: true
            })
        );
        // The request reserved before the drain is still pulled and decoded.
        let manifest = prefill.prefill(owner(1), PROMPT);
        pull_and_check(&mut peer, &cfg, (1, pages), SOURCE, manifest, PROMPT);
        assert!(daemon.try_result().is_none(), "stopped before DrainReply");
        peer.send(RequestId(0), drain_reply(&reg));
        daemon.wait().unwrap();
        peer.expect_closed();
    }

    #[test]
    fn drain_without_reply_ends_at_its_deadline() {
        let (_k, cfg, daemon, mut peer, _prefill) = start(|cfg| cfg.deadlines.drain = 300);
        let n = u32::try_from(PROMPT.len()).unwrap();
        let pages = reserve(&mut peer, 1, n, 8);
        let asked = Instant::now();
        daemon.request_stop();
        assert!(matches!(peer.next_frame().1, Message::Drain(_)));
        expect_freed(&mut peer, &cfg, 1, pages);
        assert!(asked.elapsed() >= std::time::Duration::from_millis(300));
        daemon.wait().unwrap();
        peer.expect_closed();
    }

    #[test]
    fn pulls_from_two_page_servers_on_one_host() {
        let kvctld = FakeKvctld::new();
        let mut cfg = test_config(kvctld.socket.clone());
        cfg.transfer.transport = TransportKind::Tcp;
        cfg.transfer.listen = Some("127.0.0.1:0".into());
        cfg.validate().unwrap();
        // Two prefill workers from one configuration, told apart by their ids only.
        let mut prefills = Vec::new();
        for id in ["prefill-a", "prefill-b"] {
            let mut prefill_cfg = cfg.clone();
            prefill_cfg.worker.id = Some(id.into());
            let daemon = testkit::Daemon::start(prefilld::run, prefill_cfg);
            let mut peer = kvctld.accept();
            let (reg, _) = peer.handshake(&cfg);
            assert_eq!(reg.id, id);
            prefills.push((daemon, peer, reg));
        }
        let decoded = start_daemon(cfg.clone());
        let mut dec = kvctld.accept();
        dec.handshake(&cfg);
        for (_, _, reg) in &prefills {
            dec.send(
                RequestId(0),
                PrefillEndpoint {
                    worker: reg.id.clone(),
                    geometry: reg.geometry,
                    pool_pages: reg.pool_pages,
                    endpoint: reg.endpoint.clone().expect("a page server"),
                    rdma: false,
                },
            );
        }
        // Two rounds: the second reuses each source's idle connection.
        let mut request = 0;
        for _round in 0..2 {
            for (i, (_, pre, reg)) in prefills.iter_mut().enumerate() {
                request += 1;
                let prompt = [PROMPT, OTHER_PROMPT][i];
                let n = u32::try_from(tokenize(prompt).len()).unwrap();
                let pages = reserve(&mut dec, request, n, 8);
                let run = PrefillRun {
                    owner: owner(request),
                    prompt: libkv::model::tokenize(prompt),
                };
                pre.send(RequestId(request), run);
                let Message::PrefillDone(PrefillDone { manifest }) = pre.next_frame().1 else {
                    panic!("expected PrefillDone");
                };
                pull_and_check(&mut dec, &cfg, (request, pages), &reg.id, manifest, prompt);
                pre.send(
                    RequestId(request),
                    Release {
                        owner: owner(request),
                    },
                );
                assert!(
                    matches!(pre.next_frame().1, Message::Freed(f) if f.owner == owner(request))
                );
            }
        }
        decoded.stop().unwrap();
        for (daemon, _, _) in prefills {
            daemon.stop().unwrap();
        }
    }

    #[test]
    fn pages_a_stalled_pull_is_writing_are_reported_without_an_event() {
        // A page server that takes the request and then says nothing until told to go.
        let (_k, cfg, daemon, mut peer, _prefill) = start(|_| {});
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let server = std::thread::spawn(move || {
            let (conn, _) = listener.accept().unwrap();
            let _ = released.recv_timeout(std::time::Duration::from_secs(20));
            drop(conn);
        });
        peer.send(
            RequestId(0),
            libkv::proto::PrefillEndpoint {
                worker: "prefill-slow".into(),
                geometry: cfg.geometry,
                pool_pages: cfg.prefill.pool_pages,
                endpoint: libkv::proto::TcpEndpoint {
                    addr,
                    token: [7; libkv::proto::TOKEN_BYTES],
                },
                rdma: false,
            },
        );
        let n = u32::try_from(tokenize(PROMPT).len()).unwrap();
        let pages = reserve(&mut peer, 1, n, 4);
        let manifest_pages = u32::try_from(cfg.geometry.pages_for_tokens(u64::from(n))).unwrap();
        peer.send(
            RequestId(1),
            PullKv {
                source: "prefill-slow".into(),
                manifest: Manifest {
                    owner: owner(1),
                    tokens: n,
                    pages: (0..manifest_pages).map(PageId).collect(),
                    digests: vec![0; manifest_pages as usize],
                },
                max_new_tokens: 4,
                sampling: libkv::proto::Sampling::GREEDY,
                last_token: 0,
            },
        );
        // Nothing happens on the link while the pull waits, yet a report comes that shows
        // the reservation's pages being written.
        let report = loop {
            match peer.recv() {
                (_, Message::PoolReport(r), _) if r.writing > 0 => break r,
                (_, Message::PoolReport(_), _) => {}
                (h, m, _) => panic!("expected a PoolReport, got {m:?} for {}", h.request_id),
            }
        };
        assert_eq!(report.writing + report.reserved, pages, "{report:?}");
        release.send(()).unwrap();
        server.join().unwrap();
        // The pull fails (the server hung up) and the pages come back.
        let (_, msg) = peer.next_frame();
        expect_error(msg, ErrorCode::WorkerLost);
        expect_freed(&mut peer, &cfg, 1, pages);
        daemon.stop().unwrap();
    }
}
