//! kvlat: end-to-end request latency of the local stack on shared memory, for short prompts,
//! and the bootstrap round trip (kvctld to decoded and back: reservation and grant) as kvctld
//! measures it; then the control channel itself, a client on the Unix socket against one on
//! TCP with mutual TLS (loopback, certificates made for the run), side by side in rounds: a
//! status round trip and a one-token request. A benchmark, not a test: it prints
//! percentiles and asserts nothing.

#![allow(clippy::print_stdout)]

use clap::Parser;
use kvctld::client::{Client, Endpoint};
use kvctld::stack::{Stack, StackOptions};
use kvfence_tests::certs::{KVCTLD_NAME, TestCa};
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
    let mut cfg = Config::embedded_default(dir.path().join("ctl.sock"));
    let ca = TestCa::new(dir.path(), "ca");
    let server = ca.issue("kvctld", &[KVCTLD_NAME]);
    cfg.tls = ca.kvctld(&server, "127.0.0.1:0", &[], &[CLIENT]);
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
    let code = match control_channel(&stack, &ca, args.requests) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvlat: {e}");
            ExitCode::from(1)
        }
    };
    let _ = stack.stop();
    code
}

const CLIENT: &str = "kvlat.kvfence.test";
/// Rounds of the side-by-side comparison; each times `requests / ROUNDS` of each kind on
/// each channel, the channels alternating.
const ROUNDS: u32 = 8;

/// The Unix socket against TCP + mutual TLS: status round trips and one-token requests,
/// in alternating rounds on one stack.
fn control_channel(stack: &Stack, ca: &TestCa, requests: u32) -> Result<(), String> {
    let log = stack.log("kvctld");
    let addr = log
        .lines()
        .find_map(|l| l.split("serving TLS peers on ").nth(1))
        .map(str::trim)
        .ok_or("kvctld did not say where it serves TLS peers")?;
    let leaf = ca.issue("client", &[CLIENT]);
    let tls = Endpoint::from_config(&{
        let mut c = stack.config().clone();
        c.tls = ca.peer(&leaf, addr);
        c
    })
    .map_err(|e| e.to_string())?;
    let timeout = Duration::from_secs(5);
    let mut unix = stack.client().map_err(|e| e.to_string())?;
    let mut over_tls = tls.connect(timeout).map_err(|e| e.to_string())?;
    let per_round = (requests / ROUNDS).max(1);
    let prompt = libkv::model::tokenize(b"kvlat");
    // [channel][kind]: status, request
    let mut lat: [[Vec<f64>; 2]; 2] = Default::default();
    let time = |c: &mut Client, kind: usize| -> Result<f64, String> {
        let t = Instant::now();
        match kind {
            0 => c.status().map(drop),
            _ => c.generate("bench", &prompt, 1, 0, |_| {}).map(drop),
        }
        .map_err(|e| e.to_string())?;
        Ok(t.elapsed().as_secs_f64() * 1e6)
    };
    for round in 0..ROUNDS * 2 {
        let channel = (round % 2) as usize;
        let c = if channel == 0 {
            &mut unix
        } else {
            &mut over_tls
        };
        for (kind, times) in lat[channel].iter_mut().enumerate() {
            for _ in 0..per_round {
                times.push(time(c, kind)?);
            }
        }
    }
    println!(
        "\ncontrol channel, {ROUNDS} alternating rounds of {per_round} per kind: Unix socket \
         against TCP + mutual TLS on loopback ({addr})"
    );
    println!(
        "  what            unix p50 us   unix p99 us   tls p50 us   tls p99 us   p50 tls/unix"
    );
    for (kind, what) in ["status", "1-token request"].iter().enumerate() {
        let (u50, u99) = (pct(&mut lat[0][kind], 0.5), pct(&mut lat[0][kind], 0.99));
        let (t50, t99) = (pct(&mut lat[1][kind], 0.5), pct(&mut lat[1][kind], 0.99));
        println!(
            "  {what:<15} {u50:>11.0}   {u99:>11.0}   {t50:>10.0}   {t99:>10.0}   {:>12.2}",
            t50 / u50
        );
    }
    Ok(())
}
