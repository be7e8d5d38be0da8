//! Decode's products of quantized weights, in integers.
//!
//! Each vector is quantized to 8 bits a value, per block of 32 ([`Q8Vec`], as llama.cpp
//! quantizes activations against Q4_1 and Q8_0 weights). The dot product of a weight
//! block with a vector block is then an integer sum, exact whatever adds it. Only the
//! block sums are scaled and summed in f32, in one order for every kernel ([`finish`]):
//!
//! ```text
//! acc = 0
//! for each block b:  acc = fma(isum_b, d_w[b] * d_x[b], acc)
//!                    acc = fma(m_w[b], s_x[b], acc)          (Q4_1 only)
//! ```
//!
//! So a row's product with a vector is the same bits from every kernel, alone or in any
//! batch: a request decodes to the same tokens whatever it is batched with, and whichever
//! kernel the CPU runs. The kernels ([`Kernel`]) take a strip of 16 rows at a time, as
//! [`QuantMatrix`] keeps them interleaved, a 512-bit lane a row:
//!
//! - AVX-512 VNNI: one `VPDPBUSD` multiplies four weights of the 16 rows by four bytes of a
//!   vector; a strip's block is dequantized into registers once for up to four vectors.
//! - AMX, from 12 vectors: one `TDPBSUD` multiplies a block of up to 16 vectors by the
//!   strip's block. It needs the kernel's permission (Linux `arch_prctl`), asked once.
//! - AVX2 (no VNNI): the same, eight rows a register, one vector at a time.
//! - Plain code elsewhere, row by row: the reference the others are tested against.
//!
//! Measured on a 2-core AVX-512 machine (`kernel_speed` in `quant.rs`), a 1536 x 576 Q4_1
//! product takes 11 us for one vector (the f32 kernel over dequantized blocks took 49) and
//! 67 us for sixteen (VNNI alone 100, f32 331).

use std::ops::Range;
use std::sync::OnceLock;

use crate::quant::{QuantKind, QuantMatrix, STRIP};

/// Values per block, of the weights and of a quantized vector.
pub(crate) const BLOCK: usize = 32;

/// A vector quantized per block of [`BLOCK`] values: `q[i]` is `x[i] / d[b]` rounded to
/// nearest (ties to even), `d[b]` the block's largest magnitude over 127, and `s[b]` is
/// `d[b]` times the sum of the block's `q` (what Q4_1's minimum multiplies). A block with
/// a value that is not finite has `d` and `s` NaN, so that every product with it is NaN;
/// one too small for its scale to invert is all zeros.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Q8Vec {
    pub(crate) q: Vec<i8>,
    pub(crate) d: Vec<f32>,
    pub(crate) s: Vec<f32>,
    /// Each block's sum of `q` (what Q8_0's weights, kept plus 128, are corrected by).
    pub(crate) sum: Vec<i32>,
}

impl Q8Vec {
    /// `x` quantized; its length is a whole number of blocks (decode's are: shapes are
    /// validated at load against the quantized matrices).
    pub(crate) fn new(x: &[f32]) -> Q8Vec {
        assert!(x.len().is_multiple_of(BLOCK), "Q8Vec: whole blocks");
        let blocks = x.len() / BLOCK;
        let mut v = Q8Vec {
            q: vec![0; x.len()],
            d: vec![0.0; blocks],
            s: vec![0.0; blocks],
            sum: vec![0; blocks],
        };
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above); the lengths are whole blocks.
            unsafe { quantize_avx2(x, &mut v) };
            return v;
        }
        for (b, (x, q)) in x
            .chunks_exact(BLOCK)
            .zip(v.q.chunks_exact_mut(BLOCK))
            .enumerate()
        {
            (v.d[b], v.s[b], v.sum[b]) = quantize_block(x, q);
        }
        v
    }
}

/// Vectors as the kernels take them: quantized, and arranged in tile groups the first time
/// the AMX kernel takes them. A decode step multiplies one set of vectors by many small runs
/// of rows (each a share its thread takes), so they are quantized and arranged once.
#[derive(Debug)]
pub(crate) struct Vectors {
    q8: Vec<Q8Vec>,
    #[cfg(target_arch = "x86_64")]
    groups: std::cell::OnceCell<Vec<amx::Group>>,
}

impl Vectors {
    pub(crate) fn new(q8: Vec<Q8Vec>) -> Vectors {
        Vectors {
            q8,
            #[cfg(target_arch = "x86_64")]
            groups: std::cell::OnceCell::new(),
        }
    }

    /// Each of `xs` quantized ([`Q8Vec::new`]).
    pub(crate) fn quantize(xs: &[&[f32]]) -> Vectors {
        Vectors::new(xs.iter().map(|x| Q8Vec::new(x)).collect())
    }

    /// The vectors in groups of [`amx::VECTORS`], made on the first call.
    #[cfg(target_arch = "x86_64")]
    fn groups(&self) -> &[amx::Group] {
        self.groups
            .get_or_init(|| self.q8.chunks(amx::VECTORS).map(amx::Group::new).collect())
    }
}

/// The scale of a block whose largest magnitude is `amax`, and its inverse; `None` when
/// the block quantizes to zeros (all zero, or too small for the inverse to be finite).
#[inline(always)]
fn scale(amax: f32) -> Option<(f32, f32)> {
    let d = amax / 127.0;
    let id = 1.0 / d;
    (d > 0.0 && id.is_finite()).then_some((d, id))
}

