//! Sealed memfd regions: creation, sealing, read-only re-opening and mapping.
//!
//! A pool is one memfd sized once, then sealed against shrinking and growing (and against
//! further seal changes), so that no process holding it can truncate it under a mapping and
//! turn later accesses into SIGBUS. It is mapped shared and pre-faulted once at start.
//!
//! Pre-faulting allocates every page of the pool before the worker serves, so that no
//! request pays for a page fault and a pool that does not fit fails at start, not in the
//! middle of a request. [`map_rw`] asks for transparent huge pages (`MADV_HUGEPAGE`: taken
//! where `/sys/kernel/mm/transparent_hugepage/shmem_enabled` allows them for shmem, ignored
//! elsewhere), then faults the region with `MADV_POPULATE_WRITE` (Linux 5.14) from several
//! threads, each taking the next chunk of [`PREFAULT_CHUNK`], and logs progress for pools of
//! [`PREFAULT_LOG_BYTES`] and more. Where the kernel lacks `MADV_POPULATE_WRITE` it falls
//! back to `MAP_POPULATE`, the way it always did.

use memmap2::{Advice, Mmap, MmapMut, MmapOptions};
use nix::fcntl::{FcntlArg, OFlag, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::stat::{Mode, fstat};
use std::ffi::CStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Bytes one pre-faulting thread takes at a time.
pub const PREFAULT_CHUNK: usize = 64 << 20;
/// Pools at least this large log their pre-faulting progress (at info level).
pub const PREFAULT_LOG_BYTES: usize = 1 << 30;
/// Most threads that pre-fault one pool.
const PREFAULT_MAX_THREADS: usize = 8;
/// How often progress is logged while pre-faulting a large pool.
const PREFAULT_LOG_EVERY: Duration = Duration::from_secs(1);

/// How a mapping is pre-faulted (all but [`Prefault::MapPopulate`] on a mapping made
/// without `MAP_POPULATE`). [`map_rw`] uses [`Prefault::default`]; the others are for
/// measuring (`kvprefault`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefault {
    /// Fault with `MAP_POPULATE` at mmap time, on one thread (the old way). The other
    /// fields are then ignored.
    pub map_populate: bool,
    /// Threads that run `MADV_POPULATE_WRITE` (or `_READ`) over chunks; 0: one per CPU, up
    /// to 8.
    pub threads: usize,
    /// Ask for transparent huge pages first (`MADV_HUGEPAGE`).
    pub huge_pages: bool,
}

impl Default for Prefault {
    fn default() -> Prefault {
        Prefault {
            map_populate: false,
            threads: 0,
            huge_pages: true,
        }
    }
}

impl Prefault {
    /// The old way: `MAP_POPULATE`, one thread, no huge pages.
    pub const MAP_POPULATE: Prefault = Prefault {
        map_populate: true,
        threads: 1,
        huge_pages: false,
    };

    fn threads_for(self, len: usize) -> usize {
        let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        let wanted = if self.threads == 0 {
            cpus.min(PREFAULT_MAX_THREADS)
        } else {
            self.threads
        };
        wanted.clamp(1, len.div_ceil(PREFAULT_CHUNK).max(1))
    }
}

