//! crc32c, the page digest, at memory speed.
//!
//! [`Crc32c`] absorbs bytes in any number of pieces and gives the crc32c of all of them, the
//! same value as `crc32c::crc32c_append`. On x86-64 CPUs with VPCLMULQDQ it folds 256 bytes
//! at a time with carry-less multiplication into accumulators that carry over from one piece
//! to the next, so a page digested chunk by chunk, as its bytes land, costs no more than one
//! pass over the whole page. There are two folding paths ([`Path`]), chosen at run time: four
//! 512-bit accumulators where the CPU has AVX-512, else eight 256-bit ones (AVX2). Both keep
//! the same 256 bytes of state, so either one's accumulators mean the same thing. Other CPUs
//! use the crc32c crate (the SSE4.2 or ARMv8 crc32c instruction, else tables).
//!
//! [`Crc32c::copy`] copies bytes and absorbs them in the same pass, folding the very
//! registers it stored: the folding runs faster than memory delivers the bytes, so a copy
//! out of memory costs hardly more with its digest than without, and the digest is of the
//! bytes as they were written to the destination even if the source changes during the
//! copy. Into a destination aligned to the register's width (32 or 64 bytes; every pool
//! page is) the stores are streaming ones: they write whole cache lines without first
//! reading them in, as a very large memcpy does, so the copy moves two bytes of memory per
//! byte instead of three. Nothing reads the destination back for the digest, so it need not
//! stay in the cache. Streaming stores are weakly ordered: [`Crc32c::copy_unfenced`] leaves
//! the [`store_fence`] to its caller, who makes one per page rather than per piece.
//!
//! The folding is the standard one for a reflected CRC: a 128-bit lane `X` that stands for
//! the bits `F` bits before the end of what has been absorbed is replaced by
//! `lo(X)·k1 ⊕ hi(X)·k2`, with `k1 = x^(F+63) mod P` and `k2 = x^(F-1) mod P` (bit-reversed,
//! the extra `x^-1` compensating the one a reflected carry-less product carries); the last
//! 128 bits are reduced with two crc32 instructions.

/// Folding state: the bytes absorbed since the last crc, a multiple of [`BLOCK`] and at least
/// one block, folded into one block of 16 lanes of 128 bits. Lane `i` stands for the bytes
/// at `16 * i` of the last block; the AVX-512 path holds it as four 64-byte registers, the
/// AVX2 path as eight 32-byte ones.
type Acc = [[u64; 8]; 4];

/// How a [`Crc32c`] absorbs bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// The crc32c crate.
    Portable,
    /// Folding 256-bit registers: AVX2, VPCLMULQDQ, PCLMULQDQ and SSE4.2.
    Avx2,
    /// Folding 512-bit registers: AVX-512F and all the AVX2 path needs (its fused copy uses
    /// the AVX2 path, as a copy is bound by memory either way).
    Avx512,
}

impl Path {
    /// Every path, slowest first.
    pub const ALL: [Path; 3] = [Path::Portable, Path::Avx2, Path::Avx512];

    /// Whether this CPU can take the path.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let clmul = std::is_x86_feature_detected!("vpclmulqdq")
                && std::is_x86_feature_detected!("pclmulqdq")
                && std::is_x86_feature_detected!("sse4.2");
            let avx2 = std::is_x86_feature_detected!("avx2");
            match self {
                Path::Portable => true,
                Path::Avx2 => clmul && avx2,
                Path::Avx512 => clmul && avx2 && std::is_x86_feature_detected!("avx512f"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Path::Portable
        }
    }

    /// The fastest path this CPU can take.
    pub fn best() -> Path {
        Path::ALL
            .into_iter()
            .rev()
            .find(|p| p.available())
            .unwrap_or(Path::Portable)
    }
}

/// A crc32c being computed over bytes absorbed piece by piece.
#[derive(Clone, Debug)]
pub struct Crc32c {
    /// The crc32c of what was absorbed before `acc` (in `crc32c_append` form).
    crc: u32,
    /// Folding accumulators for the bytes absorbed since `crc`, if any.
    acc: Option<Acc>,
    /// How this value absorbs bytes (one this CPU has, checked when the value is made).
    path: Path,
}

impl Default for Crc32c {
    fn default() -> Self {
        Self::new(0)
    }
}

