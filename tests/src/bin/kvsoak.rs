//! kvsoak: the tenant-canary soak. Drives a live local stack (kvctld with `--prefill`
//! prefill and `--decode` decode workers, two of each by default, on shared memory) with many
//! tenants, each prompt carrying a per-tenant secret, random sizes including over-limit
//! ones, random client disconnects and tight deadlines, and far more concurrency than the
//! pools hold, with poison mode on so every stale read would show.
//!
//! It fails (exit 1) on any exposure: an output holding another tenant's secret or poison
//! bytes, an output different from the monolithic path, an over-limit request that was not
//! rejected, an unexpected error kind, an output from a worker the stack does not run, a
//! worker that served no request in a run of at least [`SPREAD_MIN_REQUESTS`], or a stack
//! that does not go idle with every page of every worker free once the load stops (waited
//! for up to [`IDLE_WITHIN`]). Bounded in count (`--requests`) and time (`--max-seconds`).

#![allow(clippy::print_stdout)]

use clap::Parser;
use kvctld::client::{Client, ClientError, GenerateOutcome};
use kvctld::stack::{Stack, StackOptions, error_chain};
use kvfence_tests::idle;
use libkv::RequestId;
use libkv::config::{Config, PoisonMode};
use libkv::model::{self, ReferenceModel};
use libkv::proto::{ErrorCode, Hello, Message, Role, Submit};
use libkv::sys::uds;
use std::collections::BTreeMap;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(name = "kvsoak", about = "tenant-canary soak of a live kvfence stack")]
struct Args {
    /// Requests to run in all.
    #[arg(long, default_value_t = 5000)]
    requests: u64,
    /// Distinct tenants.
    #[arg(long, default_value_t = 16)]
    tenants: u32,
    /// Client threads.
    #[arg(long, default_value_t = 24)]
    concurrency: u32,
    /// Stop issuing requests after this long, whatever the count.
    #[arg(long, default_value_t = 600)]
    max_seconds: u64,
    /// Seed of the random choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Prefill workers of the stack.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=64))]
    prefill: u16,
    /// Decode workers of the stack.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=64))]
    decode: u16,
}

/// In a run of at least this many requests, every worker must serve one.
const SPREAD_MIN_REQUESTS: u64 = 1000;

/// Longest the stack may take to go idle, every page free, once the load stops.
const IDLE_WITHIN: Duration = Duration::from_secs(15);

#[derive(Debug, Default)]
struct Tally {
    issued: AtomicU64,
    ok: AtomicU64,
    rejected: AtomicU64,
    pool_full: AtomicU64,
    timeouts: AtomicU64,
    disconnects: AtomicU64,
    exposures: AtomicU64,
    mismatches: AtomicU64,
    unexpected: AtomicU64,
    tokens: AtomicU64,
}

fn add(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// xorshift64*: deterministic per thread from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn secret(tenant: u32) -> String {
    format!(
        "SECRET-{tenant:03}-{:08x}",
        tenant.wrapping_mul(0x9E37_79B9)
    )
}

fn prompt_for(rng: &mut Rng, tenant: u32, len: usize) -> Vec<u8> {
    let s = secret(tenant);
    let mut p = Vec::with_capacity(len);
    while p.len() < len {
        if rng.below(4) == 0 {
            p.extend_from_slice(s.as_bytes());
        } else {
            p.push(b'a' + u8::try_from(rng.below(26)).unwrap_or(0));
        }
    }
    p.truncate(len.max(1));
    p
}

/// Most problems kept for the report.
const MAX_PROBLEMS: usize = 20;

fn log_problem(problems: &Mutex<Vec<String>>, msg: String) {
    let mut p = problems.lock().unwrap_or_else(|e| e.into_inner());
    if p.len() < MAX_PROBLEMS {
        p.push(msg);
    }
}

