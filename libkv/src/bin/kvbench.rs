//! Benchmarks of the control-path hot spots (run with `--release`):
//!
//! - admission + reservation (both pools, both or neither) and release, decisions per second
//!   on one core, with a window of live requests so the free lists are not trivially hot;
//! - rejection decisions per second (the "can never fit" path);
//! - coverage verification (token count, page count, ownership) of a 32k-token manifest;
//! - page digests (crc32c) in GB/s;
//! - the shared-memory transfer path (decode pulling pages named by a manifest out of the
//!   prefill pool, mapped read-only, into its own reservation), in pages/s and GB/s for
//!   batches of 64 KiB, 1 MiB and 16 MiB, as a ratio to a plain memcpy of the same bytes
//!   measured in the same run, interleaved round by round, over pools larger than the CPU
//!   cache; with and without the digest check that follows every pull.
//!
//! Each figure is the median of several rounds. Nothing here asserts a time: the numbers are
//! printed, and recorded in the README.

use libkv::admission::{self, Limits, RequestSpec};
use libkv::config::{PoisonMode, Scrub};
use libkv::memory::{ForeignPool, HostMemory};
use libkv::pool::{PagePool, PoolOptions};
use libkv::verify::{Manifest, page_digest};
use libkv::{Dtype, Generation, Owner, PageGeometry, RequestId};
use std::collections::VecDeque;
use std::hint::black_box;
use std::io::Write;
use std::os::fd::AsFd;
use std::time::Instant;

const ROUNDS: usize = 7;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn owner(n: u64) -> Owner {
    Owner {
        request: RequestId(n),
        generation: Generation(1),
    }
}