/// One block of [`Q8Vec::new`]: fills `q`, returns `(d, s, sum)`.
fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, f32, i32) {
    let mut amax = 0f32;
    let mut finite = true;
    for v in x {
        let a = v.abs();
        finite &= a < f32::INFINITY;
        amax = if a > amax { a } else { amax };
    }
    q.fill(0);
    if !finite {
        return (f32::NAN, f32::NAN, 0);
    }
    let Some((d, id)) = scale(amax) else {
        return (0.0, 0.0, 0);
    };
    let mut sum = 0i32;
    for (q, v) in q.iter_mut().zip(x) {
        // |v * id| <= 127 (rounded): `v` is at most `amax` in magnitude.
        #[allow(clippy::cast_possible_truncation)]
        let r = (v * id).round_ties_even() as i32;
        #[allow(clippy::cast_possible_truncation)]
        {
            *q = r as i8;
        }
        sum += r;
    }
    #[allow(clippy::cast_precision_loss)]
    (d, d * sum as f32, sum)
}

/// [`quantize_block`] for every block, eight values at a time: the same maximum (exact
/// in any order), the same scale, the same rounding (the CPU's default, to nearest even).
///
/// # Safety
///
/// The CPU has AVX2; `x` is as long as `v.q` and a whole number of blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_avx2(x: &[f32], v: &mut Q8Vec) {
    use std::arch::x86_64::*;
    debug_assert_eq!(x.len(), v.q.len());
    let px = x.as_ptr();
    let pq = v.q.as_mut_ptr();
    // SAFETY: block `b` reads `x[32 b..32 b + 32]` and writes the same range of `q`, both
    // as long as `x` (the caller's promise); AVX2 is the caller's promise too.
    unsafe {
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let inf = _mm256_set1_ps(f32::INFINITY);
        for b in 0..x.len() / BLOCK {
            // No closures here: a closure does not inherit its function's target features.
            let mut xs = [_mm256_setzero_ps(); 4];
            let mut a = [_mm256_setzero_ps(); 4];
            let mut finite = 0xFF;
            for k in 0..4 {
                xs[k] = _mm256_loadu_ps(px.add(BLOCK * b + 8 * k));
                a[k] = _mm256_and_ps(xs[k], abs_mask);
                finite &= _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(a[k], inf));
            }
            let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)));
            let out = pq.add(BLOCK * b);
            if finite != 0xFF {
                std::ptr::write_bytes(out, 0, BLOCK);
                (v.d[b], v.s[b], v.sum[b]) = (f32::NAN, f32::NAN, 0);
                continue;
            }
            let Some((d, id)) = scale(amax) else {
                std::ptr::write_bytes(out, 0, BLOCK);
                (v.d[b], v.s[b], v.sum[b]) = (0.0, 0.0, 0);
                continue;
            };
            let id = _mm256_set1_ps(id);
            let mut q = [_mm256_setzero_si256(); 4];
            for k in 0..4 {
                q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(xs[k], id));
            }
            let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            let sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b00_00_00_01>(s)));
            // Narrow to bytes (no value saturates: all are within ±127); the packs work
            // within 128-bit lanes, the permute puts the eight runs of four back in order.
            let p = _mm256_packs_epi16(
                _mm256_packs_epi32(q[0], q[1]),
                _mm256_packs_epi32(q[2], q[3]),
            );
            let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(out.cast(), p);
            #[allow(clippy::cast_precision_loss)]
            {
                (v.d[b], v.s[b], v.sum[b]) = (d, d * sum as f32, sum);
            }
        }
    }
}

/// The f32 end of a row's product with one vector, block `b`'s integer sum `isum`
/// folded into `acc`; every kernel computes exactly this (see the module docs).
#[inline(always)]
fn finish(acc: f32, isum: i32, d: f32, m: f32, x: &Q8Vec, b: usize, q4: bool) -> f32 {
    // |isum| <= 32 * 128 * 127 < 2^24: exact in f32.
    #[allow(clippy::cast_precision_loss)]
    let acc = (isum as f32).mul_add(d * x.d[b], acc);
    if q4 { m.mul_add(x.s[b], acc) } else { acc }
}

/// Row `r` of `q` times `x`, in plain code: the reference every kernel equals.
pub(crate) fn dot_portable(q: &QuantMatrix, r: usize, x: &Q8Vec) -> f32 {
    let q4 = q.kind() == QuantKind::Q4_1;
    let mut acc = 0f32;
    for b in 0..q.blocks() {
        let (w, d, m) = q.block(r, b);
        let isum: i32 = w
            .iter()
            .zip(&x.q[b * BLOCK..(b + 1) * BLOCK])
            .map(|(w, x)| w * i32::from(*x))
            .sum();
        acc = finish(acc, isum, d, m, x, b, q4);
    }
    acc
}

/// Which kernel [`matvec`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// AMX tiles for a strip by up to 16 vectors, AVX-512 VNNI below [`AMX_FROM`] vectors.
    Amx,
    /// AVX-512 VNNI: a strip against up to [`GROUP`] vectors at a time.
    Vnni,
    /// AVX2: as VNNI, eight rows a register, each `VPDPBUSD` done as `VPMADDUBSW` and
    /// `VPMADDWD`.
    Avx2,
    /// [`dot_portable`], row by row.
    Portable,
}

impl Kernel {
    /// The fastest this CPU (and, for AMX, the operating system) runs.
    pub(crate) fn best() -> Kernel {
        static BEST: OnceLock<Kernel> = OnceLock::new();
        *BEST.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            if vnni() {
                return if amx::available() {
                    Kernel::Amx
                } else {
                    Kernel::Vnni
                };
            }
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Kernel::Avx2;
            }
            Kernel::Portable
        })
    }

    /// Every kernel this CPU runs (for tests).
    #[cfg(test)]
    pub(crate) fn all() -> Vec<Kernel> {
        let best = Kernel::best();
        [Kernel::Amx, Kernel::Vnni, Kernel::Avx2, Kernel::Portable]
            .into_iter()
            .filter(|k| match k {
                Kernel::Amx => best == Kernel::Amx,
                Kernel::Vnni => matches!(best, Kernel::Amx | Kernel::Vnni),
                Kernel::Avx2 => best != Kernel::Portable,
                Kernel::Portable => true,
            })
            .collect()
    }
}

