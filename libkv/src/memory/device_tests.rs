//! The pool's device paths (device landings, digests in verification, wipes on free, copy
//! plans) run on host memory behind [`DeviceMemory`], so the page accounting and ownership
//! checks a CUDA pool relies on are tested without a GPU. `libkv/tests/gpu.rs` runs the
//! same paths on a real device.

use super::cuda::CudaError;
use super::{DeviceMemory, PoolMemory, PullError, plan};
use crate::config::{PoisonMode, Scrub};
use crate::geometry::{Dtype, PageGeometry};
use crate::ids::{Generation, Owner, PageId, PoolOffset, RequestId};
use crate::pool::{PagePool, PoolError, PoolOptions, poison_pattern};
use crate::verify::{Manifest, VerifyError, page_digest};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// Device memory emulated on the host: no host mapping, every access through the trait.
#[derive(Debug)]
struct FakeDevice {
    bytes: Mutex<Vec<u8>>,
    len: u64,
    fd: OwnedFd,
    digests: Mutex<usize>,
}

impl FakeDevice {
    fn new(len: usize) -> Self {
        let fd = crate::sys::memfd::create_sealed(c"kvtest-fake-device", 4096).unwrap();
        FakeDevice {
            bytes: Mutex::new(vec![0; len]),
            len: len as u64,
            fd,
            digests: Mutex::new(0),
        }
    }

    fn span(&self, offset: PoolOffset, len: u64) -> Result<std::ops::Range<usize>, CudaError> {
        let end = offset.0.checked_add(len);
        match end {
            Some(e) if e <= PoolMemory::len(self) => Ok(us(offset.0)..us(e)),
            _ => Err(CudaError::OutOfRange {
                what: "bytes outside the device pool",
            }),
        }
    }

    /// Copies a plan's runs from `src` into this memory, as the device's copy engine would.
    fn copy_runs(&self, src: &FakeDevice, runs: &[plan::CopyRun]) {
        let from = src.bytes.lock().unwrap();
        let mut to = self.bytes.lock().unwrap();
        for r in runs {
            let (s, d, n) = (us(r.src.0), us(r.dst.0), us(r.len));
            to[d..d + n].copy_from_slice(&from[s..s + n]);
        }
    }
}

fn us(v: u64) -> usize {
    usize::try_from(v).unwrap()
}

impl PoolMemory for FakeDevice {
    fn len(&self) -> u64 {
        self.len
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        None
    }
    fn share_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
    fn backend(&self) -> &'static str {
        "fake-device"
    }
    fn device(&self) -> Option<&dyn DeviceMemory> {
        Some(self)
    }
}

impl DeviceMemory for FakeDevice {
    fn ordinal(&self) -> u32 {
        0
    }
    fn device_addr(&self) -> u64 {
        0x7f00_0000_0000
    }
    fn digest_pages(&self, offsets: &[PoolOffset], page_bytes: u64) -> Result<Vec<u32>, CudaError> {
        *self.digests.lock().unwrap() += offsets.len();
        let bytes = self.bytes.lock().unwrap();
        let mut out = Vec::new();
        for &o in offsets {
            let r = self.span(o, page_bytes)?;
            out.push(plan::segmented_digest(&bytes[r]));
        }
        Ok(out)
    }
    fn fill(&self, offset: PoolOffset, len: u64, pattern: &[u8; 16]) -> Result<(), CudaError> {
        let r = self.span(offset, len)?;
        let mut bytes = self.bytes.lock().unwrap();
        let region = &mut bytes[r];
        let first = region.len().min(16);
        region[..first].copy_from_slice(&pattern[..first]);
        for c in plan::fill_copies(len) {
            let (f, t, n) = (us(c.from), us(c.to), us(c.len));
            region.copy_within(f..f + n, t);
        }
        Ok(())
    }
    fn read(&self, offset: PoolOffset, dst: &mut [u8]) -> Result<(), CudaError> {
        let r = self.span(offset, dst.len() as u64)?;
        dst.copy_from_slice(&self.bytes.lock().unwrap()[r]);
        Ok(())
    }
    fn write(&self, offset: PoolOffset, src: &[u8]) -> Result<(), CudaError> {
        let r = self.span(offset, src.len() as u64)?;
        self.bytes.lock().unwrap()[r].copy_from_slice(src);
        Ok(())
    }
    fn export_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
    fn dmabuf_fd(&self) -> Result<OwnedFd, CudaError> {
        Err(CudaError::Unsupported {
            ordinal: 0,
            what: "dmabuf export (GPUDirect RDMA registration)",
        })
    }
}