impl Crc32c {
    /// A crc32c that continues from `crc` (0 for a fresh one), on this CPU's fastest path.
    pub fn new(crc: u32) -> Self {
        Crc32c {
            crc,
            acc: None,
            path: Path::best(),
        }
    }

    /// The same, never using a folding path (for tests and comparisons).
    pub fn portable(crc: u32) -> Self {
        Crc32c {
            crc,
            acc: None,
            path: Path::Portable,
        }
    }

    /// The same on `path`, if this CPU can take it (for tests and comparisons).
    pub fn with_path(crc: u32, path: Path) -> Option<Self> {
        path.available().then_some(Crc32c {
            crc,
            acc: None,
            path,
        })
    }

    /// The path this value takes.
    pub fn path(&self) -> Path {
        self.path
    }

    /// Absorbs `bytes`.
    pub fn update(&mut self, bytes: &[u8]) {
        let mut rest = bytes;
        #[cfg(target_arch = "x86_64")]
        if self.path != Path::Portable && rest.len() >= BLOCK {
            let (blocks, tail) = rest.split_at(rest.len() / BLOCK * BLOCK);
            match self.path {
                // SAFETY: the path is set only where the CPU has its features
                // (`Path::available`), the ones `fold_blocks` is compiled for.
                Path::Avx512 => unsafe {
                    x86::avx512::fold_blocks(&mut self.acc, self.crc, blocks)
                },
                // SAFETY: as above; `blocks` is readable for its length, a non-zero multiple
                // of BLOCK, and nothing is written (no copy).
                Path::Avx2 => unsafe {
                    x86::avx2::fold_blocks::<false, false>(
                        &mut self.acc,
                        self.crc,
                        blocks.as_ptr(),
                        std::ptr::null_mut(),
                        blocks.len(),
                    );
                },
                Path::Portable => {}
            }
            rest = tail;
        }
        if !rest.is_empty() {
            self.crc = crc32c::crc32c_append(self.value(), rest);
            self.acc = None;
        }
    }

    /// Copies `src` into `dst` and absorbs the bytes copied, in one pass where the CPU folds.
    ///
    /// # Panics
    /// If the two are not the same length.
    pub fn copy(&mut self, dst: &mut [u8], src: &[u8]) {
        assert_eq!(
            dst.len(),
            src.len(),
            "a copy between slices of different lengths"
        );
        // SAFETY: `src` is a live slice of `dst.len()` bytes, and it cannot overlap `dst`,
        // which is borrowed uniquely.
        unsafe { self.copy_from_ptr(dst, src.as_ptr()) }
    }

    /// Copies `dst.len()` bytes from `src` into `dst` and absorbs what was written to `dst`.
    /// The source may be memory another process writes during the copy: each of its bytes is
    /// read once, and the digest is of the bytes as they landed in `dst`, never of a second
    /// read of the source.
    ///
    /// # Safety
    /// `src` must be valid for reads of `dst.len()` bytes for the duration of the call, and
    /// must not overlap `dst`.
    pub unsafe fn copy_from_ptr(&mut self, dst: &mut [u8], src: *const u8) {
        // SAFETY: the caller's contract.
        unsafe { self.copy_unfenced(dst, src) };
        store_fence();
    }

