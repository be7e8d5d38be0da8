//! Unix-socket helpers: sending frames with file descriptors, reassembling received frames,
//! and reading the peer's credentials.
//!
//! File descriptors travel as SCM_RIGHTS attached to the first `sendmsg` of their frame, so
//! the kernel delivers them with the first bytes of that frame. [`FrameReader`] never reads
//! past the end of the frame it is assembling (it asks for the header, then for exactly the
//! body), so every descriptor it receives belongs to the frame being assembled. Descriptors
//! are received with `MSG_CMSG_CLOEXEC`, held as [`OwnedFd`] (closed on drop), and all of
//! them are closed if the kernel reports a truncated control message (`MSG_CTRUNC`).

use crate::proto::{HEADER_LEN, Header, MAX_FDS_PER_FRAME, Message, ProtoError, allowed_fds};
use nix::errno::Errno;
use nix::libc;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{ControlMessage, MsgFlags, UnixAddr, getsockopt, sendmsg, sockopt};
use nix::unistd::{Gid, Pid, Uid};
use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

/// A decoded and validated frame with the descriptors that came with it.
pub type Frame = (Header, Message, Vec<OwnedFd>);

/// Most descriptors one `recvmsg` accepts. A peer attaching more gets `MSG_CTRUNC`, and the
/// reader closes what arrived and fails.
pub const MAX_FDS_PER_RECV: usize = 8;

/// Most descriptors one `sendmsg` may attach (the kernel's SCM_MAX_FD).
const SCM_MAX_FD: usize = 253;

/// Frames [`FrameReader::read_from`] queues before it pauses reading.
pub const MAX_READY_FRAMES: usize = 16;

/// Bytes asked of one `recvmsg`; the buffer grows by at most this much per call.
const RECV_CHUNK: usize = 64 * 1024;

