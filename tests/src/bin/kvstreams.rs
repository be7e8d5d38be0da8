//! kvstreams: many concurrent streamed chat completions through openaid, at the default
//! deadlines. A benchmark, not a test: it prints figures and asserts nothing.
//!
//! It starts a stack (`--prefill` + `--decode` workers, one kvctld) on the real model of
//! `[model]` (`scripts/fetch-model`; `--reference` for the reference model), openaid in front
//! of it, then `--streams` clients at once, each asking for one streamed chat completion of
//! `--min-tokens` to `--max-tokens` new tokens. Every deadline is the default of a config
//! file that sets none, unless `--admission-wait-ms` changes that one. It prints one JSON
//! line: how many streams succeeded, the errors by kind, time to first token and to the end
//! (p50, p90, max), the wall time, the most decode slots taken and requests queued that
//! kvctld showed (sampled every 100 ms), and decoded's mean batch and step time.
//!
//! `kvstreams --streams 200 --max-batch 16` is the case `[deadlines] admission_wait` is sized
//! for (README, "Decode under load").

#![allow(clippy::print_stdout)]

use clap::Parser;
use kvctld::stack::{Stack, StackOptions, error_chain};
use kvfence_tests::{counter, worker_counter};
use libkv::config::{Config, Deadlines, ModelConfig, ModelKind};
use libkv::proto::Role;
use libkv::{Dtype, PageGeometry};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, ExitCode, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(
    name = "kvstreams",
    about = "concurrent streamed chat completions through openaid"
)]
struct Args {
    /// Concurrent streams.
    #[arg(long, default_value_t = 200)]
    streams: usize,
    /// New tokens per stream: from --min-tokens to --max-tokens, spread over the streams.
    #[arg(long, default_value_t = 16)]
    min_tokens: u32,
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    /// `[decode] max_batch` of every decode worker.
    #[arg(long, default_value_t = 16)]
    max_batch: u32,
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    #[arg(long, default_value_t = 1)]
    decode: usize,
    /// Change `[deadlines] admission_wait` from its default.
    #[arg(long)]
    admission_wait_ms: Option<u32>,
    /// The reference model instead of the GGUF model.
    #[arg(long)]
    reference: bool,
    /// `[model] threads` of each worker (0: every core, the default).
    #[arg(long, default_value_t = 0)]
    threads: u32,
}

/// One stream, as its client saw it.
#[derive(Debug)]
struct Stream {
    status: u16,
    first: Option<Duration>,
    took: Duration,
    chunks: usize,
    error: Option<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvstreams: {e}");
            ExitCode::FAILURE
        }
    }
}

fn config(args: &Args, socket: std::path::PathBuf) -> Result<Config, String> {
    let mut cfg = Config::embedded_default(socket);
    cfg.deadlines = Deadlines::default();
    if let Some(ms) = args.admission_wait_ms {
        cfg.deadlines.admission_wait = ms;
    }
    cfg.limits.max_context = 512;
    cfg.limits.max_new_tokens = 64;
    if !args.reference {
        let path = llama::gguf::default_model_path();
        let g: PageGeometry =
            llama::load::model_geometry(&path, 16, Dtype::Bf16).map_err(|e| error_chain(&e))?;
        cfg.geometry = g;
        cfg.model = ModelConfig {
            kind: ModelKind::Gguf,
            path: Some(path),
            threads: args.threads,
        };
    }
    // Room for every slot's request on each side, and a few more.
    let per_request = cfg.geometry.pages_for_tokens(512 + 64);
    let pages = u32::try_from(per_request).map_err(|e| e.to_string())? * (args.max_batch + 4);
    cfg.prefill.pool_pages = pages;
    cfg.decode.pool_pages = pages;
    cfg.decode.max_batch = Some(args.max_batch);
    Ok(cfg)
}

