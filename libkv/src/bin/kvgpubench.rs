//! GPU pull benchmark: a pull from a read-only mapped prefill pool into a decode pool on the
//! same GPU (one `cuMemcpyDtoDAsync` per run of contiguous pages, then the GPU digest of
//! what landed) against one plain `cuMemcpyDtoD` of the same bytes, and the digest's cost
//! alone, on the device and on the host.
//!
//! `kvgpubench [--device N] [--pages N] [--page-kib N] [--iters N]`; prints one line per
//! figure. `tests/gpu/run.sh` runs it after the GPU tests.

#![allow(clippy::print_stdout)]

use libkv::geometry::{Dtype, PageGeometry};
use libkv::ids::{Generation, Owner, PageId, PoolOffset, RequestId};
use libkv::memory::DeviceMemory;
use libkv::memory::cuda::{CudaDevice, CudaForeignPool, CudaMemory};
use libkv::pool::{PagePool, PoolOptions};
use libkv::verify::{Manifest, page_digest};
use std::process::ExitCode;
use std::time::{Duration, Instant};

struct Args {
    device: u32,
    pages: u32,
    page_kib: u32,
    iters: usize,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        device: 0,
        pages: 2048,
        page_kib: 256,
        iters: 20,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || -> Result<u64, String> {
            it.next()
                .ok_or(format!("{flag} needs a value"))?
                .parse()
                .map_err(|e| format!("{flag}: {e}"))
        };
        let small = |v: u64| u32::try_from(v).map_err(|_| format!("{flag}: too large"));
        match flag.as_str() {
            "--device" => a.device = small(value()?)?,
            "--pages" => a.pages = small(value()?)?,
            "--page-kib" => a.page_kib = small(value()?)?,
            "--iters" => a.iters = usize::try_from(value()?).map_err(|e| e.to_string())?,
            "-h" | "--help" => {
                return Err(
                    "usage: kvgpubench [--device N] [--pages N] [--page-kib N] [--iters N]"
                        .to_owned(),
                );
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.pages == 0 || a.page_kib == 0 || a.iters == 0 {
        return Err("--pages, --page-kib and --iters must be at least 1".to_owned());
    }
    Ok(a)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn run(a: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let dev = CudaDevice::open(a.device)?;
    let info = dev.info();
    println!(
        "device {} ({}, {} MiB), {} pages of {} KiB, median of {}",
        info.ordinal,
        info.name,
        info.total_bytes >> 20,
        a.pages,
        a.page_kib,
        a.iters
    );
    // A geometry whose page is page_kib KiB: 16 tokens x 8 heads x 128 bf16 x K,V = 64 KiB
    // per layer.
    let layers = (a.page_kib / 64).max(1);
    let geometry = PageGeometry {
        tokens_per_page: 16,
        layers,
        kv_heads: 8,
        head_dim: 128,
        dtype: Dtype::Bf16,
    };
    let page_bytes = geometry.bytes_per_page();
    let total = page_bytes * u64::from(a.pages);
    let src = CudaMemory::new(&dev, total)?;
    let page_len = usize::try_from(page_bytes)?;
    let mut host_page = vec![0u8; page_len];
    let mut digests = Vec::with_capacity(a.pages as usize);
    for p in 0..a.pages {
        for (i, b) in host_page.iter_mut().enumerate() {
            *b = (i as u64 ^ u64::from(p).wrapping_mul(0x9e37_79b9)).to_le_bytes()[0];
        }
        digests.push(page_digest(&host_page));
        src.write(PoolOffset(u64::from(p) * page_bytes), &host_page)?;
    }
    let foreign = CudaForeignPool::import(&dev, src.export_fd(), page_bytes, a.pages)?;
    let decode = PagePool::new(
        geometry,
        a.pages,
        Box::new(CudaMemory::new(&dev, total)?),
        PoolOptions::default(),
    )?;
    let orders: [(&str, Vec<PageId>); 2] = [
        ("contiguous", (0..a.pages).map(PageId).collect()),
        ("scattered", (0..a.pages).rev().map(PageId).collect()),
    ];
    for (name, pages) in &orders {
        let m_digests: Vec<u32> = pages.iter().map(|p| digests[p.0 as usize]).collect();
        let mut times = Vec::with_capacity(a.iters);
        for i in 0..a.iters {
            let owner = Owner {
                request: RequestId(i as u64 + 1),
                generation: Generation(1),
            };
            let tokens = a.pages * geometry.tokens_per_page;
            let mut res = decode.reserve(owner, tokens, 0)?;
            let started = Instant::now();
            {
                let mut grant = res.grant_write()?;
                let landing = grant.device_landing(0..pages.len())?;
                foreign.pull(pages, landing)?;
            }
            let m = Manifest {
                owner,
                tokens,
                pages: pages.clone(),
                digests: m_digests.clone(),
            };
            res.verify(&m)?.finish();
            times.push(started.elapsed());
        }
        let t = median(times);
        println!(
            "pull {name:<10} (copy + GPU digest + verify): {:>9.1} us  {:>7.1} GB/s",
            t.as_secs_f64() * 1e6,
            gbps(total, t)
        );
    }
    let dst = decode
        .memory()
        .device()
        .ok_or("decode pool is not on the device")?;
    let mut times = Vec::with_capacity(a.iters);
    for _ in 0..a.iters {
        let started = Instant::now();
        foreign.copy_plain(dst, total)?;
        times.push(started.elapsed());
    }
    let plain = median(times);
    println!(
        "cuMemcpyDtoD, one copy of the same bytes:    {:>9.1} us  {:>7.1} GB/s",
        plain.as_secs_f64() * 1e6,
        gbps(total, plain)
    );
    let offsets: Vec<PoolOffset> = (0..u64::from(a.pages))
        .map(|p| PoolOffset(p * page_bytes))
        .collect();
    let mut times = Vec::with_capacity(a.iters);
    for _ in 0..a.iters {
        let started = Instant::now();
        let got = dst.digest_pages(&offsets, page_bytes)?;
        times.push(started.elapsed());
        if got.len() != offsets.len() {
            return Err("the digest kernel returned the wrong count".into());
        }
    }
    let gpu = median(times);
    println!(
        "GPU digest of every page (crc32c):           {:>9.1} us  {:>7.1} GB/s",
        gpu.as_secs_f64() * 1e6,
        gbps(total, gpu)
    );
    let sample = usize::try_from(u64::from(a.pages.min(64)) * page_bytes)?;
    let mut buf = vec![0u8; sample];
    dst.read(PoolOffset(0), &mut buf)?;
    let started = Instant::now();
    let mut acc = 0u32;
    for page in buf.chunks(page_len) {
        acc ^= page_digest(page);
    }
    let host = started.elapsed();
    println!(
        "host digest (one core, {} pages):            {:>9.1} us  {:>7.1} GB/s  (xor {acc:08x})",
        sample / page_len,
        host.as_secs_f64() * 1e6,
        gbps(sample as u64, host)
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("kvgpubench: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvgpubench: {}", libkv::error_chain(&*e));
            ExitCode::from(1)
        }
    }
}
