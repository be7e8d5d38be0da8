//! Pool registration and per-request memory windows.
//!
//! A pool is registered once ([`RegisteredPool`]) with remote access and the right to bind
//! memory windows; the pool's rkey never leaves the process. Each request gets a type-2
//! window ([`RequestWindow`]) bound over exactly its run of pages, on the QP that serves
//! the peer, and a fresh rkey: the peer can reach those pages and no others. When the
//! request ends the window is invalidated (LOCAL_INV) and the rkey is dead, even for a peer
//! that kept it.
//!
//! Windows hold their QP, so a QP is only destroyed once every window bound on it has been
//! invalidated (destroying a QP with a bound window stalls the kernel for about a minute).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::io;
use std::os::fd::AsFd;
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, PollCompletionQueueError};
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, QueuePair, QueuePairAttribute, QueuePairState, SendOperationFlags,
};

use super::{RdmaDevice, RdmaError};
use crate::ids::PageId;
use crate::memory::{HostMemory, PoolMemory};
use crate::pool::PagePool;
use crate::rdma::ReadStats;
use crate::sys::rdma as sys;

/// How long a work request may take to complete before it is reported as stuck.
const COMPLETION_TIMEOUT: Duration = Duration::from_secs(5);

/// Largest single RDMA READ: contiguous page runs are coalesced up to this size.
pub const MAX_READ_BYTES: u64 = 1 << 20;

/// Most RDMA READs one [`RdmaQp::read_pages`] keeps posted at once.
const READS_POSTED: usize = 64;

fn verb(op: &'static str) -> impl FnOnce(io::Error) -> RdmaError {
    move |source| RdmaError::Verb { op, source }
}

fn boxed(op: &'static str) -> impl FnOnce(Box<dyn std::error::Error + Send + Sync>) -> RdmaError {
    move |e| RdmaError::Verb {
        op,
        source: io::Error::other(e),
    }
}

/// What a QP's peer needs to connect to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpEndpoint {
    pub qp_num: u32,
    pub psn: u32,
    pub gid: Gid,
}

/// One completed work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    /// `ibv_wc_status` (0 = success; 10 = remote access error).
    pub status: u32,
}

impl Completion {
    /// Whether the request succeeded.
    pub fn is_success(&self) -> bool {
        self.status == rdma_mummy_sys::ibv_wc_status::IBV_WC_SUCCESS
    }

    /// Whether the peer refused the access (bad or invalidated rkey, out of bounds).
    pub fn is_remote_access_error(&self) -> bool {
        self.status == rdma_mummy_sys::ibv_wc_status::IBV_WC_REM_ACCESS_ERR
    }
}

/// One page (or run of pages) to read: where it lands here and where it is on the peer.
#[derive(Debug)]
pub struct PageRead<'a> {
    /// The destination, inside the memory region given to [`RdmaQp::read_pages`].
    pub dst: &'a mut [u8],
    /// The window key the peer handed out for this page.
    pub rkey: u32,
    /// The page's address in the peer's window.
    pub raddr: u64,
}

/// A reliable-connected QP on a basic CQ, able to read, write, bind windows and invalidate
/// them.
pub struct RdmaQp {
    qp: ExtendedQueuePair,
    cq: Arc<BasicCompletionQueue>,
    pd: Arc<ProtectionDomain>,
    port: u8,
    gid_index: u32,
    read_depth: u8,
    local: QpEndpoint,
    next_wr: Cell<u64>,
    done: RefCell<HashMap<u64, u32>>,
}

