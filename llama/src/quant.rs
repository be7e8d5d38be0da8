//! Decode's weight matrices as the model file stores them (Q4_1, Q8_0) and the product of
//! one matrix with several vectors at once, for a batched decode step.
//!
//! Every decode step reads every weight. Read as f32, SmolLM2-135M's weights are 540 MB a
//! token; as the file's Q4_1 and Q8_0 blocks they are 98 MB. A [`QuantMatrix`] keeps the
//! blocks, interleaved for the integer kernels of [`crate::int8`], which quantize each
//! vector to 8 bits a value and multiply a strip of 16 rows by up to 16 vectors at once, so
//! a step reads each weight once from memory whatever the batch size.
//!
//! # Exactness
//!
//! A product's only rounding is in its f32 end (see [`crate::int8`]): a row times a
//! vector is the same bits from every kernel and in any batch, so a request decodes to the
//! same tokens alone or batched. Against the f32 weights the prefill's sgemm multiplies it
//! differs by the vectors' quantization, as llama.cpp's products of the same blocks do.
//! f32 matrices (a model file of f32 weights, or [`crate::runner::LlamaRunner`] with
//! quantized decode off) are multiplied here with the decode kernel's own dot product
//! (`math::dot_row`), bit for bit, for one vector or many.

use std::ops::Range;

use crate::gguf::GgmlType;
use crate::int8;
use crate::math;

/// The block types kept quantized; their blocks are 32 weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantKind {
    /// f16 `d`, f16 `m`, 16 bytes of nibbles: `nibble * d + m`.
    Q4_1,
    /// f16 `d`, 32 × i8: `q * d`.
    Q8_0,
}

/// Weights per block.
const BLOCK: usize = 32;

impl QuantKind {
    /// The kind of a ggml type kept quantized, `None` for the others.
    pub fn of(ggml_type: GgmlType) -> Option<QuantKind> {
        match ggml_type {
            GgmlType::Q4_1 => Some(QuantKind::Q4_1),
            GgmlType::Q8_0 => Some(QuantKind::Q8_0),
            _ => None,
        }
    }

    /// The ggml type whose blocks these are.
    pub fn ggml_type(self) -> GgmlType {
        match self {
            QuantKind::Q4_1 => GgmlType::Q4_1,
            QuantKind::Q8_0 => GgmlType::Q8_0,
        }
    }

    /// Bytes per block of 32 weights.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantKind::Q4_1 => 20,
            QuantKind::Q8_0 => 34,
        }
    }
}

/// Rows a [`QuantMatrix`] interleaves: a strip of 16 rows, block by block, is what the
/// integer kernels multiply at once ([`crate::int8`]).
pub(crate) const STRIP: usize = 16;

/// A row-major `[rows][cols]` matrix of quantized blocks, rows a whole number of blocks,
/// kept in the order the integer kernels read ([`crate::int8`]): strip after strip of
/// [`STRIP`] rows (the last padded with zero rows), and in a strip block after block.
///
/// A strip's block is [`QuantKind::chunks`] chunks of 64 bytes, chunk `j` holding four
/// bytes of each of the 16 rows (row `k` at byte `4 k`): for Q4_1, bytes `4 j..4 j + 4` of
/// the block's 16 bytes of nibbles (low nibbles are weights `4 j..`, high ones `16 + 4 j..`);
/// for Q8_0, weights `4 j..4 j + 4`, each plus 128 (as `u8`). So one 512-bit register holds
/// four consecutive weights of all 16 rows, the operand of a `VPDPBUSD` against four bytes
/// of a vector broadcast. The scales are f32 (widened exactly from the file's f16), per
/// strip and block the 16 rows' `d`, then their `m` (Q4_1; zeros for Q8_0).
#[derive(Clone, PartialEq)]
pub struct QuantMatrix {
    kind: QuantKind,
    rows: usize,
    cols: usize,
    packed: Vec<u8>,
    scales: Vec<f32>,
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantMatrix")
            .field("kind", &self.kind)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish_non_exhaustive()
    }
}

impl QuantKind {
    /// 64-byte chunks of one block of a strip (see [`QuantMatrix`]).
    pub(crate) fn chunks(self) -> usize {
        match self {
            QuantKind::Q4_1 => 4,
            QuantKind::Q8_0 => 8,
        }
    }
}

impl QuantMatrix {
    /// `rows` rows of `cols` weights from the file's blocks; `None` unless `cols` is a whole
    /// number of blocks and `bytes` holds exactly the matrix.
    pub fn new(kind: QuantKind, rows: usize, cols: usize, bytes: Vec<u8>) -> Option<QuantMatrix> {
        let row_bytes =
            (cols.is_multiple_of(BLOCK) && cols > 0).then(|| cols / BLOCK * kind.block_bytes())?;
        if rows.checked_mul(row_bytes)? != bytes.len() {
            return None;
        }
        let mut m = QuantMatrix::zeros(kind, rows, cols);
        let f16 = |b: &[u8]| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
        for r in 0..rows {
            for (b, blk) in bytes[r * row_bytes..(r + 1) * row_bytes]
                .chunks_exact(kind.block_bytes())
                .enumerate()
            {
                let (data, m_) = match kind {
                    QuantKind::Q4_1 => (&blk[4..], f16(&blk[2..])),
                    QuantKind::Q8_0 => (&blk[2..], 0.0),
                };
                let flip = if kind == QuantKind::Q8_0 { 0x80 } else { 0 };
                for (j, four) in data.chunks_exact(4).enumerate() {
                    let at = m.lane(r, b, j);
                    for (dst, src) in m.packed[at..at + 4].iter_mut().zip(four) {
                        *dst = src ^ flip;
                    }
                }
                let (d_at, m_at) = m.scale_at(r, b);
                m.scales[d_at] = f16(blk);
                m.scales[m_at] = m_;
            }
        }
        Some(m)
    }

