//! Long prompts: `kvctl generate` reads them from a file or standard input (an argument
//! stops at 128 KiB, the kernel's limit on one), prefill has a deadline of its own
//! (`[deadlines] prefill`) and its errors name real keys, an abandoned prefill stops between
//! chunks and frees its pages at once, and a `max_context` no Submit frame can carry is
//! refused at load with both numbers.
//!
//! Build the binaries first (`cargo build --release --bins`). Bounded in time; the slow
//! prefill uses a larger model geometry with pools of 384 MiB.

use kvctld::client::ClientError;
use kvctld::stack::{Stack, StackOptions, error_chain, find_worker, wait_until};
use kvfence_tests::ops::{describe, open_tempdir, run_bounded};
use kvfence_tests::{LogsOnPanic, bin_dir};

/// kvctld's counter `name`.
fn counter(stack: &Stack, name: &str) -> u64 {
    kvfence_tests::counter(&stack.status().expect("status"), name).unwrap_or(0)
}
use libkv::config::Config;
use libkv::geometry::{Dtype, PageGeometry};
use libkv::model::{ReferenceModel, monolithic, tokenize};
use libkv::proto::{ErrorCode, MAX_PROMPT_TOKENS};
use std::process::Command;
use std::time::{Duration, Instant};

fn prompt(len: usize) -> Vec<u8> {
    let mut p = b"[acme secret s3cr3t-long] ".to_vec();
    let mut i = 0u64;
    while p.len() < len {
        p.extend_from_slice(format!("line {i} of a long document; ").as_bytes());
        i += 1;
    }
    p.truncate(len);
    p
}

fn start(cfg: Config, dir: &std::path::Path) -> Stack {
    let mut opts = StackOptions::new(cfg, dir.to_path_buf()).expect("options");
    opts.ready_timeout = Duration::from_secs(60);
    Stack::start(opts).unwrap_or_else(|e| panic!("stack: {}", error_chain(&e)))
}

#[test]
fn a_prompt_too_long_for_an_argument_goes_through_a_file_and_standard_input() {
    let dir = open_tempdir("kvlong.");
    let _logs = LogsOnPanic(dir.path().to_path_buf());
    let mut cfg = Config::embedded_default(dir.path().join("kvctld.sock"));
    cfg.limits.max_context = 131_072;
    let pages = cfg.geometry.pages_for_tokens(u64::from(
        cfg.limits.max_context + cfg.limits.max_new_tokens,
    ));
    cfg.prefill.pool_pages = u32::try_from(pages).unwrap();
    cfg.decode.pool_pages = u32::try_from(pages).unwrap();
    cfg.deadlines.prefill = 30_000;
    cfg.deadlines.request = 60_000;
    let stack = start(cfg, dir.path());
    let model = ReferenceModel::new(stack.config().geometry).expect("model");
    let long = prompt(131_072);
    let want = monolithic(&model, &tokenize(&long), 16).expect("monolithic");
    let mut expected: Vec<u8> = want
        .tokens
        .iter()
        .map(|&t| u8::try_from(t).unwrap())
        .collect();
    expected.push(b'\n');

    // As one argument it cannot even be passed to kvctl (MAX_ARG_STRLEN is 128 KiB).
    let as_arg = Command::new(bin_dir().join("kvctl"))
        .arg("--socket")
        .arg(stack.socket())
        .args(["generate", "--tenant", "acme"])
        .arg(String::from_utf8(long.clone()).unwrap())
        .output();
    assert!(as_arg.is_err(), "a 128 KiB argument was accepted");

    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, &long).unwrap();
    let kvctl = |args: &[&str]| {
        let mut c = Command::new(bin_dir().join("kvctl"));
        c.arg("--socket")
            .arg(stack.socket())
            .args(["generate", "--tenant", "acme", "--max-new", "16"])
            .args(args);
        c
    };
    let path = file.to_str().unwrap();
    for (what, args, input) in [
        ("--prompt-file PATH", vec!["--prompt-file", path], None),
        (
            "--prompt-file -",
            vec!["--prompt-file", "-"],
            Some(long.as_slice()),
        ),
        ("-", vec!["-"], Some(long.as_slice())),
    ] {
        let ran = run_bounded(&mut kvctl(&args), input, Duration::from_secs(60));
        assert!(ran.ok(), "{}", describe(what, &ran));
        assert_eq!(
            ran.stdout.as_bytes(),
            expected.as_slice(),
            "{what}: output differs from the monolithic path"
        );
    }

    // Over what one Submit frame carries, so over any max_context: refused before sending,
    // with the limit, as kvctld refuses a prompt over max_context (rejected, exit 3, code
    // Rejected). Nothing reaches kvctld.
    let rejected_before = counter(&stack, "rejected");
    let too_long = dir.path().join("too-long.txt");
    std::fs::write(&too_long, prompt(MAX_PROMPT_TOKENS + 1)).unwrap();
    let too_long = too_long.to_str().unwrap();
    let ran = run_bounded(
        &mut kvctl(&["--prompt-file", too_long]),
        None,
        Duration::from_secs(30),
    );
    assert_eq!(ran.code(), Some(3), "{}", describe("too long", &ran));
    assert!(
        ran.stderr.contains("Rejected: prompt of 131073 tokens")
            && ran.stderr.contains(&MAX_PROMPT_TOKENS.to_string()),
        "{}",
        ran.stderr
    );
    let mut json = Command::new(bin_dir().join("kvctl"));
    json.arg("--socket").arg(stack.socket()).args([
        "--json",
        "generate",
        "--tenant",
        "acme",
        "--prompt-file",
        too_long,
    ]);
    let ran = run_bounded(&mut json, None, Duration::from_secs(30));
    let v: serde_json::Value = serde_json::from_str(ran.stdout.trim())
        .unwrap_or_else(|e| panic!("{e}: {}", describe("too long, --json", &ran)));
    assert_eq!(
        (v["code"].as_str(), v["exit_code"].as_u64(), ran.code()),
        (Some("Rejected"), Some(3), Some(3)),
        "{v}"
    );
    assert_eq!(
        counter(&stack, "rejected"),
        rejected_before,
        "kvctld saw a prompt kvctl refused"
    );
    let ran = run_bounded(
        &mut kvctl(&["--prompt-file", "/nonexistent/prompt"]),
        None,
        Duration::from_secs(30),
    );
    assert_eq!(ran.code(), Some(1), "{}", describe("missing file", &ran));
}

