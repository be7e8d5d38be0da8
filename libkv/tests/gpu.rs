//! GPU tests of the CUDA pools: allocation, the read-only mapping decode pulls from, the
//! pull into a device pool and its verification, the GPU digest against the host's, wipes
//! on free and the dmabuf export.
//!
//! They select their device from `KVFENCE_GPU` (a CUDA ordinal, e.g. `KVFENCE_GPU=0`) and
//! pass with a "SKIPPED" line when it is unset; `tests/gpu/run.sh` runs them on a GPU host,
//! one test per process (a CUDA fault poisons the whole context). The test of a host
//! without a driver runs everywhere.

#![allow(clippy::print_stdout)]

use libkv::config::{PoisonMode, Scrub};
use libkv::geometry::{Dtype, PageGeometry};
use libkv::ids::{Generation, Owner, PageId, PoolOffset, RequestId};
use libkv::memory::cuda::{CudaDevice, CudaError, CudaForeignPool, CudaMemory, driver_present};
use libkv::memory::{DeviceMemory, PoolMemory, plan};
use libkv::pool::{PagePool, PoolOptions, poison_pattern};
use libkv::verify::{Manifest, VerifyError, page_digest};
use std::os::fd::AsRawFd;
use std::sync::Arc;

/// The device under test, or `None` (after saying so) when none is configured.
fn device_under_test() -> Option<Arc<CudaDevice>> {
    let Ok(ordinal) = std::env::var("KVFENCE_GPU") else {
        println!("SKIPPED: no GPU under test (set KVFENCE_GPU to a CUDA device ordinal)");
        return None;
    };
    let ordinal: u32 = ordinal.parse().expect("KVFENCE_GPU is a device ordinal");
    let dev = CudaDevice::open(ordinal).unwrap_or_else(|e| panic!("{}", libkv::error_chain(&e)));
    println!("device {:?}", dev.info());
    Some(dev)
}

/// 64 KiB pages (16 tokens, 4 layers, 4 heads of 128 bf16).
fn geometry() -> PageGeometry {
    PageGeometry {
        tokens_per_page: 16,
        layers: 4,
        kv_heads: 4,
        head_dim: 128,
        dtype: Dtype::Bf16,
    }
}

fn page_len() -> usize {
    usize::try_from(geometry().bytes_per_page()).unwrap()
}

fn owner(r: u64) -> Owner {
    Owner {
        request: RequestId(r),
        generation: Generation(1),
    }
}

/// Distinct bytes for page `p` of a source pool.
fn page_of(p: u32) -> Vec<u8> {
    (0..page_len())
        .map(|i| {
            u32::try_from(i)
                .unwrap()
                .wrapping_mul(2_654_435_761)
                .wrapping_add(p.wrapping_mul(40_503))
                .to_le_bytes()[3]
        })
        .collect()
}

/// A prefill pool of `pages` pages on `dev`, page `p` holding `page_of(p)`.
fn prefill(dev: &Arc<CudaDevice>, pages: u32) -> CudaMemory {
    let mem = CudaMemory::new(dev, geometry().bytes_per_page() * u64::from(pages)).unwrap();
    for p in 0..pages {
        mem.write(PoolOffset(u64::from(p) * page_len() as u64), &page_of(p))
            .unwrap();
    }
    mem
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
fn a_host_without_a_driver_is_refused_by_name() {
    if driver_present() {
        println!("SKIPPED: this host has a CUDA driver");
        return;
    }
    let err = CudaDevice::open(0).unwrap_err();
    assert!(matches!(err, CudaError::NoDriver), "{err:?}");
    assert!(err.to_string().contains("libcuda.so.1"), "{err}");
}

#[test]
fn gpu_digest_equals_the_host_digest() {
    let Some(dev) = device_under_test() else {
        return;
    };
    // Page sizes that are not multiples of the threads or of 8, and one offset by a byte.
    for page_bytes in [1u64, 7, 4096, 65_536, 65_543, 2 << 20] {
        let pages = 5u32;
        let len = page_bytes * u64::from(pages) + 1;
        let mem = CudaMemory::new(&dev, len).unwrap();
        let bytes: Vec<u8> = (0..len)
            .map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56).to_le_bytes()[0])
            .collect();
        mem.write(PoolOffset(0), &bytes).unwrap();
        for shift in [0u64, 1] {
            let offsets: Vec<PoolOffset> = (0..u64::from(pages))
                .map(|p| PoolOffset(p * page_bytes + shift))
                .collect();
            let got = mem.digest_pages(&offsets, page_bytes).unwrap();
            for (o, d) in offsets.iter().zip(got) {
                let at = usize::try_from(o.0).unwrap();
                let end = at + usize::try_from(page_bytes).unwrap();
                assert_eq!(
                    d,
                    page_digest(&bytes[at..end]),
                    "{page_bytes} bytes at {}",
                    o.0
                );
            }
        }
        let r = mem.digest_pages(&[PoolOffset(len - page_bytes + 1)], page_bytes);
        assert!(matches!(r, Err(CudaError::OutOfRange { .. })), "{r:?}");
    }
}

