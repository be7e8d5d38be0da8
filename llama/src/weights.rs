//! The model's hyper-parameters and weights, dequantized to f32, and the blocks of the
//! matrices the file stores as Q4_1 or Q8_0, which decode multiplies as they are
//! ([`QuantWeights`], see [`crate::quant`]).
//!
//! Matrices are row-major `[out][in]`: `y = W x` takes row `r` of `W` for output `r`, which is
//! how GGUF stores them (`ne0` is the input dimension, contiguous). The Q and K projections
//! are stored *un-permuted*: GGUF files converted by llama.cpp permute the rows of Q and K
//! for interleaved RoPE; [`LlamaWeights::from_gguf`] undoes that, so K lands in pages in
//! the rotate-half layout the usual engines use.

use crate::gguf::{Gguf, GgufError};
use crate::quant::{QuantKind, QuantMatrix};

/// Hyper-parameters of a Llama-architecture model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub context: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
}

/// One transformer block's weights.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// RMSNorm before attention, `[hidden]`.
    pub attn_norm: Vec<f32>,
    /// `[heads * head_dim][hidden]`, rows un-permuted (rotate-half RoPE).
    pub wq: Vec<f32>,
    /// `[kv_heads * head_dim][hidden]`, rows un-permuted (rotate-half RoPE).
    pub wk: Vec<f32>,
    /// `[kv_heads * head_dim][hidden]`.
    pub wv: Vec<f32>,
    /// `[hidden][heads * head_dim]`.
    pub wo: Vec<f32>,
    /// RMSNorm before the feed-forward, `[hidden]`.
    pub ffn_norm: Vec<f32>,
    /// `[ffn][hidden]`.
    pub w_gate: Vec<f32>,
    /// `[ffn][hidden]`.
    pub w_up: Vec<f32>,
    /// `[hidden][ffn]`.
    pub w_down: Vec<f32>,
}

/// All weights of a model.
#[derive(Clone, Debug)]
pub struct LlamaWeights {
    pub config: LlamaConfig,
    /// `[vocab][hidden]`: row `t` is token `t`'s embedding.
    pub token_embd: Vec<f32>,
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm, `[hidden]`.
    pub output_norm: Vec<f32>,
    /// `[vocab][hidden]`, or `None` when the output projection is tied to `token_embd`.
    pub output: Option<Vec<f32>>,
    /// The same matrices as the file's quantized blocks, where it stores them so.
    pub quant: QuantWeights,
}

/// The decode matrices the file stores as Q4_1 or Q8_0, kept as its blocks (rows of Q and K
/// un-permuted like the f32 copies): decode multiplies these, prefill's sgemm the f32
/// copies, and both give the same products (see [`crate::quant`]). Each is `None` where
/// the file's type is another; `layers` is empty when none is kept.
#[derive(Clone, Debug, Default)]
pub struct QuantWeights {
    pub token_embd: Option<QuantMatrix>,
    pub output: Option<QuantMatrix>,
    pub layers: Vec<LayerQuant>,
}

/// One block's quantized matrices; see [`LayerWeights`] for their shapes.
#[derive(Clone, Debug, Default)]
pub struct LayerQuant {
    pub wq: Option<QuantMatrix>,
    pub wk: Option<QuantMatrix>,
    pub wv: Option<QuantMatrix>,
    pub wo: Option<QuantMatrix>,
    pub w_gate: Option<QuantMatrix>,
    pub w_up: Option<QuantMatrix>,
    pub w_down: Option<QuantMatrix>,
}

