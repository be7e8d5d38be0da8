//! Sealed memfd regions: creation, sealing, read-only re-opening and mapping.
//!
//! A pool is one memfd sized once, then sealed against shrinking and growing (and against
//! further seal changes), so that no process holding it can truncate it under a mapping and
//! turn later accesses into SIGBUS. It is mapped shared and pre-faulted once at start.

use memmap2::{Mmap, MmapMut, MmapOptions};
use nix::fcntl::{FcntlArg, OFlag, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::stat::{Mode, fstat};
use std::ffi::CStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

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

/// Maps a sealed memfd read-write, shared, pre-faulted.
pub fn map_rw(fd: BorrowedFd<'_>, len: u64) -> io::Result<MmapMut> {
    check_sealed(fd, len)?;
    let len = usize::try_from(len).map_err(|_| io::Error::other("pool too large"))?;
    let file = File::from(fd.try_clone_to_owned()?);
    // SAFETY: the memfd is sealed against shrinking (checked above), so the mapping can never
    // extend past the end of the file and no access through it raises SIGBUS. Concurrent
    // writers to the same pages are excluded by the page ownership table, which is the only way
    // this crate hands out page slices.
    let map = unsafe { MmapOptions::new().len(len).populate().map_mut(&file)? };
    Ok(map)
}

/// Maps a sealed memfd read-only, shared, pre-faulted.
pub fn map_ro(fd: BorrowedFd<'_>, len: u64) -> io::Result<Mmap> {
    check_sealed(fd, len)?;
    let len = usize::try_from(len).map_err(|_| io::Error::other("pool too large"))?;
    let file = File::from(fd.try_clone_to_owned()?);
    // SAFETY: sealed against shrinking (checked above), so no SIGBUS. The contents may change
    // under the mapping (the owner writes its pages); this crate never forms references into it
    // and only copies bytes out through raw pointers, then verifies the copy's digest.
    let map = unsafe { MmapOptions::new().len(len).populate().map(&file)? };
    Ok(map)
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
