//! Pool memory backends.
//!
//! A backend is one contiguous region split into pages by the pool. The host backend is a
//! sealed memfd mapped shared and pre-faulted; a device backend (CUDA) provides no host
//! mapping and moves bytes through its own copy engine. Pools reach memory only through this
//! trait, so the page ownership table stays the same whatever holds the bytes.

use crate::sys::memfd;
use memmap2::MmapMut;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

/// A region of memory a pool splits into pages.
pub trait PoolMemory: Send + Sync + fmt::Debug {
    /// Length in bytes.
    fn len(&self) -> u64;
    /// Whether the region is empty (never true for a valid pool).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Start of a host mapping of the whole region, if the region is host-addressable.
    fn host_ptr(&self) -> Option<NonNull<u8>>;
    /// An fd another process can map (host shared memory), if the backend has one.
    fn share_fd(&self) -> Option<BorrowedFd<'_>>;
    /// Short backend name for logs and status.
    fn backend(&self) -> &'static str;
}

/// Host shared memory: a sealed memfd, mapped shared and pre-faulted once.
pub struct HostMemory {
    fd: OwnedFd,
    map: MmapMut,
    len: u64,
}

impl fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostMemory")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl HostMemory {
    /// Creates, seals and pre-faults a region of `len` bytes.
    pub fn new(name: &std::ffi::CStr, len: u64) -> io::Result<Self> {
        let fd = memfd::create_sealed(name, len)?;
        let map = memfd::map_rw(fd.as_fd(), len)?;
        Ok(Self { fd, map, len })
    }

    /// A read-only fd of the region, for a peer that pulls pages out of it.
    pub fn read_only_fd(&self) -> io::Result<OwnedFd> {
        memfd::reopen_read_only(self.fd.as_fd())
    }
}

impl PoolMemory for HostMemory {
    fn len(&self) -> u64 {
        self.len
    }

    fn host_ptr(&self) -> Option<NonNull<u8>> {
        NonNull::new(self.map.as_ptr().cast_mut())
    }

    fn share_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.fd.as_fd())
    }

    fn backend(&self) -> &'static str {
        "host-memfd"
    }
}

/// Another process's pool, mapped read-only: the source of a pull.
pub struct ForeignPool {
    map: memmap2::Mmap,
    page_bytes: u64,
    pages: u32,
}

impl fmt::Debug for ForeignPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ForeignPool")
            .field("pages", &self.pages)
            .field("page_bytes", &self.page_bytes)
            .finish_non_exhaustive()
    }
}

impl ForeignPool {
    /// Maps `fd`, which must be a sealed memfd of exactly `pages * page_bytes` bytes.
    pub fn map(fd: BorrowedFd<'_>, page_bytes: u64, pages: u32) -> io::Result<Self> {
        let len = page_bytes
            .checked_mul(u64::from(pages))
            .ok_or_else(|| io::Error::other("foreign pool size overflows"))?;
        let map = memfd::map_ro(fd, len)?;
        Ok(Self {
            map,
            page_bytes,
            pages,
        })
    }

    /// Pages in the foreign pool.
    pub fn pages(&self) -> u32 {
        self.pages
    }

    /// Bytes per page.
    pub fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    /// Copies foreign page `page` into `dst` (exactly one page long). Returns `None` when the
    /// page id is out of range or `dst` has the wrong length. The source may change during the
    /// copy (it belongs to another process): callers verify the copy's digest afterwards.
    pub fn copy_page(&self, page: crate::ids::PageId, dst: &mut [u8]) -> Option<()> {
        if page.0 >= self.pages || dst.len() as u64 != self.page_bytes {
            return None;
        }
        let off = usize::try_from(u64::from(page.0) * self.page_bytes).ok()?;
        let src = self.map.as_ptr();
        // SAFETY: `off + dst.len()` is within the mapping (page < pages and the mapping is
        // pages * page_bytes long, sealed against shrinking). The source bytes may be written
        // concurrently by the owning process; we copy them as plain bytes without forming a
        // reference and treat the result as untrusted until its digest is checked.
        unsafe { std::ptr::copy_nonoverlapping(src.add(off), dst.as_mut_ptr(), dst.len()) };
        Some(())
    }
}
