//! The reference model runner: a small, deterministic, real computation over paged KV, so the
//! whole pipeline is checkable end to end without model weights.
//!
//! Tokens are bytes (ids 0..=255). For token `b` at position `p`, in every layer `l` and KV
//! head `h`:
//!
//! - **K** holds `p` written in base 16, one digit per dimension, in the first
//!   [`POSITION_DIGITS`] dimensions; the others hold a small value derived from `(l, h, d, b)`.
//! - **V** holds the 8 bits of `b` in dimensions 0..8 (0.0 or 1.0); the others hold a small
//!   value derived from `(l, h, d, b, p)`.
//!
//! Every value is a multiple of 1/8 below 16, exact in f16, bf16 and f32.
//!
//! Decode step `i` of a prompt of `n` tokens runs two heads over every readable position:
//!
//! - a **copy head** (layer 0, head 0): the query is position `i mod n` in base 16; scores
//!   are negative squared distances to each K; hard attention takes the best position and its
//!   V bits give the output byte. The output is therefore the prompt, echoed.
//! - and at the end a **mean head** over all layers, heads, K and V: uniform attention whose
//!   output vector, summed exactly (no addend is ever rounded away), is hashed into a 64-bit
//!   signature.
//!
//! Any foreign, stale or poisoned byte in a page the attention reads changes the copy head's
//! choice or value, or the mean head's sum, so it changes the output or the signature. The
//! [`monolithic`] path computes the same math from the prompt alone, without pages or
//! transfers, and gives the expected output for tests.

use crate::Owner;
use crate::geometry::{Kv, PageGeometry};
use crate::pool::{PoolError, WriteGrant};
use crate::proto::Sampling;
use crate::verify::VerifiedKv;

/// Dimensions of K that encode the position (base 16: positions below 16^6).
pub const POSITION_DIGITS: u32 = 6;
/// The token emitted when attention reads bytes this model never wrote (outside the byte
/// vocabulary, so it can never equal an expected output).
pub const GARBAGE: u32 = 0x1FF;
/// What workers of the reference model register as (`ModelRunner::model_id`).
pub const REFERENCE_MODEL: &str = "reference";
/// Smallest head_dim the reference model runs on.
pub const MIN_HEAD_DIM: u32 = 8;

/// Errors of a model run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ModelError {
    #[error("head_dim {0} is below the reference model's minimum of {MIN_HEAD_DIM}")]
    HeadDimTooSmall(u32),
    #[error("token {0} is not a byte")]
    BadToken(u32),
    #[error("no readable KV to attend over")]
    EmptyKv,
    #[error("writing KV")]
    Pool(#[source] PoolError),
    #[error("token {token} is outside the vocabulary of {vocab}")]
    OutOfVocab { token: u32, vocab: u32 },
    #[error("{0}")]
    Failed(String),
}

/// The output of one request: generated tokens and the mean head's signature.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Output {
    pub tokens: Vec<u32>,
    pub signature: u64,
}

/// Read access to K/V vectors by position, as f32.
pub trait KvRead {
    /// Readable positions.
    fn positions(&self) -> u64;
    /// Fills `out` (head_dim long) with the vector; false if out of range.
    fn read(&self, layer: u32, kv: Kv, head: u32, pos: u64, out: &mut [f32]) -> bool;
}

impl KvRead for VerifiedKv {
    fn positions(&self) -> u64 {
        self.tokens()
    }

    fn read(&self, layer: u32, kv: Kv, head: u32, pos: u64, out: &mut [f32]) -> bool {
        if pos >= self.tokens() {
            return false;
        }
        read_vector(self.geometry(), |i| self.page(i), layer, kv, head, pos, out)
    }
}

/// Pages a prefill writes, in token order: a reservation's [`WriteGrant`], or plain memory
/// ([`MemoryKv`]) for the monolithic path.
pub trait PageWrite {
    /// Pages there are to write.
    fn page_count(&self) -> usize;
    /// The bytes of the `index`-th page.
    fn page_mut(&mut self, index: usize) -> Result<&mut [u8], PoolError>;
}

