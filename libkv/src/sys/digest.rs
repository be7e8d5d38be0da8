//! crc32c, the page digest, at memory speed.
//!
//! [`Crc32c`] absorbs bytes in any number of pieces and gives the crc32c of all of them, the
//! same value as `crc32c::crc32c_append`. On x86-64 CPUs with AVX-512 and VPCLMULQDQ it folds
//! 256 bytes at a time with carry-less multiplication into four 512-bit accumulators that
//! carry over from one piece to the next, so a page digested chunk by chunk, as its bytes
//! land, costs no more than one pass over the whole page; other CPUs use the crc32c crate
//! (the SSE4.2 or ARMv8 crc32c instruction, else tables).
//!
//! The folding is the standard one for a reflected CRC: a 128-bit lane `X` that stands for
//! the bits `F` bits before the end of what has been absorbed is replaced by
//! `lo(X)·k1 ⊕ hi(X)·k2`, with `k1 = x^(F+63) mod P` and `k2 = x^(F-1) mod P` (bit-reversed,
//! the extra `x^-1` compensating the one a reflected carry-less product carries); the last
//! 128 bits are reduced with two crc32 instructions.

/// A crc32c being computed over bytes absorbed piece by piece.
#[derive(Clone, Debug)]
pub struct Crc32c {
    /// The crc32c of what was absorbed before `acc` (in `crc32c_append` form).
    crc: u32,
    /// Folding accumulators: the bytes absorbed since `crc`, a multiple of 256 and at least
    /// 256, folded into 64 bytes per accumulator.
    acc: Option<[[u64; 8]; 4]>,
    /// Whether this CPU folds (checked once, when the value is made).
    fold: bool,
}

impl Default for Crc32c {
    fn default() -> Self {
        Self::new(0)
    }
}

impl Crc32c {
    /// A crc32c that continues from `crc` (0 for a fresh one).
    pub fn new(crc: u32) -> Self {
        Crc32c {
            crc,
            acc: None,
            fold: accelerated(),
        }
    }

    /// The same, never using the folding path (for tests and comparisons).
    pub fn portable(crc: u32) -> Self {
        Crc32c {
            crc,
            acc: None,
            fold: false,
        }
    }

    /// Absorbs `bytes`.
    pub fn update(&mut self, bytes: &[u8]) {
        let mut rest = bytes;
        #[cfg(target_arch = "x86_64")]
        if self.fold && rest.len() >= BLOCK {
            let (blocks, tail) = rest.split_at(rest.len() / BLOCK * BLOCK);
            // SAFETY: `fold` is set only where the CPU has AVX-512F and VPCLMULQDQ
            // (`accelerated`), the features `fold_blocks` is compiled for.
            unsafe { x86::fold_blocks(&mut self.acc, self.crc, blocks) };
            rest = tail;
        }
        if !rest.is_empty() {
            self.crc = crc32c::crc32c_append(self.value(), rest);
            self.acc = None;
        }
    }

    /// The crc32c of everything absorbed.
    pub fn value(&self) -> u32 {
        match &self.acc {
            None => self.crc,
            #[cfg(target_arch = "x86_64")]
            // SAFETY: accumulators exist only when `fold` was set, i.e. on a CPU with the
            // features `reduce` is compiled for.
            Some(acc) => unsafe { x86::reduce(acc) },
            #[cfg(not(target_arch = "x86_64"))]
            Some(_) => self.crc,
        }
    }
}

/// The crc32c of `bytes` continuing from `crc`, as `crc32c::crc32c_append` computes it.
pub fn crc32c_append(crc: u32, bytes: &[u8]) -> u32 {
    let mut c = Crc32c::new(crc);
    c.update(bytes);
    c.value()
}

/// Bytes folded per step.
const BLOCK: usize = 256;

