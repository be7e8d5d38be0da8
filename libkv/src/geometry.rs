//! Page geometry: how many bytes one page of KV cache takes, and where each value sits.
//!
//! # Page layout
//!
//! A page holds the K and V vectors of `tokens_per_page` consecutive token positions for every
//! layer and KV head. Elements are stored little-endian in the configured dtype, in this order
//! (outermost first):
//!
//! ```text
//! page = [layer 0 .. layers)
//!          [kv: K = 0, V = 1]
//!            [head 0 .. kv_heads)
//!              [token slot 0 .. tokens_per_page)
//!                [dim 0 .. head_dim)   -> one element of dtype_size bytes
//! bytes_per_page = tokens_per_page * layers * 2 * kv_heads * head_dim * dtype_size
//! ```
//!
//! The token slot is innermost but one, so one head's K (or V) for a whole page is one
//! contiguous run, which is what attention kernels read.

use serde::{Deserialize, Serialize};

/// Element type of the stored K and V values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F16,
    Bf16,
    F32,
}

impl Dtype {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::F32 => 4,
        }
    }

    /// Stores `v` at the start of `out` in this dtype, little-endian.
    pub fn encode(self, v: f32, out: &mut [u8]) {
        match self {
            Dtype::F16 => out[..2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            Dtype::Bf16 => out[..2].copy_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            Dtype::F32 => out[..4].copy_from_slice(&v.to_le_bytes()),
        }
    }

    /// Reads one element of this dtype from the start of `bytes`.
    pub fn decode(self, bytes: &[u8]) -> f32 {
        match self {
            Dtype::F16 => half::f16::from_le_bytes([bytes[0], bytes[1]]).to_f32(),
            Dtype::Bf16 => half::bf16::from_le_bytes([bytes[0], bytes[1]]).to_f32(),
            Dtype::F32 => f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
        }
    }
}

/// K or V.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kv {
    K = 0,
    V = 1,
}

/// The shape of one page. All fields are non-zero once validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PageGeometry {
    pub tokens_per_page: u32,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub dtype: Dtype,
}

impl PageGeometry {
    /// Bytes of KV one token takes across all layers and heads.
    /// Saturates at `u64::MAX` for absurd geometries, which `is_valid` refuses.
    pub fn bytes_per_token(&self) -> u64 {
        [
            u64::from(self.kv_heads),
            u64::from(self.head_dim),
            self.dtype.size() as u64,
            2,
        ]
        .into_iter()
        .fold(u64::from(self.layers), u64::saturating_mul)
    }

    /// Bytes of one page (see the module docs for the layout); saturating like
    /// [`bytes_per_token`](Self::bytes_per_token).
    pub fn bytes_per_page(&self) -> u64 {
        self.bytes_per_token()
            .saturating_mul(u64::from(self.tokens_per_page))
    }

    /// Pages needed to hold `tokens` token positions. Zero tokens need zero pages.
    pub fn pages_for_tokens(&self, tokens: u64) -> u64 {
        tokens.div_ceil(u64::from(self.tokens_per_page.max(1)))
    }

    /// Token positions `pages` pages can hold.
    pub fn tokens_for_pages(&self, pages: u64) -> u64 {
        pages.saturating_mul(u64::from(self.tokens_per_page))
    }

    /// Whether every dimension is non-zero and a page fits in memory arithmetic.
    pub fn is_valid(&self) -> bool {
        self.tokens_per_page > 0
            && self.layers > 0
            && self.kv_heads > 0
            && self.head_dim > 0
            && self.bytes_per_page() <= (1 << 30)
    }

    /// Byte offset, inside a page, of element `dim` of `kv` for (`layer`, `head`, `slot`).
    pub fn element_offset(&self, layer: u32, kv: Kv, head: u32, slot: u32, dim: u32) -> usize {
        debug_assert!(layer < self.layers && head < self.kv_heads);
        debug_assert!(slot < self.tokens_per_page && dim < self.head_dim);
        let heads = self.kv_heads as usize;
        let tpp = self.tokens_per_page as usize;
        let hd = self.head_dim as usize;
        let idx = (((layer as usize * 2 + kv as usize) * heads + head as usize) * tpp
            + slot as usize)
            * hd
            + dim as usize;
        idx * self.dtype.size()
    }

    /// Byte offset of the first element of one head's vector for one token slot.
    pub fn vector_offset(&self, layer: u32, kv: Kv, head: u32, slot: u32) -> usize {
        self.element_offset(layer, kv, head, slot, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama8b() -> PageGeometry {
        PageGeometry {
            tokens_per_page: 16,
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
            dtype: Dtype::Bf16,
        }
    }

    #[test]
    fn llama_8b_token_is_128_kib() {
        assert_eq!(llama8b().bytes_per_token(), 128 * 1024);
        assert_eq!(llama8b().bytes_per_page(), 16 * 128 * 1024);
    }

    #[test]
    fn offsets_cover_the_page_exactly_once() {
        let g = PageGeometry {
            tokens_per_page: 3,
            layers: 2,
            kv_heads: 2,
            head_dim: 4,
            dtype: Dtype::F16,
        };
        let mut seen = vec![false; usize::try_from(g.bytes_per_page()).unwrap() / 2];
        for l in 0..2 {
            for kv in [Kv::K, Kv::V] {
                for h in 0..2 {
                    for s in 0..3 {
                        for d in 0..4 {
                            let o = g.element_offset(l, kv, h, s, d) / 2;
                            assert!(!seen[o], "offset {o} used twice");
                            seen[o] = true;
                        }
                    }
                }
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn pages_round_up() {
        let g = llama8b();
        assert_eq!(g.pages_for_tokens(0), 0);
        assert_eq!(g.pages_for_tokens(1), 1);
        assert_eq!(g.pages_for_tokens(16), 1);
        assert_eq!(g.pages_for_tokens(17), 2);
    }

    #[test]
    fn dtypes_round_trip_small_integers() {
        for dt in [Dtype::F16, Dtype::Bf16, Dtype::F32] {
            let mut b = [0u8; 4];
            for v in 0..16 {
                dt.encode(v as f32, &mut b);
                assert_eq!(dt.decode(&b), v as f32);
            }
        }
    }
}
