//! Newtypes for the identifiers that cross module and process boundaries.
//!
//! No raw integer crosses a module boundary: a page index, a request id and a generation are
//! different things, and the type system keeps them apart.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A request, as numbered by kvctld. Unique for the life of one kvctld instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

/// Incremented by kvctld at every start, so that ids of an earlier incarnation never match
/// pages reserved by a later one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Generation(pub u64);

/// Index of a page inside one pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PageId(pub u32);

/// Byte offset inside one pool's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolOffset(pub u64);

/// The owner of a page: a request in one generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Owner {
    pub request: RequestId,
    pub generation: Generation,
}

impl PageId {
    /// The page index as a `usize`, for indexing tables.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req#{}", self.0)
    }
}

impl fmt::Display for PageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "page#{}", self.0)
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/gen{}", self.request, self.generation.0)
    }
}

/// Longest worker id.
pub const MAX_WORKER_ID_BYTES: usize = 64;

/// Whether `id` can name a worker: 1 to [`MAX_WORKER_ID_BYTES`] bytes of
/// `[A-Za-z0-9_.@:-]` (a systemd instance name, a host and a GPU index).
pub fn is_valid_worker_id(id: &str) -> bool {
    (1..=MAX_WORKER_ID_BYTES).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'@' | b':' | b'-'))
}