/// Whether the CPU has AVX-512F and AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
fn vnni() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512vnni")
}

/// Vectors the VNNI kernel takes at once.
const GROUP: usize = 4;

/// From how many vectors the AMX kernel takes over from the VNNI one.
const AMX_FROM: usize = 12;

/// Rows `rows` of `q` times every vector of `xs`: `out[v * stride + i]` is row
/// `rows.start + i` times `xs[v]`, the same bits whatever the kernel.
pub(crate) fn matvec(
    q: &QuantMatrix,
    xs: &Vectors,
    rows: Range<usize>,
    out: &mut [f32],
    stride: usize,
) {
    matvec_with(Kernel::best(), q, xs, rows, out, stride);
}

/// [`matvec`] on `kernel`, which this CPU runs.
pub(crate) fn matvec_with(
    kernel: Kernel,
    q: &QuantMatrix,
    vectors: &Vectors,
    rows: Range<usize>,
    out: &mut [f32],
    stride: usize,
) {
    let xs = &vectors.q8[..];
    assert!(
        xs.iter().all(|x| x.q.len() == q.cols()),
        "int8::matvec: vector length"
    );
    assert!(rows.end <= q.rows(), "int8::matvec: rows out of range");
    if rows.is_empty() || xs.is_empty() {
        return;
    }
    assert!(
        out.len() >= (xs.len() - 1) * stride + rows.len(),
        "int8::matvec: output too short"
    );
    if kernel == Kernel::Portable {
        for (i, r) in rows.clone().enumerate() {
            for (v, x) in xs.iter().enumerate() {
                out[v * stride + i] = dot_portable(q, r, x);
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let strips = rows.start / STRIP..rows.end.div_ceil(STRIP);
        // Strip `s`'s products with vector `v`, the rows of it in `rows`, into `out`.
        let put = |out: &mut [f32], v: usize, s: usize, strip: &[f32; STRIP]| {
            let (first, end) = (s * STRIP, (s + 1) * STRIP);
            let (lo, hi) = (first.max(rows.start), end.min(rows.end));
            let at = v * stride + lo - rows.start;
            out[at..at + hi - lo].copy_from_slice(&strip[lo - first..hi - first]);
        };
        if kernel == Kernel::Amx && xs.len() >= AMX_FROM {
            let groups = vectors.groups();
            // SAFETY: `Kernel::Amx` is only `best` where the CPU has AMX-INT8, AVX-512F and
            // VNNI and the process may use the tiles.
            let _tiles = unsafe { amx::Tiles::configure() };
            // A few strips at a time for every group, so that the later groups read them
            // from cache.
            let chunk = if groups.len() == 1 { strips.len() } else { 8 };
            for start in strips.clone().step_by(chunk) {
                let part = start..(start + chunk).min(strips.end);
                for (g, group) in groups.iter().enumerate() {
                    // SAFETY: the tiles are configured; the vectors are a row long
                    // (asserted); the strips are the matrix's.
                    unsafe {
                        group.strips(q, part.clone(), |s, sums| {
                            for (v, strip) in sums.iter().take(group.len()).enumerate() {
                                put(out, g * amx::VECTORS + v, s, strip);
                            }
                        });
                    }
                }
            }
            return;
        }
        // The strips the rows touch; each is computed whole and its rows in `rows` kept.
        for s in strips {
            let mut put = |v: usize, strip: &[f32; STRIP]| put(out, v, s, strip);
            if kernel == Kernel::Avx2 {
                for (v, x) in xs.iter().enumerate() {
                    // SAFETY: the kernel runs only where the CPU has AVX2 and FMA
                    // (`Kernel::best`); the vector is a row long (asserted).
                    put(v, &unsafe { strip_avx2(q, s, x) });
                }
                continue;
            }
            for (g, group) in xs.chunks(GROUP).enumerate() {
                // One group of 1 to 4 vectors, its results straight into `out`.
                macro_rules! run {
                    ($($x:ident),+) => {{
                        let [$($x),+] = group else { unreachable!() };
                        // SAFETY: the kernel runs only where the CPU has AVX-512F and VNNI
                        // (`Kernel::best`); the vectors are a row long (asserted).
                        let sums = unsafe { strip_vnni(q, s, [$($x),+]) };
                        for (v, strip) in sums.iter().enumerate() {
                            put(g * GROUP + v, strip);
                        }
                    }};
                }
                match group.len() {
                    1 => run!(a),
                    2 => run!(a, b),
                    3 => run!(a, b, c),
                    4 => run!(a, b, c, d),
                    _ => unreachable!("groups of one to {GROUP}"),
                }
            }
        }
    }
}

/// Bytes a prefetch runs ahead of the strips being read: the matrix is read as one stream,
/// strip after strip.
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 2048;

/// Strip `s` of `q` times each of `xs`: for each vector the 16 rows' products. A
/// `VPDPBUSD` multiplies four weights of all 16 rows by four bytes of a vector; eight of
/// them are a block.
///
/// # Safety
///
/// The CPU has AVX-512F and AVX-512 VNNI; every vector is a row long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn strip_vnni<const V: usize>(
    q: &QuantMatrix,
    s: usize,
    xs: [&Q8Vec; V],
) -> [[f32; STRIP]; V] {
    use std::arch::x86_64::*;
    let q4 = q.kind() == QuantKind::Q4_1;
    // SAFETY: every load is inside the strip's block (its chunks of 64 bytes), its scales
    // (32 f32) or a vector's block (32 bytes, 8 of 4); a prefetch never faults and its
    // address is only computed; the features are the caller's promise.
    unsafe {
        let low = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); V];
        for b in 0..q.blocks() {
            let data = q.strip_block(s, b).as_ptr();
            let scales = q.strip_scales(s, b).as_ptr();
            _mm_prefetch::<_MM_HINT_T0>(data.wrapping_add(AHEAD).cast());
            _mm_prefetch::<_MM_HINT_T0>(data.wrapping_add(AHEAD + 64).cast());
            _mm_prefetch::<_MM_HINT_T0>(scales.wrapping_add(AHEAD / 8).cast());
            // w[g]: weights 4 g..4 g + 4 of the 16 rows.
            let mut w = [_mm512_setzero_si512(); 8];
            if q4 {
                for j in 0..4 {
                    let c = _mm512_loadu_si512(data.add(64 * j).cast());
                    w[j] = _mm512_and_si512(c, low);
                    w[j + 4] = _mm512_and_si512(_mm512_srli_epi32::<4>(c), low);
                }
            } else {
                for (g, w) in w.iter_mut().enumerate() {
                    *w = _mm512_loadu_si512(data.add(64 * g).cast());
                }
            }
            let d = _mm512_loadu_ps(scales);
            let m = _mm512_loadu_ps(scales.add(STRIP));
            for (acc, x) in acc.iter_mut().zip(xs) {
                let xb = x.q.as_ptr().add(BLOCK * b).cast::<i32>();
                let (mut i0, mut i1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                for g in (0..8).step_by(2) {
                    let (x0, x1) = (xb.add(g).read_unaligned(), xb.add(g + 1).read_unaligned());
                    i0 = _mm512_dpbusd_epi32(i0, w[g], _mm512_set1_epi32(x0));
                    i1 = _mm512_dpbusd_epi32(i1, w[g + 1], _mm512_set1_epi32(x1));
                }
                let mut isum = _mm512_add_epi32(i0, i1);
                if !q4 {
                    // The weights were stored plus 128.
                    isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * x.sum[b]));
                }
                let dd = _mm512_mul_ps(d, _mm512_set1_ps(x.d[b]));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), dd, *acc);
                if q4 {
                    *acc = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[b]), *acc);
                }
            }
        }
        let mut out = [[0f32; STRIP]; V];
        for (o, acc) in out.iter_mut().zip(acc) {
            _mm512_storeu_ps(o.as_mut_ptr(), acc);
        }
        out
    }
}

