//! RDMA sessions between a page server (prefilld) and a reader (decoded).
//!
//! Decode pulls, as on shared memory and TCP: prefilld's pool is registered once with the
//! right to bind memory windows and its own key never leaves the process; decoded's pool is
//! registered for local access only, so no peer holds any key to it. A session is set up over
//! the page server's TCP connection (`RdmaConnect` both ways, the token checked first) and
//! pairs one RC queue pair on each side. For each `PageRequest` the server binds a type-2
//! window per run of consecutive pages, remote read only, on the session's QP, and answers
//! with `RdmaWindows`; the reader RDMA-READs the pages straight into its own reservation and
//! says `RdmaReadDone`; the server then invalidates the windows, and only after that lets go
//! of the pages (the same rule as the TCP path: `Freed` waits for every sender). A Release,
//! Abort or deadline during the reads invalidates them at once: a late read fails with a
//! remote access error instead of reaching pages that may be another request's by then.
//!
//! Windows are bounded by the NIC on real hardware. soft-RoCE (rxe) checks a window key
//! against its MR only, not the window's bounds, so the bounds are checked in software as
//! well: the server binds windows over manifest pages only, and the reader reads only
//! inside the windows it was given, into pages of its own grant ([`ClientSession::read`]).
//!
//! Without the `rdma` cargo feature [`RdmaNode::open`] always says RDMA is unavailable, and
//! the session types cannot be built.

use super::{RdmaError, ReadStats};
use crate::config::RdmaConfig;
use crate::ids::PageId;
use crate::pool::{Landing, PagePool};
use crate::proto::{RdmaConnect, RdmaWindow, RdmaWindows};

#[cfg(feature = "rdma")]
pub use imp::{ClientSession, RdmaNode, ServerSession};
#[cfg(not(feature = "rdma"))]
pub use stub::{ClientSession, RdmaNode, ServerSession};

/// Groups `pages` into runs of consecutive page ids, in order: `(index of the run's first
/// page in pages, first page, length)`.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) fn runs(pages: &[PageId]) -> Vec<(u32, PageId, u32)> {
    let mut out: Vec<(u32, PageId, u32)> = Vec::new();
    for (i, &p) in pages.iter().enumerate() {
        match out.last_mut() {
            Some((_, first, len)) if first.0.checked_add(*len) == Some(p.0) => *len += 1,
            _ => out.push((u32::try_from(i).unwrap_or(u32::MAX), p, 1)),
        }
    }
    out
}

/// Where each of `count` request pages of `page_bytes` is on the peer, from its windows:
/// `(rkey, address)` per page, in request order. Refuses windows that do not cover exactly
/// `count` pages in order, or whose addresses overflow.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) fn remote_pages(
    windows: &RdmaWindows,
    count: usize,
    page_bytes: u64,
) -> Result<Vec<(u32, u64)>, &'static str> {
    let mut out = Vec::with_capacity(count);
    for w in &windows.windows {
        if usize::try_from(w.first).ok() != Some(out.len()) || w.pages == 0 {
            return Err("windows do not cover the request's pages in order");
        }
        for k in 0..u64::from(w.pages) {
            let addr = k
                .checked_mul(page_bytes)
                .and_then(|off| w.addr.checked_add(off))
                .filter(|a| a.checked_add(page_bytes).is_some())
                .ok_or("window address overflows")?;
            out.push((w.rkey, addr));
            if out.len() > count {
                return Err("windows cover more pages than requested");
            }
        }
    }
    if out.len() != count {
        return Err("windows cover fewer pages than requested");
    }
    Ok(out)
}

#[cfg(feature = "rdma")]
mod imp {
    use super::*;
    use crate::rdma::{
        PageRead, QpEndpoint, RdmaDevice, RdmaQp, RegisteredPool, RequestWindow, WindowAccess,
        select_device,
    };
    use sideway::ibverbs::address::Gid;
    use sideway::ibverbs::protection_domain::ProtectionDomain;
    use std::rc::Rc;
    use std::sync::Arc;

