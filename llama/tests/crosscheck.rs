//! The kvfence side of `scripts/crosscheck-llamacpp.sh`: greedy outputs of the prompts in
//! `fixtures/crosscheck_prompts.json` through the monolithic path of the runner (the code
//! decode runs, on f16 pages like llama.cpp's default KV cache), with each step's top-two
//! logit margin, as JSON lines into the file `$KVFENCE_CROSSCHECK_OUT`; with
//! `KVFENCE_CROSSCHECK_DECODE=f32`, decode's f32 computation instead of its quantized
//! vectors. Ignored by default: the script runs it.

use libkv::model::{MemoryKv, ModelRunner};
use llama::chat::Message;
use llama::runner::LlamaRunner;
use std::io::Write as _;

const MAX_NEW: u32 = 32;

#[test]
#[ignore = "run by scripts/crosscheck-llamacpp.sh"]
fn emit_kvfence_tokens() {
    let out_path = std::env::var_os("KVFENCE_CROSSCHECK_OUT").expect("KVFENCE_CROSSCHECK_OUT");
    let path = llama::gguf::default_model_path();
    let g = llama::load::model_geometry(&path, 16, libkv::Dtype::F16).unwrap();
    let gguf = llama::gguf::Gguf::open(&path).unwrap();
    let tok = llama::tokenizer::Tokenizer::from_gguf(&gguf).unwrap();
    let weights = llama::weights::LlamaWeights::from_gguf(&gguf).unwrap();
    // `KVFENCE_CROSSCHECK_DECODE=f32`: the f32 computation instead of the quantized vectors.
    let f32_decode = std::env::var("KVFENCE_CROSSCHECK_DECODE").is_ok_and(|v| v == "f32");
    let runner = LlamaRunner::new(weights, g, 2, llama::chat::stop_tokens(&tok))
        .unwrap()
        .with_quantized_decode(!f32_decode);
    let prompts: Vec<serde_json::Value> =
        serde_json::from_str(include_str!("fixtures/crosscheck_prompts.json")).unwrap();
    let mut out = std::fs::File::create(out_path).unwrap();
    for p in &prompts {
        let text = p["text"].as_str().unwrap();
        let prompt = if p["chat"].as_bool().unwrap() {
            llama::chat::encode_chat(&tok, &[Message::user(text)], true).unwrap()
        } else {
            tok.encode(text, false)
        };
        let n = u32::try_from(prompt.len()).unwrap();
        let mut kv = MemoryKv::new(g, u64::from(n), u64::from(MAX_NEW));
        runner.prefill(&prompt, &mut kv).unwrap();
        kv.set_prefilled(u64::from(n));
        let (mut tokens, mut margins) = (Vec::new(), Vec::new());
        let mut input = *prompt.last().unwrap();
        for step in 0..MAX_NEW {
            let logits = runner.step_logits(&mut kv, input, step, n).unwrap();
            let mut order: Vec<usize> = (0..logits.len()).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            let t = u32::try_from(order[0]).unwrap();
            margins.push(logits[order[0]] - logits[order[1]]);
            if runner.is_stop(t) {
                break;
            }
            tokens.push(t);
            input = t;
        }
        let line = serde_json::json!({
            "name": p["name"], "prompt_tokens": prompt, "tokens": tokens, "margins": margins,
            "text": String::from_utf8_lossy(&tok.decode(&tokens)),
        });
        writeln!(out, "{line}").unwrap();
    }
}