impl PageWrite for WriteGrant {
    fn page_count(&self) -> usize {
        self.pages().len()
    }

    fn page_mut(&mut self, index: usize) -> Result<&mut [u8], PoolError> {
        WriteGrant::page_mut(self, index)
    }
}

/// KV a decode attends over and appends to: verified pages ([`VerifiedKv`]), or plain memory
/// ([`MemoryKv`]) for the monolithic path.
pub trait KvCache: KvRead {
    /// The bytes of the `index`-th page, if it holds readable positions. Slots past
    /// [`KvRead::positions`] in the last page are not to be read.
    fn page(&self, index: usize) -> Option<&[u8]>;
    /// Writes the KV of the next position with `write(page_bytes, slot)` and makes it
    /// readable; returns the position. Fails when the reservation is full.
    fn append(&mut self, write: &mut dyn FnMut(&mut [u8], u32)) -> Result<u64, PoolError>;
}

impl KvCache for VerifiedKv {
    fn page(&self, index: usize) -> Option<&[u8]> {
        VerifiedKv::page(self, index)
    }

    fn append(&mut self, write: &mut dyn FnMut(&mut [u8], u32)) -> Result<u64, PoolError> {
        VerifiedKv::append(self, |page, slot| write(page, slot))
    }
}

/// One request's part of a batched decode step ([`ModelRunner::sample_batch`]): the
/// arguments of [`ModelRunner::sample`].
pub struct BatchStep<'a> {
    /// The reservation the request decodes in; `None` outside one (the monolithic path,
    /// benchmarks). Only a runner that hands KV to an engine ([`crate::engine`]) reads it.
    pub owner: Option<Owner>,
    pub kv: &'a mut dyn KvCache,
    pub input: u32,
    pub step: u32,
    pub prompt_len: u32,
    pub sampling: &'a Sampling,
}

impl std::fmt::Debug for BatchStep<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchStep")
            .field("owner", &self.owner)
            .field("input", &self.input)
            .field("step", &self.step)
            .field("prompt_len", &self.prompt_len)
            .finish_non_exhaustive()
    }
}

