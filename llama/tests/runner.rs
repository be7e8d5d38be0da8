//! The runner against a naive dense reference on small random models, its independence of
//! the thread count, chunked prefill, and that decode reads the pages; the real model against
//! llama.cpp; and the runner's speed (ignored tests).

// Sizes here are small test shapes and token counts.
#![allow(clippy::cast_possible_truncation)]

use libkv::model::{KvRead, MemoryKv, ModelError, ModelRunner, PageWrite, monolithic_paged};
use libkv::proto::Sampling;
use libkv::{Dtype, Kv, PageGeometry};
use llama::runner::{LlamaRunner, RunnerError};
use llama::weights::{LayerWeights, LlamaConfig, LlamaWeights};

/// A small seeded generator (SplitMix64), values uniform in `[-scale, scale)`.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn uniform(&mut self, scale: f32) -> f32 {
        let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        (u * 2.0 - 1.0) * scale
    }

    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(scale)).collect()
    }

    /// Norm weights around 1.
    fn norm(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| 1.0 + self.uniform(0.2)).collect()
    }

    fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n)
            .map(|_| (self.next() % vocab as u64) as u32)
            .collect()
    }
}

fn tiny_config() -> LlamaConfig {
    LlamaConfig {
        layers: 2,
        hidden: 32,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        ffn: 48,
        vocab: 50,
        context: 4096,
        rope_base: 10000.0,
        rms_eps: 1e-5,
    }
}

