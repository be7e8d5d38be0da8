//! The page order, measured.
//!
//! kvfence's page is layer-major (`[layer][K|V][kv_head][slot][head_dim]`, see
//! [`libkv::geometry`]): that is the wire format. This module holds the other candidate, a
//! token-major page (`[slot][layer][K|V][kv_head][head_dim]`: each token's K/V for the whole
//! model in one run), and the three things whose cost the order decides, written the way the
//! runner does them so that `kvllmbench layout` can time both orders side by side:
//!
//! - [`write_token`]: prefill storing one token's K/V into its page slot (the runner's
//!   `write_slot`);
//! - [`attend`]: one decode step's attention over the pages for every layer and query head,
//!   reading each page's K and V per KV head as the runner's `attend` does (a contiguous run
//!   per page in the layer-major order, one vector per slot in the token-major one);
//! - [`to_engine`]: moving pages into an engine's per-layer cache blocks, vLLM's
//!   `[block][slot][head][dim]` ([`EngineBlocks::Nhd`]) or `[block][head][slot][dim]`
//!   ([`EngineBlocks::Hnd`]), counting the copies.
//!
//! The transfer between workers moves whole pages either way: the order inside a page
//! changes neither its bytes nor the number of copies, so it is not measured here.

use crate::math;
use libkv::geometry::{Kv, PageGeometry};

/// Where a page keeps each (layer, K/V, head, slot) vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageOrder {
    /// `[layer][K|V][kv_head][slot][head_dim]`: kvfence's page ([`PageGeometry::vector_offset`]).
    LayerMajor,
    /// `[slot][layer][K|V][kv_head][head_dim]`: one token's K/V for every layer in one run.
    TokenMajor,
}

impl PageOrder {
    /// Both orders, kvfence's first.
    pub const ALL: [PageOrder; 2] = [PageOrder::LayerMajor, PageOrder::TokenMajor];

    /// Byte offset, inside a page, of the `head_dim` elements of (`layer`, `kv`, `head`,
    /// `slot`).
    pub fn vector_offset(
        self,
        g: &PageGeometry,
        layer: usize,
        kv: Kv,
        head: usize,
        slot: usize,
    ) -> usize {
        let (heads, hd, sz) = (g.kv_heads as usize, g.head_dim as usize, g.dtype.size());
        match self {
            PageOrder::LayerMajor => g.vector_offset(
                u32::try_from(layer).unwrap_or(u32::MAX),
                kv,
                u32::try_from(head).unwrap_or(u32::MAX),
                u32::try_from(slot).unwrap_or(u32::MAX),
            ),
            PageOrder::TokenMajor => {
                let per_slot = g.layers as usize * 2 * heads;
                ((slot * per_slot + (layer * 2 + kv as usize) * heads + head) * hd) * sz
            }
        }
    }
}

/// Writes one token's K/V, `[layer][K, V][kv_heads * head_dim]` as the runner holds it,
/// into slot `slot` of `page` in `order`: one encoded run of `head_dim` elements per (layer,
/// K/V, head), as the runner's `write_slot` does. In the token-major order the runs are
/// adjacent, so they are encoded as one.
pub fn write_token(order: PageOrder, g: &PageGeometry, page: &mut [u8], slot: usize, kv: &[f32]) {
    let (hd, heads, sz) = (g.head_dim as usize, g.kv_heads as usize, g.dtype.size());
    if order == PageOrder::TokenMajor {
        let at = order.vector_offset(g, 0, Kv::K, 0, slot);
        math::encode(g.dtype, kv, &mut page[at..at + kv.len() * sz]);
        return;
    }
    for (l, layer) in kv.chunks_exact(2 * heads * hd).enumerate() {
        for (which, vals) in [Kv::K, Kv::V]
            .into_iter()
            .zip(layer.chunks_exact(heads * hd))
        {
            for (head, v) in vals.chunks_exact(hd).enumerate() {
                let at = order.vector_offset(g, l, which, head, slot);
                math::encode(g.dtype, v, &mut page[at..at + hd * sz]);
            }
        }
    }
}

