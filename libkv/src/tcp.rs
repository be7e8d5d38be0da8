//! The TCP page path: kvfence frames on a TCP stream between decoded (which pulls) and
//! prefilld's page server. See the "Pulling over TCP" section of [`crate::proto`].
//!
//! Both ends read with a short socket timeout and call a `keep_going` check between slices,
//! so a cancelled request, a passed deadline or a stop ends a transfer within one slice even
//! when the peer is silent, and a dead peer cannot hang a thread.

use crate::Owner;
use crate::ids::PageId;
use crate::proto::{
    self, ErrorCode, HEADER_LEN, Header, Message, MsgType, PageData, PageRequest, ProtoError,
    TOKEN_BYTES,
};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Longest a blocking read or write waits before the caller's check runs again.
pub const IO_SLICE: Duration = Duration::from_millis(100);
/// Largest body of a frame on the page path (a `PageRequest` of the largest manifest).
pub const MAX_PAGE_PATH_BODY: usize = proto::MAX_BODY_LEN as usize;

/// Errors of the TCP page path.
#[derive(Debug, thiserror::Error)]
pub enum TcpError {
    /// A socket operation failed.
    #[error("{op}")]
    Io {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    /// The peer closed the connection in the middle of a frame or a page.
    #[error("the peer closed the connection {during}")]
    Closed { during: &'static str },
    /// The caller's check said stop (cancel, deadline, shutdown).
    #[error("stopped")]
    Stopped,
    /// The peer sent a frame that fails validation.
    #[error("invalid frame")]
    Proto(#[source] ProtoError),
    /// The page server refused the request.
    #[error("page server refused: {code}: {message}")]
    Refused { code: ErrorCode, message: String },
    /// A valid frame of a type not expected here.
    #[error("unexpected {got:?}, expected {expected:?}")]
    Unexpected { got: MsgType, expected: MsgType },
    /// A `PageData` that does not announce the next expected page.
    #[error(
        "PageData for {got_owner} index {got_index} of {got_len} bytes, expected {owner} \
         index {index} of {len} bytes"
    )]
    BadPage {
        owner: Owner,
        index: u32,
        len: u32,
        got_owner: Owner,
        got_index: u32,
        got_len: u32,
    },
}

impl TcpError {
    /// Whether the connection can carry another request: never after an error, since the
    /// stream may hold the rest of a page.
    pub fn is_fatal(&self) -> bool {
        true
    }
}

fn io_err(op: &'static str) -> impl FnOnce(io::Error) -> TcpError {
    move |source| TcpError::Io { op, source }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// Sets the socket timeouts to [`IO_SLICE`] and turns Nagle off (pages are large, requests
/// small and latency-bound).
pub fn prepare(stream: &TcpStream) -> Result<(), TcpError> {
    stream
        .set_read_timeout(Some(IO_SLICE))
        .and_then(|()| stream.set_write_timeout(Some(IO_SLICE)))
        .and_then(|()| stream.set_nodelay(true))
        .map_err(io_err("setting socket options"))
}

/// Fills `buf` from `stream`, calling `keep_going` whenever a read slice times out.
/// `during` names the read in errors.
pub fn read_full(
    mut stream: &TcpStream,
    buf: &mut [u8],
    during: &'static str,
    keep_going: &mut dyn FnMut() -> bool,
) -> Result<(), TcpError> {
    let mut at = 0;
    while at < buf.len() {
        match stream.read(&mut buf[at..]) {
            Ok(0) => return Err(TcpError::Closed { during }),
            Ok(n) => at += n,
            Err(e) if is_timeout(&e) => {
                if !keep_going() {
                    return Err(TcpError::Stopped);
                }
            }
            Err(e) => {
                return Err(TcpError::Io {
                    op: during,
                    source: e,
                });
            }
        }
    }
    Ok(())
}

/// Writes all of `bufs` in order, calling `keep_going` whenever a write slice times out.
pub fn write_full(
    mut stream: &TcpStream,
    bufs: &[&[u8]],
    keep_going: &mut dyn FnMut() -> bool,
) -> Result<(), TcpError> {
    for buf in bufs {
        let mut at = 0;
        while at < buf.len() {
            match stream.write(&buf[at..]) {
                Ok(0) => return Err(TcpError::Closed { during: "writing" }),
                Ok(n) => at += n,
                Err(e) if is_timeout(&e) => {
                    if !keep_going() {
                        return Err(TcpError::Stopped);
                    }
                }
                Err(e) => {
                    return Err(TcpError::Io {
                        op: "writing",
                        source: e,
                    });
                }
            }
        }
    }
    Ok(())
}

/// Reads one whole frame and validates it (layers 1 to 5, no fds on TCP). The body length
/// is checked against [`MAX_PAGE_PATH_BODY`] from the header before anything is allocated.
pub fn read_frame(
    stream: &TcpStream,
    during: &'static str,
    keep_going: &mut dyn FnMut() -> bool,
) -> Result<(Header, Message), TcpError> {
    let mut head = [0u8; HEADER_LEN];
    read_full(stream, &mut head, during, keep_going)?;
    let header = Header::parse(&head).map_err(TcpError::Proto)?;
    let len = header.body_len();
    if len > MAX_PAGE_PATH_BODY {
        return Err(TcpError::Proto(ProtoError::Oversized {
            len,
            max: MAX_PAGE_PATH_BODY,
        }));
    }
    let mut body = vec![0u8; len];
    read_full(stream, &mut body, during, keep_going)?;
    let msg = Message::from_frame(&header, &body, 0).map_err(TcpError::Proto)?;
    Ok((header, msg))
}

/// Encodes and writes one frame.
pub fn write_frame(
    stream: &TcpStream,
    id: crate::RequestId,
    msg: impl Into<Message>,
    keep_going: &mut dyn FnMut() -> bool,
) -> Result<(), TcpError> {
    let bytes = msg.into().encode(id).map_err(TcpError::Proto)?;
    write_full(stream, &[&bytes], keep_going)
}

/// Decode's side: asks for `pages` of `owner` on `stream` and reads each page straight into
/// `dst(index)` (exactly `page_bytes` long), checking `keep_going` between pages and while
/// the socket is silent. Every `PageData` is checked (owner, index, length) before a byte of
/// its page is read. On any error the stream must be dropped.
pub fn fetch_pages(
    stream: &TcpStream,
    token: [u8; TOKEN_BYTES],
    owner: Owner,
    pages: &[PageId],
    page_bytes: u32,
    dst: &mut dyn PageSink,
    keep_going: &mut dyn FnMut() -> bool,
) -> Result<(), TcpError> {
    let request = PageRequest {
        token,
        owner,
        pages: pages.to_vec(),
    };
    write_frame(stream, owner.request, request, keep_going)?;
    for (i, _) in pages.iter().enumerate() {
        if !keep_going() {
            return Err(TcpError::Stopped);
        }
        let index = u32::try_from(i).unwrap_or(u32::MAX);
        let (_, msg) = read_frame(stream, "reading a page header", keep_going)?;
        let data = match msg {
            Message::PageData(d) => d,
            Message::Error(e) => {
                return Err(TcpError::Refused {
                    code: e.code,
                    message: e.message,
                });
            }
            other => {
                return Err(TcpError::Unexpected {
                    got: other.msg_type(),
                    expected: MsgType::PageData,
                });
            }
        };
        let PageData {
            owner: got_owner,
            index: got_index,
            len: got_len,
        } = data;
        let buf = match dst.page_mut(i) {
            Some(buf) if got_owner == owner && got_index == index && got_len == page_bytes => buf,
            _ => {
                return Err(TcpError::BadPage {
                    owner,
                    index,
                    len: page_bytes,
                    got_owner,
                    got_index,
                    got_len,
                });
            }
        };
        if buf.len() != page_bytes as usize {
            return Err(TcpError::BadPage {
                owner,
                index,
                len: u32::try_from(buf.len()).unwrap_or(u32::MAX),
                got_owner,
                got_index,
                got_len,
            });
        }
        read_full(stream, buf, "reading a page", keep_going)?;
    }
    Ok(())
}

/// Where received pages go: the `index`-th page of a request, exactly one page long.
pub trait PageSink {
    fn page_mut(&mut self, index: usize) -> Option<&mut [u8]>;
}

impl PageSink for crate::pool::WriteGrant {
    fn page_mut(&mut self, index: usize) -> Option<&mut [u8]> {
        crate::pool::WriteGrant::page_mut(self, index).ok()
    }
}

impl PageSink for Vec<Vec<u8>> {
    fn page_mut(&mut self, index: usize) -> Option<&mut [u8]> {
        self.get_mut(index).map(Vec::as_mut_slice)
    }
}

/// The page server's answer header for the `index`-th page of a request, `len` bytes.
pub fn page_header(owner: Owner, index: u32, len: u32) -> Result<Vec<u8>, TcpError> {
    Message::from(PageData { owner, index, len })
        .encode(owner.request)
        .map_err(TcpError::Proto)
}

/// Compares two tokens in time independent of where they differ.
pub fn token_eq(a: &[u8; TOKEN_BYTES], b: &[u8; TOKEN_BYTES]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A fresh random token from the kernel.
pub fn random_token() -> io::Result<[u8; TOKEN_BYTES]> {
    let mut token = [0u8; TOKEN_BYTES];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut token)?;
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Generation, RequestId};
    use std::net::TcpListener;

    fn owner(r: u64) -> Owner {
        Owner {
            request: RequestId(r),
            generation: Generation(1),
        }
    }

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        prepare(&c).unwrap();
        prepare(&s).unwrap();
        (c, s)
    }