/// Random weights for `c`, scaled so that activations stay near unit size.
fn random_weights(c: &LlamaConfig, seed: u64, tied: bool) -> LlamaWeights {
    let mut r = Rng(seed);
    let (q, kv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let s_in = 1.0 / (c.hidden as f32).sqrt() * 1.7;
    let layers = (0..c.layers)
        .map(|_| LayerWeights {
            attn_norm: r.norm(c.hidden),
            wq: r.vec(q * c.hidden, s_in * 2.0),
            wk: r.vec(kv * c.hidden, s_in * 2.0),
            wv: r.vec(kv * c.hidden, s_in),
            wo: r.vec(c.hidden * q, 1.7 / (q as f32).sqrt()),
            ffn_norm: r.norm(c.hidden),
            w_gate: r.vec(c.ffn * c.hidden, s_in),
            w_up: r.vec(c.ffn * c.hidden, s_in),
            w_down: r.vec(c.hidden * c.ffn, 1.7 / (c.ffn as f32).sqrt()),
        })
        .collect();
    LlamaWeights {
        config: c.clone(),
        token_embd: r.vec(c.vocab * c.hidden, 1.0),
        layers,
        output_norm: r.norm(c.hidden),
        output: (!tied).then(|| r.vec(c.vocab * c.hidden, s_in * 3.0)),
        quant: Default::default(),
    }
}

fn geometry(c: &LlamaConfig, tokens_per_page: u32, dtype: Dtype) -> PageGeometry {
    PageGeometry {
        tokens_per_page,
        layers: c.layers as u32,
        kv_heads: c.kv_heads as u32,
        head_dim: c.head_dim as u32,
        dtype,
    }
}

// ---------------------------------------------------------------------------------------------
// The dense reference: plain loops, every position recomputed at every step.

fn matvec(w: &[f32], x: &[f32]) -> Vec<f32> {
    w.chunks_exact(x.len())
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / x.len() as f64;
    let s = (1.0 / (ms + f64::from(eps)).sqrt()) as f32;
    x.iter().zip(w).map(|(v, g)| v * s * g).collect()
}

fn rope(x: &mut [f32], pos: usize, base: f32) {
    let hd = x.len();
    for i in 0..hd / 2 {
        let angle = pos as f64 * f64::from(base).powf(-2.0 * i as f64 / hd as f64);
        let (c, s) = (angle.cos() as f32, angle.sin() as f32);
        let (a, b) = (x[i], x[i + hd / 2]);
        x[i] = a * c - b * s;
        x[i + hd / 2] = b * c + a * s;
    }
}

/// `v` rounded through the page dtype, with libkv's own scalar codec.
fn round(v: &mut [f32], dtype: Dtype) {
    let mut b = [0u8; 4];
    for x in v {
        dtype.encode(*x, &mut b);
        *x = dtype.decode(&b);
    }
}

/// The logits after the last of `tokens`.
fn reference_logits(w: &LlamaWeights, tokens: &[u32], dtype: Dtype) -> Vec<f32> {
    let c = &w.config;
    let (hd, group) = (c.head_dim, c.heads / c.kv_heads);
    let mut x: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&t| w.token_embd[t as usize * c.hidden..(t as usize + 1) * c.hidden].to_vec())
        .collect();
    for lw in &w.layers {
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (p, xp) in x.iter().enumerate() {
            let h = rms_norm(xp, &lw.attn_norm, c.rms_eps);
            let mut q = matvec(&lw.wq, &h);
            let mut k = matvec(&lw.wk, &h);
            let mut v = matvec(&lw.wv, &h);
            q.chunks_exact_mut(hd).for_each(|q| rope(q, p, c.rope_base));
            k.chunks_exact_mut(hd).for_each(|k| rope(k, p, c.rope_base));
            round(&mut k, dtype);
            round(&mut v, dtype);
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for (p, xp) in x.iter_mut().enumerate() {
            let mut att = vec![0f32; c.heads * hd];
            for j in 0..c.heads {
                let g = j / group;
                let q = &qs[p][j * hd..(j + 1) * hd];
                let mut s: Vec<f32> = (0..=p)
                    .map(|t| {
                        let k = &ks[t][g * hd..(g + 1) * hd];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt()
                    })
                    .collect();
                let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                s.iter_mut().for_each(|v| *v = (*v - max).exp());
                let sum: f32 = s.iter().sum();
                for (t, pt) in s.iter().enumerate() {
                    for d in 0..hd {
                        att[j * hd + d] += pt / sum * vs[t][g * hd + d];
                    }
                }
            }
            let o = matvec(&lw.wo, &att);
            xp.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            let h = rms_norm(xp, &lw.ffn_norm, c.rms_eps);
            let gate = matvec(&lw.w_gate, &h);
            let up = matvec(&lw.w_up, &h);
            let act: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let o = matvec(&lw.w_down, &act);
            xp.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
        }
    }
    let h = rms_norm(x.last().unwrap(), &w.output_norm, c.rms_eps);
    matvec(w.output.as_deref().unwrap_or(&w.token_embd), &h)
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

// ---------------------------------------------------------------------------------------------
// Driving the runner by hand, to see the logits of every step.

/// Prefills `prompt` into memory pages and decodes `max_new` greedy tokens; returns each
/// step's logits and the tokens.
fn run_paged(r: &LlamaRunner, prompt: &[u32], max_new: u32) -> (Vec<Vec<f32>>, Vec<u32>) {
    let len = prompt.len() as u32;
    let mut kv = MemoryKv::new(*r.geometry(), u64::from(len), u64::from(max_new));
    assert!(r.prefill_chunked(prompt, &mut kv, &mut |_| true).unwrap());
    kv.set_prefilled(u64::from(len));
    let mut input = *prompt.last().unwrap();
    let (mut all, mut tokens) = (Vec::new(), Vec::new());
    for step in 0..max_new {
        let logits = r.step_logits(&mut kv, input, step, len).unwrap();
        input = argmax(&logits);
        assert_eq!(kv.positions(), u64::from(len + step));
        all.push(logits);
        tokens.push(input);
    }
    (all, tokens)
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-4 * scale,
            "{what}: logit {i} is {g}, the reference has {w}"
        );
    }
}

#[test]
fn runner_matches_the_dense_reference() {
    let c = tiny_config();
    let mut rng = Rng(99);
    let cases: &[(u32, Dtype, usize, Option<usize>, bool)] = &[
        // (tokens_per_page, dtype, prompt length, prefill chunk, tied embeddings)
        (1, Dtype::F32, 1, None, true),
        (1, Dtype::F32, 13, Some(4), true),
        (3, Dtype::F32, 20, Some(6), false),
        (16, Dtype::F32, 37, Some(16), true),
        (1, Dtype::F16, 29, Some(5), true),
        (3, Dtype::F16, 23, Some(7), false),
        (16, Dtype::F16, 50, Some(16), true),
        (1, Dtype::Bf16, 11, None, true),
        (3, Dtype::Bf16, 40, Some(9), true),
        (16, Dtype::Bf16, 33, Some(16), false),
        // The default chunks of 256 tokens, crossed.
        (16, Dtype::Bf16, 300, None, true),
        (3, Dtype::F16, 260, None, false),
    ];
    for (i, &(tpp, dtype, len, chunk, tied)) in cases.iter().enumerate() {
        let w = random_weights(&c, 1000 + i as u64, tied);
        let mut r = LlamaRunner::new(w.clone(), geometry(&c, tpp, dtype), 1, Vec::new()).unwrap();
        if let Some(chunk) = chunk {
            r = r.with_chunk_tokens(chunk);
        }
        let prompt = rng.tokens(len, c.vocab);
        let max_new = 6;
        let (logits, tokens) = run_paged(&r, &prompt, max_new);
        let mut seq = prompt.clone();
        for (step, (l, &t)) in logits.iter().zip(&tokens).enumerate() {
            let want = reference_logits(&w, &seq, dtype);
            let what = format!("case {i} (tpp {tpp}, {dtype:?}, prompt {len}) step {step}");
            assert_close(l, &want, &what);
            assert_eq!(t, argmax(&want), "{what}: token");
            seq.push(t);
        }
        let out = monolithic_paged(&r, &prompt, max_new, &Sampling::GREEDY).unwrap();
        assert_eq!(out.tokens, tokens, "case {i}: monolithic_paged");
    }
}

