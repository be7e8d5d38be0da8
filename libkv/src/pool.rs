//! Page pools and the page ownership table.
//!
//! Every page has one owner record and one state (see `DESIGN.md`):
//!
//! ```text
//!            reserve                 grant_write               drop grant
//!   Free ─────────────▶ Reserved ───────────────▶ Writing ────────────────▶ Reserved
//!    ▲                     │  verify ok                │ reservation dropped
//!    │                     ▼                           ▼ (abort, timeout)
//!    │                  Readable                    Draining ── last writer gone ──┐
//!    │                     │ reservation dropped                                 │
//!    └─────────────────────┴──────────(poison / scrub)───────────────────────────┘
//! ```
//!
//! A page goes back to the free list only from a state with no writer. The values that carry
//! these states are RAII: a [`Reservation`] frees its pages when dropped (or parks them in
//! `Draining` while a [`WriteGrant`] is alive); a [`WriteGrant`] ends its writes when dropped;
//! a [`VerifiedKv`](crate::verify::VerifiedKv) — the only way to read page contents for attention — can be produced only
//! by [`Reservation::verify`] (in `verify.rs`).

use crate::config::{PoisonMode, Scrub};
use crate::geometry::PageGeometry;
use crate::ids::{Owner, PageId};
use crate::memory::PoolMemory;
use crate::sys::digest::{Crc32c, store_fence};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// What may touch a page now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageState {
    /// On the free list; no owner.
    Free,
    /// Owned by a live reservation; no writer; not yet verified.
    Reserved,
    /// Owned by a live reservation with a writer (a transfer) that may touch it.
    Writing,
    /// Verified: readable for attention by its owner only.
    Readable,
    /// Its reservation ended while a writer could still touch it; freed when the writer is gone.
    Draining,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    state: PageState,
    owner: Option<Owner>,
    writers: u32,
    /// The digest of the page's bytes, computed as they landed by the last writer's
    /// [`Landing`], if that writer wrote the whole page that way and nothing else since.
    landed: Option<u32>,
}

/// Page counts per state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolUsage {
    pub total: u32,
    pub free: u32,
    pub reserved: u32,
    pub writing: u32,
    pub readable: u32,
    pub draining: u32,
}

/// Errors of pool operations.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolError {
    #[error("pool has {free} free pages, {need} needed")]
    Full { need: u32, free: u32 },
    #[error("request needs {need} pages but the pool only has {total}")]
    NeverFits { need: u32, total: u32 },
    #[error("pool memory is {have} bytes, {need} needed for {pages} pages")]
    MemoryTooSmall { have: u64, need: u64, pages: u32 },
    #[error("a writer is already active on this reservation")]
    WriterActive,
    #[error("pages of a verified reservation take no more writers")]
    AlreadyVerified,
    #[error("pool memory has no host mapping")]
    NoHostMapping,
    #[error("pool memory is not device memory")]
    NoDeviceMemory,
    #[error("device memory: {0}")]
    Device(String),
    #[error("index {index} outside a grant of {pages} pages")]
    OutOfGrant { index: usize, pages: usize },
    #[error("append past the reservation's capacity of {capacity} tokens")]
    CapacityExhausted { capacity: u64 },
    #[error("{page} is not a page of this reservation")]
    NotOwned { page: PageId },
}

/// Monotonic counters of one pool (cheap atomics).
#[derive(Debug, Default)]
pub struct PoolCounters {
    pub reservations: AtomicU64,
    pub pages_reserved: AtomicU64,
    pub pages_freed: AtomicU64,
    pub drained: AtomicU64,
    pub verified: AtomicU64,
    pub verify_failed: AtomicU64,
}

struct Table {
    slots: Vec<Slot>,
    free: Vec<PageId>,
    usage: PoolUsage,
}

impl Table {
    fn count(&mut self, from: PageState, to: PageState) {
        let u = &mut self.usage;
        for (st, delta) in [(from, u32::MAX), (to, 1u32)] {
            let c = match st {
                PageState::Free => &mut u.free,
                PageState::Reserved => &mut u.reserved,
                PageState::Writing => &mut u.writing,
                PageState::Readable => &mut u.readable,
                PageState::Draining => &mut u.draining,
            };
            *c = c.wrapping_add(delta);
        }
    }

    fn set(&mut self, page: PageId, to: PageState) {
        let from = self.slots[page.index()].state;
        self.slots[page.index()].state = to;
        self.count(from, to);
    }
}

pub(crate) struct PoolInner {
    geometry: PageGeometry,
    pages: u32,
    page_bytes: usize,
    memory: Box<dyn PoolMemory>,
    table: Mutex<Table>,
    poison: PoisonMode,
    scrub: Scrub,
    pub(crate) counters: PoolCounters,
}

/// A paged KV pool with its ownership table. Cheap to clone (shared).
#[derive(Clone)]
pub struct PagePool {
    inner: Arc<PoolInner>,
}

impl fmt::Debug for PagePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagePool")
            .field("pages", &self.inner.pages)
            .field("backend", &self.inner.memory.backend())
            .field("usage", &self.usage())
            .finish()
    }
}

/// Options of a pool beyond its geometry and size.
#[derive(Clone, Copy, Debug, Default)]
pub struct PoolOptions {
    pub poison: PoisonMode,
    pub scrub: Scrub,
}

