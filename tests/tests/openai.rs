//! openaid, the OpenAI-compatible endpoint, in front of a stack running SmolLM2-135M:
//! the official `openai` Python package (tests/python/openai_client.py) asks for chat and
//! completions, streamed and whole, and its answers must be the monolithic path's output of
//! the same model, decoded; a prompt longer than the context is a 400 that says why and
//! never reaches a worker; a client that goes away mid-stream, or while its prompt is still
//! being prefilled, aborts its request and every page comes back. Raw HTTP checks the rest: `/health`, `/v1/models`, bad bodies, unknown
//! routes, unsupported parameters, and API keys.
//!
//! Needs the model file (`scripts/fetch-model`) and a Python with `openai`
//! (`scripts/python-env`: `target/py-venv`, or `$KVFENCE_PYTHON`). Without them the test
//! says so and passes, except under CI (`CI` set), where they must be there.

use kvfence_tests::ops::{Reaped, wait_for};
use kvfence_tests::{
    Running, all_worker_ids, bin_dir, counter, start_stack, wait_all_free, worker_counter,
};
use libkv::config::{Config, ModelConfig, ModelKind};
use libkv::model::monolithic_paged;
use libkv::proto::{Role, Sampling, StatusReply};
use libkv::{Dtype, PageGeometry};
use llama::chat::Message;
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Each test here runs a stack of the real model; taken by each for its whole run, so that
/// the two never share the machine's cores (the many-streams one is timed by the production
/// deadlines).
static ONE_STACK_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

const MAX_CONTEXT: u32 = 1024;
const MAX_NEW: u32 = 128;

/// What this machine lacks to run the test, if anything; under CI, a failure.
fn missing() -> Option<String> {
    let model = llama::gguf::default_model_path();
    let why = if !model.is_file() {
        format!(
            "{} is missing (scripts/fetch-model gets it)",
            model.display()
        )
    } else {
        let py = python();
        let ok = Command::new(&py)
            .args(["-c", "import openai"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return None;
        }
        format!(
            "{} cannot import openai (scripts/python-env makes target/py-venv)",
            py.display()
        )
    };
    assert!(std::env::var_os("CI").is_none(), "{why}");
    eprintln!("SKIPPED: {why}");
    Some(why)
}

fn python() -> PathBuf {
    std::env::var_os("KVFENCE_PYTHON").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/py-venv/bin/python"),
        PathBuf::from,
    )
}

fn model_config(c: &mut Config, path: PathBuf, geometry: PageGeometry) {
    c.geometry = geometry;
    c.limits.max_context = MAX_CONTEXT;
    c.limits.max_new_tokens = MAX_NEW;
    let pages = geometry.pages_for_tokens(u64::from(MAX_CONTEXT + MAX_NEW));
    let pool = u32::try_from(pages * 2).expect("small");
    c.prefill.pool_pages = pool;
    c.decode.pool_pages = pool;
    c.model = ModelConfig {
        kind: ModelKind::Gguf,
        path: Some(path),
        threads: 1,
    };
    c.deadlines.admission_wait = 60_000;
    c.deadlines.prefill = 60_000;
    c.deadlines.transfer = 30_000;
    c.deadlines.decode = 120_000;
    c.deadlines.request = 180_000;
}

/// openaid on a free port of loopback, for the config at `config`; its address.
fn spawn_openaid(config: &Path, log: &Path) -> (Reaped, String) {
    let out = std::fs::File::create(log).expect("log");
    let child = Command::new(bin_dir().join("openaid"))
        .arg("--config")
        .arg(config)
        .args(["--listen", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("log"))
        .stderr(out)
        .spawn()
        .expect("spawning openaid");
    let child = Reaped(child);
    let mut addr = None;
    let up = wait_for(Duration::from_secs(30), || {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        addr = text
            .split("openaid on http://")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .map(str::to_owned);
        addr.is_some()
    });
    assert!(
        up,
        "openaid did not start: {}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    (child, addr.expect("address"))
}

/// One HTTP/1.1 exchange on a fresh connection: status and body (the whole body; the
/// answers these checks read are not streamed).
fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[&str],
    body: Option<&Value>,
) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).expect("connect openaid");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let body = body.map(Value::to_string).unwrap_or_default();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: kvfence\r\nConnection: close\r\n");
    for h in headers {
        req.push_str(h);
        req.push_str("\r\n");
    }
    if !body.is_empty() || method == "POST" {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    req.push_str("\r\n");
    req.push_str(&body);
    s.write_all(req.as_bytes()).expect("send");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("read");
    let (head, body) = text.split_once("\r\n\r\n").expect("a response");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status");
    (status, body.to_owned())
}