fn run(args: &Args) -> Result<Value, String> {
    if args.streams == 0 || args.min_tokens == 0 || args.min_tokens > args.max_tokens {
        return Err(format!(
            "--streams must be at least 1 and 1 <= --min-tokens <= --max-tokens (got {}, {} and {})",
            args.streams, args.min_tokens, args.max_tokens
        ));
    }
    let dir = tempfile::Builder::new()
        .prefix("kvstreams")
        .tempdir_in("/tmp")
        .map_err(|e| e.to_string())?;
    let cfg = config(args, dir.path().join("ctl.sock"))?;
    let deadlines = cfg.deadlines;
    let stack = StackOptions::new(cfg, dir.path().join("stack"))
        .map(|o| o.with_workers(args.prefill, args.decode))
        .and_then(Stack::start)
        .map_err(|e| error_chain(&e))?;
    let log = dir.path().join("openaid.log");
    let out = std::fs::File::create(&log).map_err(|e| e.to_string())?;
    let mut openaid = Command::new(kvfence_tests::bin_dir().join("openaid"))
        .arg("--config")
        .arg(stack.config_path())
        .args(["--listen", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out.try_clone().map_err(|e| e.to_string())?)
        .stderr(out)
        .spawn()
        .map_err(|e| format!("openaid: {e}"))?;
    let found = kvctld::stack::wait_until(Duration::from_secs(30), || {
        let text = std::fs::read_to_string(&log).ok()?;
        let rest = text.split("openaid on http://").nth(1)?;
        rest.split_whitespace().next().map(str::to_owned)
    });
    let result = found
        .ok_or_else(|| "openaid did not start".to_owned())
        .and_then(|addr| load(args, &stack, &addr, deadlines));
    let _ = openaid.kill();
    let _ = openaid.wait();
    result
}

fn load(args: &Args, stack: &Stack, addr: &str, deadlines: Deadlines) -> Result<Value, String> {
    let (status, body) = http(addr, "GET", "/v1/models", None, Duration::from_secs(10))?;
    let models: Value = serde_json::from_str(&body).map_err(|e| format!("{status} {body}: {e}"))?;
    let model = models["data"][0]["id"]
        .as_str()
        .ok_or(format!("no model in {body}"))?
        .to_owned();
    let done = AtomicBool::new(false);
    let (most_used, most_queued) = (AtomicU64::new(0), AtomicU64::new(0));
    let streams = Mutex::new(Vec::new());
    let wall = Instant::now();
    thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                if let Ok(st) = stack.status() {
                    let get = |n: &str| counter(&st, n).unwrap_or(0);
                    most_used.fetch_max(get("decode_slots_used"), Ordering::Relaxed);
                    most_queued.fetch_max(get("queue_len"), Ordering::Relaxed);
                }
                thread::sleep(Duration::from_millis(100));
            }
        });
        let clients: Vec<_> = (0..args.streams)
            .map(|i| {
                let (model, streams) = (&model, &streams);
                let spread = args.max_tokens.saturating_sub(args.min_tokens) + 1;
                let tokens = args.min_tokens + u32::try_from(i).unwrap_or(0) % spread;
                s.spawn(move || {
                    let body = json!({
                        "model": model,
                        "messages": [{"role": "user", "content": format!(
                            "Question {i}: name a colour, a fruit and a city, and say why."
                        )}],
                        "max_tokens": tokens,
                        "stream": true,
                    });
                    let one = stream(addr, &body);
                    streams.lock().unwrap().push(one);
                })
            })
            .collect();
        for c in clients {
            let _ = c.join();
        }
        done.store(true, Ordering::Relaxed);
    });
    let wall = wall.elapsed();
    let streams = streams.into_inner().unwrap_or_default();
    let ok: Vec<&Stream> = streams.iter().filter(|s| s.error.is_none()).collect();
    let mut errors: std::collections::BTreeMap<String, usize> = Default::default();
    for s in streams.iter().filter(|s| s.error.is_some()) {
        let e = s.error.clone().unwrap_or_default();
        let key: String = e.chars().take(120).collect();
        *errors.entry(format!("{} {key}", s.status)).or_default() += 1;
    }
    let ms = |d: Duration| (d.as_secs_f64() * 1000.0).round();
    let pct = |mut v: Vec<Duration>| -> Value {
        if v.is_empty() {
            return Value::Null;
        }
        v.sort();
        // The q-th of the sorted durations, q in hundredths.
        let at = |q: usize| ms(v[((v.len() - 1) * q).div_ceil(100).min(v.len() - 1)]);
        json!({"p50": at(50), "p90": at(90), "max": at(100)})
    };
    let s = stack.status().map_err(|e| error_chain(&e))?;
    let decode = stack.worker_ids(Role::Decode);
    let sum = |name: &str| -> u64 {
        decode
            .iter()
            .filter_map(|d| worker_counter(&s, d, name))
            .sum()
    };
    let (steps, stepped, step_us) = (
        sum("decode_batch_steps"),
        sum("decode_batch_requests"),
        sum("decode_step_us"),
    );
    Ok(json!({
        "model": model,
        "streams": args.streams,
        "tokens": [args.min_tokens, args.max_tokens],
        "max_batch": args.max_batch,
        "workers": [args.prefill, args.decode],
        "threads": args.threads,
        "admission_wait_ms": deadlines.admission_wait,
        "request_ms": deadlines.request,
        "ok": ok.len(),
        "failed": streams.len() - ok.len(),
        "errors": errors,
        "tokens_streamed": ok.iter().map(|s| s.chunks).sum::<usize>(),
        "first_token_ms": pct(ok.iter().filter_map(|s| s.first).collect()),
        "end_ms": pct(ok.iter().map(|s| s.took).collect()),
        "wall_ms": ms(wall),
        "most_decode_slots_used": most_used.load(Ordering::Relaxed),
        "most_queued": most_queued.load(Ordering::Relaxed),
        "slot_timeouts": counter(&s, "slot_timeouts"),
        "mean_batch": if steps > 0 { stepped as f64 / steps as f64 } else { 0.0 },
        "mean_step_ms": if steps > 0 { step_us as f64 / steps as f64 / 1000.0 } else { 0.0 },
    }))
}

