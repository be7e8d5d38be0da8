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
use libkv::memory::{ForeignPool, HostMemory, PoolMemory};
use libkv::pool::{PagePool, PoolOptions};
use libkv::verify::{Manifest, VerifiedKv, page_digest};
use libkv::{Dtype, Generation, Owner, PageGeometry, RequestId};
use std::collections::VecDeque;
use std::hint::black_box;
use std::io::Write;
use std::os::fd::AsFd;
use std::time::Instant;

const ROUNDS: usize = 7;
/// Rounds of the transfer figures (each pass of a round sweeps 256 MiB).
const TRANSFER_ROUNDS: usize = 11;
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

/// `kvbench [control] [transfer] [wipe] [--svg PATH]`: the sections named, or all of them;
/// `--svg` also draws the transfer table's ratios as a chart.
fn main() -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let svg = match args.iter().position(|a| a == "--svg") {
        Some(i) if i + 1 < args.len() => {
            let path = std::path::PathBuf::from(args.remove(i + 1));
            args.remove(i);
            Some(path)
        }
        Some(_) => {
            eprintln!("kvbench: --svg needs a path");
            std::process::exit(2);
        }
        None => None,
    };
    let wanted = |name: &str| args.is_empty() || args.iter().any(|a| a == name);
    if let Some(a) = args
        .iter()
        .find(|a| !["control", "transfer", "wipe"].contains(&a.as_str()))
    {
        eprintln!("kvbench: unknown section {a} (control, transfer, wipe)");
        std::process::exit(2);
    }
    if wanted("control") {
        control(&mut out)?;
    }
    if wanted("transfer") {
        let ratios = transfer(&mut out)?;
        if let Some(path) = &svg {
            transfer_chart(&ratios)
                .write_svg(path)
                .map_err(std::io::Error::other)?;
        }
    }
    if wanted("wipe") {
        wipe_cost(&mut out)?;
    }
    Ok(())
}

/// Admission, rejection, coverage and digest figures.
fn control(out: &mut impl Write) -> std::io::Result<()> {
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

/// CPU pressure since boot ("some" total, microseconds), to flag noisy rounds.
fn cpu_pressure_us() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/pressure/cpu").ok()?;
    let some = text.lines().find(|l| l.starts_with("some"))?;
    some.split_whitespace()
        .find_map(|f| f.strip_prefix("total="))
        .and_then(|v| v.parse().ok())
}

/// One batch of the shared-memory pull: which source page goes to which decode page.
type Batch = Vec<(libkv::PageId, libkv::PageId)>;

/// What each measured pass does with the same batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pass {
    /// memcpy of the same pages between the same two mappings (no pool, no digest).
    Memcpy(usize),
    /// The same copy with the fused pull's stores (streaming, 32 bytes at a time) and no
    /// digest: what the pull + verify would cost if its digest were free.
    StreamCopy(usize),
    /// The pull without a digest: reserve, grant, copy each page, drop the grant.
    Pull,
    /// The pull as decoded does it: reserve, grant, copy and digest fused, verify.
    PullVerify(usize),
    /// The pull as it was before the fused path: copy every page, then verify (a second
    /// pass that digests every page).
    CopyThenVerify,
    /// memcpy between two heap buffers, one call per batch (the baseline of earlier runs).
    HeapMemcpy,
    /// The memcpy again, as a pass of its own: its ratio to the memcpy before it shows how
    /// far two identical passes differ here (the floor under every other ratio).
    Control(usize),
}

impl Pass {
    fn threads(self) -> usize {
        match self {
            Pass::Memcpy(t) | Pass::StreamCopy(t) | Pass::PullVerify(t) | Pass::Control(t) => t,
            _ => 1,
        }
    }
}

struct Rig {
    g: PageGeometry,
    page: usize,
    pages: u32,
    source: ForeignPool,
    decode: PagePool,
    /// A second mapping of the decode pool's memory, for the memcpy baseline.
    decode_map: memmap2::MmapMut,
    /// Digest of each source page (what prefill puts in the manifest).
    digests: Vec<u32>,
    heap_src: Vec<u8>,
    heap_dst: Vec<u8>,
    next_id: u64,
}

