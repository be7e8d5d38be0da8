//! prefilld: the prefill worker of kvfence.
//!
//! It owns a page pool on a sealed memfd, registers a read-only re-open of that memfd with
//! kvctld under its worker id (so that decoded can pull pages, never write them), and for
//! each `PrefillRun` reserves pages for the owner, computes the prompt's KV into them with the
//! reference model and answers with a manifest (pages and crc32c digests). It keeps the pages
//! until kvctld sends `Release` or `Abort`, or until the request deadline passes, then reports
//! `Freed` and a `PoolReport`.
//!
//! Everything runs on one mio event loop ([`libkv::worker::serve`], which also drains the
//! worker on SIGTERM); a prefill is short and runs on the loop thread. With `[transfer]
//! transport = "tcp"` prefilld registers no fd but a TCP page server ([`pageserver`]) from
//! which decoded pulls the pages of the owners it holds; `listen` with port 0 binds a free
//! port and registers the one bound, so several prefill workers on one host can share a
//! configuration file.

pub mod pageserver;
use pageserver::{HeldMap, PageServer, Served};

use libkv::config::{Config, Side};
use libkv::model::{ModelError, ModelRunner};
use libkv::pool::{PagePool, PoolError, Reservation};
use libkv::proto::{
    ErrorCode, Freed, Header, Message, PrefillDone, PrefillRun, RegisterAck, TcpEndpoint, Transport,
};
use libkv::verify::{Manifest, page_digest};
use libkv::worker::{self, Link, Load, Startup, Worker, add, page_count, pool_error_code, refuse};
use libkv::{Generation, Owner, RequestId};
use log::debug;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use libkv::worker::{RunOptions, Shutdown, WorkerError};

libkv::worker_counters! {
    /// Counters reported in every `PoolReport`, after the link's `frames_received`.
    pub(crate) struct Counters {
        prefill_runs,
        /// Prefills stopped between chunks: kvctld abandoned the request (its deadline, the
        /// client gone) or the connection to kvctld was lost.
        prefills_abandoned,
        pages_written,
        aborts,
        freed_pages,
        pages_served,
        bytes_served,
        page_requests_refused,
        /// Page-server connections accepted, and turned away at the connection limit.
        page_connections,
        page_connections_refused,
        rdma_sessions,
        windows_bound,
        windows_revoked,
    }
}

/// The prefill worker's state, driven by the event loop.
#[derive(Debug)]
struct Prefill {
    pool: PagePool,
    model: Arc<dyn ModelRunner>,
    counters: Arc<Counters>,
    /// Pages kept per owner until Release, Abort or their deadline; shared with the page
    /// server, which serves only these.
    held: HeldMap,
    /// Owners released while the page server may still be sending their pages: freed and
    /// reported once the server let go of them.
    releasing: Vec<(Owner, Arc<Served>)>,
    /// What was held when the kvctld connection went, with the time until which a decode
    /// worker may still be copying it from its read-only map of the pool; then freed
    /// silently (no kvctld to tell). The worker registers anew only once this is empty.
    orphaned: Vec<(Instant, Arc<Served>)>,
    server: Option<PageServer>,
    generation: Option<Generation>,
    max_context: u32,
    hold_for: Duration,
    /// How long a pull may still run after kvctld is gone: a decode job stops pulling at
    /// its transfer deadline, checked between pages.
    orphan_hold: Duration,
}

/// Beyond the transfer deadline, the time a decode job may take to notice it (one page run).
const ORPHAN_MARGIN: Duration = Duration::from_millis(100);

/// How often the loop looks at `releasing` if no wake-up came.
const RELEASE_POLL: Duration = Duration::from_millis(50);
/// How often a running prefill looks (between pages) whether kvctld abandoned it.
const ABANDON_CHECK: Duration = Duration::from_millis(5);

/// Runs prefilld until stopped (SIGTERM/SIGINT or `opts.shutdown`; registered, it drains
/// first), or until kvctld refuses its registration for good.
pub fn run(cfg: Config, opts: RunOptions) -> Result<(), WorkerError> {
    let listen = cfg.transfer.listen_addr().map_err(WorkerError::Transfer)?;
    // An engine embedding the worker brings its own runner; otherwise `[model]` says.
    let model = llama::worker_runner(opts.model.as_ref(), &cfg.model, cfg.geometry)
        .map_err(|e| WorkerError::ModelLoad(e.into()))?;
    let mut start = Startup::new(&cfg, Side::Prefill, model)?;
    let counters = Arc::new(Counters::default());
    let held = HeldMap::default();
    let (server, endpoint) = match listen {
        None => (None, None),
        Some(addr) => {
            let token = libkv::tcp::random_token()
                .map_err(|source| WorkerError::PageServer { addr, source })?;
            let limits = pageserver::Limits {
                idle: cfg.deadlines.request(),
                transfer: cfg.deadlines.transfer(),
            };
            let server = PageServer::start(
                addr,
                token,
                held.clone(),
                Arc::clone(&start.waker),
                Arc::clone(&counters),
                limits,
                start.rdma.clone(),
            )
            .map_err(|source| WorkerError::PageServer { addr, source })?;
            // The address bound, not the one configured: port 0 picked a free port.
            let endpoint = TcpEndpoint {
                addr: server.local_addr().to_string(),
                token,
            };
            log::info!("serving pages on {}", endpoint.addr);
            (Some(server), Some(endpoint))
        }
    };
    let transports = match (&endpoint, &start.rdma) {
        (Some(_), Some(_)) => vec![Transport::Tcp, Transport::Rdma],
        (Some(_), None) => vec![Transport::Tcp],
        (None, _) => vec![Transport::Shm],
    };
    let register = start.registration(transports, endpoint);
    let link = start.link(&cfg, register)?;
    let Startup {
        model,
        pool,
        poll,
        waker,
        ..
    } = start;
    let mut worker = Prefill {
        pool,
        model,
        counters,
        held,
        releasing: Vec::new(),
        orphaned: Vec::new(),
        server,
        generation: None,
        max_context: cfg.limits.max_context,
        hold_for: cfg.deadlines.request(),
        orphan_hold: cfg.deadlines.transfer() + ORPHAN_MARGIN,
    };
    worker::serve(poll, waker, link, &mut worker, &opts)?;
    Ok(())
}

