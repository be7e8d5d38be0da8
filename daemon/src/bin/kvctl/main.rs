//! kvctl: the command-line client of kvctld, and the local demo.
//!
//! ```text
//! kvctl [--socket PATH | --config PATH] [--json] [-v] generate --tenant T [--max-new N] [--deadline-ms MS] [--chat] [--temperature X [--top-p P] [--seed S]] (PROMPT | --prompt-file PATH | -)
//! kvctl [--socket PATH | --config PATH] [--json] [-v] status
//! kvctl [--socket PATH | --config PATH] top [--interval-ms MS] [--iterations N]
//! kvctl [--socket PATH | --config PATH] [--json] drain ID [--wait [--timeout-ms MS]]
//! kvctl [--socket PATH | --config PATH] [--json] undrain ID
//! kvctl --config PATH [--json] probe [--max-new N]
//! kvctl [--json] demo [--requests N] [--prefill N] [--decode N] [--keep-dir] [--reference]
//! ```
//!
//! Prompts and outputs are text in the model of `--config`'s `[model]`: the GGUF model's
//! tokenizer, or bytes for the reference model (also without `--config`).
//!
//! `status` lists every worker kvctld knows (id, role, pool, requests in flight, drain
//! state, whether it is idle: a drained worker that is idle is safe to stop). `drain` keeps
//! new requests off a worker, `--wait` then waits until it is idle (exit 4 if it is not by
//! the timeout, exit 5 if the worker is lost first: what ran on it failed); `undrain` takes
//! it back. `top` ([`top`]) refreshes the workers, their
//! pages by state, request rates and mean stage latencies every interval.
//!
//! Exit codes (see `kvctld::client::exit`): 0 ok, 1 usage or bad request, 3 rejected,
//! 4 temporary (pool full, timeout, shutting down; a drain not idle in time), 5 failed in
//! the stack (verification, worker lost, internal, protocol), 6 cannot connect or not
//! allowed, 7 output mismatch, 8 the demo's stack failed.
//!
//! Output never panics: with stdout closed early (`kvctl status | head`) the rest is dropped
//! quietly. With `--json`, stdout carries exactly one JSON object, an `error` object when
//! the command failed (the message also goes to stderr).

use clap::{Parser, Subcommand};
use kvctld::client::{Client, ClientError, GenerateOutcome, ServingPair, exit};
use kvctld::stack::{Daemon, Stack, StackError, StackOptions, error_chain};
use libkv::config::{Config, DEFAULT_SOCKET, Deadlines};
use libkv::model::{Output, monolithic_paged};
use libkv::proto::{ErrorCode, Role, Sampling, StatusReply, Submit, Transport, WorkerStatus};
use llama::LoadedModel;
use model::Codec;
use serde_json::json;
use std::cmp::Ordering as CmpOrdering;
use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// Longest prompt text read: far more than any tokenizer packs into the most tokens one
/// request carries (the token count is checked after encoding).
const MAX_PROMPT_TEXT: usize = 16 * libkv::proto::MAX_PROMPT_TOKENS;
/// Timeout of the handshake and of status and drain queries.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often `drain --wait` asks kvctld whether the worker is idle.
const DRAIN_POLL: Duration = Duration::from_millis(100);
/// Most client threads the demo runs at once.
const DEMO_MAX_THREADS: usize = 32;
/// New tokens per request of the demo on a real model.
const DEMO_MAX_NEW: u32 = 24;
/// Longest the demo waits for the pools to be all free once the requests are done.
const DEMO_DRAIN_WAIT: Duration = Duration::from_secs(3);
/// Widest line of the demo's table of which pair served each request.
const DEMO_TABLE_WIDTH: usize = 100;
/// The demo's tenants, each with a secret its prompts carry and no other tenant may see.
const DEMO_TENANTS: [(&str, &str); 2] =
    [("acme", "ACME-7731-orchid"), ("globex", "GLX-0420-falcon")];

const AFTER_HELP: &str = "\
Commands for operators:
  kvctl status                  every worker: id, role, connected, pool pages and tokens,
                                free pages, requests in flight, transports, drain state and
                                STATE: busy, idle, draining, \"safe to stop\" (drained and
                                idle) or disconnected; then kvctld's counters (-v: each
                                worker's pages by state and its own counters)
  kvctl top                     live view: request rates, mean latency per stage, every
                                worker's pages by state (free, reserved, writing, readable,
                                draining) and requests served per second
  kvctl drain ID --wait         keep new requests off worker ID and wait until it is idle,
                                then stop it (systemctl stop prefilld@ID); exit 5 if it is
                                lost before (its requests in flight failed)
  kvctl undrain ID              let new requests reach worker ID again
                                (drain and undrain: root, kvctld's user or a uid of
                                [control] worker_uids; others are refused, exit 6)
  kvctl -v generate ...         also name the prefill and decode worker that served it

Exit codes: 0 ok, 1 usage or bad request, 3 rejected, 4 temporary (pool full, timeout,
shutting down, a drained worker not idle in time), 5 failed in the stack, 6 cannot connect
or not allowed, 7 output mismatch (probe, demo), 8 the demo's stack failed.";