/// A model large enough that every product, and the attention, is split over threads.
fn wide_config() -> LlamaConfig {
    LlamaConfig {
        layers: 2,
        hidden: 256,
        heads: 8,
        kv_heads: 4,
        head_dim: 32,
        ffn: 512,
        vocab: 1000,
        context: 4096,
        rope_base: 10000.0,
        rms_eps: 1e-5,
    }
}

#[test]
fn runner_output_does_not_depend_on_threads() {
    let c = wide_config();
    let w = random_weights(&c, 7, true);
    let prompt = Rng(3).tokens(300, c.vocab);
    let run = |threads| {
        let g = geometry(&c, 16, Dtype::Bf16);
        let r = LlamaRunner::new(w.clone(), g, threads, Vec::new()).unwrap();
        run_paged(&r, &prompt, 4)
    };
    let one = run(1);
    for threads in [2, 3] {
        let other = run(threads);
        assert_eq!(other.1, one.1, "tokens with {threads} threads");
        assert!(other.0 == one.0, "logits with {threads} threads differ");
    }
}

#[test]
fn runner_prefill_stops_when_told() {
    let c = tiny_config();
    let r = LlamaRunner::new(
        random_weights(&c, 5, true),
        geometry(&c, 4, Dtype::F16),
        2,
        vec![],
    )
    .unwrap()
    .with_chunk_tokens(8);
    let prompt = Rng(1).tokens(30, c.vocab);
    let mut kv = MemoryKv::new(*r.geometry(), 30, 0);
    let mut asked = Vec::new();
    let done = r
        .prefill_chunked(&prompt, &mut kv, &mut |n| {
            asked.push(n);
            n < 16
        })
        .unwrap();
    assert!(!done);
    assert_eq!(asked, [8, 16]);
    let mut asked = Vec::new();
    assert!(
        r.prefill_chunked(&prompt, &mut kv, &mut |n| {
            asked.push(n);
            true
        })
        .unwrap()
    );
    assert_eq!(asked, [8, 16, 24]);
}

#[test]
fn runner_decode_reads_the_pages() {
    let c = tiny_config();
    let g = geometry(&c, 4, Dtype::Bf16);
    let r = LlamaRunner::new(random_weights(&c, 8, true), g, 1, vec![]).unwrap();
    let prompt = Rng(2).tokens(10, c.vocab);
    let mut kv = MemoryKv::new(g, 10, 2);
    r.prefill(&prompt, &mut kv).unwrap();
    kv.set_prefilled(10);
    let last = *prompt.last().unwrap();
    let base = r.step_logits(&mut kv.clone(), last, 0, 10).unwrap();
    assert_eq!(base, r.step_logits(&mut kv.clone(), last, 0, 10).unwrap());
    for (layer, pos) in [(0, 0), (1, 5), (1, 9)] {
        let mut bad = kv.clone();
        // The high byte (sign, exponent) of dimension 1 of KV head 1's K.
        let off = g.element_offset(layer, Kv::K, 1, pos % 4, 1) + 1;
        bad.page_mut((pos / 4) as usize).unwrap()[off] ^= 0x01;
        let changed = r.step_logits(&mut bad, last, 0, 10).unwrap();
        assert_ne!(changed, base, "a K byte of layer {layer}, position {pos}");
    }
}