    /// An opened device with a worker's pool registered on it.
    pub struct RdmaNode {
        // dropped in this order: the registration before the PD, the PD before the device
        pool: RegisteredPool,
        pd: Arc<ProtectionDomain>,
        dev: RdmaDevice,
    }

    impl std::fmt::Debug for RdmaNode {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("RdmaNode")
                .field("dev", &self.dev)
                .field("pool", &self.pool)
                .finish_non_exhaustive()
        }
    }

    impl RdmaNode {
        /// Opens the configured device and registers `pool`: for windows when `serve`
        /// (prefilld), for local access only otherwise (decoded).
        pub fn open(cfg: &RdmaConfig, pool: &PagePool, serve: bool) -> Result<Self, RdmaError> {
            let dev = select_device(cfg)?;
            let pd = dev.context().alloc_pd().map_err(|e| RdmaError::Verb {
                op: "ibv_alloc_pd",
                source: std::io::Error::other(e),
            })?;
            let pool = RegisteredPool::for_pool(&pd, pool, serve)?;
            Ok(RdmaNode { pool, pd, dev })
        }

        /// Device, port and GID, for logs and status.
        pub fn describe(&self) -> String {
            format!(
                "{} port {} GID index {} ({})",
                self.dev.name(),
                self.dev.port(),
                self.dev.gid_index(),
                std::net::Ipv6Addr::from(self.dev.gid())
            )
        }

        fn new_qp(&self, remote_access: bool) -> Result<(RdmaQp, RdmaConnect), RdmaError> {
            let psn = random_psn();
            let qp = RdmaQp::new(&self.dev, &self.pd, psn, remote_access)?;
            let ep = qp.endpoint();
            let connect = RdmaConnect {
                token: [0; crate::proto::TOKEN_BYTES],
                qp_num: ep.qp_num,
                psn: ep.psn,
                gid: ep.gid.raw,
            };
            Ok((qp, connect))
        }
    }

    fn random_psn() -> u32 {
        let bytes = crate::tcp::random_token().unwrap_or_default();
        u32::from_le_bytes([bytes[0], bytes[1], bytes[2], 0])
    }

    fn endpoint(c: &RdmaConnect) -> QpEndpoint {
        QpEndpoint {
            qp_num: c.qp_num,
            psn: c.psn,
            gid: Gid { raw: c.gid },
        }
    }

    /// The page server's side of a session: one QP, and the windows of the request being
    /// read. Not `Send`: it lives on its connection's thread.
    pub struct ServerSession {
        // invalidated (on drop at the latest) before the QP they are bound on goes
        windows: Vec<RequestWindow>,
        qp: Rc<RdmaQp>,
        node: Arc<RdmaNode>,
    }

    impl std::fmt::Debug for ServerSession {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("ServerSession")
                .field("qp", &self.qp)
                .field("windows", &self.windows.len())
                .finish_non_exhaustive()
        }
    }

    impl ServerSession {
        /// Creates this side's QP, connects it to the reader's, and returns the answer to
        /// send back.
        pub fn accept(
            node: &Arc<RdmaNode>,
            reader: &RdmaConnect,
        ) -> Result<(ServerSession, RdmaConnect), RdmaError> {
            let (mut qp, answer) = node.new_qp(true)?;
            qp.connect(&endpoint(reader))?;
            let session = ServerSession {
                windows: Vec::new(),
                qp: Rc::new(qp),
                node: Arc::clone(node),
            };
            Ok((session, answer))
        }

        /// Binds a read-only window per run of consecutive pages of `pages` (which the
        /// caller checked are the owner's) on this session's QP. Revokes what it bound if a
        /// bind fails.
        pub fn expose(&mut self, pages: &[PageId]) -> Result<Vec<RdmaWindow>, RdmaError> {
            self.revoke()?;
            let mut out = Vec::new();
            for (first, page, count) in runs(pages) {
                let bound = self
                    .node
                    .pool
                    .bind_window(&self.qp, page, count, WindowAccess::Read);
                let window = match bound {
                    Ok(w) => w,
                    Err(e) => {
                        let _ = self.revoke();
                        return Err(e);
                    }
                };
                out.push(RdmaWindow {
                    first,
                    pages: count,
                    addr: window.addr(),
                    rkey: window.rkey(),
                });
                self.windows.push(window);
            }
            Ok(out)
        }

        /// Whether windows are bound.
        pub fn exposed(&self) -> bool {
            !self.windows.is_empty()
        }

        /// Invalidates every bound window and waits until each is: their keys are dead
        /// afterwards. A window that fails to invalidate is deallocated (which also
        /// unbinds it) and the error returned: the caller ends the session.
        pub fn revoke(&mut self) -> Result<(), RdmaError> {
            let mut first_err = None;
            for w in self.windows.drain(..) {
                if let Err(e) = w.invalidate() {
                    first_err.get_or_insert(e);
                }
            }
            first_err.map_or(Ok(()), Err)
        }
    }

    /// The reader's side of a session: a QP that allows no remote access, connected to the
    /// page server's. `Send`: it moves between decoded's job threads with its connection.
    pub struct ClientSession {
        qp: RdmaQp,
        node: Arc<RdmaNode>,
    }

    impl std::fmt::Debug for ClientSession {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("ClientSession")
                .field("qp", &self.qp)
                .finish_non_exhaustive()
        }
    }

    impl ClientSession {
        /// Creates this side's QP; send the returned `RdmaConnect` (with the server's
        /// token) and [`ClientSession::connect`] to the answer.
        pub fn new(node: &Arc<RdmaNode>) -> Result<(ClientSession, RdmaConnect), RdmaError> {
            let (qp, connect) = node.new_qp(false)?;
            Ok((
                ClientSession {
                    qp,
                    node: Arc::clone(node),
                },
                connect,
            ))
        }

        /// Connects to the server's QP.
        pub fn connect(&mut self, server: &RdmaConnect) -> Result<(), RdmaError> {
            self.qp.connect(&endpoint(server))
        }

        /// Reads the pages the windows expose into `dst` (one slice per requested page, in
        /// request order, inside this node's registered pool). Every read lies inside a
        /// window it was given and lands in one of `dst`'s pages, checked before anything is
        /// posted. Consumes the session and gives it back on success only: on any failure
        /// its QP is destroyed before this returns, so nothing can land in `dst` later.
        pub fn read(
            self,
            windows: &RdmaWindows,
            dst: Vec<&mut [u8]>,
            keep_going: &mut dyn FnMut() -> bool,
        ) -> Result<(ClientSession, ReadStats), RdmaError> {
            self.read_into(windows, Landing::untracked(dst), keep_going)
        }

        /// Like [`read`](Self::read), into a grant's [`Landing`]: each page is digested
        /// as soon as the READ that carried it completes (the others still in flight), and
        /// the digest recorded for verification.
        pub fn read_into(
            self,
            windows: &RdmaWindows,
            landing: Landing<'_>,
            keep_going: &mut dyn FnMut() -> bool,
        ) -> Result<(ClientSession, ReadStats), RdmaError> {
            let page_bytes = self.node.pool.page_bytes();
            let Some((dst, mut landed)) = landing.into_device() else {
                return Err(RdmaError::OutOfRange {
                    what: "the destination has started to land already",
                });
            };
            if dst.iter().any(|d| d.len() as u64 != page_bytes) {
                return Err(RdmaError::OutOfRange {
                    what: "a destination is not one page",
                });
            }
            let remote = remote_pages(windows, dst.len(), page_bytes)
                .map_err(|what| RdmaError::OutOfRange { what })?;
            let reads = dst
                .into_iter()
                .zip(remote)
                .map(|(dst, (rkey, raddr))| PageRead { dst, rkey, raddr })
                .collect();
            let ClientSession { qp, node } = self;
            let (qp, stats) =
                qp.read_pages_each(node.pool.mr(), reads, keep_going, &mut |i, page| {
                    landed.landed(i, page)
                })?;
            Ok((ClientSession { qp, node }, stats))
        }
    }
}