#[derive(Debug, Parser)]
#[command(
    name = "kvctl",
    version,
    about = "Client of kvctld, and the local kvfence demo",
    after_help = AFTER_HELP
)]
struct Cli {
    /// kvctld's control socket [default: the config's, else /run/kvfence/kvctld.sock].
    #[arg(long, global = true, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Read the socket path and deadlines from this config file.
    #[arg(long, global = true, value_name = "PATH")]
    config: Option<PathBuf>,
    /// Print one machine-readable JSON object on stdout (an error object on failure).
    #[arg(long, global = true)]
    json: bool,
    /// More detail: which workers served a request; each worker's pages by state and
    /// counters in `status`.
    #[arg(short, long, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one request; streams the output to stdout, a summary to stderr (-v: which
    /// prefill and decode worker served it).
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
        /// Read the prompt from this file (`-`: standard input), for prompts too long for
        /// an argument.
        #[arg(long = "prompt-file", value_name = "PATH", conflicts_with = "prompt")]
        prompt_file: Option<PathBuf>,
        /// Send the prompt as one user message in the model's chat template (ChatML).
        #[arg(long)]
        chat: bool,
        /// Sample at this temperature (0 to 2) instead of decoding greedily.
        #[arg(long)]
        temperature: Option<f32>,
        /// With --temperature: keep the smallest set of tokens whose probability reaches
        /// this (0 to 1).
        #[arg(long = "top-p", requires = "temperature")]
        top_p: Option<f32>,
        /// With --temperature: the seed of the draws (one seed, one output).
        #[arg(long, requires = "temperature", default_value_t = 0)]
        seed: u64,
        /// The prompt, as text of the model of --config; `-` reads it from standard input.
        #[arg(required_unless_present = "prompt_file")]
        prompt: Option<String>,
    },
    /// Show every worker (pool, free pages, requests in flight, transports, drain state,
    /// whether it is safe to stop), limits and counters.
    Status,
    /// A live view of kvctld: request rates, mean latency per stage over the last interval,
    /// every worker's pages by state and requests served per second.
    Top {
        /// Refresh every this many milliseconds.
        #[arg(long = "interval-ms", default_value_t = 1000,
              value_parser = clap::value_parser!(u64).range(50..=3_600_000))]
        interval_ms: u64,
        /// Stop after this many frames [default: run until interrupted].
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        iterations: Option<u64>,
    },
    /// Keep new requests off a worker; requests in flight on it finish. A drained worker
    /// that is idle is safe to stop.
    Drain {
        /// The worker's id (its systemd instance name, or `[worker] id`).
        id: String,
        /// Wait until the worker is idle: exit 0 once it is, 4 at the timeout.
        #[arg(long)]
        wait: bool,
        /// Longest to wait, in milliseconds [default: the longest a request may take,
        /// `[deadlines]` admission_wait + request of --config, else of the defaults, plus
        /// 5 s].
        #[arg(long = "timeout-ms", requires = "wait", value_name = "MS")]
        timeout_ms: Option<u64>,
    },
    /// Let new requests reach a drained worker again.
    Undrain {
        /// The worker's id.
        id: String,
    },
    /// Send canary requests through the live system and check every output against the
    /// monolithic model (needs --config for the model geometry). Exits 7 on any mismatch.
    Probe {
        /// New tokens per canary.
        #[arg(long = "max-new", default_value_t = 24)]
        max_new: u32,
    },
    /// Start a local stack (kvctld, two prefill and two decode workers), run requests of two
    /// tenants concurrently, show which pair served each, check every output against the
    /// monolithic model and every page free at the end, submit an oversize request, and
    /// stop the stack.
    Demo {
        /// Requests to run.
        #[arg(long, default_value_t = 8)]
        requests: usize,
        /// Prefill workers to start.
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=64))]
        prefill: u16,
        /// Decode workers to start.
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=64))]
        decode: u16,
        /// Keep the stack's directory (config and daemon logs).
        #[arg(long = "keep-dir")]
        keep_dir: bool,
        /// Run the reference model even when the real one is there or can be fetched.
        #[arg(long)]
        reference: bool,
    },
}

/// Set once a write to stdout failed: later output is dropped.
static STDOUT_GONE: AtomicBool = AtomicBool::new(false);
/// The first write error on stdout other than a closed pipe, reported at exit.
static STDOUT_ERROR: Mutex<Option<io::Error>> = Mutex::new(None);

/// Writes one line to stdout. A closed pipe (the reader exited, as `head` does) drops this
/// and all later output quietly; another error is kept for [`main`] to report.
fn out(args: fmt::Arguments<'_>) {
    if STDOUT_GONE.load(Ordering::Relaxed) {
        return;
    }
    let mut stdout = io::stdout().lock();
    if let Err(e) = stdout
        .write_fmt(args)
        .and_then(|()| stdout.write_all(b"\n"))
    {
        stdout_failed(e);
    }
}

fn stdout_failed(e: io::Error) {
    STDOUT_GONE.store(true, Ordering::Relaxed);
    if e.kind() != io::ErrorKind::BrokenPipe
        && let Ok(mut first) = STDOUT_ERROR.lock()
    {
        first.get_or_insert(e);
    }
}

/// `println!` that never panics (see [`out`]).
macro_rules! outln {
    () => { out(format_args!("")) };
    ($($arg:tt)*) => { out(format_args!($($arg)*)) };
}

mod model;
mod top;

/// `eprintln!` that never panics: a closed stderr loses the message.
macro_rules! errln {
    ($($arg:tt)*) => {{
        let _ = writeln!(io::stderr(), $($arg)*);
    }};
}

/// A failure of a subcommand, with its exit code.
#[derive(Debug)]
struct Failure {
    code: u8,
    message: String,
    /// kvctld's error code, when it answered with one.
    server_code: Option<ErrorCode>,
    /// The command already printed its JSON object for this failure.
    reported: bool,
}

impl Failure {
    fn new(code: u8, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
            server_code: None,
            reported: false,
        }
    }

    /// The failure, marked as already printed in JSON.
    fn reported(mut self) -> Failure {
        self.reported = true;
        self
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "error": self.message,
            "code": self.server_code.map(|c| c.to_string()),
            "exit_code": self.code,
        })
    }
}