impl Rig {
    /// Runs `pass` over one pass of the pools (`batches` of `n` pages) and returns the
    /// bytes per second and, for the pulls, the batches as they were laid out.
    fn run(&mut self, pass: Pass, n: usize, last: &[Batch]) -> (f64, Vec<Batch>) {
        let tokens = u32::try_from(n).unwrap_or(1) * self.g.tokens_per_page;
        let batches = usize::try_from(self.pages).unwrap_or(1) / n;
        // A window of live reservations makes the destination cycle through the whole
        // decode pool (freed pages are reused last-freed first).
        let window_len = batches.saturating_sub(1).max(1);
        let mut laid = Vec::with_capacity(batches);
        let bytes = (batches * n * self.page) as f64;
        let t = Instant::now();
        match pass {
            Pass::Memcpy(threads) | Pass::Control(threads) | Pass::StreamCopy(threads) => {
                let page = self.page;
                let map = &mut self.decode_map[..];
                let source = &self.source;
                let stream = matches!(pass, Pass::StreamCopy(_));
                for b in last {
                    copy_batch(source, map, page, b, threads, stream);
                }
                black_box(&self.decode_map);
            }
            Pass::HeapMemcpy => {
                let batch = n * self.page;
                for b in 0..batches {
                    let off = b * batch;
                    self.heap_dst[off..off + batch]
                        .copy_from_slice(&self.heap_src[off..off + batch]);
                }
                black_box(&self.heap_dst);
            }
            Pass::Pull | Pass::PullVerify(_) | Pass::CopyThenVerify => {
                let mut window: VecDeque<Result<libkv::pool::Reservation, VerifiedKv>> =
                    VecDeque::new();
                let mut cursor = 0u32;
                for _ in 0..batches {
                    self.next_id += 1;
                    let id = self.next_id;
                    if window.len() >= window_len {
                        drop(window.pop_front());
                    }
                    let mut res = self
                        .decode
                        .reserve(owner(id), tokens, u64::from(tokens))
                        .expect("fits");
                    let src: Vec<libkv::PageId> = (0..n)
                        .map(|i| {
                            libkv::PageId((cursor + u32::try_from(i).unwrap_or(0)) % self.pages)
                        })
                        .collect();
                    cursor = (cursor + u32::try_from(n).unwrap_or(0)) % self.pages;
                    laid.push(
                        src.iter()
                            .copied()
                            .zip(res.pages().iter().copied())
                            .collect(),
                    );
                    let mut grant = res.grant_write().expect("grant");
                    match pass {
                        Pass::PullVerify(threads) => {
                            let landing = grant.landing(0..n).expect("landing");
                            self.source
                                .pull(&src, landing, threads, &|| true)
                                .expect("pull");
                        }
                        _ => {
                            for (i, &p) in src.iter().enumerate() {
                                self.source
                                    .copy_page(p, grant.page_mut(i).expect("page"))
                                    .expect("in range");
                            }
                        }
                    }
                    drop(grant);
                    if pass == Pass::Pull {
                        window.push_back(Ok(res));
                        continue;
                    }
                    let m = Manifest {
                        owner: owner(id),
                        tokens,
                        digests: src.iter().map(|p| self.digests[p.index()]).collect(),
                        pages: src,
                    };
                    window.push_back(Err(res.verify(&m).expect("verifies")));
                }
                window.clear();
            }
        }
        (bytes / t.elapsed().as_secs_f64(), laid)
    }
}