impl Prefill {
    /// Refuses an owner of another generation, or one that is not the frame's request.
    fn check_owner(&self, id: RequestId, owner: Owner) -> Result<(), String> {
        worker::check_owner(self.generation, id, owner)
    }

    fn report(&self, link: &mut Link) {
        worker::send_report(link, &self.pool, self.counters.snapshot());
    }

    /// Reports pages that are back on the free list (the reservation was dropped and no
    /// writer exists: prefill's only writer is the loop itself).
    fn freed(&self, link: &mut Link, owner: Owner, pages: u32) {
        add(&self.counters.freed_pages, u64::from(pages));
        link.send(owner.request, Freed { owner, pages });
        self.report(link);
    }

    fn prefill(&mut self, link: &mut Link, id: RequestId, run: PrefillRun) {
        let owner = run.owner;
        if let Err(reason) = self.check_owner(id, owner) {
            return refuse(link, id, ErrorCode::BadRequest, reason);
        }
        if self.held.lock().contains_key(&owner) || self.releasing.iter().any(|(o, _)| *o == owner)
        {
            let reason = format!("duplicate PrefillRun for {owner}");
            return refuse(link, id, ErrorCode::BadRequest, reason);
        }
        let tokens = run.prompt;
        let n = match u32::try_from(tokens.len()) {
            Ok(n) if n <= self.max_context => n,
            _ => {
                let reason = format!(
                    "prompt of {} tokens exceeds max_context {}",
                    tokens.len(),
                    self.max_context
                );
                refuse(link, id, ErrorCode::BadRequest, reason);
                // One Freed per owner kvctld told us of, even with nothing reserved.
                return self.freed(link, owner, 0);
            }
        };
        let mut res = match self.pool.reserve(owner, n, u64::from(n)) {
            Ok(res) => res,
            Err(e) => {
                let reason = format!("reserving prefill pages: {e}");
                refuse(link, id, pool_error_code(&e), reason);
                return self.freed(link, owner, 0);
            }
        };
        match self.write_kv(link, owner, &mut res, &tokens) {
            Ok(None) => {
                // Abandoned between chunks: the pages were never handed out.
                add(&self.counters.prefills_abandoned, 1);
                let pages = page_count(&res);
                drop(res);
                debug!("{owner}: prefill abandoned; freeing {pages} pages");
                self.freed(link, owner, pages);
            }
            Ok(Some((pages, digests))) => {
                debug!("prefilled {owner}: {n} tokens in {} pages", pages.len());
                add(&self.counters.prefill_runs, 1);
                add(&self.counters.pages_written, pages.len() as u64);
                let served = Arc::new(Served {
                    res,
                    pages: pages.clone(),
                    expires: Instant::now() + self.hold_for,
                });
                let manifest = Manifest {
                    owner,
                    tokens: n,
                    pages,
                    digests,
                };
                self.held.lock().insert(owner, served);
                link.send(id, PrefillDone { manifest });
                self.report(link);
            }
            Err(e) => {
                let pages = page_count(&res);
                drop(res);
                refuse(link, id, ErrorCode::Internal, format!("prefill: {e}"));
                self.freed(link, owner, pages);
            }
        }
    }