/// [`strip_vnni`] of one vector on AVX2: each 64-byte chunk of the strip is two registers
/// of eight rows, and a four-byte dot product is `VPMADDUBSW` (pairs, in 16 bits: no pair
/// of a Q4_1 nibble or of |w| <= 128 by a byte within ±127 overflows) then `VPMADDWD`.
/// Q8_0's weights are signed back and multiplied as |w| by x with w's sign. The scaling
/// is lane for lane the VNNI kernel's.
///
/// # Safety
///
/// The CPU has AVX2 and FMA; the vector is a row long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn strip_avx2(q: &QuantMatrix, s: usize, x: &Q8Vec) -> [f32; STRIP] {
    use std::arch::x86_64::*;
    let q4 = q.kind() == QuantKind::Q4_1;
    // SAFETY: as in `strip_vnni`: every load is inside the strip's block, its scales or
    // the vector's block; the features are the caller's promise.
    unsafe {
        let low = _mm256_set1_epi8(0x0F);
        let flip = _mm256_set1_epi8(-128);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); 2];
        for b in 0..q.blocks() {
            let data = q.strip_block(s, b).as_ptr();
            let scales = q.strip_scales(s, b).as_ptr();
            _mm_prefetch::<_MM_HINT_T0>(data.wrapping_add(AHEAD).cast());
            _mm_prefetch::<_MM_HINT_T0>(data.wrapping_add(AHEAD + 64).cast());
            _mm_prefetch::<_MM_HINT_T0>(scales.wrapping_add(AHEAD / 8).cast());
            let xb = x.q.as_ptr().add(BLOCK * b).cast::<i32>();
            for (half, acc) in acc.iter_mut().enumerate() {
                let mut isum = _mm256_setzero_si256();
                for g in 0..8 {
                    // Rows `8 half..` of weights `4 g..4 g + 4` (Q4_1: chunk g % 4, low
                    // nibbles for g < 4, high ones after).
                    let chunk = if q4 { g % 4 } else { g };
                    let c = _mm256_loadu_si256(data.add(64 * chunk + 32 * half).cast());
                    let xv = _mm256_set1_epi32(xb.add(g).read_unaligned());
                    let pairs = if q4 {
                        let w = if g < 4 {
                            _mm256_and_si256(c, low)
                        } else {
                            _mm256_and_si256(_mm256_srli_epi32::<4>(c), low)
                        };
                        _mm256_maddubs_epi16(w, xv)
                    } else {
                        let w = _mm256_xor_si256(c, flip);
                        _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w))
                    };
                    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, ones));
                }
                let d = _mm256_loadu_ps(scales.add(8 * half));
                let m = _mm256_loadu_ps(scales.add(STRIP + 8 * half));
                let dd = _mm256_mul_ps(d, _mm256_set1_ps(x.d[b]));
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dd, *acc);
                if q4 {
                    *acc = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s[b]), *acc);
                }
            }
        }
        let mut out = [0f32; STRIP];
        _mm256_storeu_ps(out.as_mut_ptr(), acc[0]);
        _mm256_storeu_ps(out.as_mut_ptr().add(8), acc[1]);
        out
    }
}