/// A model that prefills KV into pages and decodes from verified pages. The daemons only see
/// this trait: the reference model here, or a real one (the `llama` crate).
pub trait ModelRunner: Send + Sync + std::fmt::Debug {
    /// The page geometry this model writes and reads.
    fn geometry(&self) -> &PageGeometry;
    /// Token ids are below this.
    fn vocab(&self) -> u32;
    /// Writes the KV of every prompt token into the pages, zeroing unused slots of the last
    /// page so that no stale byte leaves the pool.
    fn prefill(&self, prompt: &[u32], pages: &mut dyn PageWrite) -> Result<(), ModelError> {
        self.prefill_chunked(prompt, pages, &mut |_| true).map(drop)
    }
    /// [`ModelRunner::prefill`] in chunks of whole pages: before each chunk after the first
    /// it asks `keep_going` (given the tokens written so far) and stops when it answers
    /// `false`, returning `Ok(false)`; the pages are then partly written and must not be
    /// handed out.
    fn prefill_chunked(
        &self,
        prompt: &[u32],
        pages: &mut dyn PageWrite,
        keep_going: &mut dyn FnMut(usize) -> bool,
    ) -> Result<bool, ModelError>;
    /// [`ModelRunner::prefill_chunked`] for the reservation `owner`: what prefilld calls. A
    /// runner whose KV comes from an engine ([`crate::engine`]) needs to know whose KV to
    /// write; a model that computes it ignores the owner.
    fn prefill_owned(
        &self,
        owner: Owner,
        prompt: &[u32],
        pages: &mut dyn PageWrite,
        keep_going: &mut dyn FnMut(usize) -> bool,
    ) -> Result<bool, ModelError> {
        let _ = owner;
        self.prefill_chunked(prompt, pages, keep_going)
    }
    /// Decode step `step` of a prompt of `prompt_len` tokens. `input` is the token at
    /// position `prompt_len - 1 + step`: the prompt's last token at step 0, then the token
    /// step `step - 1` emitted. The model appends to `kv` the KV it keeps and returns the
    /// token this step emits.
    fn step(
        &self,
        kv: &mut dyn KvCache,
        input: u32,
        step: u32,
        prompt_len: u32,
    ) -> Result<u32, ModelError>;
    /// [`ModelRunner::step`] picking the token as `sampling` says. A model without logits
    /// (the reference model) is deterministic and ignores it.
    fn sample(
        &self,
        kv: &mut dyn KvCache,
        input: u32,
        step: u32,
        prompt_len: u32,
        sampling: &Sampling,
    ) -> Result<u32, ModelError> {
        let _ = sampling;
        self.step(kv, input, step, prompt_len)
    }
    /// One decode step of every request of `batch` together: the result of each is exactly
    /// what [`ModelRunner::sample`] gives for that request alone, token for token. A model
    /// that can share work across requests (a real model reads each weight once per step for
    /// the whole batch) overrides it; the default steps them one by one. A failure is that
    /// request's alone.
    fn sample_batch(&self, batch: &mut [BatchStep<'_>]) -> Vec<Result<u32, ModelError>> {
        batch
            .iter_mut()
            .map(|b| self.sample(&mut *b.kv, b.input, b.step, b.prompt_len, b.sampling))
            .collect()
    }
    /// What the worker registers as its model: kvctld pairs only workers that agree on it.
    fn model_id(&self) -> String;
    /// Whether generation ends at `token` (end of turn, end of text). The stop token itself is
    /// not part of the output.
    fn is_stop(&self, token: u32) -> bool {
        let _ = token;
        false
    }
    /// A 64-bit signature over every readable position of `kv` (see [`kv_signature`]).
    fn signature(&self, kv: &dyn KvRead) -> u64 {
        kv_signature(self.geometry(), kv)
    }
}

/// KV pages in plain memory, with the layout of a pool's pages: what the monolithic path of
/// a real model prefills into and decodes from, with the same code as over a pool.
#[derive(Clone, Debug)]
pub struct MemoryKv {
    g: PageGeometry,
    pages: Vec<Vec<u8>>,
    tokens: u64,
    capacity: u64,
}

impl MemoryKv {
    /// Pages for `prompt` tokens and `max_new` more, all zero.
    pub fn new(g: PageGeometry, prompt: u64, max_new: u64) -> MemoryKv {
        let capacity = prompt + max_new;
        let n = usize::try_from(g.pages_for_tokens(capacity)).unwrap_or(0);
        let bytes = usize::try_from(g.bytes_per_page()).unwrap_or(0);
        MemoryKv {
            g,
            pages: vec![vec![0; bytes]; n],
            tokens: 0,
            capacity,
        }
    }

    /// Makes the first `tokens` positions readable, as verification does after a prefill.
    pub fn set_prefilled(&mut self, tokens: u64) {
        self.tokens = tokens.min(self.capacity);
    }
}

impl PageWrite for MemoryKv {
    fn page_count(&self) -> usize {
        self.pages.len()
    }

    fn page_mut(&mut self, index: usize) -> Result<&mut [u8], PoolError> {
        let pages = self.pages.len();
        self.pages
            .get_mut(index)
            .map(Vec::as_mut_slice)
            .ok_or(PoolError::OutOfGrant { index, pages })
    }
}

impl KvRead for MemoryKv {
    fn positions(&self) -> u64 {
        self.tokens
    }

    fn read(&self, layer: u32, kv: Kv, head: u32, pos: u64, out: &mut [f32]) -> bool {
        read_vector(
            &self.g,
            |i| KvCache::page(self, i),
            layer,
            kv,
            head,
            pos,
            out,
        )
    }
}

impl KvCache for MemoryKv {
    fn page(&self, index: usize) -> Option<&[u8]> {
        if index as u64 >= self.g.pages_for_tokens(self.tokens) {
            return None;
        }
        self.pages.get(index).map(Vec::as_slice)
    }