    /// Computes the prompt's KV into the reservation's pages; returns the pages written and
    /// the digest of each (over the full page), or `None` when kvctld abandoned the request
    /// (looked at between pages, every [`ABANDON_CHECK`]). The write grant ends before this
    /// returns.
    #[allow(clippy::type_complexity)]
    fn write_kv(
        &self,
        link: &mut Link,
        owner: Owner,
        res: &mut Reservation,
        tokens: &[u32],
    ) -> Result<Option<(Vec<libkv::PageId>, Vec<u32>)>, ModelError> {
        let mut grant = res.grant_write().map_err(ModelError::Pool)?;
        #[cfg(feature = "fault-injection")]
        if fault_active("stale-kv") {
            // A broken prefill, on purpose: it computes only the first token and leaves the
            // rest of the pages as the last request left them, yet reports them all, with
            // digests of what is there. Coverage checks pass; only the outputs show it.
            self.model
                .prefill(&tokens[..1.min(tokens.len())], &mut grant)?;
            let digests = (0..grant.pages().len())
                .map(|i| grant.page_mut(i).map(|p| page_digest(p)))
                .collect::<Result<Vec<u32>, PoolError>>()
                .map_err(ModelError::Pool)?;
            return Ok(Some((grant.pages().to_vec(), digests)));
        }
        let mut last_check = Instant::now();
        let finished = self
            .model
            .prefill_owned(owner, tokens, &mut grant, &mut |_| {
                let now = Instant::now();
                if now.saturating_duration_since(last_check) < ABANDON_CHECK {
                    return true;
                }
                last_check = now;
                !link.abandoned(owner)
            })?;
        if !finished {
            return Ok(None);
        }
        let digests = (0..grant.pages().len())
            .map(|i| grant.page_mut(i).map(|p| page_digest(p)))
            .collect::<Result<Vec<u32>, PoolError>>()
            .map_err(ModelError::Pool)?;
        #[cfg(feature = "fault-injection")]
        if fault_active("corrupt-page-once")
            && !CORRUPTED.swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            // A page changed after its digest, once per process: what a bad link, a stray
            // DMA or a buggy kernel would do. decoded's digest check must catch it.
            let page = grant.page_mut(0).map_err(ModelError::Pool)?;
            page[0] ^= 0x40;
            log::warn!("fault corrupt-page-once: flipped a bit of {owner}'s first page");
        }
        Ok(Some((grant.pages().to_vec(), digests)))
    }

    /// Release or Abort: drops the owner's pages and reports them freed.
    fn release(&mut self, link: &mut Link, id: RequestId, owner: Owner, abort: bool) {
        if let Err(reason) = self.check_owner(id, owner) {
            if abort {
                // Abort for an owner this worker cannot hold is ignored (request flow, 8).
                debug!("ignoring Abort for {owner}: {reason}");
            } else {
                refuse(link, id, ErrorCode::BadRequest, reason);
            }
            return;
        }
        if abort {
            add(&self.counters.aborts, 1);
        }
        let Some(served) = self.held.lock().remove(&owner) else {
            debug!("nothing held for {owner}; ignoring");
            return;
        };
        debug!("releasing {owner}");
        self.releasing.push((owner, served));
        self.settle(link);
    }

    /// Frees and reports the released owners no page server connection still sends.
    fn settle(&mut self, link: &mut Link) {
        let mut i = 0;
        while i < self.releasing.len() {
            if Arc::strong_count(&self.releasing[i].1) == 1 {
                let (owner, served) = self.releasing.swap_remove(i);
                let pages = page_count(&served.res);
                drop(served);
                debug!("freed {owner} ({pages} pages)");
                self.freed(link, owner, pages);
            } else {
                i += 1;
            }
        }
    }

    /// Frees what kvctld's loss left held once no decode job and no page server connection
    /// can still read it. Nothing is reported: the kvctld these pages were lent by is gone.
    fn settle_orphans(&mut self, now: Instant) {
        self.orphaned.retain(|(until, served)| {
            let keep = *until > now || Arc::strong_count(served) > 1;
            if !keep {
                let pages = page_count(&served.res);
                add(&self.counters.freed_pages, u64::from(pages));
                debug!("freed {pages} pages held when kvctld was lost");
            }
            keep
        });
    }
}

impl Worker for Prefill {
    fn refresh_report(&mut self, link: &mut Link) {
        worker::report_if_changed(link, &self.pool, || self.counters.snapshot());
    }

    fn load(&self) -> Load {
        Load {
            usage: self.pool.usage(),
            counters: self.counters.snapshot(),
            in_flight: u32::try_from(self.held.lock().len()).unwrap_or(u32::MAX),
        }
    }

    fn can_register(&self) -> bool {
        self.held.lock().is_empty()
            && self.releasing.is_empty()
            && self.orphaned.is_empty()
            && self.pool.usage().free == self.pool.pages()
    }

    fn on_registered(&mut self, link: &mut Link, ack: &RegisterAck) {
        self.generation = Some(ack.generation);
        self.max_context = ack.max_context;
        self.report(link);
    }

    fn on_frame(&mut self, link: &mut Link, header: Header, msg: Message, _fds: Vec<OwnedFd>) {
        let id = header.request_id;
        match msg {
            Message::PrefillRun(run) => self.prefill(link, id, run),
            Message::Release(m) => self.release(link, id, m.owner, false),
            Message::Abort(m) => self.release(link, id, m.owner, true),
            Message::Error(e) => debug!("kvctld reported for {id}: {}: {}", e.code, e.message),
            other => {
                let reason = format!("{:?} is not for a prefill worker", other.msg_type());
                refuse(link, id, ErrorCode::BadRequest, reason);
            }
        }
    }