#[test]
fn a_new_device_pool_is_zeroed_and_has_no_host_mapping() {
    let Some(dev) = device_under_test() else {
        return;
    };
    let mem = CudaMemory::new(&dev, 8 << 20).unwrap();
    assert!(mem.host_ptr().is_none() && mem.share_fd().is_none());
    assert_eq!(mem.backend(), "cuda");
    let mut back = vec![0xffu8; 8 << 20];
    mem.read(PoolOffset(0), &mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == 0),
        "fresh device memory is zeroed"
    );
    let r = mem.write(PoolOffset((8 << 20) - 1), &[1, 2]);
    assert!(matches!(r, Err(CudaError::OutOfRange { .. })), "{r:?}");
}

#[test]
fn decode_maps_prefill_read_only_and_pulls_verified_pages() {
    let Some(dev) = device_under_test() else {
        return;
    };
    let src = prefill(&dev, 32);
    let foreign = CudaForeignPool::import(&dev, src.export_fd(), page_len() as u64, 32).unwrap();
    assert_eq!(
        foreign.access_flags().unwrap(),
        1,
        "the mapping is CU_MEM_ACCESS_FLAGS_PROT_READ"
    );
    let decode = PagePool::new(
        geometry(),
        32,
        Box::new(CudaMemory::new(&dev, geometry().bytes_per_page() * 32).unwrap()),
        PoolOptions::default(),
    )
    .unwrap();
    // Contiguous, scattered and reversed source pages.
    let sets: [Vec<u32>; 3] = [
        (4..12).collect(),
        vec![30, 1, 17, 2, 3, 9],
        (0..16).rev().collect(),
    ];
    for (id, set) in sets.iter().enumerate() {
        let pages: Vec<PageId> = set.iter().copied().map(PageId).collect();
        let m = manifest(id as u64 + 1, &pages);
        let mut res = decode.reserve(m.owner, m.tokens, 0).unwrap();
        {
            let mut grant = res.grant_write().unwrap();
            let landing = grant.device_landing(0..pages.len()).unwrap();
            foreign.pull(&pages, landing).unwrap();
        }
        let kv = res.verify(&m).unwrap_or_else(|e| panic!("set {id}: {e}"));
        kv.finish();
    }
    // A manifest that lies about one page fails, and frees the pages.
    let pages = vec![PageId(5), PageId(6)];
    let mut m = manifest(9, &pages);
    m.digests[1] ^= 1;
    let mut res = decode.reserve(m.owner, m.tokens, 0).unwrap();
    {
        let mut grant = res.grant_write().unwrap();
        let landing = grant.device_landing(0..2).unwrap();
        foreign.pull(&pages, landing).unwrap();
    }
    let r = res.verify(&m);
    assert!(
        matches!(r, Err(VerifyError::Digest { index: 1, .. })),
        "{r:?}"
    );
    assert_eq!(decode.usage().free, 32);
    // Out of range: refused before any copy.
    let mut res = decode
        .reserve(owner(10), geometry().tokens_per_page, 0)
        .unwrap();
    let mut grant = res.grant_write().unwrap();
    let landing = grant.device_landing(0..1).unwrap();
    let r = foreign.pull(&[PageId(32)], landing);
    assert!(matches!(r, Err(CudaError::Pull(_))), "{r:?}");
}