impl PagePool {
    /// Creates a pool of `pages` pages over `memory`, which must be large enough.
    pub fn new(
        geometry: PageGeometry,
        pages: u32,
        memory: Box<dyn PoolMemory>,
        options: PoolOptions,
    ) -> Result<Self, PoolError> {
        let page_bytes = geometry.bytes_per_page();
        let need = page_bytes.saturating_mul(u64::from(pages));
        if memory.len() < need {
            return Err(PoolError::MemoryTooSmall {
                have: memory.len(),
                need,
                pages,
            });
        }
        let slots = vec![
            Slot {
                state: PageState::Free,
                owner: None,
                writers: 0,
                landed: None,
            };
            pages as usize
        ];
        // Pages are handed out lowest first: pop() takes from the end.
        let free = (0..pages).rev().map(PageId).collect();
        let usage = PoolUsage {
            total: pages,
            free: pages,
            ..PoolUsage::default()
        };
        let page_bytes = usize::try_from(page_bytes).map_err(|_| PoolError::MemoryTooSmall {
            have: memory.len(),
            need,
            pages,
        })?;
        Ok(Self {
            inner: Arc::new(PoolInner {
                geometry,
                pages,
                page_bytes,
                memory,
                table: Mutex::new(Table { slots, free, usage }),
                poison: options.poison,
                scrub: options.scrub,
                counters: PoolCounters::default(),
            }),
        })
    }

    /// A host pool on a fresh sealed memfd.
    pub fn host(
        name: &std::ffi::CStr,
        geometry: PageGeometry,
        pages: u32,
        options: PoolOptions,
    ) -> std::io::Result<Self> {
        let len = geometry.bytes_per_page().saturating_mul(u64::from(pages));
        let mem = crate::memory::HostMemory::new(name, len)?;
        Self::new(geometry, pages, Box::new(mem), options).map_err(std::io::Error::other)
    }

    pub fn geometry(&self) -> &PageGeometry {
        &self.inner.geometry
    }

    /// Pages in the pool.
    pub fn pages(&self) -> u32 {
        self.inner.pages
    }

    /// Bytes per page.
    pub fn page_bytes(&self) -> usize {
        self.inner.page_bytes
    }

    pub fn memory(&self) -> &dyn PoolMemory {
        &*self.inner.memory
    }

    pub fn counters(&self) -> &PoolCounters {
        &self.inner.counters
    }

    /// Current page counts per state.
    pub fn usage(&self) -> PoolUsage {
        self.inner.lock().usage
    }

    /// State and owner of one page (for tests and status).
    pub fn page_state(&self, page: PageId) -> Option<(PageState, Option<Owner>)> {
        let t = self.inner.lock();
        t.slots.get(page.index()).map(|s| (s.state, s.owner))
    }

    /// Reserves `pages` pages for `owner`, all or none. `tokens` is how many token positions
    /// the pages are for (the prompt); `capacity_tokens` how many the reservation may hold in
    /// all (prompt plus generated tokens on decode).
    pub fn reserve(
        &self,
        owner: Owner,
        tokens: u32,
        capacity_tokens: u64,
    ) -> Result<Reservation, PoolError> {
        let need64 = self
            .inner
            .geometry
            .pages_for_tokens(capacity_tokens.max(u64::from(tokens)));
        let need = u32::try_from(need64).unwrap_or(u32::MAX);
        if need > self.inner.pages {
            return Err(PoolError::NeverFits {
                need,
                total: self.inner.pages,
            });
        }
        let mut t = self.inner.lock();
        let free = u32::try_from(t.free.len()).unwrap_or(u32::MAX);
        if need > free {
            return Err(PoolError::Full { need, free });
        }
        let at = t.free.len() - need as usize;
        let pages: Vec<PageId> = t.free.drain(at..).rev().collect();
        for &p in &pages {
            let s = &mut t.slots[p.index()];
            debug_assert_eq!(s.state, PageState::Free);
            s.owner = Some(owner);
            s.writers = 0;
            s.landed = None;
            t.set(p, PageState::Reserved);
        }
        drop(t);
        let c = &self.inner.counters;
        c.reservations.fetch_add(1, Ordering::Relaxed);
        c.pages_reserved
            .fetch_add(u64::from(need), Ordering::Relaxed);
        Ok(Reservation {
            pool: self.clone(),
            owner,
            pages,
            tokens,
            capacity_tokens: capacity_tokens.max(u64::from(tokens)),
            grant_live: false,
        })
    }
}

impl PoolInner {
    fn lock(&self) -> MutexGuard<'_, Table> {
        // A poisoned lock means a panic while the table was held; the table's updates are
        // single assignments, so the data is still consistent.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Raw page bytes. Callers must own the page exclusively per the table.
    fn page_ptr(&self, page: PageId) -> Result<*mut u8, PoolError> {
        let base = self.memory.host_ptr().ok_or(PoolError::NoHostMapping)?;
        debug_assert!(page.0 < self.pages);
        // SAFETY: page < pages and memory.len() >= pages * page_bytes (checked in new()), so the
        // offset stays inside the mapping.
        Ok(unsafe { base.as_ptr().add(page.index() * self.page_bytes) })
    }

    /// Fills a page being freed with the poison pattern or zeros, as configured.
    fn wipe(&self, page: PageId, owner: Option<Owner>) {
        let pattern = match (self.poison, self.scrub) {
            (PoisonMode::Owner, _) => Some(poison_pattern(owner)),
            (PoisonMode::Off, Scrub::OnFree) => Some([0u8; 16]),
            (PoisonMode::Off, Scrub::Off) => None,
        };
        let Some(pattern) = pattern else {
            return;
        };
        let ptr = match (self.page_ptr(page), self.memory.device()) {
            (Ok(ptr), _) => ptr,
            (Err(_), Some(device)) => {
                let at = crate::ids::PoolOffset(page.index() as u64 * self.page_bytes as u64);
                if let Err(e) = device.fill(at, self.page_bytes as u64, &pattern) {
                    log::warn!("wiping {page} on the device: {}", crate::error_chain(&e));
                }
                return;
            }
            (Err(_), None) => return,
        };
        // SAFETY: the page is being freed under the table lock: no reservation, grant or
        // verified handle refers to it any more, so nobody else holds a slice of it.
        let bytes = unsafe { std::slice::from_raw_parts_mut(ptr, self.page_bytes) };
        if pattern == [0u8; 16] {
            bytes.fill(0);
        } else {
            // Write the pattern once, then double the filled prefix with memcpy.
            let first = bytes.len().min(16);
            bytes[..first].copy_from_slice(&pattern[..first]);
            let mut filled = first;
            while filled < bytes.len() {
                let n = filled.min(bytes.len() - filled);
                bytes.copy_within(..n, filled);
                filled += n;
            }
        }
    }