    fn on_lost(&mut self) {
        // The connection is gone: nobody will Release these pages. A decode worker may still
        // be copying some of them from its read-only map of the pool (a page server
        // connection or RDMA session holds its own reference instead), and freeing would
        // poison or reuse pages under its copy. Its job stops pulling by its transfer
        // deadline, and before the request's deadline, which ends no later than ours: the
        // pages stay until the earlier of the two, then go back to the free list.
        let now = Instant::now();
        let held: Vec<Arc<Served>> = self.held.lock().drain().map(|(_, s)| s).collect();
        for served in held {
            let until = (now + self.orphan_hold).min(served.expires);
            self.orphaned.push((until, served));
        }
        // Released already: decode is done with them, only the page server may hold them.
        self.orphaned
            .extend(self.releasing.drain(..).map(|(_, served)| (now, served)));
        self.generation = None;
    }

    fn on_wake(&mut self, link: &mut Link) {
        self.settle(link);
        self.settle_orphans(Instant::now());
    }

    fn next_deadline(&self) -> Option<Instant> {
        let poll = (!self.releasing.is_empty() || !self.orphaned.is_empty())
            .then(|| Instant::now() + RELEASE_POLL);
        let orphans = self.orphaned.iter().map(|(until, _)| *until);
        self.held
            .lock()
            .values()
            .map(|h| h.expires)
            .chain(orphans)
            .chain(poll)
            .min()
    }

    fn expire(&mut self, link: &mut Link, now: Instant) {
        let expired: Vec<(Owner, Arc<Served>)> = {
            let mut held = self.held.lock();
            let owners: Vec<Owner> = held
                .iter()
                .filter(|(_, h)| h.expires <= now)
                .map(|(o, _)| *o)
                .collect();
            owners
                .into_iter()
                .filter_map(|o| held.remove(&o).map(|h| (o, h)))
                .collect()
        };
        for (owner, served) in expired {
            debug!("request deadline passed for {owner}; releasing");
            self.releasing.push((owner, served));
        }
        self.settle(link);
        self.settle_orphans(now);
    }

    fn shutdown(&mut self, link: &mut Link) {
        // Stop the page server first: its connections let go of every page.
        drop(self.server.take());
        let held: Vec<(Owner, Arc<Served>)> = self.held.lock().drain().collect();
        self.releasing.extend(held);
        self.settle(link);
    }
}