/// A geometry whose prefill is slow enough to be abandoned half-way: 16 KiB of KV a token.
fn slow_config(dir: &std::path::Path, context: u32) -> Config {
    let mut cfg = Config::embedded_default(dir.join("kvctld.sock"));
    cfg.geometry = PageGeometry {
        tokens_per_page: 16,
        layers: 16,
        kv_heads: 4,
        head_dim: 64,
        dtype: Dtype::Bf16,
    };
    cfg.limits.max_context = context;
    cfg.limits.max_new_tokens = 16;
    let pages = |t: u32| u32::try_from(cfg.geometry.pages_for_tokens(u64::from(t))).unwrap();
    cfg.prefill.pool_pages = pages(context);
    cfg.decode.pool_pages = pages(context + 16);
    cfg.deadlines.bootstrap = 5000;
    cfg.deadlines.request = 60_000;
    cfg
}

const SLOW_CONTEXT: u32 = 24_576;

/// How long the prefill alone of `prompt` takes on this machine: the reference model
/// writing into a host pool of `cfg`'s geometry in this process, as prefilld does.
fn prefill_time(cfg: &Config, prompt: &[u8]) -> Duration {
    use libkv::memory::HostMemory;
    use libkv::model::ModelRunner;
    use libkv::pool::{PagePool, PoolOptions};
    let g = cfg.geometry;
    let pages = cfg.prefill.pool_pages;
    let memory = HostMemory::new(c"kvlong-calibration", g.bytes_per_page() * u64::from(pages))
        .expect("memory");
    let pool = PagePool::new(g, pages, Box::new(memory), PoolOptions::default()).expect("pool");
    let owner = libkv::Owner {
        request: libkv::RequestId(1),
        generation: libkv::Generation(1),
    };
    let tokens = tokenize(prompt);
    let n = u32::try_from(tokens.len()).unwrap();
    let mut res = pool.reserve(owner, n, u64::from(n)).expect("reserve");
    let mut grant = res.grant_write().expect("grant");
    let model = ReferenceModel::new(g).expect("model");
    let t = Instant::now();
    model.prefill(&tokens, &mut grant).expect("prefill");
    t.elapsed()
}