#[test]
fn runner_prefill_zeroes_the_rest_of_the_last_page() {
    let c = tiny_config();
    let g = geometry(&c, 16, Dtype::F16);
    let r = LlamaRunner::new(random_weights(&c, 8, true), g, 1, vec![]).unwrap();
    let mut kv = MemoryKv::new(g, 20, 0);
    for i in 0..2 {
        kv.page_mut(i).unwrap().fill(0xAB);
    }
    r.prefill(&Rng(4).tokens(20, c.vocab), &mut kv).unwrap();
    let page = kv.page_mut(1).unwrap().to_vec();
    for layer in 0..2 {
        for which in [Kv::K, Kv::V] {
            for head in 0..2 {
                for slot in 0..16 {
                    let off = g.vector_offset(layer, which, head, slot);
                    let v = &page[off..off + 16];
                    if slot < 4 {
                        assert!(v.iter().any(|&b| b != 0 && b != 0xAB));
                    } else {
                        assert!(v.iter().all(|&b| b == 0), "slot {slot} is not zero");
                    }
                }
            }
        }
    }
}

#[test]
fn runner_refuses_bad_input() {
    let c = tiny_config();
    let w = random_weights(&c, 8, true);
    let g = geometry(&c, 4, Dtype::F16);
    let mut other = g;
    other.kv_heads = 4;
    let e = LlamaRunner::new(w.clone(), other, 1, vec![]).unwrap_err();
    assert_eq!(
        e,
        RunnerError::GeometryMismatch {
            what: "kv_heads",
            geometry: 4,
            model: 2
        }
    );
    assert!(e.to_string().contains("kv_heads 4") && e.to_string().contains("model has 2"));
    let mut short = w.clone();
    short.layers[1].w_up.pop();
    assert!(matches!(
        LlamaRunner::new(short, g, 1, vec![]),
        Err(RunnerError::TensorShape { .. })
    ));

    let r = LlamaRunner::new(w, g, 1, vec![7]).unwrap();
    assert!(r.is_stop(7) && !r.is_stop(8));
    assert_eq!(r.vocab(), 50);
    let mut kv = MemoryKv::new(g, 8, 1);
    assert_eq!(
        r.prefill(&[1, 2, 50], &mut kv),
        Err(ModelError::OutOfVocab {
            token: 50,
            vocab: 50
        })
    );
    // Nine tokens do not fit in the two pages of four there are.
    let mut two = MemoryKv::new(g, 8, 0);
    assert!(matches!(
        r.prefill(&[1; 9], &mut two),
        Err(ModelError::Failed(_))
    ));
    r.prefill(&[1; 8], &mut kv).unwrap();
    kv.set_prefilled(8);
    assert!(matches!(
        r.step(&mut kv, 60, 0, 8),
        Err(ModelError::OutOfVocab { .. })
    ));
    assert!(matches!(
        r.step(&mut kv, 1, 3, 8),
        Err(ModelError::Failed(_))
    ));
    assert!(r.step(&mut kv, 1, 0, 8).is_ok());
    assert!(r.step(&mut kv, 1, 1, 8).is_ok());
    // The cache is full now.
    assert!(matches!(r.step(&mut kv, 1, 2, 8), Err(ModelError::Pool(_))));
}

/// SmolLM2-135M's shapes.
fn smollm_config() -> LlamaConfig {
    LlamaConfig {
        layers: 30,
        hidden: 576,
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
        ffn: 1536,
        vocab: 49152,
        context: 8192,
        rope_base: 100000.0,
        rms_eps: 1e-5,
    }
}

/// Prefill and decode speed of `w` with 1 and 2 threads (bf16 pages of 16 tokens), the best
/// of three runs each (the machine's memory bandwidth varies).
fn report_speed(w: &LlamaWeights, what: &str) {
    use std::time::Instant;
    let c = &w.config;
    let prompt = Rng(9).tokens(512, c.vocab);
    let g = geometry(c, 16, Dtype::Bf16);
    let new = 32u32;
    for threads in [1, 2] {
        let r = LlamaRunner::new(w.clone(), g, threads, Vec::new()).unwrap();
        let best = |f: &mut dyn FnMut() -> f64| (0..3).map(|_| f()).fold(f64::INFINITY, f64::min);
        let prefill = best(&mut || {
            let mut kv = MemoryKv::new(g, 512, 0);
            let t = Instant::now();
            r.prefill(&prompt, &mut kv).unwrap();
            t.elapsed().as_secs_f64()
        });
        // Decoding after a prompt of `len` tokens.
        let decode = |len: usize| {
            let mut kv = MemoryKv::new(g, len as u64, u64::from(new));
            r.prefill(&prompt[..len], &mut kv).unwrap();
            kv.set_prefilled(len as u64);
            let t = Instant::now();
            let mut input = prompt[len - 1];
            for step in 0..new {
                input = r.step(&mut kv, input, step, len as u32).unwrap();
            }
            t.elapsed().as_secs_f64()
        };
        let short = best(&mut || decode(16));
        let long = best(&mut || decode(512));
        eprintln!(
            "{what}, {threads} thread(s): prefill 512 tokens {:.0} tok/s; decode {:.1} tok/s \
             after 16 tokens, {:.1} tok/s after 512",
            512.0 / prefill,
            f64::from(new) / short,
            f64::from(new) / long,
        );
    }
}