    fn append(&mut self, write: &mut dyn FnMut(&mut [u8], u32)) -> Result<u64, PoolError> {
        let pos = self.tokens;
        if pos >= self.capacity {
            return Err(PoolError::CapacityExhausted {
                capacity: self.capacity,
            });
        }
        let tpp = u64::from(self.g.tokens_per_page);
        let index = usize::try_from(pos / tpp).unwrap_or(usize::MAX);
        let slot = u32::try_from(pos % tpp).unwrap_or(0);
        let pages = self.pages.len();
        let page = self
            .pages
            .get_mut(index)
            .ok_or(PoolError::OutOfGrant { index, pages })?;
        write(page, slot);
        self.tokens += 1;
        Ok(pos)
    }
}

/// One head's K or V vector at `pos`, decoded to f32, from pages given by `page`.
fn read_vector<'a>(
    g: &PageGeometry,
    page: impl Fn(usize) -> Option<&'a [u8]>,
    layer: u32,
    kv: Kv,
    head: u32,
    pos: u64,
    out: &mut [f32],
) -> bool {
    let tpp = u64::from(g.tokens_per_page);
    let (Ok(index), Ok(slot)) = (usize::try_from(pos / tpp), u32::try_from(pos % tpp)) else {
        return false;
    };
    let Some(bytes) = page(index) else {
        return false;
    };
    let off = g.vector_offset(layer, kv, head, slot);
    let Some(v) = bytes.get(off..off + g.head_dim as usize * g.dtype.size()) else {
        return false;
    };
    for (o, b) in out.iter_mut().zip(v.chunks_exact(g.dtype.size())) {
        *o = g.dtype.decode(b);
    }
    true
}

/// The reference model for one page geometry.
#[derive(Clone, Copy, Debug)]
pub struct ReferenceModel {
    g: PageGeometry,
}

/// A small deterministic value in [-2, 2) with 1/8 steps, from a few integers.
fn mix(a: u64, b: u64, c: u64, d: u64) -> f32 {
    let mut x = a
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F))
        .wrapping_add(c.wrapping_mul(0x1656_67B1_9E37_79F9))
        .wrapping_add(d.wrapping_mul(0x27D4_EB2F_1656_67C5));
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    let v = u8::try_from(x & 0x1F).unwrap_or(0);
    (f32::from(v) - 16.0) / 8.0
}

impl ReferenceModel {
    pub fn new(g: PageGeometry) -> Result<Self, ModelError> {
        if g.head_dim < MIN_HEAD_DIM {
            return Err(ModelError::HeadDimTooSmall(g.head_dim));
        }
        Ok(Self { g })
    }

    pub fn geometry(&self) -> &PageGeometry {
        &self.g
    }

    /// The K or V vector of `token` at `pos`, exactly as stored (values are dtype-exact).
    pub fn vector(&self, layer: u32, kv: Kv, head: u32, token: u32, pos: u64, out: &mut [f32]) {
        let digits = POSITION_DIGITS.min(self.g.head_dim);
        let (l, h, t) = (u64::from(layer), u64::from(head), u64::from(token));
        for (d, o) in (0u32..).zip(out.iter_mut()) {
            let dd = u64::from(d);
            *o = match kv {
                Kv::K if d < digits => f32::from(u8::try_from((pos >> (4 * d)) & 0xF).unwrap_or(0)),
                Kv::K => mix(l, h, dd, t),
                Kv::V if d < 8 => f32::from(u8::try_from((t >> d) & 1).unwrap_or(0)),
                Kv::V => mix(l ^ 0x55, h, dd, t ^ (pos << 8)),
            };
        }
    }

