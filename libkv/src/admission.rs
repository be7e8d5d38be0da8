//! Admission: both pools or neither, and rejection is terminal.
//!
//! A request needs `pages(prompt)` pages on prefill and `pages(prompt + max_new)` on decode.
//! [`admit`] either reserves both atomically and returns an [`Admitted`] — the only value the
//! bootstrap path accepts — or returns a [`Rejection`] that consumes the request: a rejected
//! request has nothing left to bootstrap, transfer or decode with, and there is no placeholder.
//!
//! "Can never fit" (prompt over max context, more pages than the pool has) and "not now" (the
//! pool is temporarily full) are different reasons: the first is an immediate error, the
//! second may wait in a bounded queue until a deadline.

pub use crate::config::Side;
use crate::geometry::PageGeometry;
use crate::ids::Owner;
use crate::pool::{PagePool, PoolError, Reservation};

/// What a client asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestSpec {
    pub tenant: String,
    pub prompt_tokens: u32,
    pub max_new_tokens: u32,
}

/// The deployment's limits, taken from validated config and the registered pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub geometry: PageGeometry,
    pub max_context: u32,
    pub max_new_tokens: u32,
    pub prefill_pages: u32,
    pub decode_pages: u32,
}

/// Pages a request needs on each side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Need {
    pub prefill_pages: u32,
    pub decode_pages: u32,
}

/// Why a request was not admitted.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum Rejection {
    #[error("bad request: {reason}")]
    BadRequest { reason: &'static str },
    #[error("prompt of {prompt} tokens exceeds the maximum context of {max_context}")]
    PromptExceedsContext { prompt: u32, max_context: u32 },
    #[error("max_new_tokens {asked} exceeds the limit of {limit}")]
    MaxNewExceedsLimit { asked: u32, limit: u32 },
    #[error("{side} needs {need_pages} pages but the pool has only {pool_pages}")]
    ExceedsCapacity {
        side: Side,
        need_pages: u32,
        pool_pages: u32,
    },
    #[error("{side} pool is full: {need_pages} pages needed, {free_pages} free")]
    PoolFull {
        side: Side,
        need_pages: u32,
        free_pages: u32,
    },
}

impl Rejection {
    /// Whether the request can never be admitted as it is (an immediate error to the client).
    /// Only a temporarily full pool is not terminal; such a request may wait, bounded.
    pub fn is_terminal(&self) -> bool {
        !matches!(self, Rejection::PoolFull { .. })
    }
}

/// The static checks: whether the request could ever be admitted, and what it needs.
pub fn need(spec: &RequestSpec, limits: &Limits) -> Result<Need, Rejection> {
    if spec.prompt_tokens == 0 {
        return Err(Rejection::BadRequest {
            reason: "empty prompt",
        });
    }
    if spec.max_new_tokens == 0 {
        return Err(Rejection::BadRequest {
            reason: "max_new_tokens is zero",
        });
    }
    if spec.tenant.is_empty() {
        return Err(Rejection::BadRequest {
            reason: "empty tenant",
        });
    }
    if spec.prompt_tokens > limits.max_context {
        return Err(Rejection::PromptExceedsContext {
            prompt: spec.prompt_tokens,
            max_context: limits.max_context,
        });
    }
    if spec.max_new_tokens > limits.max_new_tokens {
        return Err(Rejection::MaxNewExceedsLimit {
            asked: spec.max_new_tokens,
            limit: limits.max_new_tokens,
        });
    }
    let g = &limits.geometry;
    let pages = |tokens: u64| u32::try_from(g.pages_for_tokens(tokens)).unwrap_or(u32::MAX);
    let need = Need {
        prefill_pages: pages(u64::from(spec.prompt_tokens)),
        decode_pages: pages(u64::from(spec.prompt_tokens) + u64::from(spec.max_new_tokens)),
    };
    for (side, n, total) in [
        (Side::Prefill, need.prefill_pages, limits.prefill_pages),
        (Side::Decode, need.decode_pages, limits.decode_pages),
    ] {
        if n > total {
            return Err(Rejection::ExceedsCapacity {
                side,
                need_pages: n,
                pool_pages: total,
            });
        }
    }
    Ok(need)
}

/// Page-count bookkeeping of both pools, for a controller that does not hold the pools
/// itself (kvctld). Both sides are taken or neither.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ledger {
    pub prefill_free: u32,
    pub decode_free: u32,
}

impl Ledger {
    /// Takes `need` from both sides, or nothing.
    pub fn take(&mut self, need: Need) -> Result<(), Rejection> {
        if need.prefill_pages > self.prefill_free {
            return Err(Rejection::PoolFull {
                side: Side::Prefill,
                need_pages: need.prefill_pages,
                free_pages: self.prefill_free,
            });
        }
        if need.decode_pages > self.decode_free {
            return Err(Rejection::PoolFull {
                side: Side::Decode,
                need_pages: need.decode_pages,
                free_pages: self.decode_free,
            });
        }
        self.prefill_free -= need.prefill_pages;
        self.decode_free -= need.decode_pages;
        Ok(())
    }

    /// Returns pages of one side once its worker reports them free.
    pub fn give_back(&mut self, side: Side, pages: u32) {
        let f = match side {
            Side::Prefill => &mut self.prefill_free,
            Side::Decode => &mut self.decode_free,
        };
        *f = f.saturating_add(pages);
    }
}

/// An admitted request: its reservations on both pools. Only [`admit`] makes one.
#[derive(Debug)]
pub struct Admitted {
    spec: RequestSpec,
    pub prefill: Reservation,
    pub decode: Reservation,
}

impl Admitted {
    pub fn spec(&self) -> &RequestSpec {
        &self.spec
    }

    pub fn owner(&self) -> Owner {
        self.prefill.owner()
    }
}

/// A rejected request. It carries the reason and the tenant only: the request itself is gone.
#[derive(Debug, thiserror::Error)]
#[error("request of tenant {tenant} rejected: {reason}")]
pub struct Rejected {
    pub tenant: String,
    #[source]
    pub reason: Rejection,
}

/// Admits `spec` against two local pools: reserves the prompt on `prefill` and prompt plus
/// max new tokens on `decode`, both or neither.
pub fn admit(
    spec: RequestSpec,
    limits: &Limits,
    owner: Owner,
    prefill: &PagePool,
    decode: &PagePool,
) -> Result<Admitted, Rejected> {
    let reject = |spec: RequestSpec, reason| Rejected {
        tenant: spec.tenant,
        reason,
    };
    if let Err(reason) = need(&spec, limits) {
        return Err(reject(spec, reason));
    }
    let prompt = spec.prompt_tokens;
    let total = u64::from(prompt) + u64::from(spec.max_new_tokens);
    let from_pool = |side, e: PoolError| match e {
        PoolError::Full { need, free } => Rejection::PoolFull {
            side,
            need_pages: need,
            free_pages: free,
        },
        PoolError::NeverFits { need, total } => Rejection::ExceedsCapacity {
            side,
            need_pages: need,
            pool_pages: total,
        },
        _ => Rejection::BadRequest {
            reason: "pool refused the reservation",
        },
    };
    let d = match decode.reserve(owner, prompt, total) {
        Ok(d) => d,
        Err(e) => return Err(reject(spec, from_pool(Side::Decode, e))),
    };
    let p = match prefill.reserve(owner, prompt, u64::from(prompt)) {
        Ok(p) => p,
        // `d` is dropped here: the decode pages go back before the rejection is returned.
        Err(e) => return Err(reject(spec, from_pool(Side::Prefill, e))),
    };
    Ok(Admitted {
        spec,
        prefill: p,
        decode: d,
    })
}