/// Errors of the blocking frame helpers.
#[derive(Debug, thiserror::Error)]
pub enum UdsError {
    /// A `recvmsg` failed, or the reader refused descriptors (see [`FdRefused`]).
    #[error("receiving a frame")]
    Recv(#[source] io::Error),
    /// Waiting for the socket to become readable failed.
    #[error("waiting for a frame")]
    Poll(#[source] io::Error),
    /// The peer sent a frame that failed validation.
    #[error("peer sent an invalid frame")]
    Protocol(#[from] ProtoError),
    /// The peer closed the connection at a frame boundary.
    #[error("peer closed the connection")]
    Closed,
    /// No complete frame arrived in time.
    #[error("no frame within {timeout_ms} ms")]
    TimedOut { timeout_ms: u128 },
}

/// Why a [`FrameReader`] refused received descriptors. Carried inside the
/// [`io::ErrorKind::InvalidData`] errors of [`FrameReader::read_from`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FdRefused {
    /// The control message was truncated; the descriptors that did arrive were closed.
    #[error("control message truncated (more than {max} descriptors?); closed {closed} received")]
    ControlTruncated { closed: usize, max: usize },
}

/// Credentials of the process at the other end of a Unix socket, as of `connect`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    pub pid: Pid,
    pub uid: Uid,
    pub gid: Gid,
}

/// Reads the peer's credentials with `SO_PEERCRED`.
pub fn peer_credentials(fd: impl AsFd) -> io::Result<PeerCred> {
    let cred = getsockopt(&fd.as_fd(), sockopt::PeerCredentials)?;
    Ok(PeerCred {
        pid: Pid::from_raw(cred.pid()),
        uid: Uid::from_raw(cred.uid()),
        gid: Gid::from_raw(cred.gid()),
    })
}

/// Writes the whole of `bytes` to the socket, attaching `fds` to the first `sendmsg` only.
///
/// On a nonblocking socket, returns [`io::ErrorKind::WouldBlock`] only if nothing was
/// written; once part of the frame is out, waits with `poll` until the rest is (frames are
/// small). Retries `EINTR`. Never raises SIGPIPE (`MSG_NOSIGNAL`); a closed peer is
/// `BrokenPipe`.
pub fn send_frame(fd: impl AsFd, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let fd = fd.as_fd();
    if bytes.is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty frame"));
    }
    if fds.len() > SCM_MAX_FD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} descriptors exceed the {SCM_MAX_FD} one sendmsg carries",
                fds.len()
            ),
        ));
    }
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let mut sent = 0;
    while sent < bytes.len() {
        let iov = [IoSlice::new(&bytes[sent..])];
        let rights = [ControlMessage::ScmRights(&raw)];
        let cmsgs: &[ControlMessage<'_>] = if sent == 0 && !raw.is_empty() {
            &rights
        } else {
            &[]
        };
        match sendmsg::<UnixAddr>(fd.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(n) => sent += n,
            Err(Errno::EINTR) => {}
            Err(Errno::EAGAIN) if sent == 0 => return Err(io::ErrorKind::WouldBlock.into()),
            Err(Errno::EAGAIN) => wait_for(fd, PollFlags::POLLOUT, PollTimeout::NONE)?,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Waits until `fd` is ready for `events` or `timeout` passes (or a signal interrupts);
/// callers retry their operation either way.
fn wait_for(fd: BorrowedFd<'_>, events: PollFlags, timeout: PollTimeout) -> io::Result<()> {
    let mut fds = [PollFd::new(fd, events)];
    match poll(&mut fds, timeout) {
        Ok(_) | Err(Errno::EINTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// What one [`FrameReader::read_from`] call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadOutcome {
    /// Nothing to read: the socket returned WouldBlock at once.
    WouldBlock,
    /// Read `bytes` bytes, then the socket returned WouldBlock. Call
    /// [`FrameReader::next_frame`] until it returns `None`.
    Progressed { bytes: usize },
    /// Stopped after `bytes` bytes with data possibly left in the socket, because
    /// [`MAX_READY_FRAMES`] frames are queued. Drain [`FrameReader::next_frame`], then call
    /// `read_from` again (an edge-triggered poller will not report the socket again).
    Paused { bytes: usize },
    /// The peer closed its end. Queued frames, and a `Truncated` error if it closed mid
    /// frame, remain for [`FrameReader::next_frame`].
    Eof,
    /// A frame failed validation: its error is queued for [`FrameReader::next_frame`] and the
    /// reader reads no more. Drop the connection.
    Failed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Reading,
    Eof,
    Failed,
    /// A control message was truncated; every later read fails.
    Broken,
}

/// Reassembles frames from a stream socket, with the descriptors each frame carries.
///
/// Reads at most one frame ahead: the header first, then exactly `body_len` bytes. The header
/// is validated as soon as its 24 bytes are in (an oversized `body_len` is refused before a
/// byte of body is read) and the whole frame is validated (layers 1 to 5 of
/// [`crate::proto`]) before it is queued. The buffer never exceeds
/// [`crate::proto::MAX_FRAME_LEN`].
#[derive(Debug)]
pub struct FrameReader {
    /// Bytes of the frame being assembled.
    buf: Vec<u8>,
    /// Its header, once the first [`HEADER_LEN`] bytes passed [`Header::parse`].
    header: Option<Header>,
    /// Descriptors received with the frame being assembled.
    fds: Vec<OwnedFd>,
    /// Complete frames and errors, in arrival order.
    ready: VecDeque<Result<Frame, ProtoError>>,
    state: State,
}

impl Default for FrameReader {
    fn default() -> Self {
        FrameReader::new()
    }
}

impl FrameReader {
    /// An empty reader. It allocates nothing until bytes arrive.
    pub fn new() -> FrameReader {
        FrameReader {
            buf: Vec::new(),
            header: None,
            fds: Vec::new(),
            ready: VecDeque::new(),
            state: State::Reading,
        }
    }

    /// Reads from `fd` (with `MSG_DONTWAIT`, whatever the socket's mode) until it would
    /// block, the peer closes, a frame fails, or [`MAX_READY_FRAMES`] are queued. Retries
    /// `EINTR`. Fails with [`io::ErrorKind::InvalidData`] carrying [`FdRefused`] if a
    /// control message was truncated, after closing every descriptor received.
    pub fn read_from(&mut self, fd: impl AsFd) -> io::Result<ReadOutcome> {
        self.read_until(fd.as_fd(), MAX_READY_FRAMES)
    }

    /// The next complete frame, `Ok(None)` if none is complete yet, or the error of the first
    /// frame that failed (every [`ProtoError`] is fatal: drop the connection).
    pub fn next_frame(&mut self) -> Result<Option<Frame>, ProtoError> {
        self.ready.pop_front().transpose()
    }

    /// Bytes of the frame being assembled, for tests and diagnostics.
    pub fn pending_bytes(&self) -> usize {
        self.buf.len()
    }

    /// Bytes this reader holds allocated (its buffer and its queue of frames), for tests and
    /// diagnostics.
    pub fn allocated_bytes(&self) -> usize {
        self.buf.capacity() + self.ready.capacity() * size_of::<Result<Frame, ProtoError>>()
    }

    /// Frees the buffers when no frame is being assembled and none is queued, so that an
    /// idle connection costs nothing here however large its last frame was. A connection
    /// that goes on receiving allocates again on its next read.
    pub fn shrink_idle(&mut self) {
        if self.buf.is_empty() && self.header.is_none() && self.fds.is_empty() {
            self.buf = Vec::new();
            self.fds = Vec::new();
        }
        if self.ready.is_empty() {
            self.ready = VecDeque::new();
        }
    }

    /// The frames read and not yet taken with [`FrameReader::next_frame`], oldest first
    /// (those that passed validation).
    pub fn queued(&self) -> impl Iterator<Item = &Frame> {
        self.ready.iter().filter_map(|r| r.as_ref().ok())
    }

    fn read_until(&mut self, fd: BorrowedFd<'_>, max_ready: usize) -> io::Result<ReadOutcome> {
        match self.state {
            State::Reading => {}
            State::Eof => return Ok(ReadOutcome::Eof),
            State::Failed => return Ok(ReadOutcome::Failed),
            State::Broken => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "reader failed on an earlier control message",
                ));
            }
        }
        let mut total = 0;
        loop {
            if self.ready.len() >= max_ready {
                return Ok(ReadOutcome::Paused { bytes: total });
            }
            let want = match self.header {
                None => HEADER_LEN,
                Some(h) => h.frame_len(),
            };
            let have = self.buf.len();
            let upto = want.min(have + RECV_CHUNK);
            self.buf.resize(upto, 0);
            let got = recv_with_fds(fd, &mut self.buf[have..upto], &mut self.fds);
            let n = match got {
                Ok(n) => n,
                Err(e) => {
                    self.buf.truncate(have);
                    if e.get_ref().is_some_and(|r| r.is::<FdRefused>()) {
                        self.fds.clear();
                        self.state = State::Broken;
                    }
                    return match e.kind() {
                        io::ErrorKind::WouldBlock if total == 0 => Ok(ReadOutcome::WouldBlock),
                        io::ErrorKind::WouldBlock => Ok(ReadOutcome::Progressed { bytes: total }),
                        _ => Err(e),
                    };
                }
            };
            self.buf.truncate(have + n);
            total += n;
            if n == 0 {
                if !self.buf.is_empty() {
                    let need = self.header.map_or(HEADER_LEN, |h| h.frame_len());
                    let got = self.buf.len();
                    self.fail(ProtoError::Truncated { need, got });
                }
                self.state = State::Eof;
                return Ok(ReadOutcome::Eof);
            }
            if let Err(e) = self.advance() {
                self.fail(e);
                return Ok(ReadOutcome::Failed);
            }
        }
    }

    /// Moves the frame being assembled forward after a read: parses the header once it is
    /// complete, refuses surplus descriptors early, and queues the frame once complete.
    fn advance(&mut self) -> Result<(), ProtoError> {
        let header = match self.header {
            Some(h) => h,
            None if self.buf.len() < HEADER_LEN => return Ok(()),
            None => {
                let h = Header::parse(&self.buf)?;
                self.header = Some(h);
                h
            }
        };
        let allowed = allowed_fds(header.msg_type);
        if self.fds.len() > allowed {
            return Err(ProtoError::BadFds {
                msg_type: header.msg_type,
                expected: allowed,
                got: self.fds.len(),
            });
        }
        if self.buf.len() < header.frame_len() {
            return Ok(());
        }
        let fds = std::mem::take(&mut self.fds);
        let msg = Message::from_frame(&header, &self.buf[HEADER_LEN..], fds.len())?;
        self.buf.clear();
        self.buf.shrink_to(RECV_CHUNK);
        self.header = None;
        self.ready.push_back(Ok((header, msg, fds)));
        Ok(())
    }

    /// Queues `e`, closes the descriptors of the frame and stops reading.
    fn fail(&mut self, e: ProtoError) {
        self.fds.clear();
        self.buf = Vec::new();
        self.header = None;
        self.ready.push_back(Err(e));
        self.state = State::Failed;
    }

    /// Reads one frame, waiting with `poll` while the socket has nothing (works on blocking
    /// and nonblocking sockets). `timeout` of `None` waits for ever.
    pub fn read_frame(
        &mut self,
        fd: impl AsFd,
        timeout: Option<Duration>,
    ) -> Result<Frame, UdsError> {
        let fd = fd.as_fd();
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(frame) = self.next_frame()? {
                return Ok(frame);
            }
            match self.read_until(fd, 1).map_err(UdsError::Recv)? {
                ReadOutcome::Eof => {
                    return match self.next_frame()? {
                        Some(frame) => Ok(frame),
                        None => Err(UdsError::Closed),
                    };
                }
                ReadOutcome::WouldBlock | ReadOutcome::Progressed { .. } => {
                    if !self.ready.is_empty() {
                        continue;
                    }
                    let wait = match deadline {
                        None => PollTimeout::NONE,
                        Some(d) => {
                            let left = d.saturating_duration_since(Instant::now());
                            if left.is_zero() {
                                return Err(UdsError::TimedOut {
                                    timeout_ms: timeout.unwrap_or_default().as_millis(),
                                });
                            }
                            // Round up so a sub-millisecond remainder still waits.
                            let ms = left.as_millis().saturating_add(1);
                            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
                        }
                    };
                    wait_for(fd, PollFlags::POLLIN, wait).map_err(UdsError::Poll)?;
                }
                ReadOutcome::Paused { .. } | ReadOutcome::Failed => {}
            }
        }
    }
}