impl From<ClientError> for Failure {
    fn from(e: ClientError) -> Failure {
        Failure {
            server_code: e.server_code(),
            ..Failure::new(e.exit_code(), error_chain(&e))
        }
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
    let result = run(&cli);
    if let Err(e) = io::stdout().lock().flush() {
        stdout_failed(e);
    }
    let stdout_error = STDOUT_ERROR.lock().ok().and_then(|mut e| e.take());
    match (result, stdout_error) {
        (Ok(()), None) => ExitCode::from(exit::OK),
        (Ok(()), Some(e)) => {
            errln!("kvctl: writing to stdout: {e}");
            ExitCode::from(exit::FAILED)
        }
        (Err(f), _) => {
            if cli.json && !f.reported {
                outln!("{}", f.json());
                let _ = io::stdout().lock().flush();
            }
            errln!("kvctl: {}", f.message);
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
            prompt_file,
            chat,
            temperature,
            top_p,
            seed,
            prompt,
        } => {
            let text = read_prompt(prompt.as_deref(), prompt_file.as_deref())?;
            let sampling = sampling(*temperature, *top_p, *seed)?;
            let request = Submit {
                tenant: tenant.clone(),
                prompt: Vec::new(),
                max_new_tokens: *max_new,
                deadline_ms: deadline_ms.unwrap_or(0),
                sampling,
            };
            generate(cli, request, &text, *chat)
        }
        Command::Status => status(cli),
        Command::Top {
            interval_ms,
            iterations,
        } => top::top(cli, Duration::from_millis(*interval_ms), *iterations),
        Command::Drain {
            id,
            wait,
            timeout_ms,
        } => drain(cli, id, *wait, *timeout_ms),
        Command::Undrain { id } => undrain(cli, id),
        Command::Probe { max_new } => probe(cli, *max_new),
        Command::Demo {
            requests,
            prefill,
            decode,
            keep_dir,
            reference,
        } => demo(
            cli.json,
            *requests,
            (usize::from(*prefill), usize::from(*decode)),
            *keep_dir,
            *reference,
        ),
    }
}

/// Connects to the socket given by `--socket`, else where the config says (over TLS with
/// `[tls] connect`, else its socket), else the default socket, with the config's default
/// request deadline when there is one. Returns the deadlines in force: the config's, else
/// the defaults.
fn connect(cli: &Cli) -> Result<(Client, Deadlines), Failure> {
    let config = load_config(cli)?;
    let mut client = match (&cli.socket, &config) {
        (Some(socket), _) => Client::connect(socket, CONNECT_TIMEOUT)?,
        (None, Some(c)) => Client::connect_configured(c, CONNECT_TIMEOUT)?,
        (None, None) => Client::connect(&PathBuf::from(DEFAULT_SOCKET), CONNECT_TIMEOUT)?,
    };
    if let Some(c) = &config {
        client.set_default_deadline(c.deadlines.request() + c.deadlines.admission_wait());
    }
    Ok((client, config.map(|c| c.deadlines).unwrap_or_default()))
}

/// The config of `--config`, if given.
fn load_config(cli: &Cli) -> Result<Option<Config>, Failure> {
    match &cli.config {
        Some(path) => Ok(Some(
            Config::load(path).map_err(|e| Failure::new(exit::USAGE, error_chain(&e)))?,
        )),
        None => Ok(None),
    }
}

/// Greedy without `--temperature`; otherwise the draw it asks for, checked as kvctld will.
fn sampling(temperature: Option<f32>, top_p: Option<f32>, seed: u64) -> Result<Sampling, Failure> {
    let Some(t) = temperature else {
        return Ok(Sampling::GREEDY);
    };
    let milli = |what: &str, v: f32, max: f32| {
        if v.is_finite() && (0.0..=max).contains(&v) {
            // Checked above: 0 to 2000, which a u32 holds exactly.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            Ok((v * 1000.0).round() as u32)
        } else {
            Err(Failure::new(
                exit::USAGE,
                format!("{what} {v} is not within 0 to {max}"),
            ))
        }
    };
    Ok(Sampling {
        temperature_milli: milli("--temperature", t, 2.0)?,
        top_p_milli: match top_p {
            None => 0,
            Some(p) => milli("--top-p", p, 1.0)?.max(1),
        },
        seed,
    })
}

/// The prompt of `generate`: the argument, or the file (`--prompt-file -` and an argument
/// of `-`: standard input). Refused before connecting when it is empty or longer than one
/// Submit frame carries.
fn read_prompt(arg: Option<&str>, file: Option<&Path>) -> Result<Vec<u8>, Failure> {
    let max = MAX_PROMPT_TEXT;
    // One byte past the limit is enough to know a prompt is too long.
    let cap = u64::try_from(max).unwrap_or(u64::MAX).saturating_add(1);
    let read = |what: &str, r: &mut dyn io::Read| -> Result<Vec<u8>, Failure> {
        use io::Read as _;
        let mut bytes = Vec::new();
        io::Read::take(r, cap)
            .read_to_end(&mut bytes)
            .map_err(|e| {
                Failure::new(exit::USAGE, format!("reading the prompt from {what}: {e}"))
            })?;
        Ok(bytes)
    };
    let stdin = || read("standard input", &mut io::stdin().lock());
    let (what, bytes) = match (arg, file) {
        (_, Some(p)) if p == Path::new("-") => ("standard input".to_owned(), stdin()?),
        (_, Some(p)) => {
            let what = p.display().to_string();
            let mut f = std::fs::File::open(p).map_err(|e| {
                Failure::new(exit::USAGE, format!("opening the prompt file {what}: {e}"))
            })?;
            let bytes = read(&what, &mut f)?;
            (what, bytes)
        }
        (Some("-"), None) => ("standard input".to_owned(), stdin()?),
        (Some(text), None) => ("the argument".to_owned(), text.as_bytes().to_vec()),
        (None, None) => return Err(Failure::new(exit::USAGE, "no prompt given")),
    };
    if bytes.len() > max {
        return Err(rejected_here(format!(
            "the prompt from {what} is longer than {max} bytes, more than the {} tokens one \
             request carries",
            libkv::proto::MAX_PROMPT_TOKENS
        )));
    }
    if bytes.is_empty() {
        return Err(Failure::new(
            exit::USAGE,
            format!("the prompt from {what} is empty"),
        ));
    }
    Ok(bytes)
}

/// A prompt no kvctld admits (`max_context` is at most what one request carries), refused
/// without sending it: the same exit code and error code as kvctld's rejection.
fn rejected_here(why: String) -> Failure {
    Failure {
        server_code: Some(ErrorCode::Rejected),
        ..Failure::new(
            exit::REJECTED,
            format!("Rejected: {why}, above any max_context (not sent)"),
        )
    }
}

fn generate(cli: &Cli, mut request: Submit, text: &[u8], chat: bool) -> Result<(), Failure> {
    let codec = Codec::from_config(load_config(cli)?.as_ref())?;
    request.prompt = codec.encode(text, chat)?;
    let max = libkv::proto::MAX_PROMPT_TOKENS;
    if request.prompt.len() > max {
        return Err(rejected_here(format!(
            "prompt of {} tokens exceeds the {max} tokens one request carries",
            request.prompt.len()
        )));
    }
    let tenant = request.tenant.clone();
    let tenant = tenant.as_str();
    let (mut client, _) = connect(cli)?;
    let stream = !cli.json;
    let start = Instant::now();
    let mut streamed = false;
    let result = client.submit(request, |tokens| {
        if stream && !STDOUT_GONE.load(Ordering::Relaxed) {
            streamed = true;
            // Written raw, so a character split across frames comes out whole. Output is
            // best effort: a closed stdout must not stop the request.
            let bytes = codec.decode(tokens);
            let mut stdout = io::stdout().lock();
            if let Err(e) = stdout.write_all(&bytes).and_then(|()| stdout.flush()) {
                stdout_failed(e);
            }
        }
        true
    });
    let elapsed = start.elapsed();
    let out = match result {
        Ok(out) => out,
        Err(e) => {
            if streamed {
                outln!();
            }
            let failure = Failure::from(e);
            if cli.json {
                let mut v = failure.json();
                v["tenant"] = json!(tenant);
                outln!("{v}");
                return Err(failure.reported());
            }
            return Err(failure);
        }
    };
    let d = &out.done;
    if stream {
        outln!();
    } else {
        let value = json!({
            "request": out.request.0,
            "tenant": tenant,
            "output": String::from_utf8_lossy(&codec.decode(&out.tokens)),
            "tokens": out.tokens,
            "signature": format!("{:016x}", d.signature),
            "pages_transferred": d.pages_transferred,
            "bytes_transferred": d.bytes_transferred,
            "elapsed_us": d.elapsed_us,
            "prefill_worker": out.pair.prefill,
            "decode_worker": out.pair.decode,
        });
        outln!("{value}");
    }
    errln!(
        "{}: {} tokens, signature {:016x}, {} pages ({} bytes) transferred, {} us in the stack, {} us end to end",
        out.request,
        d.tokens,
        d.signature,
        d.pages_transferred,
        d.bytes_transferred,
        d.elapsed_us,
        elapsed.as_micros()
    );
    if cli.verbose {
        errln!(
            "{}: served by prefill worker {} and decode worker {}",
            out.request,
            shown_id(&out.pair.prefill),
            shown_id(&out.pair.decode)
        );
    }
    Ok(())
}

/// A worker id as shown: `?` when kvctld did not name it.
fn shown_id(id: &str) -> &str {
    if id.is_empty() { "?" } else { id }
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

/// A connected decode worker's batch slots: (taken, all). kvctld assigns it at most
/// `max_batch` requests at once, so its requests in flight are the slots taken.
fn decode_slots(w: &WorkerStatus) -> Option<(u32, u32)> {
    (w.role == Role::Decode && w.connected && w.max_batch > 0).then_some((w.in_flight, w.max_batch))
}

fn transport_name(t: Transport) -> &'static str {
    match t {
        Transport::Shm => "shm",
        Transport::Tcp => "tcp",
        Transport::Rdma => "rdma",
    }
}

fn transports(w: &WorkerStatus) -> Vec<&'static str> {
    w.transports.iter().copied().map(transport_name).collect()
}

