//! kvctl: the command-line client of kvctld, and the local demo.
//!
//! ```text
//! kvctl [--socket PATH | --config PATH] [--json] generate --tenant T [--max-new N] [--deadline-ms MS] PROMPT
//! kvctl [--socket PATH | --config PATH] [--json] status
//! kvctl [--json] demo [--requests N] [--keep-dir]
//! ```
//!
//! Exit codes (see `kvctld::client::exit`): 0 ok, 1 usage or bad request, 3 rejected,
//! 4 temporary (pool full, timeout, shutting down), 5 failed in the stack (verification,
//! worker lost, internal, protocol), 6 cannot connect or not allowed, 7 output mismatch,
//! 8 the demo's stack failed.

// Printing results to stdout is this binary's job.
#![allow(clippy::print_stdout)]

use clap::{Parser, Subcommand};
use kvctld::client::{Client, ClientError, GenerateOutcome, exit};
use kvctld::stack::{Daemon, Stack, StackError, StackOptions, error_chain};
use libkv::config::{Config, DEFAULT_SOCKET};
use libkv::model::{Output, ReferenceModel, detokenize, monolithic, tokenize};
use libkv::proto::{ErrorCode, Role, StatusReply, Transport, WorkerStatus};
use serde_json::json;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// Timeout of the handshake and of status queries.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Most client threads the demo runs at once.
const DEMO_MAX_THREADS: usize = 32;
/// Longest the demo waits for the pools to be all free once the requests are done.
const DEMO_DRAIN_WAIT: Duration = Duration::from_secs(3);
/// The demo's tenants, each with a secret its prompts carry and no other tenant may see.
const DEMO_TENANTS: [(&str, &str); 2] =
    [("acme", "ACME-7731-orchid"), ("globex", "GLX-0420-falcon")];

#[derive(Debug, Parser)]
#[command(
    name = "kvctl",
    version,
    about = "Client of kvctld, and the local kvfence demo"
)]
struct Cli {
    /// kvctld's control socket [default: the config's, else /run/kvfence/kvctld.sock].
    #[arg(long, global = true, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Read the socket path and deadlines from this config file.
    #[arg(long, global = true, value_name = "PATH")]
    config: Option<PathBuf>,
    /// Print machine-readable JSON on stdout.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one request; streams the output to stdout.
    Generate {
        /// Tenant the request belongs to ([A-Za-z0-9_.-], 1 to 64 bytes).
        #[arg(long)]
        tenant: String,
        /// Most tokens to generate.
        #[arg(long = "max-new", default_value_t = 32)]
        max_new: u32,
        /// Request deadline in milliseconds [default: kvctld's].
        #[arg(long = "deadline-ms")]
        deadline_ms: Option<u32>,
        /// The prompt (bytes are tokens).
        prompt: String,
    },
    /// Show workers, pools, limits and counters.
    Status,
    /// Send canary requests through the live system and check every output against the
    /// monolithic model (needs --config for the model geometry). Exits 7 on any mismatch.
    Probe {
        /// New tokens per canary.
        #[arg(long = "max-new", default_value_t = 24)]
        max_new: u32,
    },
    /// Start a local stack, run requests of two tenants concurrently, check every output
    /// against the monolithic model, submit an oversize request, and stop the stack.
    Demo {
        /// Requests to run.
        #[arg(long, default_value_t = 8)]
        requests: usize,
        /// Keep the stack's directory (config and daemon logs).
        #[arg(long = "keep-dir")]
        keep_dir: bool,
    },
}

/// A failure of a subcommand, with its exit code.
#[derive(Debug)]
struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    fn new(code: u8, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
        }
    }
}

impl From<ClientError> for Failure {
    fn from(e: ClientError) -> Failure {
        Failure::new(e.exit_code(), error_chain(&e))
    }
}