/// Reads one frame from `stream`, blocking until it is complete (a convenience for clients;
/// works on nonblocking sockets too). The peer closing at a frame boundary is
/// [`UdsError::Closed`].
pub fn read_frame_blocking(stream: impl AsFd) -> Result<Frame, UdsError> {
    FrameReader::new().read_frame(stream, None)
}

/// Like [`read_frame_blocking`], giving up after `timeout` with [`UdsError::TimedOut`].
pub fn read_frame_timeout(stream: impl AsFd, timeout: Duration) -> Result<Frame, UdsError> {
    FrameReader::new().read_frame(stream, Some(timeout))
}

/// Control-message space for [`MAX_FDS_PER_RECV`] descriptors, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct CmsgBuffer([u8; CMSG_BUFFER_LEN]);

/// `CMSG_SPACE(MAX_FDS_PER_RECV * sizeof(int))`, rounded up to the buffer alignment.
const CMSG_BUFFER_LEN: usize =
    align8(size_of::<libc::cmsghdr>()) + align8(MAX_FDS_PER_RECV * size_of::<libc::c_int>());

const fn align8(n: usize) -> usize {
    (n + 7) & !7
}

const _: () = assert!(MAX_FDS_PER_FRAME <= MAX_FDS_PER_RECV);

/// One `recvmsg(MSG_DONTWAIT | MSG_CMSG_CLOEXEC)` into `buf`, retrying `EINTR`. Received
/// descriptors are appended to `fds` as owned; on `MSG_CTRUNC` they are all closed and the
/// call fails with [`FdRefused::ControlTruncated`].
fn recv_with_fds(fd: BorrowedFd<'_>, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    if buf.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "empty receive buffer",
        ));
    }
    let mut cmsg = CmsgBuffer([0u8; CMSG_BUFFER_LEN]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is a plain C struct of integers and raw pointers, for which all-zero
    // bytes are a valid value (null pointers, zero lengths).
    let mut mhdr: libc::msghdr = unsafe { std::mem::zeroed() };
    mhdr.msg_iov = &raw mut iov;
    mhdr.msg_iovlen = 1;
    mhdr.msg_control = cmsg.0.as_mut_ptr().cast();
    // A constant of a few dozen bytes: fits size_t (glibc) and socklen_t (musl) alike.
    mhdr.msg_controllen = CMSG_BUFFER_LEN as _;
    let n = loop {
        // SAFETY: `fd` is a live descriptor borrowed for the call. `mhdr` points to one iovec
        // covering `buf` (valid for writes of `buf.len()` bytes, exclusively borrowed) and to
        // `cmsg` (valid for writes of CMSG_BUFFER_LEN bytes, aligned for cmsghdr); both
        // outlive the call. No address buffer is given (msg_name is null, msg_namelen 0).
        let r = unsafe {
            libc::recvmsg(
                fd.as_raw_fd(),
                &raw mut mhdr,
                libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
            )
        };
        match Errno::result(r) {
            Ok(n) => break n,
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let received = take_rights(&mhdr, &cmsg);
    if mhdr.msg_flags & libc::MSG_CTRUNC != 0 {
        let closed = received.len();
        drop(received);
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            FdRefused::ControlTruncated {
                closed,
                max: MAX_FDS_PER_RECV,
            },
        ));
    }
    fds.extend(received);
    usize::try_from(n).map_err(|_| io::Error::other("recvmsg returned a negative length"))
}