    /// A matrix of zeros, padded to whole strips.
    fn zeros(kind: QuantKind, rows: usize, cols: usize) -> QuantMatrix {
        let strip_blocks = rows.div_ceil(STRIP) * (cols / BLOCK);
        QuantMatrix {
            kind,
            rows,
            cols,
            packed: vec![0; strip_blocks * kind.chunks() * 64],
            scales: vec![0.0; strip_blocks * 2 * STRIP],
        }
    }

    pub fn kind(&self) -> QuantKind {
        self.kind
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Blocks a row.
    pub(crate) fn blocks(&self) -> usize {
        self.cols / BLOCK
    }

    /// Every strip's blocks, strip after strip ([`Self::strip_block`] each).
    pub(crate) fn packed(&self) -> &[u8] {
        &self.packed
    }

    /// Every strip's blocks' scales, in the order of [`Self::packed`]
    /// ([`Self::strip_scales`] each).
    pub(crate) fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// Strip `s`'s block `b`: [`QuantKind::chunks`] chunks of 64 bytes.
    pub(crate) fn strip_block(&self, s: usize, b: usize) -> &[u8] {
        let len = self.kind.chunks() * 64;
        let at = (s * self.blocks() + b) * len;
        &self.packed[at..at + len]
    }

    /// Strip `s`'s block `b`'s scales: the 16 rows' `d`, then their `m`.
    pub(crate) fn strip_scales(&self, s: usize, b: usize) -> &[f32] {
        let at = (s * self.blocks() + b) * 2 * STRIP;
        &self.scales[at..at + 2 * STRIP]
    }

    /// Where row `r`'s four bytes of chunk `j` of block `b` are in `packed`.
    fn lane(&self, r: usize, b: usize, j: usize) -> usize {
        let (s, k) = (r / STRIP, r % STRIP);
        ((s * self.blocks() + b) * self.kind.chunks() + j) * 64 + 4 * k
    }

    /// Where row `r`'s `d` and `m` of block `b` are in `scales`.
    fn scale_at(&self, r: usize, b: usize) -> (usize, usize) {
        let (s, k) = (r / STRIP, r % STRIP);
        let at = (s * self.blocks() + b) * 2 * STRIP + k;
        (at, at + STRIP)
    }

    /// Row `r`'s block `b` as integers (Q4_1's nibbles, Q8_0's signed bytes), its `d` and
    /// its `m`: what the weights are `q d + m` of.
    pub(crate) fn block(&self, r: usize, b: usize) -> ([i32; BLOCK], f32, f32) {
        let mut q = [0i32; BLOCK];
        for j in 0..self.kind.chunks() {
            let at = self.lane(r, b, j);
            for (t, &byte) in self.packed[at..at + 4].iter().enumerate() {
                match self.kind {
                    QuantKind::Q4_1 => {
                        q[4 * j + t] = i32::from(byte & 0x0F);
                        q[16 + 4 * j + t] = i32::from(byte >> 4);
                    }
                    QuantKind::Q8_0 => q[4 * j + t] = i32::from((byte ^ 0x80).cast_signed()),
                }
            }
        }
        let (d_at, m_at) = self.scale_at(r, b);
        (q, self.scales[d_at], self.scales[m_at])
    }

    /// The same matrix with its rows reordered: row `i` of the result is row `from[i]`.
    pub fn permute_rows(&self, from: impl Fn(usize) -> usize) -> QuantMatrix {
        let mut out = QuantMatrix::zeros(self.kind, self.rows, self.cols);
        for i in 0..self.rows {
            let r = from(i);
            for b in 0..self.blocks() {
                for j in 0..self.kind.chunks() {
                    let (to, at) = (out.lane(i, b, j), self.lane(r, b, j));
                    out.packed[to..to + 4].copy_from_slice(&self.packed[at..at + 4]);
                }
                let ((td, tm), (fd, fm)) = (out.scale_at(i, b), self.scale_at(r, b));
                out.scales[td] = self.scales[fd];
                out.scales[tm] = self.scales[fm];
            }
        }
        out
    }

    /// Row `r` dequantized into `out` (`cols` long): `q d + m`, as
    /// [`crate::gguf::dequantize_into`] computes it.
    #[cfg(test)]
    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        for b in 0..self.blocks() {
            let (q, d, m) = self.block(r, b);
            for (o, q) in out[b * BLOCK..(b + 1) * BLOCK].iter_mut().zip(q) {
                #[allow(clippy::cast_precision_loss)]
                let w = q as f32 * d;
                *o = if self.kind == QuantKind::Q4_1 {
                    w + m
                } else {
                    w
                };
            }
        }
    }
}

/// A decode weight matrix: f32 (as loaded) or the file's quantized blocks.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Mat<'a> {
    /// Row-major f32 with `cols` columns.
    F32 {
        w: &'a [f32],
        cols: usize,
    },
    Quant(&'a QuantMatrix),
}