/// Why a model's configuration or weights were not loaded from a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("reading the GGUF file")]
    Gguf(#[from] GgufError),

    #[error("general.architecture is {found:?}; only \"llama\" is supported")]
    Architecture { found: String },

    #[error("invalid model configuration: {key} {reason}")]
    Config { key: &'static str, reason: String },

    #[error("tensor {tensor}: expected dims {expected:?}, found {found:?} (ne0 first)")]
    Shape {
        tensor: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
}

impl LlamaConfig {
    /// Reads the hyper-parameters from a GGUF file's `llama.*` metadata, refusing any
    /// architecture but `llama` and shapes the forward pass cannot run.
    pub fn from_gguf(gguf: &Gguf) -> Result<Self, WeightsError> {
        let architecture = gguf.str("general.architecture")?;
        if architecture != "llama" {
            return Err(WeightsError::Architecture {
                found: architecture.to_owned(),
            });
        }
        let count = |key: &'static str| -> Result<usize, WeightsError> {
            let n = gguf.u64(key)?;
            usize::try_from(n)
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| config(key, format!("is {n}; it must be at least 1")))
        };
        let layers = count("llama.block_count")?;
        let hidden = count("llama.embedding_length")?;
        let heads = count("llama.attention.head_count")?;
        let kv_heads = count("llama.attention.head_count_kv")?;
        let ffn = count("llama.feed_forward_length")?;
        let context = count("llama.context_length")?;
        let vocab = match gguf.get("llama.vocab_size") {
            Some(_) => count("llama.vocab_size")?,
            None => match gguf.array("tokenizer.ggml.tokens")?.len() {
                0 => return Err(config("tokenizer.ggml.tokens", "is empty".into())),
                n => n,
            },
        };
        let rope_base = match gguf.get("llama.rope.freq_base") {
            Some(_) => gguf.f32("llama.rope.freq_base")?,
            None => 10_000.0,
        };
        let rms_eps = gguf.f32("llama.attention.layer_norm_rms_epsilon")?;

        if hidden % heads != 0 {
            return Err(config(
                "llama.attention.head_count",
                format!("= {heads} does not divide llama.embedding_length = {hidden}"),
            ));
        }
        let head_dim = hidden / heads;
        if head_dim % 2 != 0 {
            return Err(config(
                "llama.embedding_length",
                format!("/ head_count = {head_dim}: RoPE needs an even head dimension"),
            ));
        }
        if kv_heads > heads || heads % kv_heads != 0 {
            return Err(config(
                "llama.attention.head_count_kv",
                format!("= {kv_heads} does not divide llama.attention.head_count = {heads}"),
            ));
        }
        if gguf.get("llama.rope.dimension_count").is_some() {
            let rot = gguf.u64("llama.rope.dimension_count")?;
            if usize::try_from(rot).ok() != Some(head_dim) {
                return Err(config(
                    "llama.rope.dimension_count",
                    format!(
                        "= {rot}, not the head dimension {head_dim}: partial RoPE is not supported"
                    ),
                ));
            }
        }
        let positive = |key: &'static str, v: f32| {
            if v.is_finite() && v > 0.0 {
                Ok(v)
            } else {
                Err(config(
                    key,
                    format!("= {v}; it must be finite and positive"),
                ))
            }
        };
        Ok(Self {
            layers,
            hidden,
            heads,
            kv_heads,
            head_dim,
            ffn,
            vocab,
            context,
            rope_base: positive("llama.rope.freq_base", rope_base)?,
            rms_eps: positive("llama.attention.layer_norm_rms_epsilon", rms_eps)?,
        })
    }
}

fn config(key: &'static str, reason: String) -> WeightsError {
    WeightsError::Config { key, reason }
}

impl LlamaWeights {
    /// Reads the configuration, then dequantizes every weight to f32, checking each
    /// tensor's dims against the configuration and un-permuting the rows of Q and K.
    pub fn from_gguf(gguf: &Gguf) -> Result<Self, WeightsError> {
        let config = LlamaConfig::from_gguf(gguf)?;
        let c = &config;
        let [hidden, ffn, vocab] = [c.hidden, c.ffn, c.vocab].map(|n| n as u64);
        let q_dim = (c.heads * c.head_dim) as u64;
        let kv_dim = (c.kv_heads * c.head_dim) as u64;

        let token_embd = load(gguf, "token_embd.weight", &[hidden, vocab])?;
        let output_norm = load(gguf, "output_norm.weight", &[hidden])?;
        let output = match gguf.tensor("output.weight") {
            Some(_) => Some(load(gguf, "output.weight", &[hidden, vocab])?),
            None => None,
        };
        let mut quant = QuantWeights {
            token_embd: load_quant(gguf, "token_embd.weight", c.vocab, c.hidden, None)?,
            output: match output {
                Some(_) => load_quant(gguf, "output.weight", c.vocab, c.hidden, None)?,
                None => None,
            },
            layers: Vec::with_capacity(c.layers),
        };

        // The layers are independent: dequantize them on all cores.
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut layers: Vec<Option<Result<LayerWeights, WeightsError>>> =
            (0..c.layers).map(|_| None).collect();
        let per_thread = c.layers.div_ceil(threads);
        std::thread::scope(|s| {
            for (chunk_index, chunk) in layers.chunks_mut(per_thread).enumerate() {
                s.spawn(move || {
                    for (j, slot) in chunk.iter_mut().enumerate() {
                        let layer = chunk_index * per_thread + j;
                        *slot = Some(load_layer(gguf, c, layer, [hidden, ffn, q_dim, kv_dim]));
                    }
                });
            }
        });
        let layers = layers
            .into_iter()
            .map(|slot| slot.unwrap_or_else(|| unreachable!("every layer slot is filled")))
            .collect::<Result<Vec<_>, _>>()?;
        for i in 0..c.layers {
            quant.layers.push(load_layer_quant(gguf, c, i)?);
        }

        Ok(Self {
            config,
            token_embd,
            layers,
            output_norm,
            output,
            quant,
        })
    }
}