#[test]
fn prefill_has_its_own_deadline_and_an_abandoned_prefill_frees_its_pages_at_once() {
    let dir = open_tempdir("kvlong.");
    let _logs = LogsOnPanic(dir.path().to_path_buf());
    let mut cfg = slow_config(dir.path(), SLOW_CONTEXT);
    cfg.deadlines.prefill = 30_000;
    let stack = start(cfg, dir.path());
    let model = ReferenceModel::new(stack.config().geometry).expect("model");
    let long = prompt(SLOW_CONTEXT as usize);

    // The whole request is served right; the prefill alone takes `full` here.
    let out = stack
        .client()
        .and_then(|mut c| c.generate("acme", &libkv::model::tokenize(&long), 1, 60_000, |_| {}))
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let want = monolithic(&model, &tokenize(&long), 1).expect("monolithic");
    assert_eq!(out.tokens, want.tokens);
    drop(stack);
    let full = prefill_time(&slow_config(dir.path(), SLOW_CONTEXT), &long);
    eprintln!("a prefill of {SLOW_CONTEXT} tokens (16 KiB of KV each) takes {full:?} here");
    // deadlines.prefill a quarter of that (measured, not assumed: machines differ), and
    // bootstrap above it: the prefill stage fails on its own deadline and says so.
    let deadline = u32::try_from(full.as_millis() / 4).unwrap();
    assert!(
        deadline >= 100,
        "the prefill ({full:?}) is too quick here to tell an abandoned one from a finished one"
    );
    let dir2 = open_tempdir("kvlong.");
    let _logs2 = LogsOnPanic(dir2.path().to_path_buf());
    let mut cfg = slow_config(dir2.path(), SLOW_CONTEXT);
    cfg.deadlines.prefill = deadline;
    let stack = start(cfg, dir2.path());
    let t = Instant::now();
    let r = stack
        .client()
        .and_then(|mut c| c.generate("acme", &libkv::model::tokenize(&long), 1, 60_000, |_| {}));
    let failed_after = t.elapsed();
    match r {
        Err(ClientError::Server { code, message }) => {
            assert_eq!(code, ErrorCode::Timeout, "{message}");
            assert!(
                message.contains(&format!(
                    "prefill exceeded its deadline of {deadline} ms (deadlines.prefill)"
                )),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    // The abandoned prefill stops between chunks (counted as abandoned only then: a prefill
    // that ran to its end counts as a run) and frees its pages at once. Its worker reports
    // both after the fact, so the report is waited for, never read once.
    let t = Instant::now();
    let freed = wait_until(Duration::from_secs(20), || {
        let s = stack.status().ok()?;
        let w = find_worker(&s, "prefill-0")?;
        let abandoned = w
            .counters
            .iter()
            .find(|(n, _)| n == "prefills_abandoned")
            .map(|(_, v)| *v);
        (abandoned == Some(1) && w.free == w.pool_pages && w.held_pages == 0).then_some(s)
    });
    let free_after = t.elapsed();
    let status = freed.unwrap_or_else(|| {
        panic!(
            "the abandoned prefill was not counted with its pages free: {:?}",
            stack.status()
        )
    });
    let runs = find_worker(&status, "prefill-0")
        .and_then(|w| w.counters.iter().find(|(n, _)| n == "prefill_runs"))
        .map(|(_, v)| *v);
    assert_eq!(runs, Some(0), "the prefill ran to its end: {status:?}");
    eprintln!(
        "prefill deadline {deadline} ms: the request failed after {failed_after:?}; the prefill \
         worker's pages were free {free_after:?} later (the whole prefill takes {full:?})"
    );
    // The worker serves the next request normally.
    let short = prompt(500);
    let out = stack
        .client()
        .and_then(|mut c| c.generate("acme", &libkv::model::tokenize(&short), 4, 60_000, |_| {}))
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    assert_eq!(
        out.tokens,
        monolithic(&model, &tokenize(&short), 4).unwrap().tokens
    );
}

#[test]
fn a_max_context_no_submit_frame_carries_is_refused_at_load() {
    let dir = open_tempdir("kvlong.");
    let mut cfg = Config::embedded_default(dir.path().join("kvctld.sock"));
    let context: u32 = 600_000;
    let pages = u32::try_from(cfg.geometry.pages_for_tokens(u64::from(context) + 256)).unwrap();
    cfg.limits.max_context = context;
    cfg.prefill.pool_pages = pages;
    cfg.decode.pool_pages = pages;
    // Written by hand: Config::validate (used when writing) refuses it too.
    let path = dir.path().join("kvfence.toml");
    std::fs::write(&path, toml::to_string(&cfg).unwrap()).unwrap();
    assert!(cfg.validate().is_err());
    for (daemon, args) in [
        ("kvctld", vec!["--check-config"]),
        ("kvctld", vec![]),
        ("prefilld", vec!["--check-config"]),
        ("decoded", vec![]),
    ] {
        let mut cmd = Command::new(bin_dir().join(daemon));
        cmd.arg("--config").arg(&path).args(&args);
        let ran = run_bounded(&mut cmd, None, Duration::from_secs(30));
        assert_eq!(ran.code(), Some(2), "{}", describe(daemon, &ran));
        assert!(
            ran.stderr.contains("600000") && ran.stderr.contains("131072"),
            "{daemon} does not name both numbers: {}",
            ran.stderr
        );
    }
}