/// Set once `corrupt-page-once` has corrupted its page.
#[cfg(feature = "fault-injection")]
static CORRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the fault `name` is switched on in `KVFENCE_FAULT` (comma-separated). Only in
/// builds with the `fault-injection` feature, which exist to show that the isolation suite
/// and the coherence probe catch a broken build.
#[cfg(feature = "fault-injection")]
fn fault_active(name: &str) -> bool {
    std::env::var("KVFENCE_FAULT").is_ok_and(|v| v.split(',').any(|f| f.trim() == name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use libkv::config::{Backend, TransportKind};
    use libkv::memory::ForeignPool;
    use libkv::proto::{Abort, DecodeReserve, Release};
    use libkv::proto::{Drain, Role};
    use libkv::sys::memfd;
    use libkv::testkit::{self, FakeKvctld, GEN, counter, drain_reply, owner, test_config};
    use libkv::worker::{EXIT_CONFIG, LinkError, WorkerError};
    use std::io::Write;
    use std::os::fd::AsFd;

    const PROMPT: &[u8] = b"the quick brown fox jumps over the lazy dog";

    fn start(cfg: Config) -> testkit::Daemon {
        testkit::Daemon::start(run, cfg)
    }

    fn run_msg(request: u64, prompt: &[u8]) -> PrefillRun {
        PrefillRun {
            owner: owner(request),
            prompt: libkv::model::tokenize(prompt),
        }
    }

    fn expect_error(msg: Message, code: ErrorCode) -> String {
        match msg {
            Message::Error(e) if e.code == code => e.message,
            other => panic!("expected Error {code}, got {other:?}"),
        }
    }

    #[test]
    fn prefill_writes_digested_pages_and_release_frees_them() {
        let kvctld = FakeKvctld::new();
        let cfg = test_config(kvctld.socket.clone());
        let daemon = start(cfg.clone());
        let mut peer = kvctld.accept();
        let (reg, fd) = peer.handshake(&cfg);
        assert_eq!(reg.id, "prefill", "the default id is the role's name");
        assert_eq!(reg.role, Role::Prefill);
        assert_eq!(reg.geometry, cfg.geometry);
        assert_eq!(reg.pool_pages, cfg.prefill.pool_pages);
        let fd = fd.expect("prefill registers its pool fd");
        assert!(
            !memfd::is_writable(&fd).unwrap(),
            "the pool fd is read-only"
        );

        peer.send(RequestId(1), run_msg(1, PROMPT));
        let (h, msg) = peer.next_frame();
        assert_eq!(h.request_id, RequestId(1));
        let Message::PrefillDone(PrefillDone { manifest }) = msg else {
            panic!("expected PrefillDone, got {msg:?}");
        };
        let n = u32::try_from(PROMPT.len()).unwrap();
        assert_eq!(manifest.owner, owner(1));
        assert_eq!(manifest.tokens, n);
        let pages = cfg.geometry.pages_for_tokens(u64::from(n));
        assert_eq!(manifest.pages.len() as u64, pages);
        // The digests are those of the pages as decoded would see them through the fd.
        let page_bytes = cfg.geometry.bytes_per_page();
        let foreign = ForeignPool::map(fd.as_fd(), page_bytes, cfg.prefill.pool_pages).unwrap();
        let mut buf = vec![0u8; usize::try_from(page_bytes).unwrap()];
        for (p, d) in manifest.pages.iter().zip(&manifest.digests) {
            foreign.copy_page(*p, &mut buf).unwrap();
            assert_eq!(page_digest(&buf), *d);
        }
        let report = peer.pool_report();
        assert_eq!(u64::from(report.reserved), pages);

        peer.send(RequestId(1), Release { owner: owner(1) });
        let (h, msg) = peer.next_frame();
        assert_eq!(h.request_id, RequestId(1));
        assert_eq!(
            msg,
            Message::Freed(Freed {
                owner: owner(1),
                pages: u32::try_from(pages).unwrap()
            })
        );
        let report = peer.pool_report();
        assert_eq!(report.free, cfg.prefill.pool_pages);
        assert_eq!(counter(&report, "prefill_runs"), 1);
        assert_eq!(counter(&report, "pages_written"), pages);
        assert_eq!(counter(&report, "freed_pages"), pages);
        assert_eq!(counter(&report, "frames_received"), 4);
        // A second Release of the same owner is ignored: one Freed per owner.
        peer.send(RequestId(1), Release { owner: owner(1) });
        daemon.stop().unwrap();
        peer.expect_closed();
    }

    #[test]
    fn untrusted_frames_get_errors_and_abort_frees() {
        let kvctld = FakeKvctld::new();
        let cfg = test_config(kvctld.socket.clone());
        let daemon = start(cfg.clone());
        let mut peer = kvctld.accept();
        peer.handshake(&cfg);

        // Another generation.
        let stale = Owner {
            request: RequestId(2),
            generation: Generation(GEN.0 + 1),
        };
        peer.send(
            RequestId(2),
            PrefillRun {
                owner: stale,
                prompt: libkv::model::tokenize(PROMPT),
            },
        );
        let reason = expect_error(peer.next_frame().1, ErrorCode::BadRequest);
        assert!(reason.contains("generation"), "{reason}");
        // A frame id that is not the owner's request.
        peer.send(RequestId(3), run_msg(2, PROMPT));
        expect_error(peer.next_frame().1, ErrorCode::BadRequest);
        // A prompt over max_context.
        peer.send(RequestId(4), run_msg(4, &vec![b'x'; 257]));
        expect_error(peer.next_frame().1, ErrorCode::BadRequest);
        // Nothing was reserved, and kvctld hears so: one Freed of 0 pages.
        assert!(
            matches!(peer.next_frame().1, Message::Freed(f) if f.owner == owner(4) && f.pages == 0)
        );
        // A message for the other role.
        peer.send(
            RequestId(5),
            DecodeReserve {
                owner: owner(5),
                prompt_tokens: 1,
                max_new_tokens: 1,
            },
        );
        expect_error(peer.next_frame().1, ErrorCode::BadRequest);

        // A good request, then a duplicate of it, then Abort.
        peer.send(RequestId(2), run_msg(2, PROMPT));
        assert!(matches!(peer.next_frame().1, Message::PrefillDone(_)));
        peer.send(RequestId(2), run_msg(2, PROMPT));
        let reason = expect_error(peer.next_frame().1, ErrorCode::BadRequest);
        assert!(reason.contains("duplicate"), "{reason}");
        // Release of a stale owner is refused, Abort of an unknown one ignored.
        peer.send(RequestId(2), Release { owner: stale });
        expect_error(peer.next_frame().1, ErrorCode::BadRequest);
        peer.send(
            RequestId(9),
            Abort {
                owner: owner(9),
                code: ErrorCode::Timeout,
                reason: "test".into(),
            },
        );
        peer.send(
            RequestId(2),
            Abort {
                owner: owner(2),
                code: ErrorCode::Timeout,
                reason: "test".into(),
            },
        );
        let (h, msg) = peer.next_frame();
        assert_eq!(h.request_id, RequestId(2));
        assert!(matches!(msg, Message::Freed(Freed { owner: o, pages: 3 }) if o == owner(2)));
        let report = peer.pool_report();
        assert_eq!(report.free, cfg.prefill.pool_pages);
        assert_eq!(counter(&report, "aborts"), 2);
        assert_eq!(counter(&report, "prefill_runs"), 1);
        daemon.stop().unwrap();
    }

    #[test]
    fn request_deadline_frees_unreleased_pages() {
        let kvctld = FakeKvctld::new();
        let mut cfg = test_config(kvctld.socket.clone());
        cfg.deadlines.bootstrap = 100;
        cfg.deadlines.transfer = 100;
        cfg.deadlines.request = 300;
        cfg.validate().unwrap();
        let daemon = start(cfg.clone());
        let mut peer = kvctld.accept();
        peer.handshake(&cfg);
        let start = Instant::now();
        peer.send(RequestId(1), run_msg(1, PROMPT));
        assert!(matches!(peer.next_frame().1, Message::PrefillDone(_)));
        assert!(matches!(peer.next_frame().1, Message::Freed(f) if f.owner == owner(1)));
        assert!(start.elapsed() >= Duration::from_millis(300));
        assert_eq!(peer.pool_report().free, cfg.prefill.pool_pages);
        daemon.stop().unwrap();
    }

    #[test]
    fn waits_for_kvctld_and_reconnects_after_drop_or_bad_frame() {
        let mut kvctld = FakeKvctld::unbound();
        let mut cfg = test_config(kvctld.socket.clone());
        // Pages held when kvctld goes are kept for a transfer deadline (the test below).
        cfg.deadlines.transfer = 200;
        let daemon = start(cfg.clone());
        // kvctld is not there yet: the worker keeps retrying.
        std::thread::sleep(Duration::from_millis(350));
        kvctld.bind();
        let mut peer = kvctld.accept();
        peer.handshake(&cfg);
        peer.send(RequestId(1), run_msg(1, PROMPT));
        assert!(matches!(peer.next_frame().1, Message::PrefillDone(_)));

        // kvctld goes away while pages are held: they are dropped once no pull can still
        // read them, and the worker registers again with an empty pool (handshake checks the
        // PoolReport).
        drop(peer);
        let mut peer = kvctld.accept();
        peer.handshake(&cfg);

        // A frame that fails validation is fatal for the connection.
        peer.stream.write_all(&[0xAB; 24]).unwrap();
        peer.expect_closed();
        let mut peer = kvctld.accept();
        peer.handshake(&cfg);

        // kvctld refusing the Hello: the worker retries later.
        drop(peer);
        let mut peer = kvctld.accept();
        let _hello = peer.recv();
        peer.send(
            RequestId(0),
            libkv::proto::Error {
                code: ErrorCode::Unauthorized,
                message: "not allowed".into(),
            },
        );
        peer.expect_closed();
        let mut peer = kvctld.accept();
        peer.handshake(&cfg);
        daemon.stop().unwrap();
    }

    #[test]
    fn a_kvctld_older_than_one_registered_with_is_never_served() {
        let kvctld = FakeKvctld::new();
        let cfg = test_config(kvctld.socket.clone());
        let daemon = start(cfg.clone());
        let mut peer = kvctld.accept();
        peer.handshake(&cfg);
        // The connection drops; what answers next is a kvctld of an older generation (a
        // deposed one, reached at the same address): the worker registers nothing with it.
        drop(peer);
        let old = libkv::Generation(GEN.0 - 1);
        let ack = libkv::proto::HelloAck {
            version: libkv::proto::PROTOCOL_VERSION,
            generation: old,
        };
        let mut peer = kvctld.accept();
        let (_, hello, _) = peer.recv();
        assert!(matches!(hello, Message::Hello(_)), "{hello:?}");
        peer.send(RequestId(0), ack.clone());
        peer.expect_closed();
        // Again, and it replays a command of its epoch right behind its answer, as a
        // partitioned leader whose frames arrive late would. One write for both, so the
        // worker closing on the first cannot fail the test's send.
        let replay = PrefillRun {
            owner: Owner {
                generation: old,
                ..owner(1)
            },
            ..run_msg(1, PROMPT)
        };
        let mut peer = kvctld.accept();
        let (_, hello, _) = peer.recv();
        assert!(matches!(hello, Message::Hello(_)), "{hello:?}");
        let mut bytes = Message::from(ack).encode(RequestId(0)).unwrap();
        bytes.extend(Message::from(replay).encode(RequestId(1)).unwrap());
        peer.stream.write_all(&bytes).unwrap();
        // Closed with nothing but pool reports: no PrefillDone, no Error naming the request.
        peer.expect_closed();
        // The kvctld of the newest generation is served again, and the old command never
        // ran: nothing was prefilled and every page is free.
        let mut peer = kvctld.accept();
        peer.handshake(&cfg);
        let report = peer
            .report
            .clone()
            .expect("the PoolReport of the handshake");
        assert_eq!(counter(&report, "prefill_runs"), 0);
        assert_eq!(report.free, cfg.prefill.pool_pages);
        peer.send(RequestId(1), run_msg(1, PROMPT));
        assert!(matches!(peer.next_frame().1, Message::PrefillDone(_)));
        daemon.stop().unwrap();
    }

    #[test]
    fn pages_held_when_kvctld_is_lost_stay_until_no_pull_can_read_them() {
        // A decode worker may be copying a request's pages from its map of the pool when
        // kvctld dies. Freeing them at once would poison (or reuse) them under its copy.
        let kvctld = FakeKvctld::new();
        let mut cfg = test_config(kvctld.socket.clone());
        let hold = Duration::from_millis(3000);
        cfg.deadlines.transfer = u32::try_from(hold.as_millis()).unwrap();
        let daemon = start(cfg.clone());
        let mut peer = kvctld.accept();
        let (_, fd) = peer.handshake(&cfg);
        let fd = fd.expect("prefill registers its pool fd");
        let page_bytes = cfg.geometry.bytes_per_page();
        let foreign = ForeignPool::map(fd.as_fd(), page_bytes, cfg.prefill.pool_pages).unwrap();
        peer.send(RequestId(1), run_msg(1, PROMPT));
        let Message::PrefillDone(PrefillDone { manifest }) = peer.next_frame().1 else {
            panic!("expected PrefillDone");
        };
        let lost = Instant::now();
        drop(peer);

        // Well inside the transfer deadline, a copy still reads what prefill wrote.
        std::thread::sleep(Duration::from_millis(300));
        let mut buf = vec![0u8; usize::try_from(page_bytes).unwrap()];
        for (p, d) in manifest.pages.iter().zip(&manifest.digests) {
            foreign.copy_page(*p, &mut buf).unwrap();
            assert!(
                lost.elapsed() < hold,
                "the check ran too late to mean anything"
            );
            assert_eq!(
                page_digest(&buf),
                *d,
                "page {p} changed after kvctld was lost"
            );
        }
        // The worker comes back only once the pages are free, after the deadline.
        let mut peer = kvctld.accept();
        assert!(
            lost.elapsed() >= hold,
            "registered again after {:?}, before the transfer deadline",
            lost.elapsed()
        );
        peer.handshake(&cfg);
        daemon.stop().unwrap();
    }

    #[test]
    fn cuda_backend_refuses_to_start_naming_what_is_missing() {
        let mut cfg = test_config("/nonexistent/kvctld.sock".into());
        cfg.prefill.backend = Backend::Cuda;
        let err = run(cfg, RunOptions::default()).unwrap_err();
        assert_eq!(err.exit_code(), EXIT_CONFIG);
        let chain = libkv::error_chain(&err);
        if libkv::memory::cuda::driver_present() {
            // A host with a driver: the model of [model] runs on the CPU.
            assert!(chain.contains("runs on the host CPU"), "{chain}");
        } else {
            assert_eq!(
                chain,
                "[prefill] backend = \"cuda\" (cuda_device = 0) cannot run on this host; set \
                 backend = \"host\" to run the pool in host memory: the CUDA driver library \
                 libcuda.so.1 cannot be loaded: no NVIDIA driver is installed on this host, or \
                 it is not on the loader path"
            );
        }
    }

    #[test]
    fn stop_frees_held_pages_and_exits_ok() {
        let kvctld = FakeKvctld::new();
        let cfg = test_config(kvctld.socket.clone());
        let daemon = start(cfg.clone());
        let mut peer = kvctld.accept();
        peer.handshake(&cfg);
        peer.send(RequestId(1), run_msg(1, PROMPT));
        assert!(matches!(peer.next_frame().1, Message::PrefillDone(_)));
        daemon.stop().unwrap();
        assert!(matches!(peer.next_frame().1, Message::Freed(f) if f.owner == owner(1)));
        assert_eq!(peer.pool_report().free, cfg.prefill.pool_pages);
        peer.expect_closed();
    }

    #[test]
    fn a_refusal_for_good_ends_run_with_the_config_exit_code() {
        let kvctld = FakeKvctld::new();
        let cfg = test_config(kvctld.socket.clone());
        let daemon = start(cfg.clone());
        // A refusal kvctld may lift later: the worker comes back.
        let mut peer = kvctld.accept();
        peer.hello();
        peer.send(
            RequestId(0),
            libkv::proto::Error {
                code: ErrorCode::ShuttingDown,
                message: "kvctld is restarting".into(),
            },
        );
        peer.expect_closed();
        // One it never will: run returns with the configuration exit code, no retry.
        let mut peer = kvctld.accept();
        peer.hello();
        peer.send(
            RequestId(0),
            libkv::proto::Error {
                code: ErrorCode::Misconfigured,
                message: "a pool of 64 pages cannot hold max_context 4096".into(),
            },
        );
        let err = daemon.wait().unwrap_err();
        assert!(
            matches!(&err, WorkerError::Link(LinkError::Misconfigured { id, .. }) if id == "prefill"),
            "{err:?}"
        );
        assert_eq!(err.exit_code(), EXIT_CONFIG);
        assert_eq!(
            libkv::error_chain(&err),
            "kvctld refused the registration of worker prefill: \
             a pool of 64 pages cannot hold max_context 4096"
        );
        peer.expect_closed();
    }

    /// A config whose drain deadline is far beyond [`testkit::WAIT`]: a test that sees the
    /// worker stop in time saw it stop for another reason.
    fn long_drain(kvctld: &FakeKvctld) -> Config {
        let mut cfg = test_config(kvctld.socket.clone());
        cfg.deadlines.drain = 600_000;
        cfg.validate().unwrap();
        cfg
    }

    #[test]
    fn stop_drains_serves_what_is_assigned_and_ends_at_drain_reply() {
        let kvctld = FakeKvctld::new();
        let mut cfg = long_drain(&kvctld);
        cfg.worker.id = Some("prefill@gpu3".into());
        let daemon = start(cfg.clone());
        let mut peer = kvctld.accept();
        let (reg, _) = peer.handshake(&cfg);
        assert_eq!(reg.id, "prefill@gpu3");
        peer.send(RequestId(1), run_msg(1, PROMPT));
        assert!(matches!(peer.next_frame().1, Message::PrefillDone(_)));

        daemon.request_stop();
        let (h, msg) = peer.next_frame();
        assert_eq!(h.request_id, RequestId(0));
        assert_eq!(
            msg,
            Message::Drain(Drain {
                worker: "prefill@gpu3".into(),
                drain: true
            })
        );
        // Paired before the drain reached kvctld: still served, and so are releases.
        peer.send(RequestId(2), run_msg(2, PROMPT));
        assert!(matches!(peer.next_frame().1, Message::PrefillDone(_)));
        for request in [1, 2] {
            peer.send(
                RequestId(request),
                Release {
                    owner: owner(request),
                },
            );
            assert!(matches!(peer.next_frame().1, Message::Freed(f) if f.owner == owner(request)));
        }
        assert_eq!(peer.pool_report().free, cfg.prefill.pool_pages);
        assert!(daemon.try_result().is_none(), "stopped before DrainReply");
        peer.send(RequestId(0), drain_reply(&reg));
        daemon.wait().unwrap();
        peer.expect_closed();
    }

    #[test]
    fn drain_ends_at_its_deadline_and_frees_what_is_held() {
        let kvctld = FakeKvctld::new();
        let mut cfg = test_config(kvctld.socket.clone());
        cfg.deadlines.drain = 300;
        cfg.validate().unwrap();
        let daemon = start(cfg.clone());
        let mut peer = kvctld.accept();
        peer.handshake(&cfg);
        peer.send(RequestId(1), run_msg(1, PROMPT));
        assert!(matches!(peer.next_frame().1, Message::PrefillDone(_)));
        let asked = Instant::now();
        daemon.request_stop();
        assert!(matches!(peer.next_frame().1, Message::Drain(_)));
        // No DrainReply: the worker stops at the deadline, freeing what it still holds.
        assert!(matches!(peer.next_frame().1, Message::Freed(f) if f.owner == owner(1)));
        assert!(asked.elapsed() >= Duration::from_millis(300));
        assert_eq!(peer.pool_report().free, cfg.prefill.pool_pages);
        daemon.wait().unwrap();
        peer.expect_closed();
    }

    #[test]
    fn a_second_stop_request_does_not_wait_for_the_drain() {
        let kvctld = FakeKvctld::new();
        let cfg = long_drain(&kvctld);
        let daemon = start(cfg.clone());
        let mut peer = kvctld.accept();
        peer.handshake(&cfg);
        peer.send(RequestId(1), run_msg(1, PROMPT));
        assert!(matches!(peer.next_frame().1, Message::PrefillDone(_)));
        daemon.request_stop();
        assert!(matches!(peer.next_frame().1, Message::Drain(_)));
        daemon.request_stop();
        assert!(matches!(peer.next_frame().1, Message::Freed(f) if f.owner == owner(1)));
        daemon.wait().unwrap();
        peer.expect_closed();
    }

    #[test]
    fn stop_while_not_registered_is_immediate() {
        let kvctld = FakeKvctld::unbound();
        let cfg = long_drain(&kvctld);
        let daemon = start(cfg);
        daemon.request_stop();
        daemon.wait().unwrap();
    }

    #[test]
    fn page_servers_on_port_0_share_one_config() {
        let kvctld = FakeKvctld::new();
        let mut cfg = test_config(kvctld.socket.clone());
        cfg.transfer.transport = TransportKind::Tcp;
        cfg.transfer.listen = Some("127.0.0.1:0".into());
        cfg.validate().unwrap();
        let mut endpoints = Vec::new();
        let mut daemons = Vec::new();
        for id in ["prefill-a", "prefill-b"] {
            let mut cfg = cfg.clone();
            cfg.worker.id = Some(id.into());
            daemons.push(start(cfg.clone()));
            let mut peer = kvctld.accept();
            let (reg, fd) = peer.handshake(&cfg);
            assert_eq!(reg.id, id);
            assert!(fd.is_none(), "no pool fd over TCP");
            assert_eq!(reg.transports, vec![Transport::Tcp]);
            let endpoint = reg.endpoint.expect("a page server");
            let addr: std::net::SocketAddr = endpoint.addr.parse().unwrap();
            assert_eq!(addr.ip().to_string(), "127.0.0.1");
            assert_ne!(addr.port(), 0, "the bound port is registered");
            std::net::TcpStream::connect(addr).expect("the page server listens there");
            endpoints.push((addr, peer));
        }
        assert_ne!(endpoints[0].0, endpoints[1].0);
        for daemon in daemons {
            daemon.stop().unwrap();
        }
    }
}
