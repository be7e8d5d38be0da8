//! [`LlamaRunner`]: a Llama-architecture model behind libkv's [`ModelRunner`] seam, so the
//! prefill worker writes a real model's KV into pool pages and the decode worker generates
//! from the pages it verified.
//!
//! # What is computed
//!
//! The standard Llama forward pass (the semantics of Hugging Face `transformers`), in f32:
//!
//! ```text
//! x = embed[token]
//! per layer:
//!     h = rmsnorm(x) * attn_norm          rmsnorm(x) = x / sqrt(mean(x^2) + eps)
//!     q, k, v = Wq h, Wk h, Wv h
//!     q, k = rope(q), rope(k)             rotate-half, angle pos * base^(-2i / head_dim)
//!     k, v = round(k), round(v)           to the page dtype, see below
//!     a_j = softmax_t(q_j . k_t / sqrt(head_dim)) . v_t  over t <= pos, query head j
//!                                         reading KV head j / (heads / kv_heads)
//!     x += Wo a
//!     h = rmsnorm(x) * ffn_norm
//!     x += W_down(silu(W_gate h) * W_up h)
//! logits = E (rmsnorm(x) * output_norm)  E = output, or token_embd when tied
//! ```
//!
//! The rotary angles are computed in f64 and their cosine and sine rounded to f32, on both
//! paths. The next token is the argmax of the logits (greedy; the lowest id on exact ties).
//!
//! # The pages are the KV
//!
//! K (after RoPE) and V are rounded to the page dtype *before* attention, the current token's
//! included, so what attention reads is exactly what the pages hold. A monolithic run over
//! pages in memory and a disaggregated run over pool pages pulled across a transport
//! therefore compute the same tokens, and any byte changed in a page changes the computation.
//!
//! - [`ModelRunner::prefill_chunked`] runs the prompt in chunks of whole pages (about
//!   [`CHUNK_TOKENS`] tokens), feature-major, with the projections and the feed-forward as
//!   sgemm products split over threads. Each layer writes the chunk's K and V into its pages,
//!   then reads the K and V of every position so far back from the pages for the chunk's
//!   causal attention. Prefill computes no logits: the decode computes the first token.
//! - [`ModelRunner::step`] runs one token. At step 0 the token is the prompt's last, whose KV
//!   the prefill wrote: attention reads all of it from the pages and nothing is appended.
//!   Later steps compute the token's K and V, attend over the pages plus those (rounded), and
//!   append them to the cache after the forward pass. Attention reads the page bytes in
//!   place, one `tokens_per_page x head_dim` slab per page, layer, K/V and head.
//!
//! # Batched, quantized decode
//!
//! [`ModelRunner::sample_batch`] runs one decode step of several requests as one forward
//! pass: each weight row is read once and multiplied with every request's vector, and each
//! request attends over its own pages. Decode multiplies the file's Q4_1 and Q8_0 blocks
//! with each vector quantized to 8 bits a value per block of 32, in integers
//! ([`crate::int8`], as llama.cpp multiplies them): a request's logits are bit for bit the
//! same alone and in any batch, on any thread count and whichever kernel the CPU runs, and
//! a single [`ModelRunner::step`] is a batch of one. With quantized decode off
//! ([`LlamaRunner::with_quantized_decode`]) decode multiplies the f32 weights and vectors
//! instead, with the same guarantee.
//!
//! # Threads
//!
//! Prefill splits the rows of each product, and the attention heads, over the runner's
//! threads. A decode step starts its threads once and they run the whole forward pass
//! together, each taking a share of the rows of every product (for every request of the
//! batch) and a share of the requests' attention (whole requests when the batch has as many
//! as threads, so that each request's pages are read once; else a share of each request's
//! query heads), meeting at a spinning barrier between phases
//! (see the `math` module). The thread count changes no result: threads split independent
//! outputs only, never a sum.
//!
//! # Errors
//!
//! Tokens outside the vocabulary, a prompt longer than its pages, a cache page shorter than
//! the geometry, or a step past the cache's positions are errors, not panics. So are logits
//! that are all NaN (pages holding bytes this model never wrote can produce them): the step
//! fails rather than emit an arbitrary token.

use std::fmt;
use std::ops::Range;

use libkv::model::{BatchStep, KvCache, ModelError, ModelRunner, PageWrite};
use libkv::proto::Sampling;
use libkv::{Dtype, Kv, PageGeometry};

use crate::attend;
use crate::math::{self, View};
use crate::quant::{self, Mat, QuantMatrix};
use crate::weights::{LayerQuant, LayerWeights, LlamaConfig, LlamaWeights};

/// Tokens per prefill chunk (rounded down to whole pages, at least one page).
pub const CHUNK_TOKENS: usize = 256;

/// Queries per block of the prefill attention, which bounds its score matrix.
const QUERY_BLOCK: usize = 128;

/// Rows of a layer's product a member of a decode step takes at a time after its long run
/// ([`row_runs`], [`math::Member::units`]): four strips of the quantized kernels, small
/// enough that the members finish a product together.
const UNIT_ROWS: usize = 64;

/// The runs of rows a member of `members` takes of a `total`-row product, in the order they
/// are handed out: one long run each first, together half the rows (a member reading one
/// vector is as fast as memory streams its rows, and a long run keeps the stream going),
/// then the rest in runs of `unit`. Alone, the member takes the product whole.
fn row_runs(total: usize, members: usize, unit: usize) -> Vec<Range<usize>> {
    if members <= 1 {
        return std::iter::once(0..total).collect();
    }
    let long = total / (2 * members) / quant::STRIP * quant::STRIP;
    let first = if long > unit { members } else { 0 };
    let runs = (0..first).map(|i| i * long..(i + 1) * long);
    let rest = (first * long..total)
        .step_by(unit)
        .map(|at| at..(at + unit).min(total));
    runs.chain(rest).collect()
}

/// Rows of the output product a member takes at a time after its long run (the vocabulary
/// is far longer than a layer's products).
const VOCAB_UNIT_ROWS: usize = 1024;

/// Errors building a [`LlamaRunner`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RunnerError {
    #[error("page geometry {0:?} is not valid")]
    InvalidGeometry(PageGeometry),
    #[error("page geometry has {what} {geometry}, the model has {model}")]
    GeometryMismatch {
        what: &'static str,
        geometry: u64,
        model: u64,
    },
    #[error("model config: {0}")]
    BadConfig(String),
    #[error("tensor {name} has {got} values, the config needs {expected}")]
    TensorShape {
        name: String,
        expected: usize,
        got: usize,
    },
}

/// The model's dimensions, as used everywhere below.
#[derive(Clone, Copy, Debug)]
struct Dims {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    /// Query heads per KV head.
    group: usize,
    ffn: usize,
    vocab: usize,
}

impl Dims {
    fn q(&self) -> usize {
        self.heads * self.hd
    }

    fn kv(&self) -> usize {
        self.kv_heads * self.hd
    }
}

