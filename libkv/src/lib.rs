//! kvfence core library.
//!
//! Paged KV pools with per-page ownership, fail-closed admission, coverage verification,
//! strict configuration and the Unix-socket wire protocol shared by kvctld, prefilld,
//! decoded and kvctl. See `DESIGN.md` for the objectives, the trust model and the page
//! ownership states.

pub mod admission;
pub mod config;
pub mod geometry;
pub mod ids;
pub mod link;
pub mod memory;
pub mod model;
pub mod pool;
pub mod proto;
pub mod rdma;
pub mod sys;
pub mod tcp;
pub mod verify;

pub use geometry::{Dtype, Kv, PageGeometry};
pub use ids::{Generation, Owner, PageId, PoolOffset, RequestId};