/// Loads block `i`'s weights; `dims` is `[hidden, ffn, heads * head_dim, kv_heads * head_dim]`.
fn load_layer(
    gguf: &Gguf,
    c: &LlamaConfig,
    i: usize,
    [hidden, ffn, q_dim, kv_dim]: [u64; 4],
) -> Result<LayerWeights, WeightsError> {
    let t = |name: &str, dims: &[u64]| load(gguf, &format!("blk.{i}.{name}.weight"), dims);
    let wq = t("attn_q", &[hidden, q_dim])?;
    let wk = t("attn_k", &[hidden, kv_dim])?;
    Ok(LayerWeights {
        attn_norm: t("attn_norm", &[hidden])?,
        wq: unpermute_rows(&wq, c.heads, c.head_dim, c.hidden),
        wk: unpermute_rows(&wk, c.kv_heads, c.head_dim, c.hidden),
        wv: t("attn_v", &[hidden, kv_dim])?,
        wo: t("attn_output", &[q_dim, hidden])?,
        ffn_norm: t("ffn_norm", &[hidden])?,
        w_gate: t("ffn_gate", &[hidden, ffn])?,
        w_up: t("ffn_up", &[hidden, ffn])?,
        w_down: t("ffn_down", &[ffn, hidden])?,
    })
}

/// Block `i`'s quantized matrices (their dims were checked by [`load_layer`]).
fn load_layer_quant(gguf: &Gguf, c: &LlamaConfig, i: usize) -> Result<LayerQuant, WeightsError> {
    let (hidden, ffn, hd) = (c.hidden, c.ffn, c.head_dim);
    let (q_dim, kv_dim) = (c.heads * hd, c.kv_heads * hd);
    let t = |name: &str, rows: usize, cols: usize, heads: Option<usize>| {
        load_quant(
            gguf,
            &format!("blk.{i}.{name}.weight"),
            rows,
            cols,
            heads.map(|h| (h, hd)),
        )
    };
    Ok(LayerQuant {
        wq: t("attn_q", q_dim, hidden, Some(c.heads))?,
        wk: t("attn_k", kv_dim, hidden, Some(c.kv_heads))?,
        wv: t("attn_v", kv_dim, hidden, None)?,
        wo: t("attn_output", hidden, q_dim, None)?,
        w_gate: t("ffn_gate", ffn, hidden, None)?,
        w_up: t("ffn_up", ffn, hidden, None)?,
        w_down: t("ffn_down", hidden, ffn, None)?,
    })
}

/// Tensor `name`'s blocks as a `[rows][cols]` matrix when its type is one decode multiplies
/// quantized, else `None`; `unpermute` (`(heads, head_dim)`) puts the rows of Q or K back as
/// [`unpermute_rows`] does.
fn load_quant(
    gguf: &Gguf,
    name: &str,
    rows: usize,
    cols: usize,
    unpermute: Option<(usize, usize)>,
) -> Result<Option<QuantMatrix>, WeightsError> {
    let tensor = gguf
        .tensor(name)
        .ok_or_else(|| GgufError::MissingTensor(name.to_owned()))?;
    let Some(kind) = QuantKind::of(tensor.ggml_type()) else {
        return Ok(None);
    };
    let bytes = gguf.tensor_bytes(tensor)?.to_vec();
    let m = QuantMatrix::new(kind, rows, cols, bytes).ok_or_else(|| WeightsError::Shape {
        tensor: name.to_owned(),
        expected: vec![cols as u64, rows as u64],
        found: tensor.dims().to_vec(),
    })?;
    Ok(Some(match unpermute {
        Some((_, head_dim)) => m.permute_rows(|r| stored_row(r, head_dim)),
        None => m,
    }))
}