#[cfg(not(feature = "rdma"))]
mod stub {
    use super::*;
    use std::convert::Infallible;
    use std::sync::Arc;

    /// Never built without the `rdma` feature.
    #[derive(Debug)]
    pub struct RdmaNode(Infallible);

    impl RdmaNode {
        /// Always unavailable in this build.
        pub fn open(_cfg: &RdmaConfig, _pool: &PagePool, _serve: bool) -> Result<Self, RdmaError> {
            Err(RdmaError::Unavailable {
                reason: "this build has no RDMA support (built without the `rdma` feature)"
                    .to_owned(),
            })
        }

        pub fn describe(&self) -> String {
            match self.0 {}
        }
    }

    /// Never built without the `rdma` feature.
    #[derive(Debug)]
    pub struct ServerSession(Infallible);

    impl ServerSession {
        pub fn accept(
            node: &Arc<RdmaNode>,
            _reader: &RdmaConnect,
        ) -> Result<(ServerSession, RdmaConnect), RdmaError> {
            match node.0 {}
        }

        pub fn expose(&mut self, _pages: &[PageId]) -> Result<Vec<RdmaWindow>, RdmaError> {
            match self.0 {}
        }

        pub fn exposed(&self) -> bool {
            match self.0 {}
        }

        pub fn revoke(&mut self) -> Result<(), RdmaError> {
            match self.0 {}
        }
    }