/// Where one request's decode step runs: its position, the positions its attention reads
/// from the pages, and whether the token's K/V is computed here (and appended after).
#[derive(Clone, Copy, Debug)]
struct Plan {
    pos: u64,
    read: usize,
    fresh: bool,
}

/// What a decode step computed for one request: its logits, and its token's K/V
/// (`[layer][K, V][kv_heads * head_dim]`, empty unless the step appends it).
type Stepped = (Vec<f32>, Vec<f32>);

/// The vectors the members of a batched decode step share, each holding its phase's
/// vector of every request, request after request: one a phase of a layer, so that no
/// member stores into a vector another may still be loading from (members are at most one
/// barrier apart). `new_kv` holds each request's K/V, `[layer][K, V][kv_heads * head_dim]`,
/// stored by whichever member attended it and loaded after the team is done.
struct Shared {
    qkv: math::SharedVec,
    att: math::SharedVec,
    wo: math::SharedVec,
    act: math::SharedVec,
    down: math::SharedVec,
    new_kv: math::SharedVec,
}

/// One request of a batched decode step, checked and ready to run.
struct StepIn<'a> {
    /// The pages holding positions `0..plan.read`.
    pages: Vec<&'a [u8]>,
    token: u32,
    plan: Plan,
}

/// A Llama-architecture model over kvfence pages (see the module docs).
#[derive(Clone)]
pub struct LlamaRunner {
    w: LlamaWeights,
    g: PageGeometry,
    d: Dims,
    threads: usize,
    stop: Vec<u32>,
    chunk_tokens: usize,
    freqs: Vec<f64>,
    vocab: u32,
    model_id: String,
    /// Whether decode multiplies the file's quantized blocks (where it has them) rather
    /// than the f32 copies; the products are the same, the memory read is not.
    quantized: bool,
}

impl fmt::Debug for LlamaRunner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LlamaRunner")
            .field("config", &self.w.config)
            .field("geometry", &self.g)
            .field("threads", &self.threads)
            .field("stop", &self.stop)
            .field("chunk_tokens", &self.chunk_tokens)
            .finish_non_exhaustive()
    }
}

impl LlamaRunner {
    /// A runner of `weights` writing and reading pages of `geometry`, using up to `threads`
    /// threads (0 counts as 1), stopping generation at any token of `stop`.
    ///
    /// Refuses a geometry whose layers, KV heads or head dimension differ from the model's,
    /// and weights whose tensors do not have the sizes the config implies.
    pub fn new(
        weights: LlamaWeights,
        geometry: PageGeometry,
        threads: usize,
        stop: Vec<u32>,
    ) -> Result<LlamaRunner, RunnerError> {
        let d = validate_config(&weights.config)?;
        let c = &weights.config;
        if !geometry.is_valid() {
            return Err(RunnerError::InvalidGeometry(geometry));
        }
        for (what, geometry, model) in [
            ("layers", geometry.layers, c.layers),
            ("kv_heads", geometry.kv_heads, c.kv_heads),
            ("head_dim", geometry.head_dim, c.head_dim),
        ] {
            if u64::from(geometry) != model as u64 {
                return Err(RunnerError::GeometryMismatch {
                    what,
                    geometry: u64::from(geometry),
                    model: model as u64,
                });
            }
        }
        validate_shapes(&weights, &d)?;
        let vocab = u32::try_from(c.vocab)
            .map_err(|_| RunnerError::BadConfig(format!("vocab {} exceeds u32", c.vocab)))?;
        let tpp = geometry.tokens_per_page as usize;
        Ok(LlamaRunner {
            freqs: math::rope_freqs(c.rope_base, c.head_dim),
            d,
            g: geometry,
            threads: threads.max(1),
            stop,
            chunk_tokens: (CHUNK_TOKENS / tpp).max(1) * tpp,
            vocab,
            w: weights,
            model_id: "llama".to_owned(),
            quantized: true,
        })
    }

    /// The same runner registering as `id` (see [`ModelRunner::model_id`]): the loader names
    /// it after the model file.
    pub fn with_model_id(mut self, id: String) -> LlamaRunner {
        self.model_id = id;
        self
    }

    /// The same runner with prefill chunks of about `tokens` tokens (rounded down to whole
    /// pages, at least one page). Results do not depend on it beyond float rounding of the
    /// batched products; tests use small chunks to cross many chunk boundaries.
    pub fn with_chunk_tokens(mut self, tokens: usize) -> LlamaRunner {
        let tpp = self.g.tokens_per_page as usize;
        self.chunk_tokens = (tokens / tpp).max(1) * tpp;
        self
    }

    /// The same runner decoding with the f32 copies of the weights and f32 vectors even
    /// where the file's quantized blocks are kept (`false`): the f32 computation, as
    /// llama.cpp runs a model dequantized to f32. Its tokens can differ from the quantized
    /// ones where two candidates are nearly tied; it is slower (`kvllmbench runner` compares
    /// the two).
    pub fn with_quantized_decode(mut self, quantized: bool) -> LlamaRunner {
        self.quantized = quantized;
        self
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.w.config
    }

    /// Threads the runner uses.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Tokens per prefill chunk.
    pub fn chunk_tokens(&self) -> usize {
        self.chunk_tokens
    }

    /// [`ModelRunner::step`], returning all the logits instead of their argmax (the cache is
    /// read and appended to in the same way).
    pub fn step_logits(
        &self,
        kv: &mut dyn KvCache,
        input: u32,
        step: u32,
        prompt_len: u32,
    ) -> Result<Vec<f32>, ModelError> {
        let mut one = [BatchStep {
            owner: None,
            kv,
            input,
            step,
            prompt_len,
            sampling: &Sampling::GREEDY,
        }];
        let [logits] = self
            .logits_batch(&mut one)
            .try_into()
            .unwrap_or_else(|_| unreachable!("one result per request"));
        logits
    }

