//! Decode's weight matrices as the model file stores them (Q4_1, Q8_0) and the product of
//! one matrix with several vectors at once, for a batched decode step.
//!
//! Every decode step reads every weight. Read as f32, SmolLM2-135M's weights are 540 MB a
//! token; as the file's Q4_1 and Q8_0 blocks they are 98 MB. A [`QuantMatrix`] keeps the
//! blocks, and `matvec_multi` dequantizes each block where it is used, once for several
//! vectors of the batch, so a step reads each weight once from memory whatever the batch
//! size. The kernels prefetch the blocks ahead of them: a step streams the whole model
//! through the cache, faster than the hardware prefetcher alone brings it.
//!
//! # Exactness
//!
//! A row is dequantized with the arithmetic of [`crate::gguf::dequantize_into`] (an f32
//! product, then an f32 sum for Q4_1, never fused), and its dot product is the decode
//! kernel's own (`math::dot_row`): the result is bit for bit the product of the weights
//! dequantized to f32 at load, as the runner computed before, for one vector or many. So a
//! request decodes to the same tokens alone or in any batch, and quantized decode agrees
//! with the f32 weights the prefill's sgemm multiplies.

use std::ops::Range;

use crate::gguf::GgmlType;
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

/// A row-major `[rows][cols]` matrix of quantized blocks, rows a whole number of blocks.
#[derive(Clone, PartialEq)]
pub struct QuantMatrix {
    kind: QuantKind,
    rows: usize,
    cols: usize,
    bytes: Vec<u8>,
    /// Each block's f16 scale and (Q4_1) minimum, widened to f32 once here (exactly), so
    /// that a kernel broadcasts them from memory instead of converting per block.
    scales: Vec<[f32; 2]>,
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

impl QuantMatrix {
    /// `rows` rows of `cols` weights from the file's blocks; `None` unless `cols` is a whole
    /// number of blocks and `bytes` holds exactly the matrix.
    pub fn new(kind: QuantKind, rows: usize, cols: usize, bytes: Vec<u8>) -> Option<QuantMatrix> {
        let row_bytes =
            (cols.is_multiple_of(BLOCK) && cols > 0).then(|| cols / BLOCK * kind.block_bytes())?;
        if rows.checked_mul(row_bytes)? != bytes.len() {
            return None;
        }
        let scales = block_scales(kind, &bytes);
        Some(QuantMatrix {
            kind,
            rows,
            cols,
            bytes,
            scales,
        })
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

    fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.kind.block_bytes()
    }

    /// Row `r`'s blocks.
    fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes[r * rb..(r + 1) * rb]
    }

    /// Row `r`'s blocks' scales (see [`QuantMatrix::scales`]).
    fn row_scales(&self, r: usize) -> &[[f32; 2]] {
        let n = self.cols / BLOCK;
        &self.scales[r * n..(r + 1) * n]
    }

    /// The same matrix with its rows reordered: row `i` of the result is row `from[i]`.
    pub fn permute_rows(&self, from: impl Fn(usize) -> usize) -> QuantMatrix {
        let mut bytes = Vec::with_capacity(self.bytes.len());
        let mut scales = Vec::with_capacity(self.scales.len());
        for i in 0..self.rows {
            bytes.extend_from_slice(self.row(from(i)));
            scales.extend_from_slice(self.row_scales(from(i)));
        }
        QuantMatrix {
            bytes,
            scales,
            ..*self
        }
    }

