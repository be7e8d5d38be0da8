//! kvllmbench: the real model's speed. A benchmark, not a test: it prints figures and
//! asserts nothing.
//!
//! - `kvllmbench runner --threads N`: the llama runner alone on pages in memory: prefill of
//!   a prompt (tokens/s), greedy decode steps after it (tokens/s) with the quantized blocks
//!   and with the f32 weights, and a batch of requests decoded together against one alone,
//!   as one JSON line per round. `scripts/bench-llamacpp.sh` runs it alternately with
//!   llama.cpp on the same model, prompt length and threads.
//! - `kvllmbench ttft --prompts 512,2048,8192`: time to first token through the whole stack
//!   (one prefill and one decode worker on shared memory), split into what kvctld measures
//!   for prefill and for the transfer stage, and what decoded measures of that transfer for
//!   pulling and for verifying the pages; sequential requests of one new token.
//!
//! - `kvllmbench layout --context 2048`: the page order, kvfence's layer-major page against
//!   a token-major one, with SmolLM2-135M's shape (no model file needed): prefill writing
//!   every token's K/V, one decode step's attention over the context, and moving the pages
//!   into an engine's per-layer cache blocks (vLLM's `[block][slot][head][dim]` and the
//!   head-major `[block][head][slot][dim]`); rounds alternate the two orders.
//!
//! `runner` and `ttft` need the model file (`scripts/fetch-model`).

#![allow(clippy::print_stdout)]

use clap::{Parser, Subcommand};
use kvctld::stack::{Stack, StackOptions, error_chain};
use libkv::config::{Config, ModelConfig, ModelKind};
use libkv::model::{BatchStep, MemoryKv, ModelRunner};
use libkv::proto::{Role, Sampling};
use libkv::{Dtype, PageGeometry};
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(
    name = "kvllmbench",
    about = "the real model's speed: the runner, and TTFT through the stack"
)]
struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(Subcommand, Debug)]
enum What {
    /// The runner alone: prefill and decode tokens/s.
    Runner {
        #[arg(long, default_value_t = 1)]
        threads: usize,
        #[arg(long, default_value_t = 512)]
        prompt: usize,
        #[arg(long, default_value_t = 64)]
        decode: u32,
        #[arg(long, default_value_t = 1)]
        rounds: u32,
        /// Requests decoded together for `batch_tok_s`.
        #[arg(long, default_value_t = 16)]
        batch: usize,
        /// Prompt tokens of each request of the batch.
        #[arg(long, default_value_t = 128)]
        batch_prompt: usize,
    },
    /// The page order: layer-major against token-major, side by side.
    Layout {
        /// Context length in tokens.
        #[arg(long, default_value_t = 2048)]
        context: usize,
        /// Rounds, alternating the two orders.
        #[arg(long, default_value_t = 7)]
        rounds: usize,
    },
    /// Time to first token through the stack, split by stage.
    Ttft {
        /// Prompt lengths in tokens, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "512,2048,8192")]
        prompts: Vec<u32>,
        /// Threads of each worker's model.
        #[arg(long, default_value_t = 2)]
        threads: u32,
        /// Requests per prompt length.
        #[arg(long, default_value_t = 2)]
        requests: u32,
    },
}

/// `n` token ids of ordinary text (the numbers are irrelevant to the speed; the text keeps
/// attention realistic).
fn prompt_tokens(tok: &llama::tokenizer::Tokenizer, n: usize) -> Vec<u32> {
    let text =
        "The quick brown fox jumps over the lazy dog, and the river runs past the old mill. ";
    let mut ids = Vec::with_capacity(n + 32);
    while ids.len() < n {
        tok.encode_into(text, false, &mut ids);
    }
    ids.truncate(n);
    ids
}

/// Greedy decode of `steps` steps of each prompt, all together (`sample_batch`, one forward
/// step over every request per iteration), after prefilling each: the seconds the decode
/// took and the tokens it produced.
fn decode_batch(
    runner: &dyn ModelRunner,
    prompts: &[Vec<u32>],
    steps: u32,
) -> Result<(f64, u64), String> {
    let g = *runner.geometry();
    let mut kvs = Vec::with_capacity(prompts.len());
    for p in prompts {
        let n = p.len() as u64;
        let mut kv = MemoryKv::new(g, n, u64::from(steps));
        runner.prefill(p, &mut kv).map_err(|e| e.to_string())?;
        kv.set_prefilled(n);
        kvs.push(kv);
    }
    let mut inputs: Vec<u32> = prompts.iter().filter_map(|p| p.last().copied()).collect();
    let t = Instant::now();
    for step in 0..steps {
        let mut batch: Vec<BatchStep<'_>> = kvs
            .iter_mut()
            .zip(prompts.iter().zip(&inputs))
            .map(|(kv, (p, &input))| BatchStep {
                owner: None,
                kv,
                input,
                step,
                prompt_len: u32::try_from(p.len()).unwrap_or(u32::MAX),
                sampling: &Sampling::GREEDY,
            })
            .collect();
        let picked = runner.sample_batch(&mut batch);
        for (input, t) in inputs.iter_mut().zip(picked) {
            *input = t.map_err(|e| e.to_string())?;
        }
    }
    Ok((
        t.elapsed().as_secs_f64(),
        u64::from(steps) * prompts.len() as u64,
    ))
}

