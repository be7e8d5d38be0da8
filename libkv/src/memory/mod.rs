//! Pool memory backends.
//!
//! A backend is one contiguous region split into pages by the pool. The host backend is a
//! sealed memfd mapped shared and pre-faulted; a device backend (CUDA) provides no host
//! mapping and moves bytes through its own copy engine. Pools reach memory only through this
//! trait, so the page ownership table stays the same whatever holds the bytes.
//!
//! A pull from another process's pool ([`ForeignPool::pull`]) copies and digests in one
//! pass: each page is copied a chunk at a time into decode's own page, and each chunk is
//! digested from the registers its copy stored (where the CPU folds crc32c with carry-less
//! multiplication; elsewhere from the destination right after its copy, while it is still in
//! L1; see [`Landing::copy_in`]). Where the CPU folds, the stores are streaming ones, fenced
//! once per page, so the pull moves two bytes of memory per byte instead of a memcpy's three.
//! A large pull can be split over a few threads, each taking a run of pages.
//!
//! A device pool ([`cuda::CudaMemory`]) has no host mapping; what the pool needs from it is
//! [`DeviceMemory`], in plain types, so that no CUDA type leaves [`cuda`]. What such a pool
//! decides on the host (copy runs, pattern fills, the digest's arithmetic) is in [`plan`].

pub mod cuda;
#[cfg(test)]
mod device_tests;
pub mod plan;

use crate::ids::{PageId, PoolOffset};
use crate::pool::{Landing, Source};
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
    /// The region as device memory, if it lives on a GPU (then it has no host mapping).
    fn device(&self) -> Option<&dyn DeviceMemory> {
        None
    }
}

/// Pool memory on a GPU: what the pool, verification and the transports need from it.
/// Offsets are relative to the region's start and checked against its length.
pub trait DeviceMemory: PoolMemory {
    /// CUDA device ordinal.
    fn ordinal(&self) -> u32;
    /// Device address of the region's first byte.
    fn device_addr(&self) -> u64;
    /// The digest of each page of `page_bytes` at `offsets`, computed on the device: equal
    /// to [`page_digest`](crate::verify::page_digest) of the same bytes.
    fn digest_pages(
        &self,
        offsets: &[PoolOffset],
        page_bytes: u64,
    ) -> Result<Vec<u32>, cuda::CudaError>;
    /// Fills `len` bytes at `offset` with `pattern` repeated.
    fn fill(&self, offset: PoolOffset, len: u64, pattern: &[u8; 16])
    -> Result<(), cuda::CudaError>;
    /// Copies bytes at `offset` into `dst`.
    fn read(&self, offset: PoolOffset, dst: &mut [u8]) -> Result<(), cuda::CudaError>;
    /// Copies `src` into the region at `offset`.
    fn write(&self, offset: PoolOffset, src: &[u8]) -> Result<(), cuda::CudaError>;
    /// The fd another process on this host maps the region from (read-only, through
    /// [`cuda::CudaForeignPool::import`]).
    fn export_fd(&self) -> BorrowedFd<'_>;
    /// A dmabuf fd of the whole region, for GPUDirect RDMA registration.
    fn dmabuf_fd(&self) -> Result<OwnedFd, cuda::CudaError>;
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
    pub fn copy_page(&self, page: PageId, dst: &mut [u8]) -> Option<()> {
        if dst.len() as u64 != self.page_bytes {
            return None;
        }
        self.copy_from_page(page, 0, dst)
    }

    /// Copies bytes `offset .. offset + dst.len()` of foreign page `page` into `dst`. Returns
    /// `None` when the page id is out of range or the bytes are not all inside the page.
    pub fn copy_from_page(&self, page: PageId, offset: usize, dst: &mut [u8]) -> Option<()> {
        let src = self.source(page, offset, dst.len())?;
        // SAFETY: a source of the foreign map is readable for its `dst.len()` bytes and is not
        // decode's memory (see `source`). The bytes may be written concurrently by the owning
        // process; we copy them as plain bytes without forming a reference and treat the
        // result as untrusted until its digest is checked.
        unsafe { std::ptr::copy_nonoverlapping(src.ptr(), dst.as_mut_ptr(), dst.len()) };
        Some(())
    }