    /// [`copy_from_ptr`](Self::copy_from_ptr) without its closing [`store_fence`]: the
    /// streaming stores it may make are ordered only for this thread until one is made. A
    /// transfer that copies a page in many pieces fences once, when the page is complete:
    /// a fence waits for every streaming store to reach memory, and one after every 4 KiB
    /// piece cost about a fifth of the copy's speed.
    ///
    /// # Safety
    /// As [`copy_from_ptr`](Self::copy_from_ptr); and [`store_fence`] must run on this thread
    /// before another thread may read `dst` or learn that the copy is done.
    pub unsafe fn copy_unfenced(&mut self, dst: &mut [u8], src: *const u8) {
        let len = dst.len();
        // Bytes copied and folded in one pass: every whole block, where the CPU folds.
        let done = if cfg!(target_arch = "x86_64") && self.path != Path::Portable {
            len / BLOCK * BLOCK
        } else {
            0
        };
        #[cfg(target_arch = "x86_64")]
        if done > 0 {
            let (acc, crc, to) = (&mut self.acc, self.crc, dst.as_mut_ptr());
            // Streaming stores only where `dst` is aligned to the register's width.
            let aligned = |n: usize| to.addr().is_multiple_of(n);
            // SAFETY: the path is one the CPU has (`Path::available`), which is all the
            // features its function is compiled for; `src` is readable for `len >= done`
            // bytes (the caller's contract), `dst` writable for `len`, `done` is a non-zero
            // multiple of BLOCK, the two do not overlap (the caller's contract), and the
            // streaming variants run only on an aligned `dst`.
            unsafe {
                match (self.path, aligned(64), aligned(32)) {
                    (Path::Avx512, true, _) => {
                        x86::avx512::copy_blocks::<true>(acc, crc, src, to, done);
                    }
                    (Path::Avx512, false, _) => {
                        x86::avx512::copy_blocks::<false>(acc, crc, src, to, done);
                    }
                    (_, _, true) => x86::avx2::fold_blocks::<true, true>(acc, crc, src, to, done),
                    (_, _, false) => {
                        x86::avx2::fold_blocks::<true, false>(acc, crc, src, to, done);
                    }
                }
            }
        }
        if done < len {
            // SAFETY: `src + done .. src + len` is readable (the caller's contract), the
            // destination is the rest of `dst`, and the two do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.add(done),
                    dst.as_mut_ptr().add(done),
                    len - done,
                );
            }
            // What landed, read back from the destination.
            self.update(&dst[done..]);
        }
    }

    /// The crc32c of everything absorbed.
    pub fn value(&self) -> u32 {
        match &self.acc {
            None => self.crc,
            #[cfg(target_arch = "x86_64")]
            Some(acc) => match self.path {
                // SAFETY: accumulators exist only when a folding path was taken, i.e. on a
                // CPU with the features `reduce` is compiled for.
                Path::Avx512 => unsafe { x86::avx512::reduce(acc) },
                // SAFETY: as above.
                Path::Avx2 => unsafe { x86::avx2::reduce(acc) },
                Path::Portable => unreachable!("the portable path keeps no accumulators"),
            },
            #[cfg(not(target_arch = "x86_64"))]
            Some(_) => self.crc,
        }
    }
}

