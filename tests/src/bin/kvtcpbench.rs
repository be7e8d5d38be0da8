//! kvtcpbench: throughput of the TCP page path over loopback (decoded's side: reserve,
//! `fetch_pages` into its own grant pages with the digest taken as the bytes land, then
//! `verify` against prefill's digests, against prefilld's page server) on one connection and
//! on two at once (decoded runs two job threads), next to `iperf3` on the same loopback path
//! with one stream and with as many streams as connections (`-P`), and, given
//! `--mooncake PATH`, next to Mooncake Transfer Engine's own
//! benchmark (`transfer_engine_bench`, TCP transport) moving the same bytes in blocks of the
//! same size, all in the same run. A benchmark, not a test: it prints figures and asserts
//! nothing. Without `iperf3` on the PATH, or without the Mooncake binary, it prints the rest.
//!
//! The contenders run in interleaved rounds (iperf3, then for each case the page path and
//! Mooncake), so a busy moment on a shared machine hits all of them alike. Every run records
//! its CPU pressure (the "some" stall time of /proc/pressure/cpu over the run's wall time),
//! and the pressure over idle moments just before and just after it (the next run's "before"):
//! the contenders' own threads stall each other on a small machine (Mooncake's initiator
//! polls for completions on both of its threads), so only the pressure around a run tells
//! whether something else was using the CPUs. The summary is the median of the quiet runs
//! (pressure before and after at most `--quiet-pressure`), or of all runs, flagged, when
//! none was quiet. Ratios are taken between those medians.
//!
//! Every run also says where its CPU time went, per GiB moved: the receiving threads' user
//! time (digest, bookkeeping) and kernel time (socket reads, the copy out of the socket
//! buffers), the sending side's time, and read calls per MiB (from /proc/thread-self; for
//! iperf3 its own CPU report).
//!
//! Mooncake runs only on 127.0.0.1: peer-to-peer handshake instead of a metadata server,
//! `127.0.0.1` as its server name and segment, two submission threads, under `timeout`, and
//! its target is stopped by its own process id.

#![allow(clippy::print_stdout)]

use clap::Parser;
use libkv::config::{PoisonMode, Scrub};
use libkv::pool::{PagePool, PoolOptions};
use libkv::tcp;
use libkv::verify::{Manifest, page_digest};
use libkv::{Dtype, Generation, Owner, PageGeometry, RequestId};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use prefilld::pageserver::StandaloneServer;
use std::io::{BufRead, BufReader, Read};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(
    name = "kvtcpbench",
    about = "TCP page path throughput vs iperf3 and Mooncake's transfer engine on loopback"
)]
struct Args {
    /// Seconds to measure each case (at least 5 pulls each; Mooncake's runs round it up).
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Seconds of each iperf3 run.
    #[arg(long, default_value_t = 3)]
    iperf_seconds: u32,
    /// Rounds; each measures every contender once per case.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Runs whose CPU pressure is above this are left out of the medians.
    #[arg(long, default_value_t = 0.3)]
    quiet_pressure: f64,
    /// Mooncake's `transfer_engine_bench` binary (the executable inside the mooncake Python
    /// package, not the launcher script) to measure side by side.
    #[arg(long)]
    mooncake: Option<PathBuf>,
    /// Bytes moved per pull (and per Mooncake batch), in MiB.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    batch_mib: Vec<u64>,
    /// Page sizes, in KiB.
    #[arg(long, value_delimiter = ',', default_value = "64,1024")]
    page_kib: Vec<u32>,
    /// Connections the page path pulls on at once (one pull thread each, as decoded's pull
    /// threads), each compared with iperf3 with that many streams (`-P`).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    streams: Vec<usize>,
    /// What Mooncake's initiator does to its target's memory, each measured: write (push,
    /// the direction Mooncake moves KV caches in) and read (pull, as decoded does).
    #[arg(long, value_delimiter = ',', default_value = "write,read")]
    mooncake_operation: Vec<String>,
}

/// Mooncake's task submission threads (each keeps one batch in flight).
const MOONCAKE_THREADS: u64 = 2;

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