/// The runner's figures, one JSON line per round: prefill of `prompt_len` tokens, `decode`
/// greedy steps after it with the quantized blocks (`decode_tok_s`) and with the f32
/// weights as before (`decode_f32_tok_s`), and `batch` requests of `batch_prompt` tokens
/// decoded together (`batch_tok_s`, all tokens of the batch per second) against one of them
/// alone (`one_tok_s`).
fn runner(
    threads: usize,
    prompt_len: usize,
    decode: u32,
    rounds: u32,
    batch: usize,
    batch_prompt: usize,
) -> Result<(), String> {
    if batch == 0 || batch_prompt == 0 || prompt_len == 0 {
        return Err("--prompt, --batch and --batch-prompt must be at least 1".into());
    }
    let path = llama::gguf::default_model_path();
    let g = llama::load::model_geometry(&path, 16, Dtype::Bf16).map_err(|e| error_chain(&e))?;
    let gguf = llama::gguf::Gguf::open(&path).map_err(|e| error_chain(&e))?;
    let tok = llama::tokenizer::Tokenizer::from_gguf(&gguf).map_err(|e| error_chain(&e))?;
    let w = llama::weights::LlamaWeights::from_gguf(&gguf).map_err(|e| error_chain(&e))?;
    let quantized =
        llama::runner::LlamaRunner::new(w, g, threads, Vec::new()).map_err(|e| error_chain(&e))?;
    let f32_decode = quantized.clone().with_quantized_decode(false);
    let prompt = prompt_tokens(&tok, prompt_len);
    let n = u32::try_from(prompt.len()).map_err(|e| e.to_string())?;
    // Different prompts of one length: the same text from different offsets.
    let long = prompt_tokens(&tok, batch_prompt + batch);
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|i| long[i..i + batch_prompt].to_vec())
        .collect();
    for round in 0..rounds {
        let mut kv = MemoryKv::new(g, u64::from(n), u64::from(decode));
        let t = Instant::now();
        quantized
            .prefill(&prompt, &mut kv)
            .map_err(|e| e.to_string())?;
        let prefill_s = t.elapsed().as_secs_f64();
        let (q_s, _) = decode_batch(&quantized, std::slice::from_ref(&prompt), decode)?;
        let (f_s, _) = decode_batch(&f32_decode, std::slice::from_ref(&prompt), decode)?;
        let (one_s, one_tokens) = decode_batch(&quantized, &prompts[..1], decode)?;
        let (batch_s, batch_tokens) = decode_batch(&quantized, &prompts, decode)?;
        println!(
            "{{\"impl\":\"kvfence\",\"threads\":{threads},\"round\":{round},\"prompt\":{n},\
             \"prefill_tok_s\":{:.1},\"decode\":{decode},\"decode_tok_s\":{:.2},\
             \"decode_f32_tok_s\":{:.2},\"batch\":{batch},\"batch_prompt\":{batch_prompt},\
             \"one_tok_s\":{:.2},\"batch_tok_s\":{:.2}}}",
            f64::from(n) / prefill_s,
            f64::from(decode) / q_s,
            f64::from(decode) / f_s,
            one_tokens as f64 / one_s,
            batch_tokens as f64 / batch_s,
        );
    }
    Ok(())
}

