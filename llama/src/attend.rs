//! Decode attention's two kernels over bf16 pages, read where they lie.
//!
//! Decode attention reads, for each KV head, a page's slab of keys (`[slot][head_dim]`
//! bf16), scores it against the query heads of that KV head, and then sums the page's
//! values weighted by the softmax of the scores. The plain way ([`crate::math::decode`]
//! into a buffer, then [`crate::math::matvec`] or [`crate::math::weighted_sum`] for each
//! query head) widens every value into memory and reads it back once a query head. The
//! kernels here widen each row in registers once for all the query heads that read it.
//!
//! They also spread the prefetch of the next slab over the rows of this one: pages lie
//! anywhere, so no hardware prefetcher sees the next one coming, and asking for a whole
//! slab at once fills the line-fill buffers, stalling the core until most of it arrived.
//!
//! Each result is the same bits as the plain way's on a CPU with AVX2 and FMA (the only
//! place they run): a score is summed as [`crate::math::matvec`] sums a row of
//! `head_dim` (eight lanes, multiply-adds in order, the lanes added in a fixed tree), and a
//! weighted sum adds slot after slot, lane by lane. Tests compare them bit for bit.

/// Query heads a kernel call takes at once (a KV head's group; more go round again).
const HEADS: usize = 4;

/// The groups a call's `heads` query heads go in, each `(first head, heads, prefetch)`:
/// [`HEADS`] at a time, only the first pass over the rows prefetching `ahead`.
fn groups(heads: usize, ahead: &[u8]) -> impl Iterator<Item = (usize, usize, &[u8])> {
    (0..heads)
        .step_by(HEADS)
        .map(move |j| (j, HEADS.min(heads - j), if j == 0 { ahead } else { &[] }))
}

/// `x86::$kernel::<N>(args)` for `N = $n` (1 to [`HEADS`]): a kernel keeps an accumulator
/// a head in registers, so its count of heads is a constant.
macro_rules! with_heads {
    ($n:expr, $kernel:ident, $($arg:expr),*) => {
        match $n {
            1 => x86::$kernel::<1>($($arg),*),
            2 => x86::$kernel::<2>($($arg),*),
            3 => x86::$kernel::<3>($($arg),*),
            _ => x86::$kernel::<4>($($arg),*),
        }
    };
}

/// Whether the kernels run on this CPU (else the caller goes the plain way).
pub(crate) fn available() -> bool {
    crate::math::has_avx2_fma()
}

/// `out[j * stride + t]` = query head `j` of `q` (`[heads][hd]`) · key `t` of `keys`
/// (`[slots][hd]` bf16, little-endian), for every `t` below `keys.len() / (2 hd)`; the
/// rows of `ahead` are asked of memory one a key.
///
/// # Panics
///
/// If [`available`] is false, `hd` is not a multiple of 8, `q` is not whole heads or `out`
/// is too short (bugs in the caller).
pub(crate) fn scores(
    keys: &[u8],
    hd: usize,
    q: &[f32],
    out: &mut [f32],
    stride: usize,
    ahead: &[u8],
) {
    assert!(available(), "attend::scores without AVX2 and FMA");
    assert!(hd > 0 && hd.is_multiple_of(8) && q.len().is_multiple_of(hd));
    let (heads, slots) = (q.len() / hd, keys.len() / (2 * hd));
    if heads == 0 || slots == 0 {
        return;
    }
    assert!(
        out.len() >= (heads - 1) * stride + slots,
        "attend::scores: out too short"
    );
    for (j, n, ahead) in groups(heads, ahead) {
        let (q, out) = (&q[j * hd..(j + n) * hd], &mut out[j * stride..]);
        // SAFETY: the CPU has AVX2 and FMA (asserted); the shapes are asserted above.
        unsafe { with_heads!(n, scores, keys, hd, q, out, stride, ahead) };
    }
}