/// Orders every streaming store this thread made ([`Crc32c::copy_unfenced`]) before any
/// store that follows, so another thread that sees the later one sees the copied bytes too.
pub fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SFENCE is part of SSE, which every x86-64 CPU has.
    unsafe {
        std::arch::x86_64::_mm_sfence();
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

/// Whether this CPU takes a folding path.
pub fn accelerated() -> bool {
    Path::best() != Path::Portable
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
    use super::fold_constants;
    use std::arch::x86_64::{
        __m128i, _mm_clmulepi64_si128, _mm_crc32_u64, _mm_cvtsi128_si64, _mm_extract_epi64,
        _mm_set_epi64x, _mm_xor_si128,
    };

    const K_128: (u64, u64) = fold_constants(128);

    /// Lane `x` folded forward by the distance `k` stands for.
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

    /// The crc32c (in `crc32c_append` form) of the state folded into its last lane.
    #[inline]
    #[target_feature(enable = "pclmulqdq,sse4.2")]
    fn finish(y: __m128i) -> u32 {
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

    /// Four 512-bit accumulators.
    pub(super) mod avx512 {
        use super::super::{Acc, BLOCK, fold_constants};
        use super::{K_128, finish, fold_lane};
        use std::arch::x86_64::{
            __m512i, _mm_cvtsi32_si128, _mm_xor_si128, _mm512_castsi128_si512,
            _mm512_clmulepi64_epi128, _mm512_extracti32x4_epi32, _mm512_loadu_si512,
            _mm512_set_epi64, _mm512_setzero_si512, _mm512_storeu_si512, _mm512_stream_si512,
            _mm512_ternarylogic_epi64, _mm512_xor_si512,
        };

        const K_2048: (u64, u64) = fold_constants(2048);
        const K_1536: (u64, u64) = fold_constants(1536);
        const K_1024: (u64, u64) = fold_constants(1024);
        const K_512: (u64, u64) = fold_constants(512);
        const K_384: (u64, u64) = fold_constants(384);
        const K_256: (u64, u64) = fold_constants(256);

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

        /// Folds `data` (a non-empty multiple of [`BLOCK`] bytes) into `acc`, starting the
        /// accumulators from `crc` when there are none yet.
        ///
        /// # Safety
        /// The CPU must have AVX-512F, VPCLMULQDQ, PCLMULQDQ and SSE4.2.
        #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
        pub(in super::super) unsafe fn fold_blocks(acc: &mut Option<Acc>, crc: u32, data: &[u8]) {
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

        /// Copies the `len` bytes at `src` (a non-zero multiple of [`BLOCK`]) to `dst` and
        /// folds them into `acc` as [`fold_blocks`] does, each 64-byte register folded as it
        /// was stored, so what is absorbed is what `dst` was given. With `STREAM` the stores
        /// are streaming ones, weakly ordered until a [`store_fence`](super::super::store_fence).
        ///
        /// # Safety
        /// The CPU must have AVX-512F, VPCLMULQDQ, PCLMULQDQ and SSE4.2. `src` must be
        /// readable and `dst` writable for `len` bytes, the two must not overlap, and with
        /// `STREAM`, `dst` must be aligned to 64.
        #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
        pub(in super::super) unsafe fn copy_blocks<const STREAM: bool>(
            acc: &mut Option<Acc>,
            crc: u32,
            src: *const u8,
            dst: *mut u8,
            len: usize,
        ) {
            debug_assert!(len > 0 && len.is_multiple_of(BLOCK));
            // Register `i` of the block at `at`: loaded, stored, and returned to be folded.
            // Every call below has `at + BLOCK <= len` and `i < 4`.
            // SAFETY: those bytes are inside both buffers (the caller's contract); the load is
            // unaligned, and the store aligned to 64 when streaming (`dst` is, and `at` and
            // `64 * i` are multiples of 64).
            let take = |at: usize, i: usize| unsafe {
                let v = _mm512_loadu_si512(src.add(at + 64 * i).cast());
                if STREAM {
                    _mm512_stream_si512(dst.add(at + 64 * i).cast(), v);
                } else {
                    _mm512_storeu_si512(dst.add(at + 64 * i).cast(), v);
                }
                v
            };
            let mut at = 0;
            let [mut a0, mut a1, mut a2, mut a3] = match acc {
                Some(a) => load_acc(a),
                None => {
                    // The start state enters as an xor into the first 32 bits of the data.
                    #[allow(clippy::cast_possible_wrap)]
                    let init = _mm512_castsi128_si512(_mm_cvtsi32_si128(!crc as i32));
                    at = BLOCK;
                    [
                        _mm512_xor_si512(take(0, 0), init),
                        take(0, 1),
                        take(0, 2),
                        take(0, 3),
                    ]
                }
            };
            let k = constants(K_2048);
            while at < len {
                a0 = fold(a0, k, take(at, 0));
                a1 = fold(a1, k, take(at, 1));
                a2 = fold(a2, k, take(at, 2));
                a3 = fold(a3, k, take(at, 3));
                at += BLOCK;
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
        fn load_acc(a: &Acc) -> [__m512i; 4] {
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
        pub(in super::super) unsafe fn reduce(acc: &Acc) -> u32 {
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
            finish(_mm_xor_si128(
                _mm_xor_si128(fold_lane(lanes[0], K_384), fold_lane(lanes[1], K_256)),
                _mm_xor_si128(fold_lane(lanes[2], K_128), lanes[3]),
            ))
        }
    }

    /// Eight 256-bit accumulators.
    pub(super) mod avx2 {
        use super::super::{Acc, BLOCK, fold_constants};
        use super::{K_128, finish, fold_lane};
        use std::arch::x86_64::{
            __m256i, _mm_cvtsi32_si128, _mm_xor_si128, _mm256_castsi128_si256,
            _mm256_castsi256_si128, _mm256_clmulepi64_epi128, _mm256_extracti128_si256,
            _mm256_loadu_si256, _mm256_set_epi64x, _mm256_setzero_si256, _mm256_storeu_si256,
            _mm256_stream_si256, _mm256_xor_si256,
        };

        /// Registers per block.
        const REGS: usize = BLOCK / 32;

        /// Folding constants by how many registers forward: `K[d]` folds by `d` registers.
        const K: [(u64, u64); REGS + 1] = {
            let mut k = [(0, 0); REGS + 1];
            let mut d = 1;
            while d <= REGS {
                // At most 8 * 256 bits.
                #[allow(clippy::cast_possible_truncation)]
                let bits = (d * 256) as u32;
                k[d] = fold_constants(bits);
                d += 1;
            }
            k
        };

        #[allow(clippy::cast_possible_wrap)]
        #[inline]
        #[target_feature(enable = "avx2,vpclmulqdq")]
        fn constants(k: (u64, u64)) -> __m256i {
            let (lo, hi) = (k.0 as i64, k.1 as i64);
            _mm256_set_epi64x(hi, lo, hi, lo)
        }

        /// `x` folded forward by the distance `k` stands for, xored with `next`.
        #[inline]
        #[target_feature(enable = "avx2,vpclmulqdq")]
        fn fold(x: __m256i, k: __m256i, next: __m256i) -> __m256i {
            let lo = _mm256_clmulepi64_epi128(x, k, 0x00);
            let hi = _mm256_clmulepi64_epi128(x, k, 0x11);
            _mm256_xor_si256(_mm256_xor_si256(lo, hi), next)
        }

        /// Register `i` of the block at `src`, stored to the same place at `dst` as well when
        /// `COPY` (with a streaming store when `STREAM`): the value folded is the value
        /// stored, whatever `src` holds by then.
        ///
        /// # Safety
        /// `src + 32 * i` must be readable for 32 bytes, and with `COPY`, `dst + 32 * i`
        /// writable for 32 bytes, not overlapping the source, and with `STREAM` aligned to 32.
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn take<const COPY: bool, const STREAM: bool>(
            src: *const u8,
            dst: *mut u8,
            i: usize,
        ) -> __m256i {
            // SAFETY: readable (the caller's contract); the load is unaligned.
            let v = unsafe { _mm256_loadu_si256(src.add(32 * i).cast()) };
            if COPY && STREAM {
                // SAFETY: writable, not overlapping and aligned to 32 (the caller's contract).
                unsafe { _mm256_stream_si256(dst.add(32 * i).cast(), v) };
            } else if COPY {
                // SAFETY: writable and not overlapping (the caller's contract); unaligned.
                unsafe { _mm256_storeu_si256(dst.add(32 * i).cast(), v) };
            }
            v
        }

        /// Folds the `len` bytes at `src` (a non-zero multiple of [`BLOCK`]) into `acc`,
        /// starting the accumulators from `crc` when there are none yet. With `COPY`, stores
        /// every register it loads to the same offset from `dst` too, and folds that value,
        /// so what is absorbed is what `dst` was given. With `STREAM` those stores are
        /// streaming (non-temporal) ones, weakly ordered: [`store_fence`](super::super::store_fence)
        /// orders them before what follows.
        ///
        /// # Safety
        /// The CPU must have AVX2, VPCLMULQDQ, PCLMULQDQ and SSE4.2. `src` must be readable
        /// for `len` bytes; with `COPY`, `dst` must be writable for `len` bytes, and the two
        /// must not overlap (without it `dst` is not used); with `STREAM`, `dst` must be
        /// aligned to 32.
        #[target_feature(enable = "avx2,vpclmulqdq,pclmulqdq,sse4.2")]
        pub(in super::super) unsafe fn fold_blocks<const COPY: bool, const STREAM: bool>(
            acc: &mut Option<Acc>,
            crc: u32,
            src: *const u8,
            dst: *mut u8,
            len: usize,
        ) {
            debug_assert!(len > 0 && len.is_multiple_of(BLOCK));
            let mut at = 0;
            let mut a = match acc {
                Some(a) => load_acc(a),
                None => {
                    // SAFETY: the first block is in bounds (`len >= BLOCK`), as the caller
                    // promises for every block.
                    let mut a: [__m256i; REGS] =
                        std::array::from_fn(|i| unsafe { take::<COPY, STREAM>(src, dst, i) });
                    // The start state enters as an xor into the first 32 bits of the data.
                    #[allow(clippy::cast_possible_wrap)]
                    let init = _mm256_castsi128_si256(_mm_cvtsi32_si128(!crc as i32));
                    a[0] = _mm256_xor_si256(a[0], init);
                    at = BLOCK;
                    a
                }
            };
            let k = constants(K[REGS]);
            while at < len {
                // SAFETY: `at + BLOCK <= len`, within what the caller promises.
                let (s, d) = unsafe { (src.add(at), if COPY { dst.add(at) } else { dst }) };
                for (i, x) in a.iter_mut().enumerate() {
                    // SAFETY: register `i < REGS` of a block in bounds.
                    *x = fold(*x, k, unsafe { take::<COPY, STREAM>(s, d, i) });
                }
                at += BLOCK;
            }
            let mut out = [[0u64; 8]; 4];
            let p = out.as_mut_ptr().cast::<u8>();
            for (i, v) in a.into_iter().enumerate() {
                // SAFETY: `out` is BLOCK = 32 * REGS bytes of plain memory; unaligned.
                unsafe { _mm256_storeu_si256(p.add(32 * i).cast(), v) };
            }
            *acc = Some(out);
        }

        #[inline]
        #[target_feature(enable = "avx2")]
        fn load_acc(a: &Acc) -> [__m256i; REGS] {
            let p = a.as_ptr().cast::<u8>();
            // SAFETY: `a` is BLOCK = 32 * REGS bytes of plain memory; the loads are unaligned.
            std::array::from_fn(|i| unsafe { _mm256_loadu_si256(p.add(32 * i).cast()) })
        }

        /// The crc32c (in `crc32c_append` form) that the accumulators stand for.
        ///
        /// # Safety
        /// The CPU must have AVX2, VPCLMULQDQ, PCLMULQDQ and SSE4.2.
        #[target_feature(enable = "avx2,vpclmulqdq,pclmulqdq,sse4.2")]
        pub(in super::super) unsafe fn reduce(acc: &Acc) -> u32 {
            let a = load_acc(acc);
            // Every register folded forward onto the last one, then its two lanes.
            let mut x = _mm256_setzero_si256();
            for (i, &r) in a[..REGS - 1].iter().enumerate() {
                x = fold(r, constants(K[REGS - 1 - i]), x);
            }
            let x = _mm256_xor_si256(x, a[REGS - 1]);
            finish(_mm_xor_si128(
                fold_lane(_mm256_castsi256_si128(x), K_128),
                _mm256_extracti128_si256::<1>(x),
            ))
        }
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

    /// The paths this CPU has, each to be tested on its own.
    fn paths() -> Vec<Path> {
        Path::ALL.into_iter().filter(|p| p.available()).collect()
    }

    fn on(path: Path, crc: u32) -> Crc32c {
        let c = Crc32c::with_path(crc, path).expect("an available path");
        assert_eq!(c.path(), path);
        c
    }

    const SIZES: [usize; 17] = [
        0,
        1,
        15,
        16,
        31,
        32,
        255,
        256,
        257,
        511,
        512,
        513,
        768 + 32,
        4096,
        4096 + 255,
        65536,
        65536 + 77,
    ];

    #[test]
    fn matches_the_crc32c_crate_at_every_size_around_the_block() {
        for path in paths() {
            for n in SIZES {
                let data = bytes(n, 7);
                for init in [0, 1, 0xdead_beef, u32::MAX] {
                    let want = crc32c::crc32c_append(init, &data);
                    let mut c = on(path, init);
                    c.update(&data);
                    assert_eq!(c.value(), want, "{path:?} n={n} init={init:#x}");
                }
            }
        }
        for n in SIZES {
            let data = bytes(n, 9);
            assert_eq!(crc32c_append(5, &data), crc32c::crc32c_append(5, &data));
        }
        // Says which paths this machine's tests covered.
        eprintln!(
            "crc32c folding path: {:?} (tested: {:?})",
            Path::best(),
            paths()
        );
    }

    #[test]
    fn the_best_path_is_the_fastest_available_one() {
        let best = Path::best();
        assert!(best.available());
        assert_eq!(Crc32c::new(0).path(), best);
        assert_eq!(Crc32c::portable(0).path(), Path::Portable);
        assert_eq!(accelerated(), best != Path::Portable);
        assert!(paths().iter().all(|&p| p as u8 <= best as u8));
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("vpclmulqdq") {
            assert_ne!(best, Path::Portable, "this CPU folds");
            assert!(Path::Avx2.available());
        }
    }

    #[test]
    fn a_long_page_in_chunks_of_every_kind() {
        let data = bytes(1 << 20, 3);
        let want = crc32c::crc32c(&data);
        for path in paths() {
            for chunk in [256, 4096, 4096 + 256, 1000, 77] {
                let mut c = on(path, 0);
                for piece in data.chunks(chunk) {
                    c.update(piece);
                }
                assert_eq!(c.value(), want, "{path:?} chunk {chunk}");
                let mut c = on(path, 0);
                let mut dst = vec![0u8; data.len()];
                for (d, s) in dst.chunks_mut(chunk).zip(data.chunks(chunk)) {
                    c.copy(d, s);
                }
                assert_eq!(c.value(), want, "{path:?} copied in chunks of {chunk}");
                assert!(dst == data, "{path:?} chunk {chunk}");
            }
        }
    }

    #[test]
    fn a_fused_copy_lands_exactly_the_bytes_and_their_crc() {
        // Into the middle of a larger buffer at odd offsets: nothing around it is touched.
        for path in paths() {
            for n in SIZES {
                for (from, to) in [(0, 0), (1, 3), (7, 0), (0, 31), (17, 33)] {
                    let src = bytes(n + from, 11);
                    let src = &src[from..];
                    let mut buf = vec![0xeeu8; n + to + 64];
                    for init in [0, 0xdead_beef] {
                        let mut c = on(path, init);
                        c.copy(&mut buf[to..to + n], src);
                        assert_eq!(
                            c.value(),
                            crc32c::crc32c_append(init, src),
                            "{path:?} n={n} from={from} to={to}"
                        );
                        assert!(&buf[to..to + n] == src, "{path:?} n={n}");
                        assert!(buf[..to].iter().all(|&b| b == 0xee));
                        assert!(buf[to + n..].iter().all(|&b| b == 0xee));
                    }
                }
            }
        }
    }

    #[test]
    fn a_fused_copy_streams_into_aligned_destinations_and_stores_into_others() {
        // Offsets chosen from the buffer's own address: 64-byte aligned (streaming stores on
        // either path), 32 past it (streaming on the AVX2 path only) and 1, 8 and 16 past it
        // (ordinary stores), each followed by a read of what landed, here and on another
        // thread.
        for path in paths() {
            for n in [256, 4096, 65536 + 77] {
                let src = bytes(n, 13);
                let mut buf = vec![0xeeu8; n + 128];
                let aligned = buf.as_ptr().addr().next_multiple_of(64) - buf.as_ptr().addr();
                for to in [
                    aligned,
                    aligned + 32,
                    aligned + 1,
                    aligned + 8,
                    aligned + 16,
                ] {
                    buf.fill(0xee);
                    let mut c = on(path, 0);
                    c.copy(&mut buf[to..to + n], &src);
                    assert_eq!(c.value(), crc32c::crc32c(&src), "{path:?} n={n} to={to}");
                    assert!(buf[to..to + n] == src[..], "{path:?} n={n} to={to}");
                    let seen = std::thread::scope(|s| {
                        s.spawn(|| crc32c::crc32c(&buf[to..to + n])).join().unwrap()
                    });
                    assert_eq!(seen, crc32c::crc32c(&src), "another thread, to={to}");
                    assert!(buf[..to].iter().chain(&buf[to + n..]).all(|&b| b == 0xee));
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "different lengths")]
    fn a_fused_copy_refuses_slices_of_different_lengths() {
        Crc32c::new(0).copy(&mut [0u8; 300], &[0u8; 301]);
    }

    proptest! {
        #[test]
        fn pieces_in_any_split_give_the_same_crc(
            data in proptest::collection::vec(any::<u8>(), 0..3000),
            cuts in proptest::collection::vec(0usize..3000, 0..6),
            copies in proptest::collection::vec(any::<bool>(), 7),
            init in any::<u32>(),
        ) {
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(data.len())).collect();
            cuts.sort_unstable();
            let want = crc32c::crc32c_append(init, &data);
            for path in paths() {
                // Each piece absorbed, or copied and absorbed, as `copies` says.
                let mut c = on(path, init);
                let mut dst = vec![0u8; data.len()];
                let mut at = 0;
                for (k, cut) in cuts.iter().copied().chain([data.len()]).enumerate() {
                    if copies[k] {
                        c.copy(&mut dst[at..cut], &data[at..cut]);
                    } else {
                        c.update(&data[at..cut]);
                        dst[at..cut].copy_from_slice(&data[at..cut]);
                    }
                    // reading the value in the middle changes nothing
                    let _ = c.value();
                    at = cut;
                }
                prop_assert_eq!(c.value(), want, "{:?}", path);
                prop_assert!(dst == data);
            }
        }
    }
}