#[test]
#[ignore = "a benchmark: cargo test --release -p llama runner_speed -- --ignored --nocapture --test-threads=1"]
fn runner_speed_real_model() {
    if let Some((_, w)) = real_model() {
        report_speed(&w, "SmolLM2-135M");
    }
}

#[test]
#[ignore = "a benchmark: cargo test --release -p llama runner_speed -- --ignored --nocapture --test-threads=1"]
fn runner_speed_smollm_shapes() {
    report_speed(
        &random_weights(&smollm_config(), 1, true),
        "random SmolLM2-135M shapes",
    );
}

// ---------------------------------------------------------------------------------------------
// The real model.

/// llama.cpp's ids (llama-cpp-python 0.3.36, `tokenize(special=True)`) for the ChatML prompt
/// of "What is the capital of France?" with SmolLM2's default system message.
const FRANCE_PROMPT: [u32; 37] = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531,
    198,
];

/// llama.cpp's greedy answer to [`FRANCE_PROMPT`], with the model dequantized to f32
/// (`llama_model_quantize` to `ALL_F32`, so that no activation is quantized): "The capital
/// of France is Paris." and `<|im_end|>`. Straight from the Q4_1 file, llama.cpp quantizes the
/// activations to 8 bits for its Q4_1 products and answers "L'Étoile..." instead: its first
/// logits are a three-way near tie ("L" 24.91, "The" 24.56, 15319 24.46), which the f32
/// computation resolves the other way ("The" 25.32, "L" 25.24 in llama.cpp f32 and here).
/// Forced on this answer, the Q4_1 run agrees on every later token.
const FRANCE_ANSWER: [u32; 8] = [504, 3575, 282, 4649, 314, 7042, 30, 2];

/// The model, or `None` (with a line saying so) when its file is absent.
fn real_model() -> Option<(llama::gguf::Gguf, LlamaWeights)> {
    let path = llama::gguf::default_model_path();
    if !path.exists() {
        eprintln!(
            "skipped: no model at {} (set KVFENCE_MODEL)",
            path.display()
        );
        return None;
    }
    let gguf = llama::gguf::Gguf::open(&path).expect("opening the model");
    let w = LlamaWeights::from_gguf(&gguf).expect("loading the weights");
    Some((gguf, w))
}

#[test]
fn runner_real_model_answers_paris() {
    use llama::chat::{Message, encode_chat, stop_tokens};
    use llama::tokenizer::Tokenizer;
    let Some((gguf, w)) = real_model() else {
        return;
    };
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    let prompt = encode_chat(
        &tok,
        &[Message::user("What is the capital of France?")],
        true,
    )
    .unwrap();
    assert_eq!(prompt, FRANCE_PROMPT, "the tokenizer against llama.cpp");
    let stop = stop_tokens(&tok);
    let c = w.config.clone();
    let g = geometry(&c, 16, Dtype::Bf16);
    // Step 0 against the dense reference, with f32 pages: with bf16 ones, the two sum in
    // different orders, a few of the ~400k K/V values round to the other side in bf16, and
    // the logits differ by about 1e-3.
    let reference = reference_logits(&w, &prompt, Dtype::F32);
    let r32 = LlamaRunner::new(w.clone(), geometry(&c, 16, Dtype::F32), 2, vec![])
        .unwrap()
        .with_quantized_decode(false);
    assert_close(
        &run_paged(&r32, &prompt, 1).0[0],
        &reference,
        "real model, f32 pages",
    );
    drop(r32);
    // The f32 computation, as llama.cpp's f32 run: decode with f32 weights and vectors.
    let r = LlamaRunner::new(w, g, 2, stop.clone())
        .unwrap()
        .with_quantized_decode(false);
    let (logits, tokens) = run_paged(&r, &prompt, 12);
    for (step, l) in logits.iter().enumerate() {
        let mut top: Vec<(usize, f32)> = l.iter().copied().enumerate().collect();
        top.sort_by(|a, b| b.1.total_cmp(&a.1));
        eprintln!("step {step}: top 3 {:?}", &top[..3]);
    }
    let end = tokens
        .iter()
        .position(|t| stop.contains(t))
        .unwrap_or(tokens.len());
    let text = String::from_utf8_lossy(&tok.decode(&tokens[..end])).into_owned();
    eprintln!("tokens {tokens:?}, text {text:?}");
    assert_eq!(text, "The capital of France is Paris.");
    assert_eq!(
        tokens[..FRANCE_ANSWER.len()],
        FRANCE_ANSWER,
        "llama.cpp's f32 answer"
    );
    // The same through the ModelRunner seam, stop token excluded.
    let out = monolithic_paged(&r, &prompt, 12, &Sampling::GREEDY).unwrap();
    assert_eq!(out.tokens, tokens[..end]);
}

