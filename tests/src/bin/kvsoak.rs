//! kvsoak: the tenant-canary soak. Drives a live local stack (kvctld, prefilld, decoded on
//! shared memory) with many tenants, each prompt carrying a per-tenant secret, random sizes
//! including over-limit ones, random client disconnects and tight deadlines, and far more
//! concurrency than the pools hold, with poison mode on so every stale read would show.
//!
//! It fails (exit 1) on any exposure: an output holding another tenant's secret or poison
//! bytes, an output different from the monolithic path, an over-limit request that was not
//! rejected, an unexpected error kind, or pages not all free at the end. Bounded in count
//! (`--requests`) and time (`--max-seconds`).

#![allow(clippy::print_stdout)]

use clap::Parser;
use kvctld::client::{Client, ClientError};
use kvctld::stack::{Stack, StackOptions, wait_until};
use libkv::RequestId;
use libkv::config::{Config, PoisonMode};
use libkv::model::{self, ReferenceModel};
use libkv::proto::{ErrorCode, Hello, Message, Role, Submit};
use libkv::sys::uds;
use std::os::unix::net::UnixStream;
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
}

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

fn log_problem(problems: &Mutex<Vec<String>>, msg: String) {
    let mut p = problems.lock().unwrap_or_else(|e| e.into_inner());
    if p.len() < 20 {
        p.push(msg);
    }
}

