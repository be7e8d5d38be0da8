//! kvfence core library.
//!
//! Paged KV pools with per-page ownership, fail-closed admission, coverage verification,
//! strict configuration, the Unix-socket wire protocol shared by kvctld, prefilld, decoded
//! and kvctl, and the worker runtime prefilld and decoded share ([`worker`]). See
//! `DESIGN.md` for the objectives, the trust model and the page ownership states.

pub mod admission;
pub mod chart;
pub mod config;
pub mod engine;
pub mod etcd;
pub mod fence;
pub mod geometry;
pub mod ids;
pub mod leader;
pub mod members;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod outbox;
pub mod pool;
pub mod progress;
pub mod proto;
pub mod rdma;
pub mod sys;
pub mod tcp;
#[cfg(feature = "testkit")]
pub mod testkit;
pub mod tls;
pub mod verify;
pub mod worker;

pub use geometry::{Dtype, Kv, PageGeometry};
pub use ids::{Generation, Owner, PageId, PoolOffset, RequestId};

/// `error: cause: cause...`, the whole chain of an error on one line, as the binaries print
/// it once.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