/// Runs `tests/python/SCRIPT` with `args` and returns the one JSON object it prints; a
/// failure shows its stderr and openaid's log (`log`).
fn run_python(script: &str, args: &[String], log: &Path) -> Value {
    let py = Command::new(python())
        .arg(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("python")
                .join(script),
        )
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running python");
    assert!(
        py.status.success(),
        "{script} failed: {}\nopenaid: {}",
        String::from_utf8_lossy(&py.stderr),
        std::fs::read_to_string(log).unwrap_or_default()
    );
    json_of(String::from_utf8_lossy(&py.stdout).trim())
}

fn json_of(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

fn kvctld_counter(run: &Running, name: &str) -> u64 {
    counter(&run.stack.status().expect("status"), name).unwrap_or(0)
}

/// A stack of the real model with openaid in front, this file's only one while it lives.
struct OpenAiStack {
    model: llama::LoadedModel,
    run: Running,
    /// openaid's log.
    log: PathBuf,
    /// openaid's address.
    addr: String,
    _openaid: Reaped,
    _alone: std::sync::MutexGuard<'static, ()>,
}

/// [`OpenAiStack`] with `tweak` applied to the config after [`model_config`]; `None` when
/// this machine lacks the model or the `openai` package (see [`missing`]).
fn openai_stack(prefix: &str, tweak: impl FnOnce(&mut Config)) -> Option<OpenAiStack> {
    let alone = ONE_STACK_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if missing().is_some() {
        return None;
    }
    let path = llama::gguf::default_model_path();
    let geometry = llama::load::model_geometry(&path, 16, Dtype::Bf16).expect("geometry");
    let model = llama::load::load_gguf(&path, geometry, 2).expect("model");
    let run = start_stack(prefix, 1, 1, |c| {
        model_config(c, path.clone(), geometry);
        tweak(c);
    });
    let log = run.dir.path().join("openaid.log");
    let (openaid, addr) = spawn_openaid(run.stack.config_path(), &log);
    Some(OpenAiStack {
        model,
        run,
        log,
        addr,
        _openaid: openaid,
        _alone: alone,
    })
}

#[test]
fn the_openai_client_gets_the_models_answers_and_clear_errors() {
    let Some(OpenAiStack {
        model,
        run,
        log,
        addr,
        _openaid,
        _alone,
    }) = openai_stack("kvoai.", |_| {})
    else {
        return;
    };
    let model_id = model.model_id();

    // /health and /v1/models, raw.
    let (status, body) = http(&addr, "GET", "/health", &[], None);
    assert_eq!(status, 200, "{body}");
    let health = json_of(&body);
    assert_eq!(health["model"], model_id.as_str());
    assert_eq!(
        (
            health["prefill_workers"].as_u64(),
            health["decode_workers"].as_u64()
        ),
        (Some(1), Some(1))
    );

    // The expected answers: the monolithic path of the same model, greedy.
    let chat_prompt = model
        .encode_chat(&[Message::user("Name the capital city of France.")])
        .expect("chat");
    let chat_want = monolithic_paged(model.runner.as_ref(), &chat_prompt, 12, &Sampling::GREEDY)
        .expect("monolithic");
    let plain_prompt = model.encode("Once upon a time, in a small village,");
    let plain_want = monolithic_paged(model.runner.as_ref(), &plain_prompt, 12, &Sampling::GREEDY)
        .expect("monolithic");
    let chat_text = model.decode(&chat_want.tokens);
    let plain_text = model.decode(&plain_want.tokens);
    assert!(
        chat_text.contains("Paris"),
        "monolithic answer: {chat_text:?}"
    );

    let long_words = (MAX_CONTEXT + 100).to_string();
    let disconnect_max = MAX_NEW.to_string();
    let out = run_python(
        "openai_client.py",
        &[
            format!("http://{addr}/v1"),
            model_id.clone(),
            long_words,
            disconnect_max,
        ],
        &log,
    );
    eprintln!("openai {}: {out}", out["openai_version"]);

    // Chat, whole and streamed: the monolithic answer.
    let chat_tokens = chat_want.tokens.len();
    assert_eq!(out["chat"]["object"], "chat.completion");
    assert_eq!(out["chat"]["role"], "assistant");
    assert_eq!(out["chat"]["text"], chat_text.as_str());
    let finish = if chat_tokens == 12 { "length" } else { "stop" };
    assert_eq!(out["chat"]["finish"], finish);
    let usage = json!({
        "prompt_tokens": chat_prompt.len(),
        "completion_tokens": chat_tokens,
        "total_tokens": chat_prompt.len() + chat_tokens,
    });
    for (k, v) in usage.as_object().expect("object") {
        assert_eq!(&out["chat"]["usage"][k], v, "chat usage {k}");
        assert_eq!(
            &out["chat_stream"]["usage"][k], v,
            "streamed chat usage {k}"
        );
    }
    let streamed: String = out["chat_stream"]["parts"]
        .as_array()
        .expect("parts")
        .iter()
        .map(|p| p.as_str().expect("text"))
        .collect();
    assert_eq!(streamed, chat_text, "streamed chat");
    assert_eq!(out["chat_stream"]["roles"], json!(["assistant"]));
    assert_eq!(out["chat_stream"]["finish"], finish);

    // Completions, whole and streamed.
    assert_eq!(out["completion"]["object"], "text_completion");
    assert_eq!(out["completion"]["text"], plain_text.as_str());
    assert_eq!(
        out["completion"]["usage"]["prompt_tokens"].as_u64(),
        Some(plain_prompt.len() as u64)
    );
    let streamed: String = out["completion_stream"]["parts"]
        .as_array()
        .expect("parts")
        .iter()
        .map(|p| p.as_str().expect("text"))
        .collect();
    assert_eq!(streamed, plain_text, "streamed completion");

    // One seed, one answer; /v1/models names the model.
    let sampled = out["sampled"].as_array().expect("sampled");
    assert_eq!(sampled[0], sampled[1], "the same seed twice");
    assert_eq!(out["models"], json!([model_id]));

    // The over-long prompt: a 400 that says why, never admitted.
    assert_eq!(out["rejected"]["status"], 400, "{}", out["rejected"]);
    assert_eq!(out["rejected"]["code"], "context_length_exceeded");
    let message = out["rejected"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains(&format!("maximum context of {MAX_CONTEXT}")),
        "{message}"
    );
    assert_eq!(kvctld_counter(&run, "rejected_prompt_too_long"), 1);
    assert_eq!(out["wrong_model"]["status"], 404);
    assert_eq!(out["wrong_model"]["code"], "model_not_found");

    // The client that went away: its request is abandoned, kvctld counts it gone, every
    // page comes back, and the request did not run to its end.
    assert_eq!(out["disconnect"]["chunks_read"], 2);
    let gone = wait_for(Duration::from_secs(60), || {
        kvctld_counter(&run, "client_gone") == 1
    });
    assert!(
        gone,
        "kvctld did not see the client go: {:?}\nopenaid: {}",
        run.stack.status().map(|s| s.counters),
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    wait_all_free(
        &run.stack,
        &all_worker_ids(&run.stack),
        Duration::from_secs(30),
    );
    // Admitted: 2 chats, 2 completions, 2 sampled and the abandoned one; completed: all
    // but the abandoned one.
    assert_eq!(kvctld_counter(&run, "admitted"), 7);
    assert_eq!(kvctld_counter(&run, "completed"), 6);
    let openaid_log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        openaid_log.contains("the client went away"),
        "{openaid_log}"
    );

    leaving_during_prefill(&run, &addr, &model_id);
    raw_http_errors(&addr, &model_id);
    api_keys(&run, &model_id);
}

/// A client that goes away while its long prompt is being prefilled: openaid notices at
/// once, not when the first token comes, so the request is abandoned before decode pulls or
/// verifies a page of it.
fn leaving_during_prefill(run: &Running, addr: &str, model_id: &str) {
    let decode = run.stack.worker_ids(Role::Decode);
    let verified = |s: &StatusReply| worker_counter(s, &decode[0], "verified").unwrap_or(0);
    let get = |s: &StatusReply, name: &str| counter(s, name).unwrap_or(0);
    let before = wait_all_free(
        &run.stack,
        &all_worker_ids(&run.stack),
        Duration::from_secs(30),
    );
    // About 800 tokens: seconds of prefill on one thread.
    let body = json!({
        "model": model_id,
        "prompt": "The quick brown fox jumps over the lazy dog. ".repeat(80),
        "max_tokens": 4,
    })
    .to_string();
    let mut s = std::net::TcpStream::connect(addr).expect("connect openaid");
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: kvfence\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("send");
    let admitted = wait_for(Duration::from_secs(30), || {
        run.stack
            .status()
            .is_ok_and(|st| get(&st, "in_flight") == 1)
    });
    assert!(admitted, "the request was not admitted");
    drop(s);
    let gone = wait_for(Duration::from_secs(30), || {
        run.stack
            .status()
            .is_ok_and(|st| get(&st, "client_gone") == get(&before, "client_gone") + 1)
    });
    assert!(gone, "kvctld did not see the client go");
    // The report that shows every page free comes after anything decoded did for the
    // request, so its counters include a pull had there been one.
    let after = wait_all_free(
        &run.stack,
        &all_worker_ids(&run.stack),
        Duration::from_secs(30),
    );
    assert_eq!(
        verified(&after),
        verified(&before),
        "decoded pulled and verified the pages of a request whose client had gone"
    );
    assert_eq!(get(&after, "completed"), get(&before, "completed"));
}

/// Errors openaid answers itself, as OpenAI-style bodies.
fn raw_http_errors(addr: &str, model_id: &str) {
    let error = |status: u16, body: &str| {
        let v = json_of(body);
        assert!(v["error"]["message"].is_string(), "{status}: {body}");
        v["error"]["code"].as_str().unwrap_or("").to_owned()
    };
    let (s, b) = http(addr, "POST", "/v1/chat/completions", &[], None);
    assert_eq!((s, error(s, &b).as_str()), (400, "invalid_body"));
    let (s, b) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        &[],
        Some(
            &json!({"model": model_id, "messages": [{"role": "user", "content": "hi"}], "stop": ["."]}),
        ),
    );
    assert_eq!(s, 400, "{b}");
    assert_eq!(json_of(&b)["error"]["param"], "stop");
    let (s, b) = http(
        addr,
        "POST",
        "/v1/completions",
        &[],
        Some(&json!({"model": model_id, "prompt": "hi", "max_tokens": MAX_NEW + 1})),
    );
    assert_eq!(
        (s, error(s, &b).as_str()),
        (400, "max_tokens_exceeded"),
        "{b}"
    );
    let (s, b) = http(
        addr,
        "POST",
        "/v1/completions",
        &[],
        Some(&json!({"model": model_id, "prompt": [1, 2, 4_000_000], "max_tokens": 1})),
    );
    assert_eq!(s, 400, "{b}");
    assert_eq!(json_of(&b)["error"]["param"], "prompt");
    let (s, b) = http(addr, "GET", "/v1/nothing", &[], None);
    assert_eq!((s, error(s, &b).as_str()), (404, "unknown_url"));
    // What openaid cannot honour is a 400 naming the parameter, never a 200 ignoring it.
    for (path, name, v) in [
        (
            "/v1/chat/completions",
            "response_format",
            json!({"type": "json_object"}),
        ),
        (
            "/v1/chat/completions",
            "tools",
            json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ),
        ("/v1/chat/completions", "logit_bias", json!({"1": 5})),
        ("/v1/completions", "suffix", json!(" and so on.")),
        ("/v1/completions", "best_of", json!(2)),
    ] {
        let mut body = if path == "/v1/completions" {
            json!({"model": model_id, "prompt": "hi", "max_tokens": 1})
        } else {
            json!({"model": model_id, "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 1})
        };
        body[name] = v;
        let (s, b) = http(addr, "POST", path, &[], Some(&body));
        assert_eq!(s, 400, "{name} on {path}: {b}");
        assert_eq!(json_of(&b)["error"]["param"], name, "{b}");
    }
    // The README's name of the model: its file's, without the quantization.
    let (s, b) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        &[],
        Some(&json!({"model": "SmolLM2-135M-Instruct", "max_tokens": 1,
                     "messages": [{"role": "user", "content": "hi"}]})),
    );
    assert_eq!(s, 200, "model=\"SmolLM2-135M-Instruct\": {b}");
    let (s, b) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        &[],
        Some(&json!({"model": "SmolLM2-360M", "max_tokens": 1,
                     "messages": [{"role": "user", "content": "hi"}]})),
    );
    assert_eq!((s, error(s, &b).as_str()), (404, "model_not_found"), "{b}");
    assert!(
        b.contains("SmolLM2-135M-Instruct"),
        "the 404 names no usable name: {b}"
    );
}

