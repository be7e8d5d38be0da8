//! kvtcpbench: throughput of the TCP page path over loopback (decoded's side, `fetch_pages`
//! into its own grant pages, against prefilld's page server) next to `iperf3` on the same
//! loopback path in the same run. A benchmark, not a test: it prints figures and asserts
//! nothing. Without `iperf3` on the PATH it prints the page path alone.

#![allow(clippy::print_stdout)]

use clap::Parser;
use libkv::config::{PoisonMode, Scrub};
use libkv::pool::{PagePool, PoolOptions};
use libkv::tcp;
use libkv::{Dtype, Generation, Owner, PageGeometry, RequestId};
use prefilld::pageserver::StandaloneServer;
use std::net::{TcpListener, TcpStream};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(
    name = "kvtcpbench",
    about = "TCP page path throughput vs iperf3 on loopback"
)]
struct Args {
    /// Seconds to measure each case (at least 5 pulls each).
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Seconds of the iperf3 run.
    #[arg(long, default_value_t = 3)]
    iperf_seconds: u32,
}

/// A page geometry of `page_kib` KiB pages (bf16, 16 tokens per page, 8 KV heads of 64).
fn geometry(page_kib: u32) -> PageGeometry {
    // 16 tokens * 2 (K, V) * 8 heads * 64 dims * 2 bytes = 32 KiB per layer.
    PageGeometry {
        tokens_per_page: 16,
        layers: page_kib / 32,
        kv_heads: 8,
        head_dim: 64,
        dtype: Dtype::Bf16,
    }
}

/// Bytes per second of pulling `total` bytes of `page_kib` KiB pages, repeatedly.
fn page_path(page_kib: u32, total: u64, seconds: f64) -> Result<f64, String> {
    let g = geometry(page_kib);
    let page_bytes = g.bytes_per_page();
    let pages = u32::try_from(total / page_bytes).map_err(|e| e.to_string())?;
    let tokens = pages * g.tokens_per_page;
    let options = PoolOptions {
        poison: PoisonMode::Off,
        scrub: Scrub::Off,
    };
    let owner = Owner {
        request: RequestId(1),
        generation: Generation(1),
    };
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let prefill = PagePool::host(c"kvbench-prefill", g, pages, options).map_err(|x| e(&x))?;
    let mut res = prefill
        .reserve(owner, tokens, u64::from(tokens))
        .map_err(|x| e(&x))?;
    {
        let mut grant = res.grant_write().map_err(|x| e(&x))?;
        for i in 0..grant.pages().len() {
            grant.page_mut(i).map_err(|x| e(&x))?.fill(0x5a);
        }
    }
    let token = tcp::random_token().map_err(|x| e(&x))?;
    let server = StandaloneServer::start(
        "127.0.0.1:0".parse().map_err(|x| e(&x))?,
        token,
        vec![res],
        Duration::from_secs(60),
    )
    .map_err(|x| e(&x))?;
    let source_pages = server.pages(&owner).ok_or("no pages served")?;

    let decode = PagePool::host(c"kvbench-decode", g, pages, options).map_err(|x| e(&x))?;
    let stream = TcpStream::connect(server.local_addr()).map_err(|x| e(&x))?;
    tcp::prepare(&stream).map_err(|x| e(&x))?;
    let page_len = u32::try_from(page_bytes).map_err(|x| e(&x))?;
    let (mut bytes, mut runs) = (0u64, 0u32);
    let start = Instant::now();
    while runs < 5 || start.elapsed().as_secs_f64() < seconds {
        let mut res = decode
            .reserve(owner, tokens, u64::from(tokens))
            .map_err(|x| e(&x))?;
        let mut grant = res.grant_write().map_err(|x| e(&x))?;
        tcp::fetch_pages(
            &stream,
            token,
            owner,
            &source_pages,
            page_len,
            &mut grant,
            &mut || true,
        )
        .map_err(|x| e(&x))?;
        drop(grant);
        drop(res);
        bytes += total;
        runs += 1;
    }
    Ok(bytes as f64 / start.elapsed().as_secs_f64())
}

/// iperf3's received bytes per second over 127.0.0.1.
fn iperf3(seconds: u32) -> Result<f64, String> {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        l.local_addr()
            .map_err(|e| e.to_string())?
            .port()
            .to_string()
    };
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| {
            format!("iperf3 not runnable ({e}); install it (apt-get install -y iperf3)")
        })?;
    // A probe connection would count as the one-shot server's client: give it time instead.
    std::thread::sleep(Duration::from_millis(500));
    let out = Command::new("timeout")
        .args([
            &(seconds + 20).to_string(),
            "iperf3",
            "-c",
            "127.0.0.1",
            "-p",
            &port,
        ])
        .args(["-t", &seconds.to_string(), "-J"])
        .output()
        .map_err(|e| e.to_string());
    let _ = server.kill();
    let _ = server.wait();
    let out = out?;
    let json: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("iperf3 output: {e}"))?;
    json["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .map(|bits| bits / 8.0)
        .ok_or_else(|| format!("no end.sum_received in iperf3 output: {}", json["error"]))
}

fn main() -> ExitCode {
    let args = Args::parse();
    let gib = |b: f64| b / f64::from(1u32 << 30);
    let iperf = iperf3(args.iperf_seconds);
    match &iperf {
        Ok(b) => println!("iperf3 loopback: {:.2} GiB/s", gib(*b)),
        Err(e) => println!("iperf3 loopback: not measured: {e}"),
    }
    for page_kib in [64, 1024] {
        for total in [1u64 << 20, 16 << 20] {
            match page_path(page_kib, total, args.seconds) {
                Ok(b) => {
                    let ratio = iperf
                        .as_ref()
                        .map(|i| format!("{:.2} of iperf3", b / i))
                        .unwrap_or_default();
                    println!(
                        "page path: {:>2} MiB in {page_kib:>4} KiB pages: {:.2} GiB/s {ratio}",
                        total >> 20,
                        gib(b)
                    );
                }
                Err(e) => {
                    eprintln!("kvtcpbench: {page_kib} KiB pages, {} MiB: {e}", total >> 20);
                    return ExitCode::from(1);
                }
            }
        }
    }
    ExitCode::SUCCESS
}
