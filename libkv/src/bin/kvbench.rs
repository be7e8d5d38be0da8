//! Benchmarks of the control-path hot spots (run with `--release`):
//!
//! - admission + reservation (both pools, both or neither) and release, decisions per second
//!   on one core, with a window of live requests so the free lists are not trivially hot;
//! - rejection decisions per second (the "can never fit" path);
//! - coverage verification (token count, page count, ownership) of a 32k-token manifest;
//! - page digests (crc32c) in GB/s.
//!
//! Each figure is the median of several rounds. Nothing here asserts a time: the numbers are
//! printed, and recorded in the README.

use libkv::admission::{self, Limits, RequestSpec};
use libkv::pool::{PagePool, PoolOptions};
use libkv::verify::{Manifest, page_digest};
use libkv::{Dtype, Generation, Owner, PageGeometry, RequestId};
use std::collections::VecDeque;
use std::hint::black_box;
use std::io::Write;
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
    Ok(())
}
