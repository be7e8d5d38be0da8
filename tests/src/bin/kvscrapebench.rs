//! kvscrapebench: how long kvctld's `/metrics` takes to answer with the series of many
//! workers. A benchmark, not a test: it prints figures and asserts only that the answers
//! hold every worker.
//!
//! Builds a status of `--workers` workers (half prefill, half decode, each with the dozen
//! counters a worker reports), publishes it to a metrics endpoint on a loopback port, and
//! times `--scrapes` whole HTTP scrapes (connect, GET, read the body) and, apart, the
//! rendering alone. Prints the median and the 99th percentile of each.

#![allow(clippy::print_stdout)]

use clap::Parser;
use kvctld::ctl::latency::Latencies;
use kvctld::metrics::{Snapshot, render, serve};
use libkv::Generation;
use libkv::proto::{Role, StatusReply, Transport, WorkerStatus};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(about = "time of a /metrics scrape with many workers")]
struct Args {
    /// Workers in the status (half of each role).
    #[arg(long, default_value_t = 16)]
    workers: usize,
    /// Scrapes timed.
    #[arg(long, default_value_t = 500)]
    scrapes: usize,
}

fn status(workers: usize) -> StatusReply {
    let counters = [
        "frames_received",
        "prefill_runs",
        "pages_written",
        "pages_served",
        "bytes_served",
        "pulls",
        "pages_pulled",
        "bytes_pulled",
        "verified",
        "verify_failed",
        "aborts",
        "freed_pages",
    ];
    let workers = (0..workers)
        .map(|i| {
            let (role, name) = if i % 2 == 0 {
                (Role::Prefill, "prefill")
            } else {
                (Role::Decode, "decode")
            };
            WorkerStatus {
                id: format!("{name}-gpu{}", i / 2),
                role,
                connected: true,
                drain: false,
                in_flight: 3,
                held_pages: 96,
                transports: vec![Transport::Tcp, Transport::Rdma],
                served: 123_456,
                counters: counters
                    .iter()
                    .map(|c| ((*c).to_owned(), 987_654))
                    .collect(),
                pool_pages: 40_960,
                tokens_per_page: 16,
                free: 40_000,
                reserved: 500,
                writing: 200,
                readable: 200,
                draining: 60,
                max_batch: 0,
            }
        })
        .collect();
    StatusReply {
        generation: Generation(1),
        max_context: 32_768,
        max_new_tokens: 1024,
        workers,
        counters: [
            "submitted",
            "admitted",
            "completed",
            "failed",
            "rejected",
            "timeouts",
            "worker_lost",
            "verify_failed",
            "transfers",
            "pages_transferred",
            "bytes_transferred",
            "in_flight",
            "queue_len",
        ]
        .iter()
        .map(|c| ((*c).to_owned(), 42))
        .collect(),
        transport: Some(Transport::Tcp),
        model: None,
    }
}

fn quantiles(mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    let p99 = v[(v.len() * 99 / 100).min(v.len() - 1)];
    (v[v.len() / 2], p99)
}

fn main() {
    let args = Args::parse();
    let status = status(args.workers);
    let snapshot = Snapshot::default();
    snapshot.publish(status.clone(), Latencies::default());
    let addr = serve("127.0.0.1:0".parse().expect("addr"), snapshot).expect("metrics listener");

    let mut renders = Vec::with_capacity(args.scrapes);
    let mut bytes = 0;
    for _ in 0..args.scrapes {
        let t = Instant::now();
        let text = render(&status, &Latencies::default());
        renders.push(t.elapsed());
        bytes = text.len();
    }
    let mut scrapes = Vec::with_capacity(args.scrapes);
    for _ in 0..args.scrapes {
        let t = Instant::now();
        let mut s = TcpStream::connect(addr).expect("connect");
        write!(s, "GET /metrics HTTP/1.0\r\nHost: kvctld\r\n\r\n").expect("request");
        let mut body = String::new();
        s.read_to_string(&mut body).expect("answer");
        scrapes.push(t.elapsed());
        assert!(
            body.contains(&format!("worker=\"decode-gpu{}\"", args.workers / 2 - 1)),
            "the scrape lacks the last worker"
        );
    }
    let (r50, r99) = quantiles(renders);
    let (s50, s99) = quantiles(scrapes);
    let series = render(&status, &Latencies::default())
        .lines()
        .filter(|l| !l.starts_with('#'))
        .count();
    println!(
        "kvscrapebench: {} workers, {series} series, {bytes} bytes; {} scrapes",
        args.workers, args.scrapes
    );
    println!("  render alone:        p50 {r50:?}, p99 {r99:?}");
    println!("  HTTP scrape on lo:   p50 {s50:?}, p99 {s99:?}");
}