/// What an operator may do with the worker now.
fn worker_state(w: &WorkerStatus) -> &'static str {
    match (w.connected, w.drain, w.idle()) {
        (false, _, _) => "disconnected",
        (true, true, true) => "safe to stop",
        (true, true, false) => "draining",
        (true, false, true) => "idle",
        (true, false, false) => "busy",
    }
}

/// Orders ids so that `prefill-2` comes before `prefill-10`: runs of digits compare as
/// numbers.
fn natural_cmp(a: &str, b: &str) -> CmpOrdering {
    fn chunks(s: &str) -> Vec<(bool, &str)> {
        let mut out = Vec::new();
        let mut start = 0;
        let bytes = s.as_bytes();
        for i in 1..=bytes.len() {
            if i == bytes.len() || bytes[i].is_ascii_digit() != bytes[start].is_ascii_digit() {
                out.push((bytes[start].is_ascii_digit(), &s[start..i]));
                start = i;
            }
        }
        out
    }
    let (ca, cb) = (chunks(a), chunks(b));
    for ((da, xa), (db, xb)) in ca.iter().zip(&cb) {
        let ord = if *da && *db {
            let (ta, tb) = (xa.trim_start_matches('0'), xb.trim_start_matches('0'));
            ta.len().cmp(&tb.len()).then_with(|| ta.cmp(tb))
        } else {
            xa.cmp(xb)
        };
        if ord != CmpOrdering::Equal {
            return ord;
        }
    }
    ca.len().cmp(&cb.len()).then_with(|| a.cmp(b))
}

/// The workers of `status`, prefill first, each role in id order.
fn sorted_workers(status: &StatusReply) -> Vec<&WorkerStatus> {
    let rank = |r: Role| match r {
        Role::Prefill => 0,
        Role::Decode => 1,
        Role::Client => 2,
    };
    let mut workers: Vec<&WorkerStatus> = status.workers.iter().collect();
    workers.sort_by(|a, b| {
        rank(a.role)
            .cmp(&rank(b.role))
            .then_with(|| natural_cmp(&a.id, &b.id))
    });
    workers
}

fn counters_json(counters: &[(String, u64)]) -> serde_json::Map<String, serde_json::Value> {
    counters
        .iter()
        .map(|(k, v)| (k.clone(), json!(v)))
        .collect()
}

fn worker_json(s: &StatusReply, w: &WorkerStatus) -> serde_json::Value {
    json!({
        "id": w.id,
        "role": role_name(w.role),
        "connected": w.connected,
        "drain": w.drain,
        "idle": w.idle(),
        "safe_to_stop": w.safe_to_stop(),
        "state": worker_state(w),
        "in_flight": w.in_flight,
        "slots": decode_slots(w).map(|(_, all)| all),
        "slots_used": decode_slots(w).map(|(used, _)| used),
        "held_pages": w.held_pages,
        "served": w.served,
        "transports": transports(w),
        "pool_pages": w.pool_pages,
        "tokens_per_page": w.tokens_per_page,
        "capacity_tokens": capacity_tokens(w),
        "request_tokens": request_tokens(s, w.role),
        "free": w.free,
        "reserved": w.reserved,
        "writing": w.writing,
        "readable": w.readable,
        "draining": w.draining,
        "counters": counters_json(&w.counters),
    })
}