impl std::fmt::Debug for RdmaQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaQp")
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl RdmaQp {
    /// Creates a QP in `pd` on `dev`'s port, in INIT. With `remote_access` the peer may
    /// read and write through the windows bound on this QP; without, the peer can reach
    /// nothing on this side whatever key it holds.
    pub fn new(
        dev: &RdmaDevice,
        pd: &Arc<ProtectionDomain>,
        psn: u32,
        remote_access: bool,
    ) -> Result<RdmaQp, RdmaError> {
        // Basic CQs: extended ones report phantom completions on rxe (rdma-core 44).
        let cq = dev
            .context()
            .create_cq_builder()
            .setup_cqe(256)
            .build()
            .map_err(|e| boxed("ibv_create_cq")(Box::new(e)))?;
        // The send ops replace sideway's defaults, so every one used is listed; without
        // BindMemoryWindow / LocalInvalidate the ibv_wr_* entry points are null.
        let mut qp = pd
            .create_qp_builder()
            .setup_max_send_wr(u32::try_from(READS_POSTED * 2).unwrap_or(128))
            .setup_max_recv_wr(1)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_send_cq(Arc::clone(&cq))
            .setup_recv_cq(Arc::clone(&cq))
            .setup_send_ops_flags(
                SendOperationFlags::Write
                    | SendOperationFlags::Read
                    | SendOperationFlags::BindMemoryWindow
                    | SendOperationFlags::LocalInvalidate,
            )
            .build_ex()
            .map_err(|e| boxed("ibv_create_qp_ex")(Box::new(e)))?;
        let access = if remote_access {
            AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead
        } else {
            AccessFlags::LocalWrite
        };
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(dev.port())
            .setup_access_flags(access);
        qp.modify(&attr)
            .map_err(|e| boxed("ibv_modify_qp(INIT)")(Box::new(e)))?;
        let local = QpEndpoint {
            qp_num: qp.qp_number(),
            psn: psn & 0x00ff_ffff,
            gid: dev.gid(),
        };
        Ok(RdmaQp {
            qp,
            cq,
            pd: Arc::clone(pd),
            port: dev.port(),
            gid_index: dev.gid_index(),
            read_depth: dev.read_depth(),
            local,
            next_wr: Cell::new(1),
            done: RefCell::new(HashMap::new()),
        })
    }

    /// What the peer needs to connect to this QP.
    pub fn endpoint(&self) -> QpEndpoint {
        self.local
    }

    /// Moves the QP to RTR then RTS, connected to `remote`.
    pub fn connect(&mut self, remote: &QpEndpoint) -> Result<(), RdmaError> {
        let gid_index = u8::try_from(self.gid_index)
            .map_err(|_| verb("ibv_modify_qp(RTR)")(io::Error::other("GID index above 255")))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(Mtu::Mtu1024)
            .setup_dest_qp_num(remote.qp_num)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(self.read_depth)
            .setup_min_rnr_timer(12);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(0)
            .setup_port(self.port)
            .setup_service_level(0)
            .setup_grh_src_gid_index(gid_index)
            .setup_grh_dest_gid(&remote.gid)
            .setup_grh_hop_limit(1);
        attr.setup_address_vector(&ah);
        self.qp
            .modify(&attr)
            .map_err(|e| boxed("ibv_modify_qp(RTR)")(Box::new(e)))?;
        let mut attr = QueuePairAttribute::new();
        // retry_cnt 7 would retry forever: a dead peer must end in an error completion.
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.local.psn)
            .setup_timeout(14)
            .setup_retry_cnt(6)
            .setup_rnr_retry(6)
            .setup_max_read_atomic(self.read_depth);
        self.qp
            .modify(&attr)
            .map_err(|e| boxed("ibv_modify_qp(RTS)")(Box::new(e)))
    }

    /// The protection domain of this QP.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    fn wr_id(&self) -> u64 {
        let id = self.next_wr.get();
        self.next_wr.set(id + 1);
        id
    }

    /// Moves every completion the CQ holds into `done`.
    fn poll(&self) -> Result<(), RdmaError> {
        match self.cq.start_poll() {
            Ok(poller) => {
                // drain the whole batch: a dropped poller loses the rest
                let mut done = self.done.borrow_mut();
                for wc in poller {
                    done.insert(wc.wr_id(), wc.status());
                }
                Ok(())
            }
            Err(PollCompletionQueueError::CompletionQueueEmpty) => Ok(()),
            Err(e) => Err(boxed("ibv_poll_cq")(Box::new(e))),
        }
    }

    /// Waits for the completion of `wr_id`, keeping the others it drains for later.
    pub fn wait(&self, wr_id: u64) -> Result<Completion, RdmaError> {
        let deadline = Instant::now() + COMPLETION_TIMEOUT;
        loop {
            if let Some(status) = self.done.borrow_mut().remove(&wr_id) {
                return Ok(Completion { wr_id, status });
            }
            self.poll()?;
            if Instant::now() > deadline {
                return Err(RdmaError::Stuck {
                    wr_id,
                    after: COMPLETION_TIMEOUT,
                });
            }
            std::hint::spin_loop();
        }
    }

    /// RDMA WRITE of `src` (inside `src_mr`) to `raddr` under `rkey`; returns its completion,
    /// which says whether the peer accepted it.
    pub fn write(
        &self,
        src_mr: &MemoryRegion,
        src: &[u8],
        rkey: u32,
        raddr: u64,
    ) -> Result<Completion, RdmaError> {
        let base = src_mr.get_ptr() as u64;
        let laddr = src.as_ptr() as u64;
        if laddr < base || laddr + src.len() as u64 > base + src_mr.region_len() as u64 {
            return Err(RdmaError::OutOfRange {
                what: "write source outside its memory region",
            });
        }
        let len = u32::try_from(src.len()).map_err(|_| RdmaError::OutOfRange {
            what: "write longer than 4 GiB",
        })?;
        let wr = self.wr_id();
        // SAFETY: `src` is borrowed until the completion below, and lies inside `src_mr`
        // (checked above), which the caller keeps registered for the borrow.
        unsafe {
            sys::post_rdma(
                &self.qp,
                wr,
                sys::RdmaOp::Write,
                src_mr.lkey(),
                laddr,
                len,
                rkey,
                raddr,
            )
        }
        .map_err(verb("ibv_wr_rdma_write"))?;
        self.wait(wr)
    }
}