fn layout(context: usize, rounds: usize) -> Result<(), String> {
    use llama::layout::{EngineBlocks, PageOrder, attend, to_engine, write_token};
    if context == 0 || rounds == 0 {
        return Err(format!(
            "--context and --rounds must be at least 1 (got {context} and {rounds})"
        ));
    }
    // SmolLM2-135M: 30 layers, 9 query heads over 3 KV heads of 64 dimensions; 16 bf16
    // tokens per page, as the stack runs it.
    let g = PageGeometry {
        tokens_per_page: 16,
        layers: 30,
        kv_heads: 3,
        head_dim: 64,
        dtype: Dtype::Bf16,
    };
    let q_heads = 9;
    let tpp = g.tokens_per_page as usize;
    let page_bytes = usize::try_from(g.bytes_per_page()).map_err(|e| e.to_string())?;
    let n_pages = context.div_ceil(tpp);
    let per_token = g.layers as usize * 2 * g.kv_heads as usize * g.head_dim as usize;
    let wave = |n: usize, k: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 31 + k * 17) % 97) as f32 - 48.0) / 64.0)
            .collect()
    };
    let token_kv: Vec<Vec<f32>> = (0..16).map(|k| wave(per_token, k)).collect();
    let q = wave(g.layers as usize * q_heads * g.head_dim as usize, 99);
    let block = tpp * g.kv_heads as usize * g.head_dim as usize * g.dtype.size();
    let mut engine = vec![vec![0u8; n_pages * block]; 2 * g.layers as usize];
    let mut pages: Vec<Vec<Vec<u8>>> = PageOrder::ALL
        .iter()
        .map(|_| vec![vec![0u8; page_bytes]; n_pages])
        .collect();
    // Seconds per round of each measurement, per order.
    let mut write = [Vec::new(), Vec::new()];
    let mut step = [Vec::new(), Vec::new()];
    let mut nhd = [Vec::new(), Vec::new()];
    let mut hnd = [Vec::new(), Vec::new()];
    let mut copies = [[0usize; 2]; 2];
    let mut outputs: [Vec<f32>; 2] = [Vec::new(), Vec::new()];
    for round in 0..rounds {
        for k in 0..2 {
            let o = (k + round) % 2;
            let order = PageOrder::ALL[o];
            let t = Instant::now();
            for tok in 0..context {
                let page = &mut pages[o][tok / tpp];
                write_token(order, &g, page, tok % tpp, &token_kv[tok % 16]);
            }
            write[o].push(t.elapsed().as_secs_f64());
            let refs: Vec<&[u8]> = pages[o].iter().map(Vec::as_slice).collect();
            let t = Instant::now();
            outputs[o] = attend(order, &g, q_heads, &refs, context, &q);
            step[o].push(t.elapsed().as_secs_f64());
            for (b, blocks) in [EngineBlocks::Nhd, EngineBlocks::Hnd]
                .into_iter()
                .enumerate()
            {
                let t = Instant::now();
                copies[o][b] = to_engine(order, &g, &refs, blocks, &mut engine);
                let s = t.elapsed().as_secs_f64();
                if b == 0 {
                    nhd[o].push(s)
                } else {
                    hnd[o].push(s)
                }
            }
        }
    }
    let med = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let kv_bytes = (context * per_token * g.dtype.size()) as f64;
    println!(
        "kvllmbench layout: SmolLM2-135M shape (30 layers, 9 query / 3 KV heads x 64, bf16, 16 \
         tokens per page), {context} tokens in {n_pages} pages of {} KiB, median of {rounds} \
         rounds, orders alternating, one thread; attention outputs of the two orders {}",
        page_bytes / 1024,
        if outputs[0] == outputs[1] {
            "identical"
        } else {
            "DIFFER"
        }
    );
    println!("| what | layer-major (kvfence) | token-major | token-major / layer-major time |");
    println!("| --- | ---: | ---: | ---: |");
    let row = |what: &str, v: &[Vec<f64>; 2], unit: &dyn Fn(f64) -> String| {
        let (a, b) = (med(&v[0]), med(&v[1]));
        println!("| {what} | {} | {} | {:.2} |", unit(a), unit(b), b / a);
    };
    let per_tok = |s: f64| format!("{:.2} us/token", s / context as f64 * 1e6);
    let ms = |s: f64| format!("{:.2} ms", s * 1e3);
    let gbs = |s: f64| format!("{:.2} ms, {:.1} GB/s", s * 1e3, kv_bytes / s / 1e9);
    row("prefill: write every token's K/V", &write, &per_tok);
    row("decode: one step's attention over the context", &step, &ms);
    row(
        &format!(
            "pages into `[block][slot][head][dim]` blocks ({} / {} copies)",
            copies[0][0], copies[1][0]
        ),
        &nhd,
        &gbs,
    );
    row(
        &format!(
            "pages into `[block][head][slot][dim]` blocks ({} / {} copies)",
            copies[0][1], copies[1][1]
        ),
        &hnd,
        &gbs,
    );
    Ok(())
}

