//! kvrps: end-to-end requests per second of the local stack on shared memory, one prefill and
//! one decode worker against two of each, side by side in one run. A benchmark, not a test:
//! it prints figures and asserts only that every request succeeded.
//!
//! Both stacks run at once (two kvctld, each with its own socket directory), idle while the
//! other is measured; rounds alternate between them so that a change of load on the machine
//! falls on both. Each round runs `--clients` client threads, each sending `--per-client`
//! requests back to back.

#![allow(clippy::print_stdout)]

use clap::Parser;
use kvctld::stack::{Stack, StackOptions};
use libkv::config::Config;
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(
    name = "kvrps",
    about = "requests per second of 1 + 1 against 2 + 2 workers"
)]
struct Args {
    /// Rounds per stack, alternating.
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Client threads.
    #[arg(long, default_value_t = 16)]
    clients: u32,
    /// Requests per client thread per round.
    #[arg(long, default_value_t = 50)]
    per_client: u32,
    /// Prompt bytes (tokens of the reference model).
    #[arg(long, default_value_t = 512)]
    prompt: usize,
    /// New tokens per request.
    #[arg(long, default_value_t = 16)]
    max_new: u32,
}

fn start(dir: &std::path::Path, name: &str, workers: usize) -> Result<Stack, String> {
    let mut cfg = Config::embedded_default(dir.join(format!("{name}.sock")));
    cfg.control.admission_queue = 4096;
    cfg.deadlines.request = 60_000;
    cfg.deadlines.admission_wait = 30_000;
    StackOptions::new(cfg, dir.join(name))
        .map(|o| o.with_workers(workers, workers))
        .and_then(Stack::start)
        .map_err(|e| kvctld::stack::error_chain(&e))
}

/// One round: requests per second, or the first error.
fn round(stack: &Stack, args: &Args) -> Result<f64, String> {
    let prompt = vec![b'r'; args.prompt];
    let t = Instant::now();
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..args.clients)
            .map(|c| {
                let prompt = &prompt;
                s.spawn(move || -> Result<(), String> {
                    let mut client = stack.client().map_err(|e| e.to_string())?;
                    for _ in 0..args.per_client {
                        client
                            .generate(&format!("t{c}"), prompt, args.max_new, 0, |_| {})
                            .map_err(|e| e.to_string())?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("client panicked".into())))
            .collect()
    });
    let elapsed = t.elapsed();
    results.into_iter().collect::<Result<(), String>>()?;
    Ok(f64::from(args.clients * args.per_client) / elapsed.as_secs_f64())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> ExitCode {
    let args = Args::parse();
    let Ok(dir) = tempfile::Builder::new().prefix("kvrps").tempdir_in("/tmp") else {
        eprintln!("kvrps: no temp dir");
        return ExitCode::from(2);
    };
    let stacks = start(dir.path(), "one", 1).and_then(|a| Ok((a, start(dir.path(), "two", 2)?)));
    let (mut one, mut two) = match stacks {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvrps: {e}");
            return ExitCode::from(2);
        }
    };
    println!(
        "kvrps: {} clients x {} requests per round, prompt {} tokens, {} new tokens, {} rounds",
        args.clients, args.per_client, args.prompt, args.max_new, args.rounds
    );
    let (mut r1, mut r2) = (Vec::new(), Vec::new());
    let progress = libkv::progress::bar(2 * u64::from(args.rounds), "rounds");
    for i in 0..args.rounds {
        for (stack, out, label) in [(&one, &mut r1, "1 + 1"), (&two, &mut r2, "2 + 2")] {
            let measured = round(stack, &args);
            progress.inc(1);
            match measured {
                Ok(rps) => {
                    progress.suspend(|| println!("  round {i}: {label}: {rps:.0} requests/s"));
                    out.push(rps);
                }
                Err(e) => {
                    eprintln!("kvrps: {label}: {e}");
                    return ExitCode::from(1);
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    progress.finish_and_clear();
    let ratios: Vec<f64> = r1.iter().zip(&r2).map(|(a, b)| b / a).collect();
    let (lo, hi) = ratios
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), r| (l.min(*r), h.max(*r)));
    println!(
        "median: 1 + 1 {:.0} requests/s, 2 + 2 {:.0} requests/s; 2 + 2 / 1 + 1 per round {lo:.2}-{hi:.2}",
        median(&mut r1),
        median(&mut r2)
    );
    let _ = one.stop();
    let _ = two.stop();
    ExitCode::SUCCESS
}
