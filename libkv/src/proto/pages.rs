//! Page messages: what a decode worker and a prefill worker's page server say to each other
//! on TCP (page requests, page data, and the RDMA session set up on that connection).

use super::{Check, MAX_MANIFEST_PAGES, TOKEN_BYTES};
use crate::ids::{Owner, PageId};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// Decode worker to prefill page server, on TCP: send the listed pages of `owner`, in order.
/// The server answers with [`PageData`] frames, each followed by whole pages, or with one [`Error`]
/// and closes the connection: it serves a page only if it holds a reservation for exactly
/// `owner` (request and generation) and the page is in that owner's manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageRequest {
    /// The token of the server's [`TcpEndpoint`].
    pub token: [u8; TOKEN_BYTES],
    /// Whose pages.
    pub owner: Owner,
    /// Pages of the prefill pool, 1 to [`MAX_MANIFEST_PAGES`], no repeats.
    pub pages: Vec<PageId>,
}

impl PageRequest {
    pub(super) fn check(&self) -> Check {
        if self.pages.is_empty() || self.pages.len() > MAX_MANIFEST_PAGES {
            return Err(format!(
                "{} pages, expected 1 to {MAX_MANIFEST_PAGES}",
                self.pages.len()
            ));
        }
        let mut seen: HashSet<PageId> = HashSet::with_capacity(self.pages.len());
        if let Some(dup) = self.pages.iter().find(|p| !seen.insert(**p)) {
            return Err(format!("{dup} listed twice"));
        }
        Ok(())
    }
}

/// Page server to decode worker, on TCP: pages `index ..` of the request follow the frame
/// as `len` raw bytes (not part of the frame body), `len / page bytes` whole pages; the
/// server batches up to [`crate::tcp::PAGE_BATCH_BYTES`] per frame (one page when pages are
/// larger). The receiver checks `owner`, `index` (the next page it expects) and `len` (at
/// least one whole page, none past the request's end) before reading a byte.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageData {
    /// Whose page.
    pub owner: Owner,
    /// Position in the `PageRequest` of the first page that follows.
    pub index: u32,
    /// Bytes that follow.
    pub len: u32,
}

/// Bytes of an RDMA GID (an IPv6 address; IPv4-mapped on RoCE v2).
pub const GID_BYTES: usize = 16;

/// One side of an RDMA session: the queue pair to connect to. The decode worker sends it
/// with the page server's token; the page server answers with its own (token all zeros).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaConnect {
    /// The page server's token from the decode worker; zeros in the answer.
    pub token: [u8; TOKEN_BYTES],
    /// Queue pair number, 24 bits.
    pub qp_num: u32,
    /// First packet sequence number, 24 bits.
    pub psn: u32,
    /// The GID the queue pair's packets come from.
    pub gid: [u8; GID_BYTES],
}

impl RdmaConnect {
    pub(super) fn check(&self) -> Check {
        if self.qp_num == 0 || self.qp_num > 0x00ff_ffff {
            return Err(format!("QP number {} is not 1 to 2^24 - 1", self.qp_num));
        }
        if self.psn > 0x00ff_ffff {
            return Err(format!("PSN {} exceeds 24 bits", self.psn));
        }
        if self.gid == [0; GID_BYTES] {
            return Err("GID is all zeros".to_owned());
        }
        Ok(())
    }
}

/// A memory window over a run of consecutive pages of a `PageRequest`: pages `first ..
/// first + pages` of the request, readable at `addr .. addr + pages * page bytes` with
/// `rkey`, through the session's queue pair only, until the reader says `RdmaReadDone` or
/// the owner is released.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaWindow {
    /// Index in the `PageRequest` of the window's first page.
    pub first: u32,
    /// Pages in the window, at least 1.
    pub pages: u32,
    /// The first page's address, as the reader names it.
    pub addr: u64,
    /// The window's key.
    pub rkey: u32,
}

/// The page server's answer to a `PageRequest` on an RDMA session: windows that cover the
/// request's pages exactly once, in order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaWindows {
    /// Whose pages.
    pub owner: Owner,
    /// 1 to [`MAX_MANIFEST_PAGES`] windows.
    pub windows: Vec<RdmaWindow>,
}

impl RdmaWindows {
    pub(super) fn check(&self) -> Check {
        if self.windows.is_empty() || self.windows.len() > MAX_MANIFEST_PAGES {
            return Err(format!(
                "{} windows, expected 1 to {MAX_MANIFEST_PAGES}",
                self.windows.len()
            ));
        }
        let mut next = 0u64;
        for w in &self.windows {
            if w.pages == 0 || u64::from(w.first) != next {
                return Err(format!(
                    "window at page {} of {} pages does not continue at page {next}",
                    w.first, w.pages
                ));
            }
            next += u64::from(w.pages);
        }
        if next > MAX_MANIFEST_PAGES as u64 {
            return Err(format!(
                "windows cover {next} pages, over {MAX_MANIFEST_PAGES}"
            ));
        }
        Ok(())
    }

    /// Pages the windows cover.
    pub fn pages(&self) -> u64 {
        self.windows.iter().map(|w| u64::from(w.pages)).sum()
    }
}

/// The reader is done with an owner's windows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaReadDone {
    /// Whose windows.
    pub owner: Owner,
}