    fn copy_head(&self, kv: &dyn KvRead, target: u64) -> Result<u32, ModelError> {
        let n = kv.positions();
        if n == 0 {
            return Err(ModelError::EmptyKv);
        }
        let hd = self.g.head_dim as usize;
        let digits = POSITION_DIGITS.min(self.g.head_dim) as usize;
        let mut q = vec![0f32; hd];
        for (d, o) in q.iter_mut().enumerate().take(digits) {
            *o = f32::from(u8::try_from((target >> (4 * d)) & 0xF).unwrap_or(0));
        }
        let mut k = vec![0f32; hd];
        let mut best = (f32::NEG_INFINITY, 0u64);
        for j in 0..n {
            if !kv.read(0, Kv::K, 0, j, &mut k) {
                return Err(ModelError::EmptyKv);
            }
            let score: f32 = -q[..digits]
                .iter()
                .zip(&k[..digits])
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f32>();
            // A NaN score can only come from bytes this model never wrote.
            if score.is_nan() {
                return Ok(GARBAGE);
            }
            if score > best.0 {
                best = (score, j);
            }
        }
        let mut v = vec![0f32; hd];
        kv.read(0, Kv::V, 0, best.1, &mut v);
        let mut byte = 0u32;
        for (bit, x) in v.iter().take(8).enumerate() {
            if *x > 0.5 {
                byte |= 1 << bit;
            }
        }
        // Values other than exact 0/1 in the bit lanes mean the page was not written by
        // this model for this position: mark the token as out of vocabulary.
        if v.iter().take(8).any(|x| *x != 0.0 && *x != 1.0) {
            byte |= GARBAGE;
        }
        Ok(byte)
    }
}

impl ReferenceModel {
    /// The token decode step `step` emits, attending over `kv`.
    pub fn next_token(
        &self,
        kv: &dyn KvRead,
        step: u32,
        prompt_len: u32,
    ) -> Result<u32, ModelError> {
        if prompt_len == 0 {
            return Err(ModelError::EmptyKv);
        }
        self.copy_head(kv, u64::from(step % prompt_len))
    }

    /// Writes the KV of `token` at position `pos` into slot `slot` of `page`.
    pub fn write_token(&self, page: &mut [u8], slot: u32, token: u32, pos: u64) {
        let g = self.g;
        let sz = g.dtype.size();
        let mut v = vec![0f32; g.head_dim as usize];
        for layer in 0..g.layers {
            for kv in [Kv::K, Kv::V] {
                for head in 0..g.kv_heads {
                    self.vector(layer, kv, head, token, pos, &mut v);
                    let off = g.vector_offset(layer, kv, head, slot);
                    for (i, x) in v.iter().enumerate() {
                        g.dtype.encode(*x, &mut page[off + i * sz..]);
                    }
                }
            }
        }
    }
}

impl ModelRunner for ReferenceModel {
    fn geometry(&self) -> &PageGeometry {
        &self.g
    }

    fn vocab(&self) -> u32 {
        256
    }

    fn model_id(&self) -> String {
        REFERENCE_MODEL.to_owned()
    }

    fn prefill_chunked(
        &self,
        prompt: &[u32],
        pages: &mut dyn PageWrite,
        keep_going: &mut dyn FnMut(usize) -> bool,
    ) -> Result<bool, ModelError> {
        let tpp = u64::from(self.g.tokens_per_page);
        let count = pages.page_count();
        if let Some(last) = count.checked_sub(1) {
            pages.page_mut(last).map_err(ModelError::Pool)?.fill(0);
        }
        for (pos, &tok) in (0u64..).zip(prompt) {
            if tok > 0xFF {
                return Err(ModelError::BadToken(tok));
            }
            let slot = u32::try_from(pos % tpp).unwrap_or(0);
            if pos > 0 && slot == 0 && !keep_going(usize::try_from(pos).unwrap_or(usize::MAX)) {
                return Ok(false);
            }
            let index = usize::try_from(pos / tpp).unwrap_or(usize::MAX);
            let page = pages.page_mut(index).map_err(ModelError::Pool)?;
            self.write_token(page, slot, tok, pos);
        }
        Ok(true)
    }

    fn step(
        &self,
        kv: &mut dyn KvCache,
        _input: u32,
        step: u32,
        prompt_len: u32,
    ) -> Result<u32, ModelError> {
        // The copy head reads the KV only; the emitted token's KV is appended at once.
        let t = self.next_token(kv, step, prompt_len)?;
        let pos = kv.positions();
        kv.append(&mut |page, slot| self.write_token(page, slot, t, pos))
            .map_err(ModelError::Pool)?;
        Ok(t)
    }
}

