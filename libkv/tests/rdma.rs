//! RDMA device tests.
//!
//! The hardware tests select their device from `KVFENCE_RDMA_DEVICE` (with
//! `KVFENCE_RDMA_GID_INDEX`, default 1) and pass with a "SKIPPED" line when it is unset;
//! `tests/vm/rxe.sh` runs them against soft-RoCE (rdma_rxe) in a VM. The availability test
//! runs everywhere.

#![cfg(feature = "rdma")]
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

mod windows {
    use super::*;
    use libkv::PageId;
    use libkv::memory::{HostMemory, PoolMemory};
    use libkv::rdma::{RdmaQp, RegisteredPool, WindowAccess};
    use std::rc::Rc;
    use std::sync::Arc;
    use std::time::Instant;

    const PAGE: u64 = 4096;
    const PAGES: u32 = 16;

    /// A pool and a peer buffer, both registered, and a connected loopback RC QP pair:
    /// `owner` binds windows over `pool`, `peer` writes into them from `src`.
    struct Loopback {
        pool: RegisteredPool,
        src: RegisteredPool,
        owner: Rc<RdmaQp>,
        peer: RdmaQp,
    }

    fn snapshot(mem: &dyn PoolMemory) -> Vec<u8> {
        let ptr = mem.host_ptr().unwrap();
        let len = usize::try_from(mem.len()).unwrap();
        // SAFETY: the mapping is `len` bytes long and lives as long as `mem`; no RDMA
        // operation is in flight while the test reads it (each one was waited for).
        unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) }.to_vec()
    }

    fn fill(mem: &HostMemory, byte: u8) {
        let ptr = mem.host_ptr().unwrap();
        // SAFETY: as in `snapshot`; this process is the only writer.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), byte, usize::try_from(mem.len()).unwrap()) };
    }

    fn loopback(cfg: &RdmaConfig) -> Loopback {
        let dev = select_device(cfg).unwrap_or_else(|e| panic!("{e}"));
        let pd = dev.context().alloc_pd().unwrap();
        let pool_mem =
            Arc::new(HostMemory::new(c"kvfence-rdma-pool", PAGE * u64::from(PAGES)).unwrap());
        let src_mem =
            Arc::new(HostMemory::new(c"kvfence-rdma-src", PAGE * u64::from(PAGES)).unwrap());
        fill(&pool_mem, 0x11);
        fill(&src_mem, 0xee);
        let pool = RegisteredPool::new(&pd, pool_mem, PAGE).unwrap_or_else(|e| panic!("{e}"));
        let src = RegisteredPool::new(&pd, src_mem, PAGE).unwrap_or_else(|e| panic!("{e}"));
        let mut owner = RdmaQp::new(&dev, &pd, 0x1000, true).unwrap_or_else(|e| panic!("{e}"));
        let mut peer = RdmaQp::new(&dev, &pd, 0x2000, true).unwrap_or_else(|e| panic!("{e}"));
        let (a, b) = (owner.endpoint(), peer.endpoint());
        owner.connect(&b).unwrap_or_else(|e| panic!("{e}"));
        peer.connect(&a).unwrap_or_else(|e| panic!("{e}"));
        Loopback {
            pool,
            src,
            owner: Rc::new(owner),
            peer,
        }
    }

    fn source(lb: &Loopback, len: u64) -> &[u8] {
        let ptr = lb.src.memory().host_ptr().unwrap();
        // SAFETY: `len` is at most the source pool's length; the bytes stay registered and
        // mapped for as long as `lb` lives.
        unsafe { std::slice::from_raw_parts(ptr.as_ptr(), usize::try_from(len).unwrap()) }
    }

    #[test]
    fn write_through_a_window_lands_in_exactly_its_pages() {
        let Some(cfg) = device_under_test() else {
            return;
        };
        let lb = loopback(&cfg);
        let (first, count) = (PageId(5), 3);
        let window = lb
            .pool
            .bind_window(&lb.owner, first, count, WindowAccess::Write)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(window.addr(), lb.pool.page_addr(first).unwrap());
        assert_eq!(window.len(), u64::from(count) * PAGE);
        assert_ne!(
            window.rkey(),
            lb.pool.mr().rkey(),
            "the pool's own rkey never leaves"
        );
        let c = lb
            .peer
            .write(
                lb.src.mr(),
                source(&lb, window.len()),
                window.rkey(),
                window.addr(),
            )
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            c.is_success(),
            "write through the window: status {}",
            c.status
        );
        let after = snapshot(lb.pool.memory());
        let page = usize::try_from(PAGE).unwrap();
        let (lo, hi) = (5 * page, 8 * page);
        assert!(
            after[lo..hi].iter().all(|&b| b == 0xee),
            "the window's pages were written"
        );
        assert!(
            after[..lo].iter().chain(&after[hi..]).all(|&b| b == 0x11),
            "no other page changed"
        );
        window.invalidate().unwrap_or_else(|e| panic!("{e}"));
        println!("write of {} pages through a window: ok", count);
    }

    #[test]
    fn write_after_invalidate_is_refused() {
        let Some(cfg) = device_under_test() else {
            return;
        };
        let lb = loopback(&cfg);
        let window = lb
            .pool
            .bind_window(&lb.owner, PageId(2), 2, WindowAccess::Write)
            .unwrap_or_else(|e| panic!("{e}"));
        let (rkey, addr, len) = (window.rkey(), window.addr(), window.len());
        window.invalidate().unwrap_or_else(|e| panic!("{e}"));
        let before = snapshot(lb.pool.memory());
        let c = lb
            .peer
            .write(lb.src.mr(), source(&lb, len), rkey, addr)
            .unwrap_or_else(|e| panic!("{e}"));
        println!("write through an invalidated rkey: status {}", c.status);
        assert!(
            c.is_remote_access_error(),
            "expected a remote access error, got status {}",
            c.status
        );
        assert_eq!(snapshot(lb.pool.memory()), before, "the pool is unchanged");
    }

    #[test]
    fn bind_and_invalidate_cost() {
        let Some(cfg) = device_under_test() else {
            return;
        };
        let lb = loopback(&cfg);
        let mut costs = Vec::with_capacity(100);
        for i in 0..100u32 {
            let t = Instant::now();
            let window = lb
                .pool
                .bind_window(&lb.owner, PageId(i % PAGES), 1, WindowAccess::Write)
                .unwrap_or_else(|e| panic!("bind {i}: {e}"));
            window
                .invalidate()
                .unwrap_or_else(|e| panic!("invalidate {i}: {e}"));
            costs.push(t.elapsed());
        }
        costs.sort();
        println!(
            "bind + invalidate per request: median {:?} (min {:?}, max {:?}, 100 runs, including window allocation)",
            costs[50], costs[0], costs[99]
        );
    }
}