/// CPU pressure since boot ("some" total, microseconds).
fn cpu_pressure_us() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/pressure/cpu").ok()?;
    let some = text.lines().find(|l| l.starts_with("some"))?;
    some.split_whitespace()
        .find_map(|f| f.strip_prefix("total="))
        .and_then(|v| v.parse().ok())
}

/// The start of a measured interval: wall clock and CPU stall time.
struct Interval {
    start: Instant,
    stalled_us: Option<u64>,
}

impl Interval {
    fn start() -> Interval {
        Interval {
            stalled_us: cpu_pressure_us(),
            start: Instant::now(),
        }
    }

    /// Seconds since the start, and the share of them some task waited for a CPU.
    fn end(&self) -> (f64, Option<f64>) {
        let wall = self.start.elapsed().as_secs_f64();
        let pressure = match (self.stalled_us, cpu_pressure_us()) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / 1e6 / wall),
            _ => None,
        };
        (wall, pressure)
    }
}

/// The CPU pressure of an idle moment (nothing of ours running), to tell whether something
/// else is using the CPUs.
fn background() -> Option<f64> {
    let interval = Interval::start();
    std::thread::sleep(Duration::from_millis(500));
    interval.end().1
}

/// One measured run: bytes per second, the CPU pressure during it, just before and just
/// after it.
#[derive(Clone, Copy, Debug)]
struct Run {
    rate: f64,
    pressure: Option<f64>,
    before: Option<f64>,
    after: Option<f64>,
}

impl Run {
    /// Whether nothing else was competing for the CPUs around it (a missing reading, as on
    /// a kernel without pressure stall information, does not count against it).
    fn quiet(&self, limit: f64) -> bool {
        self.before.is_none_or(|p| p <= limit) && self.after.is_none_or(|p| p <= limit)
    }
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |p: Option<f64>| p.map_or("n/a".to_string(), |p| format!("{p:.2}"));
        write!(
            f,
            "{:.2} GiB/s (pressure {}, {} before)",
            gib(self.rate),
            show(self.pressure),
            show(self.before)
        )
    }
}

fn gib(bytes_per_s: f64) -> f64 {
    bytes_per_s / f64::from(1u32 << 30)
}

/// The median of the quiet runs, or of all runs when none was quiet; with the counts.
struct Summary {
    median: f64,
    quiet: usize,
    all: usize,
}

impl Summary {
    fn of(runs: &[Run], quiet: f64) -> Option<Summary> {
        let calm: Vec<f64> = runs
            .iter()
            .filter(|r| r.quiet(quiet))
            .map(|r| r.rate)
            .collect();
        let quiet_runs = calm.len();
        let mut v = if calm.is_empty() {
            runs.iter().map(|r| r.rate).collect()
        } else {
            calm
        };
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            f64::midpoint(v[n / 2 - 1], v[n / 2])
        };
        Some(Summary {
            median,
            quiet: quiet_runs,
            all: runs.len(),
        })
    }

    /// "1.23 [2/3]": the median and how many of the runs were quiet.
    fn show(&self) -> String {
        let flag = if self.quiet == 0 { " busy" } else { "" };
        format!(
            "{:.2} [{}/{}{flag}]",
            gib(self.median),
            self.quiet,
            self.all
        )
    }
}

/// User seconds, system seconds and read calls of a thread.
type Usage = (f64, f64, u64);

/// CPU time and read calls of the calling thread so far.
fn thread_usage() -> Option<Usage> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after ')'.
    let tick = 100.0; // USER_HZ on Linux
    let user = f.get(11)?.parse::<f64>().ok()? / tick;
    let system = f.get(12)?.parse::<f64>().ok()? / tick;
    let io = std::fs::read_to_string("/proc/thread-self/io").ok()?;
    let reads = io
        .lines()
        .find_map(|l| l.strip_prefix("syscr:"))
        .and_then(|v| v.trim().parse().ok())?;
    Some((user, system, reads))
}

/// CPU seconds of the whole process so far (user + system).
fn process_cpu() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let user = f.get(11)?.parse::<f64>().ok()?;
    let system = f.get(12)?.parse::<f64>().ok()?;
    Some((user + system) / 100.0)
}