impl RdmaQp {
    /// Moves the QP to the error state: every posted request completes (flushed) and the
    /// peer can no longer reach anything through it.
    pub fn fail(&mut self) -> Result<(), RdmaError> {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        self.qp
            .modify(&attr)
            .map_err(|e| boxed("ibv_modify_qp(ERR)")(Box::new(e)))
    }

    /// Reads `pages` from the peer with RDMA READs into memory registered under `mr`,
    /// coalescing pages contiguous on both sides (up to [`MAX_READ_BYTES`]), with up to 64
    /// reads posted at once. `keep_going` is asked between completions; when it says stop,
    /// or a read fails, the QP is failed and drained.
    ///
    /// The QP is consumed and given back only on success: on any error it is destroyed
    /// before this returns, so no read still in flight can land in the destination pages
    /// after their borrow ends (a destroyed QP no longer touches memory).
    pub fn read_pages(
        self,
        mr: &MemoryRegion,
        pages: Vec<PageRead<'_>>,
        keep_going: &mut dyn FnMut() -> bool,
    ) -> Result<(RdmaQp, ReadStats), RdmaError> {
        self.read_pages_each(mr, pages, keep_going, &mut |_, _| {})
    }

    /// Like [`read_pages`](Self::read_pages), and hands each page's destination to `landed`
    /// (with its index in `pages`) as soon as the READ that carried it has completed, while
    /// the others are still in flight, so the caller can digest it while it is still in the
    /// cache. A page handed over is never written again by this QP.
    pub fn read_pages_each<'a>(
        mut self,
        mr: &MemoryRegion,
        mut pages: Vec<PageRead<'a>>,
        keep_going: &mut dyn FnMut() -> bool,
        landed: &mut dyn FnMut(usize, &'a mut [u8]),
    ) -> Result<(RdmaQp, ReadStats), RdmaError> {
        let base = mr.get_ptr() as u64;
        let end = base + mr.region_len() as u64;
        // (local address, length, rkey, remote address, pages of `pages` it carries)
        let mut segments: Vec<(u64, u64, u32, u64, std::ops::Range<usize>)> = Vec::new();
        for (i, p) in pages.iter().enumerate() {
            let (laddr, len) = (p.dst.as_ptr() as u64, p.dst.len() as u64);
            if len == 0 || laddr < base || laddr + len > end {
                return Err(RdmaError::OutOfRange {
                    what: "read destination outside its memory region",
                });
            }
            if len > u64::from(u32::MAX) {
                return Err(RdmaError::OutOfRange {
                    what: "read of a page over 4 GiB",
                });
            }
            match segments.last_mut() {
                Some(s)
                    if s.2 == p.rkey
                        && s.0 + s.1 == laddr
                        && s.3 + s.1 == p.raddr
                        && s.1 + len <= MAX_READ_BYTES =>
                {
                    s.1 += len;
                    s.4.end = i + 1;
                }
                _ => segments.push((laddr, len, p.rkey, p.raddr, i..i + 1)),
            }
        }
        let mut stats = ReadStats::default();
        // (work request id, segment)
        let mut posted: Vec<(u64, usize)> = Vec::with_capacity(READS_POSTED);
        let mut next = 0;
        let mut progress = Instant::now();
        let outcome = 'reading: loop {
            while next < segments.len() && posted.len() < READS_POSTED {
                let (laddr, len, rkey, raddr, _) = segments[next];
                // a segment is one page (at most 4 GiB, checked) or at most MAX_READ_BYTES
                let len32 = u32::try_from(len).unwrap_or(u32::MAX);
                let wr = self.wr_id();
                // SAFETY: `[laddr, laddr + len)` lies inside `mr` (checked above) and is
                // made of the `dst` slices, mutably borrowed by `pages` for this call; on
                // any early return the QP is failed, drained and destroyed first.
                let post = unsafe {
                    sys::post_rdma(
                        &self.qp,
                        wr,
                        sys::RdmaOp::Read,
                        mr.lkey(),
                        laddr,
                        len32,
                        rkey,
                        raddr,
                    )
                };
                if let Err(e) = post {
                    break 'reading Err(verb("ibv_wr_rdma_read")(e));
                }
                posted.push((wr, next));
                stats.reads += 1;
                stats.bytes += len;
                next += 1;
            }
            if posted.is_empty() && next == segments.len() {
                break Ok(());
            }
            if let Err(e) = self.poll() {
                break Err(e);
            }
            let mut failed = None;
            let mut completed = Vec::new();
            {
                let mut done = self.done.borrow_mut();
                posted.retain(|(id, segment)| match done.remove(id) {
                    Some(status) => {
                        if status == rdma_mummy_sys::ibv_wc_status::IBV_WC_SUCCESS {
                            completed.push(*segment);
                        } else {
                            failed.get_or_insert(status);
                        }
                        false
                    }
                    None => true,
                });
            }
            if failed.is_none() {
                for segment in completed {
                    for i in segments[segment].4.clone() {
                        landed(i, std::mem::take(&mut pages[i].dst));
                    }
                }
            }
            if let Some(status) = failed {
                break Err(RdmaError::Completion {
                    op: "RDMA READ",
                    status,
                });
            }
            if posted.len() < READS_POSTED {
                progress = Instant::now();
            }
            if !keep_going() {
                break Err(RdmaError::Stopped);
            }
            if progress.elapsed() > COMPLETION_TIMEOUT {
                break Err(RdmaError::Stuck {
                    wr_id: posted.first().map(|p| p.0).unwrap_or_default(),
                    after: COMPLETION_TIMEOUT,
                });
            }
            std::hint::spin_loop();
        };
        match outcome {
            Ok(()) => Ok((self, stats)),
            Err(e) => {
                // Flush what is still posted, then destroy the QP (dropping `self`).
                if self.fail().is_ok() {
                    let deadline = Instant::now() + COMPLETION_TIMEOUT;
                    while !posted.is_empty() && Instant::now() < deadline {
                        if self.poll().is_err() {
                            break;
                        }
                        let mut done = self.done.borrow_mut();
                        posted.retain(|(id, _)| done.remove(id).is_none());
                    }
                }
                drop(self);
                Err(e)
            }
        }
    }
}