fn status(cli: &Cli) -> Result<(), Failure> {
    let (mut client, _) = connect(cli)?;
    let s = client.status()?;
    let workers = sorted_workers(&s);
    let cluster = load_config(cli)?
        .filter(|c| c.election.enabled())
        .map(|c| cluster_json(&c, &s));
    if cli.json {
        let mut value = json!({
            "generation": s.generation.0,
            "max_context": s.max_context,
            "max_new_tokens": s.max_new_tokens,
            "transport": s.transport.map(transport_name),
            "workers": workers.iter().map(|w| worker_json(&s, w)).collect::<Vec<_>>(),
            "counters": counters_json(&s.counters),
        });
        if let Some(c) = cluster {
            value["cluster"] = c;
        }
        outln!("{value}");
        return Ok(());
    }
    outln!("kvctld generation {}", s.generation.0);
    outln!(
        "limits: max_context {} tokens, max_new_tokens {}",
        s.max_context,
        s.max_new_tokens
    );
    outln!(
        "transport: {}",
        s.transport.map_or(
            "none yet (no prefill and decode worker registered)",
            transport_name
        )
    );
    if workers.is_empty() {
        outln!("workers: none registered");
    } else {
        print_workers(&s, &workers, cli.verbose);
    }
    if !s.counters.is_empty() {
        outln!("kvctld counters:");
        print_counters("  ", &s.counters);
    }
    if let Some(c) = &cluster {
        print_cluster(c);
    }
    Ok(())
}

/// The cluster as etcd has it (`[election]`): the leader, and every member with whether the
/// leader has it registered. An etcd out of reach is said in `error`, not a failure: the
/// leader's own status was read.
fn cluster_json(cfg: &Config, s: &StatusReply) -> serde_json::Value {
    let Some(client) =
        libkv::etcd::Etcd::for_election(&cfg.election, libkv::leader::LOOKUP_TIMEOUT)
    else {
        return json!({});
    };
    let mut out = json!({ "etcd": client.endpoints() });
    if let Some(lookup) = libkv::leader::LeaderLookup::from_config(&cfg.election) {
        match lookup.find() {
            Ok(l) => out["leader"] = json!({ "addr": l.addr, "epoch": l.epoch }),
            Err(e) => out["error"] = json!(error_chain(&e)),
        }
    }
    match libkv::members::list(&client, &cfg.election.members) {
        Ok(members) => {
            let registered = |id: &str| s.workers.iter().any(|w| w.id == id && w.connected);
            out["members"] = members
                .into_iter()
                .map(|(id, m)| match m {
                    Ok(m) => json!({
                        "id": id,
                        "role": m.role,
                        "host": m.host,
                        "pid": m.pid,
                        "model": m.model,
                        "pool_pages": m.pool_pages,
                        "page_bytes": m.page_bytes,
                        "transports": m.transports,
                        "endpoint": m.endpoint,
                        "registered": registered(&id),
                    }),
                    Err(text) => json!({ "id": id, "unreadable": text }),
                })
                .collect();
        }
        Err(e) => out["error"] = json!(error_chain(&e)),
    }
    out
}