#[cfg(target_arch = "x86_64")]
mod amx {
    //! The AMX kernel: one `TDPBSUD` multiplies a block of up to 16 vectors (signed bytes,
    //! tile A: a vector a row) by the block of a strip's 16 rows (tile B: the strip's
    //! chunks as they are kept, Q4_1's nibbles widened to bytes first), into a tile of
    //! integer sums, a row of 16 (one a weight row) for each vector, then scaled as the
    //! VNNI kernel scales its own.
    //!
    //! The matrix is read as one stream of units, a unit a strip's block (the order
    //! [`QuantMatrix`] keeps them in), [`DEPTH`] units a stage. Three stages run at once, a
    //! stage apart: the nibbles of stage `i + 2` are widened while the tiles of stage
    //! `i + 1` are multiplied and stored and the sums of stage `i` are scaled. So no tile
    //! load waits for the stores that widened its weights, and no scaling for the store of
    //! its tile. (Two or three stages apart measured no faster: [`LAG`].)
    //!
    //! The tile instructions are written as inline assembly (the compiler's AMX
    //! intrinsics are not stable); the compiler never uses tile registers itself, so they
    //! hold their values from one `asm!` to the next.

    use std::arch::asm;
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{BLOCK, OnceLock, Q8Vec, QuantKind, QuantMatrix, STRIP};

    /// Vectors of a tile.
    pub(super) const VECTORS: usize = 16;