    #[test]
    fn fetch_checks_every_page_header_before_reading() {
        let page = 64u32;
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (page_header(owner(2), 0, page).unwrap(), "owner"),
            (page_header(owner(1), 1, page).unwrap(), "index"),
            (page_header(owner(1), 0, page + 1).unwrap(), "len"),
            (page_header(owner(1), 0, u32::MAX).unwrap(), "huge len"),
        ];
        for (header, what) in cases {
            let (c, s) = pair();
            let mut w = &s;
            w.write_all(&header).unwrap();
            w.write_all(&vec![0u8; page as usize + 1]).unwrap();
            let mut buf = vec![vec![0u8; page as usize]];
            let r = fetch_pages(
                &c,
                [0; TOKEN_BYTES],
                owner(1),
                &[PageId(3)],
                page,
                &mut buf,
                &mut || true,
            );
            assert!(matches!(r, Err(TcpError::BadPage { .. })), "{what}: {r:?}");
            assert!(buf[0].iter().all(|&b| b == 0), "{what}: bytes were read");
        }
    }

    #[test]
    fn silent_peer_stops_at_the_check() {
        let (c, _s) = pair();
        let mut calls = 0;
        let mut buf = vec![vec![0u8; 8]];
        let r = fetch_pages(
            &c,
            [0; TOKEN_BYTES],
            owner(1),
            &[PageId(0)],
            8,
            &mut buf,
            &mut || {
                calls += 1;
                calls < 3
            },
        );
        assert!(matches!(r, Err(TcpError::Stopped)), "{r:?}");
        let (c, s) = pair();
        drop(s);
        let r = fetch_pages(
            &c,
            [0; TOKEN_BYTES],
            owner(1),
            &[PageId(0)],
            8,
            &mut buf,
            &mut || true,
        );
        assert!(
            matches!(r, Err(TcpError::Closed { .. } | TcpError::Io { .. })),
            "{r:?}"
        );
    }

    #[test]
    fn tokens_compare_whole() {
        let a = [1u8; TOKEN_BYTES];
        let mut b = a;
        assert!(token_eq(&a, &b));
        b[TOKEN_BYTES - 1] = 0;
        assert!(!token_eq(&a, &b));
        assert_ne!(random_token().unwrap(), random_token().unwrap());
    }
}