/// One decode step's attention of every layer over positions `0..read` of `pages`, for
/// `q_heads` query heads (`q` holds `[layer][q_head][head_dim]`), as the runner's `attend`
/// computes it: per page and KV head, its `slots x head_dim` K values decoded to f32 (from
/// one run in the layer-major order, from one run per slot in the token-major one), scores
/// by matrix-vector product for every query head of the group, softmax, then V the same way
/// into weighted sums. Returns the outputs, `[layer][q_head][head_dim]`: the same in both
/// orders for the same values.
///
/// # Panics
/// If `q_heads` is not a multiple of the KV heads, `q` is too short or the pages hold fewer
/// than `read` positions.
pub fn attend(
    order: PageOrder,
    g: &PageGeometry,
    q_heads: usize,
    pages: &[&[u8]],
    read: usize,
    q: &[f32],
) -> Vec<f32> {
    let (hd, heads, tpp) = (
        g.head_dim as usize,
        g.kv_heads as usize,
        g.tokens_per_page as usize,
    );
    assert!(q_heads.is_multiple_of(heads) && read <= pages.len() * tpp);
    let group = q_heads / heads;
    let layers = g.layers as usize;
    assert!(q.len() >= layers * q_heads * hd);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; layers * q_heads * hd];
    let mut scores = vec![0f32; q_heads * read];
    let mut buf = vec![0f32; tpp * hd];
    // One head's K or V for the first `slots` slots of `page`, decoded into `buf`.
    let run = |page: &[u8], l: usize, kv: Kv, head: usize, slots: usize, buf: &mut [f32]| {
        let sz = g.dtype.size();
        match order {
            PageOrder::LayerMajor => {
                let at = order.vector_offset(g, l, kv, head, 0);
                math::decode(
                    g.dtype,
                    &page[at..at + slots * hd * sz],
                    &mut buf[..slots * hd],
                );
            }
            PageOrder::TokenMajor => {
                for (s, b) in buf[..slots * hd].chunks_exact_mut(hd).enumerate() {
                    let at = order.vector_offset(g, l, kv, head, s);
                    math::decode(g.dtype, &page[at..at + hd * sz], b);
                }
            }
        }
    };
    for l in 0..layers {
        let ql = &q[l * q_heads * hd..(l + 1) * q_heads * hd];
        for (pi, page) in pages.iter().enumerate() {
            let slots = tpp.min(read.saturating_sub(pi * tpp));
            let at = pi * tpp..pi * tpp + slots;
            for kvh in 0..heads {
                run(page, l, Kv::K, kvh, slots, &mut buf);
                for j in kvh * group..(kvh + 1) * group {
                    let row = &mut scores[j * read..(j + 1) * read];
                    math::matvec(
                        &buf[..slots * hd],
                        &ql[j * hd..(j + 1) * hd],
                        &mut row[at.clone()],
                    );
                }
            }
        }
        for row in scores.chunks_exact_mut(read.max(1)) {
            row.iter_mut().for_each(|s| *s *= scale);
            math::softmax(row);
        }
        let ol = &mut out[l * q_heads * hd..(l + 1) * q_heads * hd];
        for (pi, page) in pages.iter().enumerate() {
            let slots = tpp.min(read.saturating_sub(pi * tpp));
            let at = pi * tpp..pi * tpp + slots;
            for kvh in 0..heads {
                run(page, l, Kv::V, kvh, slots, &mut buf);
                for j in kvh * group..(kvh + 1) * group {
                    let p = &scores[j * read + at.start..j * read + at.end];
                    math::weighted_sum(p, &buf[..slots * hd], &mut ol[j * hd..(j + 1) * hd]);
                }
            }
        }
    }
    out
}

/// How an engine lays out its own per-layer KV cache blocks (one block per page, one
/// buffer per layer and K/V).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineBlocks {
    /// `[block][slot][kv_head][head_dim]` (vLLM's default cache layout).
    Nhd,
    /// `[block][kv_head][slot][head_dim]` (the head-major layout some attention kernels
    /// take, and kvfence's own runner reads).
    Hnd,
}

