//! RDMA device tests.
//!
//! The hardware tests select their device from `KVFENCE_RDMA_DEVICE` (with
//! `KVFENCE_RDMA_GID_INDEX`, default 1) and pass with a "SKIPPED" line when it is unset;
//! `tests/vm/rxe.sh` runs them against soft-RoCE (rdma_rxe) in a VM. The availability test
//! runs everywhere.

#![allow(clippy::print_stdout)]

use libkv::config::RdmaConfig;
use libkv::rdma::{RdmaAvailability, RdmaError, rdma_status, select_device};

/// The device under test, or `None` (after saying so) when none is configured.
fn device_under_test() -> Option<RdmaConfig> {
    let Ok(device) = std::env::var("KVFENCE_RDMA_DEVICE") else {
        println!("SKIPPED: no RDMA device (set KVFENCE_RDMA_DEVICE)");
        return None;
    };
    let mut cfg = RdmaConfig::for_device(device);
    if let Ok(idx) = std::env::var("KVFENCE_RDMA_GID_INDEX") {
        cfg.gid_index = idx.parse().expect("KVFENCE_RDMA_GID_INDEX is a number");
    }
    Some(cfg)
}

#[test]
fn status_and_selection_agree_on_this_host() {
    let missing = RdmaConfig::for_device("kvfence-no-such-device");
    match rdma_status() {
        RdmaAvailability::Unavailable { reason } => {
            println!("RDMA off: {reason}");
            assert!(
                !reason.trim().is_empty(),
                "an unavailable status gives a reason"
            );
            let err = select_device(&missing).unwrap_err();
            assert!(err.is_unavailable(), "{err}");
            assert!(err.to_string().contains(&reason), "{err}");
        }
        RdmaAvailability::Available { devices } => {
            assert!(!devices.is_empty());
            match select_device(&missing).unwrap_err() {
                RdmaError::NoSuchDevice { available, .. } => assert_eq!(available, devices),
                other => panic!("expected NoSuchDevice, got {other}"),
            }
        }
    }
}

#[test]
fn selects_the_device_under_test() {
    let Some(cfg) = device_under_test() else {
        return;
    };
    let dev = select_device(&cfg).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(dev.name(), cfg.device);
    assert_eq!((dev.port(), dev.gid_index()), (cfg.port, cfg.gid_index));
    assert!(!dev.gid().is_zero());
    println!("selected {dev:?}");
}

#[test]
fn wrong_gid_index_lists_the_valid_gids() {
    let Some(mut cfg) = device_under_test() else {
        return;
    };
    cfg.gid_index = 200;
    let err = select_device(&cfg).unwrap_err();
    println!("wrong GID index: {err}");
    match &err {
        RdmaError::BadGid { valid, .. } => {
            assert!(!valid.is_empty(), "{err}");
            assert!(valid.iter().all(|g| g.port == 1 && !g.address.is_empty()));
        }
        other => panic!("expected BadGid, got {other}"),
    }
    assert!(err.to_string().contains("index"), "{err}");
    cfg.gid_index = 1;
    cfg.port = 9;
    let err = select_device(&cfg).unwrap_err();
    println!("wrong port: {err}");
    assert!(matches!(err, RdmaError::BadPort { .. }), "{err}");
    cfg.port = 1;
    cfg.device = "kvfence-no-such-device".into();
    let err = select_device(&cfg).unwrap_err();
    println!("wrong device: {err}");
    assert!(err.to_string().contains("available:"), "{err}");
}
