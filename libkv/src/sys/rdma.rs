//! The memory-window verbs sideway does not wrap, and raw posting on an extended QP.
//!
//! Every call here goes straight to libibverbs through `rdma_mummy_sys` on handles that
//! sideway owns. Callers keep those owners (PD, MR, QP) alive for as long as the raw handles
//! are used; [`crate::rdma`] encodes that in its types.

use std::io;
use std::ptr::NonNull;

use rdma_mummy_sys::{
    ibv_access_flags, ibv_alloc_mw, ibv_dealloc_mw, ibv_mw, ibv_mw_bind_info, ibv_mw_type,
    ibv_qp_ex, ibv_qp_to_qp_ex, ibv_send_flags, ibv_wr_bind_mw, ibv_wr_complete, ibv_wr_local_inv,
    ibv_wr_rdma_read, ibv_wr_rdma_write, ibv_wr_set_sge, ibv_wr_start,
};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{ExtendedQueuePair, QueuePair};

/// A type-2 memory window, deallocated on drop.
#[derive(Debug)]
pub struct MemoryWindow {
    mw: NonNull<ibv_mw>,
}

impl MemoryWindow {
    /// Allocates a type-2 window in `pd`.
    pub fn alloc_type2(pd: &ProtectionDomain) -> io::Result<MemoryWindow> {
        // SAFETY: `pd.pd()` is the live PD that `pd` owns; ibv_alloc_mw only reads it and
        // returns a new window or null (errno set, EOPNOTSUPP when the device has none).
        let mw = unsafe { ibv_alloc_mw(pd.pd().as_ptr(), ibv_mw_type::IBV_MW_TYPE_2) };
        NonNull::new(mw)
            .map(|mw| MemoryWindow { mw })
            .ok_or_else(io::Error::last_os_error)
    }

    /// The rkey of the last successful bind (the initial one before any).
    pub fn rkey(&self) -> u32 {
        // SAFETY: `mw` is a live window until drop; reading a plain field.
        unsafe { (*self.mw.as_ptr()).rkey }
    }

    /// Records the rkey of a bind that completed successfully. libibverbs does not update
    /// it for type-2 windows bound through a QP, and rxe refuses the next bind otherwise.
    pub fn set_rkey(&mut self, rkey: u32) {
        // SAFETY: `mw` is a live window until drop; `&mut self` makes this the only access.
        unsafe { (*self.mw.as_ptr()).rkey = rkey };
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        // SAFETY: `mw` came from ibv_alloc_mw and is deallocated exactly once, here.
        let rc = unsafe { ibv_dealloc_mw(self.mw.as_ptr()) };
        if rc != 0 {
            log::warn!(
                "ibv_dealloc_mw failed: {}",
                io::Error::from_raw_os_error(rc)
            );
        }
    }
}

fn qp_ex(qp: &ExtendedQueuePair) -> *mut ibv_qp_ex {
    // SAFETY: `qp.qp()` is the live QP that `qp` owns; it was created with ibv_create_qp_ex,
    // so ibv_qp_to_qp_ex returns its extended handle (a pointer into the same object).
    unsafe { ibv_qp_to_qp_ex(qp.qp().as_ptr()) }
}

/// Runs one work request between ibv_wr_start and ibv_wr_complete.
///
/// # Safety
///
/// `post` must only call ibv_wr_* builders the QP was created for (its send-op flags), on
/// the handle it is given.
unsafe fn post_one(
    qp: &ExtendedQueuePair,
    wr_id: u64,
    post: impl FnOnce(*mut ibv_qp_ex),
) -> io::Result<()> {
    let qpx = qp_ex(qp);
    // SAFETY: `qpx` is the live extended QP of `qp`, borrowed for this call; one request is
    // built between start and complete, as the ibv_wr_* API requires; wr_id and wr_flags
    // are plain fields the next builder reads.
    let rc = unsafe {
        ibv_wr_start(qpx);
        (*qpx).wr_id = wr_id;
        (*qpx).wr_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        post(qpx);
        ibv_wr_complete(qpx)
    };
    match rc {
        0 => Ok(()),
        rc => Err(io::Error::from_raw_os_error(rc)),
    }
}