/// Where a run's time went, per GiB moved.
#[derive(Clone, Copy, Debug, Default)]
struct Cost {
    /// Receiving threads' CPU seconds in user space (digest, bookkeeping) and in the kernel
    /// (socket reads, the copy out of the socket buffers).
    recv_user: f64,
    recv_system: f64,
    /// The sending side's CPU seconds (kernel and user).
    send: f64,
    /// Read calls per MiB received.
    reads_per_mib: f64,
}

impl std::fmt::Display for Cost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CPU s/GiB: receiver {:.2} user + {:.2} sys, sender {:.2}; {:.1} reads/MiB",
            self.recv_user, self.recv_system, self.send, self.reads_per_mib
        )
    }
}

/// Pulls `total` bytes of `page_kib` KiB pages, repeatedly, for `seconds`, on `streams`
/// connections at once (one pull thread each, as decoded's pull threads): every pull
/// reserves, lands the pages (digested as they arrive) and verifies them against the
/// digests prefill computed, as decoded does.
fn page_path(
    page_kib: u32,
    total: u64,
    seconds: f64,
    streams: usize,
) -> Result<(Run, Cost), String> {
    let before = background();
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
    let mut digests = Vec::with_capacity(pages as usize);
    {
        let mut grant = res.grant_write().map_err(|x| e(&x))?;
        for i in 0..grant.pages().len() {
            let page = grant.page_mut(i).map_err(|x| e(&x))?;
            page.fill(u8::try_from(i % 251).unwrap_or(0) ^ 0x5a);
            digests.push(page_digest(page));
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
    let manifest = Manifest {
        owner,
        tokens,
        pages: source_pages.clone(),
        digests,
    };
    let streams32 = u32::try_from(streams).map_err(|x| e(&x))?;
    let decode =
        PagePool::host(c"kvbench-decode", g, pages * streams32, options).map_err(|x| e(&x))?;
    let page_len = u32::try_from(page_bytes).map_err(|x| e(&x))?;
    let cpu0 = process_cpu();
    let interval = Interval::start();
    let pull = || -> Result<(u64, Usage), String> {
        let stream = TcpStream::connect(server.local_addr()).map_err(|x| e(&x))?;
        tcp::prepare(&stream).map_err(|x| e(&x))?;
        let u0 = thread_usage().unwrap_or_default();
        let (mut bytes, mut runs) = (0u64, 0u32);
        while runs < 5 || interval.start.elapsed().as_secs_f64() < seconds {
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
            let kv = res.verify(&manifest).map_err(|x| e(&x))?;
            drop(kv);
            bytes += total;
            runs += 1;
        }
        let u1 = thread_usage().unwrap_or_default();
        Ok((bytes, (u1.0 - u0.0, u1.1 - u0.1, u1.2 - u0.2)))
    };
    let results: Vec<Result<(u64, Usage), String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..streams).map(|_| scope.spawn(pull)).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a pull panicked".into())))
            .collect()
    });
    let (wall, pressure) = interval.end();
    let cpu = process_cpu().zip(cpu0).map(|(b, a)| b - a);
    let (mut bytes, mut recv) = (0u64, (0.0, 0.0, 0u64));
    for r in results {
        let (b, u) = r?;
        bytes += b;
        recv = (recv.0 + u.0, recv.1 + u.1, recv.2 + u.2);
    }
    let gib = bytes as f64 / f64::from(1u32 << 30);
    let cost = Cost {
        recv_user: recv.0 / gib,
        recv_system: recv.1 / gib,
        send: cpu.map_or(0.0, |c| (c - recv.0 - recv.1).max(0.0) / gib),
        reads_per_mib: recv.2 as f64 / (bytes as f64 / f64::from(1u32 << 20)),
    };
    Ok((
        Run {
            rate: bytes as f64 / wall,
            pressure,
            before,
            after: None,
        },
        cost,
    ))
}

