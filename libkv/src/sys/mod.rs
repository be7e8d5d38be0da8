//! Thin wrappers over system calls. All unsafe code of libkv lives below this module.

pub mod digest;
pub mod memfd;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod uds;