/// With `[openai] api_keys`, a request needs a key of the file, and is charged to its
/// tenant.
fn api_keys(run: &Running, model_id: &str) {
    let dir = run.dir.path();
    let keys = dir.join("openai-keys");
    std::fs::write(&keys, "sk-test-aaaaaaaaaaaaaaaa acme\n").expect("keys");
    let mut cfg = run.stack.config().clone();
    cfg.openai.api_keys = Some(keys);
    let config = dir.join("openaid-keys.toml");
    kvfence_tests::ops::write_config(&config, &cfg);
    let (_keyed, addr) = spawn_openaid(&config, &dir.join("openaid-keys.log"));
    let (s, b) = http(&addr, "GET", "/v1/models", &[], None);
    assert_eq!(s, 401, "{b}");
    let (s, _) = http(
        &addr,
        "GET",
        "/v1/models",
        &["Authorization: Bearer sk-test-bbbbbbbbbbbbbbbb"],
        None,
    );
    assert_eq!(s, 401);
    let (s, b) = http(
        &addr,
        "GET",
        "/v1/models",
        &["Authorization: Bearer sk-test-aaaaaaaaaaaaaaaa"],
        None,
    );
    assert_eq!(s, 200, "{b}");
    assert_eq!(json_of(&b)["data"][0]["id"], model_id);
    let (s, b) = http(
        &addr,
        "POST",
        "/v1/completions",
        &["Authorization: Bearer sk-test-aaaaaaaaaaaaaaaa"],
        Some(&json!({"model": model_id, "prompt": "Hello", "max_tokens": 2, "temperature": 0})),
    );
    assert_eq!(s, 200, "{b}");
    assert!(json_of(&b)["choices"][0]["text"].is_string(), "{b}");
    let charged = wait_for(Duration::from_secs(10), || {
        std::fs::read_to_string(dir.join("openaid-keys.log"))
            .unwrap_or_default()
            .contains("tenant acme:")
    });
    assert!(charged, "the request was not charged to the key's tenant");
}

