//! kvrps: end-to-end requests per second of the local stack on shared memory, side by side
//! in one run: one prefill and one decode worker against two of each (`--compare workers`,
//! the default), or two of each without metrics against two of each with `/metrics` on
//! every daemon, each scraped every `--scrape-ms` while measured (`--compare metrics`: what
//! metrics cost the hot path). A benchmark, not a test: it prints figures and asserts only
//! that every request succeeded. `--svg PATH` also draws the rounds as a chart.
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
    /// What the two stacks differ in: `workers` (1 + 1 against 2 + 2) or `metrics` (2 + 2
    /// without, and with `/metrics` on every daemon, scraped every `--scrape-ms`).
    #[arg(long, default_value = "workers", value_parser = ["workers", "metrics"])]
    compare: String,
    /// With `--compare metrics`: how often every daemon's `/metrics` is scraped while its
    /// stack is measured, in ms (Prometheus's default is 15000).
    #[arg(long, default_value_t = 1000)]
    scrape_ms: u64,
    /// Also write the requests per second of every round as an SVG bar chart here.
    #[arg(long, value_name = "PATH")]
    svg: Option<std::path::PathBuf>,
}

fn start(
    dir: &std::path::Path,
    name: &str,
    workers: usize,
    metrics: bool,
) -> Result<Stack, String> {
    let mut cfg = Config::embedded_default(dir.join(format!("{name}.sock")));
    if metrics {
        // One shared file: port 0 gives every daemon a port of its own.
        cfg.metrics.listen = Some("127.0.0.1:0".into());
        cfg.metrics.prefill_listen = Some("127.0.0.1:0".into());
        cfg.metrics.decode_listen = Some("127.0.0.1:0".into());
    }
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
                            .generate(
                                &format!("t{c}"),
                                &libkv::model::tokenize(prompt),
                                args.max_new,
                                0,
                                |_| {},
                            )
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

/// The `/metrics` addresses of every daemon of `stack`, once each has logged its own.
fn metrics_addrs(stack: &Stack) -> Option<Vec<String>> {
    kvctld::stack::wait_until(Duration::from_secs(10), || {
        stack
            .names()
            .iter()
            .map(|n| kvfence_tests::metrics_addr(&stack.log(n)))
            .collect()
    })
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
    let metrics = args.compare == "metrics";
    let (labels, workers, with_metrics) = if metrics {
        (["2 + 2", "2 + 2 with metrics"], [2, 2], [false, true])
    } else {
        (["1 + 1", "2 + 2"], [1, 2], [false, false])
    };
    let stacks = start(dir.path(), "a", workers[0], with_metrics[0])
        .and_then(|a| Ok((a, start(dir.path(), "b", workers[1], with_metrics[1])?)));
    let (mut a, mut b) = match stacks {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvrps: {e}");
            return ExitCode::from(2);
        }
    };
    let scraped = if metrics {
        let Some(addrs) = metrics_addrs(&b) else {
            eprintln!("kvrps: not every daemon logged a metrics address within 10 s");
            return ExitCode::from(2);
        };
        addrs
    } else {
        Vec::new()
    };
    println!(
        "kvrps: {} clients x {} requests per round, prompt {} tokens, {} new tokens, {} rounds{}",
        args.clients,
        args.per_client,
        args.prompt,
        args.max_new,
        args.rounds,
        if metrics {
            format!(
                "; {} daemons' /metrics scraped every {} ms while measured",
                scraped.len(),
                args.scrape_ms
            )
        } else {
            String::new()
        }
    );
    let (mut r1, mut r2) = (Vec::new(), Vec::new());
    let mut scrapes = 0u64;
    let progress = libkv::progress::bar(2 * u64::from(args.rounds), "rounds");
    for i in 0..args.rounds {
        for (stack, out, label, scrape_it) in [
            (&a, &mut r1, labels[0], false),
            (&b, &mut r2, labels[1], metrics),
        ] {
            let stop = std::sync::atomic::AtomicBool::new(false);
            let (measured, n) = std::thread::scope(|s| {
                let scraper = s.spawn(|| {
                    let mut n = 0u64;
                    while scrape_it && !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        n += scraped
                            .iter()
                            .filter(|a| kvfence_tests::scrape(a).is_some())
                            .count() as u64;
                        std::thread::sleep(Duration::from_millis(args.scrape_ms));
                    }
                    n
                });
                let r = round(stack, &args);
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                (r, scraper.join().unwrap_or(0))
            });
            scrapes += n;
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
    if let Some(path) = &args.svg {
        let chart = libkv::chart::BarChart {
            title: format!(
                "kvrps: requests/s per round, {} against {}",
                labels[1], labels[0]
            ),
            y_label: "requests/s".into(),
            series: labels.iter().map(|l| (*l).to_owned()).collect(),
            groups: r1
                .iter()
                .zip(&r2)
                .enumerate()
                .map(|(i, (x, y))| libkv::chart::Group {
                    label: format!("round {i}"),
                    values: vec![*x, *y],
                })
                .collect(),
            reference: None,
        };
        if let Err(e) = chart.write_svg(path) {
            eprintln!("kvrps: writing {}: {e}", path.display());
            return ExitCode::from(1);
        }
    }
    let mut sorted = ratios.clone();
    println!(
        "median: {} {:.0} requests/s, {} {:.0} requests/s; {} / {} per round {lo:.2}-{hi:.2}, \
         median {:.3}{}",
        labels[0],
        median(&mut r1),
        labels[1],
        median(&mut r2),
        labels[1],
        labels[0],
        median(&mut sorted),
        if metrics {
            format!("; {scrapes} scrapes answered")
        } else {
            String::new()
        }
    );
    let _ = a.stop();
    let _ = b.stop();
    ExitCode::SUCCESS
}