/// Faults every page of `map` in, as `how` says, with `advice` `PopulateWrite` (a mapping
/// the worker writes) or `PopulateRead`. `advise_range` is the mapping's safe
/// `madvise`. Fails with `EINVAL` where the kernel lacks the populate advice.
fn populate(
    len: usize,
    advise_range: &(dyn Fn(Advice, usize, usize) -> io::Result<()> + Sync),
    advice: Advice,
    how: Prefault,
) -> io::Result<()> {
    if how.huge_pages {
        // Taken where the kernel allows huge pages for shmem; an error only means it does not.
        let _ = advise_range(Advice::HugePage, 0, len);
    }
    let threads = how.threads_for(len);
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let work = || -> io::Result<()> {
        loop {
            let start = next.fetch_add(PREFAULT_CHUNK, Ordering::Relaxed);
            if start >= len {
                return Ok(());
            }
            let n = PREFAULT_CHUNK.min(len - start);
            advise_range(advice, start, n)?;
            done.fetch_add(n, Ordering::Relaxed);
        }
    };
    let log = len >= PREFAULT_LOG_BYTES;
    let begun = Instant::now();
    let gib = |b: usize| b as f64 / f64::from(1u32 << 30);
    if log {
        log::info!(
            "pre-faulting the pool: {:.1} GiB on {threads} threads",
            gib(len)
        );
    }
    let result = std::thread::scope(|scope| {
        if !log {
            let helpers: Vec<_> = (1..threads).map(|_| scope.spawn(work)).collect();
            let mut result = work();
            for h in helpers {
                let r = h
                    .join()
                    .unwrap_or_else(|_| Err(io::Error::other("pre-fault thread panicked")));
                result = result.and(r);
            }
            return result;
        }
        // A large pool: every thread faults, this one says how far they got.
        let workers: Vec<_> = (0..threads).map(|_| scope.spawn(work)).collect();
        let mut last = Instant::now();
        while !workers
            .iter()
            .all(std::thread::ScopedJoinHandle::is_finished)
        {
            std::thread::sleep(Duration::from_millis(20));
            if last.elapsed() >= PREFAULT_LOG_EVERY {
                last = Instant::now();
                let d = done.load(Ordering::Relaxed);
                log::info!(
                    "pre-faulting the pool: {:.1} of {:.1} GiB ({:.0}%)",
                    gib(d),
                    gib(len),
                    100.0 * d as f64 / len as f64
                );
            }
        }
        let mut result = Ok(());
        for h in workers {
            let r = h
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("pre-fault thread panicked")));
            result = result.and(r);
        }
        result
    });
    if log {
        let secs = begun.elapsed().as_secs_f64();
        log::info!(
            "pre-faulted {:.1} GiB in {secs:.2} s ({:.2} GiB/s)",
            gib(done.load(Ordering::Relaxed)),
            gib(len) / secs.max(1e-9)
        );
    }
    result
}

/// Seals every pool carries before it is shared.
pub fn required_seals() -> SealFlag {
    SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL
}

/// Creates a memfd of `len` bytes and seals its size.
pub fn create_sealed(name: &CStr, len: u64) -> io::Result<OwnedFd> {
    if len == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "memfd length is zero",
        ));
    }
    let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)?;
    let file = File::from(fd);
    file.set_len(len)?;
    let fd = OwnedFd::from(file);
    fcntl(&fd, FcntlArg::F_ADD_SEALS(required_seals()))?;
    Ok(fd)
}

/// Checks that a received fd is a memfd sealed against resizing and exactly `len` bytes long.
pub fn check_sealed(fd: BorrowedFd<'_>, len: u64) -> io::Result<()> {
    let seals = fcntl(fd, FcntlArg::F_GET_SEALS)?;
    let seals = SealFlag::from_bits_truncate(seals);
    if !seals.contains(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("pool fd is not sealed against resizing (seals {seals:?})"),
        ));
    }
    let st = fstat(fd)?;
    let size = u64::try_from(st.st_size).unwrap_or(0);
    if size != len {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("pool fd is {size} bytes, expected {len}"),
        ));
    }
    Ok(())
}