    /// One decode step of each request of `batch` together: their logits, in order (the
    /// sampling of each is not read). A request that cannot step (a token outside the
    /// vocabulary, a step past its cache, an unreadable page) fails alone; the others run as
    /// one batch, each weight read once for all of them. The K/V a step computes is appended
    /// to its cache after the forward pass.
    pub fn logits_batch(&self, batch: &mut [BatchStep<'_>]) -> Vec<Result<Vec<f32>, ModelError>> {
        let mut plans: Vec<Option<Plan>> = vec![None; batch.len()];
        let mut outputs: Vec<Result<Stepped, ModelError>> = {
            let mut steps = Vec::with_capacity(batch.len());
            let mut failed: Vec<Option<ModelError>> = Vec::with_capacity(batch.len());
            for (b, slot) in batch.iter().zip(plans.iter_mut()) {
                let kv: &dyn KvCache = &*b.kv;
                let ready = self
                    .plan(kv, b.input, b.step, b.prompt_len)
                    .and_then(|plan| Ok((plan, self.readable_pages(kv, plan.read)?)));
                match ready {
                    Ok((plan, pages)) => {
                        *slot = Some(plan);
                        steps.push(StepIn {
                            pages,
                            token: b.input,
                            plan,
                        });
                        failed.push(None);
                    }
                    Err(e) => failed.push(Some(e)),
                }
            }
            let mut ran = self.forward_batch(&steps).into_iter();
            failed
                .into_iter()
                .map(|f| match f {
                    Some(e) => Err(e),
                    None => ran
                        .next()
                        .ok_or_else(|| ModelError::Failed("a batched step lost a request".into())),
                })
                .collect()
        };
        for (b, (out, plan)) in batch.iter_mut().zip(outputs.iter_mut().zip(&plans)) {
            let (Ok((_, new_kv)), Some(plan)) = (&*out, plan) else {
                continue;
            };
            if plan.fresh
                && let Err(e) = self.append(&mut *b.kv, new_kv)
            {
                *out = Err(e);
            }
        }
        outputs
            .into_iter()
            .map(|r| r.map(|(logits, _)| logits))
            .collect()
    }

    /// Where a decode step of `input` at `step` of a `prompt_len`-token prompt runs, checked
    /// against the cache.
    fn plan(
        &self,
        kv: &dyn KvCache,
        input: u32,
        step: u32,
        prompt_len: u32,
    ) -> Result<Plan, ModelError> {
        self.check_token(input)?;
        let pos = u64::from(prompt_len)
            .checked_sub(1)
            .ok_or(ModelError::EmptyKv)?
            + u64::from(step);
        let held = kv.positions();
        if pos > held {
            return Err(ModelError::Failed(format!(
                "decode step at position {pos}, but the cache holds {held} positions"
            )));
        }
        let fresh = pos == held;
        // Positions read from the pages: those before the token, and the token itself when
        // the prefill wrote it.
        let read = usize::try_from(if fresh { pos } else { pos + 1 })
            .map_err(|_| ModelError::Failed(format!("position {pos} is out of range")))?;
        Ok(Plan { pos, read, fresh })
    }

    /// Appends a step's K/V (`[layer][K, V][kv_heads * head_dim]`) to the cache.
    fn append(&self, kv: &mut dyn KvCache, new_kv: &[f32]) -> Result<(), ModelError> {
        let mut short = None;
        let need = self.page_bytes();
        kv.append(&mut |page, slot| {
            if page.len() < need {
                short = Some(page.len());
                return;
            }
            self.write_slot(page, slot, new_kv);
        })
        .map_err(ModelError::Pool)?;
        match short {
            Some(len) => Err(ModelError::Failed(format!(
                "a cache page has {len} bytes, the geometry needs {need}"
            ))),
            None => Ok(()),
        }
    }

    fn check_token(&self, token: u32) -> Result<(), ModelError> {
        if token >= self.vocab {
            return Err(ModelError::OutOfVocab {
                token,
                vocab: self.vocab,
            });
        }
        Ok(())
    }

    fn page_bytes(&self) -> usize {
        usize::try_from(self.g.bytes_per_page()).unwrap_or(usize::MAX)
    }

    fn tpp(&self) -> usize {
        self.g.tokens_per_page as usize
    }

    /// Bytes of one head's K or V run: `slots` consecutive slots of `layer` from slot 0.
    fn slab(&self, layer: usize, kv: Kv, head: usize, slots: usize) -> std::ops::Range<usize> {
        let off = self.vector_offset(layer, kv, head, 0);
        off..off + slots * self.d.hd * self.g.dtype.size()
    }

    fn vector_offset(&self, layer: usize, kv: Kv, head: usize, slot: usize) -> usize {
        // All four are below their geometry bound, a u32, checked in `new`.
        let u = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        self.g.vector_offset(u(layer), kv, u(head), u(slot))
    }

    /// The pages holding the first `positions` positions of `kv`, each at least a full page.
    fn readable_pages<'a>(
        &self,
        kv: &'a dyn KvCache,
        positions: usize,
    ) -> Result<Vec<&'a [u8]>, ModelError> {
        let need = self.page_bytes();
        (0..positions.div_ceil(self.tpp()))
            .map(|i| {
                kv.page(i).filter(|p| p.len() >= need).ok_or_else(|| {
                    ModelError::Failed(format!("page {i} of the cache is not readable"))
                })
            })
            .collect()
    }

    /// A decode matrix as decode multiplies it: the file's quantized blocks where the runner
    /// has them and uses them, else the f32 copy.
    fn mat<'a>(&'a self, f: &'a [f32], q: Option<&'a QuantMatrix>, cols: usize) -> Mat<'a> {
        match q {
            Some(q) if self.quantized => Mat::Quant(q),
            _ => Mat::F32 { w: f, cols },
        }
    }

    /// Layer `l`'s decode matrices `[wq, wk, wv, wo, w_gate, w_up, w_down]`.
    fn layer_mats(&self, l: usize) -> [Mat<'_>; 7] {
        let (lw, d) = (&self.w.layers[l], self.d);
        let lq = self.w.quant.layers.get(l);
        let q = |f: fn(&LayerQuant) -> &Option<QuantMatrix>| lq.and_then(|lq| f(lq).as_ref());
        [
            self.mat(&lw.wq, q(|l| &l.wq), d.hidden),
            self.mat(&lw.wk, q(|l| &l.wk), d.hidden),
            self.mat(&lw.wv, q(|l| &l.wv), d.hidden),
            self.mat(&lw.wo, q(|l| &l.wo), d.q()),
            self.mat(&lw.w_gate, q(|l| &l.w_gate), d.hidden),
            self.mat(&lw.w_up, q(|l| &l.w_up), d.hidden),
            self.mat(&lw.w_down, q(|l| &l.w_down), d.ffn),
        ]
    }

    /// The output projection as decode multiplies it.
    fn output_mat(&self) -> Mat<'_> {
        let q = &self.w.quant;
        match &self.w.output {
            Some(o) => self.mat(o, q.output.as_ref(), self.d.hidden),
            None => self.mat(&self.w.token_embd, q.token_embd.as_ref(), self.d.hidden),
        }
    }

    /// One decode step of every request of `steps` together: each request's logits and its
    /// token's rounded K/V, `[layer][K, V][kv_heads * head_dim]` (empty unless `fresh`).
    /// Attention of a request reads positions `0..read` from its pages and, when `fresh`,
    /// the token's own K/V computed here.
    ///
    /// The runner's threads run it together as a [`math::team`]. Each product is cut into
    /// runs of rows and each layer's attention into requests ([`math::Member::units`]);
    /// a member takes the next unit when it is done with its last, so one held up (its
    /// core shared, its requests longer) holds up the others by a unit at most. Every
    /// output is computed as for the request alone (one row, one vector, the same kernel),
    /// so a request's tokens depend neither on the batch it ran in nor on who computed it.
    fn forward_batch(&self, steps: &[StepIn<'_>]) -> Vec<Stepped> {
        let (d, n) = (self.d, steps.len());
        if n == 0 {
            return Vec::new();
        }
        let layer_kv = 2 * d.kv();
        let shared = Shared {
            qkv: math::SharedVec::new(n * (d.q() + layer_kv)),
            att: math::SharedVec::new(n * d.q()),
            wo: math::SharedVec::new(n * d.hidden),
            act: math::SharedVec::new(n * d.ffn),
            down: math::SharedVec::new(n * d.hidden),
            new_kv: math::SharedVec::new(n * self.w.config.layers * layer_kv),
        };
        let parts = math::team(self.threads, |m| self.forward_member(m, steps, &shared));
        steps
            .iter()
            .enumerate()
            .map(|(b, s)| {
                let mut logits = vec![0f32; d.vocab];
                // Each member computed runs of the vocabulary, every request's logits of a
                // run request after request.
                for (rows, part) in parts.iter().flatten() {
                    let k = rows.len();
                    logits[rows.clone()].copy_from_slice(&part[b * k..(b + 1) * k]);
                }
                let mut new_kv = Vec::new();
                if s.plan.fresh {
                    let all = self.w.config.layers * layer_kv;
                    new_kv = vec![0f32; all];
                    shared.new_kv.load(b * all, &mut new_kv);
                }
                (logits, new_kv)
            })
            .collect()
    }

    /// Member `m`'s part of [`Self::forward_batch`]: the runs of the vocabulary it computed,
    /// each with its logits of every request (request after request). The K/V it computed
    /// it leaves in `shared.new_kv`.
    fn forward_member(
        &self,
        m: &math::Member<'_>,
        steps: &[StepIn<'_>],
        shared: &Shared,
    ) -> Vec<(Range<usize>, Vec<f32>)> {
        let (d, c, n) = (self.d, &self.w.config, steps.len());
        let (qkv_rows, layer_kv) = (d.q() + 2 * d.kv(), 2 * d.kv());
        let mut x = vec![0f32; n * d.hidden];
        for (x, s) in x.chunks_exact_mut(d.hidden).zip(steps) {
            let t = s.token as usize;
            x.copy_from_slice(&self.w.token_embd[t * d.hidden..(t + 1) * d.hidden]);
        }
        let mut h = vec![0f32; n * d.hidden];
        let mut qkv = vec![0f32; qkv_rows];
        let mut att = vec![0f32; n * d.q()];
        let mut proj = vec![0f32; n * d.hidden];
        let mut act = vec![0f32; n * d.ffn];
        let (mut part, mut gate, mut up) = (Vec::new(), Vec::new(), Vec::new());
        let half = d.hd / 2;
        let (mut cos, mut sin) = (vec![0f32; n * half], vec![0f32; n * half]);
        for (s, (cos, sin)) in steps
            .iter()
            .zip(cos.chunks_exact_mut(half).zip(sin.chunks_exact_mut(half)))
        {
            math::rope_angles(&self.freqs, s.plan.pos, cos, sin);
        }
        // `[M_0; M_1; ...] x_b` for every request's `x_b` (each `cols` long): the runs of
        // rows this member takes, published in `out` (request after request); after the
        // barrier every member may load any of it.
        let mut product = |ms: &[Mat<'_>], x: &[f32], out: &math::SharedVec| {
            let total = out.len() / n;
            let xs = quant::Inputs::new(vectors(x, x.len() / n));
            let runs = row_runs(total, m.count(), UNIT_ROWS);
            for r in m.units(runs.len()).map(|u| runs[u].clone()) {
                let k = r.len();
                part.resize(part.len().max(n * k), 0.0);
                let p = &mut part[..n * k];
                quant::matvec_multi_stacked(ms, &xs, r.clone(), p);
                for b in 0..n {
                    out.store(b * total + r.start, &p[b * k..(b + 1) * k]);
                }
            }
            m.sync();
        };
        for l in 0..c.layers {
            let lw = &self.w.layers[l];
            let [wq, wk, wv, wo, w_gate, w_up, w_down] = self.layer_mats(l);
            for (x, h) in x.chunks_exact(d.hidden).zip(h.chunks_exact_mut(d.hidden)) {
                math::rms_norm(x, &lw.attn_norm, c.rms_eps, h);
            }
            product(&[wq, wk, wv], &h, &shared.qkv);
            // Attention of request `b`, query heads `heads`: its Q, K and V loaded, rotated
            // and rounded, the K/V kept (`keep`), the heads' result published in `att`.
            let mut attend = |b: usize, heads: Range<usize>, keep: bool| {
                let s = &steps[b];
                shared.qkv.load(b * qkv_rows, &mut qkv);
                let (cos, sin) = (
                    &cos[b * half..(b + 1) * half],
                    &sin[b * half..(b + 1) * half],
                );
                let (q, kv) = qkv.split_at_mut(d.q());
                if s.plan.fresh {
                    let (k, v) = kv.split_at_mut(d.kv());
                    for head in k.chunks_exact_mut(d.hd) {
                        math::rope_head(head, cos, sin);
                    }
                    math::round_to(self.g.dtype, k);
                    math::round_to(self.g.dtype, v);
                    if keep {
                        let at = (b * c.layers + l) * layer_kv;
                        shared.new_kv.store(at, kv);
                    }
                }
                let span = heads.start * d.hd..heads.end * d.hd;
                let q = &mut q[span.clone()];
                for head in q.chunks_exact_mut(d.hd) {
                    math::rope_head(head, cos, sin);
                }
                let cur = s.plan.fresh.then(|| kv.split_at(d.kv()));
                let out = &mut att[span.clone()];
                self.attend(l, heads, &s.pages, s.plan.read, q, cur, out);
                shared.att.store(b * d.q() + span.start, out);
            };
            // Whole requests when there are as many as members (a request's pages are then
            // read by one member only), else each member its share of every request's heads.
            if n >= m.count() {
                for b in m.units(n) {
                    attend(b, 0..d.heads, true);
                }
            } else {
                for b in 0..n {
                    attend(b, m.share(d.heads), m.is_first());
                }
            }
            m.sync();
            shared.att.load(0, &mut att);
            product(&[wo], &att, &shared.wo);
            shared.wo.load(0, &mut proj);
            x.iter_mut().zip(&proj).for_each(|(x, p)| *x += p);
            for (x, h) in x.chunks_exact(d.hidden).zip(h.chunks_exact_mut(d.hidden)) {
                math::rms_norm(x, &lw.ffn_norm, c.rms_eps, h);
            }
            // Gate and up by the same runs of rows, so each member has both halves of the
            // rows it takes.
            let xs = quant::Inputs::new(vectors(&h, d.hidden));
            let runs = row_runs(d.ffn, m.count(), UNIT_ROWS);
            for r in m.units(runs.len()).map(|u| runs[u].clone()) {
                let k = r.len();
                gate.resize(gate.len().max(n * k), 0.0);
                up.resize(up.len().max(n * k), 0.0);
                let (gate, up) = (&mut gate[..n * k], &mut up[..n * k]);
                quant::matvec_multi_stacked(&[w_gate], &xs, r.clone(), gate);
                quant::matvec_multi_stacked(&[w_up], &xs, r.clone(), up);
                for b in 0..n {
                    let gate = &mut gate[b * k..(b + 1) * k];
                    math::silu_mul(gate, &up[b * k..(b + 1) * k]);
                    shared.act.store(b * d.ffn + r.start, gate);
                }
            }
            m.sync();
            shared.act.load(0, &mut act);
            product(&[w_down], &act, &shared.down);
            shared.down.load(0, &mut proj);
            x.iter_mut().zip(&proj).for_each(|(x, p)| *x += p);
        }
        for (x, h) in x.chunks_exact(d.hidden).zip(h.chunks_exact_mut(d.hidden)) {
            math::rms_norm(x, &self.w.output_norm, c.rms_eps, h);
        }
        let xs = quant::Inputs::new(vectors(&h, d.hidden));
        let output = self.output_mat();
        let runs = row_runs(d.vocab, m.count(), VOCAB_UNIT_ROWS);
        m.units(runs.len())
            .map(|u| {
                let r = runs[u].clone();
                let mut logits = vec![0f32; n * r.len()];
                quant::matvec_multi_stacked(&[output], &xs, r.clone(), &mut logits);
                (r, logits)
            })
            .collect()
    }

    /// Decode attention of layer `l` for the query heads `heads` (`q` and `out` hold theirs,
    /// `[heads][head_dim]`) over positions `0..read` of the pages and, if given, the current
    /// token's K/V (`cur`, all KV heads). The K and V slabs are read in place, page by page
    /// (the slabs of one page and layer are contiguous), each decoded once for all the
    /// query heads that read it. Each head's result does not depend on which others are
    /// computed with it.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        l: usize,
        heads: std::ops::Range<usize>,
        pages: &[&[u8]],
        read: usize,
        q: &[f32],
        cur: Option<(&[f32], &[f32])>,
        out: &mut [f32],
    ) {
        let (hd, group, tpp, dtype) = (self.d.hd, self.d.group, self.tpp(), self.g.dtype);
        if heads.is_empty() {
            return;
        }
        let total = read + usize::from(cur.is_some());
        let scale = 1.0 / (hd as f32).sqrt();
        let mut scores = vec![0f32; heads.len() * total];
        // The KV heads read, and the query heads of each (local indices).
        let kv_heads = heads.start / group..(heads.end - 1) / group + 1;
        let local = |g: usize| {
            (g * group).max(heads.start) - heads.start
                ..((g + 1) * group).min(heads.end) - heads.start
        };
        // The bf16 kernels read the slabs in place and spread the prefetch of the next slab
        // over this one's rows; elsewhere each slab is decoded into `buf` first and the
        // whole next page asked of memory at once. Both give the same bits.
        let fused = dtype == Dtype::Bf16 && attend::available() && hd.is_multiple_of(8);
        let mut buf = if fused {
            Vec::new()
        } else {
            vec![0f32; tpp * hd]
        };
        // KV head `g`'s slab for `kv` on page `pi` (empty past the last page read).
        let slab = |pi: usize, kv: Kv, g: usize| -> &[u8] {
            match pages.get(pi).filter(|_| pi * tpp < read) {
                Some(page) => &page[self.slab(l, kv, g, tpp.min(read - pi * tpp))],
                None => &[],
            }
        };
        // The slabs of page `pi` for `kv`, asked of memory while the page before is read:
        // pages lie anywhere, so no hardware prefetcher sees the next one coming.
        let prefetch = |pi: usize, kv: Kv| {
            if !fused {
                for g in kv_heads.clone() {
                    math::prefetch(slab(pi, kv, g));
                }
            }
        };
        prefetch(0, Kv::K);
        for pi in 0..pages.len() {
            let at = pi * tpp..(pi * tpp + tpp).min(read);
            prefetch(pi + 1, Kv::K);
            for g in kv_heads.clone() {
                let (js, keys) = (local(g), slab(pi, Kv::K, g));
                if fused {
                    // The slab read after this one: the head's keys on the next page, or
                    // its values on the first.
                    let ahead = if pi + 1 < pages.len() {
                        slab(pi + 1, Kv::K, g)
                    } else {
                        slab(0, Kv::V, g)
                    };
                    let q = &q[js.start * hd..js.end * hd];
                    let rows = &mut scores[js.start * total + at.start..];
                    attend::scores(keys, hd, q, rows, total, ahead);
                    continue;
                }
                let kb = &mut buf[..at.len() * hd];
                math::decode(dtype, keys, kb);
                for j in js {
                    let row = &mut scores[j * total..(j + 1) * total];
                    math::matvec(kb, &q[j * hd..(j + 1) * hd], &mut row[at.clone()]);
                }
            }
        }
        if let Some((k, _)) = cur {
            for g in kv_heads.clone() {
                for j in local(g) {
                    scores[j * total + read] =
                        math::dot(&k[g * hd..(g + 1) * hd], &q[j * hd..(j + 1) * hd]);
                }
            }
        }
        for row in scores.chunks_exact_mut(total.max(1)) {
            row.iter_mut().for_each(|s| *s *= scale);
            math::softmax(row);
        }
        out.fill(0.0);
        prefetch(0, Kv::V);
        for pi in 0..pages.len() {
            let at = pi * tpp..(pi * tpp + tpp).min(read);
            prefetch(pi + 1, Kv::V);
            for g in kv_heads.clone() {
                let (js, values) = (local(g), slab(pi, Kv::V, g));
                if fused {
                    let p = &scores[js.start * total + at.start..];
                    let out = &mut out[js.start * hd..js.end * hd];
                    attend::weighted(values, hd, p, total, out, slab(pi + 1, Kv::V, g));
                    continue;
                }
                let vb = &mut buf[..at.len() * hd];
                math::decode(dtype, values, vb);
                for j in js {
                    let p = &scores[j * total + at.start..j * total + at.end];
                    math::weighted_sum(p, vb, &mut out[j * hd..(j + 1) * hd]);
                }
            }
        }
        if let Some((_, v)) = cur {
            for g in kv_heads {
                for j in local(g) {
                    let p = &scores[j * total + read..(j + 1) * total];
                    math::weighted_sum(p, &v[g * hd..(g + 1) * hd], &mut out[j * hd..(j + 1) * hd]);
                }
            }
        }
    }

    /// Writes one token's K/V (`[layer][K, V][kv_heads * head_dim]`, already rounded) into
    /// slot `slot` of `page`, which holds at least a full page.
    fn write_slot(&self, page: &mut [u8], slot: u32, kv: &[f32]) {
        let (d, sz) = (self.d, self.g.dtype.size());
        for (l, layer) in kv.chunks_exact(2 * d.kv()).enumerate() {
            for (which, vals) in [Kv::K, Kv::V].into_iter().zip(layer.chunks_exact(d.kv())) {
                for (head, v) in vals.chunks_exact(d.hd).enumerate() {
                    let off = self.vector_offset(l, which, head, slot as usize);
                    math::encode(self.g.dtype, v, &mut page[off..off + d.hd * sz]);
                }
            }
        }
    }

    /// Runs positions `start..end` of `prompt` (whole pages but for the last) through every
    /// layer, writing their K/V into `pages`.
    fn prefill_chunk(
        &self,
        prompt: &[u32],
        start: usize,
        end: usize,
        pages: &mut dyn PageWrite,
    ) -> Result<(), ModelError> {
        let (d, c, threads) = (self.d, &self.w.config, self.threads);
        let n = end - start;
        // Activations are feature-major: row r holds feature r of every token of the chunk.
        let mut x = vec![0f32; d.hidden * n];
        for (t, &tok) in prompt[start..end].iter().enumerate() {
            let e = &self.w.token_embd[tok as usize * d.hidden..(tok as usize + 1) * d.hidden];
            for (r, &v) in e.iter().enumerate() {
                x[r * n + t] = v;
            }
        }
        let half = d.hd / 2;
        let (mut cos, mut sin) = (vec![0f32; half * n], vec![0f32; half * n]);
        let (mut c1, mut s1) = (vec![0f32; half], vec![0f32; half]);
        for t in 0..n {
            math::rope_angles(&self.freqs, (start + t) as u64, &mut c1, &mut s1);
            for i in 0..half {
                cos[i * n + t] = c1[i];
                sin[i * n + t] = s1[i];
            }
        }
        let mut h = vec![0f32; d.hidden * n];
        let mut q = vec![0f32; d.q() * n];
        let mut k = vec![0f32; d.kv() * n];
        let mut v = vec![0f32; d.kv() * n];
        let mut att = vec![0f32; d.q() * n];
        let mut gate = vec![0f32; d.ffn * n];
        let mut up = vec![0f32; d.ffn * n];
        // The K and V of positions 0..end of one layer, `[kv_heads][end][head_dim]`.
        let mut k_all = vec![0f32; d.kv() * end];
        let mut v_all = vec![0f32; d.kv() * end];
        for (l, lw) in self.w.layers.iter().enumerate() {
            math::rms_norm_fm(&x, &lw.attn_norm, c.rms_eps, n, &mut h);
            let jobs = vec![
                (&lw.wq[..], &mut q[..]),
                (&lw.wk[..], &mut k[..]),
                (&lw.wv[..], &mut v[..]),
            ];
            math::gemm_fm_stacked(jobs, &h, n, 0.0, threads);
            for head in q
                .chunks_exact_mut(d.hd * n)
                .chain(k.chunks_exact_mut(d.hd * n))
            {
                math::rope_head_fm(head, n, &cos, &sin);
            }
            math::round_to(self.g.dtype, &mut k);
            math::round_to(self.g.dtype, &mut v);
            self.write_chunk(pages, l, start, end, &k, &v)?;
            self.read_layer(pages, l, end, &mut k_all, &mut v_all)?;
            self.attend_chunk(start, n, end, &q, &k_all, &v_all, &mut att);
            math::gemm_fm_stacked(vec![(&lw.wo[..], &mut x[..])], &att, n, 1.0, threads);
            math::rms_norm_fm(&x, &lw.ffn_norm, c.rms_eps, n, &mut h);
            self.gate_up(lw, &h, n, &mut gate, &mut up);
            math::gemm_fm_stacked(vec![(&lw.w_down[..], &mut x[..])], &gate, n, 1.0, threads);
        }
        Ok(())
    }

    /// `gate = silu(W_gate h) * (W_up h)` for the `n` tokens of feature-major `h`, both
    /// products and the activation of a block of rows on one thread.
    fn gate_up(&self, lw: &LayerWeights, h: &[f32], n: usize, gate: &mut [f32], up: &mut [f32]) {
        let hidden = self.d.hidden;
        let per = self.d.ffn.div_ceil(self.threads).next_multiple_of(16);
        let blocks: Vec<_> = lw
            .w_gate
            .chunks(per * hidden)
            .zip(lw.w_up.chunks(per * hidden))
            .zip(gate.chunks_mut(per * n).zip(up.chunks_mut(per * n)))
            .collect();
        math::for_each_parallel(blocks, self.threads, |((wg, wu), (g, u))| {
            math::gemm_fm(wg, h, n, g, 0.0);
            math::gemm_fm(wu, h, n, u, 0.0);
            math::silu_mul(g, u);
        });
    }

    /// The page `index` of a prefill, checked to hold a full page.
    fn page_of<'a>(
        &self,
        pages: &'a mut dyn PageWrite,
        index: usize,
    ) -> Result<&'a mut [u8], ModelError> {
        let need = self.page_bytes();
        let page = pages.page_mut(index).map_err(ModelError::Pool)?;
        if page.len() < need {
            return Err(ModelError::Failed(format!(
                "page {index} has {} bytes, the geometry needs {need}",
                page.len()
            )));
        }
        Ok(page)
    }

    /// Writes layer `l`'s K and V of positions `start..end` (feature-major `[kv_heads *
    /// head_dim][end - start]`, rounded) into their slots.
    fn write_chunk(
        &self,
        pages: &mut dyn PageWrite,
        l: usize,
        start: usize,
        end: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), ModelError> {
        let (hd, tpp, n) = (self.d.hd, self.tpp(), end - start);
        let mut run = vec![0f32; tpp * hd];
        let mut p = start;
        while p < end {
            let (index, slot) = (p / tpp, p % tpp);
            let slots = (tpp - slot).min(end - p);
            let page = self.page_of(pages, index)?;
            for (which, buf) in [(Kv::K, k), (Kv::V, v)] {
                for (head, rows) in buf.chunks_exact(hd * n).enumerate() {
                    // Transpose the head's block to the page's [slot][dim] order.
                    let run = &mut run[..slots * hd];
                    for (s, vec) in run.chunks_exact_mut(hd).enumerate() {
                        for (dim, o) in vec.iter_mut().enumerate() {
                            *o = rows[dim * n + (p - start) + s];
                        }
                    }
                    let off = self.vector_offset(l, which, head, slot);
                    let len = run.len() * self.g.dtype.size();
                    math::encode(self.g.dtype, run, &mut page[off..off + len]);
                }
            }
            p += slots;
        }
        Ok(())
    }

    /// Reads layer `l`'s K and V of positions `0..end` from the pages into `[kv_heads][end]
    /// [head_dim]` buffers.
    fn read_layer(
        &self,
        pages: &mut dyn PageWrite,
        l: usize,
        end: usize,
        k_all: &mut [f32],
        v_all: &mut [f32],
    ) -> Result<(), ModelError> {
        let (hd, tpp) = (self.d.hd, self.tpp());
        for index in 0..end.div_ceil(tpp) {
            let page = self.page_of(pages, index)?;
            let slots = tpp.min(end - index * tpp);
            for (which, buf) in [(Kv::K, &mut *k_all), (Kv::V, &mut *v_all)] {
                for (head, dst) in buf.chunks_exact_mut(end * hd).enumerate() {
                    let dst = &mut dst[index * tpp * hd..(index * tpp + slots) * hd];
                    math::decode(self.g.dtype, &page[self.slab(l, which, head, slots)], dst);
                }
            }
        }
        Ok(())
    }

    /// Causal attention of the chunk's queries (positions `start..start + n`, feature-major
    /// `q`) over positions `0..end` (`k_all`, `v_all`), into feature-major `out`. Query heads
    /// are split over threads.
    #[allow(clippy::too_many_arguments)]
    fn attend_chunk(
        &self,
        start: usize,
        n: usize,
        end: usize,
        q: &[f32],
        k_all: &[f32],
        v_all: &[f32],
        out: &mut [f32],
    ) {
        let (hd, group) = (self.d.hd, self.d.group);
        let scale = 1.0 / (hd as f32).sqrt();
        let tasks: Vec<(usize, &mut [f32])> = out.chunks_exact_mut(hd * n).enumerate().collect();
        math::for_each_parallel(tasks, self.threads, |(h, out)| {
            let g = h / group;
            let qh = &q[h * hd * n..(h + 1) * hd * n];
            let kg = &k_all[g * end * hd..(g + 1) * end * hd];
            let vg = &v_all[g * end * hd..(g + 1) * end * hd];
            let mut scores = Vec::new();
            for b0 in (0..n).step_by(QUERY_BLOCK) {
                let bn = QUERY_BLOCK.min(n - b0);
                // Keys up to the block's last query.
                let keys = start + b0 + bn;
                scores.clear();
                scores.resize(bn * keys, 0.0);
                math::sgemm(
                    scale,
                    &qh[b0..],
                    View::cols(bn, hd, n),
                    kg,
                    View::cols(hd, keys, hd),
                    0.0,
                    &mut scores,
                    View::rows(bn, keys, keys),
                );
                for (t, row) in scores.chunks_exact_mut(keys).enumerate() {
                    let visible = start + b0 + t + 1;
                    math::softmax(&mut row[..visible]);
                    row[visible..].fill(0.0);
                }
                math::sgemm(
                    1.0,
                    &scores,
                    View::rows(bn, keys, keys),
                    vg,
                    View::rows(keys, hd, hd),
                    0.0,
                    &mut out[b0..],
                    View::cols(bn, hd, n),
                );
            }
        });
    }
}