/// Takes ownership of every descriptor in the SCM_RIGHTS messages that `recvmsg` left in
/// `cmsg`, including those of a truncated control message.
fn take_rights(mhdr: &libc::msghdr, cmsg: &CmsgBuffer) -> Vec<OwnedFd> {
    let mut out = Vec::new();
    let start = cmsg.0.as_ptr() as usize;
    // The kernel never reports more control data than the buffer holds; clamp anyway.
    // (msg_controllen and cmsg_len are size_t on glibc but socklen_t on musl.)
    #[allow(clippy::useless_conversion)]
    let controllen = usize::try_from(mhdr.msg_controllen)
        .unwrap_or(0)
        .min(CMSG_BUFFER_LEN);
    let end = start + controllen;
    let header_len = align8(size_of::<libc::cmsghdr>());
    // SAFETY: `mhdr` is the msghdr `recvmsg` filled in; its msg_control points to `cmsg`,
    // borrowed here, and msg_controllen is the length the kernel wrote.
    let mut hdr = unsafe { libc::CMSG_FIRSTHDR(mhdr) };
    while !hdr.is_null() {
        let at = hdr as usize;
        if at + size_of::<libc::cmsghdr>() > end {
            break;
        }
        // SAFETY: `hdr` is non-null, inside `cmsg` with a whole cmsghdr before `end`
        // (checked above), and aligned: the buffer is 8-aligned and CMSG_FIRSTHDR /
        // CMSG_NXTHDR only return aligned headers.
        let h = unsafe { std::ptr::read(hdr) };
        #[allow(clippy::useless_conversion)]
        let len = usize::try_from(h.cmsg_len).unwrap_or(0);
        if len < header_len || at + len > end {
            break;
        }
        if h.cmsg_level == libc::SOL_SOCKET && h.cmsg_type == libc::SCM_RIGHTS {
            let count = (len - header_len) / size_of::<libc::c_int>();
            // SAFETY: CMSG_DATA of a header inside the buffer points `header_len` bytes
            // after it, still inside the buffer.
            let data = unsafe { libc::CMSG_DATA(hdr) };
            for i in 0..count {
                // SAFETY: `header_len + (i + 1) * size_of::<c_int>() <= len` and
                // `at + len <= end`, so the read is inside `cmsg`; read_unaligned needs no
                // alignment.
                let raw: RawFd = unsafe {
                    data.add(i * size_of::<libc::c_int>())
                        .cast::<libc::c_int>()
                        .read_unaligned()
                };
                if raw >= 0 {
                    // SAFETY: the kernel installed `raw` in our table for this SCM_RIGHTS
                    // message and nothing else owns it yet; we take sole ownership.
                    out.push(unsafe { OwnedFd::from_raw_fd(raw) });
                }
            }
        }
        // SAFETY: `mhdr` and `hdr` are as above; CMSG_NXTHDR checks the next header against
        // msg_control + msg_controllen and returns null past the end.
        hdr = unsafe { libc::CMSG_NXTHDR(mhdr, hdr) };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{Dtype, PageGeometry};
    use crate::ids::RequestId;
    use crate::proto::{MAX_BODY_LEN, MsgType, PrefillPool, RawHeader, Role, StatusQuery, Submit};
    use nix::fcntl::{FcntlArg, FdFlag, OFlag, fcntl};
    use std::fs::File;
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::unix::net::UnixStream;
    use zerocopy::little_endian::U32;
    use zerocopy::{FromBytes, IntoBytes};

    fn pool_msg() -> Message {
        PrefillPool {
            worker: "prefill-0".into(),
            geometry: PageGeometry {
                tokens_per_page: 16,
                layers: 1,
                kv_heads: 1,
                head_dim: 8,
                dtype: Dtype::F32,
            },
            pool_pages: 4,
        }
        .into()
    }

    fn submit_msg() -> Message {
        Submit {
            tenant: "t".into(),
            prompt: crate::model::tokenize(b"why is the sky blue"),
            max_new_tokens: 8,
            deadline_ms: 0,
            sampling: crate::proto::Sampling::GREEDY,
        }
        .into()
    }

    fn tempfile_with(contents: &[u8]) -> File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(contents).unwrap();
        f
    }

    fn is_cloexec(fd: &OwnedFd) -> bool {
        let flags = fcntl(fd, FcntlArg::F_GETFD).unwrap();
        FdFlag::from_bits_truncate(flags).contains(FdFlag::FD_CLOEXEC)
    }

    /// A nonblocking pipe: (read end as a File, write end).
    fn pipe() -> (File, OwnedFd) {
        let (r, w) = nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC).unwrap();
        (File::from(r), w)
    }

    /// Whether every write end of the pipe is closed: a read then sees EOF, not WouldBlock.
    fn writers_closed(mut read_end: &File) -> bool {
        let mut b = [0u8; 1];
        matches!(read_end.read(&mut b), Ok(0))
    }

    #[test]
    fn frame_with_fd_arrives_usable_and_cloexec() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = tempfile_with(b"kv pages");
        let frame = pool_msg().encode(RequestId(3)).unwrap();
        send_frame(&a, &frame, &[file.as_fd()]).unwrap();
        drop(file);
        let (header, msg, fds) = read_frame_blocking(&b).unwrap();
        assert_eq!(header.msg_type, MsgType::PrefillPool);
        assert_eq!(header.request_id, RequestId(3));
        assert_eq!(msg, pool_msg());
        assert_eq!(fds.len(), 1);
        assert!(is_cloexec(&fds[0]), "received fd lacks FD_CLOEXEC");
        let mut f = File::from(fds.into_iter().next().unwrap());
        f.seek(SeekFrom::Start(0)).unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        assert_eq!(s, "kv pages");
    }

    #[test]
    fn nonblocking_reader_matches_fd_to_its_frame() {
        let (a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let file = tempfile_with(b"x");
        let first = submit_msg().encode(RequestId(1)).unwrap();
        let second = pool_msg().encode(RequestId(2)).unwrap();
        let third = Message::from(StatusQuery {}).encode(RequestId(3)).unwrap();
        send_frame(&a, &first, &[]).unwrap();
        send_frame(&a, &second, &[file.as_fd()]).unwrap();
        send_frame(&a, &third, &[]).unwrap();
        let mut reader = FrameReader::new();
        let total = first.len() + second.len() + third.len();
        assert_eq!(
            reader.read_from(&b).unwrap(),
            ReadOutcome::Progressed { bytes: total }
        );
        let got: Vec<_> = std::iter::from_fn(|| reader.next_frame().unwrap()).collect();
        let ids: Vec<_> = got
            .iter()
            .map(|(h, _, fds)| (h.request_id.0, fds.len()))
            .collect();
        assert_eq!(ids, [(1, 0), (2, 1), (3, 0)]);
        assert_eq!(reader.read_from(&b).unwrap(), ReadOutcome::WouldBlock);
        drop(a);
        assert_eq!(reader.read_from(&b).unwrap(), ReadOutcome::Eof);
        assert!(reader.next_frame().unwrap().is_none());
    }

    #[test]
    fn one_byte_writes_reassemble() {
        let (a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let frame = submit_msg().encode(RequestId(9)).unwrap();
        let mut reader = FrameReader::new();
        for (i, byte) in frame.iter().enumerate() {
            assert!(
                reader.next_frame().unwrap().is_none(),
                "frame complete after {i} bytes"
            );
            send_frame(&a, std::slice::from_ref(byte), &[]).unwrap();
            assert_eq!(
                reader.read_from(&b).unwrap(),
                ReadOutcome::Progressed { bytes: 1 }
            );
        }
        let (header, msg, fds) = reader.next_frame().unwrap().unwrap();
        assert_eq!(header.request_id, RequestId(9));
        assert_eq!(msg, submit_msg());
        assert!(fds.is_empty());
        assert_eq!(reader.pending_bytes(), 0);
    }

    #[test]
    fn blocking_read_reassembles_split_writes() {
        let (a, b) = UnixStream::pair().unwrap();
        let frame = submit_msg().encode(RequestId(4)).unwrap();
        let writer = std::thread::spawn(move || {
            for byte in &frame {
                send_frame(&a, std::slice::from_ref(byte), &[]).unwrap();
            }
        });
        let (_, msg, _) = read_frame_timeout(&b, Duration::from_secs(10)).unwrap();
        assert_eq!(msg, submit_msg());
        writer.join().unwrap();
        assert!(matches!(read_frame_blocking(&b), Err(UdsError::Closed)));
    }

    #[test]
    fn oversized_header_is_refused_before_the_body_is_read() {
        let (mut a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let mut frame = Message::from(StatusQuery {}).encode(RequestId(1)).unwrap();
        let mut raw = RawHeader::read_from_prefix(&frame).unwrap().0;
        raw.body_len = U32::new(MAX_BODY_LEN + 1);
        frame.copy_from_slice(raw.as_bytes());
        a.write_all(&frame).unwrap();
        a.write_all(b"body bytes").unwrap();
        let mut reader = FrameReader::new();
        assert_eq!(reader.read_from(&b).unwrap(), ReadOutcome::Failed);
        assert!(matches!(
            reader.next_frame(),
            Err(ProtoError::Oversized { .. })
        ));
        assert_eq!(reader.read_from(&b).unwrap(), ReadOutcome::Failed);
        // Not a byte of the body was consumed.
        let mut rest = [0u8; 32];
        let n = (&b).read(&mut rest).unwrap();
        assert_eq!(&rest[..n], b"body bytes");
    }

    #[test]
    fn peer_credentials_are_ours() {
        let (a, _b) = UnixStream::pair().unwrap();
        let cred = peer_credentials(&a).unwrap();
        assert_eq!(cred.pid, Pid::this());
        assert_eq!(cred.uid, Uid::current());
        assert_eq!(cred.gid, Gid::current());
    }

    #[test]
    fn fds_on_a_type_that_carries_none_are_refused_and_closed() {
        let (a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let (read_end, write_end) = pipe();
        let frame = submit_msg().encode(RequestId(1)).unwrap();
        send_frame(&a, &frame, &[write_end.as_fd()]).unwrap();
        drop(write_end);
        assert!(
            !writers_closed(&read_end),
            "the descriptor in flight is an open writer"
        );
        let mut reader = FrameReader::new();
        assert_eq!(reader.read_from(&b).unwrap(), ReadOutcome::Failed);
        assert!(matches!(
            reader.next_frame(),
            Err(ProtoError::BadFds {
                msg_type: MsgType::Submit,
                expected: 0,
                got: 1
            })
        ));
        assert!(writers_closed(&read_end), "refused descriptor still open");
    }

    #[test]
    fn prefill_register_without_its_fd_is_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        let msg = Message::from(crate::proto::RegisterWorker {
            id: "w-0".into(),
            role: Role::Prefill,
            geometry: PageGeometry {
                tokens_per_page: 16,
                layers: 1,
                kv_heads: 1,
                head_dim: 8,
                dtype: Dtype::F32,
            },
            pool_pages: 4,
            transports: vec![crate::proto::Transport::Shm],
            endpoint: None,
            model: "reference".into(),
            max_batch: 0,
        });
        send_frame(&a, &msg.encode(RequestId(0)).unwrap(), &[]).unwrap();
        assert!(matches!(
            read_frame_blocking(&b),
            Err(UdsError::Protocol(ProtoError::BadFds {
                expected: 1,
                got: 0,
                ..
            }))
        ));
    }

    #[test]
    fn too_many_fds_truncate_and_are_closed() {
        let (a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let (readers, writers): (Vec<File>, Vec<OwnedFd>) =
            (0..MAX_FDS_PER_RECV + 4).map(|_| pipe()).unzip();
        let borrowed: Vec<BorrowedFd<'_>> = writers.iter().map(AsFd::as_fd).collect();
        let frame = pool_msg().encode(RequestId(1)).unwrap();
        send_frame(&a, &frame, &borrowed).unwrap();
        drop(writers);
        let mut reader = FrameReader::new();
        let err = reader.read_from(&b).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        let refused = err
            .get_ref()
            .and_then(|e| e.downcast_ref::<FdRefused>())
            .copied();
        assert!(
            matches!(
                refused,
                Some(FdRefused::ControlTruncated {
                    closed: MAX_FDS_PER_RECV,
                    ..
                })
            ),
            "{err}"
        );
        for (i, r) in readers.iter().enumerate() {
            assert!(
                writers_closed(r),
                "descriptor {i} of a truncated message stayed open"
            );
        }
        assert!(reader.read_from(&b).is_err());
    }

    #[test]
    fn eof_mid_frame_is_truncated() {
        let (a, b) = UnixStream::pair().unwrap();
        let frame = submit_msg().encode(RequestId(1)).unwrap();
        send_frame(&a, &frame[..frame.len() - 2], &[]).unwrap();
        drop(a);
        let len = frame.len();
        let r = read_frame_blocking(&b);
        assert!(
            matches!(r, Err(UdsError::Protocol(ProtoError::Truncated { need, got }))
                if need == len && got == len - 2),
            "{r:?}"
        );
    }

    #[test]
    fn read_times_out() {
        let (_a, b) = UnixStream::pair().unwrap();
        assert!(matches!(
            read_frame_timeout(&b, Duration::from_millis(20)),
            Err(UdsError::TimedOut { .. })
        ));
    }

    #[test]
    fn nonblocking_send_to_a_full_socket_would_block() {
        let (a, _b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let mut filled = 0u32;
        loop {
            match (&a).write(&[0]) {
                Ok(_) => filled += 1,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
            assert!(filled < 10_000_000, "socket never filled");
        }
        let frame = submit_msg().encode(RequestId(1)).unwrap();
        let err = send_frame(&a, &frame, &[]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
        assert_eq!(
            send_frame(&a, &[], &[]).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }
}
