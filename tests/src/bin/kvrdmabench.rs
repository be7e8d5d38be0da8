//! kvrdmabench: RDMA READ throughput of page runs through per-request read windows, the way
//! decode pulls prefill's pages: for each request the owner binds a read-only type-2 window
//! over the run, the reader (a QP with no remote rights, into a local-only registration)
//! reads the run's pages with `read_pages`, and the owner invalidates the window. Two
//! connected QPs on one device, pools larger than the CPU cache (64 MiB by default) on both
//! sides, requests cycling through them.
//!
//! Two layouts of the read list: `contiguous` (the run lands in consecutive pages, so its
//! pages coalesce into READs of up to 4 MiB) and `scattered` (the same pages listed last
//! first, so no two neighbours are contiguous: one READ per page, what a fragmented decode
//! pool costs).
//!
//! A benchmark, not a test: it prints figures and asserts nothing. Each case prints a line
//! for people and a `RESULT` line of key=value pairs for scripts (tests/vm/rxe-bench.sh puts
//! it next to perftest's ib_read_bw and ib_write_bw on the same device). Gb/s are 10^9 bits
//! per second, as perftest reports them.

#![allow(clippy::print_stdout)]

use clap::{Parser, ValueEnum};
use libkv::PageId;
use libkv::config::RdmaConfig;
use libkv::memory::{HostMemory, PoolMemory};
use libkv::rdma::{PageRead, RdmaQp, RegisteredPool, WindowAccess, select_device};
use std::process::ExitCode;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Layout {
    Contiguous,
    Scattered,
    Both,
}

#[derive(Parser, Debug)]
#[command(
    name = "kvrdmabench",
    about = "RDMA READ of page runs through per-request read windows"
)]
struct Args {
    /// RDMA device (as ibv_devices lists it).
    #[arg(long, default_value = "rxe0")]
    device: String,
    /// Port of the device, from 1.
    #[arg(long, default_value_t = 1)]
    port: u8,
    /// GID index (the RoCE v2 GID of the address to use).
    #[arg(long, default_value_t = 1)]
    gid_index: u32,
    /// Page sizes in KiB.
    #[arg(long, value_delimiter = ',', default_value = "64,1024")]
    page_kib: Vec<u32>,
    /// Pages per request (one window per request).
    #[arg(long, default_value_t = 16)]
    run_pages: u32,
    /// Size of each side's pool in MiB.
    #[arg(long, default_value_t = 64)]
    pool_mib: u64,
    /// Seconds to measure each case (at least 3 requests each, after one to warm up).
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Destination layout.
    #[arg(long, value_enum, default_value_t = Layout::Both)]
    layout: Layout,
}

/// Median of `v` (empty: zero).
fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// What one case measured.
struct Figures {
    requests: u32,
    bytes: u64,
    reads: u64,
    elapsed: Duration,
    reading: Duration,
    window_costs: Vec<Duration>,
    verified: bool,
}

/// The pages of `reg` as one byte slice.
///
/// # Safety
///
/// No RDMA operation may write the registration while the slice lives, and no mutable view
/// of it may exist.
unsafe fn bytes(reg: &RegisteredPool) -> &[u8] {
    let mem = reg.memory();
    let ptr = mem.host_ptr().expect("host memory");
    let len = usize::try_from(mem.len()).expect("pool fits the address space");
    // SAFETY: the mapping is `len` bytes and lives as long as `reg`; the caller keeps
    // writers away while the slice lives.
    unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) }
}

/// Mutable views of pages `first..first + count` of `reg`, last first when `backwards`.
///
/// # Safety
///
/// The caller holds no other view of those pages while the returned slices live.
#[expect(
    clippy::mut_from_ref,
    reason = "registered memory is shared with the device, not owned by the registration"
)]
unsafe fn run_mut(
    reg: &RegisteredPool,
    first: u32,
    count: u32,
    backwards: bool,
) -> Vec<(u32, &mut [u8])> {
    let page = usize::try_from(reg.page_bytes()).expect("page fits the address space");
    let base = reg.memory().host_ptr().expect("host memory");
    let mut pages: Vec<(u32, &mut [u8])> = (0..count)
        .map(|k| {
            let p = first + k;
            assert!(p < reg.pages());
            let off = usize::try_from(p).expect("page index") * page;
            // SAFETY: page `p` lies inside the mapping, which lives as long as `reg`; the
            // pages are distinct and the caller holds no other view of them.
            (k, unsafe {
                std::slice::from_raw_parts_mut(base.as_ptr().add(off), page)
            })
        })
        .collect();
    if backwards {
        pages.reverse();
    }
    pages
}