/// memcpy (or, with `stream`, [`stream_copy`]) of one batch's pages from the source mapping
/// into the decode pool's memory (its second mapping), on `threads` threads, each taking a
/// run of the pages.
fn copy_batch(
    source: &ForeignPool,
    map: &mut [u8],
    page: usize,
    b: &Batch,
    threads: usize,
    stream: bool,
) {
    let copy = |s: libkv::PageId, d: &mut [u8]| {
        if stream {
            let from = source.source(s, 0, d.len()).expect("in range");
            stream_copy(d, from);
        } else {
            source.copy_page(s, d).expect("in range");
        }
    };
    // The batch's destination pages as disjoint slices, then back in the batch's order, so
    // that the copies run in the pull's order and the threads take the pull's runs.
    let mut want: Vec<(usize, libkv::PageId, usize)> = b
        .iter()
        .enumerate()
        .map(|(k, &(s, d))| (d.index(), s, k))
        .collect();
    want.sort_unstable_by_key(|&(d, _, _)| d);
    let mut dst: Vec<(usize, libkv::PageId, &mut [u8])> = Vec::with_capacity(b.len());
    let mut rest = map;
    let mut base = 0usize;
    for (d, s, k) in want {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(d * page - base);
        let (this, tail) = tail.split_at_mut(page);
        dst.push((k, s, this));
        rest = tail;
        base = (d + 1) * page;
    }
    dst.sort_unstable_by_key(|&(k, _, _)| k);
    let per = dst.len().div_ceil(threads.max(1));
    std::thread::scope(|scope| {
        let mut chunks = dst.chunks_mut(per.max(1));
        let mine = chunks.next();
        for chunk in chunks {
            scope.spawn(move || {
                for (_, s, d) in chunk.iter_mut() {
                    copy(*s, d);
                }
            });
        }
        for (_, s, d) in mine.into_iter().flatten() {
            copy(*s, d);
        }
    });
}

/// Copies `from` into `dst` (the same length) with 32-byte streaming stores, as the fused
/// pull stores (see `libkv::sys::digest`), but folds nothing; a plain copy where the CPU has
/// no AVX2 or `dst` is not aligned to 32.
fn stream_copy(dst: &mut [u8], from: libkv::pool::Source<'_>) {
    assert_eq!(dst.len(), from.len());
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && dst.as_ptr().addr().is_multiple_of(32) {
        // SAFETY: the CPU has AVX2 (checked just above), `from` is readable for its length,
        // `dst.len()`, and is another mapping than `dst`; `dst` is aligned to 32.
        unsafe { stream_copy_avx2(dst, from.ptr()) };
        return;
    }
    // SAFETY: as above: readable for `dst.len()` bytes, not overlapping `dst`.
    unsafe { std::ptr::copy_nonoverlapping(from.ptr(), dst.as_mut_ptr(), dst.len()) };
}

/// # Safety
/// The CPU must have AVX2; `src` must be readable for `dst.len()` bytes and not overlap
/// `dst`, which must be aligned to 32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_copy_avx2(dst: &mut [u8], src: *const u8) {
    use std::arch::x86_64::{__m256i, _mm_sfence, _mm256_loadu_si256, _mm256_stream_si256};
    let whole = dst.len() / 32 * 32;
    let d = dst.as_mut_ptr();
    for at in (0..whole).step_by(32) {
        // SAFETY: `at + 32 <= dst.len()`: inside both (the caller's contract); the load is
        // unaligned, the store aligned to 32 (`dst` is, and `at` is a multiple of 32).
        unsafe {
            let v = _mm256_loadu_si256(src.add(at).cast::<__m256i>());
            _mm256_stream_si256(d.add(at).cast::<__m256i>(), v);
        }
    }
    _mm_sfence();
    // SAFETY: the rest of both, as above.
    unsafe { std::ptr::copy_nonoverlapping(src.add(whole), d.add(whole), dst.len() - whole) };
}