#[test]
fn another_process_maps_the_pool_from_its_fd() {
    let Some(dev) = device_under_test() else {
        return;
    };
    if let Ok(fd) = std::env::var("KVFENCE_GPU_CHILD_FD") {
        // The child: import the parent's pool through the inherited fd and check it.
        let fd: i32 = fd.parse().unwrap();
        // SAFETY: the parent passed this fd to us open, and nothing else in this process
        // uses it.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let foreign = CudaForeignPool::import(&dev, fd, page_len() as u64, 8).unwrap();
        assert_eq!(foreign.access_flags().unwrap(), 1);
        let dst = CudaMemory::new(&dev, geometry().bytes_per_page() * 8).unwrap();
        let pool = PagePool::new(geometry(), 8, Box::new(dst), PoolOptions::default()).unwrap();
        let pages: Vec<PageId> = (0..8).rev().map(PageId).collect();
        let m = manifest(1, &pages);
        let mut res = pool.reserve(m.owner, m.tokens, 0).unwrap();
        {
            let mut grant = res.grant_write().unwrap();
            let landing = grant.device_landing(0..8).unwrap();
            foreign.pull(&pages, landing).unwrap();
        }
        res.verify(&m).unwrap();
        println!("child pulled and verified 8 pages");
        return;
    }
    let src = prefill(&dev, 8);
    // An inheritable duplicate for the child (dup clears close-on-exec).
    let dup = nix::unistd::dup(src.export_fd()).unwrap();
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([
            "--exact",
            "another_process_maps_the_pool_from_its_fd",
            "--nocapture",
        ])
        .env("KVFENCE_GPU_CHILD_FD", dup.as_raw_fd().to_string())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("child pulled and verified 8 pages"), "{text}");
}

#[test]
fn freed_device_pages_are_poisoned_and_scrubbed() {
    let Some(dev) = device_under_test() else {
        return;
    };
    for (poison, scrub) in [
        (PoisonMode::Owner, Scrub::Off),
        (PoisonMode::Off, Scrub::OnFree),
    ] {
        let mem = CudaMemory::new(&dev, geometry().bytes_per_page() * 4).unwrap();
        let pool =
            PagePool::new(geometry(), 4, Box::new(mem), PoolOptions { poison, scrub }).unwrap();
        let src = prefill(&dev, 4);
        let foreign = CudaForeignPool::import(&dev, src.export_fd(), page_len() as u64, 4).unwrap();
        let pages = vec![PageId(2), PageId(3)];
        let m = manifest(1, &pages);
        let mut res = pool.reserve(m.owner, m.tokens, 0).unwrap();
        let mine = res.pages().to_vec();
        {
            let mut grant = res.grant_write().unwrap();
            let landing = grant.device_landing(0..2).unwrap();
            foreign.pull(&pages, landing).unwrap();
        }
        res.verify(&m).unwrap().finish();
        let want: Vec<u8> = match poison {
            PoisonMode::Owner => poison_pattern(Some(owner(1)))
                .iter()
                .copied()
                .cycle()
                .take(page_len())
                .collect(),
            PoisonMode::Off => vec![0; page_len()],
        };
        let device = pool.memory().device().unwrap();
        for p in mine {
            let mut got = vec![0u8; page_len()];
            device
                .read(PoolOffset(u64::from(p.0) * page_len() as u64), &mut got)
                .unwrap();
            assert!(got == want, "{p} after free with {poison:?}/{scrub:?}");
        }
    }
}

#[test]
fn the_pool_exports_a_dmabuf_for_gpudirect() {
    let Some(dev) = device_under_test() else {
        return;
    };
    let mem = CudaMemory::new(&dev, 4 << 20).unwrap();
    match mem.dmabuf_fd() {
        Ok(fd) => {
            assert!(fd.as_raw_fd() >= 0);
            println!("dmabuf fd exported ({} bytes)", PoolMemory::len(&mem));
        }
        Err(CudaError::Unsupported { what, .. }) => {
            println!("SKIPPED: device without dmabuf export: {what}");
        }
        Err(e) => panic!("{}", libkv::error_chain(&e)),
    }
}

#[test]
fn the_kernel_and_its_host_model_agree_on_segments() {
    // Runs everywhere: the arithmetic the kernel does, on the host.
    for len in [1usize, 255, 2048, 65_536, 65_543] {
        let bytes: Vec<u8> = (0..len).map(|i| (i * 13 + 7).to_le_bytes()[0]).collect();
        assert_eq!(plan::segmented_digest(&bytes), page_digest(&bytes));
    }
}