fn print_cluster(c: &serde_json::Value) {
    outln!(
        "cluster in etcd at {}:",
        c["etcd"].as_str().unwrap_or_default()
    );
    if let Some(l) = c.get("leader") {
        outln!(
            "  leader {} (epoch {})",
            l["addr"].as_str().unwrap_or_default(),
            l["epoch"]
        );
    }
    if let Some(e) = c.get("error") {
        outln!("  etcd: {}", e.as_str().unwrap_or_default());
    }
    let members = c["members"].as_array().cloned().unwrap_or_default();
    if members.is_empty() {
        outln!("  members: none published");
        return;
    }
    let text = |m: &serde_json::Value, k: &str| m[k].as_str().unwrap_or("-").to_owned();
    let width = members
        .iter()
        .map(|m| text(m, "id").len())
        .max()
        .unwrap_or(6)
        .max(6);
    outln!(
        "  {:<width$}  {:<7}  {:<20}  {:>7}  {:>6}  {:<14}  {:<21}  registered",
        "member",
        "role",
        "host",
        "pid",
        "pages",
        "transports",
        "endpoint"
    );
    for m in &members {
        if let Some(bad) = m.get("unreadable") {
            outln!("  {:<width$}  unreadable: {bad}", text(m, "id"));
            continue;
        }
        let transports: Vec<String> = m["transports"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|t| t.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        outln!(
            "  {:<width$}  {:<7}  {:<20}  {:>7}  {:>6}  {:<14}  {:<21}  {}",
            text(m, "id"),
            text(m, "role"),
            text(m, "host"),
            m["pid"],
            m["pool_pages"],
            transports.join(","),
            text(m, "endpoint"),
            if m["registered"].as_bool() == Some(true) {
                "yes"
            } else {
                "no"
            }
        );
    }
}

fn print_counters(indent: &str, counters: &[(String, u64)]) {
    let width = counters.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in counters {
        outln!("{indent}{k:<width$} {v}");
    }
}

/// The width of the `worker` column of a table of `workers`.
fn id_width(workers: &[&WorkerStatus]) -> usize {
    workers
        .iter()
        .map(|w| w.id.len())
        .max()
        .unwrap_or(0)
        .max("worker".len())
}

/// The table of workers: one line each; with `verbose`, then each one's pages by state
/// and its own counters.
fn print_workers(s: &StatusReply, workers: &[&WorkerStatus], verbose: bool) {
    let idw = id_width(workers);
    outln!(
        "{:<idw$}  {:<7}  {:<4}  {:<5}  {:<12}  {:>6}  {:>7}  {:>6}  {:>7}  {:>9}  {:>7}  {:<12}  {:>4}",
        "worker",
        "role",
        "conn",
        "drain",
        "state",
        "flight",
        "slots",
        "held",
        "pages",
        "tokens",
        "free",
        "transports",
        "fits"
    );
    let yes_no = |b: bool| if b { "yes" } else { "no" };
    for w in workers {
        let need = request_tokens(s, w.role);
        let slots = decode_slots(w).map_or_else(|| "-".to_owned(), |(u, n)| format!("{u}/{n}"));
        outln!(
            "{:<idw$}  {:<7}  {:<4}  {:<5}  {:<12}  {:>6}  {:>7}  {:>6}  {:>7}  {:>9}  {:>7}  {:<12}  {:>4}",
            w.id,
            role_name(w.role),
            yes_no(w.connected),
            yes_no(w.drain),
            worker_state(w),
            w.in_flight,
            slots,
            w.held_pages,
            w.pool_pages,
            capacity_tokens(w),
            w.free,
            transports(w).join(","),
            capacity_tokens(w).checked_div(need).unwrap_or(0),
        );
    }
    outln!(
        "flight: requests in flight; slots: a decode worker's batch slots taken of its \
         max_batch (no more requests are assigned to it at once); held: pages lent against \
         the pool; tokens: pages x {}",
        workers.first().map_or(0, |w| w.tokens_per_page)
    );
    outln!(
        "fits: largest requests the pool holds at once ({} tokens on prefill, {} on decode); \
         safe to stop: drained and idle",
        request_tokens(s, Role::Prefill),
        request_tokens(s, Role::Decode),
    );
    if !verbose {
        return;
    }
    for w in workers {
        outln!(
            "{}: pages free {}, reserved {}, writing {}, readable {}, draining {}; served {} requests",
            w.id,
            w.free,
            w.reserved,
            w.writing,
            w.readable,
            w.draining,
            w.served
        );
        print_counters("  ", &w.counters);
    }
}

/// The line `drain`, `drain --wait` and `undrain` print about the worker.
fn drain_line(w: &WorkerStatus) -> String {
    match (w.drain, w.idle()) {
        (true, true) => format!("{}: drained and idle: safe to stop", w.id),
        (true, false) => format!(
            "{}: drained; {} requests in flight, {} pages held",
            w.id, w.in_flight, w.held_pages
        ),
        (false, _) => format!("{}: taking new requests", w.id),
    }
}

fn drain(cli: &Cli, id: &str, wait: bool, timeout_ms: Option<u64>) -> Result<(), Failure> {
    let (mut client, deadlines) = connect(cli)?;
    let start = Instant::now();
    let mut w = client.drain(id, true)?;
    let timeout = timeout_ms.map_or_else(
        || deadlines.admission_wait() + deadlines.request() + kvctld::client::REPLY_SLACK,
        Duration::from_millis,
    );
    let mut last = None;
    if wait {
        while w.connected && !w.idle() {
            if start.elapsed() >= timeout {
                let message = format!(
                    "{id} is drained but not idle after {} ms: {} requests in flight, {} pages held",
                    start.elapsed().as_millis(),
                    w.in_flight,
                    w.held_pages
                );
                let failure = Failure::new(exit::UNAVAILABLE, message);
                if cli.json {
                    let mut v = failure.json();
                    v["worker"] = last.as_ref().map_or_else(
                        || json!({ "id": w.id, "in_flight": w.in_flight }),
                        |s| worker_json(s, &w),
                    );
                    outln!("{v}");
                    return Err(failure.reported());
                }
                return Err(failure);
            }
            thread::sleep(DRAIN_POLL.min(timeout.saturating_sub(start.elapsed())));
            let s = client.status()?;
            let Some(now) = s.workers.iter().find(|x| x.id == id).cloned() else {
                return Err(Failure::new(
                    exit::FAILED,
                    format!("kvctld no longer lists worker {id} (it was drained)"),
                ));
            };
            if !now.connected {
                return Err(lost_while_draining(cli, &s, &now, start));
            }
            w = now;
            last = Some(s);
        }
    }
    if cli.json {
        let s = match last {
            Some(s) => s,
            None => client.status()?,
        };
        outln!(
            "{}",
            json!({
                "worker": worker_json(&s, &w),
                "waited_ms": start.elapsed().as_millis(),
            })
        );
    } else if wait {
        outln!(
            "{} (waited {} ms)",
            drain_line(&w),
            start.elapsed().as_millis()
        );
    } else if w.idle() {
        outln!("{}", drain_line(&w));
    } else {
        outln!(
            "{} (`kvctl drain {id} --wait` waits until it is idle)",
            drain_line(&w)
        );
    }
    Ok(())
}

/// `drain --wait` saw the worker lost before it was idle: what was in flight on it failed,
/// so stopping it was not safe.
fn lost_while_draining(cli: &Cli, s: &StatusReply, w: &WorkerStatus, start: Instant) -> Failure {
    let failed = w
        .failed_when_lost()
        .map_or_else(|| "its requests".to_string(), |n| format!("{n} requests"));
    let message = format!(
        "{} was lost while draining, after {} ms and before it was idle: {failed} in flight \
         on it failed (WorkerLost)",
        w.id,
        start.elapsed().as_millis()
    );
    let failure = Failure::new(exit::FAILED, message);
    if cli.json {
        let mut v = failure.json();
        v["worker"] = worker_json(s, w);
        outln!("{v}");
        return failure.reported();
    }
    failure
}

fn undrain(cli: &Cli, id: &str) -> Result<(), Failure> {
    let (mut client, _) = connect(cli)?;
    let w = client.drain(id, false)?;
    if cli.json {
        let s = client.status()?;
        outln!("{}", json!({ "worker": worker_json(&s, &w) }));
    } else if w.drain {
        outln!("{}: still drained: the worker is stopping", w.id);
    } else {
        outln!("{}", drain_line(&w));
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

/// Questions the demo asks a real model (one user message each, in its chat template).
const DEMO_QUESTIONS: [&str; 4] = [
    "Name the capital city of France.",
    "Name the three primary colors.",
    "What is 12 times 12?",
    "Write one sentence about the sea.",
];

/// Request `index` of the demo: its tenant, its text and its prompt tokens. The reference
/// model echoes a prompt that carries the tenant's secret; a real model answers a question.
fn demo_prompt(
    index: usize,
    model: &LoadedModel,
) -> Result<(&'static str, String, Vec<u32>), Failure> {
    let (tenant, secret) = DEMO_TENANTS[index % DEMO_TENANTS.len()];
    if model.tokenizer.is_none() {
        let text =
            format!("[{tenant} secret {secret}] request {index}: summarize our quarterly figures");
        let tokens = model.encode(&text);
        return Ok((tenant, text, tokens));
    }
    let text = DEMO_QUESTIONS[index % DEMO_QUESTIONS.len()].to_owned();
    let tokens = model
        .encode_chat(&[llama::chat::Message::user(text.as_str())])
        .map_err(|e| Failure::new(exit::STACK, e))?;
    Ok((tenant, text, tokens))
}

/// Where `scripts/fetch-model` is under `cargo run` from a checkout.
fn fetch_script() -> Option<PathBuf> {
    let dir = std::env::var_os("CARGO_MANIFEST_DIR")?;
    Some(Path::new(&dir).join("../scripts/fetch-model"))
}

fn demo(
    json_out: bool,
    requests: usize,
    (prefill, decode): (usize, usize),
    keep_dir: bool,
    reference: bool,
) -> Result<(), Failure> {
    let dir = tempfile::Builder::new()
        .prefix("kvfence-demo.")
        .tempdir_in("/tmp")
        .map_err(|e| Failure::new(exit::STACK, format!("creating a directory in /tmp: {e}")))?;
    let say = |line: String| {
        if !json_out {
            outln!("{line}");
        }
    };
    let mut config = Config::embedded_default(dir.path().join("kvctld.sock"));
    if !reference {
        match model::demo_model(fetch_script().as_deref()) {
            Ok((path, geometry)) => {
                say(format!("kvfence demo: model {}", path.display()));
                config = model::demo_config(config, path, geometry);
            }
            Err(why) => say(format!("kvfence demo: the reference model ({why})")),
        }
    }
    let model = llama::load(&config.model, config.geometry, 2).map_err(|e| {
        Failure::new(
            exit::STACK,
            format!("loading the model: {}", error_chain(&e)),
        )
    })?;
    say(format!(
        "kvfence demo: starting kvctld, {prefill} prefill and {decode} decode workers in {}",
        dir.path().display()
    ));
    let opts =
        StackOptions::new(config.clone(), dir.path().to_path_buf())?.with_workers(prefill, decode);
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
        .map(|(name, p)| format!("{name} pid {p}"))
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
                        e.name,
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
                outln!("{summary}");
            } else {
                outln!("{stop_line}");
                if let Some(k) = &kept {
                    outln!("config and logs kept in {}", k.display());
                }
            }
            if stop.as_ref().is_ok_and(|r| !r.is_clean()) || stop.is_err() {
                return Err(Failure::new(exit::STACK, stop_line).reported());
            }
            Ok(())
        }
        Err(f) => {
            errln!("{stop_line}");
            if let Some(k) = &kept {
                errln!("config and logs kept in {}", k.display());
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
        errln!("{line}");
    } else {
        outln!("{line}");
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

/// The table of which worker served each request: a row per worker, a column per request
/// (its index), `x` where the worker took part; requests that failed are marked in a last
/// row. Wrapped into blocks of columns so no line is wider than [`DEMO_TABLE_WIDTH`].
fn pair_table(workers: &[String], runs: &[DemoRun]) -> Vec<String> {
    let label_w = workers
        .iter()
        .map(String::len)
        .chain(["failed".len(), "request".len()])
        .max()
        .unwrap_or(0);
    let col_w = runs
        .iter()
        .map(|r| r.index.to_string().len())
        .max()
        .unwrap_or(1)
        + 1;
    let per_block = (DEMO_TABLE_WIDTH.saturating_sub(label_w) / col_w).max(1);
    let any_failed = runs.iter().any(|r| r.result.is_err());
    let mut lines = Vec::new();
    for block in runs.chunks(per_block) {
        let mut header = format!("{:<label_w$}", "request");
        for r in block {
            header.push_str(&format!("{:>col_w$}", r.index));
        }
        lines.push(header);
        for id in workers {
            let mut line = format!("{id:<label_w$}");
            for r in block {
                let served = r
                    .result
                    .as_ref()
                    .is_ok_and(|o| o.pair.prefill == *id || o.pair.decode == *id);
                line.push_str(&format!("{:>col_w$}", if served { "x" } else { "." }));
            }
            lines.push(line.trim_end().to_owned());
        }
        if any_failed {
            let mut line = format!("{:<label_w$}", "failed");
            for r in block {
                let mark = if r.result.is_err() { "x" } else { "." };
                line.push_str(&format!("{mark:>col_w$}"));
            }
            lines.push(line);
        }
    }
    lines
}

/// Runs the requests and the oversize request against a started stack; the JSON summary,
/// or the failure with its exit code.
fn demo_run(
    stack: &mut Stack,
    model: &LoadedModel,
    requests: usize,
    json_out: bool,
) -> Result<serde_json::Value, Failure> {
    let config = stack.config().clone();
    let max_new_limit = config.limits.max_new_tokens;
    let mut plan = Vec::with_capacity(requests);
    for index in 0..requests {
        let (tenant, prompt, tokens) = demo_prompt(index, model)?;
        // The reference model echoes the whole prompt; a real one answers in a sentence.
        let max_new = if model.tokenizer.is_none() {
            u32::try_from(tokens.len()).unwrap_or(u32::MAX)
        } else {
            DEMO_MAX_NEW
        }
        .min(max_new_limit);
        let expected = monolithic_paged(model.runner.as_ref(), &tokens, max_new, &Sampling::GREEDY)
            .map_err(|e| Failure::new(exit::STACK, format!("monolithic model: {e}")))?;
        plan.push((index, tenant, prompt, tokens, max_new, expected));
    }
    let mut workers = stack.worker_ids(Role::Prefill);
    workers.extend(stack.worker_ids(Role::Decode));

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
                    let Some((index, tenant, prompt, tokens, max_new, expected)) = plan.get(i)
                    else {
                        break;
                    };
                    let t0 = Instant::now();
                    let result = match client.take() {
                        Some(c) => Ok(c),
                        None => stack.client(),
                    }
                    .and_then(|mut c| {
                        let r = c.generate(tenant, tokens, *max_new, 0, |_| {});
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
    let mut served_by: BTreeMap<String, u64> = workers.iter().map(|w| (w.clone(), 0)).collect();
    let mut pairs: BTreeMap<ServingPair, u64> = BTreeMap::new();
    for r in &runs {
        let expected_text = model.decode(&r.expected.tokens);
        match &r.result {
            Ok(o) => {
                let tokens_ok = o.tokens == r.expected.tokens;
                let sig_ok = o.done.signature == r.expected.signature;
                pages += u64::from(o.done.pages_transferred);
                bytes += o.done.bytes_transferred;
                for id in [&o.pair.prefill, &o.pair.decode] {
                    *served_by.entry(shown_id(id).to_owned()).or_default() += 1;
                }
                *pairs.entry(o.pair.clone()).or_default() += 1;
                let verdict = if tokens_ok && sig_ok {
                    ok += 1;
                    "ok"
                } else {
                    mismatched += 1;
                    "MISMATCH"
                };
                if !json_out {
                    outln!(
                        "#{} {} {} via {}: {verdict} (tokens {}, signature {}), {:.1} ms",
                        r.index,
                        r.tenant,
                        o.request,
                        o.pair,
                        if tokens_ok { "match" } else { "DIFFER" },
                        if sig_ok { "matches" } else { "DIFFERS" },
                        ms(r.latency)
                    );
                    outln!("    output   {:?}", model.decode(&o.tokens));
                    outln!("    expected {expected_text:?}");
                }
                json_runs.push(json!({
                    "index": r.index,
                    "tenant": r.tenant,
                    "request": o.request.0,
                    "prefill_worker": o.pair.prefill,
                    "decode_worker": o.pair.decode,
                    "prompt": r.prompt,
                    "output": model.decode(&o.tokens),
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
                    outln!(
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
    if !json_out && !runs.is_empty() {
        outln!("which workers served each request (x), one column per request:");
        for line in pair_table(&workers, &runs) {
            outln!("  {line}");
        }
    }

    // A prompt one token over max_context must be rejected, and nothing else.
    let oversize_len = usize::try_from(config.limits.max_context)
        .unwrap_or(usize::MAX)
        .saturating_add(1);
    let oversize_prompt = vec![u32::from(b'x'); oversize_len];
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
        outln!(
            "oversize request ({oversize_len} tokens, max_context {}): {oversize_line}",
            config.limits.max_context
        );
    }

    // Every page of every worker must be back on the free lists once the requests are over.
    let pools_free = |s: &StatusReply| {
        workers.iter().all(|id| {
            s.workers.iter().any(|w| {
                w.id == *id
                    && w.connected
                    && w.idle()
                    && w.free == w.pool_pages
                    && w.reserved + w.writing + w.readable + w.draining == 0
            })
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
        Some(s) => sorted_workers(s)
            .iter()
            .map(|w| format!("{} {}/{} pages free", w.id, w.free, w.pool_pages))
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
    // In the stack's order (prefill workers first), then any id the stack does not have.
    let served_line = workers
        .iter()
        .chain(served_by.keys().filter(|id| !workers.contains(id)))
        .map(|id| format!("{id} {}", served_by.get(id).copied().unwrap_or(0)))
        .collect::<Vec<_>>()
        .join(", ");
    if !json_out {
        outln!(
            "pools after the run: {pools_line}{}",
            if drained { "" } else { " (PAGES STILL HELD)" }
        );
        outln!(
            "summary: {requests} requests from {} tenants: {ok} ok, {mismatched} mismatched, {failed} failed; oversize request {}",
            DEMO_TENANTS.len().min(requests),
            if rejected { "rejected" } else { "NOT rejected" }
        );
        outln!(
            "  requests served per worker: {served_line}; {} distinct pairs",
            pairs.len()
        );
        outln!("  transferred {pages} pages, {bytes} bytes of KV");
        outln!(
            "  total {:.1} ms; latency mean {:.2} ms, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            ms(total),
            ms(mean),
            ms(pct(50)),
            ms(pct(99)),
            ms(pct(100))
        );
    }
    let summary = json!({
        "workers": workers,
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
            "served_by": served_by,
            "pairs": pairs
                .iter()
                .map(|(p, n)| json!({ "prefill_worker": p.prefill, "decode_worker": p.decode, "requests": n }))
                .collect::<Vec<_>>(),
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
            outln!("{summary}");
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
        )
        .reported());
    }
    if failed > 0 || !drained {
        if json_out {
            outln!("{summary}");
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
        )
        .reported());
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
    let model = llama::load(&config.model, config.geometry, config.model.threads())
        .map_err(|e| Failure::new(exit::USAGE, error_chain(&e)))?;
    let report = kvctld::probe::run_probe(&socket, &model, max_new, timeout).map_err(|e| {
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
        outln!("{v}");
    } else {
        outln!(
            "probe: {} of {} canaries matched the monolithic path",
            report.matched,
            report.requests
        );
        for m in &report.mismatches {
            outln!("  MISMATCH {m}");
        }
        for e in &report.errors {
            outln!("  error: {e}");
        }
    }
    if !report.mismatches.is_empty() {
        log::error!(
            "coherence probe: {} outputs differ from the monolithic path",
            report.mismatches.len()
        );
        return Err(
            Failure::new(exit::MISMATCH, "outputs differ from the monolithic path").reported(),
        );
    }
    if !report.errors.is_empty() {
        return Err(Failure::new(
            exit::UNAVAILABLE,
            "some canaries failed; coherence not shown",
        )
        .reported());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_sort_with_numbers_as_numbers() {
        let mut ids = vec![
            "prefill-10",
            "prefill-2",
            "gpu1",
            "prefill-02x",
            "a",
            "prefill-1",
        ];
        ids.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            ids,
            [
                "a",
                "gpu1",
                "prefill-1",
                "prefill-2",
                "prefill-02x",
                "prefill-10"
            ]
        );
        assert_eq!(natural_cmp("x-01", "x-1"), CmpOrdering::Less);
    }

    #[test]
    fn the_cli_parses_drain_and_refuses_a_timeout_without_wait() {
        let cli =
            Cli::try_parse_from(["kvctl", "drain", "gpu0", "--wait", "--timeout-ms", "5"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Drain {
                ref id,
                wait: true,
                timeout_ms: Some(5)
            } if id == "gpu0"
        ));
        assert!(Cli::try_parse_from(["kvctl", "drain", "gpu0", "--timeout-ms", "5"]).is_err());
        assert!(Cli::try_parse_from(["kvctl", "undrain"]).is_err());
        let cli = Cli::try_parse_from(["kvctl", "-v", "--json", "status"]).unwrap();
        assert!(cli.verbose && cli.json);
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
