//! What a device pool decides on the host, in plain Rust: which byte ranges a pull copies
//! (runs of contiguous pages coalesced into one copy each), how a page is filled with a
//! 16-byte pattern by doubling copies, and the crc32c of a page computed the way the GPU
//! digest kernel computes it (segments digested apart, then combined).
//!
//! [`cuda`](super::cuda) only issues what these functions plan, so everything here is
//! tested on host memory; the GPU tests (`libkv/tests/gpu.rs`) compare the device's digests
//! with [`page_digest`](crate::verify::page_digest) of the same bytes.

use crate::ids::{PageId, PoolOffset};
use crate::memory::PullError;

/// One device-to-device copy of a pull: `len` bytes from `src` (in the foreign pool) to `dst`
/// (in the landing pool).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyRun {
    pub src: PoolOffset,
    pub dst: PoolOffset,
    pub len: u64,
}

/// The copies that move foreign `pages` (of a pool of `pool_pages` pages of `page_bytes`)
/// into the landing pages at `dst`, in order: one copy per run of pages that are contiguous
/// both in the source and in the destination. Refuses, before anything is copied, a count
/// that differs, a source page out of range and destinations that overlap one another.
pub fn copy_runs(
    pages: &[PageId],
    pool_pages: u32,
    dst: &[PoolOffset],
    page_bytes: u64,
) -> Result<Vec<CopyRun>, PullError> {
    if pages.len() != dst.len() {
        return Err(PullError::Count {
            pages: pages.len(),
            landing: dst.len(),
        });
    }
    let mut sorted: Vec<u64> = dst.iter().map(|d| d.0).collect();
    sorted.sort_unstable();
    for (i, w) in sorted.windows(2).enumerate() {
        if w[1] - w[0] < page_bytes {
            return Err(PullError::PageSize {
                index: i + 1,
                page_bytes,
            });
        }
    }
    let mut runs: Vec<CopyRun> = Vec::new();
    for (&page, &to) in pages.iter().zip(dst) {
        if page.0 >= pool_pages {
            return Err(PullError::OutOfRange {
                page,
                pages: pool_pages,
            });
        }
        let from = PoolOffset(u64::from(page.0) * page_bytes);
        if let Some(last) = runs.last_mut()
            && last.src.0 + last.len == from.0
            && last.dst.0 + last.len == to.0
        {
            last.len += page_bytes;
            continue;
        }
        runs.push(CopyRun {
            src: from,
            dst: to,
            len: page_bytes,
        });
    }
    Ok(runs)
}

/// One copy of a pattern fill, inside the region being filled: `len` bytes from offset
/// `from` to offset `to`, both relative to the region's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FillCopy {
    pub from: u64,
    pub to: u64,
    pub len: u64,
}

/// How a region of `len` bytes is filled with a 16-byte pattern once its first
/// `min(16, len)` bytes hold the pattern: each copy doubles the filled prefix (the last one
/// fills what is left), so a page takes about log2(len / 16) copies. Copies run in order.
pub fn fill_copies(len: u64) -> Vec<FillCopy> {
    let mut filled = len.min(16);
    let mut out = Vec::new();
    while filled < len {
        let n = filled.min(len - filled);
        out.push(FillCopy {
            from: 0,
            to: filled,
            len: n,
        });
        filled += n;
    }
    out
}

/// Threads of one block of the digest kernel: one block digests one page, each thread one
/// segment of it.
pub const DIGEST_THREADS: u32 = 256;

/// crc32c's reflected polynomial.
const POLY: u32 = 0x82f6_3b78;

/// Bytes of each thread's segment of a page of `page_bytes`: an equal share rounded up to
/// 8 bytes (the kernel's load width), so only the last segments are short or empty.
pub fn segment_bytes(page_bytes: u64) -> u64 {
    page_bytes
        .div_ceil(u64::from(DIGEST_THREADS))
        .next_multiple_of(8)
}

/// The slice-by-8 tables of crc32c (table 0 is the byte-wise table), as the kernel builds
/// them in shared memory.
pub fn crc_tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    for i in 0..256u32 {
        let mut c = i;
        for _ in 0..8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
        }
        t[0][i as usize] = c;
    }
    for k in 1..8 {
        for i in 0..256 {
            let prev = t[k - 1][i];
            t[k][i] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
        }
    }
    t
}