    /// Whether the CPU has AMX-INT8 and the kernel lets this process use the tiles.
    pub(super) fn available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            // CPUID leaf 7, EDX bits 24 (AMX-TILE) and 25 (AMX-INT8).
            super::vnni() && __cpuid_count(7, 0).edx & (3 << 24) == 3 << 24 && permitted()
        })
    }

    /// Asks Linux for the tile data state (`ARCH_REQ_XCOMP_PERM`, `XFEATURE_XTILEDATA`):
    /// without it the first tile instruction faults.
    #[cfg(target_os = "linux")]
    fn permitted() -> bool {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with this request only changes what the process may use.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn permitted() -> bool {
        false
    }

    /// The tile shapes: tmm0 to tmm3 the sums of four units (16 rows of 16 i32), tmm4 and
    /// tmm5 the vectors (16 rows of 32 bytes), tmm6 and tmm7 the weights (8 rows of 16
    /// rows by 4 bytes). A group of fewer vectors has zero rows past its last.
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    impl Config {
        fn new() -> Config {
            let mut c = [0u8; 64];
            c[0] = 1; // palette 1
            #[allow(clippy::cast_possible_truncation)] // 16
            let rows = VECTORS as u8;
            let shapes = [(64u16, rows); 4]
                .into_iter()
                .chain([(32, rows); 2])
                .chain([(64, 8); 2]);
            for (t, (colsb, rows)) in shapes.enumerate() {
                c[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
                c[48 + t] = rows;
            }
            Config(c)
        }
    }

    /// The tiles configured for [`Group::strips`], released when dropped.
    pub(super) struct Tiles(());

    impl Tiles {
        /// # Safety
        ///
        /// [`available`] said yes.
        pub(super) unsafe fn configure() -> Tiles {
            let config = Config::new();
            // SAFETY: loading a tile configuration is allowed once the process has the
            // permission (`available`, the caller's promise).
            unsafe { asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack)) };
            Tiles(())
        }
    }

    impl Drop for Tiles {
        fn drop(&mut self) {
            // SAFETY: releasing the tiles is always allowed; it spares every later context
            // switch of this thread saving them.
            unsafe { asm!("tilerelease", options(nostack)) };
        }
    }

    /// Units a stage multiplies at once, each into its own tile of sums.
    const DEPTH: usize = 4;

    /// Steps from a stage's widening to its multiplying, and from that to its scaling.
    const LAG: usize = 1;

    /// Buffers of each kind in flight.
    const SLOTS: usize = LAG + 1;

    /// Units the prefetches run ahead of the stage being widened.
    const AHEAD: usize = 8;

    /// Tiles of sums, [`DEPTH`] units of a row of 16 i32 for each vector.
    #[repr(C, align(64))]
    struct Sums([[[i32; STRIP]; VECTORS]; DEPTH]);

    /// [`DEPTH`] units' weights, as tile B takes them.
    #[repr(C, align(64))]
    struct Weights([[u8; 512]; DEPTH]);

    /// Up to [`DEPTH`] consecutive units from unit `first`, strip `strip`'s block `block`.
    #[derive(Clone, Copy)]
    struct Stage {
        first: usize,
        len: usize,
        strip: usize,
        block: usize,
        /// Blocks of a strip.
        blocks: usize,
    }

    impl Stage {
        /// Each unit's strip and block.
        fn units(self) -> impl Iterator<Item = (usize, usize)> {
            let (mut s, mut b) = (self.strip, self.block);
            (0..self.len).map(move |_| {
                let unit = (s, b);
                b += 1;
                if b == self.blocks {
                    (s, b) = (s + 1, 0);
                }
                unit
            })
        }
    }

    /// Up to [`VECTORS`] vectors as tile A takes them (a row each, zero rows past the
    /// last), and each block's `d`, `s` and the Q8_0 correction `128 sum` of every vector
    /// (zero past the last), so that the scaling runs over all 16 lanes with no branch on
    /// the group's size.
    #[derive(Debug)]
    pub(super) struct Group {
        len: usize,
        a: Vec<i8>,
        d: Vec<[f32; VECTORS]>,
        s: Vec<[f32; VECTORS]>,
        plus: Vec<[i32; VECTORS]>,
    }

    impl Group {
        pub(super) fn new(xs: &[Q8Vec]) -> Group {
            debug_assert!((1..=VECTORS).contains(&xs.len()));
            let cols = xs[0].q.len();
            let blocks = cols / BLOCK;
            let mut g = Group {
                len: xs.len(),
                a: vec![0i8; VECTORS * cols],
                d: vec![[0.0; VECTORS]; blocks],
                s: vec![[0.0; VECTORS]; blocks],
                plus: vec![[0; VECTORS]; blocks],
            };
            for (v, (row, x)) in g.a.chunks_exact_mut(cols).zip(xs).enumerate() {
                row.copy_from_slice(&x.q);
                for b in 0..blocks {
                    (g.d[b][v], g.s[b][v], g.plus[b][v]) = (x.d[b], x.s[b], 128 * x.sum[b]);
                }
            }
            g
        }

        pub(super) fn len(&self) -> usize {
            self.len
        }

        /// Strips `strips` of `q` times each vector, as [`super::strip_vnni`] computes
        /// them: `put(s, sums)` for each strip `s` in order, `sums[v]` its 16 rows' products
        /// with vector `v`.
        ///
        /// # Safety
        ///
        /// The tiles are configured ([`Tiles::configure`]); every vector is a row of `q`
        /// long; the strips exist.
        #[target_feature(enable = "avx512f")]
        pub(super) unsafe fn strips(
            &self,
            q: &QuantMatrix,
            strips: Range<usize>,
            put: impl FnMut(usize, &[[f32; STRIP]; VECTORS]),
        ) {
            // SAFETY: the caller's promises.
            unsafe {
                match q.kind() {
                    QuantKind::Q4_1 => self.strips_of::<true>(q, strips, put),
                    QuantKind::Q8_0 => self.strips_of::<false>(q, strips, put),
                }
            }
        }

        /// [`Self::strips`] of a Q4_1 (`Q4`) or Q8_0 matrix.
        ///
        /// # Safety
        ///
        /// As [`Self::strips`].
        #[target_feature(enable = "avx512f")]
        unsafe fn strips_of<const Q4: bool>(
            &self,
            q: &QuantMatrix,
            strips: Range<usize>,
            mut put: impl FnMut(usize, &[[f32; STRIP]; VECTORS]),
        ) {
            let blocks = q.blocks();
            let units = strips.start * blocks..strips.end * blocks;
            let stages = units.len().div_ceil(DEPTH);
            let stage = |i: usize| {
                let first = units.start + i * DEPTH;
                Stage {
                    first,
                    len: DEPTH.min(units.end - first),
                    strip: first / blocks,
                    block: first % blocks,
                    blocks,
                }
            };
            let mut sums: [Sums; SLOTS] =
                std::array::from_fn(|_| Sums([[[0; STRIP]; VECTORS]; DEPTH]));
            let mut wide: [Weights; SLOTS] = std::array::from_fn(|_| Weights([[0; 512]; DEPTH]));
            let mut acc = [_mm512_setzero_ps(); VECTORS];
            // SAFETY: the caller's promises; every stage is inside the strips' units, and
            // the buffers a stage reads were written `LAG` steps before and are not
            // written again until it was read (see the module docs).
            unsafe {
                for t in 0..stages + 2 * LAG {
                    if let Some(i) = t.checked_sub(LAG).filter(|&i| i < stages) {
                        self.issue::<Q4>(q, stage(i), &wide[i % SLOTS], &mut sums[i % SLOTS]);
                    }
                    if t < stages {
                        self.widen::<Q4>(q, stage(t), &mut wide[t % SLOTS]);
                    }
                    if let Some(i) = t.checked_sub(2 * LAG) {
                        acc = self.fold::<Q4>(q, stage(i), &sums[i % SLOTS], acc, &mut put);
                    }
                }
            }
        }

        /// Widens the Q4_1 nibbles of `units` into `wide` (Q8_0's tile B is read where it
        /// is kept), and asks memory for the units [`AHEAD`] of them.
        ///
        /// # Safety
        ///
        /// AVX-512F is the caller's; the units exist.
        #[inline(always)]
        unsafe fn widen<const Q4: bool>(&self, q: &QuantMatrix, stage: Stage, wide: &mut Weights) {
            let units = stage.first..stage.first + stage.len;
            let (packed, scales) = (q.packed(), q.scales());
            let unit_bytes = q.kind().chunks() * 64;
            for u in units.clone() {
                let at = (u + AHEAD) * unit_bytes;
                let scale_at = (u + AHEAD) * 2 * STRIP;
                // SAFETY: a prefetch never faults; its address is only computed.
                unsafe {
                    for line in (0..unit_bytes).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(packed.as_ptr().wrapping_add(at + line).cast());
                    }
                    for f in (0..2 * STRIP).step_by(16) {
                        _mm_prefetch::<_MM_HINT_T0>(
                            scales.as_ptr().wrapping_add(scale_at + f).cast(),
                        );
                    }
                }
            }
            if !Q4 {
                return;
            }
            for (wide, u) in wide.0.iter_mut().zip(units) {
                let data = &packed[u * unit_bytes..(u + 1) * unit_bytes];
                // SAFETY: 4 chunks of 64 bytes in, 8 out; AVX-512F is enabled here.
                unsafe {
                    let low = _mm512_set1_epi8(0x0F);
                    for j in 0..4 {
                        let c = _mm512_loadu_si512(data.as_ptr().add(64 * j).cast());
                        let (lo, hi) = (
                            _mm512_and_si512(c, low),
                            _mm512_and_si512(_mm512_srli_epi32::<4>(c), low),
                        );
                        _mm512_store_si512(wide.as_mut_ptr().add(64 * j).cast(), lo);
                        _mm512_store_si512(wide.as_mut_ptr().add(64 * (j + 4)).cast(), hi);
                    }
                }
            }
        }

        /// Multiplies `units` (at most [`DEPTH`]) into `sums`, their weights in `wide`
        /// (Q4_1) or in `q`.
        ///
        /// # Safety
        ///
        /// The tiles are configured; the units exist; `wide` holds their widened weights.
        #[inline(always)]
        unsafe fn issue<const Q4: bool>(
            &self,
            q: &QuantMatrix,
            stage: Stage,
            wide: &Weights,
            sums: &mut Sums,
        ) {
            let cols = q.cols();
            let weights = if Q4 {
                wide.0.as_ptr().cast::<u8>()
            } else {
                q.packed()[stage.first * 512..].as_ptr()
            };
            // Tile A of each unit: its block of every vector.
            let mut a = [self.a.as_ptr(); DEPTH];
            for (a, (_, block)) in a.iter_mut().zip(stage.units()) {
                *a = self.a[BLOCK * block..].as_ptr();
            }
            let c = sums.0.as_mut_ptr();
            // SAFETY: unit `i`'s tile A reads 16 rows of 32 bytes at `cols` from its
            // block's column of `a` (16 rows of `cols`), its tile B the 512 bytes at
            // `weights + 512 i` (`wide`, or the units as kept: whole ones, the range is
            // inside the matrix), its sums are stored into `sums.0[i]` (16 rows of 64
            // bytes). The shapes are those configured.
            unsafe {
                if stage.len == DEPTH {
                    asm!(
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "tilezero tmm2",
                        "tilezero tmm3",
                        "tileloadd tmm4, [{a0} + {sa} * 1]",
                        "tileloadd tmm6, [{w} + {s64} * 1]",
                        "tdpbsud tmm0, tmm4, tmm6",
                        "tileloadd tmm5, [{a1} + {sa} * 1]",
                        "tileloadd tmm7, [{w} + {s64} * 1 + 512]",
                        "tdpbsud tmm1, tmm5, tmm7",
                        "tileloadd tmm4, [{a2} + {sa} * 1]",
                        "tileloadd tmm6, [{w} + {s64} * 1 + 1024]",
                        "tdpbsud tmm2, tmm4, tmm6",
                        "tileloadd tmm5, [{a3} + {sa} * 1]",
                        "tileloadd tmm7, [{w} + {s64} * 1 + 1536]",
                        "tdpbsud tmm3, tmm5, tmm7",
                        "tilestored [{c} + {s64} * 1], tmm0",
                        "tilestored [{c} + {s64} * 1 + 1024], tmm1",
                        "tilestored [{c} + {s64} * 1 + 2048], tmm2",
                        "tilestored [{c} + {s64} * 1 + 3072], tmm3",
                        a0 = in(reg) a[0], a1 = in(reg) a[1], a2 = in(reg) a[2], a3 = in(reg) a[3],
                        sa = in(reg) cols, w = in(reg) weights,
                        c = in(reg) c, s64 = in(reg) 64usize,
                        options(nostack),
                    );
                } else {
                    for (i, a) in a.iter().take(stage.len).enumerate() {
                        asm!(
                            "tilezero tmm0",
                            "tileloadd tmm4, [{a} + {sa} * 1]",
                            "tileloadd tmm6, [{w} + {s64} * 1]",
                            "tdpbsud tmm0, tmm4, tmm6",
                            "tilestored [{c} + {s64} * 1], tmm0",
                            a = in(reg) *a, sa = in(reg) cols,
                            w = in(reg) weights.add(512 * i),
                            c = in(reg) c.add(i), s64 = in(reg) 64usize,
                            options(nostack),
                        );
                    }
                }
            }
        }

        /// Scales the sums of `units` into `acc` and returns it; a strip's first unit
        /// clears it and its last hands it to `put`.
        ///
        /// # Safety
        ///
        /// AVX-512F is the caller's; the units exist.
        #[inline(always)]
        unsafe fn fold<const Q4: bool>(
            &self,
            q: &QuantMatrix,
            stage: Stage,
            sums: &Sums,
            mut acc: [__m512; VECTORS],
            put: &mut impl FnMut(usize, &[[f32; STRIP]; VECTORS]),
        ) -> [__m512; VECTORS] {
            for (sums, (s, b)) in sums.0.iter().zip(stage.units()) {
                if b == 0 {
                    // SAFETY: AVX-512F is enabled here.
                    acc = [unsafe { _mm512_setzero_ps() }; VECTORS];
                }
                let scales = q.strip_scales(s, b);
                let (dx, sx, plus) = (&self.d[b], &self.s[b], &self.plus[b]);
                // SAFETY: 32 scales, 16 sums a vector; AVX-512F is enabled here. Past the
                // group's last vector the sums, `d` and `s` are zero: those lanes stay 0.
                unsafe {
                    let d = _mm512_loadu_ps(scales.as_ptr());
                    let m = _mm512_loadu_ps(scales.as_ptr().add(STRIP));
                    for v in 0..VECTORS {
                        let mut isum = _mm512_load_si512(sums[v].as_ptr().cast());
                        if !Q4 {
                            // The weights were kept plus 128.
                            isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(plus[v]));
                        }
                        let dd = _mm512_mul_ps(d, _mm512_set1_ps(dx[v]));
                        acc[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), dd, acc[v]);
                        if Q4 {
                            acc[v] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[v]), acc[v]);
                        }
                    }
                }
                if b + 1 == stage.blocks {
                    let mut out = [[0f32; STRIP]; VECTORS];
                    for (o, acc) in out.iter_mut().zip(acc.iter()) {
                        // SAFETY: 16 f32; AVX-512F is enabled here.
                        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *acc) };
                    }
                    put(s, &out);
                }
            }
            acc
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::tests::blocks;

    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        *seed >> 33
    }

    fn values(n: usize, seed: &mut u64) -> Vec<f32> {
        (0..n)
            .map(|_| (lcg(seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn quantizing_is_the_same_everywhere_and_keeps_non_finite_values() {
        let mut seed = 11;
        let mut x = values(32 * 12, &mut seed);
        x[3] = f32::NAN; // block 0
        x[40] = f32::INFINITY; // block 1
        x[64..96].fill(0.0); // block 2
        x[96..128].iter_mut().for_each(|v| *v *= 1e-38); // block 3: too small to scale
        // Ties: block 4's largest is 127, so its values are their own quotients.
        for (i, v) in x[128..160].iter_mut().enumerate() {
            *v = i as f32 - 15.5;
        }
        x[159] = 127.0;
        let v = Q8Vec::new(&x);
        let mut want = Q8Vec {
            q: vec![0; x.len()],
            d: vec![0.0; 12],
            s: vec![0.0; 12],
            sum: vec![0; 12],
        };
        for (b, (x, q)) in x
            .chunks_exact(BLOCK)
            .zip(want.q.chunks_exact_mut(BLOCK))
            .enumerate()
        {
            (want.d[b], want.s[b], want.sum[b]) = quantize_block(x, q);
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(v.q, want.q);
        assert_eq!(bits(&v.d), bits(&want.d));
        assert_eq!(bits(&v.s), bits(&want.s));
        assert!(v.d[0].is_nan() && v.d[1].is_nan() && v.s[1].is_nan());
        assert_eq!((v.d[2], v.d[3]), (0.0, 0.0));
        assert!(v.q[96..128].iter().all(|&q| q == 0));
        // -15.5 and -14.5 .. 15.5 round to even; 127 stays 127.
        assert_eq!(&v.q[128..132], &[-16, -14, -14, -12]);
        assert_eq!(v.q[159], 127);
        // Elsewhere the quantized values are within half a step of the input.
        for b in 5..12 {
            for (q, x) in v.q[b * 32..(b + 1) * 32].iter().zip(&x[b * 32..]) {
                assert!((f32::from(*q) * v.d[b] - x).abs() <= v.d[b] * 0.5 + 1e-7);
            }
        }
    }

    /// Every kernel this CPU runs gives every (row, vector) the reference's bits, for any
    /// number of vectors (one or two tile groups) and rows (whole tiles and a tail), and
    /// the result is close to the product of the dequantized weights in f32.
    #[test]
    fn every_kernel_gives_the_reference_bits() {
        let mut seed = 5;
        for kind in [QuantKind::Q4_1, QuantKind::Q8_0] {
            for (rows, cols) in [(40, 64), (35, 576), (16, 32)] {
                let bytes = blocks(kind, rows, cols, &mut seed);
                let mut f = vec![0f32; rows * cols];
                crate::gguf::dequantize_into(kind.ggml_type(), &bytes, &mut f).unwrap();
                let q = QuantMatrix::new(kind, rows, cols, bytes).unwrap();
                for vectors in [1, 2, 7, 16, 17] {
                    let xs: Vec<Q8Vec> = (0..vectors)
                        .map(|_| Q8Vec::new(&values(cols, &mut seed)))
                        .collect();
                    // Rows from 1: strips that do not start at a multiple of 16.
                    let span = 1..rows;
                    let n = span.len();
                    let mut got = vec![0f32; vectors * n];
                    let xs = Vectors::new(xs);
                    matvec(&q, &xs, span.clone(), &mut got, n);
                    for kernel in Kernel::all() {
                        let mut other = vec![0f32; vectors * n];
                        matvec_with(kernel, &q, &xs, span.clone(), &mut other, n);
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&other),
                            bits(&got),
                            "{kernel:?}, {kind:?} {rows}x{cols}, {vectors} vectors"
                        );
                    }
                    for (v, x) in xs.q8.iter().enumerate() {
                        for (i, r) in span.clone().enumerate() {
                            let want = dot_portable(&q, r, x);
                            assert_eq!(
                                got[v * n + i].to_bits(),
                                want.to_bits(),
                                "{kind:?} {rows}x{cols}, {vectors} vectors: row {r} vector {v}"
                            );
                            // The dequantized product, of the quantized vector's values.
                            let xq: Vec<f32> = (0..cols)
                                .map(|i| f32::from(x.q[i]) * x.d[i / BLOCK])
                                .collect();
                            let exact: f64 = f[r * cols..(r + 1) * cols]
                                .iter()
                                .zip(&xq)
                                .map(|(w, x)| f64::from(*w) * f64::from(*x))
                                .sum();
                            let scale: f64 = f[r * cols..(r + 1) * cols]
                                .iter()
                                .zip(&xq)
                                .map(|(w, x)| (f64::from(*w) * f64::from(*x)).abs())
                                .sum();
                            assert!(
                                (f64::from(want) - exact).abs() <= 1e-5 * scale + 1e-6,
                                "{kind:?} row {r} vector {v}: {want} against {exact}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_vector_that_is_not_finite_gives_nan() {
        let mut seed = 9;
        let bytes = blocks(QuantKind::Q4_1, 32, 64, &mut seed);
        let q = QuantMatrix::new(QuantKind::Q4_1, 32, 64, bytes).unwrap();
        let mut x = values(64, &mut seed);
        x[50] = f32::NAN;
        let xs = Vectors::new(vec![Q8Vec::new(&values(64, &mut seed)), Q8Vec::new(&x)]);
        let mut out = vec![0f32; 64];
        matvec(&q, &xs, 0..32, &mut out, 32);
        assert!(out[..32].iter().all(|v| v.is_finite()));
        assert!(out[32..].iter().all(|v| v.is_nan()));
    }
}