impl From<StackError> for Failure {
    fn from(e: StackError) -> Failure {
        Failure::new(exit::STACK, format!("local stack: {}", error_chain(&e)))
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() {
                exit::USAGE
            } else {
                exit::OK
            });
        }
    };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    match run(&cli) {
        Ok(()) => ExitCode::from(exit::OK),
        Err(f) => {
            eprintln!("kvctl: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}

fn run(cli: &Cli) -> Result<(), Failure> {
    match &cli.command {
        Command::Generate {
            tenant,
            max_new,
            deadline_ms,
            prompt,
        } => generate(cli, tenant, *max_new, deadline_ms.unwrap_or(0), prompt),
        Command::Status => status(cli),
        Command::Probe { max_new } => probe(cli, *max_new),
        Command::Demo { requests, keep_dir } => demo(cli.json, *requests, *keep_dir),
    }
}

/// Connects to the socket given by `--socket`, else the config's, else the default, with
/// the config's default request deadline when there is one.
fn connect(cli: &Cli) -> Result<Client, Failure> {
    let config = match &cli.config {
        Some(path) => {
            Some(Config::load(path).map_err(|e| Failure::new(exit::USAGE, error_chain(&e)))?)
        }
        None => None,
    };
    let socket = cli
        .socket
        .clone()
        .or_else(|| config.as_ref().map(|c| c.control.socket.clone()))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET));
    let mut client = Client::connect(&socket, CONNECT_TIMEOUT)?;
    if let Some(c) = &config {
        client.set_default_deadline(c.deadlines.request() + c.deadlines.admission_wait());
    }
    Ok(client)
}

fn generate(
    cli: &Cli,
    tenant: &str,
    max_new: u32,
    deadline_ms: u32,
    prompt: &str,
) -> Result<(), Failure> {
    let mut client = connect(cli)?;
    let stream = !cli.json;
    let mut stdout = std::io::stdout().lock();
    let start = Instant::now();
    let mut streamed = false;
    let result = client.generate(tenant, prompt.as_bytes(), max_new, deadline_ms, |tokens| {
        if stream {
            streamed = true;
            // Tokens are bytes; write them raw so multi-byte characters split across
            // frames come out whole. Output is best effort: a closed stdout must not stop
            // the request.
            let bytes: Vec<u8> = tokens
                .iter()
                .map(|&t| u8::try_from(t).unwrap_or(b'?'))
                .collect();
            let _ = stdout.write_all(&bytes);
            let _ = stdout.flush();
        }
    });
    let elapsed = start.elapsed();
    let out = match result {
        Ok(out) => out,
        Err(e) => {
            if streamed {
                let _ = writeln!(stdout);
            } else if !stream {
                let failure = json!({
                    "tenant": tenant,
                    "error": error_chain(&e),
                    "code": e.server_code().map(|c| c.to_string()),
                    "exit_code": e.exit_code(),
                });
                let _ = writeln!(stdout, "{failure}");
            }
            return Err(e.into());
        }
    };
    let d = &out.done;
    if stream {
        let _ = writeln!(stdout);
    } else {
        let value = json!({
            "request": out.request.0,
            "tenant": tenant,
            "output": detokenize(&out.tokens),
            "tokens": out.tokens,
            "signature": format!("{:016x}", d.signature),
            "pages_transferred": d.pages_transferred,
            "bytes_transferred": d.bytes_transferred,
            "elapsed_us": d.elapsed_us,
        });
        let _ = writeln!(stdout, "{value}");
    }
    eprintln!(
        "{}: {} tokens, signature {:016x}, {} pages ({} bytes) transferred, {} us in the stack, {} us end to end",
        out.request,
        d.tokens,
        d.signature,
        d.pages_transferred,
        d.bytes_transferred,
        d.elapsed_us,
        elapsed.as_micros()
    );
    Ok(())
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Client => "client",
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

/// Tokens one largest request needs in the pool of `role`.
fn request_tokens(status: &StatusReply, role: Role) -> u64 {
    let context = u64::from(status.max_context);
    match role {
        Role::Decode => context + u64::from(status.max_new_tokens),
        Role::Prefill | Role::Client => context,
    }
}

fn capacity_tokens(w: &WorkerStatus) -> u64 {
    u64::from(w.pool_pages) * u64::from(w.tokens_per_page)
}

fn transport_name(t: Transport) -> &'static str {
    match t {
        Transport::Shm => "shm",
        Transport::Tcp => "tcp",
        Transport::Rdma => "rdma",
    }
}

fn status(cli: &Cli) -> Result<(), Failure> {
    let mut client = connect(cli)?;
    let s = client.status()?;
    if cli.json {
        let workers: Vec<_> = s
            .workers
            .iter()
            .map(|w| {
                json!({
                    "role": role_name(w.role),
                    "connected": w.connected,
                    "pool_pages": w.pool_pages,
                    "tokens_per_page": w.tokens_per_page,
                    "capacity_tokens": capacity_tokens(w),
                    "request_tokens": request_tokens(&s, w.role),
                    "free": w.free,
                    "reserved": w.reserved,
                    "writing": w.writing,
                    "readable": w.readable,
                    "draining": w.draining,
                })
            })
            .collect();
        let counters: serde_json::Map<String, serde_json::Value> = s
            .counters
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        let value = json!({
            "generation": s.generation.0,
            "max_context": s.max_context,
            "max_new_tokens": s.max_new_tokens,
            "transport": s.transport.map(transport_name),
            "workers": workers,
            "counters": counters,
        });
        println!("{value}");
        return Ok(());
    }
    println!("kvctld generation {}", s.generation.0);
    println!(
        "limits: max_context {} tokens, max_new_tokens {}",
        s.max_context, s.max_new_tokens
    );
    println!(
        "transport: {}",
        s.transport
            .map_or("none yet (workers not both registered)", transport_name)
    );
    println!(
        "{:<8} {:<5} {:>7} {:>7} {:>8} {:>7} {:>8} {:>8}  capacity vs one largest request",
        "worker", "conn", "pages", "free", "reserved", "writing", "readable", "draining"
    );
    for role in [Role::Prefill, Role::Decode] {
        let Some(w) = s.workers.iter().find(|w| w.role == role) else {
            println!("{:<8} not registered", role_name(role));
            continue;
        };
        let cap = capacity_tokens(w);
        let need = request_tokens(&s, role);
        let what = match role {
            Role::Decode => "max_context + max_new_tokens",
            Role::Prefill | Role::Client => "max_context",
        };
        println!(
            "{:<8} {:<5} {:>7} {:>7} {:>8} {:>7} {:>8} {:>8}  {cap} tokens ({} pages of {}) vs {what} = {need}: {} at once",
            role_name(role),
            if w.connected { "yes" } else { "no" },
            w.pool_pages,
            w.free,
            w.reserved,
            w.writing,
            w.readable,
            w.draining,
            w.pool_pages,
            w.tokens_per_page,
            cap.checked_div(need).unwrap_or(0),
        );
    }
    if !s.counters.is_empty() {
        println!("counters:");
        let width = s.counters.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        for (k, v) in &s.counters {
            println!("  {k:<width$} {v}");
        }
    }
    Ok(())
}

/// One demo request and what came of it.
#[derive(Debug)]
struct DemoRun {
    index: usize,
    tenant: &'static str,
    prompt: String,
    expected: Output,
    result: Result<GenerateOutcome, ClientError>,
    latency: Duration,
}

fn demo_prompt(index: usize) -> (&'static str, String) {
    let (tenant, secret) = DEMO_TENANTS[index % DEMO_TENANTS.len()];
    (
        tenant,
        format!("[{tenant} secret {secret}] request {index}: summarize our quarterly figures"),
    )
}

fn demo(json_out: bool, requests: usize, keep_dir: bool) -> Result<(), Failure> {
    let dir = tempfile::Builder::new()
        .prefix("kvfence-demo.")
        .tempdir_in("/tmp")
        .map_err(|e| Failure::new(exit::STACK, format!("creating a directory in /tmp: {e}")))?;
    let config = Config::embedded_default(dir.path().join("kvctld.sock"));
    let model = ReferenceModel::new(config.geometry)
        .map_err(|e| Failure::new(exit::STACK, format!("reference model: {e}")))?;
    let say = |line: String| {
        if !json_out {
            println!("{line}");
        }
    };
    say(format!(
        "kvfence demo: starting kvctld, prefilld and decoded in {}",
        dir.path().display()
    ));
    let opts = StackOptions::new(config.clone(), dir.path().to_path_buf())?;
    build_missing_daemons(&opts.bin_dir, json_out)?;
    let started = Stack::start(opts);
    let mut stack = match started {
        Ok(stack) => stack,
        Err(e) => {
            let kept = dir.keep();
            return Err(Failure::new(
                exit::STACK,
                format!(
                    "local stack: {} (logs kept in {})",
                    error_chain(&e),
                    kept.display()
                ),
            ));
        }
    };
    let pids: Vec<String> = stack
        .pids()
        .iter()
        .map(|(d, p)| format!("{d} pid {p}"))
        .collect();
    say(format!("stack up: {}", pids.join(", ")));

    let outcome = demo_run(&mut stack, &model, requests, json_out);

    let stop = stack.stop();
    let stop_line = match &stop {
        Ok(report) if report.is_clean() => "daemons stopped cleanly".to_owned(),
        Ok(report) => {
            let parts: Vec<String> = report
                .exits
                .iter()
                .map(|e| {
                    format!(
                        "{} {}{}",
                        e.daemon,
                        e.status,
                        if e.killed { " (killed)" } else { "" }
                    )
                })
                .collect();
            format!("daemons did not all stop cleanly: {}", parts.join(", "))
        }
        Err(e) => format!("stopping the daemons: {}", error_chain(e)),
    };
    let failed = outcome.is_err() || !matches!(&stop, Ok(r) if r.is_clean());
    let kept = if keep_dir || failed {
        Some(dir.keep())
    } else {
        drop(dir);
        None
    };
    match outcome {
        Ok(mut summary) => {
            if json_out {
                summary["stop"] = json!(stop_line);
                summary["dir"] = json!(kept.as_ref().map(|p| p.display().to_string()));
                println!("{summary}");
            } else {
                println!("{stop_line}");
                if let Some(k) = &kept {
                    println!("config and logs kept in {}", k.display());
                }
            }
            Ok(())
        }
        Err(f) => {
            eprintln!("{stop_line}");
            if let Some(k) = &kept {
                eprintln!("config and logs kept in {}", k.display());
            }
            Err(f)
        }
    }
}

/// Under `cargo run` (which builds only kvctl), builds the daemon binaries when they are
/// missing next to kvctl, with the same profile, so that `cargo run --bin kvctl -- demo`
/// works on a fresh checkout. Elsewhere, a missing binary is left to [`Stack::start`]'s
/// error, which names the command to run.
fn build_missing_daemons(bin_dir: &Path, json_out: bool) -> Result<(), Failure> {
    let missing = Daemon::ALL
        .iter()
        .any(|d| !bin_dir.join(d.binary()).is_file());
    let (Some(cargo), Some(manifest_dir)) = (
        std::env::var_os("CARGO"),
        std::env::var_os("CARGO_MANIFEST_DIR"),
    ) else {
        return Ok(());
    };
    let Some(profile) = bin_dir.file_name().and_then(|n| n.to_str()) else {
        return Ok(());
    };
    if !missing {
        return Ok(());
    }
    let profile = if profile == "debug" { "dev" } else { profile };
    let line = format!(
        "daemon binaries missing from {}: running `cargo build --workspace --bins --profile {profile}`",
        bin_dir.display()
    );
    if json_out {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
    let status = std::process::Command::new(cargo)
        .args(["build", "--workspace", "--bins", "--profile", profile])
        .current_dir(manifest_dir)
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(|e| Failure::new(exit::STACK, format!("running cargo build: {e}")))?;
    if !status.success() {
        return Err(Failure::new(
            exit::STACK,
            format!("cargo build --bins failed: {status}"),
        ));
    }
    Ok(())
}

/// Runs the requests and the oversize request against a started stack; the JSON summary,
/// or the failure with its exit code.
fn demo_run(
    stack: &mut Stack,
    model: &ReferenceModel,
    requests: usize,
    json_out: bool,
) -> Result<serde_json::Value, Failure> {
    let config = stack.config().clone();
    let max_new_limit = config.limits.max_new_tokens;
    let mut plan = Vec::with_capacity(requests);
    for index in 0..requests {
        let (tenant, prompt) = demo_prompt(index);
        let max_new = u32::try_from(prompt.len())
            .unwrap_or(u32::MAX)
            .min(max_new_limit);
        let expected = monolithic(model, &tokenize(prompt.as_bytes()), max_new)
            .map_err(|e| Failure::new(exit::STACK, format!("monolithic model: {e}")))?;
        plan.push((index, tenant, prompt, max_new, expected));
    }

    let next = AtomicUsize::new(0);
    let runs: Mutex<Vec<DemoRun>> = Mutex::new(Vec::with_capacity(requests));
    let threads = requests.clamp(1, DEMO_MAX_THREADS);
    let start = Instant::now();
    thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                let mut client: Option<Client> = None;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((index, tenant, prompt, max_new, expected)) = plan.get(i) else {
                        break;
                    };
                    let t0 = Instant::now();
                    let result = match client.take() {
                        Some(c) => Ok(c),
                        None => stack.client(),
                    }
                    .and_then(|mut c| {
                        let r = c.generate(tenant, prompt.as_bytes(), *max_new, 0, |_| {});
                        client = Some(c);
                        r
                    });
                    if result.is_err() {
                        // Connect afresh for the next request.
                        client = None;
                    }
                    let run = DemoRun {
                        index: *index,
                        tenant,
                        prompt: prompt.clone(),
                        expected: expected.clone(),
                        result,
                        latency: t0.elapsed(),
                    };
                    if let Ok(mut runs) = runs.lock() {
                        runs.push(run);
                    }
                }
            });
        }
    });
    let total = start.elapsed();
    let mut runs = runs.into_inner().unwrap_or_else(|p| p.into_inner());
    runs.sort_by_key(|r| r.index);

    let (mut ok, mut mismatched, mut failed) = (0usize, 0usize, 0usize);
    let (mut pages, mut bytes) = (0u64, 0u64);
    let mut first_failure: Option<u8> = None;
    let mut json_runs = Vec::new();
    for r in &runs {
        let expected_text = detokenize(&r.expected.tokens);
        match &r.result {
            Ok(o) => {
                let tokens_ok = o.tokens == r.expected.tokens;
                let sig_ok = o.done.signature == r.expected.signature;
                pages += u64::from(o.done.pages_transferred);
                bytes += o.done.bytes_transferred;
                let verdict = if tokens_ok && sig_ok {
                    ok += 1;
                    "ok"
                } else {
                    mismatched += 1;
                    "MISMATCH"
                };
                if !json_out {
                    println!(
                        "#{} {} {}: {verdict} (tokens {}, signature {}), {:.1} ms",
                        r.index,
                        r.tenant,
                        o.request,
                        if tokens_ok { "match" } else { "DIFFER" },
                        if sig_ok { "matches" } else { "DIFFERS" },
                        ms(r.latency)
                    );
                    println!("    output   {:?}", detokenize(&o.tokens));
                    println!("    expected {expected_text:?}");
                }
                json_runs.push(json!({
                    "index": r.index,
                    "tenant": r.tenant,
                    "request": o.request.0,
                    "prompt": r.prompt,
                    "output": detokenize(&o.tokens),
                    "expected": expected_text,
                    "tokens_match": tokens_ok,
                    "signature_match": sig_ok,
                    "signature": format!("{:016x}", o.done.signature),
                    "expected_signature": format!("{:016x}", r.expected.signature),
                    "pages_transferred": o.done.pages_transferred,
                    "bytes_transferred": o.done.bytes_transferred,
                    "elapsed_us": o.done.elapsed_us,
                    "latency_us": r.latency.as_micros(),
                }));
            }
            Err(e) => {
                failed += 1;
                let msg = error_chain(e);
                first_failure = first_failure.or(Some(e.exit_code()));
                if !json_out {
                    println!(
                        "#{} {}: FAILED after {:.1} ms: {msg}",
                        r.index,
                        r.tenant,
                        ms(r.latency)
                    );
                }
                json_runs.push(json!({
                    "index": r.index,
                    "tenant": r.tenant,
                    "prompt": r.prompt,
                    "error": msg,
                    "latency_us": r.latency.as_micros(),
                }));
            }
        }
    }

    // A prompt one token over max_context must be rejected, and nothing else.
    let oversize_len = usize::try_from(config.limits.max_context)
        .unwrap_or(usize::MAX)
        .saturating_add(1);
    let oversize_prompt = vec![b'x'; oversize_len];
    let oversize = stack
        .client()
        .and_then(|mut c| c.generate("acme", &oversize_prompt, 8, 0, |_| {}));
    let (rejected, oversize_line) = match &oversize {
        Err(ClientError::Server {
            code: ErrorCode::Rejected,
            message,
        }) => (true, format!("Rejected ({message})")),
        Err(e) => (
            false,
            format!("NOT REJECTED, failed instead: {}", error_chain(e)),
        ),
        Ok(o) => (
            false,
            format!("NOT REJECTED: answered {} tokens", o.tokens.len()),
        ),
    };
    if !json_out {
        println!(
            "oversize request ({oversize_len} tokens, max_context {}): {oversize_line}",
            config.limits.max_context
        );
    }

    // Every page must be back on the free lists once the requests are over.
    let pools_free = |s: &StatusReply| {
        s.workers.len() >= 2
            && s.workers.iter().all(|w| {
                w.connected
                    && w.free == w.pool_pages
                    && w.reserved + w.writing + w.readable + w.draining == 0
            })
    };
    let mut last_status = None;
    let drained = kvctld::stack::wait_until(DEMO_DRAIN_WAIT, || {
        let s = stack.status().ok()?;
        let free = pools_free(&s);
        last_status = Some(s);
        free.then_some(())
    })
    .is_some();
    let pools_line = match &last_status {
        Some(s) => s
            .workers
            .iter()
            .map(|w| {
                format!(
                    "{} {}/{} pages free",
                    role_name(w.role),
                    w.free,
                    w.pool_pages
                )
            })
            .collect::<Vec<_>>()
            .join(", "),
        None => "status unavailable".to_owned(),
    };

    let mut latencies: Vec<Duration> = runs.iter().map(|r| r.latency).collect();
    latencies.sort();
    let pct = |p: usize| {
        latencies
            .get((latencies.len().saturating_sub(1)) * p / 100)
            .copied()
            .unwrap_or_default()
    };
    let mean = latencies
        .iter()
        .sum::<Duration>()
        .checked_div(u32::try_from(latencies.len().max(1)).unwrap_or(u32::MAX))
        .unwrap_or_default();
    if !json_out {
        println!(
            "pools after the run: {pools_line}{}",
            if drained { "" } else { " (PAGES STILL HELD)" }
        );
        println!(
            "summary: {requests} requests from {} tenants: {ok} ok, {mismatched} mismatched, {failed} failed; oversize request {}",
            DEMO_TENANTS.len().min(requests),
            if rejected { "rejected" } else { "NOT rejected" }
        );
        println!("  transferred {pages} pages, {bytes} bytes of KV");
        println!(
            "  total {:.1} ms; latency mean {:.2} ms, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            ms(total),
            ms(mean),
            ms(pct(50)),
            ms(pct(99)),
            ms(pct(100))
        );
    }
    let summary = json!({
        "requests": json_runs,
        "oversize": {
            "tokens": oversize_len,
            "rejected": rejected,
            "detail": oversize_line,
        },
        "pools_drained": drained,
        "summary": {
            "ok": ok,
            "mismatched": mismatched,
            "failed": failed,
            "pages_transferred": pages,
            "bytes_transferred": bytes,
            "total_us": total.as_micros(),
            "latency_us": {
                "mean": mean.as_micros(),
                "p50": pct(50).as_micros(),
                "p99": pct(99).as_micros(),
                "max": pct(100).as_micros(),
            },
        },
    });
    if mismatched > 0 || !rejected {
        if json_out {
            println!("{summary}");
        }
        return Err(Failure::new(
            exit::MISMATCH,
            format!(
                "{mismatched} outputs mismatched{}",
                if rejected {
                    ""
                } else {
                    "; the oversize request was not rejected"
                }
            ),
        ));
    }
    if failed > 0 || !drained {
        if json_out {
            println!("{summary}");
        }
        let code = first_failure.unwrap_or(exit::FAILED);
        return Err(Failure::new(
            code,
            format!(
                "{failed} requests failed{}",
                if drained {
                    ""
                } else {
                    "; pages still held after the run: "
                }
            ) + if drained { "" } else { &pools_line },
        ));
    }
    Ok(summary)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// `kvctl probe`: canaries through the live system, compared with the monolithic path.
