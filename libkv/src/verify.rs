//! Transfer manifests and the coverage check decode runs before any attention.
//!
//! [`Reservation::verify`] is the only constructor of [`VerifiedKv`], and `VerifiedKv` is the
//! only way to read page contents for attention. The check is not configurable: token count,
//! page count, ownership and every page digest must match, or the reservation is dropped
//! (its pages released) and the error returned. There is no switch that skips any part.
//!
//! A page's digest is computed from its bytes in this pool: by the transfer, chunk by chunk
//! as the bytes land (a [`Landing`](crate::pool::Landing): one pass over memory instead of
//! a copy and then a second read), or here, from the page, when the last writer did not
//! land the whole page that way. Either way it is compared with the manifest's before any
//! page becomes readable.

use crate::geometry::Kv;
use crate::ids::{Owner, PageId, PoolOffset};
use crate::pool::{PageState, PoolError, Reservation};
use serde::{Deserialize, Serialize};
use std::sync::atomic::Ordering;

/// What prefill says it delivered for one request: the source pages in token order and a
/// crc32c digest of each page's full contents (padding slots of the last page are zero).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub owner: Owner,
    /// Prompt tokens whose KV the pages hold.
    pub tokens: u32,
    /// Source pages in the prefill pool, in token order.
    pub pages: Vec<PageId>,
    /// crc32c of each page, same order as `pages`.
    pub digests: Vec<u32>,
}

/// Integrity digest of one page's bytes: crc32c (the value `crc32c::crc32c` gives), computed
/// with carry-less multiplication where the CPU has it ([`crate::sys::digest`]).
pub fn page_digest(bytes: &[u8]) -> u32 {
    crate::sys::digest::crc32c_append(0, bytes)
}

/// Why decode refused a transfer. Every variant aborts the request.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VerifyError {
    #[error("manifest is for {got}, reservation is for {expected}")]
    OwnerMismatch { expected: Owner, got: Owner },
    #[error("manifest covers {manifest} tokens, reservation holds {reserved}")]
    TokenCount { reserved: u32, manifest: u32 },
    #[error("manifest lists {got} pages, {expected} needed for the reserved tokens")]
    PageCount { expected: usize, got: usize },
    #[error("manifest has {digests} digests for {pages} pages")]
    DigestCount { pages: usize, digests: usize },
    #[error("{page} is not owned by this request")]
    NotOwned { page: PageId },
    #[error("{page} is {state:?}, not written and idle")]
    WrongState { page: PageId, state: PageState },
    #[error("a writer may still touch the pages")]
    WriterActive,
    #[error("page {index} ({page}) digest {got:#010x} does not match manifest {expected:#010x}")]
    Digest {
        index: usize,
        page: PageId,
        expected: u32,
        got: u32,
    },
    #[error("reading pages")]
    Pool(#[source] PoolError),
}