fn main() -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    // Small pages keep the pools cheap to allocate; admission cost does not depend on bytes.
    let g = PageGeometry {
        tokens_per_page: 16,
        layers: 1,
        kv_heads: 1,
        head_dim: 8,
        dtype: Dtype::Bf16,
    };
    let pages = 1 << 17;
    let prefill = PagePool::host(c"bench-p", g, pages, PoolOptions::default())?;
    let decode = PagePool::host(c"bench-d", g, pages, PoolOptions::default())?;
    let limits = Limits {
        geometry: g,
        max_context: 32768,
        max_new_tokens: 4096,
        prefill_pages: pages,
        decode_pages: pages,
    };

    // Admission + reservation + release with 256 requests live.
    let n = 200_000u64;
    let mut rates = Vec::new();
    for _ in 0..ROUNDS {
        let mut window = VecDeque::with_capacity(257);
        let t = Instant::now();
        for i in 0..n {
            let spec = RequestSpec {
                tenant: "bench".into(),
                prompt_tokens: 64 + (i % 256) as u32,
                max_new_tokens: 64,
            };
            let a = admission::admit(spec, &limits, owner(i), &prefill, &decode).expect("fits");
            window.push_back(a);
            if window.len() > 256 {
                drop(window.pop_front());
            }
        }
        drop(window);
        rates.push(n as f64 / t.elapsed().as_secs_f64());
    }
    writeln!(
        out,
        "admission+reservation+release: {:.0} decisions/s (median of {ROUNDS}, one core)",
        median(rates)
    )?;

    let mut rates = Vec::new();
    for _ in 0..ROUNDS {
        let t = Instant::now();
        for i in 0..n {
            let spec = RequestSpec {
                tenant: "bench".into(),
                prompt_tokens: 40_000,
                max_new_tokens: 64,
            };
            black_box(admission::admit(spec, &limits, owner(i), &prefill, &decode).unwrap_err());
        }
        rates.push(n as f64 / t.elapsed().as_secs_f64());
    }
    writeln!(
        out,
        "rejection (prompt over max context): {:.0} decisions/s",
        median(rates)
    )?;

    // Coverage check of a 32k-token manifest (2048 pages of 16 tokens).
    let tokens = 32768u32;
    let mut times = Vec::new();
    for r in 0..ROUNDS * 3 {
        let mut res = decode
            .reserve(owner(1_000_000 + r as u64), tokens, u64::from(tokens))
            .expect("fits");
        let m = Manifest {
            owner: res.owner(),
            tokens,
            pages: res.pages().to_vec(),
            digests: vec![0; res.pages().len()],
        };
        let t = Instant::now();
        res.check_coverage(&m).expect("coverage");
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    writeln!(
        out,
        "coverage check, 32768-token manifest (2048 pages): {:.1} us",
        median(times)
    )?;

    // Digest throughput over pages of a Llama-3-8B-shaped geometry (2 MiB pages).
    let page = vec![0x5Au8; 2 << 20];
    let mut rates = Vec::new();
    for _ in 0..ROUNDS {
        let t = Instant::now();
        for _ in 0..64 {
            black_box(page_digest(black_box(&page)));
        }
        rates.push(64.0 * page.len() as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    writeln!(out, "page digest (crc32c): {:.2} GB/s", median(rates))?;
    transfer(&mut out)?;
    wipe_cost(&mut out)?;
    Ok(())
}

/// CPU pressure since boot ("some" total, microseconds), to flag noisy rounds.
fn cpu_pressure_us() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/pressure/cpu").ok()?;
    let some = text.lines().find(|l| l.starts_with("some"))?;
    some.split_whitespace()
        .find_map(|f| f.strip_prefix("total="))
        .and_then(|v| v.parse().ok())
}

fn transfer(out: &mut impl Write) -> std::io::Result<()> {
    // 64 KiB pages: 16 tokens x 1 layer x 2 (K, V) x 2 heads x 512 dims x bf16.
    let g = PageGeometry {
        tokens_per_page: 16,
        layers: 1,
        kv_heads: 2,
        head_dim: 512,
        dtype: Dtype::Bf16,
    };
    let page = usize::try_from(g.bytes_per_page()).unwrap_or(0);
    let pages: u32 = 4096; // 256 MiB per pool: far larger than the last-level cache
    let pool_bytes = g.bytes_per_page() * u64::from(pages);
    let prefill_mem = HostMemory::new(c"bench-prefill", pool_bytes)?;
    let ro = prefill_mem.read_only_fd()?;
    let source = ForeignPool::map(ro.as_fd(), g.bytes_per_page(), pages)?;
    let decode = PagePool::host(c"bench-decode", g, pages, PoolOptions::default())?;
    // Plain buffers of the same size for the memcpy reference.
    let zero = page_digest(&vec![0u8; page]);
    let src_plain = vec![0xA5u8; usize::try_from(pool_bytes).unwrap_or(0)];
    let mut dst_plain = vec![0u8; src_plain.len()];
    writeln!(
        out,
        "shm transfer vs memcpy (256 MiB pools, {} KiB pages; median of quiet rounds):",
        page / 1024
    )?;
    writeln!(
        out,
        "  batch    pull GB/s  memcpy GB/s  ratio  pull+verify GB/s  ratio  pages/s (pull)"
    )?;
    for batch_bytes in [64usize << 10, 1 << 20, 16 << 20] {
        let n = (batch_bytes / page).max(1);
        let tokens = u32::try_from(n).unwrap_or(1) * g.tokens_per_page;
        let batches = (256usize << 20) / batch_bytes; // one pass over the pools per round
        let (mut pull, mut memcpy, mut verify) = (Vec::new(), Vec::new(), Vec::new());
        let mut cursor = 0u32;
        let mut id = 0u64;
        for _round in 0..7 {
            let p0 = cpu_pressure_us();
            let t0 = Instant::now();
            // memcpy of the same bytes, cycling through the buffers.
            for b in 0..batches {
                let off = b * batch_bytes;
                dst_plain[off..off + batch_bytes]
                    .copy_from_slice(&src_plain[off..off + batch_bytes]);
            }
            black_box(&dst_plain);
            let t_memcpy = t0.elapsed().as_secs_f64();
            // The pull: reserve, grant, copy the manifest's pages, drop the grant. A window
            // of live reservations makes the destination cycle through the whole decode pool
            // as well (freed pages are reused last-freed first).
            let window_len = (usize::try_from(pages).unwrap_or(1) / n)
                .saturating_sub(1)
                .max(1);
            let mut window: VecDeque<libkv::pool::Reservation> = VecDeque::new();
            let t1 = Instant::now();
            for _ in 0..batches {
                id += 1;
                if window.len() >= window_len {
                    drop(window.pop_front());
                }
                let mut res = decode
                    .reserve(owner(id), tokens, u64::from(tokens))
                    .expect("fits");
                let mut grant = res.grant_write().expect("grant");
                for i in 0..n {
                    let src = libkv::PageId((cursor + u32::try_from(i).unwrap_or(0)) % pages);
                    source
                        .copy_page(src, grant.page_mut(i).expect("page"))
                        .expect("in range");
                }
                cursor = (cursor + u32::try_from(n).unwrap_or(0)) % pages;
                drop(grant);
                window.push_back(res);
            }
            let t_pull = t1.elapsed().as_secs_f64();
            window.clear();
            // The pull followed by the digest check (coverage + crc32c of every page).
            let mut verified: VecDeque<libkv::verify::VerifiedKv> = VecDeque::new();
            let t2 = Instant::now();
            for _ in 0..batches {
                id += 1;
                if verified.len() >= window_len {
                    drop(verified.pop_front());
                }
                let mut res = decode
                    .reserve(owner(id), tokens, u64::from(tokens))
                    .expect("fits");
                let mut grant = res.grant_write().expect("grant");
                let mut m = Manifest {
                    owner: owner(id),
                    tokens,
                    pages: Vec::with_capacity(n),
                    digests: Vec::with_capacity(n),
                };
                for i in 0..n {
                    let src = libkv::PageId((cursor + u32::try_from(i).unwrap_or(0)) % pages);
                    let dst = grant.page_mut(i).expect("page");
                    source.copy_page(src, dst).expect("in range");
                    m.pages.push(src);
                    // Prefill computes this digest; the source pages are zeros here, so it
                    // is computed once, outside the timed loop.
                    m.digests.push(zero);
                }
                cursor = (cursor + u32::try_from(n).unwrap_or(0)) % pages;
                drop(grant);
                verified.push_back(res.verify(&m).expect("verifies"));
            }
            let t_verify = t2.elapsed().as_secs_f64();
            verified.clear();
            let wall = t0.elapsed().as_secs_f64();
            let pressure = match (p0, cpu_pressure_us()) {
                (Some(a), Some(b)) => (b.saturating_sub(a)) as f64 / 1e6 / wall,
                _ => 0.0,
            };
            if pressure > 0.3 && pull.len() >= 3 {
                continue; // a noisy round: others were competing for the CPU
            }
            let bytes = (batches * n * page) as f64;
            memcpy.push(bytes / t_memcpy / 1e9);
            pull.push(bytes / t_pull / 1e9);
            verify.push(bytes / t_verify / 1e9);
        }
        let (p, m, v) = (median(pull), median(memcpy), median(verify));
        let pages_s = p * 1e9 / page as f64;
        writeln!(
            out,
            "  {:>6}   {p:>9.2}  {m:>11.2}  {:>5.2}  {v:>16.2}  {:>5.2}  {pages_s:>10.0}",
            human(batch_bytes),
            p / m,
            v / m
        )?;
    }
    Ok(())
}

fn human(b: usize) -> String {
    if b >= 1 << 20 {
        format!("{} MiB", b >> 20)
    } else {
        format!("{} KiB", b >> 10)
    }
}

/// The cost of `scrub = "on-free"` and `poison = "owner"`: reserve and release 1 MiB of pages
/// (16 pages of 64 KiB), cycling through a 256 MiB pool, with each wipe policy.
fn wipe_cost(out: &mut impl Write) -> std::io::Result<()> {
    let g = PageGeometry {
        tokens_per_page: 16,
        layers: 1,
        kv_heads: 2,
        head_dim: 512,
        dtype: Dtype::Bf16,
    };
    let pages = 4096u32;
    let tokens = 16 * g.tokens_per_page;
    writeln!(
        out,
        "page release with wipe policies (1 MiB reservations, 256 MiB pool):"
    )?;
    let mut base = None;
    for (name, poison, scrub) in [
        ("none", PoisonMode::Off, Scrub::Off),
        ("scrub on-free", PoisonMode::Off, Scrub::OnFree),
        ("poison owner", PoisonMode::Owner, Scrub::Off),
    ] {
        let pool = PagePool::host(c"bench-wipe", g, pages, PoolOptions { poison, scrub })?;
        let window_len = usize::try_from(pages / 16).unwrap_or(1) - 1;
        let mut rates = Vec::new();
        let mut id = 0u64;
        for _ in 0..7 {
            let mut window = VecDeque::new();
            let n = 2000u64;
            let t = Instant::now();
            for _ in 0..n {
                id += 1;
                if window.len() >= window_len {
                    drop(window.pop_front());
                }
                window.push_back(
                    pool.reserve(owner(id), tokens, u64::from(tokens))
                        .expect("fits"),
                );
            }
            drop(window);
            rates.push(n as f64 / t.elapsed().as_secs_f64());
        }
        let r = median(rates);
        let b = *base.get_or_insert(r);
        writeln!(
            out,
            "  {name:<14} {r:>9.0} reservations/s ({:.2}x the time of none; {:.2} GB/s wiped)",
            b / r,
            if name == "none" {
                0.0
            } else {
                r * f64::from(16 * 64 * 1024) / 1e9
            }
        )?;
    }
    Ok(())
}