fn ttft(prompts: &[u32], threads: u32, requests: u32) -> Result<(), String> {
    let path = llama::gguf::default_model_path();
    let max_prompt = *prompts.iter().max().ok_or("no prompt lengths")?;
    let g: PageGeometry =
        llama::load::model_geometry(&path, 16, Dtype::Bf16).map_err(|e| error_chain(&e))?;
    let (tok, _) = llama::load::load_tokenizer(&path).map_err(|e| error_chain(&e))?;
    let dir = tempfile::Builder::new()
        .prefix("kvttft")
        .tempdir_in("/tmp")
        .map_err(|e| e.to_string())?;
    let mut cfg = Config::embedded_default(dir.path().join("ctl.sock"));
    cfg.geometry = g;
    cfg.limits.max_context = max_prompt;
    cfg.limits.max_new_tokens = 1;
    let pages = g.pages_for_tokens(u64::from(max_prompt) + 1);
    cfg.prefill.pool_pages = u32::try_from(pages + 1).map_err(|e| e.to_string())?;
    cfg.decode.pool_pages = cfg.prefill.pool_pages;
    cfg.model = ModelConfig {
        kind: ModelKind::Gguf,
        path: Some(path),
        threads,
    };
    cfg.deadlines.admission_wait = 600_000;
    cfg.deadlines.prefill = 600_000;
    cfg.deadlines.transfer = 60_000;
    cfg.deadlines.decode = 60_000;
    cfg.deadlines.request = 900_000;
    let stack = StackOptions::new(cfg, dir.path().join("stack"))
        .and_then(Stack::start)
        .map_err(|e| error_chain(&e))?;
    let decode_id = stack
        .worker_ids(Role::Decode)
        .into_iter()
        .next()
        .ok_or("no decode worker")?;
    let read = |stack: &Stack| -> Result<Reading, String> {
        let s = stack.status().map_err(|e| error_chain(&e))?;
        let get = |name: &str| kvfence_tests::counter(&s, name).unwrap_or(0);
        let worker = |name: &str| kvfence_tests::worker_counter(&s, &decode_id, name).unwrap_or(0);
        Ok(Reading {
            bootstrap_us: get("latency_bootstrap_us"),
            prefill_us: get("latency_prefill_us"),
            transfer_us: get("latency_transfer_us"),
            first_token_us: get("latency_first_token_us"),
            pull_us: worker("pull_us"),
            verify_us: worker("verify_us"),
            verified: worker("verified"),
        })
    };
    println!(
        "kvllmbench ttft: SmolLM2-135M, {threads} threads per worker, {requests} sequential \
         requests per length, one new token, shared memory"
    );
    println!(
        "| prompt tokens | pages | TTFT ms | bootstrap ms | prefill ms | transfer stage ms | \
         pull ms | verify ms | first step and the rest ms | prefill tok/s |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for &len in prompts {
        let prompt = prompt_tokens(&tok, len as usize);
        let mut sums = [0f64; 6];
        for _ in 0..requests {
            let before = read(&stack)?;
            let mut client = stack.client().map_err(|e| error_chain(&e))?;
            client.set_default_deadline(Duration::from_secs(900));
            client
                .generate("bench", &prompt, 1, 0, |_| {})
                .map_err(|e| error_chain(&e))?;
            // The worker's counters arrive with its next pool report.
            let after = kvctld::stack::wait_until(Duration::from_secs(10), || {
                read(&stack).ok().filter(|r| r.verified > before.verified)
            })
            .ok_or("decoded's counters did not show the request")?;
            let ms = |a: u64, b: u64| a.saturating_sub(b) as f64 / 1000.0;
            sums[0] += ms(after.first_token_us, before.first_token_us);
            sums[1] += ms(after.prefill_us, before.prefill_us);
            sums[2] += ms(after.transfer_us, before.transfer_us);
            sums[3] += ms(after.pull_us, before.pull_us);
            sums[4] += ms(after.verify_us, before.verify_us);
            sums[5] += ms(after.bootstrap_us, before.bootstrap_us);
        }
        let mean = sums.map(|s| s / f64::from(requests));
        println!(
            "| {len} | {} | {:.0} | {:.1} | {:.0} | {:.2} | {:.2} | {:.3} | {:.0} | {:.0} |",
            g.pages_for_tokens(u64::from(len)),
            mean[0],
            mean[5],
            mean[1],
            mean[2],
            mean[3],
            mean[4],
            mean[0] - mean[5] - mean[1] - mean[2],
            f64::from(len) / (mean[1] / 1000.0)
        );
    }
    Ok(())
}

/// Cumulative counters at one moment.
struct Reading {
    bootstrap_us: u64,
    prefill_us: u64,
    transfer_us: u64,
    first_token_us: u64,
    pull_us: u64,
    verify_us: u64,
    verified: u64,
}

fn main() -> ExitCode {
    let result = match Args::parse().what {
        What::Runner {
            threads,
            prompt,
            decode,
            rounds,
            batch,
            batch_prompt,
        } => runner(threads, prompt, decode, rounds, batch, batch_prompt),
        What::Ttft {
            prompts,
            threads,
            requests,
        } => ttft(&prompts, threads, requests),
        What::Layout { context, rounds } => layout(context, rounds),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvllmbench: {e}");
            ExitCode::from(2)
        }
    }
}
