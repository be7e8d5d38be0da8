//! Building the runner a worker's `[model]` section names, and the tokenizer that goes with
//! it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use libkv::PageGeometry;
use libkv::config::{ModelConfig, ModelKind};
use libkv::model::{ModelError, ModelRunner, ReferenceModel};

use crate::chat;
use crate::gguf::{Gguf, GgufError};
use crate::runner::{LlamaRunner, RunnerError};
use crate::tokenizer::{Tokenizer, TokenizerError};
use crate::weights::{LlamaWeights, WeightsError};

/// Why the configured model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(
        "model.kind is \"engine\": its workers run inside the engine (the kvfence vLLM \
         connector), not as daemons of their own"
    )]
    Engine,
    #[error("model.kind is \"gguf\" but model.path is not set")]
    NoPath,
    #[error("opening the model {}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: GgufError,
    },
    #[error("reading the weights of {}", path.display())]
    Weights {
        path: PathBuf,
        #[source]
        source: WeightsError,
    },
    #[error("reading the tokenizer of {}", path.display())]
    Tokenizer {
        path: PathBuf,
        #[source]
        source: TokenizerError,
    },
    #[error(
        "the model {} does not fit [geometry]: {source}; set [geometry] to the model's \
         (layers, kv_heads, head_dim)",
        path.display()
    )]
    Geometry {
        path: PathBuf,
        #[source]
        source: RunnerError,
    },
    #[error("the reference model cannot run on [geometry]")]
    Reference(#[source] ModelError),
}

/// The model a worker runs, with the tokenizer clients of it need (none for the reference
/// model, whose tokens are bytes).
#[derive(Debug, Clone)]
pub struct LoadedModel {
    pub runner: Arc<dyn ModelRunner>,
    pub tokenizer: Option<Arc<Tokenizer>>,
}

impl LoadedModel {
    /// `text` as the model's tokens (bytes for the reference model); special-token text is
    /// not parsed, so user text can never forge a control token.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match &self.tokenizer {
            Some(t) => t.encode(text, false),
            None => libkv::model::tokenize(text.as_bytes()),
        }
    }

    /// A chat as the model's tokens: ChatML for a GGUF model; the reference model has no
    /// template and reads the last message's text.
    pub fn encode_chat(&self, messages: &[chat::Message]) -> Result<Vec<u32>, String> {
        match &self.tokenizer {
            Some(t) => chat::encode_chat(t, messages, true).map_err(|e| e.to_string()),
            None => {
                let last = messages.last().ok_or("a chat needs at least one message")?;
                Ok(libkv::model::tokenize(last.content.as_bytes()))
            }
        }
    }

    /// Tokens as text, invalid UTF-8 replaced.
    pub fn decode(&self, tokens: &[u32]) -> String {
        match &self.tokenizer {
            Some(t) => String::from_utf8_lossy(&t.decode(tokens)).into_owned(),
            None => libkv::model::detokenize(tokens),
        }
    }

    /// The id workers of this model register under.
    pub fn model_id(&self) -> String {
        self.runner.model_id()
    }
}

/// The runner a worker daemon runs: `given` when an engine embedding the worker brings its
/// own ([`libkv::engine`]), otherwise the one `[model]` names ([`load`]).
pub fn worker_runner(
    given: Option<&Arc<dyn ModelRunner>>,
    cfg: &ModelConfig,
    geometry: PageGeometry,
) -> Result<Arc<dyn ModelRunner>, LoadError> {
    match given {
        Some(runner) => Ok(Arc::clone(runner)),
        None => Ok(load(cfg, geometry, cfg.threads())?.runner),
    }
}

/// Builds the runner `[model]` names over pages of `geometry`, prefilling on up to `threads`
/// threads. A GGUF model whose layers, KV heads or head dimension differ from `geometry`'s
/// is refused, naming both.
pub fn load(
    cfg: &ModelConfig,
    geometry: PageGeometry,
    threads: usize,
) -> Result<LoadedModel, LoadError> {
    match cfg.kind {
        ModelKind::Reference => Ok(LoadedModel {
            runner: Arc::new(ReferenceModel::new(geometry).map_err(LoadError::Reference)?),
            tokenizer: None,
        }),
        ModelKind::Engine => Err(LoadError::Engine),
        ModelKind::Gguf => {
            let path = cfg.path.as_deref().ok_or(LoadError::NoPath)?;
            load_gguf(path, geometry, threads)
        }
    }
}

/// Loads a GGUF model file: weights, tokenizer and the runner over `geometry`.
pub fn load_gguf(
    path: &Path,
    geometry: PageGeometry,
    threads: usize,
) -> Result<LoadedModel, LoadError> {
    let gguf = Gguf::open(path).map_err(|source| LoadError::Open {
        path: path.to_owned(),
        source,
    })?;
    let tokenizer = Tokenizer::from_gguf(&gguf).map_err(|source| LoadError::Tokenizer {
        path: path.to_owned(),
        source,
    })?;
    let weights = LlamaWeights::from_gguf(&gguf).map_err(|source| LoadError::Weights {
        path: path.to_owned(),
        source,
    })?;
    let runner = LlamaRunner::new(weights, geometry, threads, chat::stop_tokens(&tokenizer))
        .map_err(|source| LoadError::Geometry {
            path: path.to_owned(),
            source,
        })?
        .with_model_id(model_id(&gguf));
    Ok(LoadedModel {
        runner: Arc::new(runner),
        tokenizer: Some(Arc::new(tokenizer)),
    })
}

/// Only the tokenizer of a GGUF file (what a client needs to talk to the model).
pub fn load_tokenizer(path: &Path) -> Result<(Tokenizer, String), LoadError> {
    let gguf = Gguf::open(path).map_err(|source| LoadError::Open {
        path: path.to_owned(),
        source,
    })?;
    let tokenizer = Tokenizer::from_gguf(&gguf).map_err(|source| LoadError::Tokenizer {
        path: path.to_owned(),
        source,
    })?;
    Ok((tokenizer, model_id(&gguf)))
}

/// The id a GGUF model registers under: its name, its size and a crc32c of the whole file,
/// so two workers agree only if they load the same bytes.
pub fn model_id(gguf: &Gguf) -> String {
    let name: String = gguf
        .str("general.name")
        .unwrap_or("gguf")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                c
            } else {
                '-'
            }
        })
        .take(64)
        .collect();
    let bytes = gguf.file_bytes();
    format!(
        "{name}:{}:{:08x}",
        bytes.len(),
        libkv::verify::page_digest(bytes)
    )
}

/// The page geometry of a GGUF model: its layers, KV heads and head dimension, with the
/// given tokens per page and page dtype (what `[geometry]` must say to run it).
pub fn model_geometry(
    path: &Path,
    tokens_per_page: u32,
    dtype: libkv::Dtype,
) -> Result<PageGeometry, LoadError> {
    let gguf = Gguf::open(path).map_err(|source| LoadError::Open {
        path: path.to_owned(),
        source,
    })?;
    let c = crate::weights::LlamaConfig::from_gguf(&gguf).map_err(|source| LoadError::Weights {
        path: path.to_owned(),
        source,
    })?;
    let dim = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    Ok(PageGeometry {
        tokens_per_page,
        layers: dim(c.layers),
        kv_heads: dim(c.kv_heads),
        head_dim: dim(c.head_dim),
        dtype,
    })
}