impl ModelRunner for LlamaRunner {
    fn geometry(&self) -> &PageGeometry {
        &self.g
    }

    fn vocab(&self) -> u32 {
        self.vocab
    }

    fn prefill_chunked(
        &self,
        prompt: &[u32],
        pages: &mut dyn PageWrite,
        keep_going: &mut dyn FnMut(usize) -> bool,
    ) -> Result<bool, ModelError> {
        for &t in prompt {
            self.check_token(t)?;
        }
        let tpp = self.tpp();
        let need = prompt.len().div_ceil(tpp);
        let count = pages.page_count();
        if count < need {
            return Err(ModelError::Failed(format!(
                "a prompt of {} tokens needs {need} pages of {tpp} tokens, there are {count}",
                prompt.len()
            )));
        }
        // No stale byte may leave the pool: the slots of the last prompt page past the
        // prompt, and the last page of the grant, are zero.
        for index in [need.checked_sub(1), count.checked_sub(1)]
            .into_iter()
            .flatten()
        {
            self.page_of(pages, index)?.fill(0);
        }
        for (i, start) in (0..prompt.len()).step_by(self.chunk_tokens).enumerate() {
            if i > 0 && !keep_going(start) {
                return Ok(false);
            }
            let end = (start + self.chunk_tokens).min(prompt.len());
            self.prefill_chunk(prompt, start, end, pages)?;
        }
        Ok(true)
    }