    /// Frees one page whose last holder has gone. Table lock held by the caller.
    fn free_page(&self, t: &mut Table, page: PageId) {
        let owner = t.slots[page.index()].owner.take();
        t.slots[page.index()].landed = None;
        self.wipe(page, owner);
        t.set(page, PageState::Free);
        t.free.push(page);
        self.counters.pages_freed.fetch_add(1, Ordering::Relaxed);
    }
}

/// The 16-byte pattern poison mode writes into a freed page: "KVPOISON" followed by the
/// little-endian id of the request that last owned it.
pub fn poison_pattern(owner: Option<Owner>) -> [u8; 16] {
    let mut p = [0u8; 16];
    p[..8].copy_from_slice(b"KVPOISON");
    p[8..].copy_from_slice(&owner.map_or(u64::MAX, |o| o.request.0).to_le_bytes());
    p
}

/// Pages reserved for one request on one pool. Dropping it releases the pages: at once when
/// no writer can touch them, else when the last [`WriteGrant`] is gone.
#[must_use = "dropping a reservation releases its pages"]
pub struct Reservation {
    pool: PagePool,
    owner: Owner,
    pages: Vec<PageId>,
    tokens: u32,
    capacity_tokens: u64,
    grant_live: bool,
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation")
            .field("owner", &self.owner)
            .field("pages", &self.pages.len())
            .field("tokens", &self.tokens)
            .finish()
    }
}

impl Reservation {
    pub fn owner(&self) -> Owner {
        self.owner
    }

    /// All reserved pages, in token order.
    pub fn pages(&self) -> &[PageId] {
        &self.pages
    }

    /// Prompt tokens the reservation was made for.
    pub fn tokens(&self) -> u32 {
        self.tokens
    }

    /// Pages that hold the prompt tokens (a prefix of `pages()`).
    pub fn prompt_pages(&self) -> usize {
        usize::try_from(
            self.pool
                .geometry()
                .pages_for_tokens(u64::from(self.tokens)),
        )
        .unwrap_or(usize::MAX)
    }

    pub fn capacity_tokens(&self) -> u64 {
        self.capacity_tokens
    }

    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    /// Opens write access to the prompt pages for one writer (a transfer, or a local prefill).
    /// While the grant lives the pages are `Writing`; if the reservation is dropped meanwhile
    /// they become `Draining` and are freed only when the grant is dropped.
    pub fn grant_write(&mut self) -> Result<WriteGrant, PoolError> {
        self.grant_pages(self.prompt_pages())
    }

    /// Like [`grant_write`](Self::grant_write) over the first `n` pages.
    pub fn grant_pages(&mut self, n: usize) -> Result<WriteGrant, PoolError> {
        self.refresh_grant();
        if self.grant_live {
            return Err(PoolError::WriterActive);
        }
        let n = n.min(self.pages.len());
        let inner = &self.pool.inner;
        let mut t = inner.lock();
        for &p in &self.pages[..n] {
            let s = &t.slots[p.index()];
            if s.state != PageState::Reserved || s.owner != Some(self.owner) {
                return Err(PoolError::AlreadyVerified);
            }
        }
        for &p in &self.pages[..n] {
            let s = &mut t.slots[p.index()];
            s.writers += 1;
            // A new writer may change the page: what the last one landed no longer counts.
            s.landed = None;
            t.set(p, PageState::Writing);
        }
        drop(t);
        self.grant_live = true;
        Ok(WriteGrant {
            pool: self.pool.clone(),
            owner: self.owner,
            pages: self.pages[..n].to_vec(),
            landed: vec![None; n],
        })
    }

    /// Re-reads from the table whether the last grant has ended (a grant reports its end to
    /// the table, not to the reservation, since it may outlive it).
    fn refresh_grant(&mut self) {
        if self.grant_live {
            let t = self.pool.inner.lock();
            self.grant_live = self.pages.iter().any(|p| t.slots[p.index()].writers > 0);
        }
    }

    /// Whether a writer may still touch any of the pages.
    pub fn has_writer(&mut self) -> bool {
        self.refresh_grant();
        self.grant_live
    }

    /// The bytes of `page`, for sending it to the peer that pulls it (a prefill page server).
    /// Refused unless `page` is one of this reservation's pages and no writer can touch it.
    pub fn read_page(&self, page: PageId) -> Result<&[u8], PoolError> {
        let mut one = self.read_pages(&[page])?;
        one.pop().ok_or(PoolError::NotOwned { page })
    }

    /// The bytes of each of `pages`, in order, checked under one lock: each must be one of
    /// this reservation's pages, owned by it in the table, with no writer.
    pub fn read_pages(&self, pages: &[PageId]) -> Result<Vec<&[u8]>, PoolError> {
        let inner = &self.pool.inner;
        {
            let t = inner.lock();
            for &page in pages {
                let Some(s) = t
                    .slots
                    .get(page.index())
                    .filter(|_| self.pages.contains(&page))
                else {
                    return Err(PoolError::NotOwned { page });
                };
                if s.owner != Some(self.owner) {
                    return Err(PoolError::NotOwned { page });
                }
                if s.writers > 0 {
                    return Err(PoolError::WriterActive);
                }
            }
        }
        let mut out = Vec::with_capacity(pages.len());
        for &page in pages {
            let ptr = inner.page_ptr(page)?;
            // SAFETY: the page belongs to this live reservation (checked above, and a page
            // leaves a reservation only when it is dropped, which `&self` excludes) and no
            // writer holds it; a new
            // writer needs `grant_pages(&mut self)`, which the borrow of `self` for the
            // returned slices excludes.
            out.push(unsafe { std::slice::from_raw_parts(ptr, inner.page_bytes) });
        }
        Ok(out)
    }