impl Reservation {
    /// Checks the transferred prompt pages against this reservation and `manifest`, and on
    /// success turns the reservation into a readable handle. On failure the reservation is
    /// dropped: its pages go back to the pool (or drain), and nothing was read for attention.
    pub fn verify(mut self, manifest: &Manifest) -> Result<VerifiedKv, VerifyError> {
        let result = self.check(manifest);
        let counters = &self.pool().counters();
        match result {
            Ok(()) => {
                counters.verified.fetch_add(1, Ordering::Relaxed);
                let tokens = u64::from(self.tokens());
                Ok(VerifiedKv { res: self, tokens })
            }
            Err(e) => {
                counters.verify_failed.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// The coverage part of the check: owner, token count, page count and ownership of every
    /// target page, with no writer left. Produces nothing readable; [`verify`](Self::verify)
    /// runs it first, then the digests.
    pub fn check_coverage(&mut self, m: &Manifest) -> Result<(), VerifyError> {
        if m.owner != self.owner() {
            return Err(VerifyError::OwnerMismatch {
                expected: self.owner(),
                got: m.owner,
            });
        }
        if m.tokens != self.tokens() {
            return Err(VerifyError::TokenCount {
                reserved: self.tokens(),
                manifest: m.tokens,
            });
        }
        let expected = self.prompt_pages();
        if m.pages.len() != expected {
            return Err(VerifyError::PageCount {
                expected,
                got: m.pages.len(),
            });
        }
        if m.digests.len() != m.pages.len() {
            return Err(VerifyError::DigestCount {
                pages: m.pages.len(),
                digests: m.digests.len(),
            });
        }
        if self.has_writer() {
            return Err(VerifyError::WriterActive);
        }
        let targets = &self.pages()[..expected];
        self.with_table(|t| {
            for &p in targets {
                match t.owned_state(p) {
                    None => return Err(VerifyError::NotOwned { page: p }),
                    Some(PageState::Reserved) => {}
                    Some(state) => return Err(VerifyError::WrongState { page: p, state }),
                }
            }
            Ok(())
        })
    }

    fn check(&mut self, m: &Manifest) -> Result<(), VerifyError> {
        self.check_coverage(m)?;
        let expected = self.prompt_pages();
        let targets = &self.pages()[..expected];
        let page_bytes = self.pool().page_bytes();
        // Digests the last writer computed as the bytes landed in these very pages (see
        // `pool::Landing`); stable from here on, since no writer is left and a new one needs
        // `&mut self`, which we hold.
        let landed: Vec<Option<u32>> =
            self.with_table(|t| targets.iter().map(|&p| t.landed(p)).collect());
        let landed = self.digest_on_device(targets, landed)?;
        for (i, ((&p, &want), landed)) in targets.iter().zip(&m.digests).zip(landed).enumerate() {
            let got = match landed {
                Some(d) => d,
                None => {
                    let ptr = self.page_bytes_ptr(p).map_err(VerifyError::Pool)?;
                    // SAFETY: `p` is owned by this reservation and idle (state Reserved, no
                    // writer, checked above); a new writer needs `&mut self`, which we hold.
                    let bytes = unsafe { std::slice::from_raw_parts(ptr, page_bytes) };
                    page_digest(bytes)
                }
            };
            if got != want {
                return Err(VerifyError::Digest {
                    index: i,
                    page: p,
                    expected: want,
                    got,
                });
            }
        }
        self.with_table(|t| {
            for &p in targets {
                match t.owned_state(p) {
                    Some(PageState::Reserved) => t.make_readable(p),
                    None => return Err(VerifyError::NotOwned { page: p }),
                    Some(state) => return Err(VerifyError::WrongState { page: p, state }),
                }
            }
            Ok(())
        })
    }
}

impl Reservation {
    /// For a pool on a device (no host mapping): the pages no landing digested, digested
    /// now on the device in one launch. Host pools are digested page by page by the caller.
    fn digest_on_device(
        &self,
        targets: &[PageId],
        mut landed: Vec<Option<u32>>,
    ) -> Result<Vec<Option<u32>>, VerifyError> {
        let memory = self.pool().memory();
        let Some(device) = memory.device().filter(|_| memory.host_ptr().is_none()) else {
            return Ok(landed);
        };
        let page_bytes = self.pool().page_bytes() as u64;
        let missing: Vec<usize> = (0..targets.len())
            .filter(|&i| landed[i].is_none())
            .collect();
        if missing.is_empty() {
            return Ok(landed);
        }
        let offsets: Vec<PoolOffset> = missing
            .iter()
            .map(|&i| PoolOffset(u64::from(targets[i].0) * page_bytes))
            .collect();
        let digests = device
            .digest_pages(&offsets, page_bytes)
            .map_err(|e| VerifyError::Pool(PoolError::Device(crate::error_chain(&e))))?;
        for (&i, d) in missing.iter().zip(digests) {
            landed[i] = Some(d);
        }
        Ok(landed)
    }
}

/// A reservation whose prompt coverage was verified: the only way to read KV for attention.
/// Reads are limited to the token positions written so far; decode appends the KV of the
/// tokens it generates into the rest of the reservation.
#[derive(Debug)]
pub struct VerifiedKv {
    res: Reservation,
    tokens: u64,
}

impl VerifiedKv {
    pub fn owner(&self) -> Owner {
        self.res.owner()
    }

    /// Token positions readable now.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    pub fn geometry(&self) -> &crate::PageGeometry {
        self.res.pool().geometry()
    }

    /// Bytes of the `index`-th page of the reservation, if it holds readable tokens.
    pub fn page(&self, index: usize) -> Option<&[u8]> {
        let readable = self.geometry().pages_for_tokens(self.tokens);
        if index as u64 >= readable {
            return None;
        }
        let p = *self.res.pages().get(index)?;
        let ptr = self.res.page_bytes_ptr(p).ok()?;
        // SAFETY: the page is owned by this verified reservation and `Readable`; no writer
        // exists (verification required none, and no grant can be made after it), and the only
        // mutation, `append`, needs `&mut self`.
        Some(unsafe { std::slice::from_raw_parts(ptr, self.res.pool().page_bytes()) })
    }

    /// One head's K or V vector for token position `pos` (raw dtype bytes).
    pub fn vector(&self, layer: u32, kv: Kv, head: u32, pos: u64) -> Option<&[u8]> {
        if pos >= self.tokens {
            return None;
        }
        let g = *self.geometry();
        let tpp = u64::from(g.tokens_per_page);
        let page = self.page(usize::try_from(pos / tpp).ok()?)?;
        let slot = u32::try_from(pos % tpp).ok()?;
        let off = g.vector_offset(layer, kv, head, slot);
        let len = g.head_dim as usize * g.dtype.size();
        page.get(off..off + len)
    }

    /// Writes the KV of the next token position with `write(page_bytes, slot)` and makes it
    /// readable. Fails when the reservation's capacity is used up.
    pub fn append(&mut self, write: impl FnOnce(&mut [u8], u32)) -> Result<u64, PoolError> {
        let pos = self.tokens;
        if pos >= self.res.capacity_tokens() {
            return Err(PoolError::CapacityExhausted {
                capacity: self.res.capacity_tokens(),
            });
        }
        let g = *self.geometry();
        let tpp = u64::from(g.tokens_per_page);
        let index = usize::try_from(pos / tpp).map_err(|_| PoolError::OutOfGrant {
            index: usize::MAX,
            pages: self.res.pages().len(),
        })?;
        let p = *self.res.pages().get(index).ok_or(PoolError::OutOfGrant {
            index,
            pages: self.res.pages().len(),
        })?;
        let slot = u32::try_from(pos % tpp).unwrap_or(0);
        let ptr = self.res.page_bytes_ptr(p)?;
        self.res.with_table(|t| {
            if t.owned_state(p) == Some(PageState::Reserved) {
                t.make_readable(p);
            }
        });
        // SAFETY: the page belongs to this reservation (decode's own generated-token pages or
        // the tail of the last prompt page), no writer exists after verification, and
        // `&mut self` excludes every reader handed out by `page`/`vector`.
        let bytes = unsafe { std::slice::from_raw_parts_mut(ptr, self.res.pool().page_bytes()) };
        write(bytes, slot);
        self.tokens += 1;
        Ok(pos)
    }

    /// Ends the request: releases the pages.
    pub fn finish(self) {
        drop(self.res);
    }
}