    /// Row `r` dequantized into `out` (`cols` long): [`crate::gguf::dequantize_into`]'s
    /// values, with the same arithmetic in registers where `SIMD` (512-bit ones where
    /// `WIDE_REGS`).
    #[inline(always)]
    fn dequantize_row<const SIMD: bool, const WIDE_REGS: bool>(&self, r: usize, out: &mut [f32]) {
        let row = self.row(r);
        #[cfg(target_arch = "x86_64")]
        if SIMD && WIDE_REGS {
            let bytes = self.kind.block_bytes();
            let blocks = row.chunks_exact(bytes).zip(self.row_scales(r));
            for ((b, &[d, m]), y) in blocks.zip(out.chunks_exact_mut(BLOCK)) {
                // SAFETY: WIDE_REGS is set only inside a function compiled for AVX-512F
                // (and AVX2, FMA, F16C), called once the CPU is known to have them; `b` is
                // a whole block and `y` 32 values.
                unsafe {
                    match self.kind {
                        QuantKind::Q4_1 => simd::q4_1_block_wide(b, d, m, y),
                        QuantKind::Q8_0 => simd::q8_0_block_wide(b, d, y),
                    }
                }
            }
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if SIMD {
            let bytes = self.kind.block_bytes();
            for (b, y) in row.chunks_exact(bytes).zip(out.chunks_exact_mut(BLOCK)) {
                // SAFETY: SIMD is set only inside functions compiled for AVX2, FMA and F16C,
                // called once the CPU is known to have them; `b` is a whole block and `y`
                // 32 values.
                unsafe {
                    match self.kind {
                        QuantKind::Q4_1 => simd::q4_1_block(b, y),
                        QuantKind::Q8_0 => simd::q8_0_block(b, y),
                    }
                }
            }
            return;
        }
        let ggml = self.kind.ggml_type();
        // A row is whole blocks of `cols` values (`QuantMatrix::new`): it cannot fail.
        if crate::gguf::dequantize_into(ggml, row, &mut out[..self.cols]).is_err() {
            unreachable!("a row of whole blocks");
        }
    }
}

/// Each block's `[d, m]` (Q4_1) or `[d, 0]` (Q8_0), as [`crate::gguf::dequantize_into`]
/// widens them.
fn block_scales(kind: QuantKind, bytes: &[u8]) -> Vec<[f32; 2]> {
    let f16 = |lo, hi| half::f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32();
    bytes
        .chunks_exact(kind.block_bytes())
        .map(|b| match kind {
            QuantKind::Q4_1 => [f16(b[0], b[1]), f16(b[2], b[3])],
            QuantKind::Q8_0 => [f16(b[0], b[1]), 0.0],
        })
        .collect()
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

/// Rows `rows` of `M x_b` for every vector `x_b` of `xs` (each `cols` long) into `out`,
/// vector-major: `out[b * rows.len() + i]` is row `rows.start + i` of `M x_b`. Each output
/// is exactly [`math::matvec`]'s for that row and vector alone (see the module docs).
///
/// # Panics
///
/// If a vector is not `cols` long, a row is out of range, or `out` is not
/// `xs.len() * rows.len()` long (bugs in the caller: shapes are validated at load).
pub(crate) fn matvec_multi(m: Mat<'_>, xs: &[&[f32]], rows: Range<usize>, out: &mut [f32]) {
    assert_eq!(
        out.len(),
        xs.len() * rows.len(),
        "matvec_multi: output length"
    );
    let stride = rows.len();
    matvec_strided(m, xs, rows, out, stride);
}

/// [`matvec_multi`] of the matrices `ms` stacked (`[M_0; M_1; ...]`, rows counted across
/// them), rows `rows` of it.
pub(crate) fn matvec_multi_stacked(
    ms: &[Mat<'_>],
    xs: &[&[f32]],
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
            let at = lo - rows.start;
            matvec_strided(*m, xs, lo - base..hi - base, &mut out[at..], stride);
        }
        base += n;
    }
}

/// Row `rows.start + i` of `M x_b` into `out[b * stride + i]`.
fn matvec_strided(m: Mat<'_>, xs: &[&[f32]], rows: Range<usize>, out: &mut [f32], stride: usize) {
    let cols = m.cols();
    assert!(
        xs.iter().all(|x| x.len() == cols),
        "matvec_multi: vector length"
    );
    assert!(rows.end <= m.rows(), "matvec_multi: rows out of range");
    if rows.is_empty() || xs.is_empty() {
        return;
    }
    assert!(
        out.len() >= (xs.len() - 1) * stride + rows.len(),
        "matvec_multi: output too short"
    );
    #[cfg(target_arch = "x86_64")]
    if has_simd() {
        if has_avx512vl() {
            // SAFETY: the CPU has AVX2, FMA, F16C, AVX-512F and AVX-512VL (checked at run
            // time just above), the only requirement of calling a function compiled with
            // those features.
            unsafe { matvec_avx512(m, xs, rows, out, stride) };
        } else {
            // SAFETY: the CPU has AVX2, FMA and F16C (checked at run time just above).
            unsafe { matvec_avx2(m, xs, rows, out, stride) };
        }
        return;
    }
    matvec_body::<false, false>(m, xs, rows, out, stride);
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

/// Whether the AVX2, FMA and F16C kernels may run on this CPU.
#[inline]
fn has_simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        math::has_avx2_fma() && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn matvec_avx2(m: Mat<'_>, xs: &[&[f32]], rows: Range<usize>, out: &mut [f32], stride: usize) {
    matvec_body::<true, false>(m, xs, rows, out, stride);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
fn matvec_avx512(m: Mat<'_>, xs: &[&[f32]], rows: Range<usize>, out: &mut [f32], stride: usize) {
    matvec_body::<true, true>(m, xs, rows, out, stride);
}

/// `matvec_strided`'s work. `SIMD` only inside [`matvec_avx2`] and [`matvec_avx512`],
/// `WIDE_REGS` (32 registers: two rows at once) only inside the latter.
///
/// A quantized matrix on AVX-512: [`blocks_wide`], blocks dequantized into registers for
/// up to [`GROUP`] vectors at once. On AVX2, one vector: each block dequantized into
/// registers and multiplied there. Otherwise (f32 rows, or more vectors on AVX2): rows
/// dequantized into buffers that stay in L1, each weight loaded from there serving two
/// vectors (and, with 32 registers, two or four rows).
#[inline(always)]
fn matvec_body<const SIMD: bool, const WIDE_REGS: bool>(
    m: Mat<'_>,
    xs: &[&[f32]],
    rows: Range<usize>,
    out: &mut [f32],
    stride: usize,
) {
    let cols = m.cols();
    #[cfg(target_arch = "x86_64")]
    if SIMD
        && cols >= simd::WIDE
        && let Mat::Quant(q) = m
    {
        if WIDE_REGS {
            // SAFETY: WIDE_REGS is set only inside `matvec_avx512`, compiled for AVX-512F
            // (and AVX2, FMA, F16C) and called once the CPU is known to have them; every
            // vector is as long as a row (`matvec_strided`).
            unsafe { blocks_wide(q, xs, rows, out, stride) };
            return;
        }
        if let [x] = xs {
            for (i, r) in rows.enumerate() {
                // SAFETY: SIMD is set only in functions compiled for AVX2, FMA and F16C,
                // called once the CPU is known to have them; `x` is as long as a row.
                out[i] = unsafe { simd::dot_blocks(q.kind, q.row(r), x) };
            }
            return;
        }
    }
    // Dequantized rows land in these; f32 rows are read in place and need none.
    let len = if matches!(m, Mat::Quant(_)) { cols } else { 0 };
    let mut bufs: [Vec<f32>; 4] = std::array::from_fn(|_| vec![0f32; len]);
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
        let [b0, b1, b2, b3] = &mut bufs;
        if four && r + 3 < end {
            let rs = [
                row::<SIMD, WIDE_REGS>(m, r, b0),
                row::<SIMD, WIDE_REGS>(m, r + 1, b1),
                row::<SIMD, WIDE_REGS>(m, r + 2, b2),
                row::<SIMD, WIDE_REGS>(m, r + 3, b3),
            ];
            dots4::<SIMD, WIDE_REGS>(rs, &pairs, xs.len(), &mut out[i..], stride);
            r += 4;
        } else if many && r + 1 < end {
            let (r0, r1) = (
                row::<SIMD, WIDE_REGS>(m, r, b0),
                row::<SIMD, WIDE_REGS>(m, r + 1, b1),
            );
            dots2::<SIMD, WIDE_REGS>(r0, r1, xs, &mut out[i..], stride);
            r += 2;
        } else {
            dots::<SIMD>(row::<SIMD, WIDE_REGS>(m, r, b0), xs, &mut out[i..], stride);
            r += 1;
        }
    }
}

/// Vectors [`blocks_wide`] multiplies at once: two rows against six vectors are 24
/// accumulators, and with the rows' four registers of weights that leaves room in 32.
const GROUP: usize = 6;

/// [`matvec_body`] of a quantized matrix on AVX-512: rows two at a time, each pair's blocks
/// dequantized into registers once for every [`GROUP`] of vectors (the pair's blocks stay
/// in L1 from one group to the next), each register of weights serving every vector of
/// the group.
///
/// # Safety
///
/// The CPU has AVX-512F, AVX2, FMA and F16C; every vector of `xs` is a row long, at least
/// [`WIDE`]; `out` holds `out[b * stride + i]` for every vector `b` and row `i` of `rows`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn blocks_wide(
    q: &QuantMatrix,
    xs: &[&[f32]],
    rows: Range<usize>,
    out: &mut [f32],
    stride: usize,
) {
    let (start, end) = (rows.start, rows.end);
    let mut r = start;
    while r < end {
        let i = r - start;
        for (g, group) in xs.chunks(GROUP).enumerate() {
            let out = &mut out[g * GROUP * stride + i..];
            // SAFETY: the caller's promise.
            unsafe {
                match (q.kind, r + 1 < end) {
                    (QuantKind::Q4_1, true) => rows_group::<false, 2>(q, r, group, out, stride),
                    (QuantKind::Q4_1, false) => rows_group::<false, 1>(q, r, group, out, stride),
                    (QuantKind::Q8_0, true) => rows_group::<true, 2>(q, r, group, out, stride),
                    (QuantKind::Q8_0, false) => rows_group::<true, 1>(q, r, group, out, stride),
                }
            }
        }
        r += if r + 1 < end { 2 } else { 1 };
    }
}

/// Rows `r..r + R` against the vectors `xs` (at most [`GROUP`]): `out[b * stride + k]` is
/// row `r + k` · `xs[b]`.
///
/// # Safety
///
/// As [`blocks_wide`]; `Q8` says the matrix is Q8_0 (else Q4_1), and rows `r..r + R` exist.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn rows_group<const Q8: bool, const R: usize>(
    q: &QuantMatrix,
    r: usize,
    xs: &[&[f32]],
    out: &mut [f32],
    stride: usize,
) {
    let blocks: [&[u8]; R] = std::array::from_fn(|k| q.row(r + k));
    let scales: [&[[f32; 2]]; R] = std::array::from_fn(|k| q.row_scales(r + k));
    macro_rules! run {
        ($v:literal) => {{
            let xs: [&[f32]; $v] = std::array::from_fn(|b| xs[b]);
            // SAFETY: the caller's promise covers `dot_rows`'.
            let d = unsafe { simd::dot_rows::<Q8, R, $v>(blocks, scales, xs) };
            for (b, rows) in d.iter().enumerate() {
                out[b * stride..b * stride + R].copy_from_slice(rows);
            }
        }};
    }
    match xs.len() {
        1 => run!(1),
        2 => run!(2),
        3 => run!(3),
        4 => run!(4),
        5 => run!(5),
        6 => run!(6),
        n => unreachable!("groups of one to {GROUP} vectors, not {n}"),
    }
}