/// Whether this CPU takes the folding path.
pub fn accelerated() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("vpclmulqdq")
            && std::is_x86_feature_detected!("pclmulqdq")
            && std::is_x86_feature_detected!("sse4.2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `x^n mod P` for crc32c's polynomial `P` (0x1EDC6F41), bits in normal order.
const fn xpow_mod(n: u32) -> u32 {
    let mut r: u64 = 1;
    let mut i = 0;
    while i < n {
        r <<= 1;
        if r & (1 << 32) != 0 {
            r ^= 0x1_1EDC_6F41;
        }
        i += 1;
    }
    // Below 2^32 after every reduction.
    #[allow(clippy::cast_possible_truncation)]
    let r = r as u32;
    r
}

/// The two constants that fold a 128-bit lane forward by `bits`: for its low and its high
/// 64 bits, bit-reversed for the reflected carry-less product.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const fn fold_constants(bits: u32) -> (u64, u64) {
    (
        (xpow_mod(bits + 63) as u64).reverse_bits(),
        (xpow_mod(bits - 1) as u64).reverse_bits(),
    )
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{BLOCK, fold_constants};
    use std::arch::x86_64::{
        __m128i, __m512i, _mm_clmulepi64_si128, _mm_crc32_u64, _mm_cvtsi32_si128,
        _mm_cvtsi128_si64, _mm_extract_epi64, _mm_set_epi64x, _mm_xor_si128,
        _mm512_castsi128_si512, _mm512_clmulepi64_epi128, _mm512_extracti32x4_epi32,
        _mm512_loadu_si512, _mm512_set_epi64, _mm512_setzero_si512, _mm512_storeu_si512,
        _mm512_ternarylogic_epi64, _mm512_xor_si512,
    };

    const K_2048: (u64, u64) = fold_constants(2048);
    const K_1536: (u64, u64) = fold_constants(1536);
    const K_1024: (u64, u64) = fold_constants(1024);
    const K_512: (u64, u64) = fold_constants(512);
    const K_384: (u64, u64) = fold_constants(384);
    const K_256: (u64, u64) = fold_constants(256);
    const K_128: (u64, u64) = fold_constants(128);

    #[allow(clippy::cast_possible_wrap)]
    #[inline]
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    fn constants(k: (u64, u64)) -> __m512i {
        let (lo, hi) = (k.0 as i64, k.1 as i64);
        _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo)
    }

    /// `x` folded forward by the distance `k` stands for, xored with `next`.
    #[inline]
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    fn fold(x: __m512i, k: __m512i, next: __m512i) -> __m512i {
        let lo = _mm512_clmulepi64_epi128(x, k, 0x00);
        let hi = _mm512_clmulepi64_epi128(x, k, 0x11);
        _mm512_ternarylogic_epi64(lo, hi, next, 0x96)
    }

    #[allow(clippy::cast_possible_wrap)]
    #[inline]
    #[target_feature(enable = "pclmulqdq,sse4.2")]
    fn fold_lane(x: __m128i, k: (u64, u64)) -> __m128i {
        let k = _mm_set_epi64x(k.1 as i64, k.0 as i64);
        _mm_xor_si128(
            _mm_clmulepi64_si128(x, k, 0x00),
            _mm_clmulepi64_si128(x, k, 0x11),
        )
    }

    /// Folds `data` (a non-empty multiple of [`BLOCK`] bytes) into `acc`, starting the
    /// accumulators from `crc` when there are none yet.
    ///
    /// # Safety
    /// The CPU must have AVX-512F, VPCLMULQDQ, PCLMULQDQ and SSE4.2.
    #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
    pub(super) unsafe fn fold_blocks(acc: &mut Option<[[u64; 8]; 4]>, crc: u32, data: &[u8]) {
        debug_assert!(!data.is_empty() && data.len().is_multiple_of(BLOCK));
        let mut blocks = data.chunks_exact(BLOCK);
        let [mut a0, mut a1, mut a2, mut a3] = match acc {
            Some(a) => load_acc(a),
            None => {
                let Some(first) = blocks.next() else { return };
                // The start state enters as an xor into the first 32 bits of the data.
                #[allow(clippy::cast_possible_wrap)]
                let init = _mm512_castsi128_si512(_mm_cvtsi32_si128(!crc as i32));
                let [b0, b1, b2, b3] = load_block(first);
                [_mm512_xor_si512(b0, init), b1, b2, b3]
            }
        };
        let k = constants(K_2048);
        for b in blocks {
            let [b0, b1, b2, b3] = load_block(b);
            a0 = fold(a0, k, b0);
            a1 = fold(a1, k, b1);
            a2 = fold(a2, k, b2);
            a3 = fold(a3, k, b3);
        }
        let mut out = [[0u64; 8]; 4];
        for (o, v) in out.iter_mut().zip([a0, a1, a2, a3]) {
            // SAFETY: `o` is 64 bytes of plain memory; the store is unaligned.
            unsafe { _mm512_storeu_si512(o.as_mut_ptr().cast(), v) };
        }
        *acc = Some(out);
    }

    /// The four 64-byte quarters of one block.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn load_block(b: &[u8]) -> [__m512i; 4] {
        assert!(b.len() >= BLOCK);
        let p = b.as_ptr();
        // SAFETY: `b` holds at least BLOCK = 4 * 64 bytes (asserted); the loads are
        // unaligned.
        unsafe {
            [
                _mm512_loadu_si512(p.cast()),
                _mm512_loadu_si512(p.add(64).cast()),
                _mm512_loadu_si512(p.add(128).cast()),
                _mm512_loadu_si512(p.add(192).cast()),
            ]
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn load_acc(a: &[[u64; 8]; 4]) -> [__m512i; 4] {
        // SAFETY: each accumulator is 64 bytes of plain memory; the loads are unaligned.
        unsafe {
            [
                _mm512_loadu_si512(a[0].as_ptr().cast()),
                _mm512_loadu_si512(a[1].as_ptr().cast()),
                _mm512_loadu_si512(a[2].as_ptr().cast()),
                _mm512_loadu_si512(a[3].as_ptr().cast()),
            ]
        }
    }

    /// The crc32c (in `crc32c_append` form) that the accumulators stand for.
    ///
    /// # Safety
    /// As [`fold_blocks`].
    #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
    pub(super) unsafe fn reduce(acc: &[[u64; 8]; 4]) -> u32 {
        let [a0, a1, a2, a3] = load_acc(acc);
        let zero = _mm512_setzero_si512();
        // The four accumulators into one 64-byte value, then its four lanes into one.
        let x = _mm512_ternarylogic_epi64(
            fold(a0, constants(K_1536), zero),
            fold(a1, constants(K_1024), zero),
            fold(a2, constants(K_512), a3),
            0x96,
        );
        let lanes = [
            _mm512_extracti32x4_epi32::<0>(x),
            _mm512_extracti32x4_epi32::<1>(x),
            _mm512_extracti32x4_epi32::<2>(x),
            _mm512_extracti32x4_epi32::<3>(x),
        ];
        let y = _mm_xor_si128(
            _mm_xor_si128(fold_lane(lanes[0], K_384), fold_lane(lanes[1], K_256)),
            _mm_xor_si128(fold_lane(lanes[2], K_128), lanes[3]),
        );
        #[allow(clippy::cast_sign_loss)]
        let (lo, hi) = (
            _mm_cvtsi128_si64(y) as u64,
            _mm_extract_epi64::<1>(y) as u64,
        );
        // The crc32 of the last 16 bytes from a zero state is the state after all of them.
        #[allow(clippy::cast_possible_truncation)]
        let state = _mm_crc32_u64(_mm_crc32_u64(0, lo), hi) as u32;
        !state
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bytes(n: usize, seed: u32) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x.to_le_bytes()[0]
            })
            .collect()
    }

    #[test]
    fn matches_the_crc32c_crate_at_every_size_around_the_block() {
        for n in [
            0,
            1,
            15,
            16,
            255,
            256,
            257,
            511,
            512,
            513,
            4096,
            65536,
            65536 + 77,
        ] {
            let data = bytes(n, 7);
            for init in [0, 1, 0xdead_beef, u32::MAX] {
                let want = crc32c::crc32c_append(init, &data);
                assert_eq!(crc32c_append(init, &data), want, "n={n} init={init:#x}");
                let mut p = Crc32c::portable(init);
                p.update(&data);
                assert_eq!(p.value(), want, "portable n={n}");
            }
        }
        // Says which path this machine's tests covered.
        eprintln!("crc32c folding path: {}", accelerated());
    }

    #[test]
    fn a_long_page_in_chunks_of_every_kind() {
        let data = bytes(1 << 20, 3);
        let want = crc32c::crc32c(&data);
        for chunk in [256, 4096, 4096 + 256, 1000, 77] {
            let mut c = Crc32c::new(0);
            for piece in data.chunks(chunk) {
                c.update(piece);
            }
            assert_eq!(c.value(), want, "chunk {chunk}");
        }
    }

    proptest! {
        #[test]
        fn pieces_in_any_split_give_the_same_crc(
            data in proptest::collection::vec(any::<u8>(), 0..3000),
            cuts in proptest::collection::vec(0usize..3000, 0..6),
            init in any::<u32>(),
        ) {
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(data.len())).collect();
            cuts.sort_unstable();
            let mut c = Crc32c::new(init);
            let mut at = 0;
            for cut in cuts.into_iter().chain([data.len()]) {
                c.update(&data[at..cut]);
                // reading the value in the middle changes nothing
                let _ = c.value();
                at = cut;
            }
            prop_assert_eq!(c.value(), crc32c::crc32c_append(init, &data));
        }
    }
}