/// 4 KiB pages.
fn geometry() -> PageGeometry {
    PageGeometry {
        tokens_per_page: 16,
        layers: 1,
        kv_heads: 1,
        head_dim: 64,
        dtype: Dtype::Bf16,
    }
}

fn owner(r: u64) -> Owner {
    Owner {
        request: RequestId(r),
        generation: Generation(1),
    }
}

fn page_len() -> usize {
    us(geometry().bytes_per_page())
}

fn page_of(seed: u32) -> Vec<u8> {
    (0..page_len())
        .map(|i| {
            u32::try_from(i)
                .unwrap()
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed)
                .to_le_bytes()[3]
        })
        .collect()
}

/// A pool of `pages` pages on fake device memory, and that memory.
fn device_pool(pages: u32, options: PoolOptions) -> (PagePool, Arc<FakeDevice>) {
    let mem = Arc::new(FakeDevice::new(page_len() * pages as usize));
    // The pool holds a second handle on the same bytes, which the test looks through.
    let pool = PagePool::new(geometry(), pages, Box::new(Shared(mem.clone())), options).unwrap();
    (pool, mem)
}

/// A `PoolMemory` that forwards to memory the test keeps a reference to.
#[derive(Debug)]
struct Shared(Arc<FakeDevice>);

impl PoolMemory for Shared {
    fn len(&self) -> u64 {
        PoolMemory::len(&*self.0)
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        None
    }
    fn share_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
    fn backend(&self) -> &'static str {
        "fake-device"
    }
    fn device(&self) -> Option<&dyn DeviceMemory> {
        Some(&*self.0)
    }
}

/// The foreign pool of a pull: `pages` pages, page `p` holding `page_of(p)`.
fn foreign(pages: u32) -> FakeDevice {
    let f = FakeDevice::new(page_len() * pages as usize);
    for p in 0..pages {
        f.write(PoolOffset(u64::from(p) * page_len() as u64), &page_of(p))
            .unwrap();
    }
    f
}

/// What `CudaForeignPool::pull` does, on the fake devices: plan, copy, digest what landed.
fn pull(
    src: &FakeDevice,
    src_pages: u32,
    pages: &[PageId],
    landing: crate::pool::DeviceLanding<'_>,
    dst: &FakeDevice,
) -> Result<usize, CudaError> {
    let runs = plan::copy_runs(pages, src_pages, landing.offsets(), landing.page_bytes())
        .map_err(CudaError::Pull)?;
    dst.copy_runs(src, &runs);
    landing.digest_landed()?;
    Ok(runs.len())
}

fn manifest(id: u64, pages: &[PageId]) -> Manifest {
    Manifest {
        owner: owner(id),
        tokens: u32::try_from(pages.len()).unwrap() * geometry().tokens_per_page,
        pages: pages.to_vec(),
        digests: pages.iter().map(|p| page_digest(&page_of(p.0))).collect(),
    }
}