/// llama.cpp's greedy answer to [`FRANCE_PROMPT`] straight from the Q4_1 file, its
/// activations quantized to 8 bits per block of 32 for the Q4_1 and Q8_0 products, as
/// kvfence's quantized decode quantizes them ("L'Étoile, la Cité, la Nation, la Gé").
/// llama.cpp's top-two margins at these steps are 0.089, 1.497, 0.719, 3.589, 1.44, 0.825
/// and 0.596; at the next step they are 0.019 apart, and the two diverge there.
const FRANCE_ANSWER_Q8: [u32; 7] = [60, 23, 39614, 1141, 552, 28, 2618];

#[test]
fn runner_real_model_with_quantized_vectors_answers_as_llama_cpp_does() {
    let Some((_, w)) = real_model() else {
        return;
    };
    let g = geometry(&w.config, 16, Dtype::Bf16);
    let r = LlamaRunner::new(w, g, 2, vec![]).unwrap();
    let (_, tokens) = run_paged(&r, &FRANCE_PROMPT, 7);
    assert_eq!(tokens, FRANCE_ANSWER_Q8, "llama.cpp's Q4_1 answer");
}

// ---------------------------------------------------------------------------------------------
// Quantized and batched decode: each request's tokens as when it runs alone.

/// `w` rounded to ggml blocks: Q8_0 for the embedding, Q4_1 for the layers' matrices, the
/// blocks kept in `w.quant` and the f32 copies replaced by their exact dequantization, as a
/// quantized model file loads. Every `cols` must be a multiple of 32.
#[allow(clippy::cast_sign_loss)] // clamped to 0..=15 before the cast
fn quantize(mut w: LlamaWeights) -> LlamaWeights {
    use llama::gguf::dequantize_into;
    use llama::quant::{QuantKind, QuantMatrix};
    fn f16(v: f32) -> [u8; 2] {
        half::f16::from_f32(v).to_le_bytes()
    }
    fn blocks(kind: QuantKind, w: &[f32]) -> Vec<u8> {
        let mut out = Vec::new();
        for b in w.chunks_exact(32) {
            match kind {
                QuantKind::Q8_0 => {
                    let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let d = half::f16::from_f32(amax / 127.0).to_f32();
                    out.extend_from_slice(&f16(d));
                    let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
                    out.extend(b.iter().map(|v| ((v * inv).round() as i8).cast_unsigned()));
                }
                QuantKind::Q4_1 => {
                    let lo = b.iter().fold(f32::MAX, |m, &v| m.min(v));
                    let hi = b.iter().fold(f32::MIN, |m, &v| m.max(v));
                    let d = half::f16::from_f32((hi - lo) / 15.0).to_f32();
                    let m = half::f16::from_f32(lo).to_f32();
                    out.extend_from_slice(&f16(d));
                    out.extend_from_slice(&f16(m));
                    let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
                    let q = |v: f32| ((v - m) * inv).round().clamp(0.0, 15.0) as u8;
                    out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
                }
            }
        }
        out
    }
    // Quantizes `f` ([rows][cols]) in place to its dequantized blocks; returns the blocks.
    let quant = |kind: QuantKind, f: &mut Vec<f32>, cols: usize| {
        let bytes = blocks(kind, f);
        dequantize_into(kind.ggml_type(), &bytes, f).unwrap();
        Some(QuantMatrix::new(kind, f.len() / cols, cols, bytes).unwrap())
    };
    let c = w.config.clone();
    let (h, q, ffn) = (c.hidden, c.heads * c.head_dim, c.ffn);
    w.quant.token_embd = quant(QuantKind::Q8_0, &mut w.token_embd, h);
    if let Some(o) = w.output.as_mut() {
        w.quant.output = quant(QuantKind::Q8_0, o, h);
    }
    for l in &mut w.layers {
        let kind = QuantKind::Q4_1;
        w.quant.layers.push(llama::weights::LayerQuant {
            wq: quant(kind, &mut l.wq, h),
            wk: quant(kind, &mut l.wk, h),
            wv: quant(kind, &mut l.wv, h),
            wo: quant(kind, &mut l.wo, q),
            w_gate: quant(kind, &mut l.w_gate, h),
            w_up: quant(kind, &mut l.w_up, h),
            w_down: quant(kind, &mut l.w_down, ffn),
        });
    }
    w
}