fn transfer(out: &mut impl Write) -> std::io::Result<Vec<Ratios>> {
    let mut measured = Vec::new();
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
    // Every source page different, so that a page landing in the wrong place would fail.
    {
        let mut w = libkv::sys::memfd::map_rw(prefill_mem.share_fd().expect("memfd"), pool_bytes)?;
        for (i, p) in w.chunks_mut(page).enumerate() {
            p.fill(u8::try_from(i % 251).unwrap_or(0));
            p[..8].copy_from_slice(&(i as u64).to_le_bytes());
        }
    }
    let ro = prefill_mem.read_only_fd()?;
    let source = ForeignPool::map(ro.as_fd(), g.bytes_per_page(), pages)?;
    let decode = PagePool::host(c"bench-decode", g, pages, PoolOptions::default())?;
    let decode_map =
        libkv::sys::memfd::map_rw(decode.memory().share_fd().expect("host pool"), pool_bytes)?;
    let mut buf = vec![0u8; page];
    let digests = (0..pages)
        .map(|p| {
            source
                .copy_page(libkv::PageId(p), &mut buf)
                .expect("in range");
            page_digest(&buf)
        })
        .collect();
    let heap_src = vec![0xA5u8; usize::try_from(pool_bytes).unwrap_or(0)];
    let mut heap_dst = vec![0u8; heap_src.len()];
    heap_dst.fill(1); // fault it in now
    let mut rig = Rig {
        g,
        page,
        pages,
        source,
        decode,
        decode_map,
        digests,
        heap_src,
        heap_dst,
        next_id: 0,
    };
    writeln!(
        out,
        "shm pull vs memcpy of the same pages between the same mappings (256 MiB pools, {} KiB \
         pages, {TRANSFER_ROUNDS} rounds, every pass one sweep of the pools, passes interleaved and \
         rotated; GB/s median, ratios to the memcpy just before, median [min-max] of quiet \
         rounds):",
        page / 1024
    )?;
    writeln!(
        out,
        "  batch   thr  memcpy  memcpy again     pull   /memcpy          pull+verify      \
         /memcpy          copy,then-verify streaming copy   pull+verify/stream heap memcpy/batch"
    )?;
    const BATCHES: [usize; 3] = [64 << 10, 1 << 20, 16 << 20];
    // Rounds of every (batch, threads) case: batches of more than one page on 1 and 2.
    let cases: usize = BATCHES
        .iter()
        .map(|b| if b / page > 1 { 2 } else { 1 })
        .sum();
    let progress = libkv::progress::bar((cases * TRANSFER_ROUNDS) as u64, "rounds");
    for batch_bytes in BATCHES {
        let n = (batch_bytes / page).max(1);
        let thread_counts: &[usize] = if n > 1 { &[1, 2] } else { &[1] };
        for &threads in thread_counts {
            let mut passes = vec![
                Pass::Control(threads),
                Pass::StreamCopy(threads),
                Pass::PullVerify(threads),
            ];
            if threads == 1 {
                passes.extend([Pass::Pull, Pass::CopyThenVerify, Pass::HeapMemcpy]);
            }
            // Lay the batches out once, untimed, so the first memcpy has them.
            let (_, mut last) = rig.run(Pass::Pull, n, &[]);
            let mut rates: Vec<Vec<f64>> = vec![Vec::new(); passes.len()];
            let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); passes.len()];
            let mut memcpy = Vec::new();
            for round in 0..TRANSFER_ROUNDS {
                progress.inc(1);
                let p0 = cpu_pressure_us();
                let t0 = Instant::now();
                let mut this = vec![0.0; passes.len()];
                let mut base = vec![0.0; passes.len()];
                // Rotate the order, and measure a memcpy right before every other pass.
                for k in 0..passes.len() {
                    let i = (k + round) % passes.len();
                    let (m, _) = rig.run(Pass::Memcpy(passes[i].threads()), n, &last);
                    let (r, laid) = rig.run(passes[i], n, &last);
                    if !laid.is_empty() {
                        last = laid;
                    }
                    this[i] = r;
                    base[i] = m;
                }
                let wall = t0.elapsed().as_secs_f64();
                let pressure = match (p0, cpu_pressure_us()) {
                    (Some(a), Some(b)) => (b.saturating_sub(a)) as f64 / 1e6 / wall,
                    _ => 0.0,
                };
                if pressure > 0.3 && round + 3 < TRANSFER_ROUNDS {
                    continue; // a noisy round: others were competing for the CPU
                }
                for i in 0..passes.len() {
                    rates[i].push(this[i]);
                    ratios[i].push(this[i] / base[i]);
                }
                memcpy.extend(&base);
            }
            let show = |p: Pass| -> (f64, String) {
                match passes.iter().position(|&q| q == p) {
                    Some(i) if !rates[i].is_empty() => {
                        let (lo, hi) = range(&ratios[i]);
                        (
                            median(rates[i].clone()) / 1e9,
                            format!("{:.2} [{lo:.2}-{hi:.2}]", median(ratios[i].clone())),
                        )
                    }
                    _ => (0.0, "-".to_string()),
                }
            };
            let m = median(memcpy) / 1e9;
            let (_, mr) = show(Pass::Control(threads));
            let (p, pr) = show(Pass::Pull);
            let (v, vr) = show(Pass::PullVerify(threads));
            let (_, cr) = show(Pass::CopyThenVerify);
            let (_, sr) = show(Pass::StreamCopy(threads));
            // The digest's own cost: the pull + verify against the streaming copy of the same
            // round (the same stores, nothing folded).
            let of = |p: Pass| passes.iter().position(|&q| q == p).map(|i| &rates[i]);
            let vs = match (of(Pass::PullVerify(threads)), of(Pass::StreamCopy(threads))) {
                (Some(v), Some(s)) if !v.is_empty() => {
                    let r: Vec<f64> = v.iter().zip(s).map(|(v, s)| v / s).collect();
                    let (lo, hi) = range(&r);
                    format!("{:.2} [{lo:.2}-{hi:.2}]", median(r))
                }
                _ => "-".to_string(),
            };
            let (h, _) = show(Pass::HeapMemcpy);
            let dash = |x: f64| {
                if x > 0.0 {
                    format!("{x:.2}")
                } else {
                    "-".to_string()
                }
            };
            writeln!(
                out,
                "  {:>6}  {threads:>3}  {m:>6.2}  {mr:<16} {:>5}  {pr:<16} {v:>5.2}  {vr:<16} \
                 {cr:<16} {sr:<16} {vs:<16} {:>6}",
                human(batch_bytes),
                dash(p),
                dash(h),
            )?;
            let ratio = |p: Pass| {
                passes
                    .iter()
                    .position(|&q| q == p)
                    .filter(|&i| !ratios[i].is_empty())
                    .map(|i| median(ratios[i].clone()))
            };
            measured.push(Ratios {
                batch: human(batch_bytes),
                threads,
                pull: ratio(Pass::Pull),
                pull_verify: ratio(Pass::PullVerify(threads)),
            });
        }
    }
    progress.finish_and_clear();
    Ok(measured)
}