/// The mean head's signature over every readable position of `kv`: per layer, K/V and head,
/// the exact sum of each lane over all positions and the position count, folded into 64 bits
/// with crc32c. Any change of any value read changes it.
pub fn kv_signature(g: &PageGeometry, kv: &dyn KvRead) -> u64 {
    let g = *g;
    let hd = g.head_dim as usize;
    let mut v = vec![0f32; hd];
    let mut sums: Vec<ExactSum> = vec![ExactSum::default(); hd];
    let mut sig = 0u64;
    for layer in 0..g.layers {
        for kvk in [Kv::K, Kv::V] {
            for head in 0..g.kv_heads {
                sums.iter_mut().for_each(|s| *s = ExactSum::default());
                for pos in 0..kv.positions() {
                    kv.read(layer, kvk, head, pos, &mut v);
                    for (s, x) in sums.iter_mut().zip(&v) {
                        s.add(*x);
                    }
                }
                // The mean is the exact sum over the position count, which is the same
                // for every lane: hashing the exact sums and the count fixes it.
                let mut bytes = kv.positions().to_le_bytes().to_vec();
                for s in &sums {
                    s.append_bytes(&mut bytes);
                }
                let lo =
                    crc32c::crc32c_append(u32::try_from(sig & 0xFFFF_FFFF).unwrap_or(0), &bytes);
                let hi = crc32c::crc32c_append(
                    u32::try_from(sig >> 32).unwrap_or(0) ^ 0x5A5A_5A5A,
                    &bytes,
                );
                sig = (u64::from(hi) << 32) | u64::from(lo);
            }
        }
    }
    sig
}

/// An exact sum of f32 values: every finite f32 is an integer multiple of 2^-149 below
/// 2^128, so a 384-bit fixed-point accumulator per sign holds any sum of up to 2^100 values
/// without rounding. Unlike a float sum, no addend is ever absorbed, so a change of any value
/// (even a denormal one) changes the sum. Negative zeros and non-finite values, which an
/// arithmetic sum cannot see, are counted apart.
#[derive(Clone, Debug, Default)]
struct ExactSum {
    pos: [u64; 6],
    neg: [u64; 6],
    neg_zero: u64,
    non_finite: u64,
}

impl ExactSum {
    fn add(&mut self, x: f32) {
        let bits = x.to_bits();
        let exp = (bits >> 23) & 0xFF;
        let frac = u64::from(bits & 0x7F_FFFF);
        if exp == 0xFF {
            self.non_finite = self.non_finite.wrapping_add(u64::from(bits) | 1);
            return;
        }
        if bits == 0x8000_0000 {
            self.neg_zero += 1;
            return;
        }
        let (m, shift) = if exp == 0 {
            (frac, 0)
        } else {
            (frac | 0x80_0000, exp - 1)
        };
        let acc = if bits >> 31 == 1 {
            &mut self.neg
        } else {
            &mut self.pos
        };
        let (limb, bit) = ((shift / 64) as usize, shift % 64);
        let mut carry = u128::from(m) << bit;
        for a in acc.iter_mut().skip(limb) {
            if carry == 0 {
                break;
            }
            let s = u128::from(*a) + (carry & u128::from(u64::MAX));
            *a = u64::try_from(s & u128::from(u64::MAX)).unwrap_or(0);
            carry = (carry >> 64) + (s >> 64);
        }
    }

    fn append_bytes(&self, out: &mut Vec<u8>) {
        for w in self
            .pos
            .iter()
            .chain(&self.neg)
            .chain([&self.neg_zero, &self.non_finite])
        {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
}

/// Positions and tokens known without pages: the monolithic path's KV.
#[derive(Debug)]
struct ComputedKv<'a> {
    model: &'a ReferenceModel,
    tokens: Vec<u32>,
}

impl KvRead for ComputedKv<'_> {
    fn positions(&self) -> u64 {
        self.tokens.len() as u64
    }