/// One request of [`decode_together`]: joins the batch at iteration `join`.
struct Req {
    prompt: Vec<u32>,
    max_new: u32,
    sampling: Sampling,
    join: usize,
}

/// Prefills every request, then decodes them together with `sample_batch`, request `i`
/// joining at its iteration and leaving when done (at a stop token or `max_new`): each
/// request's tokens and final signature.
fn decode_together(r: &LlamaRunner, reqs: &[Req]) -> Vec<libkv::model::Output> {
    let mut kvs: Vec<MemoryKv> = reqs
        .iter()
        .map(|q| {
            let len = q.prompt.len() as u64;
            let mut kv = MemoryKv::new(*r.geometry(), len, u64::from(q.max_new));
            r.prefill(&q.prompt, &mut kv).unwrap();
            kv.set_prefilled(len);
            kv
        })
        .collect();
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); reqs.len()];
    let mut done = vec![false; reqs.len()];
    let mut widest = 0;
    for it in 0.. {
        let active: Vec<usize> = (0..reqs.len())
            .filter(|&i| reqs[i].join <= it && !done[i])
            .collect();
        if active.is_empty() && done.iter().all(|&d| d) {
            break;
        }
        let mut steps: Vec<libkv::model::BatchStep<'_>> = Vec::new();
        let mut order = Vec::new();
        for (i, kv) in kvs.iter_mut().enumerate() {
            if !active.contains(&i) {
                continue;
            }
            let q = &reqs[i];
            let step = tokens[i].len() as u32;
            let input = tokens[i]
                .last()
                .copied()
                .unwrap_or(*q.prompt.last().unwrap());
            steps.push(libkv::model::BatchStep {
                owner: None,
                kv,
                input,
                step,
                prompt_len: q.prompt.len() as u32,
                sampling: &q.sampling,
            });
            order.push(i);
        }
        widest = widest.max(steps.len());
        for (i, t) in order.into_iter().zip(r.sample_batch(&mut steps)) {
            let t = t.unwrap();
            if r.is_stop(t) {
                done[i] = true;
                continue;
            }
            tokens[i].push(t);
            done[i] = tokens[i].len() as u32 == reqs[i].max_new;
        }
    }
    assert!(widest > 1, "the requests never ran together");
    tokens
        .into_iter()
        .zip(&kvs)
        .map(|(tokens, kv)| libkv::model::Output {
            tokens,
            signature: r.signature(kv),
        })
        .collect()
}

/// Requests of several lengths joining a running batch at different steps, one sampled.
fn staggered(vocab: usize, lens: &[usize], max_new: u32) -> Vec<Req> {
    let mut rng = Rng(41);
    lens.iter()
        .enumerate()
        .map(|(i, &len)| Req {
            prompt: rng.tokens(len, vocab),
            max_new: max_new + i as u32,
            sampling: if i == 1 {
                Sampling {
                    temperature_milli: 800,
                    top_p_milli: 900,
                    seed: 5,
                }
            } else {
                Sampling::GREEDY
            },
            join: [0, 0, 2, 5, 3][i % 5],
        })
        .collect()
}

