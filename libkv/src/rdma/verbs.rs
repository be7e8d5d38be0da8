//! The verbs side of the RDMA transport (feature `rdma`): device selection, QPs, windows.

use std::fmt;
use std::io;
use std::sync::Arc;

use sideway::ibverbs::address::{Gid, GidType};
use sideway::ibverbs::device::{DeviceInfo, DeviceList, GetDeviceListErrorKind};
use sideway::ibverbs::device_context::DeviceContext;

use super::{GidInfo, RdmaAvailability, RdmaError};
use crate::config::RdmaConfig;

#[path = "window.rs"]
mod window;
pub use window::{
    Completion, MAX_READ_BYTES, PageRead, QpEndpoint, RdmaQp, RegisteredPool, RequestWindow,
    WindowAccess,
};

fn gid_kind(kind: GidType) -> &'static str {
    match kind {
        GidType::InfiniBand => "IB",
        GidType::RoceV1 => "RoCEv1",
        GidType::RoceV2 => "RoCEv2",
    }
}

fn gid_address(gid: &Gid) -> String {
    std::net::Ipv6Addr::from(*gid).to_string()
}

/// An opened RDMA device with a checked port and GID.
pub struct RdmaDevice {
    name: String,
    port: u8,
    gid_index: u32,
    gid: Gid,
    /// RDMA READs one QP may have outstanding (initiator and responder), at most 16.
    read_depth: u8,
    context: Arc<DeviceContext>,
}

impl fmt::Debug for RdmaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaDevice")
            .field("name", &self.name)
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("gid", &gid_address(&self.gid))
            .finish_non_exhaustive()
    }
}

impl RdmaDevice {
    /// Device name (`mlx5_0`, `rxe0`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The checked port number.
    pub fn port(&self) -> u8 {
        self.port
    }

    /// The checked GID index.
    pub fn gid_index(&self) -> u32 {
        self.gid_index
    }

    /// The GID at the checked index.
    pub fn gid(&self) -> Gid {
        self.gid
    }

    /// RDMA READs a QP on this device may have in flight at once.
    pub fn read_depth(&self) -> u8 {
        self.read_depth
    }

    /// The opened device.
    pub fn context(&self) -> &Arc<DeviceContext> {
        &self.context
    }
}

/// Why the host's device list cannot be had, in words an operator can act on.
fn unavailable_reason(err: &io::Error) -> String {
    match err.raw_os_error() {
        Some(nix::libc::ENOSYS) => {
            format!("the kernel has no RDMA (InfiniBand) support: listing devices failed ({err})")
        }
        Some(nix::libc::EOPNOTSUPP) => {
            format!("libibverbs is not installed or cannot be loaded ({err})")
        }
        _ => format!("cannot list RDMA devices ({err})"),
    }
}

fn device_list() -> Result<DeviceList, RdmaError> {
    let list = DeviceList::new().map_err(|e| {
        let reason = match &e.0 {
            GetDeviceListErrorKind::Ibverbs(io) => unavailable_reason(io),
            #[allow(unreachable_patterns)]
            _ => format!("cannot list RDMA devices ({e})"),
        };
        RdmaError::Unavailable { reason }
    })?;
    if list.is_empty() {
        return Err(RdmaError::Unavailable {
            reason: "no RDMA devices (no NIC driver loaded, or no rxe/siw link added)".to_owned(),
        });
    }
    Ok(list)
}

/// Probes the host for RDMA devices without opening any.
pub fn rdma_status() -> RdmaAvailability {
    match device_list() {
        Ok(list) => RdmaAvailability::Available {
            devices: list.iter().map(|d| d.name()).collect(),
        },
        Err(RdmaError::Unavailable { reason }) => RdmaAvailability::Unavailable { reason },
        Err(other) => RdmaAvailability::Unavailable {
            reason: other.to_string(),
        },
    }
}

/// The valid GIDs of `port` (all ports when `None`) of an opened device.
fn valid_gids(ctx: &DeviceContext, port: Option<u8>) -> Vec<GidInfo> {
    let Ok(table) = ctx.query_gid_table() else {
        return Vec::new();
    };
    table
        .iter()
        .filter(|e| port.is_none_or(|p| e.port_num() == u32::from(p)) && !e.gid().is_zero())
        .map(|e| GidInfo {
            port: e.port_num(),
            index: e.gid_index(),
            kind: gid_kind(e.gid_type()),
            address: gid_address(&e.gid()),
        })
        .collect()
}

/// Opens the configured device and checks its port and GID index.
pub fn select_device(cfg: &RdmaConfig) -> Result<RdmaDevice, RdmaError> {
    let list = device_list()?;
    let Some(device) = list.iter().find(|d| d.name() == cfg.device) else {
        return Err(RdmaError::NoSuchDevice {
            wanted: cfg.device.clone(),
            available: list.iter().map(|d| d.name()).collect(),
        });
    };
    let name = cfg.device.clone();
    let context = device.open().map_err(|e| RdmaError::Open {
        device: name.clone(),
        source: Box::new(e),
    })?;
    let attr = context.query_device().map_err(|e| RdmaError::Query {
        device: name.clone(),
        source: Box::new(e),
    })?;
    let ports = attr.phys_port_cnt();
    if cfg.port == 0 || cfg.port > ports {
        return Err(RdmaError::BadPort {
            device: name,
            port: cfg.port,
            ports,
            valid: valid_gids(&context, None),
        });
    }
    let valid = valid_gids(&context, Some(cfg.port));
    let gid = match context.query_gid(cfg.port, cfg.gid_index) {
        Ok(gid) if !gid.is_zero() && valid.iter().any(|g| g.index == cfg.gid_index) => gid,
        _ => {
            return Err(RdmaError::BadGid {
                device: name,
                port: cfg.port,
                gid_index: cfg.gid_index,
                valid,
            });
        }
    };
    // Both ends must accept the depth: the responder's max_qp_rd_atom and the initiator's
    // max_qp_init_rd_atom; 16 is what common NICs offer and plenty for page runs.
    let depth = attr
        .max_qp_rd_atom()
        .min(attr.max_qp_init_rd_atom())
        .clamp(1, 16);
    Ok(RdmaDevice {
        name,
        port: cfg.port,
        gid_index: cfg.gid_index,
        gid,
        read_depth: u8::try_from(depth).unwrap_or(1),
        context,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_list_what_exists() {
        let e = RdmaError::NoSuchDevice {
            wanted: "mlx5_9".into(),
            available: vec!["mlx5_0".into(), "rxe0".into()],
        };
        assert_eq!(
            e.to_string(),
            "RDMA device \"mlx5_9\" not found; available: mlx5_0, rxe0"
        );
        let e = RdmaError::BadGid {
            device: "rxe0".into(),
            port: 1,
            gid_index: 7,
            valid: vec![GidInfo {
                port: 1,
                index: 1,
                kind: "RoCEv2",
                address: "::ffff:192.0.2.1".into(),
            }],
        };
        assert_eq!(
            e.to_string(),
            "RDMA device rxe0 port 1 has no usable GID at index 7; valid GIDs of the port: \
             [port 1 index 1 RoCEv2 ::ffff:192.0.2.1]"
        );
        assert!(!e.is_unavailable());
    }

    #[test]
    fn unavailable_reasons_name_the_cause() {
        let r = unavailable_reason(&io::Error::from_raw_os_error(nix::libc::ENOSYS));
        assert!(r.contains("no RDMA"), "{r}");
        let r = unavailable_reason(&io::Error::from_raw_os_error(nix::libc::EOPNOTSUPP));
        assert!(r.contains("libibverbs"), "{r}");
    }
}
