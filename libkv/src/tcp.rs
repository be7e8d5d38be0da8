//! The TCP page path: kvfence frames on a TCP stream between decoded (which pulls) and
//! prefilld's page server. See the "Pulling over TCP" section of [`crate::proto`].
//!
//! Both ends read with a short socket timeout and call a `keep_going` check between slices,
//! so a cancelled request, a passed deadline or a stop ends a transfer within one slice even
//! when the peer is silent, and a dead peer cannot hang a thread.

use crate::Owner;
use crate::ids::PageId;
use crate::pool::Landing;
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
    /// A `PageData` that does not announce the next expected pages.
    #[error(
        "PageData for {got_owner} index {got_index} of {got_len} bytes, expected {owner} \
         index {index}: 1 to {left} whole pages of {len} bytes"
    )]
    BadPage {
        owner: Owner,
        index: u32,
        /// Bytes per page.
        len: u32,
        /// Pages the request still expects.
        left: u32,
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
    stream: &TcpStream,
    buf: &mut [u8],
    during: &'static str,
    keep_going: &mut dyn FnMut() -> bool,
) -> Result<(), TcpError> {
    read_full_vectored(stream, &mut [buf], during, keep_going)
}

/// Writes all of `bufs` in order with vectored writes (a page's header and its bytes leave
/// in one call, not as a lone small segment), calling `keep_going` whenever a write slice
/// times out.
pub fn write_full(
    mut stream: &TcpStream,
    bufs: &[&[u8]],
    keep_going: &mut dyn FnMut() -> bool,
) -> Result<(), TcpError> {
    let mut slices: Vec<io::IoSlice<'_>> = bufs.iter().map(|b| io::IoSlice::new(b)).collect();
    let mut rest = &mut slices[..];
    io::IoSlice::advance_slices(&mut rest, 0);
    while !rest.is_empty() {
        match stream.write_vectored(rest) {
            Ok(0) => return Err(TcpError::Closed { during: "writing" }),
            Ok(n) => io::IoSlice::advance_slices(&mut rest, n),
            Err(e) if is_timeout(&e) => {
                if !keep_going() {
                    return Err(TcpError::Stopped);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(TcpError::Io {
                    op: "writing",
                    source: e,
                });
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

/// Decode's side: asks for `pages` of `owner` on `stream` and reads them straight into
/// `dst`'s pages (each exactly `page_bytes` long) with vectored reads of at most
/// [`READ_CHUNK`] bytes, digesting what each read delivered right after it (the bytes are
/// still in the cache the kernel's copy left them in; see [`Landing`]), checking
/// `keep_going` between batches and while the socket is silent. Every `PageData` is checked
/// (owner, next index, whole pages, none past the end) before a byte of its pages is read.
/// On any error the stream must be dropped.
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
    let mut i = 0usize;
    while i < pages.len() {
        if !keep_going() {
            return Err(TcpError::Stopped);
        }
        let index = u32::try_from(i).unwrap_or(u32::MAX);
        let left = u32::try_from(pages.len() - i).unwrap_or(u32::MAX);
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
        let bad = || TcpError::BadPage {
            owner,
            index,
            len: page_bytes,
            left,
            got_owner,
            got_index,
            got_len,
        };
        let count = if page_bytes > 0 && got_len % page_bytes == 0 {
            got_len / page_bytes
        } else {
            0
        };
        if got_owner != owner || got_index != index || count == 0 || count > left {
            return Err(bad());
        }
        let count = count as usize;
        let mut landing = dst.landing(i, count).ok_or_else(bad)?;
        if landing.pages() != count || landing.remaining() != count * page_bytes as usize {
            return Err(bad());
        }
        read_landing(stream, &mut landing, "reading pages", keep_going)?;
        i += count;
    }
    Ok(())
}

/// Most bytes one read of page bytes asks for: what the next digest reads back is then still
/// in the L2 cache the kernel's copy filled.
pub const READ_CHUNK: usize = 256 << 10;

/// Fills `landing` from `stream` with vectored reads of at most [`READ_CHUNK`] bytes, each
/// digested as it lands, calling `keep_going` whenever a read slice times out.
pub fn read_landing(
    mut stream: &TcpStream,
    landing: &mut Landing<'_>,
    during: &'static str,
    keep_going: &mut dyn FnMut() -> bool,
) -> Result<(), TcpError> {
    while !landing.is_full() {
        match landing.fill_vectored(READ_CHUNK, |bufs| stream.read_vectored(bufs)) {
            Ok(0) => return Err(TcpError::Closed { during }),
            Ok(_) => {}
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

/// Fills every buffer of `bufs` in order from `stream` with vectored reads, calling
/// `keep_going` whenever a read slice times out.
pub fn read_full_vectored(
    mut stream: &TcpStream,
    bufs: &mut [&mut [u8]],
    during: &'static str,
    keep_going: &mut dyn FnMut() -> bool,
) -> Result<(), TcpError> {
    let mut slices: Vec<io::IoSliceMut<'_>> =
        bufs.iter_mut().map(|b| io::IoSliceMut::new(b)).collect();
    let mut rest = &mut slices[..];
    io::IoSliceMut::advance_slices(&mut rest, 0);
    while !rest.is_empty() {
        match stream.read_vectored(rest) {
            Ok(0) => return Err(TcpError::Closed { during }),
            Ok(n) => io::IoSliceMut::advance_slices(&mut rest, n),
            Err(e) if is_timeout(&e) => {
                if !keep_going() {
                    return Err(TcpError::Stopped);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
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

/// Where received pages go: pages of a request by index, each exactly one page long.
pub trait PageSink {
    /// Pages `first .. first + count`, to be filled in order, or `None` if out of range.
    fn landing(&mut self, first: usize, count: usize) -> Option<Landing<'_>>;
}

/// A grant's pages, digested as they land: verification then reads none of them again.
impl PageSink for crate::pool::WriteGrant {
    fn landing(&mut self, first: usize, count: usize) -> Option<Landing<'_>> {
        let end = first.checked_add(count)?;
        crate::pool::WriteGrant::landing(self, first..end).ok()
    }
}

/// Plain buffers (tests): nothing digested.
impl PageSink for Vec<Vec<u8>> {
    fn landing(&mut self, first: usize, count: usize) -> Option<Landing<'_>> {
        let end = first.checked_add(count)?;
        self.get_mut(first..end)
            .map(|pages| Landing::untracked(pages.iter_mut().map(Vec::as_mut_slice).collect()))
    }
}

/// Most page bytes the page server sends after one `PageData` (a larger page goes alone).
pub const PAGE_BATCH_BYTES: u64 = 1 << 20;

/// The page server's answer header for pages `index ..` of a request, `len` bytes of whole
/// pages.
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
    fn vectored_writes_keep_every_byte_in_order_across_partial_writes() {
        let (c, s) = pair();
        // Larger than the socket buffers: the writes come back partial and resume mid-slice.
        let bufs: Vec<Vec<u8>> = (0..5u8)
            .map(|i| {
                (0..(3 << 20) + usize::from(i))
                    .map(|j| u8::try_from(j % 251).unwrap() ^ i)
                    .collect()
            })
            .collect();
        let want: Vec<u8> = bufs.concat();
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; want.len()];
            read_full(&c, &mut got, "reading", &mut || true).unwrap();
            assert!(got == want, "bytes out of order or lost");
        });
        let slices: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
        write_full(&s, &slices, &mut || true).unwrap();
        reader.join().unwrap();
    }

    #[test]
    fn fetch_checks_every_page_header_before_reading() {
        let page = 64u32;
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (page_header(owner(2), 0, page).unwrap(), "owner"),
            (page_header(owner(1), 1, page).unwrap(), "index"),
            (page_header(owner(1), 0, page + 1).unwrap(), "len"),
            (page_header(owner(1), 0, u32::MAX).unwrap(), "huge len"),
            (page_header(owner(1), 0, 2 * page).unwrap(), "past the end"),
            (page_header(owner(1), 0, 0).unwrap(), "no page"),
        ];
        for (header, what) in cases {
            let (c, s) = pair();
            let mut w = &s;
            w.write_all(&header).unwrap();
            w.write_all(&vec![0xaa; 2 * page as usize + 1]).unwrap();
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
    fn batches_of_whole_pages_land_in_order() {
        let page = 64u32;
        let (c, s) = pair();
        let server = std::thread::spawn(move || {
            let (_, msg) = read_frame(&s, "request", &mut || true).unwrap();
            assert!(matches!(msg, Message::PageRequest(r) if r.pages.len() == 5));
            // pages 0-2 in one frame, then 3-4
            let body = |first: u8, n: u8| -> Vec<u8> {
                (first..first + n)
                    .flat_map(|p| vec![p + 1; page as usize])
                    .collect()
            };
            let first = page_header(owner(1), 0, 3 * page).unwrap();
            let second = page_header(owner(1), 3, 2 * page).unwrap();
            write_full(
                &s,
                &[&first, &body(0, 3), &second, &body(3, 2)],
                &mut || true,
            )
            .unwrap();
        });
        let mut buf = vec![vec![0u8; page as usize]; 5];
        let ids: Vec<PageId> = (0..5).map(PageId).collect();
        fetch_pages(
            &c,
            [0; TOKEN_BYTES],
            owner(1),
            &ids,
            page,
            &mut buf,
            &mut || true,
        )
        .unwrap();
        server.join().unwrap();
        for (i, p) in buf.iter().enumerate() {
            assert!(p.iter().all(|&b| usize::from(b) == i + 1), "page {i}");
        }
    }

    #[test]
    fn pages_read_into_a_grant_are_verified_from_the_digests_taken_as_they_landed() {
        use crate::pool::{PagePool, PoolOptions};
        use crate::verify::{Manifest, VerifyError, page_digest};
        use crate::{Dtype, PageGeometry};
        let g = PageGeometry {
            tokens_per_page: 16,
            layers: 1,
            kv_heads: 4,
            head_dim: 512,
            dtype: Dtype::Bf16,
        };
        let page = usize::try_from(g.bytes_per_page()).unwrap();
        // Larger than one read: READ_CHUNK splits pages, so digests carry over reads.
        let pages = 2 * READ_CHUNK / page + 3;
        let body: Vec<u8> = (0..pages * page)
            .map(|i| u8::try_from((i * 31 + i / page) % 251).unwrap())
            .collect();
        let digests: Vec<u32> = body.chunks(page).map(page_digest).collect();
        let decode = PagePool::host(c"kvtest-tcp", g, 64, PoolOptions::default()).unwrap();
        for corrupt in [false, true] {
            let (c, s) = pair();
            let sent = body.clone();
            let server = std::thread::spawn(move || {
                let (_, msg) = read_frame(&s, "request", &mut || true).unwrap();
                let Message::PageRequest(r) = msg else {
                    panic!("{msg:?}")
                };
                let len = u32::try_from(sent.len()).unwrap();
                let header = page_header(r.owner, 0, len).unwrap();
                write_full(&s, &[&header, &sent], &mut || true).unwrap();
            });
            let count = u32::try_from(pages).unwrap();
            let tokens = count * g.tokens_per_page;
            let mut res = decode.reserve(owner(1), tokens, 0).unwrap();
            {
                let mut grant = res.grant_write().unwrap();
                let ids: Vec<PageId> = (0..count).map(PageId).collect();
                let page_len = u32::try_from(page).unwrap();
                fetch_pages(
                    &c,
                    [0; TOKEN_BYTES],
                    owner(1),
                    &ids,
                    page_len,
                    &mut grant,
                    &mut || true,
                )
                .unwrap();
                if corrupt {
                    // Decode's own page changed after it landed: the digest taken as it
                    // landed no longer counts, verification reads the page itself.
                    grant.page_mut(pages - 1).unwrap()[3] ^= 1;
                }
            }
            server.join().unwrap();
            let landed: Vec<Option<u32>> =
                res.with_table(|t| res.pages().iter().map(|&p| t.landed(p)).collect());
            let want: Vec<Option<u32>> = digests
                .iter()
                .enumerate()
                .map(|(i, &d)| (!(corrupt && i == pages - 1)).then_some(d))
                .collect();
            assert_eq!(landed, want);
            let m = Manifest {
                owner: owner(1),
                tokens,
                pages: (0..count).map(PageId).collect(),
                digests: digests.clone(),
            };
            match res.verify(&m) {
                Ok(_) => assert!(!corrupt),
                Err(VerifyError::Digest { index, .. }) => {
                    assert!(corrupt);
                    assert_eq!(index, pages - 1);
                }
                Err(e) => panic!("{e}"),
            }
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