/// Submits and hangs up after the first reply frame (or none): a client that goes away.
fn submit_and_vanish(socket: &Path, tenant: &str, prompt: &[u8], max_new: u32, wait_one: bool) {
    let Ok(s) = UnixStream::connect(socket) else {
        return;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let send = |m: Message| m.encode(RequestId(0)).map(|f| uds::send_frame(&s, &f, &[]));
    let _ = send(Hello::new(Role::Client).into());
    let _ = uds::read_frame_timeout(&s, Duration::from_secs(5));
    let sub = Submit {
        tenant: tenant.into(),
        prompt: libkv::model::tokenize(prompt),
        max_new_tokens: max_new,
        deadline_ms: 0,
        sampling: libkv::proto::Sampling::GREEDY,
    };
    let _ = send(sub.into());
    if wait_one {
        let _ = uds::read_frame_timeout(&s, Duration::from_secs(5));
    }
}

/// What every client thread shares.
struct Load<'a> {
    args: &'a Args,
    socket: &'a Path,
    model: &'a ReferenceModel,
    secrets: &'a [String],
    max_context: usize,
    stop_at: Instant,
    tally: &'a Tally,
    problems: &'a Mutex<Vec<String>>,
    prefill_ids: &'a [String],
    decode_ids: &'a [String],
    /// Requests each worker of the stack served with the right output, by id.
    served: &'a Mutex<BTreeMap<String, u64>>,
    /// Requests issued, on a terminal.
    progress: &'a libkv::progress::ProgressBar,
}