#[test]
fn a_device_pull_lands_digests_that_verification_uses() {
    let src = foreign(16);
    let (pool, mem) = device_pool(16, PoolOptions::default());
    let pages: Vec<PageId> = [3, 4, 5, 9, 2].into_iter().map(PageId).collect();
    let m = manifest(1, &pages);
    let mut res = pool.reserve(owner(1), m.tokens, 0).unwrap();
    {
        let mut grant = res.grant_write().unwrap();
        let landing = grant.device_landing(0..pages.len()).unwrap();
        assert_eq!(landing.pages(), pages.len());
        // Decode's pages 0..5 are contiguous, so is the source's 3, 4, 5: three runs.
        assert_eq!(pull(&src, 16, &pages, landing, &mem).unwrap(), 3);
    }
    let before = *mem.digests.lock().unwrap();
    let kv = res.verify(&m).unwrap();
    assert_eq!(
        *mem.digests.lock().unwrap(),
        before,
        "verification used the landed digests"
    );
    assert_eq!(kv.tokens(), u64::from(m.tokens));
    assert!(kv.page(0).is_none(), "device pages have no host slice");
}

#[test]
fn pages_no_landing_digested_are_digested_on_the_device_and_checked() {
    let src = foreign(8);
    let (pool, mem) = device_pool(8, PoolOptions::default());
    let pages = [PageId(6), PageId(1)];
    let m = manifest(2, &pages);
    // Written without a landing: verification digests on the device.
    let mut res = pool.reserve(owner(2), m.tokens, 0).unwrap();
    {
        let mut grant = res.grant_write().unwrap();
        let landing = grant.device_landing(0..2).unwrap();
        let runs = plan::copy_runs(&pages, 8, landing.offsets(), landing.page_bytes()).unwrap();
        mem.copy_runs(&src, &runs);
        // dropped without digest_landed
    }
    let before = *mem.digests.lock().unwrap();
    res.verify(&m).unwrap();
    assert_eq!(*mem.digests.lock().unwrap(), before + 2);
    // The same with one byte changed after the copy fails, and frees the pages.
    let mut res = pool.reserve(owner(3), m.tokens, 0).unwrap();
    let target = res.pages()[1];
    {
        let mut grant = res.grant_write().unwrap();
        let landing = grant.device_landing(0..2).unwrap();
        let runs = plan::copy_runs(&pages, 8, landing.offsets(), landing.page_bytes()).unwrap();
        mem.copy_runs(&src, &runs);
    }
    let at = PoolOffset(u64::from(target.0) * page_len() as u64 + 77);
    let mut b = [0u8; 1];
    mem.read(at, &mut b).unwrap();
    mem.write(at, &[!b[0]]).unwrap();
    let m3 = Manifest {
        owner: owner(3),
        ..m.clone()
    };
    let r = res.verify(&m3);
    assert!(
        matches!(r, Err(VerifyError::Digest { index: 1, .. })),
        "{r:?}"
    );
    assert_eq!(pool.usage().free, 8, "a failed verify frees the pages");
}

#[test]
fn a_landing_written_after_its_digest_is_not_trusted() {
    let src = foreign(4);
    let (pool, mem) = device_pool(4, PoolOptions::default());
    let pages = [PageId(0)];
    let m = manifest(4, &pages);
    let mut res = pool.reserve(owner(4), m.tokens, 0).unwrap();
    let mut grant = res.grant_write().unwrap();
    let landing = grant.device_landing(0..1).unwrap();
    pull(&src, 4, &pages, landing, &mem).unwrap();
    // A second landing over the same pages clears what the first recorded.
    let landing = grant.device_landing(0..1).unwrap();
    let at = PoolOffset(u64::from(res_page(&landing)) * page_len() as u64);
    mem.write(at, &[1, 2, 3]).unwrap();
    drop(landing);
    drop(grant);
    let r = res.verify(&m);
    assert!(matches!(r, Err(VerifyError::Digest { .. })), "{r:?}");
}

fn res_page(landing: &crate::pool::DeviceLanding<'_>) -> u32 {
    u32::try_from(landing.offsets()[0].0 / page_len() as u64).unwrap()
}