/// Submits and hangs up after the first reply frame (or none): a client that goes away.
fn submit_and_vanish(
    socket: &std::path::Path,
    tenant: &str,
    prompt: &[u8],
    max_new: u32,
    wait_one: bool,
) {
    let Ok(s) = UnixStream::connect(socket) else {
        return;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let send = |m: Message| m.encode(RequestId(0)).map(|f| uds::send_frame(&s, &f, &[]));
    let _ = send(Hello::new(Role::Client).into());
    let _ = uds::read_frame_timeout(&s, Duration::from_secs(5));
    let sub = Submit {
        tenant: tenant.into(),
        prompt: prompt.to_vec(),
        max_new_tokens: max_new,
        deadline_ms: 0,
    };
    let _ = send(sub.into());
    if wait_one {
        let _ = uds::read_frame_timeout(&s, Duration::from_secs(5));
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
        Ok(o) => o,
        Err(e) => {
            eprintln!("kvsoak: {e}");
            return ExitCode::from(2);
        }
    };
    let mut stack = match Stack::start(opts) {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "kvsoak: starting the stack: {}",
                kvctld::stack::error_chain(&e)
            );
            return ExitCode::from(2);
        }
    };
    let socket = stack.socket().to_path_buf();
    let model = ReferenceModel::new(geometry).expect("embedded geometry fits the model");
    let tally = Tally::default();
    let problems = Mutex::new(Vec::new());
    let started = Instant::now();
    let stop_at = started + Duration::from_secs(args.max_seconds);
    let secrets: Vec<String> = (0..args.tenants).map(secret).collect();

    std::thread::scope(|s| {
        for t in 0..args.concurrency {
            let (tally, problems, socket, model, secrets) =
                (&tally, &problems, &socket, &model, &secrets);
            let args = &args;
            s.spawn(move || {
                let mut rng = Rng(args.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (u64::from(t) + 1) << 17 | 1);
                let mut client: Option<Client> = None;
                loop {
                    let n = tally.issued.fetch_add(1, Ordering::Relaxed);
                    if n >= args.requests || Instant::now() >= stop_at {
                        break;
                    }
                    let tenant = u32::try_from(rng.below(u64::from(args.tenants))).unwrap_or(0);
                    let name = format!("tenant{tenant}");
                    let oversize = rng.below(20) == 0;
                    let len = if oversize {
                        max_context + 1 + usize::try_from(rng.below(64)).unwrap_or(0)
                    } else {
                        1 + usize::try_from(rng.below(max_context as u64)).unwrap_or(0)
                    };
                    let prompt = prompt_for(&mut rng, tenant, len);
                    let max_new = 1 + u32::try_from(rng.below(32)).unwrap_or(0);
                    let action = rng.below(100);
                    if action < 4 && !oversize {
                        add(&tally.disconnects);
                        submit_and_vanish(socket, &name, &prompt, max_new, action < 2);
                        continue;
                    }
                    let deadline_ms = if action < 8 { 1 + u32::try_from(rng.below(20)).unwrap_or(0) } else { 0 };
                    if client.is_none() {
                        client = Client::connect(socket, Duration::from_secs(10)).ok();
                    }
                    let Some(c) = client.as_mut() else {
                        add(&tally.unexpected);
                        log_problem(problems, "cannot connect".into());
                        continue;
                    };
                    match c.generate(&name, &prompt, max_new, deadline_ms, |_| {}) {
                        Ok(out) => {
                            if oversize {
                                add(&tally.exposures);
                                log_problem(problems, format!("over-limit prompt of {len} tokens was served"));
                                continue;
                            }
                            add(&tally.ok);
                            tally.tokens.fetch_add(out.tokens.len() as u64, Ordering::Relaxed);
                            let text = model::detokenize(&out.tokens);
                            let foreign = secrets.iter().enumerate().any(|(i, sec)| {
                                u32::try_from(i).ok() != Some(tenant) && text.contains(sec.as_str())
                            });
                            let bytes: Vec<u8> = out.tokens.iter().map(|&t| u8::try_from(t).unwrap_or(0)).collect();
                            let poison = bytes.windows(8).any(|w| w == b"KVPOISON") || out.tokens.iter().any(|&t| t > 0xFF);
                            if foreign || poison {
                                add(&tally.exposures);
                                log_problem(problems, format!("{} exposed foreign={foreign} poison={poison}: {text:?}", out.request));
                            }
                            let expected = model::monolithic(model, &model::tokenize(&prompt), max_new);
                            match expected {
                                Ok(e) if e.tokens == out.tokens && e.signature == out.done.signature => {}
                                _ => {
                                    add(&tally.mismatches);
                                    log_problem(problems, format!("{} differs from the monolithic path", out.request));
                                }
                            }
                        }
                        Err(e) => {
                            let code = e.server_code();
                            match code {
                                Some(ErrorCode::Rejected) if oversize => add(&tally.rejected),
                                Some(ErrorCode::PoolFull) => add(&tally.pool_full),
                                Some(ErrorCode::Timeout) if deadline_ms > 0 => add(&tally.timeouts),
                                _ => {
                                    add(&tally.unexpected);
                                    log_problem(problems, format!("unexpected error (oversize {oversize}, deadline {deadline_ms}): {e}"));
                                }
                            }
                            if !matches!(e, ClientError::Server { .. }) {
                                client = None;
                            }
                        }
                    }
                }
            });
        }
    });
    let elapsed = started.elapsed();

    // Every page must come back once the system is idle.
    let idle = wait_until(Duration::from_secs(15), || {
        let st = stack.status().ok()?;
        let in_flight = st
            .counters
            .iter()
            .find(|(n, _)| n == "in_flight")
            .map_or(1, |c| c.1);
        let all_free = st
            .workers
            .iter()
            .all(|w| w.connected && w.free == w.pool_pages);
        (in_flight == 0 && all_free).then_some(st)
    });
    let leaked = match &idle {
        Some(_) => 0,
        None => {
            let st = stack.status().ok();
            st.map_or(u64::MAX, |st| {
                st.workers
                    .iter()
                    .map(|w| u64::from(w.pool_pages - w.free.min(w.pool_pages)))
                    .sum()
            })
        }
    };
    let status = stack.status().ok();
    let counter = |name: &str| {
        status
            .as_ref()
            .and_then(|s| s.counters.iter().find(|(n, _)| n == name).map(|c| c.1))
            .unwrap_or(0)
    };
    let stop = stack.stop();

    let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let issued = g(&tally.issued).min(args.requests);
    println!(
        "kvsoak: {issued} requests, {} tenants, {} clients, {:.1} s",
        args.tenants,
        args.concurrency,
        elapsed.as_secs_f64()
    );
    println!(
        "  ok {} (tokens {}), rejected over-limit {}, pool-full {}, deadline timeouts {}, client disconnects {}",
        g(&tally.ok),
        g(&tally.tokens),
        g(&tally.rejected),
        g(&tally.pool_full),
        g(&tally.timeouts),
        g(&tally.disconnects)
    );
    println!(
        "  pools: prefill {prefill_pages} pages, decode {decode_pages} pages; pages transferred {}, verified {}, verify failures {}",
        counter("pages_transferred"),
        counter("decoded.verified"),
        counter("decoded.verify_failed")
    );
    println!(
        "  exposures {}, mismatches {}, unexpected errors {}, pages leaked {leaked}",
        g(&tally.exposures),
        g(&tally.mismatches),
        g(&tally.unexpected)
    );
    for p in problems.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        println!("  problem: {p}");
    }
    let clean_stop = matches!(&stop, Ok(r) if r.is_clean());
    if !clean_stop {
        println!("  daemons did not stop cleanly: {stop:?}");
    }
    // No fault is injected here: a verification failure means pages changed under a pull.
    let verify_failed = counter("decoded.verify_failed");
    let bad =
        g(&tally.exposures) + g(&tally.mismatches) + g(&tally.unexpected) + leaked + verify_failed;
    if bad == 0 && clean_stop && g(&tally.ok) > 0 {
        println!("kvsoak: PASS");
        ExitCode::SUCCESS
    } else {
        println!("kvsoak: FAIL");
        ExitCode::from(1)
    }
}