impl Load<'_> {
    /// One client thread: requests until the count or the time is up.
    fn run(&self, t: u32) {
        let (args, tally, problems) = (self.args, self.tally, self.problems);
        let mut rng =
            Rng(args.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (u64::from(t) + 1) << 17 | 1);
        let mut client: Option<Client> = None;
        loop {
            let n = tally.issued.fetch_add(1, Ordering::Relaxed);
            if n >= args.requests || Instant::now() >= self.stop_at {
                break;
            }
            self.progress.inc(1);
            let tenant = u32::try_from(rng.below(u64::from(args.tenants))).unwrap_or(0);
            let name = format!("tenant{tenant}");
            let oversize = rng.below(20) == 0;
            let len = if oversize {
                self.max_context + 1 + usize::try_from(rng.below(64)).unwrap_or(0)
            } else {
                1 + usize::try_from(rng.below(self.max_context as u64)).unwrap_or(0)
            };
            let prompt = prompt_for(&mut rng, tenant, len);
            let max_new = 1 + u32::try_from(rng.below(32)).unwrap_or(0);
            let action = rng.below(100);
            if action < 4 && !oversize {
                add(&tally.disconnects);
                submit_and_vanish(self.socket, &name, &prompt, max_new, action < 2);
                continue;
            }
            let deadline_ms = if action < 8 {
                1 + u32::try_from(rng.below(20)).unwrap_or(0)
            } else {
                0
            };
            if client.is_none() {
                client = Client::connect(self.socket, Duration::from_secs(10)).ok();
            }
            let Some(c) = client.as_mut() else {
                add(&tally.unexpected);
                log_problem(problems, "cannot connect".into());
                continue;
            };
            match c.generate(
                &name,
                &libkv::model::tokenize(&prompt),
                max_new,
                deadline_ms,
                |_| {},
            ) {
                Ok(out) => {
                    if oversize {
                        add(&tally.exposures);
                        log_problem(
                            problems,
                            format!("over-limit prompt of {len} tokens was served"),
                        );
                        continue;
                    }
                    add(&tally.ok);
                    tally
                        .tokens
                        .fetch_add(out.tokens.len() as u64, Ordering::Relaxed);
                    self.check(tenant, &prompt, max_new, &out);
                }
                Err(e) => {
                    match e.server_code() {
                        Some(ErrorCode::Rejected) if oversize => add(&tally.rejected),
                        Some(ErrorCode::PoolFull) => add(&tally.pool_full),
                        Some(ErrorCode::Timeout) if deadline_ms > 0 => add(&tally.timeouts),
                        _ => {
                            add(&tally.unexpected);
                            log_problem(
                                problems,
                                format!(
                                    "unexpected error (oversize {oversize}, deadline \
                                     {deadline_ms}): {e}"
                                ),
                            );
                        }
                    }
                    if !matches!(e, ClientError::Server { .. }) {
                        client = None;
                    }
                }
            }
        }
    }

    /// Checks a served output: no foreign secret or poison, the monolithic path's tokens
    /// and signature, served by workers of the stack (counted for each).
    fn check(&self, tenant: u32, prompt: &[u8], max_new: u32, out: &GenerateOutcome) {
        let (tally, problems) = (self.tally, self.problems);
        let text = model::detokenize(&out.tokens);
        let foreign =
            self.secrets.iter().enumerate().any(|(i, sec)| {
                u32::try_from(i).ok() != Some(tenant) && text.contains(sec.as_str())
            });
        let bytes: Vec<u8> = out
            .tokens
            .iter()
            .map(|&t| u8::try_from(t).unwrap_or(0))
            .collect();
        let poison =
            bytes.windows(8).any(|w| w == b"KVPOISON") || out.tokens.iter().any(|&t| t > 0xFF);
        if foreign || poison {
            add(&tally.exposures);
            log_problem(
                problems,
                format!(
                    "{} exposed foreign={foreign} poison={poison}: {text:?}",
                    out.request
                ),
            );
        }
        match model::monolithic(self.model, &model::tokenize(prompt), max_new) {
            Ok(e) if e.tokens == out.tokens && e.signature == out.done.signature => {}
            _ => {
                add(&tally.mismatches);
                log_problem(
                    problems,
                    format!("{} differs from the monolithic path", out.request),
                );
            }
        }
        let pair = &out.pair;
        if self.prefill_ids.contains(&pair.prefill) && self.decode_ids.contains(&pair.decode) {
            let mut served = self.served.lock().unwrap_or_else(|e| e.into_inner());
            for id in [&pair.prefill, &pair.decode] {
                *served.entry(id.clone()).or_insert(0) += 1;
            }
        } else {
            add(&tally.unexpected);
            log_problem(
                problems,
                format!(
                    "{} served by {pair}, not a prefill and a decode worker of the stack",
                    out.request
                ),
            );
        }
    }
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = Args::parse();
    let dir = match tempfile::Builder::new().prefix("kvsoak").tempdir_in("/tmp") {
        Ok(d) => d,
        Err(e) => {
            eprintln!("kvsoak: temp dir: {e}");
            return ExitCode::from(2);
        }
    };
    let mut cfg = Config::embedded_default(dir.path().join("ctl.sock"));
    // Small pools and many clients: pages are reused constantly.
    cfg.limits.max_context = 512;
    cfg.limits.max_new_tokens = 32;
    cfg.prefill.pool_pages = 96;
    cfg.decode.pool_pages = 128;
    cfg.prefill.poison = PoisonMode::Owner;
    cfg.decode.poison = PoisonMode::Owner;
    cfg.deadlines.admission_wait = 10_000;
    let geometry = cfg.geometry;
    let max_context = cfg.limits.max_context as usize;
    let (prefill_pages, decode_pages) = (cfg.prefill.pool_pages, cfg.decode.pool_pages);
    let opts = match StackOptions::new(cfg, dir.path().join("stack")) {
        Ok(o) => o.with_workers(usize::from(args.prefill), usize::from(args.decode)),
        Err(e) => {
            eprintln!("kvsoak: {e}");
            return ExitCode::from(2);
        }
    };
    let mut stack = match Stack::start(opts) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvsoak: starting the stack: {}", error_chain(&e));
            return ExitCode::from(2);
        }
    };
    let prefill_ids = stack.worker_ids(Role::Prefill);
    let decode_ids = stack.worker_ids(Role::Decode);
    let ids = idle::worker_ids(&stack);
    let served = Mutex::new(
        ids.iter()
            .map(|id| (id.clone(), 0))
            .collect::<BTreeMap<String, u64>>(),
    );
    let socket = stack.socket().to_path_buf();
    let model = ReferenceModel::new(geometry).expect("embedded geometry fits the model");
    let tally = Tally::default();
    let problems = Mutex::new(Vec::new());
    let started = Instant::now();
    let secrets: Vec<String> = (0..args.tenants).map(secret).collect();
    let progress = libkv::progress::bar(args.requests, "requests");
    let load = Load {
        args: &args,
        socket: &socket,
        model: &model,
        secrets: &secrets,
        max_context,
        stop_at: started + Duration::from_secs(args.max_seconds),
        tally: &tally,
        problems: &problems,
        prefill_ids: &prefill_ids,
        decode_ids: &decode_ids,
        served: &served,
        progress: &progress,
    };
    std::thread::scope(|s| {
        for t in 0..args.concurrency {
            let load = &load;
            s.spawn(move || load.run(t));
        }
    });
    progress.finish_and_clear();
    let elapsed = started.elapsed();

    // Every page of every worker must come back once the load stops: waited for, since a
    // worker reports its pages after it frees them, after the last answer.
    let idle = idle::wait_idle(&stack, IDLE_WITHIN);
    let (status, leaked) = match &idle {
        Ok(s) => (Some(s.clone()), Some(0)),
        Err(e) => (stack.status().ok(), e.pages_not_free()),
    };
    let decode_counter = |name: &str| -> u64 {
        status.as_ref().map_or(0, |s| {
            s.workers
                .iter()
                .filter(|w| w.role == Role::Decode)
                .map(|w| idle::worker_counter(w, name))
                .sum()
        })
    };
    let verified = decode_counter("verified");
    let verify_failed = decode_counter("verify_failed");
    let pages_transferred = status
        .as_ref()
        .and_then(|s| idle::counter(s, "pages_transferred"))
        .unwrap_or(0);
    let stop = stack.stop();

    let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let issued = g(&tally.issued).min(args.requests);
    println!(
        "kvsoak: {issued} requests, {} tenants, {} clients, {} + {} workers, {:.1} s",
        args.tenants,
        args.concurrency,
        args.prefill,
        args.decode,
        elapsed.as_secs_f64()
    );
    println!(
        "  ok {} (tokens {}), rejected over-limit {}, pool-full {}, deadline timeouts {}, \
         client disconnects {}",
        g(&tally.ok),
        g(&tally.tokens),
        g(&tally.rejected),
        g(&tally.pool_full),
        g(&tally.timeouts),
        g(&tally.disconnects)
    );
    println!(
        "  pools: prefill {prefill_pages} pages, decode {decode_pages} pages each; pages \
         transferred {pages_transferred}, verified {verified}, verify failures {verify_failed}"
    );
    // Per worker: the requests it served with the right output, and kvctld's count of the
    // requests it completed (which also holds those whose client went away).
    let served = served.into_inner().unwrap_or_else(|e| e.into_inner());
    let mut idle_workers = Vec::new();
    let mut undercounted = Vec::new();
    for id in &ids {
        let n = served.get(id).copied().unwrap_or(0);
        let kvctld_count = status
            .as_ref()
            .and_then(|s| s.workers.iter().find(|w| &w.id == id))
            .map(|w| w.served);
        println!(
            "  {id}: served {n} (kvctld counts {})",
            kvctld_count.map_or("?".to_owned(), |c| c.to_string())
        );
        if n == 0 {
            idle_workers.push(id.clone());
        }
        if kvctld_count.is_some_and(|c| c < n) {
            undercounted.push(id.clone());
        }
    }
    println!(
        "  exposures {}, mismatches {}, unexpected errors {}, pages leaked {}",
        g(&tally.exposures),
        g(&tally.mismatches),
        g(&tally.unexpected),
        leaked.map_or("unknown".to_owned(), |n| n.to_string())
    );
    for p in problems.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        println!("  problem: {p}");
    }
    let spread_ok = issued < SPREAD_MIN_REQUESTS || idle_workers.is_empty();
    if !spread_ok {
        println!("  problem: in {issued} requests these workers served none: {idle_workers:?}");
    }
    if !undercounted.is_empty() {
        println!(
            "  problem: kvctld counts fewer requests served than the clients saw for \
             {undercounted:?}"
        );
    }
    if let Err(e) = &idle {
        println!("  problem: {}", e.message);
    }
    let clean_stop = matches!(&stop, Ok(r) if r.is_clean());
    if !clean_stop {
        println!("  daemons did not stop cleanly: {stop:?}");
    }
    // No fault is injected here: a verification failure means pages changed under a pull.
    let bad = g(&tally.exposures) + g(&tally.mismatches) + g(&tally.unexpected) + verify_failed;
    let pass = bad == 0
        && idle.is_ok()
        && spread_ok
        && undercounted.is_empty()
        && clean_stop
        && g(&tally.ok) > 0;
    if pass {
        println!("kvsoak: PASS");
        ExitCode::SUCCESS
    } else {
        println!("kvsoak: FAIL");
        ExitCode::from(1)
    }
}