    /// Runs `f` on the owner's view of the table, under the table lock. Only `verify.rs` uses
    /// it, to check ownership and move pages to `Readable` atomically.
    pub(crate) fn with_table<R>(&self, f: impl FnOnce(&mut TableView<'_>) -> R) -> R {
        let mut t = self.pool.inner.lock();
        let mut view = TableView {
            table: &mut t,
            owner: self.owner,
        };
        f(&mut view)
    }

    pub(crate) fn page_bytes_ptr(&self, page: PageId) -> Result<*mut u8, PoolError> {
        self.pool.inner.page_ptr(page)
    }
}

/// Access to the table for the verification step.
pub(crate) struct TableView<'a> {
    table: &'a mut Table,
    owner: Owner,
}

impl TableView<'_> {
    /// State of `page` if the view's owner owns it.
    pub(crate) fn owned_state(&self, page: PageId) -> Option<PageState> {
        let s = self.table.slots.get(page.index())?;
        (s.owner == Some(self.owner)).then_some(s.state)
    }

    pub(crate) fn make_readable(&mut self, page: PageId) {
        self.table.set(page, PageState::Readable);
    }

    /// The digest `page`'s last writer computed as its bytes landed, if it did and the view's
    /// owner owns the page.
    pub(crate) fn landed(&self, page: PageId) -> Option<u32> {
        let s = self.table.slots.get(page.index())?;
        (s.owner == Some(self.owner)).then_some(s.landed).flatten()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let inner = &self.pool.inner;
        let mut t = inner.lock();
        let mut drained = false;
        for &p in &self.pages {
            let s = t.slots[p.index()];
            debug_assert_eq!(s.owner, Some(self.owner));
            if s.writers > 0 {
                t.set(p, PageState::Draining);
                drained = true;
            } else {
                inner.free_page(&mut t, p);
            }
        }
        drop(t);
        if drained {
            inner.counters.drained.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Write access to a reservation's pages for one writer. Send it to the thread that writes;
/// dropping it ends the writes. Holds the pool alive, not the reservation.
pub struct WriteGrant {
    pool: PagePool,
    owner: Owner,
    pages: Vec<PageId>,
    /// Per grant page, the digest a [`Landing`] computed as the whole page landed; cleared
    /// whenever the page is handed out for writing any other way.
    landed: Vec<Option<u32>>,
}

impl fmt::Debug for WriteGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WriteGrant")
            .field("owner", &self.owner)
            .field("pages", &self.pages.len())
            .finish()
    }
}

impl WriteGrant {
    pub fn owner(&self) -> Owner {
        self.owner
    }

    /// Pages this grant may write, in token order.
    pub fn pages(&self) -> &[PageId] {
        &self.pages
    }

    pub fn geometry(&self) -> &PageGeometry {
        self.pool.geometry()
    }

    /// The bytes of the `index`-th page of the grant.
    pub fn page_mut(&mut self, index: usize) -> Result<&mut [u8], PoolError> {
        let page = *self.pages.get(index).ok_or(PoolError::OutOfGrant {
            index,
            pages: self.pages.len(),
        })?;
        let ptr = self.pool.inner.page_ptr(page)?;
        self.landed[index] = None;
        // SAFETY: the table records this grant as the only writer of `page` (grant_pages refuses
        // a second grant, and only the owner's reservation could make one), nobody reads it
        // before verification, and `&mut self` keeps this slice unique within the grant.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, self.pool.inner.page_bytes) })
    }

    /// The bytes of grant pages `range` at once, in grant order, for a transfer that fills
    /// them together (a vectored read, RDMA reads with many in flight). Refused when the
    /// range is not inside the grant.
    pub fn pages_mut(
        &mut self,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<&mut [u8]>, PoolError> {
        let pages = self.pages.get(range.clone()).ok_or(PoolError::OutOfGrant {
            index: range.end,
            pages: self.pages.len(),
        })?;
        let mut out = Vec::with_capacity(pages.len());
        for &page in pages {
            let ptr = self.pool.inner.page_ptr(page)?;
            // SAFETY: as in `page_mut`; the pages of a grant are distinct (a reservation
            // never holds a page twice), so the slices do not overlap, and `&mut self`
            // keeps them the only ones for as long as they live.
            out.push(unsafe { std::slice::from_raw_parts_mut(ptr, self.pool.inner.page_bytes) });
        }
        self.landed[range].fill(None);
        Ok(out)
    }

    /// Grant pages `range`, to be filled in order by a transfer that digests every byte as it
    /// lands (see [`Landing`]). What the landing digests is what verification compares with
    /// the manifest, so the pages are not read a second time; a page the landing does not
    /// complete, or that is written any other way afterwards, is digested by verification
    /// from the pool as before.
    pub fn landing(&mut self, range: std::ops::Range<usize>) -> Result<Landing<'_>, PoolError> {
        let page_bytes = self.pool.inner.page_bytes;
        let count = range.len();
        if self.pages.get(range.clone()).is_none() {
            return Err(PoolError::OutOfGrant {
                index: range.end,
                pages: self.pages.len(),
            });
        }
        let mut pages = Vec::with_capacity(count);
        for &page in &self.pages[range.clone()] {
            let ptr = self.pool.inner.page_ptr(page)?;
            // SAFETY: as in `pages_mut`: distinct pages this grant alone may write, borrowed
            // through `&mut self` for as long as the landing lives.
            pages.push(unsafe { std::slice::from_raw_parts_mut(ptr, page_bytes) });
        }
        let slots = &mut self.landed[range];
        slots.fill(None);
        Ok(Landing::new(pages, Some(slots)))
    }
}