/// `out[j * hd..(j + 1) * hd] += sum_t p[j * stride + t] value_t` for each query head `j`
/// of `out` (`[heads][hd]`) over the values of `values` (`[slots][hd]` bf16), slot after
/// slot; the rows of `ahead` are asked of memory one a value.
///
/// # Panics
///
/// As [`scores`], or if `p` is too short.
pub(crate) fn weighted(
    values: &[u8],
    hd: usize,
    p: &[f32],
    stride: usize,
    out: &mut [f32],
    ahead: &[u8],
) {
    assert!(available(), "attend::weighted without AVX2 and FMA");
    assert!(hd > 0 && hd.is_multiple_of(8) && out.len().is_multiple_of(hd));
    let (heads, slots) = (out.len() / hd, values.len() / (2 * hd));
    if heads == 0 || slots == 0 {
        return;
    }
    assert!(
        p.len() >= (heads - 1) * stride + slots,
        "attend::weighted: p too short"
    );
    for (j, n, ahead) in groups(heads, ahead) {
        let (p, out) = (&p[j * stride..], &mut out[j * hd..(j + n) * hd]);
        // SAFETY: as in `scores`.
        unsafe { with_heads!(n, weighted, values, hd, p, stride, out, ahead) };
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Eight bf16 at `at` as f32.
    #[inline(always)]
    unsafe fn widen(at: *const u8) -> __m256 {
        // SAFETY: 16 bytes at `at` (the caller's promise); AVX2 is the caller's.
        unsafe {
            let h = _mm_loadu_si128(at.cast());
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }

    /// The lanes of `a` added as `math::sum_lanes` adds them.
    #[inline(always)]
    unsafe fn sum_lanes(a: __m256) -> f32 {
        // SAFETY: register arithmetic; AVX is the caller's.
        unsafe {
            // [a0 + a4, a1 + a5, a2 + a6, a3 + a7]
            let b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
            // [b0 + b2, b1 + b3, ..]
            let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
            _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps::<1>(c, c)))
        }
    }

    /// Asks memory for row `t` (`row` bytes) of `ahead`, if it has one.
    #[inline(always)]
    fn prefetch_row(ahead: &[u8], t: usize, row: usize) {
        if let Some(bytes) = ahead.get(t * row..(t + 1) * row) {
            for line in (0..row).step_by(64) {
                // SAFETY: a prefetch never faults; its address is inside `bytes`.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(line).cast()) };
            }
        }
    }

    /// [`super::scores`] for `N` query heads.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA; the shapes are [`super::scores`]'s.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores<const N: usize>(
        keys: &[u8],
        hd: usize,
        q: &[f32],
        out: &mut [f32],
        stride: usize,
        ahead: &[u8],
    ) {
        let (row, slots) = (2 * hd, keys.len() / (2 * hd));
        for t in 0..slots {
            prefetch_row(ahead, t, row);
            let k = keys[t * row..(t + 1) * row].as_ptr();
            let mut acc = [_mm256_setzero_ps(); N];
            for c in 0..hd / 8 {
                // SAFETY: 8 values of the key and of each head's query, inside both.
                unsafe {
                    let k = widen(k.add(16 * c));
                    for (j, acc) in acc.iter_mut().enumerate() {
                        let q = _mm256_loadu_ps(q.as_ptr().add(j * hd + 8 * c));
                        *acc = _mm256_fmadd_ps(k, q, *acc);
                    }
                }
            }
            for (j, acc) in acc.into_iter().enumerate() {
                // SAFETY: register arithmetic.
                out[j * stride + t] = unsafe { sum_lanes(acc) };
            }
        }
        for t in slots..ahead.len() / row {
            prefetch_row(ahead, t, row);
        }
    }

    /// Lanes of the output a pass over the values keeps in registers, for each head.
    const LANES: usize = 16;

    /// [`super::weighted`] for `N` query heads.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA; the shapes are [`super::weighted`]'s.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weighted<const N: usize>(
        values: &[u8],
        hd: usize,
        p: &[f32],
        stride: usize,
        out: &mut [f32],
        ahead: &[u8],
    ) {
        let (row, slots) = (2 * hd, values.len() / (2 * hd));
        let mut start = 0;
        while start < hd {
            // Eight or sixteen lanes of each head's output (`hd` is a multiple of 8).
            let two = start + LANES <= hd;
            let mut acc = [[_mm256_setzero_ps(); 2]; N];
            // SAFETY: the lanes `start..start + 8` (and `+ 16` when `two`) of each head's
            // output, inside `out` (`N` heads of `hd`).
            unsafe {
                for (j, acc) in acc.iter_mut().enumerate() {
                    let o = out.as_ptr().add(j * hd + start);
                    acc[0] = _mm256_loadu_ps(o);
                    if two {
                        acc[1] = _mm256_loadu_ps(o.add(8));
                    }
                }
            }
            for t in 0..slots {
                if start == 0 {
                    prefetch_row(ahead, t, row);
                }
                let v = values[t * row + 2 * start..(t + 1) * row].as_ptr();
                // SAFETY: 8 (or 16) values of row `t` from lane `start`, inside the row;
                // `p[j * stride + t]` is inside `p` (the caller's shapes).
                unsafe {
                    let v0 = widen(v);
                    let v1 = if two { widen(v.add(16)) } else { v0 };
                    for (j, acc) in acc.iter_mut().enumerate() {
                        let w = _mm256_set1_ps(*p.get_unchecked(j * stride + t));
                        acc[0] = _mm256_fmadd_ps(w, v0, acc[0]);
                        if two {
                            acc[1] = _mm256_fmadd_ps(w, v1, acc[1]);
                        }
                    }
                }
            }
            // SAFETY: as the loads above.
            unsafe {
                for (j, acc) in acc.iter().enumerate() {
                    let o = out.as_mut_ptr().add(j * hd + start);
                    _mm256_storeu_ps(o, acc[0]);
                    if two {
                        _mm256_storeu_ps(o.add(8), acc[1]);
                    }
                }
            }
            start += if two { LANES } else { 8 };
        }
        for t in slots..ahead.len() / row {
            prefetch_row(ahead, t, row);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    pub(super) unsafe fn scores<const N: usize>(
        _: &[u8],
        _: usize,
        _: &[f32],
        _: &mut [f32],
        _: usize,
        _: &[u8],
    ) {
        unreachable!("attend::available is false off x86_64")
    }

    pub(super) unsafe fn weighted<const N: usize>(
        _: &[u8],
        _: usize,
        _: &[f32],
        _: usize,
        _: &mut [f32],
        _: &[u8],
    ) {
        unreachable!("attend::available is false off x86_64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::math;
    use libkv::Dtype;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn bf16_rows(n: usize, seed: &mut u64) -> Vec<u8> {
        let mut x: Vec<f32> = (0..n).map(|_| lcg(seed) * 3.0).collect();
        math::round_to(Dtype::Bf16, &mut x);
        let mut bytes = vec![0u8; 2 * n];
        math::encode(Dtype::Bf16, &x, &mut bytes);
        bytes
    }

    #[test]
    fn the_kernels_give_the_plain_way_s_bits() {
        if !available() {
            eprintln!("no AVX2 and FMA here: nothing to compare");
            return;
        }
        let mut seed = 7u64;
        for hd in [8, 24, 64, 128] {
            for heads in 1..=6 {
                for slots in [1, 3, 16, 17] {
                    let keys = bf16_rows(slots * hd, &mut seed);
                    let q: Vec<f32> = (0..heads * hd).map(|_| lcg(&mut seed)).collect();
                    let stride = slots + 5;
                    let ahead = bf16_rows(16 * hd, &mut seed);
                    let mut got = vec![f32::NAN; heads * stride];
                    scores(&keys, hd, &q, &mut got, stride, &ahead);
                    let mut k = vec![0f32; slots * hd];
                    math::decode(Dtype::Bf16, &keys, &mut k);
                    for j in 0..heads {
                        let mut want = vec![0f32; slots];
                        math::matvec(&k, &q[j * hd..(j + 1) * hd], &mut want);
                        let got: Vec<u32> = got[j * stride..j * stride + slots]
                            .iter()
                            .map(|v| v.to_bits())
                            .collect();
                        let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
                        assert_eq!(
                            got, want,
                            "scores, hd {hd}, head {j} of {heads}, {slots} slots"
                        );
                    }
                    let p: Vec<f32> = (0..heads * stride).map(|_| lcg(&mut seed).abs()).collect();
                    let start: Vec<f32> = (0..heads * hd).map(|_| lcg(&mut seed)).collect();
                    let mut got = start.clone();
                    weighted(&keys, hd, &p, stride, &mut got, &ahead);
                    for j in 0..heads {
                        let mut want = start[j * hd..(j + 1) * hd].to_vec();
                        math::weighted_sum(&p[j * stride..j * stride + slots], &k, &mut want);
                        let got: Vec<u32> = got[j * hd..(j + 1) * hd]
                            .iter()
                            .map(|v| v.to_bits())
                            .collect();
                        let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
                        assert_eq!(
                            got, want,
                            "weighted, hd {hd}, head {j} of {heads}, {slots} slots"
                        );
                    }
                }
            }
        }
    }

    /// Scores and weighted sums over slabs laid out as decode reads them (a page's three
    /// KV heads' slabs side by side, pages anywhere), from a buffer far larger than the
    /// caches and from one that fits in L2: how far the kernels are from memory's speed.
    #[test]
    #[ignore = "a measurement: cargo test --release -p llama --lib attend_speed -- --ignored"]
    fn attend_speed() {
        if !available() {
            return;
        }
        let (hd, heads, tpp, kv_heads) = (64, 3, 16, 3);
        let slab = tpp * hd * 2;
        let block = kv_heads * slab;
        let mut seed = 3u64;
        for (what, bytes) in [("cold", 256usize << 20), ("hot", 1 << 20)] {
            let buf = bf16_rows(bytes / 2, &mut seed);
            let blocks = bytes / block;
            // 16 requests x 10 pages, each page a random block.
            let order: Vec<usize> = (0..160 * 30)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    usize::try_from(seed >> 33).unwrap_or(0) % blocks
                })
                .collect();
            let q: Vec<f32> = (0..heads * hd).map(|_| lcg(&mut seed)).collect();
            let p = vec![0.01f32; heads * tpp];
            let (mut out, mut acc) = (vec![0f32; heads * tpp], vec![0f32; heads * hd]);
            let at = |b: usize, g: usize| &buf[order[b] * block + g * slab..][..slab];
            // Each slab in order, the same head's slab of the next page prefetched.
            let time = |kernel: &str, run: &mut dyn FnMut(&[u8], &[u8])| {
                let t = std::time::Instant::now();
                for b in 0..order.len() {
                    for g in 0..kv_heads {
                        let ahead = if b + 1 < order.len() {
                            at(b + 1, g)
                        } else {
                            &[]
                        };
                        run(at(b, g), ahead);
                    }
                }
                let s = t.elapsed().as_secs_f64();
                eprintln!(
                    "{kernel} {what}: {:.1} ns a row, {:.2} GB/s",
                    s * 1e9 / (order.len() * kv_heads * tpp) as f64,
                    (order.len() * block) as f64 / s / 1e9
                );
            };
            time("scores", &mut |keys, ahead| {
                scores(keys, hd, &q, &mut out, tpp, ahead);
            });
            time("weighted", &mut |values, ahead| {
                weighted(values, hd, &p, tpp, &mut acc, ahead);
            });
        }
    }
}