/// Row `r` of `m`: in place for f32, dequantized into `buf` for blocks. (A function, not a
/// closure: closures do not inherit the target features of the kernels that inline this.)
#[inline(always)]
fn row<'a, const SIMD: bool, const WIDE_REGS: bool>(
    m: Mat<'a>,
    r: usize,
    buf: &'a mut [f32],
) -> &'a [f32] {
    match m {
        Mat::F32 { w, cols } => &w[r * cols..(r + 1) * cols],
        Mat::Quant(q) => {
            q.dequantize_row::<SIMD, WIDE_REGS>(r, buf);
            buf
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

    /// `blocks · x` for a row of quantized blocks, each block dequantized into registers:
    /// the values of [`super::QuantMatrix::dequantize_row`], summed as [`dot2`] sums.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2, FMA and F16C; `x` holds 32 values per block of `blocks`, at least
    /// [`WIDE`] in all.
    #[inline(always)]
    pub(super) unsafe fn dot_blocks(kind: super::QuantKind, blocks: &[u8], x: &[f32]) -> f32 {
        let bytes = kind.block_bytes();
        debug_assert!(x.len() >= blocks.len() / bytes * 32);
        let px = x.as_ptr();
        // SAFETY: block `i` reads `x[32 i..32 i + 32]`, inside `x` (above); the features
        // are the caller's promise.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 4];
            for (i, b) in blocks.chunks_exact(bytes).enumerate() {
                let w = match kind {
                    super::QuantKind::Q4_1 => q4_1_regs(b),
                    super::QuantKind::Q8_0 => q8_0_regs(b),
                };
                for k in 0..4 {
                    acc[k] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(px.add(32 * i + 8 * k)), acc[k]);
                }
            }
            reduce(acc)
        }
    }

    /// Blocks a prefetch runs ahead of the kernel that reads them: a decode step reads
    /// every weight once, from memory, faster than the hardware prefetcher alone fetches.
    const AHEAD: usize = 96;

    /// `[[row k · xs[b]; R]; V]` for `R` rows of quantized blocks (Q8_0 if `Q8`, else
    /// Q4_1; scales widened as [`super::QuantMatrix`] keeps them): each block is
    /// dequantized into two 512-bit registers once for all `V` vectors, and summed as
    /// [`dot_blocks`] sums (one register holds its accumulators 0 and 1 in its halves, the
    /// other 2 and 3: lane by lane the same arithmetic, the same tree at the end).
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F, AVX2 and FMA; every row is as many blocks as `scales[k]`
    /// holds, all rows alike, and every vector 32 values per block.
    #[inline(always)]
    pub(super) unsafe fn dot_rows<const Q8: bool, const R: usize, const V: usize>(
        blocks: [&[u8]; R],
        scales: [&[[f32; 2]]; R],
        xs: [&[f32]; V],
    ) -> [[f32; R]; V] {
        let bytes = if Q8 { 34 } else { 20 };
        let n = scales[0].len();
        debug_assert!((0..R).all(|k| scales[k].len() == n && blocks[k].len() == n * bytes));
        debug_assert!(xs.iter().all(|x| x.len() >= 32 * n));
        let px = xs.map(<[f32]>::as_ptr);
        // SAFETY: block `i` of each row is `bytes` long and reads `x[32 i..32 i + 32]`,
        // inside every vector (above); a prefetch never faults, and its address is only
        // computed (`wrapping_add`); the features are the caller's promise.
        unsafe {
            let mut acc = [[[_mm512_setzero_ps(); 2]; R]; V];
            for i in 0..n {
                let mut w = [[_mm512_setzero_ps(); 2]; R];
                for k in 0..R {
                    let b = blocks[k].as_ptr().add(i * bytes);
                    _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(AHEAD * bytes).cast());
                    let s = scales[k].as_ptr().add(i);
                    _mm_prefetch::<_MM_HINT_T0>(s.wrapping_add(AHEAD).cast());
                    let [d, m] = *s;
                    let b = std::slice::from_raw_parts(b, bytes);
                    w[k] = if Q8 {
                        q8_0_wide(b, d)
                    } else {
                        q4_1_wide(b, d, m)
                    };
                }
                for (acc, x) in acc.iter_mut().zip(px) {
                    let (x01, x23) = (
                        _mm512_loadu_ps(x.add(32 * i)),
                        _mm512_loadu_ps(x.add(32 * i + 16)),
                    );
                    for (acc, w) in acc.iter_mut().zip(&w) {
                        acc[0] = _mm512_fmadd_ps(w[0], x01, acc[0]);
                        acc[1] = _mm512_fmadd_ps(w[1], x23, acc[1]);
                    }
                }
            }
            let mut out = [[0f32; R]; V];
            for (out, acc) in out.iter_mut().zip(&acc) {
                for (o, [a01, a23]) in out.iter_mut().zip(acc) {
                    *o = reduce([
                        _mm512_castps512_ps256(*a01),
                        high_half(*a01),
                        _mm512_castps512_ps256(*a23),
                        high_half(*a23),
                    ]);
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

    /// A Q4_1 block's 32 weights in two registers of sixteen: [`q4_1_regs`]'s values, given
    /// the block's scale `d` and minimum `m` widened.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F; `b` is a 20-byte Q4_1 block.
    #[inline(always)]
    unsafe fn q4_1_wide(b: &[u8], d: f32, m: f32) -> [__m512; 2] {
        debug_assert!(b.len() >= 20);
        // SAFETY: the length above bounds the loads; the features are the caller's promise.
        unsafe {
            let (d, m) = (_mm512_set1_ps(d), _mm512_set1_ps(m));
            let q = _mm_loadu_si128(b.as_ptr().add(4).cast());
            let mask = _mm_set1_epi8(0x0F);
            let lo = _mm_and_si128(q, mask);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), mask);
            // No closures here: a closure does not inherit its function's target features.
            let (lo, hi) = (
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)),
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)),
            );
            // One fused multiply-add is the unfused product and sum bit for bit: `q d` is
            // exact in f32 (a 4-bit integer times an f16's 11 significant bits), so only
            // the sum rounds, once, either way.
            [_mm512_fmadd_ps(lo, d, m), _mm512_fmadd_ps(hi, d, m)]
        }
    }

    /// A Q8_0 block's 32 weights in two registers of sixteen: [`q8_0_regs`]'s values, given
    /// the block's scale `d` widened.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F; `b` is a 34-byte Q8_0 block.
    #[inline(always)]
    unsafe fn q8_0_wide(b: &[u8], d: f32) -> [__m512; 2] {
        debug_assert!(b.len() >= 34);
        // SAFETY: as in `q4_1_wide`.
        unsafe {
            let d = _mm512_set1_ps(d);
            let q0 = _mm_loadu_si128(b.as_ptr().add(2).cast());
            let q1 = _mm_loadu_si128(b.as_ptr().add(18).cast());
            [
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d),
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d),
            ]
        }
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

    /// The two f16 at `b[0..2]` and `b[2..4]`, widened exactly.
    #[inline(always)]
    unsafe fn scales(b: &[u8]) -> (__m256, __m256) {
        // SAFETY: `b` has at least 4 bytes (a block); F16C is enabled by the caller.
        unsafe {
            let h = _mm_cvtsi32_si128(i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            let f = _mm_cvtph_ps(h);
            (
                _mm256_broadcastss_ps(f),
                _mm256_broadcastss_ps(_mm_shuffle_ps::<1>(f, f)),
            )
        }
    }

    /// A Q4_1 block's 32 weights in four registers of eight.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and F16C; `b` is a 20-byte Q4_1 block.
    #[inline(always)]
    unsafe fn q4_1_regs(b: &[u8]) -> [__m256; 4] {
        debug_assert!(b.len() >= 20);
        // SAFETY: the length above bounds the load; the features are the caller's promise.
        unsafe {
            let (d, m) = scales(b);
            let q = _mm_loadu_si128(b.as_ptr().add(4).cast());
            let mask = _mm_set1_epi8(0x0F);
            let lo = _mm_and_si128(q, mask);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), mask);
            // No closures here: a closure does not inherit its function's target features.
            let q = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
            let mut w = [_mm256_setzero_ps(); 4];
            for k in 0..4 {
                let v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[k]));
                w[k] = _mm256_add_ps(_mm256_mul_ps(v, d), m);
            }
            w
        }
    }

    /// A Q8_0 block's 32 weights in four registers of eight.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and F16C; `b` is a 34-byte Q8_0 block.
    #[inline(always)]
    unsafe fn q8_0_regs(b: &[u8]) -> [__m256; 4] {
        debug_assert!(b.len() >= 34);
        // SAFETY: as in `q4_1_regs`.
        unsafe {
            let h = _mm_cvtsi32_si128(i32::from(u16::from_le_bytes([b[0], b[1]])));
            let d = _mm256_broadcastss_ps(_mm_cvtph_ps(h));
            let q = _mm256_loadu_si256(b.as_ptr().add(2).cast());
            let (q0, q1) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
            let q = [q0, _mm_srli_si128::<8>(q0), q1, _mm_srli_si128::<8>(q1)];
            let mut w = [_mm256_setzero_ps(); 4];
            for k in 0..4 {
                w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q[k])), d);
            }
            w
        }
    }

    /// # Safety
    ///
    /// The CPU has AVX2 and F16C; `b` is a 20-byte Q4_1 block, `y` at least 32 values.
    #[inline(always)]
    pub(super) unsafe fn q4_1_block(b: &[u8], y: &mut [f32]) {
        debug_assert!(y.len() >= 32);
        // SAFETY: the caller's promise is `q4_1_regs`'s; `y` holds the 32 values stored.
        unsafe { store(q4_1_regs(b), y) }
    }

    /// # Safety
    ///
    /// The CPU has AVX2 and F16C; `b` is a 34-byte Q8_0 block, `y` at least 32 values.
    #[inline(always)]
    pub(super) unsafe fn q8_0_block(b: &[u8], y: &mut [f32]) {
        debug_assert!(y.len() >= 32);
        // SAFETY: as in `q4_1_block`.
        unsafe { store(q8_0_regs(b), y) }
    }

    /// # Safety
    ///
    /// The CPU has AVX-512F; `b` is a 20-byte Q4_1 block with scale `d` and minimum `m`,
    /// `y` at least 32 values.
    #[inline(always)]
    pub(super) unsafe fn q4_1_block_wide(b: &[u8], d: f32, m: f32, y: &mut [f32]) {
        debug_assert!(y.len() >= 32);
        // SAFETY: the caller's promise is `q4_1_wide`'s; `y` holds the 32 values stored.
        unsafe { store_wide(q4_1_wide(b, d, m), y) }
    }

    /// # Safety
    ///
    /// The CPU has AVX-512F; `b` is a 34-byte Q8_0 block with scale `d`, `y` at least 32
    /// values.
    #[inline(always)]
    pub(super) unsafe fn q8_0_block_wide(b: &[u8], d: f32, y: &mut [f32]) {
        debug_assert!(y.len() >= 32);
        // SAFETY: as in `q4_1_block_wide`.
        unsafe { store_wide(q8_0_wide(b, d), y) }
    }

    #[inline(always)]
    unsafe fn store_wide(w: [__m512; 2], y: &mut [f32]) {
        // SAFETY: `y` holds at least 32 values (the callers' check); AVX-512F is their
        // promise.
        unsafe {
            _mm512_storeu_ps(y.as_mut_ptr(), w[0]);
            _mm512_storeu_ps(y.as_mut_ptr().add(16), w[1]);
        }
    }

    #[inline(always)]
    unsafe fn store(w: [__m256; 4], y: &mut [f32]) {
        // SAFETY: `y` holds at least 32 values (the callers' check); AVX is their promise.
        unsafe {
            for (i, v) in w.into_iter().enumerate() {
                _mm256_storeu_ps(y.as_mut_ptr().add(8 * i), v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::dequantize_into;

    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        *seed >> 33
    }

    /// Random blocks with finite scales (`d` and `m` of a small exponent).
    fn blocks(kind: QuantKind, rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
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

    #[test]
    fn products_equal_the_f32_kernel_on_the_dequantized_weights() {
        let mut seed = 7;
        for (kind, ggml) in [
            (QuantKind::Q4_1, GgmlType::Q4_1),
            (QuantKind::Q8_0, GgmlType::Q8_0),
        ] {
            for cols in [32, 256, 576, 1536] {
                let rows = 10;
                let bytes = blocks(kind, rows, cols, &mut seed);
                let mut f = vec![0f32; rows * cols];
                dequantize_into(ggml, &bytes, &mut f).unwrap();
                let q = QuantMatrix::new(kind, rows, cols, bytes).unwrap();
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
                    let mut got = vec![0f32; refs.len() * (hi - lo)];
                    matvec_multi(Mat::Quant(&q), &refs, lo..hi, &mut got);
                    let mut from_f32 = vec![0f32; refs.len() * (hi - lo)];
                    matvec_multi(Mat::F32 { w: &f, cols }, &refs, lo..hi, &mut from_f32);
                    // Every kernel this CPU can run, not only the one dispatch picks. The
                    // portable one rounds each multiply-add twice (no FMA): quantized or f32,
                    // it agrees with itself.
                    let n = hi - lo;
                    let portable = |m: Mat<'_>| {
                        let mut out = vec![0f32; refs.len() * n];
                        matvec_body::<false, false>(m, &refs, lo..hi, &mut out, n);
                        out
                    };
                    assert_eq!(
                        portable(Mat::Quant(&q)),
                        portable(Mat::F32 { w: &f, cols }),
                        "portable kernel, cols {cols}"
                    );
                    for m in [Mat::Quant(&q), Mat::F32 { w: &f, cols }] {
                        #[cfg(target_arch = "x86_64")]
                        if has_simd() {
                            let mut avx2 = vec![0f32; refs.len() * n];
                            // SAFETY: the CPU has the features (checked just above).
                            unsafe { matvec_avx2(m, &refs, lo..hi, &mut avx2, n) };
                            assert_eq!(avx2, got, "AVX2 kernel, cols {cols}");
                        }
                    }
                    for (b, x) in refs.iter().enumerate() {
                        let mut want = vec![0f32; hi - lo];
                        math::matvec(&f[lo * cols..hi * cols], x, &mut want);
                        let got_b = &got[b * (hi - lo)..(b + 1) * (hi - lo)];
                        let f32_b = &from_f32[b * (hi - lo)..(b + 1) * (hi - lo)];
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(got_b), bits(&want), "{kind:?} cols {cols} vector {b}");
                        assert_eq!(bits(f32_b), bits(&want), "f32 cols {cols} vector {b}");
                    }
                }
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

    #[test]
    fn permuted_rows_move_whole() {
        let mut seed = 3;
        for kind in [QuantKind::Q8_0, QuantKind::Q4_1] {
            let bytes = blocks(kind, 4, 64, &mut seed);
            let q = QuantMatrix::new(kind, 4, 64, bytes).unwrap();
            let p = q.permute_rows(|i| 3 - i);
            let (mut a, mut b) = (vec![0f32; 64], vec![0f32; 64]);
            for r in 0..4 {
                q.dequantize_row::<false, false>(3 - r, &mut a);
                p.dequantize_row::<false, false>(r, &mut b);
                assert_eq!(a, b);
                // The widened scales move with their blocks, and are the blocks' own.
                assert_eq!(q.row_scales(3 - r), p.row_scales(r));
                assert_eq!(p, QuantMatrix::new(kind, 4, 64, p.bytes.clone()).unwrap());
            }
        }
    }
}

#[cfg(test)]
mod speed {
    use super::*;

    /// `cargo test --release -p llama --lib kernel_speed -- --ignored --nocapture`: the
    /// products alone, one vector against sixteen, on SmolLM2-135M's shapes.
    #[test]
    #[ignore = "a benchmark"]
    fn kernel_speed() {
        for (rows, cols) in [(1536, 576), (576, 1536), (4096, 576)] {
            let blocks = rows * cols / BLOCK;
            let mut bytes = vec![0u8; blocks * 20];
            for (i, b) in bytes.iter_mut().enumerate() {
                *b = (i * 7 % 251).to_le_bytes()[0] & 0x3F;
            }
            let q = QuantMatrix::new(QuantKind::Q4_1, rows, cols, bytes).unwrap();
            let xs: Vec<Vec<f32>> = (0..16)
                .map(|b| (0..cols).map(|i| ((i + b) % 13) as f32 * 0.01).collect())
                .collect();
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
        }
    }
}