/// iperf3's received bytes per second over 127.0.0.1, with `streams` parallel streams
/// (`-P`), and where its time went (its own CPU report).
fn iperf3(seconds: u32, streams: usize) -> Result<(Run, Cost), String> {
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
    // A probe connection would count as the one-shot server's client: give it time instead
    // (the idle pressure sample takes that time).
    let before = background();
    let interval = Interval::start();
    let out = Command::new("timeout")
        .args([
            &(seconds + 20).to_string(),
            "iperf3",
            "-c",
            "127.0.0.1",
            "-p",
            &port,
        ])
        .args(["-t", &seconds.to_string(), "-P", &streams.to_string(), "-J"])
        .output()
        .map_err(|e| e.to_string());
    let (_, pressure) = interval.end();
    let _ = server.kill();
    let _ = server.wait();
    let out = out?;
    let json: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("iperf3 output: {e}"))?;
    let end = &json["end"];
    let rate = end["sum_received"]["bits_per_second"]
        .as_f64()
        .ok_or_else(|| format!("no end.sum_received in iperf3 output: {}", json["error"]))?
        / 8.0;
    // CPU use in percent of one CPU over the test, of the client (sender) and the server.
    let cpu = &end["cpu_utilization_percent"];
    let pct = |k: &str| cpu[k].as_f64().unwrap_or(0.0) / 100.0 * f64::from(seconds);
    let gib = rate * f64::from(seconds) / f64::from(1u32 << 30);
    let cost = Cost {
        recv_user: pct("remote_user") / gib,
        recv_system: pct("remote_system") / gib,
        send: pct("host_total") / gib,
        // iperf3 reads 128 KiB at a time over TCP by default.
        reads_per_mib: 0.0,
    };
    Ok((
        Run {
            rate,
            pressure,
            before,
            after: None,
        },
        cost,
    ))
}

/// Checks that `bin` is an executable (ELF) rather than the package's launcher script, which
/// would run the benchmark as a grandchild that stopping the launcher leaves behind.
fn mooncake_binary(bin: &Path) -> Result<(), String> {
    let mut magic = [0u8; 4];
    std::fs::File::open(bin)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map_err(|e| format!("{}: {e}", bin.display()))?;
    if &magic != b"\x7fELF" {
        return Err(format!(
            "{} is not the transfer_engine_bench executable (a launcher script?); pass the \
             one inside the mooncake package directory",
            bin.display()
        ));
    }
    Ok(())
}

/// The flags every Mooncake run gets: loopback only, no metadata server, two threads.
fn mooncake_common(buffer: u64) -> Vec<String> {
    vec![
        "--metadata_server=P2PHANDSHAKE".into(),
        "--local_server_name=127.0.0.1".into(),
        "--protocol=tcp".into(),
        format!("--threads={MOONCAKE_THREADS}"),
        format!("--buffer_size={buffer}"),
        "--logtostderr".into(),
    ]
}