/// Opens a second, read-only file description of `fd`, so the receiver of it can map the
/// region for reading but never for writing.
pub fn reopen_read_only(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let ro = nix::fcntl::open(
        path.as_str(),
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    Ok(ro)
}

/// Maps a sealed memfd read-write, shared, pre-faulted (see the module doc).
pub fn map_rw(fd: BorrowedFd<'_>, len: u64) -> io::Result<MmapMut> {
    map_rw_with(fd, len, Prefault::default())
}

/// [`map_rw`], pre-faulted as `how` says.
pub fn map_rw_with(fd: BorrowedFd<'_>, len: u64, how: Prefault) -> io::Result<MmapMut> {
    check_sealed(fd, len)?;
    let len = usize::try_from(len).map_err(|_| io::Error::other("pool too large"))?;
    let file = File::from(fd.try_clone_to_owned()?);
    let map_with = |populate: bool| {
        let mut opts = MmapOptions::new();
        opts.len(len);
        if populate {
            opts.populate();
        }
        // SAFETY: the memfd is sealed against shrinking (checked above), so the mapping can
        // never extend past the end of the file and no access through it raises SIGBUS.
        // Concurrent writers to the same pages are excluded by the page ownership table, which
        // is the only way this crate hands out page slices.
        unsafe { opts.map_mut(&file) }
    };
    if how.map_populate {
        return map_with(true);
    }
    let map = map_with(false)?;
    let advise = |a: Advice, off: usize, n: usize| map.advise_range(a, off, n);
    match populate(len, &advise, Advice::PopulateWrite, how) {
        Ok(()) => Ok(map),
        Err(e) if e.raw_os_error() == Some(nix::libc::EINVAL) => {
            log::debug!("MADV_POPULATE_WRITE unavailable ({e}); pre-faulting with MAP_POPULATE");
            drop(map);
            map_with(true)
        }
        Err(e) => Err(e),
    }
}

/// Maps a sealed memfd read-only, shared, pre-faulted (`MADV_POPULATE_READ` from several
/// threads, else `MAP_POPULATE`).
pub fn map_ro(fd: BorrowedFd<'_>, len: u64) -> io::Result<Mmap> {
    check_sealed(fd, len)?;
    let len = usize::try_from(len).map_err(|_| io::Error::other("pool too large"))?;
    let file = File::from(fd.try_clone_to_owned()?);
    let map_with = |populate: bool| {
        let mut opts = MmapOptions::new();
        opts.len(len);
        if populate {
            opts.populate();
        }
        // SAFETY: sealed against shrinking (checked above), so no SIGBUS. The contents may
        // change under the mapping (the owner writes its pages); this crate never forms
        // references into it and only copies bytes out through raw pointers, then verifies the
        // copy's digest.
        unsafe { opts.map(&file) }
    };
    let map = map_with(false)?;
    let advise = |a: Advice, off: usize, n: usize| map.advise_range(a, off, n);
    let how = Prefault {
        huge_pages: false,
        ..Prefault::default()
    };
    match populate(len, &advise, Advice::PopulateRead, how) {
        Ok(()) => Ok(map),
        Err(e) if e.raw_os_error() == Some(nix::libc::EINVAL) => {
            drop(map);
            map_with(true)
        }
        Err(e) => Err(e),
    }
}

/// The fd is a readable, writable handle that can be passed on.
pub fn is_writable(fd: impl AsFd) -> io::Result<bool> {
    let fl = fcntl(fd.as_fd(), FcntlArg::F_GETFL)?;
    let acc = OFlag::from_bits_truncate(fl) & OFlag::O_ACCMODE;
    Ok(acc == OFlag::O_RDWR || acc == OFlag::O_WRONLY)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_memfd_refuses_resize() {
        let fd = create_sealed(c"t", 8192).unwrap();
        let f = File::from(fd.try_clone().unwrap());
        assert!(f.set_len(4096).is_err());
        assert!(f.set_len(16384).is_err());
        check_sealed(fd.as_fd(), 8192).unwrap();
        assert!(check_sealed(fd.as_fd(), 4096).is_err());
    }

    #[test]
    fn read_only_reopen_cannot_map_writable() {
        let fd = create_sealed(c"t", 4096).unwrap();
        let mut rw = map_rw(fd.as_fd(), 4096).unwrap();
        rw[10] = 7;
        let ro = reopen_read_only(fd.as_fd()).unwrap();
        assert!(!is_writable(&ro).unwrap());
        assert!(map_rw(ro.as_fd(), 4096).is_err());
        let m = map_ro(ro.as_fd(), 4096).unwrap();
        assert_eq!(m[10], 7);
    }

    #[test]
    fn unsealed_fd_is_refused() {
        let fd = memfd_create(c"u", MFdFlags::MFD_CLOEXEC).unwrap();
        let f = File::from(fd);
        f.set_len(4096).unwrap();
        assert!(check_sealed(f.as_fd(), 4096).is_err());
    }
}