/// What a window lets the peer do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowAccess {
    /// RDMA READ only (the pull design: decode reads prefill's pages).
    Read,
    /// RDMA WRITE only.
    Write,
}

/// What keeps a registration's memory mapped.
enum Keeper {
    Memory(Arc<HostMemory>),
    Pool(PagePool),
}

/// A pool's memory, registered for remote access and window binding (or, for a pool no
/// peer may reach, for local access only).
pub struct RegisteredPool {
    mr: Arc<MemoryRegion>,
    page_bytes: u64,
    pages: u32,
    // after `mr`: the mapping outlives its registration
    keeper: Keeper,
}

impl std::fmt::Debug for RegisteredPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredPool")
            .field("pages", &self.pages)
            .field("page_bytes", &self.page_bytes)
            .finish_non_exhaustive()
    }
}

impl RegisteredPool {
    /// Registers all of `memory`, split in pages of `page_bytes`, in `pd`, for windows.
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        memory: Arc<HostMemory>,
        page_bytes: u64,
    ) -> Result<RegisteredPool, RdmaError> {
        Self::register(pd, Keeper::Memory(memory), page_bytes, true)
    }

    /// Registers the memory of `pool`. With `windows`, for remote access through windows
    /// bound over it (the MR's own rkey never leaves); without, for local access only: the
    /// pool is then a place this side's reads land, and no key reaches it from a peer.
    pub fn for_pool(
        pd: &Arc<ProtectionDomain>,
        pool: &PagePool,
        windows: bool,
    ) -> Result<RegisteredPool, RdmaError> {
        let page_bytes = pool.page_bytes() as u64;
        Self::register(pd, Keeper::Pool(pool.clone()), page_bytes, windows)
    }

    /// Registers all of `memory`, split in pages of `page_bytes`, in `pd` for local access
    /// only (a place this side's reads land): no key reaches it from a peer.
    pub fn local_only(
        pd: &Arc<ProtectionDomain>,
        memory: Arc<HostMemory>,
        page_bytes: u64,
    ) -> Result<RegisteredPool, RdmaError> {
        Self::register(pd, Keeper::Memory(memory), page_bytes, false)
    }

    fn register(
        pd: &Arc<ProtectionDomain>,
        keeper: Keeper,
        page_bytes: u64,
        windows: bool,
    ) -> Result<RegisteredPool, RdmaError> {
        let memory: &dyn PoolMemory = match &keeper {
            Keeper::Memory(m) => &**m,
            Keeper::Pool(p) => p.memory(),
        };
        let len = memory.len();
        if len.checked_rem(page_bytes) != Some(0) {
            return Err(RdmaError::OutOfRange {
                what: "pool length is not a whole number of pages",
            });
        }
        let pages = u32::try_from(len / page_bytes).map_err(|_| RdmaError::OutOfRange {
            what: "more than 2^32 pages",
        })?;
        let bytes = usize::try_from(len).map_err(|_| RdmaError::OutOfRange {
            what: "pool larger than the address space",
        })?;
        let access = if windows {
            AccessFlags::LocalWrite
                | AccessFlags::RemoteWrite
                | AccessFlags::RemoteRead
                | AccessFlags::MemoryWindowBind
        } else {
            AccessFlags::LocalWrite
        };
        let mr = match (memory.host_ptr(), memory.device()) {
            (Some(ptr), _) => {
                let ptr: NonNull<u8> = ptr;
                // SAFETY: `ptr` maps `len` bytes for as long as `keeper` lives (a sealed
                // memfd that cannot shrink); `keeper` is kept in the registration, dropped
                // after the MR.
                unsafe { sys::reg_mr(pd, ptr, bytes, access) }
                    .map_err(|e| boxed("ibv_reg_mr")(Box::new(e)))?
            }
            // GPUDirect RDMA: the NIC reaches device memory through a dmabuf of the pool,
            // registered at the pool's device address so page addresses are the same.
            (None, Some(device)) => {
                let fd = device
                    .dmabuf_fd()
                    .map_err(|e| boxed("cuMemGetHandleForAddressRange")(Box::new(e)))?;
                // SAFETY: the dmabuf covers the whole device pool, which stays allocated and
                // mapped for as long as `keeper` lives; `keeper` is kept in the
                // registration, dropped after the MR.
                unsafe { sys::reg_dmabuf_mr(pd, fd.as_fd(), bytes, device.device_addr(), access) }
                    .map_err(|e| boxed("ibv_reg_dmabuf_mr")(Box::new(e)))?
            }
            (None, None) => {
                return Err(RdmaError::OutOfRange {
                    what: "pool memory has neither a host mapping nor device memory",
                });
            }
        };
        Ok(RegisteredPool {
            mr,
            page_bytes,
            pages,
            keeper,
        })
    }

    /// The memory region (its rkey covers the whole pool: never give it to a peer).
    pub fn mr(&self) -> &Arc<MemoryRegion> {
        &self.mr
    }

    /// The registered memory.
    pub fn memory(&self) -> &dyn PoolMemory {
        match &self.keeper {
            Keeper::Memory(m) => &**m,
            Keeper::Pool(p) => p.memory(),
        }
    }

    /// Pages in the registration.
    pub fn pages(&self) -> u32 {
        self.pages
    }

    /// Bytes per page.
    pub fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    /// Address of page `page` in the registration.
    pub fn page_addr(&self, page: PageId) -> Option<u64> {
        (page.0 < self.pages)
            .then(|| self.mr.get_ptr() as u64 + u64::from(page.0) * self.page_bytes)
    }

    /// Binds a new type-2 window over pages `[first, first + count)` on `qp` (the QP the
    /// peer reaches it through), allowing only `access`, and waits for the bind to complete.
    pub fn bind_window(
        &self,
        qp: &Rc<RdmaQp>,
        first: PageId,
        count: u32,
        access: WindowAccess,
    ) -> Result<RequestWindow, RdmaError> {
        let end = first
            .0
            .checked_add(count)
            .filter(|&e| count > 0 && e <= self.pages);
        if end.is_none() {
            return Err(RdmaError::OutOfRange {
                what: "window pages outside the pool",
            });
        }
        let addr = self.mr.get_ptr() as u64 + u64::from(first.0) * self.page_bytes;
        let len = u64::from(count) * self.page_bytes;
        let mut mw = sys::MemoryWindow::alloc_type2(qp.pd()).map_err(verb("ibv_alloc_mw"))?;
        // a fresh key for each bind: the low 8 bits are ours to change (no overflow)
        let old = mw.rkey();
        let rkey = (old & !0xff) | (old.wrapping_add(1) & 0xff);
        let wr = qp.wr_id();
        let read = access == WindowAccess::Read;
        sys::post_bind(&qp.qp, wr, &mw, rkey, &self.mr, addr, len, read)
            .map_err(verb("ibv_wr_bind_mw"))?;
        let c = qp.wait(wr)?;
        if !c.is_success() {
            return Err(RdmaError::Completion {
                op: "bind memory window",
                status: c.status,
            });
        }
        mw.set_rkey(rkey);
        Ok(RequestWindow {
            _mw: mw,
            qp: Rc::clone(qp),
            rkey,
            addr,
            len,
            bound: true,
        })
    }
}