impl WriteGrant {
    /// Grant pages `range` of a device pool, for a transfer the device performs (a
    /// device-to-device pull): where each page is, and, once the device has written them
    /// all, [`DeviceLanding::digest_landed`] digests them on the device, as verification
    /// would. Refused when the range is not inside the grant or the pool is not on a device.
    pub fn device_landing(
        &mut self,
        range: std::ops::Range<usize>,
    ) -> Result<DeviceLanding<'_>, PoolError> {
        let memory = self
            .pool
            .inner
            .memory
            .device()
            .ok_or(PoolError::NoDeviceMemory)?;
        let pages = self.pages.get(range.clone()).ok_or(PoolError::OutOfGrant {
            index: range.end,
            pages: self.pages.len(),
        })?;
        let page_bytes = self.pool.inner.page_bytes as u64;
        let offsets = pages
            .iter()
            .map(|p| crate::ids::PoolOffset(u64::from(p.0) * page_bytes))
            .collect();
        let slots = &mut self.landed[range];
        slots.fill(None);
        Ok(DeviceLanding {
            memory,
            offsets,
            page_bytes,
            slots,
        })
    }
}

/// Grant pages of a device pool that a device fills ([`WriteGrant::device_landing`]). The
/// digests it records are computed on the device from the pages themselves, after the
/// writes, never taken from the writer; until then verification digests the pages itself.
#[must_use = "a landing records nothing until digest_landed"]
pub struct DeviceLanding<'a> {
    memory: &'a dyn crate::memory::DeviceMemory,
    offsets: Vec<crate::ids::PoolOffset>,
    page_bytes: u64,
    slots: &'a mut [Option<u32>],
}

impl fmt::Debug for DeviceLanding<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceLanding")
            .field("pages", &self.offsets.len())
            .field("page_bytes", &self.page_bytes)
            .finish_non_exhaustive()
    }
}

impl<'a> DeviceLanding<'a> {
    /// Pages in the landing.
    pub fn pages(&self) -> usize {
        self.offsets.len()
    }

    /// Where each page starts in the pool's memory, in landing order.
    pub fn offsets(&self) -> &[crate::ids::PoolOffset] {
        &self.offsets
    }

    pub fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    /// The device memory the pages are in.
    pub fn memory(&self) -> &'a dyn crate::memory::DeviceMemory {
        self.memory
    }

    /// Every page has been written (the device's work is complete): digests them all on
    /// the device and records the digests for verification.
    pub fn digest_landed(self) -> Result<(), crate::memory::cuda::CudaError> {
        let digests = self.memory.digest_pages(&self.offsets, self.page_bytes)?;
        for (slot, d) in self.slots.iter_mut().zip(digests) {
            *slot = Some(d);
        }
        Ok(())
    }
}

/// Where a transfer puts a run of pages: the pages are filled in order, and every byte is
/// digested (crc32c, [`page_digest`](crate::verify::page_digest)) as it lands: a copy the
/// CPU makes ([`Landing::copy_in`]) digests the very values it stores, in the same pass;
/// bytes another writer delivered ([`Landing::fill`]) are digested right after they land,
/// while they are still in the CPU's cache, from the destination page itself. Either way the
/// digest is of what the page holds, never of a second read of the source, which may change
/// after the copy. When a page is complete its digest goes to the grant, and
/// [`Reservation::verify`] compares that digest with the manifest instead of reading the page
/// again.
///
/// A writer gets only the bytes not yet landed, and bytes it reports landed are digested
/// at once and never handed out again, so every digest is of a page's final contents.
#[must_use = "a landing fills nothing until it is used"]
pub struct Landing<'a> {
    pages: Vec<&'a mut [u8]>,
    /// Where each page's digest goes (none for buffers outside a pool: nothing digested).
    slots: Option<&'a mut [Option<u32>]>,
    /// The page being filled, and how many of its bytes have landed.
    page: usize,
    filled: usize,
    crc: Crc32c,
    /// Whether bytes were copied in since the last [`store_fence`]: streaming stores, to be
    /// fenced before the page is recorded complete or the landing ends. A fence orders only
    /// the stores of its own thread, so a landing is filled and dropped on one thread (a
    /// pull splits it before any byte lands and hands each part to one thread).
    unfenced: bool,
}

impl fmt::Debug for Landing<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Landing")
            .field("pages", &self.pages.len())
            .field("page", &self.page)
            .field("filled", &self.filled)
            .field("digested", &self.slots.is_some())
            .finish()
    }
}

impl<'a> Landing<'a> {
    fn new(pages: Vec<&'a mut [u8]>, slots: Option<&'a mut [Option<u32>]>) -> Self {
        let mut l = Landing {
            pages,
            slots,
            page: 0,
            filled: 0,
            crc: Crc32c::new(0),
            unfenced: false,
        };
        l.skip_empty();
        l
    }

    /// A landing over plain buffers (tests, benchmarks, a peer's bytes not bound for a
    /// pool): filled in order like any other, nothing digested or kept.
    pub fn untracked(pages: Vec<&'a mut [u8]>) -> Self {
        Self::new(pages, None)
    }

    /// Pages in the landing.
    pub fn pages(&self) -> usize {
        self.pages.len()
    }

    /// Whether every byte of every page has landed.
    pub fn is_full(&self) -> bool {
        self.page >= self.pages.len()
    }

    /// The index of the page being filled (`pages()` once full).
    pub fn current_page(&self) -> usize {
        self.page
    }

    /// The length of the page being filled (`None` once full).
    pub fn current_len(&self) -> Option<usize> {
        self.pages.get(self.page).map(|p| p.len())
    }

    /// Bytes still to land.
    pub fn remaining(&self) -> usize {
        let rest: usize = self.pages.iter().skip(self.page).map(|p| p.len()).sum();
        rest - self.filled
    }