fn probe(cli: &Cli, max_new: u32) -> Result<(), Failure> {
    let Some(path) = &cli.config else {
        return Err(Failure::new(
            exit::USAGE,
            "probe needs --config: the model geometry comes from the deployment's config",
        ));
    };
    let config = Config::load(path).map_err(|e| Failure::new(exit::USAGE, error_chain(&e)))?;
    let socket = cli
        .socket
        .clone()
        .unwrap_or_else(|| config.control.socket.clone());
    let timeout = config.deadlines.request() + config.deadlines.admission_wait();
    let report =
        kvctld::probe::run_probe(&socket, config.geometry, max_new, timeout).map_err(|e| {
            let code = match e {
                kvctld::probe::ProbeError::Connect(ref c) => c.exit_code(),
                kvctld::probe::ProbeError::Model(_) => exit::USAGE,
            };
            Failure::new(code, error_chain(&e))
        })?;
    if cli.json {
        let v = serde_json::json!({
            "requests": report.requests,
            "matched": report.matched,
            "mismatches": report.mismatches,
            "errors": report.errors,
            "coherent": report.is_coherent(),
        });
        println!("{v}");
    } else {
        println!(
            "probe: {} of {} canaries matched the monolithic path",
            report.matched, report.requests
        );
        for m in &report.mismatches {
            println!("  MISMATCH {m}");
        }
        for e in &report.errors {
            println!("  error: {e}");
        }
    }
    if !report.mismatches.is_empty() {
        log::error!(
            "coherence probe: {} outputs differ from the monolithic path",
            report.mismatches.len()
        );
        return Err(Failure::new(
            exit::MISMATCH,
            "outputs differ from the monolithic path",
        ));
    }
    if !report.errors.is_empty() {
        return Err(Failure::new(
            exit::UNAVAILABLE,
            "some canaries failed; coherence not shown",
        ));
    }
    Ok(())
}