/// A type-2 memory window over one request's pages.
#[derive(Debug)]
pub struct RequestWindow {
    // deallocated on drop, after the invalidation in `Drop`
    _mw: sys::MemoryWindow,
    qp: Rc<RdmaQp>,
    rkey: u32,
    addr: u64,
    len: u64,
    bound: bool,
}

impl RequestWindow {
    /// The key the peer writes with.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// The first byte's address, as the peer names it.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the window is empty (never: a window covers at least one page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Invalidates the window (LOCAL_INV) and waits: afterwards its rkey is refused.
    pub fn invalidate(mut self) -> Result<(), RdmaError> {
        self.invalidate_inner()
    }

    fn invalidate_inner(&mut self) -> Result<(), RdmaError> {
        if !self.bound {
            return Ok(());
        }
        let wr = self.qp.wr_id();
        sys::post_local_inv(&self.qp.qp, wr, self.rkey).map_err(verb("ibv_wr_local_inv"))?;
        let c = self.qp.wait(wr)?;
        self.bound = false;
        if !c.is_success() {
            return Err(RdmaError::Completion {
                op: "invalidate memory window",
                status: c.status,
            });
        }
        Ok(())
    }
}

impl Drop for RequestWindow {
    fn drop(&mut self) {
        if let Err(e) = self.invalidate_inner() {
            log::warn!("invalidating a request window on drop: {e}");
        }
    }
}