    /// Bytes `offset .. offset + len` of foreign page `page`, to copy into a [`Landing`].
    /// `None` when the page id is out of range or the bytes are not all inside the page.
    pub fn source(&self, page: PageId, offset: usize, len: usize) -> Option<Source<'_>> {
        let end = offset.checked_add(len)?;
        if page.0 >= self.pages || end as u64 > self.page_bytes {
            return None;
        }
        let start = usize::try_from(u64::from(page.0) * self.page_bytes).ok()? + offset;
        // SAFETY: `start + len` is within the mapping (page < pages, offset + len within the
        // page, and the mapping is pages * page_bytes long, sealed against shrinking), which
        // lives as long as `self`. It is a read-only map of another pool's memory, never of
        // pages a landing fills. The owning process may write the bytes during a copy; they
        // are read only through raw pointers.
        Some(unsafe { Source::from_raw(self.map.as_ptr().add(start), len) })
    }

    /// Pulls foreign `pages`, in order, into `landing` (one landing page per foreign page, of
    /// the same size), on up to `threads` threads (1: this one only): each page is copied
    /// [`PULL_CHUNK`] bytes at a time and each chunk digested as it is copied
    /// ([`Landing::copy_in`]). `keep_going` is asked between pages (on every thread); when it
    /// says stop, the pull ends with [`PullError::Stopped`] once every thread has finished
    /// its page.
    pub fn pull(
        &self,
        pages: &[PageId],
        mut landing: Landing<'_>,
        threads: usize,
        keep_going: &(dyn Fn() -> bool + Sync),
    ) -> Result<(), PullError> {
        if landing.pages() != pages.len() {
            return Err(PullError::Count {
                pages: pages.len(),
                landing: landing.pages(),
            });
        }
        let threads = threads.clamp(1, pages.len().max(1));
        if threads == 1 {
            return self.pull_run(pages, &mut landing, keep_going, None);
        }
        // Runs of consecutive manifest pages, one per thread; this thread takes the first.
        let per = pages.len().div_ceil(threads);
        let mut parts = Vec::with_capacity(threads);
        for t in (1..threads).rev() {
            let at = (t * per).min(pages.len());
            if let Some(part) = landing.split_off(at) {
                parts.push((at, part));
            }
        }
        let stop = std::sync::atomic::AtomicBool::new(false);
        let going = || !stop.load(std::sync::atomic::Ordering::Relaxed) && keep_going();
        std::thread::scope(|scope| {
            let mut helpers = Vec::with_capacity(parts.len());
            let mut end = pages.len();
            for (at, mut part) in parts {
                let run = &pages[at..end];
                end = at;
                let (going, stop) = (&going, &stop);
                helpers.push(scope.spawn(move || {
                    let r = self.pull_run(run, &mut part, going, Some(stop));
                    drop(part);
                    r
                }));
            }
            let mut result = self.pull_run(&pages[..end], &mut landing, &going, Some(&stop));
            for h in helpers {
                let r = h.join().unwrap_or(Err(PullError::Stopped));
                // The first failure in manifest order matters least; any failure fails.
                if result.is_ok() {
                    result = r;
                }
            }
            result
        })
    }

    /// One thread's run of a pull. On failure sets `stop` so the other threads end too.
    fn pull_run(
        &self,
        pages: &[PageId],
        landing: &mut Landing<'_>,
        keep_going: &(dyn Fn() -> bool + Sync),
        stop: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<(), PullError> {
        let result = (|| {
            let page_len = usize::try_from(self.page_bytes).unwrap_or(usize::MAX);
            for (i, &page) in pages.iter().enumerate() {
                if !keep_going() {
                    return Err(PullError::Stopped);
                }
                if page.0 >= self.pages {
                    return Err(PullError::OutOfRange {
                        page,
                        pages: self.pages,
                    });
                }
                if landing.current_len() != Some(page_len) {
                    return Err(PullError::PageSize {
                        index: i,
                        page_bytes: self.page_bytes,
                    });
                }
                let mut offset = 0;
                while offset < page_len {
                    let n = landing.copy_in(PULL_CHUNK, |len| {
                        self.source(page, offset, len).ok_or(PullError::OutOfRange {
                            page,
                            pages: self.pages,
                        })
                    })?;
                    offset += n;
                }
            }
            Ok(())
        })();
        if let (Err(_), Some(stop)) = (&result, stop) {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        result
    }
}

/// Bytes a pull copies and digests at a time: small enough that where the digest is not
/// fused with the copy it reads the chunk from L1 right after the copy wrote it.
pub const PULL_CHUNK: usize = 4096;

/// Why a pull from a foreign pool stopped.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PullError {
    #[error("{page} is outside the prefill pool of {pages} pages")]
    OutOfRange { page: PageId, pages: u32 },
    #[error("destination page {index} is not {page_bytes} bytes long, as the prefill pages are")]
    PageSize { index: usize, page_bytes: u64 },
    #[error("{pages} pages to pull into a landing of {landing}")]
    Count { pages: usize, landing: usize },
    #[error("stopped")]
    Stopped,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{Dtype, PageGeometry};
    use crate::ids::{Generation, Owner, RequestId};
    use crate::pool::{PagePool, PoolOptions};
    use crate::verify::{Manifest, VerifyError, page_digest};

    /// 16 KiB pages: four pull chunks each.
    fn geometry() -> PageGeometry {
        PageGeometry {
            tokens_per_page: 16,
            layers: 1,
            kv_heads: 1,
            head_dim: 256,
            dtype: Dtype::Bf16,
        }
    }

    fn owner(r: u64) -> Owner {
        Owner {
            request: RequestId(r),
            generation: Generation(1),
        }
    }

    /// A prefill pool of `pages` pages with distinct contents, its writable mapping (what
    /// prefill itself may change at any time) and decode's read-only map of it.
    fn prefill(pages: u32) -> (HostMemory, MmapMut, ForeignPool) {
        let g = geometry();
        let len = g.bytes_per_page() * u64::from(pages);
        let mem = HostMemory::new(c"kvtest-prefill", len).unwrap();
        let mut w = memfd::map_rw(mem.share_fd().unwrap(), len).unwrap();
        for (i, b) in w.iter_mut().enumerate() {
            *b = u8::try_from((i * 7 + i / 4096) % 251).unwrap();
        }
        let ro = mem.read_only_fd().unwrap();
        let foreign = ForeignPool::map(ro.as_fd(), g.bytes_per_page(), pages).unwrap();
        (mem, w, foreign)
    }

    fn digest_of(w: &MmapMut, page: u32) -> u32 {
        let len = usize::try_from(geometry().bytes_per_page()).unwrap();
        let at = usize::try_from(page).unwrap() * len;
        page_digest(&w[at..at + len])
    }

    #[test]
    fn a_fused_pull_verifies_from_the_digests_it_landed() {
        let (_mem, w, foreign) = prefill(64);
        let g = geometry();
        let decode = PagePool::host(c"kvtest-decode", g, 64, PoolOptions::default()).unwrap();
        for threads in [1, 2, 3] {
            let src: Vec<PageId> = (0..40).rev().map(PageId).collect();
            let tokens = 40 * g.tokens_per_page;
            let mut res = decode.reserve(owner(threads as u64), tokens, 0).unwrap();
            {
                let mut grant = res.grant_write().unwrap();
                let landing = grant.landing(0..src.len()).unwrap();
                foreign.pull(&src, landing, threads, &|| true).unwrap();
            }
            let m = Manifest {
                owner: res.owner(),
                tokens,
                digests: src.iter().map(|p| digest_of(&w, p.0)).collect(),
                pages: src.clone(),
            };
            let kv = res.verify(&m).unwrap();
            for (i, p) in src.iter().enumerate() {
                assert_eq!(page_digest(kv.page(i).unwrap()), m.digests[i], "page {p}");
            }
        }
    }

    /// Pulls foreign page 2 into a fresh one-page reservation a chunk at a time, the way
    /// [`ForeignPool::pull`] does (`fused`: copy and digest in one pass) or with a plain copy
    /// digested after each chunk, calling `between` after the first chunk has landed.
    fn pull_chunks(
        decode: &PagePool,
        foreign: &ForeignPool,
        id: u64,
        fused: bool,
        between: impl FnOnce(),
    ) -> crate::pool::Reservation {
        let g = geometry();
        let mut res = decode.reserve(owner(id), g.tokens_per_page, 0).unwrap();
        let mut grant = res.grant_write().unwrap();
        let mut landing = grant.landing(0..1).unwrap();
        let mut between = Some(between);
        let mut offset = 0;
        while !landing.is_full() {
            offset += if fused {
                landing.copy_in(PULL_CHUNK, |len| {
                    foreign.source(PageId(2), offset, len).ok_or(())
                })
            } else {
                landing.fill(PULL_CHUNK, |dst| {
                    foreign
                        .copy_from_page(PageId(2), offset, dst)
                        .map(|()| dst.len())
                        .ok_or(())
                })
            }
            .unwrap();
            if let Some(f) = between.take() {
                f();
            }
        }
        drop(landing);
        drop(grant);
        res
    }

    #[test]
    fn a_page_altered_between_chunks_of_the_fused_copy_fails_verification() {
        let (_mem, w, foreign) = prefill(4);
        let w = std::cell::RefCell::new(w);
        let g = geometry();
        let page_len = usize::try_from(g.bytes_per_page()).unwrap();
        assert!(page_len >= 4 * PULL_CHUNK);
        let decode = PagePool::host(c"kvtest-decode", g, 4, PoolOptions::default()).unwrap();
        let at = 2 * page_len;
        let original = (w.borrow()[at + 5], w.borrow()[at + 3 * PULL_CHUNK + 9]);
        // Prefill rewrites the page (reused too early, or a bug) after the first chunk was
        // copied: a byte in the part already copied and one in a part still to come.
        let alter = |on: bool| {
            let mut w = w.borrow_mut();
            let (a, b) = if on {
                (!original.0, !original.1)
            } else {
                original
            };
            w[at + 5] = a;
            w[at + 3 * PULL_CHUNK + 9] = b;
        };
        let before = digest_of(&w.borrow(), 2);
        alter(true);
        let after = digest_of(&w.borrow(), 2);
        assert_ne!(before, after);
        let manifest = |id, digest| Manifest {
            owner: owner(id),
            tokens: g.tokens_per_page,
            pages: vec![PageId(2)],
            digests: vec![digest],
        };
        for fused in [true, false] {
            // What landed is neither the page as prefill digested it nor the page as it is now.
            for (id, digest) in [(1, before), (2, after)] {
                alter(false);
                let res = pull_chunks(&decode, &foreign, id, fused, || alter(true));
                let landed = res.with_table(|t| t.landed(res.pages()[0]));
                assert!(landed.is_some(), "the landing recorded its digest");
                let r = res.verify(&manifest(id, digest));
                assert!(
                    matches!(r, Err(VerifyError::Digest { index: 0, .. })),
                    "fused {fused}: {r:?}"
                );
                assert_eq!(decode.usage().free, 4, "a failed verify frees the pages");
            }
            // The same pull with nothing altered verifies: the failures above are the tear.
            alter(false);
            let res = pull_chunks(&decode, &foreign, 3, fused, || {});
            res.verify(&manifest(3, before)).unwrap();
        }
    }

    #[test]
    fn a_pull_digests_what_landed_while_prefill_rewrites_the_page() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let (_mem, mut w, foreign) = prefill(4);
        let g = geometry();
        let page_len = usize::try_from(g.bytes_per_page()).unwrap();
        let decode = PagePool::host(c"kvtest-decode", g, 4, PoolOptions::default()).unwrap();
        let before = digest_of(&w, 2);
        let stop = AtomicBool::new(false);
        // Prefill keeps rewriting bytes all over page 2 while decode pulls it.
        let base = w.as_mut_ptr() as usize + 2 * page_len;
        let torn = std::thread::scope(|scope| {
            let writer = scope.spawn(|| {
                let mut k = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let at = (k * 4099) % page_len;
                    // SAFETY: `at` is inside page 2 of the prefill mapping, which outlives the
                    // scope; the pull reads it only through raw pointers, as it would read
                    // another process's memory.
                    let p = (base + at) as *mut u8;
                    // SAFETY: as above.
                    unsafe { std::ptr::write_volatile(p, k.to_le_bytes()[0]) };
                    k += 1;
                }
            });
            // Ends the writer however the pulls end, a failed assertion included.
            struct Stop<'a>(&'a AtomicBool);
            impl Drop for Stop<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Relaxed);
                }
            }
            let stop = Stop(&stop);
            let mut torn = 0;
            for id in 0..200 {
                let res = pull_chunks(&decode, &foreign, id, true, || {});
                let Some(landed) = res.with_table(|t| t.landed(res.pages()[0])) else {
                    panic!("the landing recorded no digest");
                };
                torn += usize::from(landed != before);
                // The digest recorded is the digest of what the page holds, whatever the
                // source held by the time the digest was taken.
                let m = Manifest {
                    owner: res.owner(),
                    tokens: g.tokens_per_page,
                    pages: vec![PageId(2)],
                    digests: vec![landed],
                };
                let kv = res.verify(&m).unwrap();
                assert_eq!(page_digest(kv.page(0).unwrap()), landed, "pull {id}");
            }
            drop(stop);
            writer.join().unwrap();
            torn
        });
        eprintln!("pulls that landed a page unlike the one prefill digested: {torn} of 200");
    }

    #[test]
    fn a_pull_refuses_what_it_cannot_land_and_stops_when_asked() {
        let (_mem, _w, foreign) = prefill(4);
        let g = geometry();
        let decode = PagePool::host(c"kvtest-decode", g, 8, PoolOptions::default()).unwrap();
        let mut res = decode.reserve(owner(1), 2 * g.tokens_per_page, 0).unwrap();
        let mut grant = res.grant_write().unwrap();
        let r = foreign.pull(&[PageId(0)], grant.landing(0..2).unwrap(), 1, &|| true);
        assert!(matches!(r, Err(PullError::Count { .. })), "{r:?}");
        let r = foreign.pull(
            &[PageId(0), PageId(4)],
            grant.landing(0..2).unwrap(),
            1,
            &|| true,
        );
        assert!(matches!(r, Err(PullError::OutOfRange { .. })), "{r:?}");
        for threads in [1, 2] {
            let r = foreign.pull(
                &[PageId(0), PageId(1)],
                grant.landing(0..2).unwrap(),
                threads,
                &|| false,
            );
            assert_eq!(r, Err(PullError::Stopped));
        }
    }
}