/// Stops a process started under `timeout` by its own id: `timeout` passes SIGTERM on to the
/// benchmark and sends SIGKILL 5 s later if it is still running.
fn stop(child: &mut Child) {
    if let Ok(id) = i32::try_from(child.id()) {
        let _ = kill(Pid::from_raw(id), Signal::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The port of the target's handshake listener, from its log line
/// "... P2P handshake, listening on 127.0.0.1:PORT".
fn handshake_port(line: &str) -> Option<u16> {
    let rest = line.split("listening on 127.0.0.1:").nth(1)?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Bytes per second from the initiator's summary line
/// "Test completed: duration D, batch count N, throughput X MB/s".
fn mooncake_throughput(log: &str) -> Option<f64> {
    let line = log.lines().find(|l| l.contains("Test completed:"))?;
    let rest = line.split("throughput ").nth(1)?;
    let mut words = rest.split_whitespace();
    let value: f64 = words.next()?.parse().ok()?;
    (words.next()? == "MB/s").then_some(value * 1e6)
}

/// The last lines of a log, for error messages.
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(3)..].join(" | ")
}

/// Mooncake's initiator moving batches of `batch` blocks of `block` bytes to (or from) its
/// target over TCP on 127.0.0.1 for `seconds`, by its own report.
fn mooncake(
    bin: &Path,
    operation: &str,
    block: u64,
    batch: u64,
    seconds: &str,
) -> Result<Run, String> {
    // Each thread works on its own `batch * block` bytes of the buffer on both sides.
    let buffer = block * batch * MOONCAKE_THREADS;
    let mut target = Command::new("timeout")
        .args(["--kill-after=5", "120"])
        .arg(bin)
        .arg("--mode=target")
        .args(mooncake_common(buffer))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting the target: {e}"))?;
    let (tx, rx) = mpsc::channel();
    let stderr = target.stderr.take().ok_or("no target stderr")?;
    // Keeps reading the target's log until it exits, so that it never blocks on a full pipe.
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut seen = String::new();
    let port = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                if let Some(port) = handshake_port(&line) {
                    break Ok(port);
                }
                seen.push_str(&line);
                seen.push('\n');
            }
            Err(_) => break Err(format!("target did not start: {}", tail(&seen))),
        }
    };
    let result = port.and_then(|port| {
        let before = background();
        let interval = Interval::start();
        let out = Command::new("timeout")
            .args(["--kill-after=5", "60"])
            .arg(bin)
            .arg("--mode=initiator")
            .args(mooncake_common(buffer))
            .arg(format!("--segment_id=127.0.0.1:{port}"))
            .arg(format!("--operation={operation}"))
            .arg(format!("--block_size={block}"))
            .arg(format!("--batch_size={batch}"))
            .arg(format!("--duration={seconds}"))
            .args(["--report_unit=MB", "--report_precision=1"])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("starting the initiator: {e}"))?;
        let (_, pressure) = interval.end();
        let log = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        match mooncake_throughput(&log) {
            Some(rate) if out.status.success() => Ok(Run {
                rate,
                pressure,
                before,
                after: None,
            }),
            _ => Err(format!("initiator ({}): {}", out.status, tail(&log))),
        }
    });
    stop(&mut target);
    let _ = reader.join();
    result
}

/// One case: `total` bytes per pull in `page_kib` KiB pages.
struct Case {
    page_kib: u32,
    total: u64,
}

impl Case {
    fn name(&self) -> String {
        format!(
            "{:>2} MiB in {:>4} KiB pages",
            self.total >> 20,
            self.page_kib
        )
    }
}

/// Who ran: iperf3 with `s` streams, the page path in case `c` on `s` connections, or
/// Mooncake's operation `o` in case `c`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Who {
    Iperf(usize),
    PagePath(usize, usize),
    Mooncake(usize, usize),
}

/// Every run in the order they ran, so that each run's "after" is the next one's "before".
#[derive(Default)]
struct Log(Vec<(Who, Run, Cost)>);

impl Log {
    fn push(&mut self, who: Who, run: Run) {
        self.push_cost(who, run, Cost::default());
    }

    fn push_cost(&mut self, who: Who, run: Run, cost: Cost) {
        if let Some((_, last, _)) = self.0.last_mut() {
            last.after = run.before;
        }
        self.0.push((who, run, cost));
    }

    /// Samples the idle moment after the last run.
    fn close(&mut self) {
        if let Some((_, last, _)) = self.0.last_mut() {
            last.after = background();
        }
    }

    fn summary(&self, who: Who, quiet: f64) -> Option<Summary> {
        let runs: Vec<Run> = self
            .0
            .iter()
            .filter(|(w, _, _)| *w == who)
            .map(|(_, r, _)| *r)
            .collect();
        Summary::of(&runs, quiet)
    }