/// Runs requests of `run` pages for `seconds`: bind a read window, read, invalidate.
fn case(
    owner: &Rc<RdmaQp>,
    mut reader: RdmaQp,
    pool: &RegisteredPool,
    dst: &RegisteredPool,
    run: u32,
    scattered: bool,
    seconds: f64,
) -> Result<(RdmaQp, Figures), String> {
    let runs = pool.pages() / run;
    if runs == 0 {
        return Err(format!(
            "a run of {run} pages does not fit a pool of {} pages",
            pool.pages()
        ));
    }
    let mut f = Figures {
        requests: 0,
        bytes: 0,
        reads: 0,
        elapsed: Duration::ZERO,
        reading: Duration::ZERO,
        window_costs: Vec::new(),
        verified: false,
    };
    let mut last = (0, 0);
    // one warm-up request, then at least three measured ones
    let mut i = 0u32;
    let mut start = Instant::now();
    while i < 4 || start.elapsed().as_secs_f64() < seconds {
        // the source runs walk the pool; the destination runs walk it in another order
        let src_run = i % runs;
        let dst_run = (i * 7 + 3) % runs;
        let t0 = Instant::now();
        let window = pool
            .bind_window(owner, PageId(src_run * run), run, WindowAccess::Read)
            .map_err(|e| format!("bind: {e}"))?;
        let t1 = Instant::now();
        // SAFETY: only this loop makes views of `dst`, one request at a time; they end with
        // the read (read_pages consumes them).
        let targets = unsafe { run_mut(dst, dst_run * run, run, scattered) };
        // page k of the window lands in page k of the destination run; backwards, no two
        // neighbours in the list are contiguous and every page is its own READ
        let pages: Vec<PageRead<'_>> = targets
            .into_iter()
            .map(|(k, dst)| PageRead {
                dst,
                rkey: window.rkey(),
                raddr: window.addr() + u64::from(k) * pool.page_bytes(),
            })
            .collect();
        let (qp, stats) = reader
            .read_pages(dst.mr(), pages, &mut || true)
            .map_err(|e| format!("read: {e}"))?;
        reader = qp;
        let t2 = Instant::now();
        window
            .invalidate()
            .map_err(|e| format!("invalidate: {e}"))?;
        let t3 = Instant::now();
        if i == 0 {
            start = Instant::now();
        } else {
            f.requests += 1;
            f.bytes += stats.bytes;
            f.reads += u64::from(stats.reads);
            f.reading += t2 - t1;
            f.window_costs.push((t1 - t0) + (t3 - t2));
        }
        last = (src_run, dst_run);
        i += 1;
    }
    f.elapsed = start.elapsed();
    // the last request's pages arrived (the benchmark reports, it does not fail)
    let page = usize::try_from(pool.page_bytes()).map_err(|e| e.to_string())?;
    let len = page * run as usize;
    // SAFETY: nothing is in flight any more (every read was waited for) and no view of
    // either pool lives.
    let (src, got) = unsafe { (bytes(pool), bytes(dst)) };
    let (s, d) = (last.0 as usize * len, last.1 as usize * len);
    f.verified = src[s..s + len] == got[d..d + len];
    Ok((reader, f))
}