/// Copies every page into an engine's per-layer cache: `engine[layer * 2 + kv]` holds one
/// block per page in `blocks` layout, filled with the fewest contiguous copies the two
/// layouts allow. Returns the number of copies.
///
/// # Panics
/// If an engine buffer is shorter than `pages.len()` blocks or there are fewer than
/// `2 * layers` of them.
pub fn to_engine(
    order: PageOrder,
    g: &PageGeometry,
    pages: &[&[u8]],
    blocks: EngineBlocks,
    engine: &mut [Vec<u8>],
) -> usize {
    let (hd, heads, tpp, sz) = (
        g.head_dim as usize,
        g.kv_heads as usize,
        g.tokens_per_page as usize,
        g.dtype.size(),
    );
    let vec = hd * sz;
    let block = tpp * heads * vec;
    let mut copies = 0;
    for (b, page) in pages.iter().enumerate() {
        for l in 0..g.layers as usize {
            for kv in [Kv::K, Kv::V] {
                let dst = &mut engine[l * 2 + kv as usize][b * block..(b + 1) * block];
                match (order, blocks) {
                    // One head-major slab per (layer, K/V): the block as it is.
                    (PageOrder::LayerMajor, EngineBlocks::Hnd) => {
                        let at = order.vector_offset(g, l, kv, 0, 0);
                        dst.copy_from_slice(&page[at..at + block]);
                        copies += 1;
                    }
                    // One token's heads are adjacent: a run of `heads` vectors per slot.
                    (PageOrder::TokenMajor, EngineBlocks::Nhd) => {
                        for s in 0..tpp {
                            let at = order.vector_offset(g, l, kv, 0, s);
                            dst[s * heads * vec..(s + 1) * heads * vec]
                                .copy_from_slice(&page[at..at + heads * vec]);
                            copies += 1;
                        }
                    }
                    // The order inside the block differs: one vector at a time.
                    (_, _) => {
                        for s in 0..tpp {
                            for h in 0..heads {
                                let at = order.vector_offset(g, l, kv, h, s);
                                let to = match blocks {
                                    EngineBlocks::Nhd => (s * heads + h) * vec,
                                    EngineBlocks::Hnd => (h * tpp + s) * vec,
                                };
                                dst[to..to + vec].copy_from_slice(&page[at..at + vec]);
                                copies += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    copies
}

#[cfg(test)]
mod tests {
    use super::*;
    use libkv::geometry::Dtype;

    fn geometry() -> PageGeometry {
        PageGeometry {
            tokens_per_page: 4,
            layers: 3,
            kv_heads: 2,
            head_dim: 8,
            dtype: Dtype::Bf16,
        }
    }

    /// `n` values that differ from each other, exactly representable in bf16.
    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 + seed * 11) % 61) as f32 / 16.0 - 1.5)
            .collect()
    }

    #[test]
    fn the_token_major_order_covers_a_page_exactly_once() {
        let g = geometry();
        let page = usize::try_from(g.bytes_per_page()).unwrap();
        let (hd, sz) = (g.head_dim as usize, g.dtype.size());
        let mut seen = vec![false; page / (hd * sz)];
        for s in 0..4 {
            for l in 0..3 {
                for kv in [Kv::K, Kv::V] {
                    for h in 0..2 {
                        let at = PageOrder::TokenMajor.vector_offset(&g, l, kv, h, s);
                        assert_eq!(at % (hd * sz), 0);
                        assert!(!std::mem::replace(&mut seen[at / (hd * sz)], true));
                    }
                }
            }
        }
        assert!(seen.iter().all(|&s| s));
        // The layer-major order is the geometry's own.
        let g2 = geometry();
        assert_eq!(
            PageOrder::LayerMajor.vector_offset(&g, 2, Kv::V, 1, 3),
            g2.vector_offset(2, Kv::V, 1, 3)
        );
    }

    /// Pages of `tokens` tokens written in `order`.
    fn written(order: PageOrder, tokens: usize) -> Vec<Vec<u8>> {
        let g = geometry();
        let per_token = 3 * 2 * 2 * 8;
        let mut pages =
            vec![vec![0u8; usize::try_from(g.bytes_per_page()).unwrap()]; tokens.div_ceil(4)];
        for t in 0..tokens {
            write_token(order, &g, &mut pages[t / 4], t % 4, &values(per_token, t));
        }
        pages
    }

    fn refs(p: &[Vec<u8>]) -> Vec<&[u8]> {
        p.iter().map(Vec::as_slice).collect()
    }

    #[test]
    fn both_orders_attend_to_the_same_values_and_fill_the_same_engine_blocks() {
        let g = geometry();
        let tokens = 10; // a partial last page
        let (lm, tm) = (
            written(PageOrder::LayerMajor, tokens),
            written(PageOrder::TokenMajor, tokens),
        );
        assert_ne!(lm, tm, "the orders differ");
        let q = values(3 * 4 * 8, 99);
        let a = attend(PageOrder::LayerMajor, &g, 4, &refs(&lm), tokens, &q);
        let b = attend(PageOrder::TokenMajor, &g, 4, &refs(&tm), tokens, &q);
        assert_eq!(a, b);
        // and the attention reads the values: another token's K changes the output
        let mut other = tm.clone();
        write_token(
            PageOrder::TokenMajor,
            &g,
            &mut other[0],
            1,
            &values(96, 500),
        );
        assert_ne!(
            attend(PageOrder::TokenMajor, &g, 4, &refs(&other), tokens, &q),
            b
        );
        let block = 4 * 2 * 8 * 2;
        for blocks in [EngineBlocks::Nhd, EngineBlocks::Hnd] {
            let mut e1 = vec![vec![0u8; 3 * block]; 6];
            let mut e2 = e1.clone();
            let c1 = to_engine(PageOrder::LayerMajor, &g, &refs(&lm), blocks, &mut e1);
            let c2 = to_engine(PageOrder::TokenMajor, &g, &refs(&tm), blocks, &mut e2);
            assert_eq!(e1, e2, "{blocks:?}");
            // 3 pages x 3 layers x K/V: one slab each, or a run per slot, or a vector each
            let (lm_copies, tm_copies) = match blocks {
                EngineBlocks::Hnd => (18, 18 * 4 * 2),
                EngineBlocks::Nhd => (18 * 4 * 2, 18 * 4),
            };
            assert_eq!((c1, c2), (lm_copies, tm_copies), "{blocks:?}");
        }
        // The engine block of layer 1's V, page 0, slot 2, head 1 (NHD) is that vector.
        let mut e = vec![vec![0u8; 3 * block]; 6];
        to_engine(
            PageOrder::LayerMajor,
            &g,
            &refs(&lm),
            EngineBlocks::Nhd,
            &mut e,
        );
        let at = PageOrder::LayerMajor.vector_offset(&g, 1, Kv::V, 1, 2);
        assert_eq!(
            &e[3][(2 * 2 + 1) * 16..(2 * 2 + 2) * 16],
            &lm[0][at..at + 16]
        );
    }
}
