//! `kvctl top`: kvctld's status as a live view, refreshed every interval. Rates and mean
//! latencies are over the last interval (two status readings: counters and histogram sums
//! kvctld keeps since it started); pools are as the workers last reported them.
//!
//! On a terminal each frame replaces the last; otherwise (a pipe, a file, `--iterations`
//! in a script) frames follow each other, separated by a blank line.

use super::{
    Failure, capacity_tokens, connect, id_width, out, role_name, sorted_workers, worker_state,
};
use kvctld::client::exit;
use libkv::proto::StatusReply;
use std::io::IsTerminal;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The stages `latency_NAME_*` counters name, in request order, with their column title.
const STAGES: [(&str, &str); 7] = [
    ("admission_wait", "admission"),
    ("bootstrap", "bootstrap"),
    ("prefill", "prefill"),
    ("transfer", "transfer"),
    ("decode", "decode"),
    ("first_token", "ttft"),
    ("request", "request"),
];

/// One status reading and when it was taken.
#[derive(Debug)]
pub(crate) struct Reading {
    pub status: StatusReply,
    pub at: Instant,
}

impl Reading {
    fn counter(&self, name: &str) -> Option<u64> {
        self.status
            .counters
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
    }
}

/// `kvctl top`: `iterations` frames (`None`: until interrupted), `interval` apart.
pub(crate) fn top(
    cli: &super::Cli,
    interval: Duration,
    iterations: Option<u64>,
) -> Result<(), Failure> {
    if cli.json {
        return Err(Failure::new(
            exit::USAGE,
            "top is for a terminal; use `kvctl --json status` for one JSON reading",
        ));
    }
    let (mut client, _) = connect(cli)?;
    let terminal = std::io::stdout().is_terminal();
    let mut last: Option<Reading> = None;
    let mut shown = 0u64;
    loop {
        let now = Reading {
            status: client.status()?,
            at: Instant::now(),
        };
        if terminal {
            // Home and clear: the frame replaces the last one.
            outln!(
                "\x1b[H\x1b[2J{}",
                frame(last.as_ref(), &now, interval).join("\n")
            );
        } else {
            if shown > 0 {
                outln!();
            }
            outln!("{}", frame(last.as_ref(), &now, interval).join("\n"));
        }
        shown += 1;
        if iterations.is_some_and(|n| shown >= n) {
            return Ok(());
        }
        last = Some(now);
        std::thread::sleep(interval);
    }
}

/// A rate per second of a counter between two readings (`None` for the first).
fn rate(last: Option<&Reading>, now: &Reading, name: &str) -> Option<f64> {
    let last = last?;
    let dt = now.at.saturating_duration_since(last.at).as_secs_f64();
    if dt <= 0.0 {
        return None;
    }
    let (a, b) = (last.counter(name)?, now.counter(name)?);
    Some(b.saturating_sub(a) as f64 / dt)
}

/// The mean of a latency histogram over the requests between two readings, in ms.
fn mean_ms(last: Option<&Reading>, now: &Reading, name: &str) -> Option<f64> {
    let last = last?;
    let count = format!("latency_{name}_count");
    let sum = format!("latency_{name}_us");
    let n = now.counter(&count)?.checked_sub(last.counter(&count)?)?;
    let us = now.counter(&sum)?.checked_sub(last.counter(&sum)?)?;
    (n > 0).then(|| us as f64 / n as f64 / 1000.0)
}

fn per_s(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"))
}

fn clock() -> String {
    let s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("{:02}:{:02}:{:02} UTC", s / 3600 % 24, s / 60 % 60, s % 60)
}