    /// Never built without the `rdma` feature.
    #[derive(Debug)]
    pub struct ClientSession(Infallible);

    impl ClientSession {
        pub fn new(node: &Arc<RdmaNode>) -> Result<(ClientSession, RdmaConnect), RdmaError> {
            match node.0 {}
        }

        pub fn connect(&mut self, _server: &RdmaConnect) -> Result<(), RdmaError> {
            match self.0 {}
        }

        pub fn read(
            self,
            _windows: &RdmaWindows,
            _dst: Vec<&mut [u8]>,
            _keep_going: &mut dyn FnMut() -> bool,
        ) -> Result<(ClientSession, ReadStats), RdmaError> {
            match self.0 {}
        }

        pub fn read_into(
            self,
            _windows: &RdmaWindows,
            _landing: Landing<'_>,
            _keep_going: &mut dyn FnMut() -> bool,
        ) -> Result<(ClientSession, ReadStats), RdmaError> {
            match self.0 {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{Generation, Owner, RequestId};

    #[test]
    fn runs_group_consecutive_pages_in_order() {
        let p = |ids: &[u32]| ids.iter().map(|&i| PageId(i)).collect::<Vec<_>>();
        assert_eq!(
            runs(&p(&[4, 5, 6, 9, 2, 3, 10])),
            vec![
                (0, PageId(4), 3),
                (3, PageId(9), 1),
                (4, PageId(2), 2),
                (6, PageId(10), 1)
            ]
        );
        assert_eq!(
            runs(&p(&[u32::MAX, 0])),
            vec![(0, PageId(u32::MAX), 1), (1, PageId(0), 1)]
        );
        assert!(runs(&[]).is_empty());
    }

    #[test]
    fn remote_pages_stay_inside_the_windows() {
        let owner = Owner {
            request: RequestId(1),
            generation: Generation(1),
        };
        let w = |first, pages, addr| RdmaWindow {
            first,
            pages,
            addr,
            rkey: first + 100,
        };
        let ws = |windows| RdmaWindows { owner, windows };
        assert_eq!(
            remote_pages(&ws(vec![w(0, 2, 1000), w(2, 1, 50)]), 3, 10).unwrap(),
            vec![(100, 1000), (100, 1010), (102, 50)]
        );
        // fewer, more, out of order, overflowing
        assert!(remote_pages(&ws(vec![w(0, 2, 0)]), 3, 10).is_err());
        assert!(remote_pages(&ws(vec![w(0, 4, 0)]), 3, 10).is_err());
        assert!(remote_pages(&ws(vec![w(1, 3, 0)]), 3, 10).is_err());
        assert!(remote_pages(&ws(vec![w(0, 3, u64::MAX - 15)]), 3, 10).is_err());
    }
}