/// Dequantizes tensor `name` after checking its dims (`ne0` first) are `expected`.
fn load(gguf: &Gguf, name: &str, expected: &[u64]) -> Result<Vec<f32>, WeightsError> {
    let tensor = gguf
        .tensor(name)
        .ok_or_else(|| GgufError::MissingTensor(name.to_owned()))?;
    if tensor.dims() != expected {
        return Err(WeightsError::Shape {
            tensor: name.to_owned(),
            expected: expected.to_vec(),
            found: tensor.dims().to_vec(),
        });
    }
    Ok(gguf.dequantize_tensor(tensor)?)
}

/// Undoes llama.cpp's converter permutation of the Q or K projection's rows.
///
/// The converter reshapes the Hugging Face matrix as `[n_head][2][head_dim / 2][cols]` and
/// swaps the middle axes, interleaving each head's two rotate-half halves for ggml's
/// interleaved RoPE: Hugging Face row `h * head_dim + half * head_dim / 2 + i` is stored at
/// row `h * head_dim + 2 * i + half`. This puts every row back, giving the rotate-half
/// layout. `w` is `[n_head * head_dim][cols]`, row-major.
fn unpermute_rows(w: &[f32], n_head: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    debug_assert_eq!(w.len(), n_head * head_dim * cols);
    let mut out = vec![0.0; w.len()];
    for (hf, row) in out.chunks_exact_mut(cols).enumerate() {
        let stored = stored_row(hf, head_dim);
        row.copy_from_slice(&w[stored * cols..(stored + 1) * cols]);
    }
    out
}