    fn step(
        &self,
        kv: &mut dyn KvCache,
        input: u32,
        step: u32,
        prompt_len: u32,
    ) -> Result<u32, ModelError> {
        let logits = self.step_logits(kv, input, step, prompt_len)?;
        let best = math::argmax(&logits)
            .ok_or_else(|| ModelError::Failed("every logit is NaN".to_owned()))?;
        // The argmax indexes the logits, which has `vocab` (a u32) entries.
        Ok(u32::try_from(best).unwrap_or(u32::MAX))
    }

    fn sample(
        &self,
        kv: &mut dyn KvCache,
        input: u32,
        step: u32,
        prompt_len: u32,
        sampling: &Sampling,
    ) -> Result<u32, ModelError> {
        let logits = self.step_logits(kv, input, step, prompt_len)?;
        pick(&logits, sampling, step)
    }

    fn sample_batch(&self, batch: &mut [BatchStep<'_>]) -> Vec<Result<u32, ModelError>> {
        self.logits_batch(batch)
            .into_iter()
            .zip(batch.iter())
            .map(|(logits, b)| pick(&logits?, b.sampling, b.step))
            .collect()
    }

    fn model_id(&self) -> String {
        self.model_id.clone()
    }

    fn is_stop(&self, token: u32) -> bool {
        self.stop.contains(&token)
    }
}

/// `v` as vectors of `len`.
fn vectors(v: &[f32], len: usize) -> Vec<&[f32]> {
    v.chunks_exact(len.max(1)).collect()
}

/// The token `sampling` picks from `logits` at `step`.
fn pick(logits: &[f32], sampling: &Sampling, step: u32) -> Result<u32, ModelError> {
    let pick = crate::sample::pick(logits, sampling, step)
        .ok_or_else(|| ModelError::Failed("every logit is NaN".to_owned()))?;
    // The pick indexes the logits, which has `vocab` (a u32) entries.
    Ok(u32::try_from(pick).unwrap_or(u32::MAX))
}

/// Checks the hyper-parameters the forward pass relies on.
fn validate_config(c: &LlamaConfig) -> Result<Dims, RunnerError> {
    let bad = |m: String| Err(RunnerError::BadConfig(m));
    if c.layers == 0 || c.hidden == 0 || c.heads == 0 || c.kv_heads == 0 || c.ffn == 0 {
        return bad(format!("a dimension is zero: {c:?}"));
    }
    if c.vocab == 0 {
        return bad("the vocabulary is empty".to_owned());
    }
    if !c.heads.is_multiple_of(c.kv_heads) {
        return bad(format!(
            "{} heads are not a multiple of {} KV heads",
            c.heads, c.kv_heads
        ));
    }
    if c.head_dim == 0 || !c.head_dim.is_multiple_of(2) {
        return bad(format!(
            "head_dim {} is not a positive even number",
            c.head_dim
        ));
    }
    if !(c.rope_base.is_finite() && c.rope_base > 0.0) {
        return bad(format!(
            "rope base {} is not a positive number",
            c.rope_base
        ));
    }
    if !(c.rms_eps.is_finite() && c.rms_eps >= 0.0) {
        return bad(format!(
            "rms eps {} is not a non-negative number",
            c.rms_eps
        ));
    }
    Ok(Dims {
        hidden: c.hidden,
        heads: c.heads,
        kv_heads: c.kv_heads,
        hd: c.head_dim,
        group: c.heads / c.kv_heads,
        ffn: c.ffn,
        vocab: c.vocab,
    })
}

/// Checks that every tensor has the size the config implies.
fn validate_shapes(w: &LlamaWeights, d: &Dims) -> Result<(), RunnerError> {
    let c = &w.config;
    if w.layers.len() != c.layers {
        return Err(RunnerError::BadConfig(format!(
            "{} layers of weights, the config has {}",
            w.layers.len(),
            c.layers
        )));
    }
    let size = |name: &str, a: usize, b: usize| {
        a.checked_mul(b)
            .ok_or_else(|| RunnerError::BadConfig(format!("{name}: {a} x {b} overflows")))
    };
    let check = |name: String, got: usize, expected: usize| {
        if got == expected {
            Ok(())
        } else {
            Err(RunnerError::TensorShape {
                name,
                expected,
                got,
            })
        }
    };
    let embd = size("token_embd", d.vocab, d.hidden)?;
    check("token_embd".to_owned(), w.token_embd.len(), embd)?;
    check("output_norm".to_owned(), w.output_norm.len(), d.hidden)?;
    if let Some(o) = &w.output {
        check("output".to_owned(), o.len(), embd)?;
    }
    let q = size("attn_q", d.q(), d.hidden)?;
    let kv = size("attn_k", d.kv(), d.hidden)?;
    let ffn = size("ffn", d.ffn, d.hidden)?;
    for (i, l) in w.layers.iter().enumerate() {
        let LayerWeights {
            attn_norm,
            wq,
            wk,
            wv,
            wo,
            ffn_norm,
            w_gate,
            w_up,
            w_down,
        } = l;
        for (name, got, expected) in [
            ("attn_norm", attn_norm.len(), d.hidden),
            ("attn_q", wq.len(), q),
            ("attn_k", wk.len(), kv),
            ("attn_v", wv.len(), kv),
            ("attn_output", wo.len(), q),
            ("ffn_norm", ffn_norm.len(), d.hidden),
            ("ffn_gate", w_gate.len(), ffn),
            ("ffn_up", w_up.len(), ffn),
            ("ffn_down", w_down.len(), ffn),
        ] {
            check(format!("blk.{i}.{name}"), got, expected)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runs cover the rows once, in order, each starting on a strip (no strip is
    /// computed twice), the first of each member long where the product is.
    #[test]
    fn row_runs_cover_a_product_once_on_strips() {
        for members in 1..=4 {
            for total in [1, 16, 64, 576, 960, 1536, 49152, 49155] {
                let runs = row_runs(total, members, UNIT_ROWS);
                let mut at = 0;
                for r in &runs {
                    assert_eq!(r.start, at, "{total} rows, {members} members: {runs:?}");
                    assert!(r.start.is_multiple_of(quant::STRIP) && !r.is_empty());
                    at = r.end;
                }
                assert_eq!(at, total);
                if members == 1 {
                    assert_eq!(runs.len(), 1);
                } else if total >= 576 {
                    let long = runs[..members]
                        .iter()
                        .map(ExactSizeIterator::len)
                        .sum::<usize>();
                    assert!(long * 2 <= total && long * 3 >= total, "{runs:?}");
                }
            }
        }
    }

    fn config() -> LlamaConfig {
        LlamaConfig {
            layers: 1,
            hidden: 8,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            ffn: 8,
            vocab: 3,
            context: 16,
            rope_base: 10000.0,
            rms_eps: 1e-5,
        }
    }

    fn weights(c: &LlamaConfig) -> LlamaWeights {
        let (h, q, kv) = (c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim);
        LlamaWeights {
            config: c.clone(),
            token_embd: vec![0.1; c.vocab * h],
            layers: vec![LayerWeights {
                attn_norm: vec![1.0; h],
                wq: vec![0.1; q * h],
                wk: vec![0.1; kv * h],
                wv: vec![0.1; kv * h],
                wo: vec![0.1; h * q],
                ffn_norm: vec![1.0; h],
                w_gate: vec![0.1; c.ffn * h],
                w_up: vec![0.1; c.ffn * h],
                w_down: vec![0.1; h * c.ffn],
            }],
            output_norm: vec![1.0; h],
            output: None,
            quant: Default::default(),
        }
    }

    fn geometry(tokens_per_page: u32) -> PageGeometry {
        PageGeometry {
            tokens_per_page,
            layers: 1,
            kv_heads: 1,
            head_dim: 4,
            dtype: libkv::Dtype::F16,
        }
    }

    #[test]
    fn runner_config_is_validated() {
        let mut c = config();
        c.kv_heads = 3;
        assert!(matches!(
            validate_config(&c),
            Err(RunnerError::BadConfig(_))
        ));
        let mut c = config();
        c.head_dim = 3;
        assert!(matches!(
            validate_config(&c),
            Err(RunnerError::BadConfig(_))
        ));
        let mut c = config();
        c.rope_base = f32::NAN;
        assert!(matches!(
            validate_config(&c),
            Err(RunnerError::BadConfig(_))
        ));
        let mut w = weights(&config());
        w.layers.clear();
        assert!(matches!(
            LlamaRunner::new(w, geometry(4), 1, vec![]),
            Err(RunnerError::BadConfig(_))
        ));
        let mut g = geometry(4);
        g.tokens_per_page = 0;
        assert!(matches!(
            LlamaRunner::new(weights(&config()), g, 1, vec![]),
            Err(RunnerError::InvalidGeometry(_))
        ));
    }

    #[test]
    fn runner_chunks_are_whole_pages() {
        let r = LlamaRunner::new(weights(&config()), geometry(3), 0, vec![]).unwrap();
        assert_eq!(r.threads(), 1);
        assert_eq!(r.chunk_tokens(), 255);
        assert_eq!(r.with_chunk_tokens(10).chunk_tokens(), 9);
        let r = LlamaRunner::new(weights(&config()), geometry(1000), 1, vec![]).unwrap();
        assert_eq!(r.chunk_tokens(), 1000);
        assert_eq!(r.with_chunk_tokens(1).chunk_tokens(), 1000);
    }

    #[test]
    fn runner_fails_on_nan_logits() {
        let c = config();
        let g = geometry(4);
        let r = LlamaRunner::new(weights(&c), g, 1, vec![]).unwrap();
        let mut kv = libkv::model::MemoryKv::new(g, 2, 1);
        r.prefill(&[0, 1], &mut kv).unwrap();
        // A NaN in the first K (f16 0x7E00) spreads through the attention to every logit.
        kv.page_mut(0).unwrap()[..2].copy_from_slice(&[0x00, 0x7E]);
        kv.set_prefilled(2);
        assert!(matches!(
            r.step(&mut kv, 1, 0, 2),
            Err(ModelError::Failed(_))
        ));
    }
}