    fn read(&self, layer: u32, kv: Kv, head: u32, pos: u64, out: &mut [f32]) -> bool {
        let Some(&tok) = usize::try_from(pos).ok().and_then(|p| self.tokens.get(p)) else {
            return false;
        };
        self.model.vector(layer, kv, head, tok, pos, out);
        true
    }
}

/// The expected output of a request: the same math with no pools, no transfer, no daemons.
pub fn monolithic(
    model: &ReferenceModel,
    prompt: &[u32],
    max_new: u32,
) -> Result<Output, ModelError> {
    let prompt_len = u32::try_from(prompt.len()).map_err(|_| ModelError::EmptyKv)?;
    let mut kv = ComputedKv {
        model,
        tokens: prompt.to_vec(),
    };
    let mut out = Vec::with_capacity(max_new as usize);
    for step in 0..max_new {
        let t = model.next_token(&kv, step, prompt_len)?;
        out.push(t);
        kv.tokens.push(t);
    }
    Ok(Output {
        signature: model.signature(&kv),
        tokens: out,
    })
}

/// Decodes up to `max_new` tokens from verified KV, appending KV as the model keeps it, and
/// calls `on_token` for each. `last_token` is the prompt's last token. Returns the output
/// with the signature over all positions.
pub fn decode(
    model: &dyn ModelRunner,
    kv: &mut dyn KvCache,
    prompt_len: u32,
    last_token: u32,
    max_new: u32,
    mut on_token: impl FnMut(u32, u32),
) -> Result<Output, ModelError> {
    let greedy = Sampling::GREEDY;
    decode_with(
        model,
        kv,
        prompt_len,
        last_token,
        max_new,
        &greedy,
        |step, t| {
            on_token(step, t);
            Ok::<(), ModelError>(())
        },
    )
}

/// Like [`decode`], but `after_token(step, token)` may stop the decode between steps with
/// its own error (a cancelled request, a passed deadline): the one decode loop every caller
/// shares. Each token is picked as `sampling` says. Generation ends early at a token the
/// model stops at, which is not emitted.
pub fn decode_with<E: From<ModelError>>(
    model: &dyn ModelRunner,
    kv: &mut dyn KvCache,
    prompt_len: u32,
    last_token: u32,
    max_new: u32,
    sampling: &Sampling,
    mut after_token: impl FnMut(u32, u32) -> Result<(), E>,
) -> Result<Output, E> {
    let mut out = Vec::with_capacity(max_new as usize);
    let mut input = last_token;
    for step in 0..max_new {
        let t = model.sample(kv, input, step, prompt_len, sampling)?;
        if model.is_stop(t) {
            break;
        }
        out.push(t);
        after_token(step, t)?;
        input = t;
    }
    Ok(Output {
        signature: model.signature(kv),
        tokens: out,
    })
}

/// The monolithic path of any model: the same prefill and decode code over pages in plain
/// memory, with no pool, transfer or daemon. For a real model this is the expected output of
/// a disaggregated request; the reference model also has [`monolithic`], computed without
/// pages at all.
pub fn monolithic_paged(
    model: &dyn ModelRunner,
    prompt: &[u32],
    max_new: u32,
    sampling: &Sampling,
) -> Result<Output, ModelError> {
    let (Some(&last), Ok(len)) = (prompt.last(), u32::try_from(prompt.len())) else {
        return Err(ModelError::EmptyKv);
    };
    let mut kv = MemoryKv::new(*model.geometry(), u64::from(len), u64::from(max_new));
    model.prefill(prompt, &mut kv)?;
    kv.set_prefilled(u64::from(len));
    decode_with(model, &mut kv, len, last, max_new, sampling, |_, _| {
        Ok::<(), ModelError>(())
    })
}

/// Bytes to tokens.
pub fn tokenize(text: &[u8]) -> Vec<u32> {
    text.iter().map(|&b| u32::from(b)).collect()
}

/// Tokens to bytes; tokens outside the byte range render as U+FFFD.
pub fn detokenize(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens
        .iter()
        .map(|&t| u8::try_from(t).unwrap_or(b'?'))
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