    /// Lends `fill` the next at most `max` bytes of the page being filled; `fill` returns
    /// how many of them, from the start, it wrote. Those are digested at once. Returns that
    /// count (0 once full, without calling `fill`). A count above what was lent is an error
    /// of the caller and counts as what was lent.
    pub fn fill<E>(
        &mut self,
        max: usize,
        fill: impl FnOnce(&mut [u8]) -> Result<usize, E>,
    ) -> Result<usize, E> {
        let Some(page) = self.pages.get_mut(self.page) else {
            return Ok(0);
        };
        let end = page.len().min(self.filled.saturating_add(max));
        let lent = &mut page[self.filled..end];
        let n = fill(lent)?.min(end - self.filled);
        self.landed(n);
        Ok(n)
    }

    /// Copies the next at most `max` bytes of the page being filled from the source `src`
    /// gives for that many bytes, and digests them in the same pass (the registers the copy
    /// stored, see [`Crc32c::copy`]), so nothing is read again. Copies as many bytes as the
    /// source holds, if fewer. Returns that count (0 once full, without calling `src`).
    pub fn copy_in<'s, E>(
        &mut self,
        max: usize,
        src: impl FnOnce(usize) -> Result<Source<'s>, E>,
    ) -> Result<usize, E> {
        let Some(page) = self.pages.get_mut(self.page) else {
            return Ok(0);
        };
        let end = page.len().min(self.filled.saturating_add(max));
        let from = src(end - self.filled)?;
        let n = from.len.min(end - self.filled);
        let len = page.len();
        let dst = &mut page[self.filled..self.filled + n];
        if self.slots.is_some() {
            // SAFETY: a `Source` is readable for its length, at least `n`, and never overlaps
            // a landing's pages (`Source::from_raw`'s contract; a slice cannot overlap pages
            // this landing borrows uniquely). The fence comes when the page is complete or
            // the landing is dropped (see `unfenced`).
            unsafe { self.crc.copy_unfenced(dst, from.ptr) };
            self.unfenced = true;
        } else {
            // SAFETY: as above.
            unsafe { std::ptr::copy_nonoverlapping(from.ptr, dst.as_mut_ptr(), n) };
        }
        self.filled += n;
        if self.filled == len {
            self.finish_page();
        }
        self.skip_empty();
        Ok(n)
    }

    /// Lends `fill` the next at most `max` bytes, across pages, as vectored-I/O buffers;
    /// `fill` returns how many bytes it wrote from the start of them. Those are digested at
    /// once (page by page). Returns that count (0 once full, without calling `fill`).
    pub fn fill_vectored<E>(
        &mut self,
        max: usize,
        fill: impl FnOnce(&mut [std::io::IoSliceMut<'_>]) -> Result<usize, E>,
    ) -> Result<usize, E> {
        if self.is_full() || max == 0 {
            return Ok(0);
        }
        let mut lent = 0usize;
        let mut bufs = Vec::new();
        let mut from = self.filled;
        for page in &mut self.pages[self.page..] {
            if lent >= max {
                break;
            }
            let end = page.len().min(from.saturating_add(max - lent));
            lent += end - from;
            bufs.push(std::io::IoSliceMut::new(&mut page[from..end]));
            from = 0;
        }
        let n = fill(&mut bufs)?.min(lent);
        drop(bufs);
        self.landed(n);
        Ok(n)
    }

    /// Splits off pages `at..` into a landing of their own (to fill them on another thread).
    /// `None` if any of them has started to land or `at` is past the end.
    pub fn split_off(&mut self, at: usize) -> Option<Landing<'a>> {
        if at > self.pages.len() || (self.page > at) || (self.page == at && self.filled > 0) {
            return None;
        }
        let pages = self.pages.split_off(at);
        let slots = match self.slots.take() {
            Some(s) => {
                let (mine, theirs) = s.split_at_mut(at);
                self.slots = Some(mine);
                Some(theirs)
            }
            None => None,
        };
        self.skip_empty();
        Some(Landing::new(pages, slots))
    }

    /// For a transfer the CPU does not perform (RDMA): every page whole, to hand to the
    /// device, and what records each one once the device reports it landed. `None` if a
    /// byte has landed already.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn into_device(mut self) -> Option<(Vec<&'a mut [u8]>, DeviceLanded<'a>)> {
        if self.page > 0 || self.filled > 0 {
            return None;
        }
        let expected = self
            .pages
            .iter()
            .map(|p| (p.as_ptr() as usize, p.len()))
            .collect();
        Some((
            std::mem::take(&mut self.pages),
            DeviceLanded {
                expected,
                slots: self.slots.take(),
            },
        ))
    }

    /// `n` more bytes of the pages have landed: digests them, and records each page that is
    /// complete.
    fn landed(&mut self, mut n: usize) {
        while n > 0 {
            let page = &self.pages[self.page];
            let take = n.min(page.len() - self.filled);
            if self.slots.is_some() {
                self.crc.update(&page[self.filled..self.filled + take]);
            }
            self.filled += take;
            n -= take;
            if self.filled == page.len() {
                self.finish_page();
            }
        }
        self.skip_empty();
    }

    fn finish_page(&mut self) {
        self.fence();
        let crc = std::mem::take(&mut self.crc);
        if let Some(slot) = self.slots.as_mut().and_then(|s| s.get_mut(self.page)) {
            *slot = Some(crc.value());
        }
        self.page += 1;
        self.filled = 0;
    }

    /// Pages of no bytes are complete as soon as they are reached.
    fn skip_empty(&mut self) {
        while self.pages.get(self.page).is_some_and(|p| p.is_empty()) {
            self.finish_page();
        }
    }

    /// Makes the bytes copied in so far visible to every thread before what follows.
    fn fence(&mut self) {
        if std::mem::take(&mut self.unfenced) {
            store_fence();
        }
    }
}

impl Drop for Landing<'_> {
    fn drop(&mut self) {
        // A page left incomplete is digested by verification, maybe on another thread.
        self.fence();
    }
}