#[test]
fn a_device_pull_is_refused_before_any_copy() {
    let src = foreign(4);
    let (pool, mem) = device_pool(8, PoolOptions::default());
    let mut res = pool
        .reserve(owner(5), 2 * geometry().tokens_per_page, 0)
        .unwrap();
    let mut grant = res.grant_write().unwrap();
    let before = mem.bytes.lock().unwrap().clone();
    let landing = grant.device_landing(0..2).unwrap();
    let r = pull(&src, 4, &[PageId(0), PageId(4)], landing, &mem);
    assert!(
        matches!(r, Err(CudaError::Pull(PullError::OutOfRange { .. }))),
        "{r:?}"
    );
    let landing = grant.device_landing(0..2).unwrap();
    let r = pull(&src, 4, &[PageId(0)], landing, &mem);
    assert!(
        matches!(r, Err(CudaError::Pull(PullError::Count { .. }))),
        "{r:?}"
    );
    assert!(*mem.bytes.lock().unwrap() == before, "nothing was copied");
    let r = grant.device_landing(1..3);
    assert!(matches!(r, Err(PoolError::OutOfGrant { .. })), "{r:?}");
}

#[test]
fn a_host_pool_has_no_device_landing() {
    let pool = PagePool::host(c"kvtest-host", geometry(), 2, PoolOptions::default()).unwrap();
    let mut res = pool
        .reserve(owner(6), geometry().tokens_per_page, 0)
        .unwrap();
    let mut grant = res.grant_write().unwrap();
    let r = grant.device_landing(0..1);
    assert!(matches!(r, Err(PoolError::NoDeviceMemory)), "{r:?}");
}

#[test]
fn freed_device_pages_are_poisoned_or_scrubbed_on_the_device() {
    for (poison, scrub) in [
        (PoisonMode::Owner, Scrub::Off),
        (PoisonMode::Off, Scrub::OnFree),
    ] {
        let src = foreign(4);
        let (pool, mem) = device_pool(4, PoolOptions { poison, scrub });
        let pages = [PageId(1), PageId(2)];
        let m = manifest(7, &pages);
        let mut res = pool.reserve(owner(7), m.tokens, 0).unwrap();
        let mine = res.pages().to_vec();
        {
            let mut grant = res.grant_write().unwrap();
            let landing = grant.device_landing(0..2).unwrap();
            pull(&src, 4, &pages, landing, &mem).unwrap();
        }
        res.verify(&m).unwrap().finish();
        let want: Vec<u8> = match poison {
            PoisonMode::Owner => poison_pattern(Some(owner(7)))
                .iter()
                .copied()
                .cycle()
                .take(page_len())
                .collect(),
            PoisonMode::Off => vec![0; page_len()],
        };
        for p in mine {
            let mut got = vec![0u8; page_len()];
            mem.read(PoolOffset(u64::from(p.0) * page_len() as u64), &mut got)
                .unwrap();
            assert!(got == want, "{p} after free with {poison:?}/{scrub:?}");
        }
        assert_eq!(pool.usage().free, 4);
    }
}

#[test]
fn a_device_pool_dropped_mid_pull_drains_until_the_grant_ends() {
    let src = foreign(4);
    let (pool, mem) = device_pool(4, PoolOptions::default());
    let pages = [PageId(0), PageId(1)];
    let mut res = pool
        .reserve(owner(8), 2 * geometry().tokens_per_page, 0)
        .unwrap();
    let mut grant = res.grant_write().unwrap();
    drop(res);
    assert_eq!(pool.usage().draining, 2, "pages wait for the writer");
    let landing = grant.device_landing(0..2).unwrap();
    pull(&src, 4, &pages, landing, &mem).unwrap();
    assert_eq!(pool.usage().free, 2);
    drop(grant);
    assert_eq!(pool.usage().free, 4, "freed once the last writer is gone");
}