/// Streams opened at once by [`two_hundred_concurrent_streams_each_get_their_own_answer`].
const STREAMS: usize = 200;
/// New tokens each of them asks for.
const STREAM_TOKENS: u32 = 8;
/// Distinct prompts among them (each sent as a plain completion, and one stream in eight as
/// a chat, whose template makes the prompt four times longer: prefill, one prompt at a time
/// on the one prefill worker, is most of the time the streams take, and the production
/// request deadline of 60 s bounds the slowest).
const STREAM_PROMPTS: usize = 20;

/// Two hundred streams at once through openaid, at the production deadlines: every one gets
/// the monolithic answer to its own prompt, none fails or times out, and every page is free
/// after. kvctld queues what the decode worker's batch cannot take; decoded steps the
/// requests it holds together.
#[test]
fn two_hundred_concurrent_streams_each_get_their_own_answer() {
    let Some(OpenAiStack {
        model,
        run,
        log,
        addr,
        _openaid,
        _alone,
    }) = openai_stack("kvoai200.", |c| {
        c.deadlines = libkv::config::Deadlines::default();
    })
    else {
        return;
    };
    let model_id = model.model_id();

    let prompts: Vec<String> = (0..STREAM_PROMPTS)
        .map(|i| format!("Write one sentence about the number {}.", 7 * i + 3))
        .collect();
    // The expected answers, [prompt][plain, chat]: the monolithic path, greedy.
    let want: Vec<[(String, usize); 2]> = prompts
        .iter()
        .map(|p| {
            let chat = model.encode_chat(&[Message::user(p)]).expect("chat");
            [model.encode(p), chat].map(|tokens| {
                let out = monolithic_paged(
                    model.runner.as_ref(),
                    &tokens,
                    STREAM_TOKENS,
                    &Sampling::GREEDY,
                )
                .expect("monolithic");
                (model.decode(&out.tokens), out.tokens.len())
            })
        })
        .collect();

    let before = kvctld_counter(&run, "completed");
    let mut args = vec![
        format!("http://{addr}/v1"),
        model_id.clone(),
        STREAMS.to_string(),
        STREAM_TOKENS.to_string(),
    ];
    args.extend(prompts.iter().cloned());
    let out = run_python("openai_streams.py", &args, &log);
    let streams = out["streams"].as_array().expect("streams");
    assert_eq!(streams.len(), STREAMS);
    let mut failed = Vec::new();
    let mut seconds: Vec<f64> = Vec::new();
    for s in streams {
        let p = usize::try_from(s["prompt"].as_u64().expect("prompt")).expect("index");
        let chat = s["chat"].as_bool().expect("chat");
        let (text, tokens) = &want[p][usize::from(chat)];
        let finish = if *tokens == STREAM_TOKENS as usize {
            "length"
        } else {
            "stop"
        };
        if !s["error"].is_null() || s["text"] != text.as_str() || s["finish"] != finish {
            failed.push(format!("{s} (want {text:?}, {finish})"));
        }
        seconds.push(s["seconds"].as_f64().unwrap_or(f64::NAN));
    }
    seconds.sort_by(f64::total_cmp);
    eprintln!(
        "{STREAMS} streams: {} wrong or failed; seconds per stream: median {:.1}, max {:.1}",
        failed.len(),
        seconds[STREAMS / 2],
        seconds[STREAMS - 1]
    );
    assert!(
        failed.is_empty(),
        "{} of {STREAMS} streams wrong or failed:\n{}\nopenaid: {}",
        failed.len(),
        failed.join("\n"),
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    wait_all_free(
        &run.stack,
        &all_worker_ids(&run.stack),
        Duration::from_secs(30),
    );
    assert_eq!(kvctld_counter(&run, "completed") - before, STREAMS as u64);
    // They were decoded together: decoded stepped several requests at a time.
    let status = run.stack.status().expect("status");
    let decode = &run.stack.worker_ids(Role::Decode)[0];
    let steps = worker_counter(&status, decode, "decode_batch_steps").unwrap_or(0);
    let stepped = worker_counter(&status, decode, "decode_batch_requests").unwrap_or(0);
    eprintln!(
        "decoded: {stepped} request steps in {steps} batched steps (mean batch {:.1})",
        stepped as f64 / steps.max(1) as f64
    );
    assert!(
        stepped > 2 * steps,
        "{stepped} request steps in {steps} steps"
    );
}