/// The medians of one row of the transfer table, for the chart.
#[derive(Debug)]
struct Ratios {
    batch: String,
    threads: usize,
    pull: Option<f64>,
    pull_verify: Option<f64>,
}

/// The transfer table as a chart: per batch size, the pull and the pull + verify on one
/// thread and the pull + verify on two, each against memcpy on as many threads.
fn transfer_chart(rows: &[Ratios]) -> libkv::chart::BarChart {
    let mut groups: Vec<libkv::chart::Group> = Vec::new();
    for r in rows {
        if !groups.iter().any(|g| g.label == r.batch) {
            groups.push(libkv::chart::Group {
                label: r.batch.clone(),
                values: vec![0.0; 3],
            });
        }
        let g = groups
            .iter_mut()
            .find(|g| g.label == r.batch)
            .expect("just added");
        match r.threads {
            1 => {
                g.values[0] = r.pull.unwrap_or(0.0);
                g.values[1] = r.pull_verify.unwrap_or(0.0);
            }
            _ => g.values[2] = r.pull_verify.unwrap_or(0.0),
        }
    }
    libkv::chart::BarChart {
        title: "kvbench: shared-memory pull against memcpy of the same bytes".into(),
        y_label: "ratio to memcpy (median)".into(),
        series: vec![
            "pull, 1 thread".into(),
            "pull + verify, 1 thread".into(),
            "pull + verify, 2 threads".into(),
        ],
        groups,
        reference: Some((0.9, "target for pull + verify: 0.9".into())),
    }
}

fn range(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
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
