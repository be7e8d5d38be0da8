//! The RDMA transport: device discovery and selection, pool registration, per-request
//! memory windows (see `RegisteredPool`) and the sessions that read pages through them
//! ([`ServerSession`], [`ClientSession`]; the design is in `session.rs`).
//!
//! Devices are reached through `sideway`, which loads libibverbs at run time: a binary built
//! with RDMA support still starts on a host without it, and [`rdma_status`] says why RDMA is
//! off so that the workers can log it once and carry on over shm or TCP.
//!
//! [`select_device`] opens the configured device and checks the port and GID index before
//! anything else uses them. GID selection is the most common bring-up failure, so a wrong
//! port or index is refused with the port's valid GIDs (index, type, address) in the error.

//!
//! All of it needs the `rdma` cargo feature (the verbs bindings are generated at build time,
//! which needs cmake and libclang). Without it, [`rdma_status`] says RDMA was not built in
//! and the workers log that once and serve over shm or TCP.

/// Whether this host can do RDMA.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RdmaAvailability {
    /// These devices are present.
    Available { devices: Vec<String> },
    /// No RDMA here, and why.
    Unavailable { reason: String },
}

#[cfg(feature = "rdma")]
mod verbs;
#[cfg(feature = "rdma")]
pub use verbs::*;

mod session;
pub use session::{ClientSession, RdmaNode, ServerSession};

use std::fmt;
use std::io;

/// What an RDMA read of pages did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// RDMA READs posted (contiguous pages coalesced).
    pub reads: u32,
    /// Bytes read.
    pub bytes: u64,
}

/// Errors of RDMA device discovery and selection.
#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    /// The host has no usable RDMA (no kernel support, no libibverbs, no device).
    #[error("RDMA unavailable: {reason}")]
    Unavailable { reason: String },

    #[error(
        "RDMA device {wanted:?} not found; available: {}",
        list_or_none(available)
    )]
    NoSuchDevice {
        wanted: String,
        available: Vec<String>,
    },

    #[error("cannot open RDMA device {device}")]
    Open {
        device: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    #[error("cannot query RDMA device {device}")]
    Query {
        device: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    #[error(
        "RDMA device {device} has no port {port} (it has ports 1..={ports}); valid GIDs: {}",
        list_or_none(valid)
    )]
    BadPort {
        device: String,
        port: u8,
        ports: u8,
        valid: Vec<GidInfo>,
    },

    #[error(
        "RDMA device {device} port {port} has no usable GID at index {gid_index}; \
         valid GIDs of the port: {}",
        list_or_none(valid)
    )]
    BadGid {
        device: String,
        port: u8,
        gid_index: u32,
        valid: Vec<GidInfo>,
    },

    #[error("{op} failed")]
    Verb {
        op: &'static str,
        #[source]
        source: io::Error,
    },

    #[error("{op} completed with status {status}")]
    Completion { op: &'static str, status: u32 },

    #[error("work request {wr_id} did not complete within {after:?}")]
    Stuck {
        wr_id: u64,
        after: std::time::Duration,
    },

    #[error("stopped before the transfer completed")]
    Stopped,

    #[error("out of range: {what}")]
    OutOfRange { what: &'static str },
}

impl RdmaError {
    /// Whether RDMA is simply absent on this host (as opposed to misconfigured).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, RdmaError::Unavailable { .. })
    }

    /// Whether the configuration names a device, port or GID that does not exist.
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            RdmaError::NoSuchDevice { .. } | RdmaError::BadPort { .. } | RdmaError::BadGid { .. }
        )
    }
}

fn list_or_none<T: fmt::Display>(items: &[T]) -> String {
    if items.is_empty() {
        return "none".to_owned();
    }
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// One entry of a port's GID table, for errors and logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidInfo {
    pub port: u32,
    pub index: u32,
    /// "IB", "RoCEv1" or "RoCEv2".
    pub kind: &'static str,
    /// The GID as an IPv6 address (an IPv4-mapped one on RoCE v2).
    pub address: String,
}

impl fmt::Display for GidInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[port {} index {} {} {}]",
            self.port, self.index, self.kind, self.address
        )
    }
}

/// Probes the host for RDMA devices: in a build without the `rdma` feature, none.
#[cfg(not(feature = "rdma"))]
pub fn rdma_status() -> RdmaAvailability {
    RdmaAvailability::Unavailable {
        reason: "this build has no RDMA support (built without the `rdma` feature)".to_owned(),
    }
}

/// Opens the RDMA device for a worker whose `[transfer]` transport is `"rdma"` and registers
/// its pool (`serve`: prefilld, whose pages are read through windows; otherwise decoded,
/// whose pool no peer can reach). `Ok(None)` for other transports, and where the host has
/// no RDMA at all: then it logs once why and the worker moves pages over TCP. A device,
/// port or GID that is configured but wrong is an error: the worker refuses to start.
pub fn open_node(
    cfg: &crate::config::Config,
    pool: &crate::pool::PagePool,
    serve: bool,
) -> Result<Option<std::sync::Arc<RdmaNode>>, RdmaError> {
    use crate::config::TransportKind;
    let (TransportKind::Rdma, Some(rdma)) = (cfg.transfer.transport, &cfg.rdma) else {
        log_status();
        return Ok(None);
    };
    match RdmaNode::open(rdma, pool, serve) {
        Ok(node) => {
            log::info!("RDMA on: {}", node.describe());
            Ok(Some(std::sync::Arc::new(node)))
        }
        Err(RdmaError::Unavailable { reason }) => {
            log::warn!("RDMA off: {reason}; moving pages over TCP");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Logs once, at start-up, whether RDMA is available; the workers carry on either way.
pub fn log_status() -> RdmaAvailability {
    let status = rdma_status();
    match &status {
        RdmaAvailability::Unavailable { reason } => log::info!("RDMA off: {reason}"),
        RdmaAvailability::Available { devices } => {
            log::info!("RDMA devices: {}", devices.join(", "));
        }
    }
    status
}

#[cfg(all(test, not(feature = "rdma")))]
mod tests {
    use super::*;

    #[test]
    fn a_build_without_rdma_says_so() {
        match log_status() {
            RdmaAvailability::Unavailable { reason } => assert!(reason.contains("rdma")),
            other => panic!("{other:?}"),
        }
    }
}