/// Bytes a [`Landing`] copies in ([`Landing::copy_in`]): a slice, or memory another process
/// may write during the copy (the landing then digests what it copied, which is what
/// verification must judge).
#[derive(Clone, Copy, Debug)]
pub struct Source<'a> {
    ptr: *const u8,
    len: usize,
    bytes: std::marker::PhantomData<&'a [u8]>,
}

impl<'a> From<&'a [u8]> for Source<'a> {
    fn from(bytes: &'a [u8]) -> Self {
        Source {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
            bytes: std::marker::PhantomData,
        }
    }
}

impl Source<'_> {
    /// The `len` bytes at `ptr`, which may change while they are copied.
    ///
    /// # Safety
    /// `ptr` must be readable for `len` bytes for as long as the source lives, and the bytes
    /// must not overlap any page a [`Landing`] may fill (they are read only through raw
    /// pointers, never as a reference).
    pub unsafe fn from_raw(ptr: *const u8, len: usize) -> Self {
        Source {
            ptr,
            len,
            bytes: std::marker::PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Where the bytes start (to be read through raw pointers only, for the source's `len`
    /// bytes and its lifetime).
    pub fn ptr(&self) -> *const u8 {
        self.ptr
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Records the pages of a [`Landing`] a device filled, one by one as it reports them landed.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) struct DeviceLanded<'a> {
    /// Address and length of each page.
    expected: Vec<(usize, usize)>,
    slots: Option<&'a mut [Option<u32>]>,
}

impl<'a> DeviceLanded<'a> {
    /// Page `index` has landed: digests its bytes and records the digest. The page is given
    /// back for good, so nothing can write it after the digest; a slice that is not that
    /// page records nothing (verification then digests the page from the pool).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn landed(&mut self, index: usize, page: &'a mut [u8]) {
        let ok = self.expected.get(index) == Some(&(page.as_ptr() as usize, page.len()));
        if let Some(slot) = self.slots.as_mut().and_then(|s| s.get_mut(index)) {
            *slot = ok.then(|| crate::verify::page_digest(page));
        }
    }
}

impl Drop for WriteGrant {
    fn drop(&mut self) {
        let inner = &self.pool.inner;
        let mut t = inner.lock();
        for (&p, &landed) in self.pages.iter().zip(&self.landed) {
            let s = &mut t.slots[p.index()];
            debug_assert_eq!(s.owner, Some(self.owner));
            s.writers = s.writers.saturating_sub(1);
            s.landed = landed;
            let (writers, state) = (s.writers, s.state);
            if writers == 0 {
                match state {
                    PageState::Draining => inner.free_page(&mut t, p),
                    PageState::Writing => t.set(p, PageState::Reserved),
                    _ => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Dtype, Generation, RequestId};

    #[test]
    fn a_range_of_grant_pages_is_exactly_those_pages() {
        let geometry = PageGeometry {
            tokens_per_page: 4,
            layers: 1,
            kv_heads: 1,
            head_dim: 8,
            dtype: Dtype::Bf16,
        };
        let pool = PagePool::host(c"kvtest-range", geometry, 8, PoolOptions::default()).unwrap();
        let owner = Owner {
            request: RequestId(1),
            generation: Generation(1),
        };
        let mut res = pool.reserve(owner, 16, 4).unwrap();
        let mut grant = res.grant_write().unwrap();
        let n = grant.pages().len();
        for i in 0..n {
            grant.page_mut(i).unwrap().fill(0xaa);
        }
        for (i, page) in grant.pages_mut(1..3).unwrap().into_iter().enumerate() {
            page.fill(u8::try_from(i).unwrap() + 1);
        }
        for i in 0..n {
            let want = match i {
                1 => 1,
                2 => 2,
                _ => 0xaa,
            };
            assert!(
                grant.page_mut(i).unwrap().iter().all(|&b| b == want),
                "page {i}"
            );
        }
        assert!(grant.pages_mut(n - 1..n + 1).is_err());
        assert_eq!(grant.pages_mut(0..n).unwrap().len(), n);
    }

    fn landing_pool() -> (PagePool, Reservation) {
        let geometry = PageGeometry {
            tokens_per_page: 4,
            layers: 1,
            kv_heads: 1,
            head_dim: 64,
            dtype: Dtype::Bf16,
        };
        let pool = PagePool::host(c"kvtest-landing", geometry, 8, PoolOptions::default()).unwrap();
        let owner = Owner {
            request: RequestId(1),
            generation: Generation(1),
        };
        let res = pool.reserve(owner, 16, 16).unwrap();
        (pool, res)
    }

    fn landed(res: &Reservation) -> Vec<Option<u32>> {
        res.with_table(|t| res.pages().iter().map(|&p| t.landed(p)).collect())
    }

    #[test]
    fn a_landing_digests_every_page_as_its_last_byte_lands() {
        let (pool, mut res) = landing_pool();
        let page = pool.page_bytes();
        let stream: Vec<u8> = (0..4 * page)
            .map(|i| u8::try_from(i % 253).unwrap())
            .collect();
        {
            let mut grant = res.grant_write().unwrap();
            let mut landing = grant.landing(0..4).unwrap();
            assert_eq!(landing.remaining(), 4 * page);
            // Reads of odd sizes across page boundaries, some short of what was lent.
            let mut at = 0;
            for (max, take) in [
                (100, 100),
                (page, 7),
                (3 * page, 2 * page),
                (usize::MAX, page),
            ] {
                let n = landing
                    .fill_vectored(max, |bufs| {
                        let mut left = take;
                        for b in bufs.iter_mut() {
                            let k = b.len().min(left);
                            b[..k].copy_from_slice(&stream[at..at + k]);
                            at += k;
                            left -= k;
                        }
                        Ok::<_, ()>(take - left)
                    })
                    .unwrap();
                assert!(n <= take);
            }
            while !landing.is_full() {
                landing
                    .fill(64, |dst| {
                        dst.copy_from_slice(&stream[at..at + dst.len()]);
                        at += dst.len();
                        Ok::<_, ()>(dst.len())
                    })
                    .unwrap();
            }
            assert_eq!(at, stream.len());
        }
        let want: Vec<Option<u32>> = stream
            .chunks(page)
            .map(|p| Some(crate::verify::page_digest(p)))
            .collect();
        assert_eq!(landed(&res), want);
    }

    #[test]
    fn a_landing_copies_in_and_digests_in_the_same_pass() {
        let (pool, mut res) = landing_pool();
        let page = pool.page_bytes();
        let stream: Vec<u8> = (0..4 * page)
            .map(|i| u8::try_from(i % 251).unwrap())
            .collect();
        {
            let mut grant = res.grant_write().unwrap();
            let mut landing = grant.landing(0..4).unwrap();
            let mut at = 0;
            // Odd sizes, a source shorter than what was lent, and more than a page asked.
            for (max, short) in [(100, false), (page, true), (3 * page, false), (300, true)] {
                let n = landing
                    .copy_in(max, |len| {
                        let len = if short { len / 2 } else { len };
                        Ok::<_, ()>(Source::from(&stream[at..at + len]))
                    })
                    .unwrap();
                at += n;
            }
            while !landing.is_full() {
                at += landing
                    .copy_in(usize::MAX, |len| {
                        Ok::<_, ()>(Source::from(&stream[at..at + len]))
                    })
                    .unwrap();
            }
            assert_eq!(at, stream.len());
            assert_eq!(landing.copy_in(10, |_| Err(())), Ok(0), "full: not asked");
        }
        let want: Vec<Option<u32>> = stream
            .chunks(page)
            .map(|p| Some(crate::verify::page_digest(p)))
            .collect();
        assert_eq!(landed(&res), want);
        let mut grant = res.grant_write().unwrap();
        for (i, p) in stream.chunks(page).enumerate() {
            assert!(grant.page_mut(i).unwrap() == p, "page {i}");
        }
        // Plain buffers: copied, nothing digested.
        let mut bufs = [vec![0u8; 300], vec![0u8; 5]];
        let mut plain = Landing::untracked(bufs.iter_mut().map(Vec::as_mut_slice).collect());
        while !plain.is_full() {
            plain
                .copy_in(usize::MAX, |len| Ok::<_, ()>(Source::from(&stream[..len])))
                .unwrap();
        }
        drop(plain);
        assert!(bufs[0] == stream[..300] && bufs[1] == stream[..5]);
    }

    #[test]
    fn writing_a_page_any_other_way_forgets_what_landed() {
        let (pool, mut res) = landing_pool();
        let page = pool.page_bytes();
        let fill_all = |grant: &mut WriteGrant| {
            let mut landing = grant.landing(0..4).unwrap();
            while !landing.is_full() {
                landing.fill(page, |d| Ok::<_, ()>(d.len())).unwrap();
            }
        };
        {
            let mut grant = res.grant_write().unwrap();
            fill_all(&mut grant);
            grant.page_mut(1).unwrap()[0] = 1;
            drop(grant.pages_mut(3..4).unwrap());
        }
        let l = landed(&res);
        assert!(l[0].is_some() && l[2].is_some(), "{l:?}");
        assert_eq!((l[1], l[3]), (None, None));
        // A new grant may change every page again: nothing landed counts any more.
        {
            let mut grant = res.grant_write().unwrap();
            assert!(landed(&res).iter().all(Option::is_none));
            fill_all(&mut grant);
            // a landing that is begun again starts from scratch, and one not finished
            // records nothing
            let mut again = grant.landing(2..4).unwrap();
            again.fill(10, |d| Ok::<_, ()>(d.len())).unwrap();
        }
        let l = landed(&res);
        assert!(l[0].is_some() && l[1].is_some(), "{l:?}");
        assert_eq!((l[2], l[3]), (None, None));
        drop(res);
        assert_eq!(pool.usage().free, 8);
    }

    #[test]
    fn split_landings_fill_disjoint_pages_and_plain_buffers_keep_no_digest() {
        let (pool, mut res) = landing_pool();
        let page = pool.page_bytes();
        {
            let mut grant = res.grant_write().unwrap();
            let mut first = grant.landing(0..4).unwrap();
            let mut second = first.split_off(1).unwrap();
            let mut third = second.split_off(2).unwrap();
            assert_eq!((first.pages(), second.pages(), third.pages()), (1, 2, 1));
            for (k, l) in [&mut first, &mut second, &mut third]
                .into_iter()
                .enumerate()
            {
                while !l.is_full() {
                    l.fill(page, |d| {
                        d.fill(u8::try_from(k).unwrap());
                        Ok::<_, ()>(d.len())
                    })
                    .unwrap();
                }
            }
            drop((first, second, third));
            // a landing that has begun cannot give away its current page
            let mut l = grant.landing(0..2).unwrap();
            l.fill(1, |d| Ok::<_, ()>(d.len())).unwrap();
            assert!(l.split_off(0).is_none());
            assert!(l.split_off(3).is_none());
        }
        assert!(landed(&res)[2..].iter().all(Option::is_some));
        let mut bufs = [vec![0u8; 3], vec![0u8; 0], vec![0u8; 2]];
        let mut plain = Landing::untracked(bufs.iter_mut().map(Vec::as_mut_slice).collect());
        assert_eq!(plain.remaining(), 5);
        let n = plain
            .fill_vectored(usize::MAX, |b| {
                assert_eq!(b.len(), 3);
                b[0].fill(7);
                b[2][0] = 8;
                Ok::<_, ()>(4)
            })
            .unwrap();
        assert_eq!((n, plain.remaining(), plain.current_page()), (4, 1, 2));
        drop(plain);
        assert_eq!(bufs, [vec![7, 7, 7], vec![], vec![8, 0]]);
    }
}