/// The stored row of Hugging Face row `hf` (see [`unpermute_rows`]).
fn stored_row(hf: usize, head_dim: usize) -> usize {
    let half_dim = head_dim / 2;
    let (h, within) = (hf / head_dim, hf % head_dim);
    let (half, i) = (within / half_dim, within % half_dim);
    h * head_dim + 2 * i + half
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::gguf::testing::GgufWriter;
    use crate::gguf::{Value, ValueType, default_model_path};

    /// The converter's permutation, written as numpy's
    /// `w.reshape(n_head, 2, hd / 2, cols).swapaxes(1, 2).reshape(n_head * hd, cols)`:
    /// the output at `[h][i][half]` is the input at `[h][half][i]`.
    fn permute_rows(w: &[f32], n_head: usize, hd: usize, cols: usize) -> Vec<f32> {
        let half_dim = hd / 2;
        let at = |h: usize, a: usize, b: usize, inner: usize, c: usize| {
            ((h * 2 * half_dim) + a * inner + b) * cols + c
        };
        let mut out = vec![0.0; w.len()];
        for h in 0..n_head {
            for i in 0..half_dim {
                for half in 0..2 {
                    for c in 0..cols {
                        // output shape [n_head][half_dim][2]; input [n_head][2][half_dim]
                        out[at(h, i, half, 2, c)] = w[at(h, half, i, half_dim, c)];
                    }
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_inverts_the_converter_permutation() {
        let (n_head, hd, cols) = (3, 8, 5);
        let hf: Vec<f32> = (0..n_head * hd * cols).map(|x| x as f32).collect();
        let stored = permute_rows(&hf, n_head, hd, cols);
        assert_ne!(stored, hf);
        // the documented row mapping
        for h in 0..n_head {
            for half in 0..2 {
                for i in 0..hd / 2 {
                    let (r_hf, r_st) = (h * hd + half * hd / 2 + i, h * hd + 2 * i + half);
                    assert_eq!(stored[r_st * cols..][..cols], hf[r_hf * cols..][..cols]);
                }
            }
        }
        assert_eq!(unpermute_rows(&stored, n_head, hd, cols), hf);
        // a single head of dim 2 is its own permutation
        let w: Vec<f32> = (0..6).map(|x| x as f32).collect();
        assert_eq!(unpermute_rows(&w, 1, 2, 3), w);
    }

    /// A tiny llama: 2 layers, hidden 8, 2 heads of 4, 1 kv head, ffn 12, vocab 10; every
    /// tensor F32 with element `k` of tensor `t` equal to `t * 1000 + k`.
    fn tiny(tied: bool) -> GgufWriter {
        let mut w = GgufWriter::new();
        let u = |v: u32| Value::U32(v);
        w.kv("general.architecture", Value::String("llama".into()))
            .kv("llama.block_count", u(2))
            .kv("llama.embedding_length", u(8))
            .kv("llama.attention.head_count", u(2))
            .kv("llama.attention.head_count_kv", u(1))
            .kv("llama.feed_forward_length", u(12))
            .kv("llama.context_length", u(64))
            .kv("llama.rope.dimension_count", u(4))
            .kv("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5))
            .kv(
                "tokenizer.ggml.tokens",
                Value::Array(
                    ValueType::String,
                    (0..10).map(|t| Value::String(format!("t{t}"))).collect(),
                ),
            );
        let mut names: Vec<(String, Vec<u64>)> = vec![
            ("token_embd.weight".into(), vec![8, 10]),
            ("output_norm.weight".into(), vec![8]),
        ];
        if !tied {
            names.push(("output.weight".into(), vec![8, 10]));
        }
        for i in 0..2 {
            for (n, d) in [
                ("attn_norm", vec![8]),
                ("attn_q", vec![8, 8]),
                ("attn_k", vec![8, 4]),
                ("attn_v", vec![8, 4]),
                ("attn_output", vec![8, 8]),
                ("ffn_norm", vec![8]),
                ("ffn_gate", vec![8, 12]),
                ("ffn_up", vec![8, 12]),
                ("ffn_down", vec![12, 8]),
            ] {
                names.push((format!("blk.{i}.{n}.weight"), d));
            }
        }
        for (t, (name, dims)) in names.iter().enumerate() {
            let n: u64 = dims.iter().product();
            let values: Vec<f32> = (0..n).map(|k| (t * 1000) as f32 + k as f32).collect();
            w.tensor_f32(name, dims, &values);
        }
        w
    }

    fn open(w: &GgufWriter) -> (tempfile::TempDir, Gguf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tiny.gguf");
        w.write(&path);
        let g = Gguf::open(&path).expect("open");
        (dir, g)
    }

    #[test]
    fn loads_a_tiny_model() {
        let (_dir, g) = open(&tiny(false));
        let m = LlamaWeights::from_gguf(&g).expect("load");
        let c = &m.config;
        assert_eq!(
            *c,
            LlamaConfig {
                layers: 2,
                hidden: 8,
                heads: 2,
                kv_heads: 1,
                head_dim: 4,
                ffn: 12,
                vocab: 10,
                context: 64,
                rope_base: 10_000.0,
                rms_eps: 1e-5,
            }
        );
        assert_eq!(m.token_embd.len(), 80);
        assert_eq!(m.token_embd[8 * 3 + 1], 3.0 * 8.0 + 1.0);
        assert_eq!(m.output.as_ref().map(Vec::len), Some(80));
        assert_eq!(m.layers.len(), 2);
        let l1 = &m.layers[1];
        assert_eq!(l1.w_down.len(), 96);
        assert_eq!(l1.wv, g.dequantize("blk.1.attn_v.weight").unwrap());
        // Q and K rows come back un-permuted: HF row h*4 + half*2 + i from stored h*4 + 2i + half
        for (got, name, heads) in [
            (&l1.wq, "blk.1.attn_q.weight", 2),
            (&l1.wk, "blk.1.attn_k.weight", 1),
        ] {
            let stored = g.dequantize(name).unwrap();
            assert_eq!(got.len(), heads * 4 * 8);
            assert_eq!(*got, unpermute_rows(&stored, heads, 4, 8));
            assert_eq!(
                got[8..16],
                stored[2 * 8..3 * 8],
                "{name}: HF row 1 is stored row 2"
            );
            assert_eq!(
                got[2 * 8..3 * 8],
                stored[8..16],
                "{name}: HF row 2 is stored row 1"
            );
        }

        let (_dir, g) = open(&tiny(true));
        assert!(
            LlamaWeights::from_gguf(&g)
                .expect("load tied")
                .output
                .is_none()
        );
    }

    #[test]
    fn refuses_bad_configs_and_shapes() {
        let with = |key: &str, value: Value| {
            let mut w = tiny(true);
            match w.kvs.iter_mut().find(|(k, _)| k == key) {
                Some(kv) => kv.1 = value,
                None => w.kvs.push((key.to_owned(), value)),
            }
            w
        };
        let load_err = |w: GgufWriter| {
            let (_dir, g) = open(&w);
            LlamaWeights::from_gguf(&g).expect_err("must not load")
        };
        let e = load_err(with("general.architecture", Value::String("qwen2".into())));
        assert!(matches!(e, WeightsError::Architecture { .. }), "{e}");
        let e = load_err(with("llama.rope.dimension_count", Value::U32(2)));
        assert!(
            matches!(
                e,
                WeightsError::Config {
                    key: "llama.rope.dimension_count",
                    ..
                }
            ),
            "{e}"
        );
        let e = load_err(with("llama.attention.head_count", Value::U32(3)));
        assert!(matches!(e, WeightsError::Config { .. }), "{e}");
        let e = load_err(with("llama.block_count", Value::U32(0)));
        assert!(matches!(e, WeightsError::Config { .. }), "{e}");
        let e = load_err(with("llama.block_count", Value::String("2".into())));
        assert!(
            matches!(e, WeightsError::Gguf(GgufError::WrongType { .. })),
            "{e}"
        );
        // the vocabulary size key wins over the token list: token_embd no longer matches
        let e = load_err(with("llama.vocab_size", Value::U32(11)));
        let WeightsError::Shape {
            tensor,
            expected,
            found,
        } = e
        else {
            panic!("expected a shape error, got {e}");
        };
        assert_eq!(
            (tensor.as_str(), expected, found),
            ("token_embd.weight", vec![8, 11], vec![8, 10])
        );
        // one more layer than the file has
        let e = load_err(with("llama.block_count", Value::U32(3)));
        assert!(
            matches!(&e, WeightsError::Gguf(GgufError::MissingTensor(n)) if n == "blk.2.attn_q.weight"),
            "{e}"
        );
        // a transposed matrix
        let mut w = tiny(true);
        let down = w
            .tensors
            .iter_mut()
            .find(|t| t.0 == "blk.0.ffn_down.weight")
            .unwrap();
        down.1 = vec![8, 12];
        let e = load_err(w);
        assert!(e.to_string().contains("blk.0.ffn_down.weight"), "{e}");
        assert!(
            e.to_string().contains("[12, 8]") && e.to_string().contains("[8, 12]"),
            "{e}"
        );
    }

    /// Loads the real model when it is present (CI fetches it first).
    #[test]
    fn loads_smollm2() {
        let path = default_model_path();
        if !path.exists() {
            eprintln!(
                "loads_smollm2: skipped, no model at {} (set KVFENCE_MODEL)",
                path.display()
            );
            return;
        }
        let start = Instant::now();
        let g = Gguf::open(&path).expect("open model");
        let opened = start.elapsed();
        let m = LlamaWeights::from_gguf(&g).expect("load model");
        eprintln!(
            "loads_smollm2: parsed in {opened:?}, loaded in {:?} ({} tensors)",
            start.elapsed(),
            g.tensors().len()
        );
        let c = &m.config;
        assert_eq!(
            *c,
            LlamaConfig {
                layers: 30,
                hidden: 576,
                heads: 9,
                kv_heads: 3,
                head_dim: 64,
                ffn: 1536,
                vocab: 49152,
                context: c.context,
                rope_base: 100_000.0,
                rms_eps: 1e-5,
            }
        );
        assert!(c.context >= 2048, "context {}", c.context);
        assert_eq!(g.tensors().len(), 272);
        assert!(
            m.output.is_none(),
            "SmolLM2 ties its output to the embeddings"
        );
        assert_eq!(m.token_embd.len(), 49152 * 576);
        assert_eq!(m.output_norm.len(), 576);
        assert_eq!(m.layers.len(), 30);
        for l in &m.layers {
            assert_eq!((l.attn_norm.len(), l.ffn_norm.len()), (576, 576));
            assert_eq!(
                (l.wq.len(), l.wk.len(), l.wv.len()),
                (576 * 576, 192 * 576, 192 * 576)
            );
            assert_eq!(l.wo.len(), 576 * 576);
            assert_eq!(
                (l.w_gate.len(), l.w_up.len(), l.w_down.len()),
                (1536 * 576, 1536 * 576, 1536 * 576)
            );
        }
        let all = std::iter::once(&m.token_embd)
            .chain([&m.output_norm])
            .chain(m.layers.iter().flat_map(|l| {
                [
                    &l.attn_norm,
                    &l.wq,
                    &l.wk,
                    &l.wv,
                    &l.wo,
                    &l.ffn_norm,
                    &l.w_gate,
                    &l.w_up,
                    &l.w_down,
                ]
            }));
        for w in all {
            assert!(w.iter().all(|x| x.is_finite()), "a weight is not finite");
            assert!(w.iter().any(|&x| x != 0.0), "a tensor is all zeros");
        }
    }
}