fn run(args: &Args) -> Result<(), String> {
    let mut cfg = RdmaConfig::for_device(args.device.clone());
    cfg.port = args.port;
    cfg.gid_index = args.gid_index;
    let dev = select_device(&cfg).map_err(|e| e.to_string())?;
    let pd = dev
        .context()
        .alloc_pd()
        .map_err(|e| format!("ibv_alloc_pd: {e}"))?;
    let pool_bytes = args.pool_mib << 20;
    let pool_mem = Arc::new(
        HostMemory::new(c"kvrdmabench-pool", pool_bytes).map_err(|e| format!("pool: {e}"))?,
    );
    let dst_mem =
        Arc::new(HostMemory::new(c"kvrdmabench-dst", pool_bytes).map_err(|e| format!("dst: {e}"))?);
    {
        let ptr = pool_mem.host_ptr().ok_or("pool has no host mapping")?;
        let len = usize::try_from(pool_bytes).map_err(|e| e.to_string())?;
        // SAFETY: the mapping is `len` bytes long and nothing else touches it yet.
        let all = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len) };
        for (i, chunk) in all.chunks_mut(4096).enumerate() {
            chunk.fill(u8::try_from(i % 251).unwrap_or(0));
        }
    }
    let mut owner = RdmaQp::new(&dev, &pd, 0x1000, true).map_err(|e| e.to_string())?;
    let mut reader = RdmaQp::new(&dev, &pd, 0x2000, false).map_err(|e| e.to_string())?;
    let (a, b) = (owner.endpoint(), reader.endpoint());
    owner.connect(&b).map_err(|e| e.to_string())?;
    reader.connect(&a).map_err(|e| e.to_string())?;
    let owner = Rc::new(owner);
    println!(
        "kvrdmabench: {} (GID index {}, read depth {}), pools {} MiB each side, runs of {} pages, {} s per case",
        dev.name(),
        dev.gid_index(),
        dev.read_depth(),
        args.pool_mib,
        args.run_pages,
        args.seconds
    );
    let layouts: &[bool] = match args.layout {
        Layout::Contiguous => &[false],
        Layout::Scattered => &[true],
        Layout::Both => &[false, true],
    };
    for &kib in &args.page_kib {
        let page_bytes = u64::from(kib) << 10;
        let pool = RegisteredPool::new(&pd, Arc::clone(&pool_mem), page_bytes)
            .map_err(|e| format!("register pool: {e}"))?;
        let dst = RegisteredPool::local_only(&pd, Arc::clone(&dst_mem), page_bytes)
            .map_err(|e| format!("register destination: {e}"))?;
        for &scattered in layouts {
            let (qp, f) = case(
                &owner,
                reader,
                &pool,
                &dst,
                args.run_pages,
                scattered,
                args.seconds,
            )?;
            reader = qp;
            let secs = f.elapsed.as_secs_f64();
            let gbits = f.bytes as f64 * 8.0 / secs / 1e9;
            let reading_gbits = f.bytes as f64 * 8.0 / f.reading.as_secs_f64() / 1e9;
            let window_total: Duration = f.window_costs.iter().sum();
            let share = window_total.as_secs_f64() / secs;
            let per_request = f.reads as f64 / f64::from(f.requests.max(1));
            let window_us = median(f.window_costs).as_secs_f64() * 1e6;
            let layout = if scattered { "scattered" } else { "contiguous" };
            println!(
                "{kib:>5} KiB pages, {layout:<10}: {gbits:.3} Gb/s ({:.1} MB/s, {:.0} pages/s), \
                 {per_request:.0} READs per request; reads alone {reading_gbits:.3} Gb/s; \
                 bind + invalidate {window_us:.0} us per request (median), {:.1}% of the time; \
                 {} requests{}",
                f.bytes as f64 / secs / 1e6,
                f.bytes as f64 / page_bytes as f64 / secs,
                share * 100.0,
                f.requests,
                if f.verified {
                    ""
                } else {
                    "; LAST REQUEST'S PAGES DIFFER"
                }
            );
            println!(
                "RESULT tool=kvfence page_bytes={page_bytes} layout={layout} gbits={gbits:.4} \
                 reading_gbits={reading_gbits:.4} reads_per_request={per_request:.1} \
                 window_us={window_us:.1} window_share={share:.4} requests={} verified={}",
                f.requests, f.verified
            );
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvrdmabench: {e}");
            ExitCode::from(1)
        }
    }
}