#[test]
fn quantized_and_batched_decode_give_each_request_its_own_tokens() {
    let c = LlamaConfig {
        hidden: 64,
        ffn: 96,
        vocab: 300,
        ..wide_config()
    };
    let w = quantize(random_weights(&c, 23, true));
    let reqs = staggered(c.vocab, &[1, 17, 40, 100, 64], 6);
    for tpp in [1, 16] {
        let g = geometry(&c, tpp, Dtype::Bf16);
        for quantized in [true, false] {
            // Batched on two threads, alone on one: the same tokens, bit for bit the same
            // logits, with quantized vectors (the integer kernels) and with f32 ones.
            let batched = LlamaRunner::new(w.clone(), g, 2, Vec::new())
                .unwrap()
                .with_quantized_decode(quantized);
            let single = LlamaRunner::new(w.clone(), g, 1, Vec::new())
                .unwrap()
                .with_quantized_decode(quantized);
            let alone: Vec<_> = reqs
                .iter()
                .map(|q| monolithic_paged(&single, &q.prompt, q.max_new, &q.sampling).unwrap())
                .collect();
            let together = decode_together(&batched, &reqs);
            for (i, (t, a)) in together.iter().zip(&alone).enumerate() {
                let what = format!("tpp {tpp} quantized {quantized} request {i}");
                assert_eq!(t.tokens, a.tokens, "{what}: batched tokens");
                assert_eq!(t.signature, a.signature, "{what}: signature");
            }
            let bits = |v: &[Vec<f32>]| v.concat().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for (i, q) in reqs.iter().enumerate() {
                let (a, _) = run_paged(&batched, &q.prompt, 3);
                let (b, _) = run_paged(&single, &q.prompt, 3);
                assert!(
                    bits(&a) == bits(&b),
                    "tpp {tpp} quantized {quantized} request {i}: logits"
                );
            }
        }
        // Quantizing the vectors moves the logits a little, not the answer's shape: within
        // 5 % of the largest logit of the f32 computation (3 % measured).
        let quantized = LlamaRunner::new(w.clone(), g, 2, Vec::new()).unwrap();
        let f32_decode = quantized.clone().with_quantized_decode(false);
        for q in &reqs {
            let (a, _) = run_paged(&quantized, &q.prompt, 1);
            let (b, _) = run_paged(&f32_decode, &q.prompt, 1);
            let scale = b[0].iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = a[0]
                .iter()
                .zip(&b[0])
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                worst <= 0.05 * scale,
                "quantized logits {worst} from f32, scale {scale}"
            );
            assert_ne!(a, b, "the quantized path ran");
        }
    }
}

#[test]
fn a_request_that_cannot_step_fails_alone_in_its_batch() {
    let c = tiny_config();
    let g = geometry(&c, 4, Dtype::F16);
    let r = LlamaRunner::new(random_weights(&c, 2, true), g, 2, Vec::new()).unwrap();
    let prompt = Rng(8).tokens(9, c.vocab);
    let alone = monolithic_paged(&r, &prompt, 2, &Sampling::GREEDY).unwrap();
    let mut kvs: Vec<MemoryKv> = (0..3)
        .map(|_| {
            let mut kv = MemoryKv::new(g, 9, 2);
            r.prefill(&prompt, &mut kv).unwrap();
            kv.set_prefilled(9);
            kv
        })
        .collect();
    let inputs = [
        *prompt.last().unwrap(),
        c.vocab as u32 + 7,
        *prompt.last().unwrap(),
    ];
    let mut steps: Vec<libkv::model::BatchStep<'_>> = kvs
        .iter_mut()
        .zip(inputs)
        .map(|(kv, input)| libkv::model::BatchStep {
            owner: None,
            kv,
            input,
            step: 0,
            prompt_len: 9,
            sampling: &Sampling::GREEDY,
        })
        .collect();
    let out = r.sample_batch(&mut steps);
    assert!(
        matches!(out[1], Err(ModelError::OutOfVocab { .. })),
        "{out:?}"
    );
    assert_eq!(out[0].as_ref().ok(), Some(&alone.tokens[0]));
    assert_eq!(out[2].as_ref().ok(), Some(&alone.tokens[0]));
}

#[test]
fn real_model_batched_and_quantized_decode_equal_each_request_alone() {
    let Some((_, w)) = real_model() else { return };
    let c = w.config.clone();
    assert!(
        w.quant.layers.iter().all(|l| l.w_down.is_some()),
        "Q4_1 blocks kept"
    );
    assert!(w.quant.token_embd.is_some(), "Q8_0 embedding kept");
    let reqs = staggered(c.vocab, &[5, 40, 130], 10);
    let g = geometry(&c, 16, Dtype::Bf16);
    let quantized = LlamaRunner::new(w.clone(), g, 2, Vec::new()).unwrap();
    let single = LlamaRunner::new(w, g, 1, Vec::new()).unwrap();
    let together = decode_together(&quantized, &reqs);
    for (i, (q, t)) in reqs.iter().zip(&together).enumerate() {
        let alone = monolithic_paged(&single, &q.prompt, q.max_new, &q.sampling).unwrap();
        assert_eq!(t.tokens, alone.tokens, "request {i}");
        assert_eq!(t.signature, alone.signature, "request {i}: signature");
    }
}