/// The lines of one frame.
pub(crate) fn frame(last: Option<&Reading>, now: &Reading, interval: Duration) -> Vec<String> {
    let s = &now.status;
    let r = |name: &str| per_s(rate(last, now, name));
    let counter = |name: &str| now.counter(name).unwrap_or(0);
    let mut lines = vec![
        format!(
            "kvfence top: kvctld generation {}, every {} ms, {}",
            s.generation.0,
            interval.as_millis(),
            clock()
        ),
        format!(
            "requests/s: submitted {}  completed {}  failed {}  rejected {}  pool full {}   \
             in flight {}  queued {}  decode slots {}/{}",
            r("submitted"),
            r("completed"),
            r("failed"),
            r("rejected"),
            r("refused_full"),
            counter("in_flight"),
            counter("queue_len"),
            counter("decode_slots_used"),
            counter("decode_slots"),
        ),
        format!(
            "transfers/s: {}  pages/s {}  MB/s {}   verify failures: {}  probe mismatches: {}",
            r("transfers"),
            r("pages_transferred"),
            per_s(rate(last, now, "bytes_transferred").map(|b| b / 1e6)),
            counter("verify_failed"),
            counter("probe_mismatches"),
        ),
    ];
    let mut lat = String::from("mean ms:");
    for (name, title) in STAGES {
        let v = mean_ms(last, now, name).map_or_else(|| "-".to_owned(), |v| format!("{v:.2}"));
        lat.push_str(&format!("  {title} {v}"));
    }
    lines.push(lat);
    let workers = sorted_workers(s);
    if workers.is_empty() {
        lines.push("workers: none registered".to_owned());
        return lines;
    }
    let idw = id_width(&workers);
    lines.push(format!(
        "{:<idw$}  {:<7}  {:<12}  {:>6}  {:>7}  {:>9}  {:>6}  {:>8}  {:>7}  {:>8}  {:>8}  {:>8}",
        "worker",
        "role",
        "state",
        "flight",
        "pages",
        "tokens",
        "free",
        "reserved",
        "writing",
        "readable",
        "draining",
        "served/s"
    ));
    for w in workers {
        let served = last
            .and_then(|l| {
                let before = l.status.workers.iter().find(|p| p.id == w.id)?;
                let dt = now.at.saturating_duration_since(l.at).as_secs_f64();
                (dt > 0.0).then(|| w.served.saturating_sub(before.served) as f64 / dt)
            })
            .map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
        lines.push(format!(
            "{:<idw$}  {:<7}  {:<12}  {:>6}  {:>7}  {:>9}  {:>6}  {:>8}  {:>7}  {:>8}  {:>8}  {:>8}",
            w.id,
            role_name(w.role),
            worker_state(w),
            w.in_flight,
            w.pool_pages,
            capacity_tokens(w),
            w.free,
            w.reserved,
            w.writing,
            w.readable,
            w.draining,
            served
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use libkv::Generation;
    use libkv::proto::{Role, Transport, WorkerStatus};

    fn reading(at: Instant, completed: u64, transfer: (u64, u64), served: u64) -> Reading {
        Reading {
            status: StatusReply {
                generation: Generation(2),
                max_context: 64,
                max_new_tokens: 8,
                workers: vec![WorkerStatus {
                    id: "decode-0".into(),
                    role: Role::Decode,
                    connected: true,
                    drain: false,
                    in_flight: 1,
                    held_pages: 2,
                    transports: vec![Transport::Shm],
                    served,
                    counters: Vec::new(),
                    pool_pages: 10,
                    tokens_per_page: 16,
                    free: 6,
                    reserved: 1,
                    writing: 2,
                    readable: 1,
                    draining: 0,
                    max_batch: 0,
                }],
                counters: vec![
                    ("completed".into(), completed),
                    ("latency_transfer_count".into(), transfer.0),
                    ("latency_transfer_us".into(), transfer.1),
                ],
                transport: Some(Transport::Shm),
                model: None,
            },
            at,
        }
    }

    #[test]
    fn rates_and_means_are_over_the_interval() {
        let t0 = Instant::now();
        let a = reading(t0, 100, (50, 100_000), 40);
        let b = reading(t0 + Duration::from_secs(2), 130, (60, 130_000), 50);
        let text = frame(Some(&a), &b, Duration::from_secs(2)).join("\n");
        assert!(text.contains("completed 15.0"), "{text}");
        // 10 transfers took 30 ms between the readings: 3 ms each.
        assert!(text.contains("transfer 3.00"), "{text}");
        assert!(text.contains("decode -"), "no decode samples: {text}");
        let row = text.lines().find(|l| l.starts_with("decode-0")).unwrap();
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            cols[1..],
            [
                "decode", "busy", "1", "10", "160", "6", "1", "2", "1", "0", "5.0"
            ]
        );
        // The first frame has no rates yet.
        let first = frame(None, &a, Duration::from_secs(2)).join("\n");
        assert!(first.contains("completed -"), "{first}");
    }
}
