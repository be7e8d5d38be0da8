//! RDMA transport groundwork: device discovery and selection, pool registration and
//! per-request memory windows (see [`RegisteredPool`]).
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

/// Probes the host for RDMA devices: in a build without the `rdma` feature, none.
#[cfg(not(feature = "rdma"))]
pub fn rdma_status() -> RdmaAvailability {
    RdmaAvailability::Unavailable {
        reason: "this build has no RDMA support (built without the `rdma` feature)".to_owned(),
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