/// Posts a signaled bind of `mw` to `rkey` over `[addr, addr + len)` of `mr` with `access`
/// (remote read or remote write, never both from here). The QP must have been created with
/// the BindMemoryWindow send op.
#[allow(clippy::too_many_arguments)]
pub fn post_bind(
    qp: &ExtendedQueuePair,
    wr_id: u64,
    mw: &MemoryWindow,
    rkey: u32,
    mr: &MemoryRegion,
    addr: u64,
    len: u64,
    remote_read: bool,
) -> io::Result<()> {
    let access = if remote_read {
        ibv_access_flags::IBV_ACCESS_REMOTE_READ
    } else {
        ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
    };
    let info = ibv_mw_bind_info {
        // SAFETY: `mr.mr()` is the live MR of `mr`, which covers [addr, addr + len) (checked
        // by the caller and again by the device); the bind info is read during the call only.
        mr: unsafe { mr.mr().as_ptr() },
        addr,
        length: len,
        mw_access_flags: access.0,
    };
    // SAFETY: the QP was created with IBV_QP_EX_WITH_BIND_MW (RdmaQp does so), so
    // wr_bind_mw is set; `mw` is live and belongs to the QP's PD.
    unsafe {
        post_one(qp, wr_id, |q| {
            ibv_wr_bind_mw(q, mw.mw.as_ptr(), rkey, &info)
        })
    }
}

/// Posts a signaled LOCAL_INV of `rkey`. The QP must have the LocalInvalidate send op.
pub fn post_local_inv(qp: &ExtendedQueuePair, wr_id: u64, rkey: u32) -> io::Result<()> {
    // SAFETY: the QP was created with IBV_QP_EX_WITH_LOCAL_INV (RdmaQp does so).
    unsafe { post_one(qp, wr_id, |q| ibv_wr_local_inv(q, rkey)) }
}

/// Which way an RDMA transfer goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RdmaOp {
    /// Local bytes to the peer (the QP must have the Write send op).
    Write,
    /// Peer bytes to local memory (the QP must have the Read send op).
    Read,
}

/// Posts a signaled RDMA WRITE or READ between `[laddr, laddr + len)` (registered under
/// `lkey`) and `raddr` on the peer under `rkey`.
///
/// # Safety
///
/// `[laddr, laddr + len)` must stay valid and registered under `lkey` until the request
/// completes or the QP is destroyed; for a READ, nothing else may use those bytes until then.
#[allow(clippy::too_many_arguments)]
pub unsafe fn post_rdma(
    qp: &ExtendedQueuePair,
    wr_id: u64,
    op: RdmaOp,
    lkey: u32,
    laddr: u64,
    len: u32,
    rkey: u32,
    raddr: u64,
) -> io::Result<()> {
    // SAFETY: the QP was created with IBV_QP_EX_WITH_RDMA_WRITE and _READ (RdmaQp does so);
    // the local buffer's validity is the caller's contract.
    unsafe {
        post_one(qp, wr_id, |q| {
            match op {
                RdmaOp::Write => ibv_wr_rdma_write(q, rkey, raddr),
                RdmaOp::Read => ibv_wr_rdma_read(q, rkey, raddr),
            }
            ibv_wr_set_sge(q, lkey, laddr, len);
        })
    }
}

/// Registers `[ptr, ptr + len)` with `access`.
///
/// # Safety
///
/// The memory must stay mapped, and not be remapped, for as long as the returned MR lives.
pub unsafe fn reg_mr(
    pd: &std::sync::Arc<ProtectionDomain>,
    ptr: NonNull<u8>,
    len: usize,
    access: sideway::ibverbs::AccessFlags,
) -> Result<std::sync::Arc<MemoryRegion>, sideway::ibverbs::memory_region::RegisterMemoryRegionError>
{
    // SAFETY: the mapping's lifetime is the caller's contract.
    unsafe { pd.reg_mr(ptr.as_ptr() as usize, len, access) }
}

/// Registers `len` bytes of the dmabuf `fd` from its start, at address `iova` for the
/// peer's and our work requests, with `access` (GPUDirect RDMA of device memory).
///
/// # Safety
///
/// The memory behind the dmabuf must stay allocated for as long as the returned MR lives.
pub unsafe fn reg_dmabuf_mr(
    pd: &std::sync::Arc<ProtectionDomain>,
    fd: std::os::fd::BorrowedFd<'_>,
    len: usize,
    iova: u64,
    access: sideway::ibverbs::AccessFlags,
) -> Result<std::sync::Arc<MemoryRegion>, sideway::ibverbs::memory_region::RegisterMemoryRegionError>
{
    use std::os::fd::AsRawFd;
    // SAFETY: the allocation's lifetime is the caller's contract; the kernel takes its own
    // reference to the dmabuf, so `fd` may be closed after the call.
    unsafe { pd.reg_dmabuf_mr(0, len, iova, fd.as_raw_fd(), access) }
}
