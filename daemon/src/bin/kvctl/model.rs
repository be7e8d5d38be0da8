//! What kvctl needs of the model the workers run: text to tokens and back, and for the demo
//! the model itself.

use super::Failure;
use kvctld::client::exit;
use kvctld::stack::error_chain;
use libkv::config::{Config, ModelConfig, ModelKind};
use libkv::{Dtype, PageGeometry};
use llama::chat::Message;
use std::path::{Path, PathBuf};

/// Text to tokens and back ([`llama::codec::Codec`]), with kvctl's failures.
pub struct Codec(llama::codec::Codec);

impl Codec {
    /// The codec of the config's `[model]` (the reference model without a config).
    pub fn from_config(config: Option<&Config>) -> Result<Codec, Failure> {
        let Some(model) = config.map(|c| &c.model) else {
            return Ok(Codec(llama::codec::Codec::Bytes));
        };
        llama::codec::Codec::from_model(model)
            .map(Codec)
            .map_err(|e| Failure::new(exit::USAGE, error_chain(&e)))
    }

    /// `text` as tokens; `chat` wraps it as one user message in the model's chat template
    /// (the reference model has none and takes the text as it is).
    pub fn encode(&self, text: &[u8], chat: bool) -> Result<Vec<u32>, Failure> {
        if matches!(self.0, llama::codec::Codec::Bytes) {
            return Ok(libkv::model::tokenize(text));
        }
        let text = std::str::from_utf8(text)
            .map_err(|e| Failure::new(exit::USAGE, format!("the prompt is not UTF-8: {e}")))?;
        if chat {
            self.0
                .encode_chat(&[Message::user(text)])
                .map_err(|e| Failure::new(exit::USAGE, e.to_string()))
        } else {
            Ok(self.0.encode(text))
        }
    }

    /// Tokens as bytes (UTF-8 for text; a character may be split between two calls).
    pub fn decode(&self, tokens: &[u32]) -> Vec<u8> {
        self.0.decode(tokens)
    }
}

/// The real model for the demo: the GGUF file at the default path, fetched with
/// `scripts/fetch-model` when missing (from a checkout), with the page geometry it needs.
/// `Err` says in one line why the demo falls back to the reference model.
pub fn demo_model(fetch_script: Option<&Path>) -> Result<(PathBuf, PageGeometry), String> {
    let path = llama::gguf::default_model_path();
    if !path.is_file() {
        let Some(script) = fetch_script.filter(|s| s.is_file()) else {
            return Err(format!(
                "{} is missing; scripts/fetch-model gets it",
                path.display()
            ));
        };
        let ran = std::process::Command::new(script)
            .stdout(std::process::Stdio::null())
            .output()
            .map_err(|e| format!("running {}: {e}", script.display()))?;
        if !ran.status.success() || !path.is_file() {
            let why = String::from_utf8_lossy(&ran.stderr);
            let why = why.lines().last().unwrap_or("no reason given");
            return Err(format!("fetching the model failed: {why}"));
        }
    }
    let g = llama::load::model_geometry(&path, 16, Dtype::Bf16).map_err(|e| error_chain(&e))?;
    Ok((path, g))
}

/// `config` set up to run the GGUF model at `path` on pages of `geometry`: pools for the
/// whole context, one thread per request (the demo runs four workers at once) and deadlines
/// a CPU-only forward pass can meet.
pub fn demo_config(mut config: Config, path: PathBuf, geometry: PageGeometry) -> Config {
    config.geometry = geometry;
    config.limits.max_context = 2048;
    config.limits.max_new_tokens = 64;
    let pages = geometry.pages_for_tokens(u64::from(
        config.limits.max_context + config.limits.max_new_tokens,
    ));
    let pool = u32::try_from(pages * 3).unwrap_or(u32::MAX);
    config.prefill.pool_pages = pool;
    config.decode.pool_pages = pool;
    config.model = ModelConfig {
        kind: ModelKind::Gguf,
        path: Some(path),
        threads: 1,
    };
    config.deadlines.prefill = config.deadlines.prefill.max(60_000);
    config.deadlines.decode = config.deadlines.decode.max(120_000);
    config.deadlines.request = config.deadlines.request.max(180_000);
    config
}
