//! kvlat: end-to-end request latency of the local stack on shared memory, for short prompts,
//! and the bootstrap round trip (kvctld to decoded and back: reservation and grant) as kvctld
//! measures it. A benchmark, not a test: it prints percentiles and asserts nothing.

#![allow(clippy::print_stdout)]

use clap::Parser;
use kvctld::stack::{Stack, StackOptions};
use libkv::config::Config;
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(
    name = "kvlat",
    about = "end-to-end latency of short requests on the local stack"
)]
struct Args {
    /// Sequential requests per prompt size (kvctld keeps the last 4096 bootstrap round
    /// trips, so 4096 makes each size's figures its own).
    #[arg(long, default_value_t = 4096)]
    requests: u32,
    /// New tokens per request.
    #[arg(long, default_value_t = 1)]
    max_new: u32,
}

fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let last = v.len().saturating_sub(1);
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let i = ((last as f64) * q).round() as usize;
    v.get(i).copied().unwrap_or(f64::NAN)
}

fn main() -> ExitCode {
    let args = Args::parse();
    let Ok(dir) = tempfile::Builder::new().prefix("kvlat").tempdir_in("/tmp") else {
        eprintln!("kvlat: no temp dir");
        return ExitCode::from(2);
    };
    let cfg = Config::embedded_default(dir.path().join("ctl.sock"));
    let stack = StackOptions::new(cfg, dir.path().join("stack")).and_then(Stack::start);
    let mut stack = match stack {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvlat: {}", kvctld::stack::error_chain(&e));
            return ExitCode::from(2);
        }
    };
    let mut client = match stack.client() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvlat: {e}");
            return ExitCode::from(2);
        }
    };
    println!(
        "kvlat: {} sequential requests per size, max_new {}",
        args.requests, args.max_new
    );
    println!("  prompt   p50 us   p99 us   max us   bootstrap p50 us   bootstrap p99 us");
    for size in [16usize, 128, 1024] {
        let prompt = vec![b'k'; size];
        let mut lat = Vec::with_capacity(args.requests as usize);
        for _ in 0..args.requests {
            let t = Instant::now();
            if let Err(e) = client.generate(
                "bench",
                &libkv::model::tokenize(&prompt),
                args.max_new,
                0,
                |_| {},
            ) {
                eprintln!("kvlat: request failed: {e}");
                return ExitCode::from(1);
            }
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let (p50, p99, max) = (pct(&mut lat, 0.5), pct(&mut lat, 0.99), pct(&mut lat, 1.0));
        // kvctld's bootstrap round trip (DecodeReserve -> DecodeReserved) over its last 4096.
        std::thread::sleep(Duration::from_millis(50));
        let (b50, b99) = match stack.status() {
            Ok(st) => {
                let get = |n: &str| st.counters.iter().find(|(k, _)| k == n).map_or(0, |c| c.1);
                (get("bootstrap_rtt_p50_us"), get("bootstrap_rtt_p99_us"))
            }
            Err(_) => (0, 0),
        };
        println!("  {size:>6}   {p50:>6.0}   {p99:>6.0}   {max:>6.0}   {b50:>16}   {b99:>16}");
    }
    let _ = stack.stop();
    ExitCode::SUCCESS
}
