//! The outgoing-frame queue of a non-blocking Unix-socket connection, shared by kvctld (one
//! per peer) and the workers' link to kvctld.
//!
//! Frames are queued whole, already encoded, each with the file descriptors it carries
//! (attached to its first byte, as `SCM_RIGHTS`). [`Outbox::flush`] writes as much as the
//! socket takes without blocking and remembers how far into the front frame it got, so a
//! full socket never stalls an event loop and never splits a frame from its descriptors.
//! The queue is bounded in bytes by its owner: [`Outbox::bytes`] says how much is waiting.

use nix::errno::Errno;
use nix::sys::socket::{ControlMessage, MsgFlags, UnixAddr, sendmsg};
use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};

#[derive(Debug)]
struct Outgoing {
    bytes: Vec<u8>,
    fds: Vec<OwnedFd>,
    /// Bytes of `bytes` already written; the descriptors went with the first of them.
    sent: usize,
}

/// Frames waiting to be written, in order.
#[derive(Debug, Default)]
pub struct Outbox {
    frames: VecDeque<Outgoing>,
    bytes: usize,
}

/// What [`Outbox::flush`] left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flushed {
    /// Everything was written.
    Empty,
    /// The socket is full; flush again once it is writable.
    Pending,
}

impl Outbox {
    /// An empty queue.
    pub fn new() -> Outbox {
        Outbox::default()
    }

    /// Queues one encoded frame and the descriptors it carries.
    pub fn push(&mut self, bytes: Vec<u8>, fds: Vec<OwnedFd>) {
        self.bytes += bytes.len();
        self.frames.push_back(Outgoing {
            bytes,
            fds,
            sent: 0,
        });
    }

    /// Bytes queued and not yet written.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Frames queued (the front one may be partly written).
    pub fn len(&self) -> usize {
        self.frames.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Frees the queue's storage when nothing is queued, so that an idle connection holds
    /// no memory here; the next [`Outbox::push`] allocates again.
    pub fn shrink_idle(&mut self) {
        if self.frames.is_empty() {
            self.frames = VecDeque::new();
        }
    }

    /// Bytes of storage the queue holds allocated (its slots, not the frames' bytes).
    pub fn allocated_bytes(&self) -> usize {
        self.frames.capacity() * size_of::<Outgoing>()
    }

    /// Writes queued frames to `socket` until it would block. An error other than
    /// `EAGAIN`/`EINTR` means the connection is unusable; the caller drops it.
    pub fn flush(&mut self, socket: impl AsFd) -> io::Result<Flushed> {
        let fd = socket.as_fd().as_raw_fd();
        while let Some(front) = self.frames.front_mut() {
            let rest = &front.bytes[front.sent..];
            let iov = [IoSlice::new(rest)];
            let raw: Vec<RawFd> = front.fds.iter().map(AsRawFd::as_raw_fd).collect();
            let rights = [ControlMessage::ScmRights(&raw)];
            let cmsgs: &[ControlMessage<'_>] = if front.sent == 0 && !raw.is_empty() {
                &rights
            } else {
                &[]
            };
            let flags = MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT;
            match sendmsg::<UnixAddr>(fd, &iov, cmsgs, flags, None) {
                Ok(n) => {
                    front.sent += n;
                    self.bytes -= n;
                    if front.sent >= front.bytes.len() {
                        self.frames.pop_front();
                    }
                }
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => return Ok(Flushed::Pending),
                Err(e) => return Err(e.into()),
            }
        }
        Ok(Flushed::Empty)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_full_socket_keeps_the_rest_in_order() {
        let (a, mut b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let mut out = Outbox::new();
        // Far more than a socket buffer holds: the flush must stop, not block.
        let frames: Vec<Vec<u8>> = (0..64u8).map(|i| vec![i; 64 * 1024]).collect();
        for f in &frames {
            out.push(f.clone(), Vec::new());
        }
        assert_eq!(out.bytes(), 64 * 64 * 1024);
        assert_eq!(out.flush(&a).unwrap(), Flushed::Pending);
        let mut got = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        while got.len() < 64 * 64 * 1024 {
            let n = b.read(&mut buf).unwrap();
            got.extend_from_slice(&buf[..n]);
            // Drain what was read, then let the outbox write more.
            let _ = out.flush(&a).unwrap();
        }
        assert!(out.is_empty());
        assert_eq!(out.bytes(), 0);
        assert_eq!(got, frames.concat());
    }

    #[test]
    fn a_closed_peer_is_an_error() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(b);
        let mut out = Outbox::new();
        out.push(vec![1, 2, 3], Vec::new());
        assert!(out.flush(&a).is_err());
    }
}