impl Mat<'_> {
    pub(crate) fn rows(&self) -> usize {
        match self {
            Mat::F32 { w, cols } => w.len() / (*cols).max(1),
            Mat::Quant(q) => q.rows,
        }
    }

    fn cols(&self) -> usize {
        match self {
            Mat::F32 { cols, .. } => *cols,
            Mat::Quant(q) => q.cols,
        }
    }
}

/// The vectors a product multiplies: as given, for f32 matrices, and quantized the first
/// time a quantized matrix takes them ([`int8::Vectors`]), once for every product of them.
#[derive(Debug)]
pub(crate) struct Inputs<'a> {
    xs: Vec<&'a [f32]>,
    quantized: std::cell::OnceCell<int8::Vectors>,
}

impl<'a> Inputs<'a> {
    pub(crate) fn new(xs: Vec<&'a [f32]>) -> Inputs<'a> {
        Inputs {
            xs,
            quantized: std::cell::OnceCell::new(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.xs.len()
    }

    fn quantized(&self) -> &int8::Vectors {
        self.quantized
            .get_or_init(|| int8::Vectors::quantize(&self.xs))
    }
}

/// Rows `rows` of `M x_b` for every vector `x_b` of `xs` (each `cols` long) into `out`,
/// vector-major: `out[b * rows.len() + i]` is row `rows.start + i` of `M x_b`. Each output
/// is the same bits as for that row and vector alone (see the module docs).
///
/// # Panics
///
/// If a vector is not `cols` long, a row is out of range, or `out` is not
/// `xs.len() * rows.len()` long (bugs in the caller: shapes are validated at load).
#[cfg(test)]
pub(crate) fn matvec_multi(m: Mat<'_>, xs: &[&[f32]], rows: Range<usize>, out: &mut [f32]) {
    matvec_multi_stacked(&[m], &Inputs::new(xs.to_vec()), rows, out);
}

/// [`matvec_multi`] of the matrices `ms` stacked (`[M_0; M_1; ...]`, rows counted across
/// them), rows `rows` of it.
pub(crate) fn matvec_multi_stacked(
    ms: &[Mat<'_>],
    xs: &Inputs<'_>,
    rows: Range<usize>,
    out: &mut [f32],
) {
    assert_eq!(
        out.len(),
        xs.len() * rows.len(),
        "matvec_multi: output length"
    );
    let stride = rows.len();
    let mut base = 0;
    for m in ms {
        let n = m.rows();
        let (lo, hi) = (rows.start.max(base), rows.end.min(base + n));
        if lo < hi {
            let (out, rows) = (&mut out[lo - rows.start..], lo - base..hi - base);
            assert!(
                xs.xs.iter().all(|x| x.len() == m.cols()),
                "matvec_multi: vector length"
            );
            match *m {
                Mat::Quant(q) => int8::matvec(q, xs.quantized(), rows, out, stride),
                Mat::F32 { w, cols } => matvec_f32(w, cols, &xs.xs, rows, out, stride),
            }
        }
        base += n;
    }
}

/// Row `rows.start + i` of `W x_b` into `out[b * stride + i]`, `W` f32 with `cols`
/// columns.
fn matvec_f32(
    w: &[f32],
    cols: usize,
    xs: &[&[f32]],
    rows: Range<usize>,
    out: &mut [f32],
    stride: usize,
) {
    assert!(
        rows.end * cols <= w.len(),
        "matvec_multi: rows out of range"
    );
    if rows.is_empty() || xs.is_empty() {
        return;
    }
    assert!(
        out.len() >= (xs.len() - 1) * stride + rows.len(),
        "matvec_multi: output too short"
    );
    #[cfg(target_arch = "x86_64")]
    if math::has_avx2_fma() {
        if has_avx512vl() {
            // SAFETY: the CPU has AVX2, FMA, AVX-512F and AVX-512VL (checked at run time
            // just above), the only requirement of calling a function compiled with those
            // features.
            unsafe { matvec_avx512(w, cols, xs, rows, out, stride) };
        } else {
            // SAFETY: the CPU has AVX2 and FMA (checked at run time just above).
            unsafe { matvec_avx2(w, cols, xs, rows, out, stride) };
        }
        return;
    }
    matvec_body::<false, false>(w, cols, xs, rows, out, stride);
}

/// Whether the CPU has AVX-512F and AVX-512VL: then the 256-bit kernels may use 32
/// registers (the arithmetic, and so every result, is that of the AVX2 kernels).
#[inline]
fn has_avx512vl() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn matvec_avx2(
    w: &[f32],
    cols: usize,
    xs: &[&[f32]],
    rows: Range<usize>,
    out: &mut [f32],
    stride: usize,
) {
    matvec_body::<true, false>(w, cols, xs, rows, out, stride);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
fn matvec_avx512(
    w: &[f32],
    cols: usize,
    xs: &[&[f32]],
    rows: Range<usize>,
    out: &mut [f32],
    stride: usize,
) {
    matvec_body::<true, true>(w, cols, xs, rows, out, stride);
}

/// `matvec_f32`'s work. `SIMD` only inside [`matvec_avx2`] and [`matvec_avx512`],
/// `WIDE_REGS` (32 registers: two rows at once) only inside the latter. Each weight loaded
/// serves two vectors (and, with 32 registers, two or four rows).
#[inline(always)]
fn matvec_body<const SIMD: bool, const WIDE_REGS: bool>(
    w: &[f32],
    cols: usize,
    xs: &[&[f32]],
    rows: Range<usize>,
    out: &mut [f32],
    stride: usize,
) {
    let row = |r: usize| &w[r * cols..(r + 1) * cols];
    let many = SIMD && WIDE_REGS && cols >= WIDE && xs.len() > 1;
    let four = many && cols.is_multiple_of(32);
    // Four rows at a time take the vectors in pairs, each pair interleaved once here for
    // all the rows (see `dots4`).
    let pairs = if four {
        interleave_pairs(xs)
    } else {
        Vec::new()
    };
    let (start, end) = (rows.start, rows.end);
    let mut r = start;
    while r < end {
        let i = r - start;
        if four && r + 3 < end {
            let rs = [row(r), row(r + 1), row(r + 2), row(r + 3)];
            dots4::<SIMD, WIDE_REGS>(rs, &pairs, xs.len(), &mut out[i..], stride);
            r += 4;
        } else if many && r + 1 < end {
            dots2::<SIMD, WIDE_REGS>(row(r), row(r + 1), xs, &mut out[i..], stride);
            r += 2;
        } else {
            dots::<SIMD>(row(r), xs, &mut out[i..], stride);
            r += 1;
        }
    }
}

/// The row width from which the four-accumulator kernels apply: [`math::dot_row`]'s.
const WIDE: usize = 256;

/// `out[b * stride] = row · xs[b]` for every `b`, each summed as [`math::dot_row`] sums it.
#[inline(always)]
fn dots<const SIMD: bool>(row: &[f32], xs: &[&[f32]], out: &mut [f32], stride: usize) {
    #[cfg(target_arch = "x86_64")]
    if SIMD && row.len() >= simd::WIDE {
        let mut pairs = xs.chunks_exact(2);
        let mut at = 0;
        for pair in pairs.by_ref() {
            // SAFETY: SIMD is set only in functions compiled for AVX2 and FMA, called once
            // the CPU is known to have them; the vectors are as long as the row (checked by
            // `matvec_strided`).
            let (a, b) = unsafe { simd::dot2(row, pair[0], pair[1]) };
            out[at] = a;
            out[at + stride] = b;
            at += 2 * stride;
        }
        if let [x] = pairs.remainder() {
            // SAFETY: as above.
            out[at] = unsafe { simd::dot2(row, x, x) }.0;
        }
        return;
    }
    for (b, x) in xs.iter().enumerate() {
        out[b * stride] = math::dot_row::<SIMD>(row, x);
    }
}

/// The vectors two by two, each pair in one buffer of eight-value chunks, `a`'s chunk then
/// `b`'s (`[a0..a8, b0..b8, a8..a16, b8..b16, ...]`), so that one 512-bit load holds the
/// same eight columns of both; an odd last vector is paired with itself.
fn interleave_pairs(xs: &[&[f32]]) -> Vec<Vec<f32>> {
    xs.chunks(2)
        .map(|pair| {
            let (a, b) = (pair[0], pair[pair.len() - 1]);
            let mut out = Vec::with_capacity(2 * a.len());
            for (ca, cb) in a.chunks(8).zip(b.chunks(8)) {
                out.extend_from_slice(ca);
                out.extend_from_slice(cb);
            }
            out
        })
        .collect()
}

/// [`dots`] of four rows against `n` vectors, given as [`interleave_pairs`]:
/// `out[b * stride + k]` from `r[k]`. Only where `WIDE_REGS`, on rows of whole 32-value
/// blocks; up to four pairs (eight vectors) share each load of the rows.
#[inline(always)]
fn dots4<const SIMD: bool, const WIDE_REGS: bool>(
    r: [&[f32]; 4],
    pairs: &[Vec<f32>],
    n: usize,
    out: &mut [f32],
    stride: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if SIMD && WIDE_REGS {
        let mut first = 0;
        for group in pairs.chunks(4) {
            // SAFETY: WIDE_REGS is set only in `matvec_avx512`, compiled for AVX-512F/VL
            // and called once the CPU is known to have them; every row is the same whole
            // number of blocks long and every pair twice that (`matvec_strided`,
            // `matvec_body`, `interleave_pairs`).
            unsafe {
                match group {
                    [p0] => dots4_group([p0], r, first, n, out, stride),
                    [p0, p1] => dots4_group([p0, p1], r, first, n, out, stride),
                    [p0, p1, p2] => dots4_group([p0, p1, p2], r, first, n, out, stride),
                    [p0, p1, p2, p3] => dots4_group([p0, p1, p2, p3], r, first, n, out, stride),
                    _ => unreachable!("chunks of one to four"),
                }
            }
            first += 2 * group.len();
        }
        return;
    }
    let _ = (pairs, n, r, out, stride);
    unreachable!("four rows at a time only with 32 registers");
}

/// [`dots4`] for the `P` pairs `group`, whose first vector is vector `first` of `n`.
///
/// # Safety
///
/// As [`simd::dots4xp`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dots4_group<const P: usize>(
    group: [&Vec<f32>; P],
    r: [&[f32]; 4],
    first: usize,
    n: usize,
    out: &mut [f32],
    stride: usize,
) {
    // SAFETY: the caller's promise.
    let d = unsafe { simd::dots4xp(group.map(Vec::as_slice), r) };
    for (p, rows) in d.iter().enumerate() {
        for half in 0..2 {
            let b = first + 2 * p + half;
            if b < n {
                for (k, v) in rows.iter().enumerate() {
                    out[b * stride + k] = v[half];
                }
            }
        }
    }
}

/// [`dots`] of two rows: `out[b * stride]` from `r0`, `out[b * stride + 1]` from `r1`.
#[inline(always)]
fn dots2<const SIMD: bool, const WIDE_REGS: bool>(
    r0: &[f32],
    r1: &[f32],
    xs: &[&[f32]],
    out: &mut [f32],
    stride: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if SIMD && WIDE_REGS && r0.len() >= simd::WIDE {
        let mut pairs = xs.chunks_exact(2);
        let mut at = 0;
        for pair in pairs.by_ref() {
            // SAFETY: WIDE_REGS is set only in `matvec_avx512`, compiled for AVX-512F/VL
            // and called once the CPU is known to have them; lengths as in `dots`.
            let [a0, a1, b0, b1] = unsafe { simd::dot2x2(r0, r1, pair[0], pair[1]) };
            out[at] = a0;
            out[at + 1] = a1;
            out[at + stride] = b0;
            out[at + stride + 1] = b1;
            at += 2 * stride;
        }
        if let [x] = pairs.remainder() {
            // SAFETY: as above.
            let [a0, a1, ..] = unsafe { simd::dot2x2(r0, r1, x, x) };
            out[at] = a0;
            out[at + 1] = a1;
        }
        return;
    }
    dots::<SIMD>(r0, xs, out, stride);
    dots::<SIMD>(r1, xs, &mut out[1..], stride);
}

/// The block dequantizers for AVX2 with F16C: the same values as the scalar ones (an exact
/// widening of the scales and the integers, then one rounded product and one rounded sum);
/// and the dot product of a wide row with two vectors at once, each summed exactly as
/// [`math::dot_row`] sums a row of [`WIDE`] or more columns (four accumulators of eight
/// lanes, fused multiply-adds, the same tree at the end).
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// The narrowest row [`dot2`] takes.
    pub(super) use super::WIDE;

    /// `[r0 · a, r1 · a, r0 · b, r1 · b]`, each as [`dot2`] sums it: 16 accumulators, for
    /// the 32 registers of AVX-512VL.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2, FMA and AVX-512VL; `r1`, `a` and `b` are at least as long as `r0`.
    #[inline(always)]
    pub(super) unsafe fn dot2x2(r0: &[f32], r1: &[f32], a: &[f32], b: &[f32]) -> [f32; 4] {
        let n = r0.len();
        debug_assert!(r1.len() >= n && a.len() >= n && b.len() >= n);
        if !n.is_multiple_of(32) {
            // SAFETY: the caller's promise covers `dot2`'s.
            let (x, y) = unsafe { (dot2(r0, a, b), dot2(r1, a, b)) };
            return [x.0, y.0, x.1, y.1];
        }
        let (w0, w1, pa, pb) = (r0.as_ptr(), r1.as_ptr(), a.as_ptr(), b.as_ptr());
        // SAFETY: every load reads below `n` from the four slices (lengths above); the
        // features are the caller's promise.
        unsafe {
            let z = _mm256_setzero_ps();
            let (mut a0, mut a1, mut b0, mut b1) = ([z; 4], [z; 4], [z; 4], [z; 4]);
            let mut j = 0;
            while j < n {
                for k in 0..4 {
                    let (u, v) = (
                        _mm256_loadu_ps(w0.add(j + 8 * k)),
                        _mm256_loadu_ps(w1.add(j + 8 * k)),
                    );
                    let xa = _mm256_loadu_ps(pa.add(j + 8 * k));
                    a0[k] = _mm256_fmadd_ps(u, xa, a0[k]);
                    a1[k] = _mm256_fmadd_ps(v, xa, a1[k]);
                    let xb = _mm256_loadu_ps(pb.add(j + 8 * k));
                    b0[k] = _mm256_fmadd_ps(u, xb, b0[k]);
                    b1[k] = _mm256_fmadd_ps(v, xb, b1[k]);
                }
                j += 32;
            }
            [reduce(a0), reduce(a1), reduce(b0), reduce(b1)]
        }
    }

    /// `[[[r[k] · a_p, r[k] · b_p]; 4]; P]` for the `P` interleaved pairs `(a_p, b_p)` of
    /// `pairs` (`super::interleave_pairs`), each summed as [`dot2`] sums it. A 512-bit
    /// register holds the eight lanes of one accumulator of `r[k] · a_p` in its low half and
    /// those of `r[k] · b_p` in its high half, so one 512-bit multiply-add does the work of
    /// two 256-bit ones, lane by lane the same arithmetic. [`dot2`]'s four accumulators are
    /// independent chains (columns `32 j + 8 c ..`, chain `c`), so they are run one after the
    /// other: `4 P` registers accumulate at a time, and each load of a row's eight values
    /// serves `P` multiply-adds.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F; every row is `r[0].len()` long, a multiple of 32, and every
    /// pair twice that.
    /// Columns [`dots4xp`] takes at a time, a multiple of 32: four rows and four pairs of
    /// them are 24 KiB.
    const TILE: usize = 256;

    #[inline(always)]
    pub(super) unsafe fn dots4xp<const P: usize>(
        pairs: [&[f32]; P],
        r: [&[f32]; 4],
    ) -> [[[f32; 2]; 4]; P] {
        let n = r[0].len();
        debug_assert!(n.is_multiple_of(32) && r.iter().all(|r| r.len() >= n));
        debug_assert!(pairs.iter().all(|p| p.len() >= 2 * n));
        let w = r.map(<[f32]>::as_ptr);
        let x = pairs.map(<[f32]>::as_ptr);
        // SAFETY: every load reads below `n` from a row and below `2 n` from a pair
        // (lengths above); the features are the caller's promise.
        unsafe {
            // chains[c][p][k]: chain c of row k against pair p. The columns go in tiles
            // whose rows and pairs stay in L1 while each chain passes over them.
            let mut chains = [[[_mm512_setzero_ps(); 4]; P]; 4];
            for t in (0..n).step_by(TILE) {
                let end = (t + TILE).min(n);
                for (c, chain) in chains.iter_mut().enumerate() {
                    let mut acc = *chain;
                    let mut j = t + 8 * c;
                    while j < end {
                        let mut xv = [_mm512_setzero_ps(); P];
                        for (v, x) in xv.iter_mut().zip(x) {
                            *v = _mm512_loadu_ps(x.add(2 * j));
                        }
                        for (k, w) in w.iter().enumerate() {
                            let wv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(
                                _mm256_loadu_ps(w.add(j)),
                            )));
                            for (acc, xv) in acc.iter_mut().zip(&xv) {
                                acc[k] = _mm512_fmadd_ps(wv, *xv, acc[k]);
                            }
                        }
                        j += 32;
                    }
                    *chain = acc;
                }
            }
            let mut out = [[[0f32; 2]; 4]; P];
            for (p, o) in out.iter_mut().enumerate() {
                for (k, o) in o.iter_mut().enumerate() {
                    // No closures (they do not inherit the target features).
                    let (mut lo, mut hi) = ([_mm256_setzero_ps(); 4], [_mm256_setzero_ps(); 4]);
                    for c in 0..4 {
                        let v = chains[c][p][k];
                        lo[c] = _mm512_castps512_ps256(v);
                        hi[c] = high_half(v);
                    }
                    *o = [reduce(lo), reduce(hi)];
                }
            }
            out
        }
    }

    /// The high eight lanes of `v`.
    #[inline(always)]
    unsafe fn high_half(v: __m512) -> __m256 {
        // SAFETY: register arithmetic only; AVX-512F is the caller's promise.
        unsafe { _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))) }
    }

    /// `(row · a, row · b)`.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA; `a` and `b` are at least as long as `row`.
    #[inline(always)]
    pub(super) unsafe fn dot2(row: &[f32], a: &[f32], b: &[f32]) -> (f32, f32) {
        let n = row.len();
        debug_assert!(a.len() >= n && b.len() >= n);
        let (w, pa, pb) = (row.as_ptr(), a.as_ptr(), b.as_ptr());
        // SAFETY: every load reads below `n` from the three slices (lengths above); the
        // features are the caller's promise.
        unsafe {
            let mut acc_a = [_mm256_setzero_ps(); 4];
            let mut acc_b = [_mm256_setzero_ps(); 4];
            let blocks = n / 32 * 32;
            let mut j = 0;
            while j < blocks {
                for k in 0..4 {
                    let wv = _mm256_loadu_ps(w.add(j + 8 * k));
                    acc_a[k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(pa.add(j + 8 * k)), acc_a[k]);
                    acc_b[k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(pb.add(j + 8 * k)), acc_b[k]);
                }
                j += 32;
            }
            // Whole vectors after the blocks go to the accumulators in turn, as in dot_body.
            let whole = n / 8 * 8;
            let mut k = 0;
            while j < whole {
                let wv = _mm256_loadu_ps(w.add(j));
                acc_a[k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(pa.add(j)), acc_a[k]);
                acc_b[k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(pb.add(j)), acc_b[k]);
                j += 8;
                k += 1;
            }
            if whole < n {
                acc_a[0] = tail(acc_a[0], &row[whole..n], &a[whole..n]);
                acc_b[0] = tail(acc_b[0], &row[whole..n], &b[whole..n]);
            }
            (reduce(acc_a), reduce(acc_b))
        }
    }

    /// The last `w.len() < 8` products, fused into the first lanes of `acc` as dot_body
    /// does.
    #[inline(always)]
    unsafe fn tail(acc: __m256, w: &[f32], x: &[f32]) -> __m256 {
        // SAFETY: `lanes` holds the 8 values stored and loaded; AVX and FMA are the caller's
        // promise.
        unsafe {
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
            for ((l, w), x) in lanes.iter_mut().zip(w).zip(x) {
                *l = w.mul_add(*x, *l);
            }
            _mm256_loadu_ps(lanes.as_ptr())
        }
    }

    /// dot_body's tree: `(acc0 + acc2) + (acc1 + acc3)` lane by lane, then the lanes as
    /// `sum_lanes`: `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
    #[inline(always)]
    unsafe fn reduce(acc: [__m256; 4]) -> f32 {
        // SAFETY: register arithmetic only; AVX is the caller's promise.
        unsafe {
            let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
            let b = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
            let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
            _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps::<1>(c, c)))
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        *seed >> 33
    }

    /// Random blocks with finite scales (`d` and `m` of a small exponent).
    pub(crate) fn blocks(kind: QuantKind, rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
        let mut bytes = Vec::new();
        for _ in 0..rows * cols / BLOCK {
            let scale = |seed: &mut u64| {
                let v = (lcg(seed) % 2000) as f32 / 1000.0 - 1.0;
                half::f16::from_f32(v * 0.05).to_le_bytes()
            };
            bytes.extend_from_slice(&scale(seed));
            if kind == QuantKind::Q4_1 {
                bytes.extend_from_slice(&scale(seed));
            }
            let qs = kind.block_bytes() - bytes.len() % kind.block_bytes();
            for _ in 0..qs {
                bytes.push(lcg(seed).to_le_bytes()[0]);
            }
        }
        bytes
    }

    /// The f32 kernels (every one this CPU runs, for any number of vectors and rows)
    /// give each row and vector [`math::matvec`]'s bits for that row and vector alone.
    #[test]
    fn f32_products_equal_the_decode_kernel_alone() {
        let mut seed = 7;
        for cols in [32, 100, 256, 576, 1536] {
            let rows = 10;
            let f: Vec<f32> = (0..rows * cols)
                .map(|_| (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            for vectors in [1, 2, 3, 5, 8, 9, 16] {
                let xs: Vec<Vec<f32>> = (0..vectors)
                    .map(|_| {
                        (0..cols)
                            .map(|_| (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0)
                            .collect()
                    })
                    .collect();
                let refs: Vec<&[f32]> = xs.iter().map(Vec::as_slice).collect();
                // An odd number of rows: the kernels that take two rows at once end on one.
                let (lo, hi) = (2, 9);
                let n = hi - lo;
                let mut got = vec![0f32; refs.len() * n];
                matvec_multi(Mat::F32 { w: &f, cols }, &refs, lo..hi, &mut got);
                let mut portable = vec![0f32; refs.len() * n];
                matvec_body::<false, false>(&f, cols, &refs, lo..hi, &mut portable, n);
                #[cfg(target_arch = "x86_64")]
                if math::has_avx2_fma() {
                    let mut avx2 = vec![0f32; refs.len() * n];
                    // SAFETY: the CPU has the features (checked just above).
                    unsafe { matvec_avx2(&f, cols, &refs, lo..hi, &mut avx2, n) };
                    assert_eq!(avx2, got, "AVX2 kernel, cols {cols}");
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                for (b, x) in refs.iter().enumerate() {
                    let mut want = vec![0f32; n];
                    math::matvec(&f[lo * cols..hi * cols], x, &mut want);
                    let got_b = &got[b * n..(b + 1) * n];
                    assert_eq!(bits(got_b), bits(&want), "cols {cols} vector {b}");
                    // The portable kernel rounds each multiply-add twice (no FMA): it
                    // agrees with itself alone.
                    let mut alone = vec![0f32; n];
                    matvec_body::<false, false>(&f, cols, &[x], lo..hi, &mut alone, n);
                    assert_eq!(bits(&portable[b * n..(b + 1) * n]), bits(&alone));
                }
            }
        }
    }

    /// A quantized product is the integer kernels' (quantizing each vector once for a
    /// stack of matrices), and a stack is its matrices' rows one after the other.
    #[test]
    fn quantized_products_are_the_integer_kernels() {
        let mut seed = 13;
        let cols = 64;
        let (a, b) = (
            QuantMatrix::new(
                QuantKind::Q4_1,
                20,
                cols,
                blocks(QuantKind::Q4_1, 20, cols, &mut seed),
            )
            .unwrap(),
            QuantMatrix::new(
                QuantKind::Q8_0,
                12,
                cols,
                blocks(QuantKind::Q8_0, 12, cols, &mut seed),
            )
            .unwrap(),
        );
        let xs: Vec<Vec<f32>> = (0..3)
            .map(|_| {
                (0..cols)
                    .map(|_| (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0)
                    .collect()
            })
            .collect();
        let refs: Vec<&[f32]> = xs.iter().map(Vec::as_slice).collect();
        let rows = 5..27;
        let mut got = vec![0f32; 3 * rows.len()];
        matvec_multi_stacked(
            &[Mat::Quant(&a), Mat::Quant(&b)],
            &Inputs::new(refs.clone()),
            rows.clone(),
            &mut got,
        );
        for (v, x) in refs.iter().enumerate() {
            let q8 = int8::Q8Vec::new(x);
            for (i, r) in rows.clone().enumerate() {
                let want = if r < 20 {
                    int8::dot_portable(&a, r, &q8)
                } else {
                    int8::dot_portable(&b, r - 20, &q8)
                };
                assert_eq!(
                    got[v * rows.len() + i].to_bits(),
                    want.to_bits(),
                    "row {r} vector {v}"
                );
            }
        }
    }

    #[test]
    fn a_matrix_must_be_whole_blocks() {
        assert!(QuantMatrix::new(QuantKind::Q4_1, 2, 32, vec![0; 40]).is_some());
        assert!(QuantMatrix::new(QuantKind::Q4_1, 2, 32, vec![0; 39]).is_none());
        assert!(QuantMatrix::new(QuantKind::Q8_0, 1, 48, vec![0; 51]).is_none());
        assert!(QuantMatrix::new(QuantKind::Q8_0, 1, 0, vec![]).is_none());
    }

    /// The interleaved strips hold the file's weights: every row (the last strip padded)
    /// dequantizes to what the file's blocks dequantize to.
    #[test]
    fn strips_hold_the_file_blocks() {
        let mut seed = 17;
        for kind in [QuantKind::Q4_1, QuantKind::Q8_0] {
            let (rows, cols) = (21, 96);
            let bytes = blocks(kind, rows, cols, &mut seed);
            let mut want = vec![0f32; rows * cols];
            crate::gguf::dequantize_into(kind.ggml_type(), &bytes, &mut want).unwrap();
            let q = QuantMatrix::new(kind, rows, cols, bytes).unwrap();
            let mut got = vec![0f32; cols];
            for r in 0..rows {
                q.dequantize_row(r, &mut got);
                assert_eq!(got, want[r * cols..(r + 1) * cols], "{kind:?} row {r}");
            }
        }
    }

    #[test]
    fn permuted_rows_move_whole() {
        let mut seed = 3;
        for kind in [QuantKind::Q8_0, QuantKind::Q4_1] {
            let (rows, cols) = (19, 64);
            let bytes = blocks(kind, rows, cols, &mut seed);
            let row_bytes = cols / BLOCK * kind.block_bytes();
            // The file's rows reversed, packed: the same as the packed rows reversed.
            let reversed: Vec<u8> = bytes
                .chunks_exact(row_bytes)
                .rev()
                .flatten()
                .copied()
                .collect();
            let q = QuantMatrix::new(kind, rows, cols, bytes).unwrap();
            let p = q.permute_rows(|i| rows - 1 - i);
            assert_eq!(p, QuantMatrix::new(kind, rows, cols, reversed).unwrap());
        }
    }
}

#[cfg(test)]
mod speed {
    use super::*;

    /// A Q4_1 matrix of `rows` x `cols` and sixteen vectors for it.
    fn matrix_and_vectors(rows: usize, cols: usize) -> (QuantMatrix, Vec<Vec<f32>>) {
        let mut bytes = vec![0u8; rows * cols / BLOCK * 20];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 7 % 251).to_le_bytes()[0] & 0x3F;
        }
        let q = QuantMatrix::new(QuantKind::Q4_1, rows, cols, bytes).unwrap();
        let xs = (0..16)
            .map(|b| (0..cols).map(|i| ((i + b) % 13) as f32 * 0.01).collect())
            .collect();
        (q, xs)
    }

    /// `cargo test --release -p llama --lib unit_speed -- --ignored --nocapture`: a product
    /// of sixteen vectors whole against the same in runs of rows, each run a call as a
    /// member of a decode step takes it (`UNIT_ROWS` in `runner.rs`): what a call costs.
    #[test]
    #[ignore = "a benchmark"]
    fn unit_speed() {
        for (rows, cols) in [(960, 576), (576, 1536), (1536, 576)] {
            let (q, xs) = matrix_and_vectors(rows, cols);
            for n in [1, 16] {
                let refs: Vec<&[f32]> = xs[..n].iter().map(Vec::as_slice).collect();
                for unit in [rows, 256, 128, 64] {
                    let mut out = vec![0f32; n * unit];
                    let reps = 500;
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        let inputs = Inputs::new(refs.clone());
                        for u in 0..rows.div_ceil(unit) {
                            let r = u * unit..((u + 1) * unit).min(rows);
                            let k = r.len();
                            matvec_multi_stacked(&[Mat::Quant(&q)], &inputs, r, &mut out[..n * k]);
                        }
                    }
                    let us = t.elapsed().as_secs_f64() * 1e6 / f64::from(reps);
                    eprintln!("{rows}x{cols} x {n:>2} in units of {unit}: {us:>8.1} us");
                }
            }
        }
    }

    /// `cargo test --release -p llama --lib kernel_speed -- --ignored --nocapture`: the
    /// products alone, one vector against sixteen, on SmolLM2-135M's shapes.
    #[test]
    #[ignore = "a benchmark"]
    fn kernel_speed() {
        for (rows, cols) in [(1536, 576), (576, 1536), (4096, 576)] {
            let (q, xs) = matrix_and_vectors(rows, cols);
            for n in [1, 2, 4, 8, 16] {
                let refs: Vec<&[f32]> = xs[..n].iter().map(Vec::as_slice).collect();
                let mut out = vec![0f32; n * rows];
                let reps = 200;
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    matvec_multi(Mat::Quant(&q), &refs, 0..rows, &mut out);
                }
                let us = t.elapsed().as_secs_f64() * 1e6 / f64::from(reps);
                let gflop = 2.0 * (rows * cols * n) as f64 / us / 1e3;
                let per = us / n as f64;
                eprintln!(
                    "{rows}x{cols} x {n:>2}: {us:>8.1} us  {gflop:>6.1} GFLOP/s  {per:>5.2} us/vector"
                );
            }
            // Each integer kernel this CPU runs, one vector and sixteen.
            for kernel in int8::Kernel::all() {
                for n in [1, 16] {
                    let q8 =
                        int8::Vectors::new(xs[..n].iter().map(|x| int8::Q8Vec::new(x)).collect());
                    let mut out = vec![0f32; n * rows];
                    let reps = if kernel == int8::Kernel::Portable {
                        5
                    } else {
                        200
                    };
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        int8::matvec_with(kernel, &q, &q8, 0..rows, &mut out, rows);
                    }
                    let us = t.elapsed().as_secs_f64() * 1e6 / f64::from(reps);
                    eprintln!("{rows}x{cols} x {n:>2}, {kernel:?}: {us:>8.1} us");
                }
            }
        }
    }
}