/// One request and its whole answer: status and body (de-chunked).
fn http(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    let body = body.map(Value::to_string).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: kvfence\r\nConnection: close\r\nContent-Type: \
         application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    parse(&raw)
}

/// Status and body of a raw HTTP/1.1 response.
fn parse(raw: &[u8]) -> Result<(u16, String), String> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("no response")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or("no status")?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    Ok((
        status,
        if chunked {
            dechunk(body)
        } else {
            body.to_owned()
        },
    ))
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

/// One streamed completion: read as it comes, to note its first token.
fn stream(addr: &str, body: &Value) -> Stream {
    let started = Instant::now();
    let fail = |status, error: String| Stream {
        status,
        first: None,
        took: started.elapsed(),
        chunks: 0,
        error: Some(error),
    };
    let mut s = match TcpStream::connect(addr) {
        Ok(s) => s,
        Err(e) => return fail(0, format!("connect: {e}")),
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(180)));
    let body = body.to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: kvfence\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    if let Err(e) = s.write_all(req.as_bytes()) {
        return fail(0, format!("send: {e}"));
    }
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 << 10];
    let mut first = None;
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                raw.extend_from_slice(&buf[..n]);
                if first.is_none() && raw.windows(6).any(|w| w == b"data: ") {
                    first = Some(started.elapsed());
                }
            }
            Err(e) => return fail(0, format!("read: {e}")),
        }
    }
    let took = started.elapsed();
    let (status, text) = match parse(&raw) {
        Ok(r) => r,
        Err(e) => return fail(0, e),
    };
    if status != 200 {
        return fail(status, text);
    }
    let mut chunks = 0;
    let mut ended = false;
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            ended = true;
            continue;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        if v.get("error").is_some() {
            return fail(status, v["error"].to_string());
        }
        if v["choices"][0]["delta"]["content"]
            .as_str()
            .is_some_and(|c| !c.is_empty())
        {
            chunks += 1;
        }
    }
    if !ended {
        return fail(status, format!("no [DONE]: {text}"));
    }
    Stream {
        status,
        first,
        took,
        chunks,
        error: None,
    }
}