/// `a * b` modulo the polynomial, both reflected (bit 31 is x^0), as zlib's `multmodp`.
pub fn multmodp(a: u32, mut b: u32) -> u32 {
    let mut m = 1u32 << 31;
    let mut p = 0u32;
    loop {
        if a & m != 0 {
            p ^= b;
            if a & (m - 1) == 0 {
                break;
            }
        }
        m >>= 1;
        if m == 0 {
            break;
        }
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
    p
}

/// x^(2^k) modulo the polynomial for k in 0..32: what [`shift`] multiplies by. The kernel
/// carries the same table as a constant.
pub fn x2n_table() -> [u32; 32] {
    let mut t = [0u32; 32];
    let mut p = 1u32 << 30; // x^1
    for slot in &mut t {
        *slot = p;
        p = multmodp(p, p);
    }
    t
}

/// The crc register `crc` advanced over `bytes` zero bytes (x^(8 * bytes) * crc).
pub fn shift(table: &[u32; 32], crc: u32, bytes: u64) -> u32 {
    let mut p = 1u32 << 31; // x^0
    let mut n = bytes;
    let mut k = 3usize; // 8 bits per byte
    while n != 0 {
        if n & 1 != 0 {
            p = multmodp(table[k & 31], p);
        }
        n >>= 1;
        k += 1;
    }
    multmodp(p, crc)
}

/// The crc32c register after `bytes`, from a zero register, with no final inversion: linear
/// in the bytes, which is what lets segments be digested apart and combined.
pub fn raw_crc(tables: &[[u32; 256]; 8], mut crc: u32, bytes: &[u8]) -> u32 {
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let lo = crc ^ u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        let hi = u32::from_le_bytes([w[4], w[5], w[6], w[7]]);
        crc = tables[7][(lo & 0xff) as usize]
            ^ tables[6][((lo >> 8) & 0xff) as usize]
            ^ tables[5][((lo >> 16) & 0xff) as usize]
            ^ tables[4][(lo >> 24) as usize]
            ^ tables[3][(hi & 0xff) as usize]
            ^ tables[2][((hi >> 8) & 0xff) as usize]
            ^ tables[1][((hi >> 16) & 0xff) as usize]
            ^ tables[0][(hi >> 24) as usize];
    }
    for &b in words.remainder() {
        crc = tables[0][((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    crc
}

/// The digest of `page` computed as the GPU kernel does: [`DIGEST_THREADS`] segments of
/// [`segment_bytes`] each digested from a zero register, combined pairwise in a tree (the
/// left one shifted over the right one's length), then the initial register's effect and
/// the final inversion applied. Equals [`page_digest`](crate::verify::page_digest).
pub fn segmented_digest(page: &[u8]) -> u32 {
    let tables = crc_tables();
    let x2n = x2n_table();
    let seg = usize::try_from(segment_bytes(page.len() as u64)).unwrap_or(usize::MAX);
    let threads = DIGEST_THREADS as usize;
    let mut crc = vec![0u32; threads];
    let mut len = vec![0u64; threads];
    for t in 0..threads {
        let start = t.saturating_mul(seg).min(page.len());
        let end = start.saturating_add(seg).min(page.len());
        crc[t] = raw_crc(&tables, 0, &page[start..end]);
        len[t] = (end - start) as u64;
    }
    let mut s = 1;
    while s < threads {
        for t in (0..threads).step_by(2 * s) {
            if t + s < threads && len[t + s] > 0 {
                crc[t] = shift(&x2n, crc[t], len[t + s]) ^ crc[t + s];
                len[t] += len[t + s];
            }
        }
        s *= 2;
    }
    crc[0] ^ shift(&x2n, u32::MAX, page.len() as u64) ^ u32::MAX
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verify::page_digest;
    use proptest::prelude::*;

    fn us(v: u64) -> usize {
        usize::try_from(v).unwrap()
    }

    fn offs(v: &[u64]) -> Vec<PoolOffset> {
        v.iter().map(|&o| PoolOffset(o)).collect()
    }

    #[test]
    fn contiguous_pages_are_copied_in_one_run() {
        let pages: Vec<PageId> = (3..7).map(PageId).collect();
        let runs = copy_runs(&pages, 8, &offs(&[0, 100, 200, 300]), 100).unwrap();
        assert_eq!(
            runs,
            vec![CopyRun {
                src: PoolOffset(300),
                dst: PoolOffset(0),
                len: 400
            }]
        );
    }

    #[test]
    fn a_break_in_source_or_destination_starts_a_run() {
        let pages = [PageId(0), PageId(1), PageId(5), PageId(6), PageId(7)];
        // Destination breaks between the 4th and 5th page, source between the 2nd and 3rd.
        let dst = offs(&[0, 10, 20, 30, 70]);
        let runs = copy_runs(&pages, 8, &dst, 10).unwrap();
        let got: Vec<(u64, u64, u64)> = runs.iter().map(|r| (r.src.0, r.dst.0, r.len)).collect();
        assert_eq!(got, vec![(0, 0, 20), (50, 20, 20), (70, 70, 10)]);
        // Reversed pages never coalesce.
        let rev: Vec<PageId> = (0..4).rev().map(PageId).collect();
        assert_eq!(
            copy_runs(&rev, 4, &offs(&[0, 10, 20, 30]), 10)
                .unwrap()
                .len(),
            4
        );
    }

    #[test]
    fn a_plan_refuses_before_any_copy() {
        let r = copy_runs(&[PageId(0), PageId(8)], 8, &offs(&[0, 10]), 10);
        assert_eq!(
            r,
            Err(PullError::OutOfRange {
                page: PageId(8),
                pages: 8
            })
        );
        let r = copy_runs(&[PageId(0)], 8, &offs(&[0, 10]), 10);
        assert!(matches!(r, Err(PullError::Count { .. })), "{r:?}");
        // Two destinations closer than a page would land on each other.
        let r = copy_runs(&[PageId(0), PageId(1)], 8, &offs(&[20, 25]), 10);
        assert!(matches!(r, Err(PullError::PageSize { .. })), "{r:?}");
        let r = copy_runs(&[PageId(0), PageId(1)], 8, &offs(&[20, 20]), 10);
        assert!(matches!(r, Err(PullError::PageSize { .. })), "{r:?}");
    }

    /// Runs `runs` on host buffers the way the device does.
    fn apply(runs: &[CopyRun], src: &[u8], dst: &mut [u8]) {
        for r in runs {
            let (s, d, n) = (us(r.src.0), us(r.dst.0), us(r.len));
            dst[d..d + n].copy_from_slice(&src[s..s + n]);
        }
    }

    proptest! {
        #[test]
        fn runs_copy_exactly_the_pages_asked_for(
            picks in proptest::sample::subsequence((0u32..32).collect::<Vec<_>>(), 0..16),
            shuffle in any::<u64>(),
            dst_gap in 0u64..3,
        ) {
            let page_bytes = 64u64;
            let src: Vec<u8> = (0..32 * page_bytes).map(|i| (i * 31 % 251).to_le_bytes()[0]).collect();
            let mut pages: Vec<PageId> = picks.into_iter().map(PageId).collect();
            // A deterministic shuffle of some of the pages, so runs break at random.
            if shuffle % 2 == 1 && pages.len() > 2 {
                let k = (shuffle / 2) as usize % pages.len();
                pages.swap(0, k);
            }
            let dst: Vec<PoolOffset> = (0..pages.len() as u64)
                .map(|i| PoolOffset(i * page_bytes + (i / 3) * dst_gap * page_bytes))
                .collect();
            let runs = copy_runs(&pages, 32, &dst, page_bytes).unwrap();
            let total: u64 = runs.iter().map(|r| r.len).sum();
            prop_assert_eq!(total, pages.len() as u64 * page_bytes);
            let mut out = vec![0u8; us(64 * page_bytes)];
            apply(&runs, &src, &mut out);
            for (p, d) in pages.iter().zip(&dst) {
                let s = us(u64::from(p.0) * page_bytes);
                let d = us(d.0);
                prop_assert_eq!(&out[d..d + 64], &src[s..s + 64]);
            }
        }

        #[test]
        fn the_segmented_digest_is_crc32c(bytes in proptest::collection::vec(any::<u8>(), 0..9000)) {
            prop_assert_eq!(segmented_digest(&bytes), page_digest(&bytes));
        }
    }

    #[test]
    fn the_segmented_digest_is_crc32c_at_page_sizes() {
        for len in [
            1usize,
            7,
            8,
            255,
            256,
            2047,
            2048,
            2049,
            16 << 10,
            64 << 10,
            100_003,
        ] {
            let bytes: Vec<u8> = (0..len)
                .map(|i| (i * 7 + i / 4096).to_le_bytes()[0])
                .collect();
            assert_eq!(segmented_digest(&bytes), page_digest(&bytes), "{len} bytes");
        }
        assert_eq!(
            segmented_digest(b"123456789"),
            0xe306_9283,
            "the crc32c check value"
        );
    }

    #[test]
    fn shifting_by_zero_bytes_is_the_identity_and_shifts_compose() {
        let t = x2n_table();
        assert_eq!(shift(&t, 0xdead_beef, 0), 0xdead_beef);
        let once = shift(&t, 0x1234_5678, 1000);
        assert_eq!(shift(&t, shift(&t, 0x1234_5678, 400), 600), once);
        // Advancing over zero bytes with the table gives the same register.
        let tables = crc_tables();
        assert_eq!(raw_crc(&tables, 0x1234_5678, &[0u8; 1000]), once);
    }

    #[test]
    fn fill_copies_double_until_the_region_is_full() {
        for len in [0u64, 5, 16, 17, 31, 32, 33, 4096, 16384 + 5] {
            let mut region = vec![0u8; us(len)];
            let pattern: Vec<u8> = (1..=16).collect();
            let first = region.len().min(16);
            region[..first].copy_from_slice(&pattern[..first]);
            let copies = fill_copies(len);
            for c in &copies {
                let (f, t, n) = (us(c.from), us(c.to), us(c.len));
                assert!(f + n <= t, "copies never overlap their source");
                region.copy_within(f..f + n, t);
            }
            for (i, b) in region.iter().enumerate() {
                assert_eq!(*b, pattern[i % 16], "byte {i} of {len}");
            }
            assert!(copies.len() <= 64 - len.leading_zeros() as usize);
        }
    }
}