    /// The median of each cost figure over the quiet runs of `who` (all runs if none).
    fn cost(&self, who: Who, quiet: f64) -> Option<Cost> {
        let all: Vec<&(Who, Run, Cost)> = self.0.iter().filter(|(w, _, _)| *w == who).collect();
        let calm: Vec<Cost> = all
            .iter()
            .filter(|(_, r, _)| r.quiet(quiet))
            .map(|(_, _, c)| *c)
            .collect();
        let v = if calm.is_empty() {
            all.iter().map(|(_, _, c)| *c).collect()
        } else {
            calm
        };
        if v.is_empty() {
            return None;
        }
        let med = |f: fn(&Cost) -> f64| {
            let mut x: Vec<f64> = v.iter().map(f).collect();
            x.sort_by(f64::total_cmp);
            x[x.len() / 2]
        };
        Some(Cost {
            recv_user: med(|c| c.recv_user),
            recv_system: med(|c| c.recv_system),
            send: med(|c| c.send),
            reads_per_mib: med(|c| c.reads_per_mib),
        })
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(op) = args
        .mooncake_operation
        .iter()
        .find(|op| !["read", "write"].contains(&op.as_str()))
    {
        eprintln!("kvtcpbench: --mooncake-operation: {op} is neither read nor write");
        return ExitCode::from(2);
    }
    if args.streams.is_empty() || args.streams.contains(&0) {
        eprintln!("kvtcpbench: --streams: give one or more counts of at least 1");
        return ExitCode::from(2);
    }
    let mooncake_bin = match &args.mooncake {
        None => None,
        Some(bin) => match mooncake_binary(bin) {
            Ok(()) => Some(bin.clone()),
            Err(e) => {
                println!("mooncake: not measured: {e}");
                None
            }
        },
    };
    let ops: &[String] = if mooncake_bin.is_some() {
        &args.mooncake_operation
    } else {
        &[]
    };
    let mooncake_seconds = format!("{:.0}", args.seconds.ceil().max(1.0));
    if args.page_kib.iter().any(|&k| k < 32 || k % 32 != 0) || args.batch_mib.contains(&0) {
        eprintln!("kvtcpbench: pages are whole multiples of 32 KiB, batches at least 1 MiB");
        return ExitCode::from(2);
    }
    let cases: Vec<Case> = args
        .page_kib
        .iter()
        .flat_map(|&page_kib| {
            args.batch_mib.iter().map(move |&mib| Case {
                page_kib,
                total: mib << 20,
            })
        })
        .filter(|c| c.total >= u64::from(c.page_kib) << 10)
        .collect();
    let mut log = Log::default();
    let rounds = args.rounds.max(1);
    let progress = libkv::progress::bar(u64::from(rounds), "rounds");
    for round in 1..=rounds {
        progress.inc(1);
        progress.suspend(|| println!("round {round}/{rounds}"));
        for &streams in &args.streams {
            match iperf3(args.iperf_seconds, streams) {
                Ok((r, cost)) => {
                    println!("  iperf3 -P {streams} loopback: {r}; {cost}");
                    log.push_cost(Who::Iperf(streams), r, cost);
                }
                Err(e) => println!("  iperf3 -P {streams} loopback: not measured: {e}"),
            }
        }
        for (c, case) in cases.iter().enumerate() {
            for &streams in &args.streams {
                match page_path(case.page_kib, case.total, args.seconds, streams) {
                    Ok((r, cost)) => {
                        println!("  page path x{streams}   {}: {r}; {cost}", case.name());
                        log.push_cost(Who::PagePath(c, streams), r, cost);
                    }
                    Err(e) => {
                        eprintln!("kvtcpbench: page path {}: {e}", case.name());
                        return ExitCode::from(1);
                    }
                }
            }
            let Some(bin) = &mooncake_bin else {
                continue;
            };
            // Blocks of the page size, batches of the bytes one pull moves.
            let block = u64::from(case.page_kib) << 10;
            let batch = case.total / block;
            for (o, op) in ops.iter().enumerate() {
                let name = format!("mooncake {op:<5} {}", case.name());
                match mooncake(bin, op, block, batch, &mooncake_seconds) {
                    Ok(r) => {
                        println!("  {name}: {r}");
                        log.push(Who::Mooncake(c, o), r);
                    }
                    Err(e) => println!("  {name}: not measured: {e}"),
                }
            }
        }
    }
    progress.finish_and_clear();
    log.close();

    let quiet = args.quiet_pressure;
    println!(
        "median GiB/s of the quiet runs (CPU pressure before and after <= {quiet:.2}) \
         [quiet/all runs]:"
    );
    let iperf: Vec<(usize, Option<Summary>)> = args
        .streams
        .iter()
        .map(|&s| (s, log.summary(Who::Iperf(s), quiet)))
        .collect();
    for (streams, i) in &iperf {
        match i {
            Some(i) => println!("  iperf3 -P {streams} loopback: {}", i.show()),
            None => println!("  iperf3 -P {streams} loopback: not measured"),
        }
    }
    for (c, case) in cases.iter().enumerate() {
        for &streams in &args.streams {
            let Some(k) = log.summary(Who::PagePath(c, streams), quiet) else {
                continue;
            };
            let mut line = format!("  page path x{streams} {}: {}", case.name(), k.show());
            for (s, i) in &iperf {
                if let Some(i) = i {
                    line += &format!(", {:.2} of iperf3 -P {s}", k.median / i.median);
                }
            }
            if streams == 1 {
                for (o, op) in ops.iter().enumerate() {
                    match log.summary(Who::Mooncake(c, o), quiet) {
                        Some(m) => {
                            line += &format!(
                                ", {:.2}x mooncake {op} ({})",
                                k.median / m.median,
                                m.show()
                            );
                        }
                        None => line += &format!(", mooncake {op} not measured"),
                    }
                }
            }
            println!("{line}");
        }
    }
    println!("where the time goes (medians of the same runs):");
    for &streams in &args.streams {
        if let Some(cost) = log.cost(Who::Iperf(streams), quiet) {
            println!("  iperf3 -P {streams}: {cost}");
        }
    }
    for (c, case) in cases.iter().enumerate() {
        for &streams in &args.streams {
            if let Some(cost) = log.cost(Who::PagePath(c, streams), quiet) {
                println!("  page path x{streams} {}: {cost}", case.name());
            }
        }
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mooncake_logs() {
        let target = "I1202 15:00:32.348415 17734 transfer_engine_impl.cpp:183] Transfer \
                      Engine RPC using P2P handshake, listening on 127.0.0.1:16989";
        assert_eq!(handshake_port(target), Some(16989));
        assert_eq!(handshake_port("TcpTransport: listen on port 16838"), None);
        let initiator = "I1202 x.cpp:440] Worker 0 stopped!\n\
                         I1202 x.cpp:569] Test completed: duration 2.01, batch count 1393, \
                         throughput 727.8 MB/s\n";
        assert_eq!(mooncake_throughput(initiator), Some(727.8e6));
        assert_eq!(mooncake_throughput("throughput 0.79 GB/s"), None);
    }

    #[test]
    fn summary_prefers_quiet_runs() {
        let run = |rate, p| Run {
            rate,
            pressure: Some(1.0),
            before: Some(0.0),
            after: Some(p),
        };
        let s = Summary::of(&[run(1.0, 0.9), run(3.0, 0.1), run(5.0, 0.2)], 0.3).unwrap();
        assert_eq!((s.median, s.quiet, s.all), (4.0, 2, 3));
        let s = Summary::of(&[run(1.0, 0.9), run(2.0, 0.8), run(9.0, 0.7)], 0.3).unwrap();
        assert_eq!((s.median, s.quiet, s.all), (2.0, 0, 3));
        assert!(Summary::of(&[], 0.3).is_none());
    }

    #[test]
    fn a_run_is_quiet_only_if_the_next_one_started_quiet() {
        let run = |rate, before| Run {
            rate,
            pressure: Some(0.9),
            before: Some(before),
            after: None,
        };
        let mut log = Log::default();
        log.push(Who::PagePath(0, 1), run(1.0, 0.0));
        log.push(Who::Mooncake(0, 0), run(2.0, 0.8));
        log.push(Who::PagePath(0, 1), run(3.0, 0.0));
        let s = log.summary(Who::PagePath(0, 1), 0.3).unwrap();
        assert_eq!((s.median, s.quiet, s.all), (3.0, 1, 2));
        let s = log.summary(Who::Mooncake(0, 0), 0.3).unwrap();
        assert_eq!((s.quiet, s.all), (0, 1));
    }
}
