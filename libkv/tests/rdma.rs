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
    use libkv::rdma::{PageRead, RdmaDevice, RdmaQp, ReadStats, RegisteredPool, WindowAccess};
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

    /// `ibv_wc_status` of a request the peer refused (bad, foreign or dead rkey, wrong
    /// access).
    const REM_ACCESS_ERR: u32 = 10;

    /// The pull side of the design: `owner` binds read windows over `pool` (registered for
    /// windows); `reader`, a QP with no remote rights of its own, reads through them into
    /// `dst` (registered for local access only) and writes from `src` when a test probes
    /// writes.
    struct Reads {
        dev: RdmaDevice,
        pool: RegisteredPool,
        dst: RegisteredPool,
        src: RegisteredPool,
        owner: Rc<RdmaQp>,
        reader: RdmaQp,
    }

    /// The byte at `offset` of pool page `page`: every page differs from every other.
    fn pattern(page: usize, offset: usize) -> u8 {
        u8::try_from((page * 251 + offset) % 253).unwrap_or(0)
    }

    fn fill_pattern(mem: &HostMemory) {
        let ptr = mem.host_ptr().unwrap();
        let len = usize::try_from(mem.len()).unwrap();
        // SAFETY: the mapping is `len` bytes long and lives as long as `mem`; nothing else
        // reads or writes it while this runs (no RDMA operation is in flight yet).
        let bytes = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len) };
        let page = usize::try_from(PAGE).unwrap();
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = pattern(i / page, i % page);
        }
    }

    /// A connected pair of fresh QPs in the PD of `like`: (owner side, peer side).
    fn pair(dev: &RdmaDevice, like: &RdmaQp, psn: u32, peer_remote: bool) -> (RdmaQp, RdmaQp) {
        let pd = like.pd();
        let mut owner = RdmaQp::new(dev, pd, psn, true).unwrap_or_else(|e| panic!("{e}"));
        let mut peer =
            RdmaQp::new(dev, pd, psn + 0x100, peer_remote).unwrap_or_else(|e| panic!("{e}"));
        let (a, b) = (owner.endpoint(), peer.endpoint());
        owner.connect(&b).unwrap_or_else(|e| panic!("{e}"));
        peer.connect(&a).unwrap_or_else(|e| panic!("{e}"));
        (owner, peer)
    }

    fn reads(cfg: &RdmaConfig) -> Reads {
        let dev = select_device(cfg).unwrap_or_else(|e| panic!("{e}"));
        let pd = dev.context().alloc_pd().unwrap();
        let bytes = PAGE * u64::from(PAGES);
        let pool_mem = Arc::new(HostMemory::new(c"kvfence-rdma-pool", bytes).unwrap());
        let dst_mem = Arc::new(HostMemory::new(c"kvfence-rdma-dst", bytes).unwrap());
        let src_mem = Arc::new(HostMemory::new(c"kvfence-rdma-src", bytes).unwrap());
        fill_pattern(&pool_mem);
        fill(&dst_mem, 0x77);
        fill(&src_mem, 0xee);
        let pool = RegisteredPool::new(&pd, pool_mem, PAGE).unwrap_or_else(|e| panic!("{e}"));
        let dst = RegisteredPool::local_only(&pd, dst_mem, PAGE).unwrap_or_else(|e| panic!("{e}"));
        let src = RegisteredPool::local_only(&pd, src_mem, PAGE).unwrap_or_else(|e| panic!("{e}"));
        let mut owner = RdmaQp::new(&dev, &pd, 0x3000, true).unwrap_or_else(|e| panic!("{e}"));
        let mut reader = RdmaQp::new(&dev, &pd, 0x4000, false).unwrap_or_else(|e| panic!("{e}"));
        let (a, b) = (owner.endpoint(), reader.endpoint());
        owner.connect(&b).unwrap_or_else(|e| panic!("{e}"));
        reader.connect(&a).unwrap_or_else(|e| panic!("{e}"));
        Reads {
            dev,
            pool,
            dst,
            src,
            owner: Rc::new(owner),
            reader,
        }
    }

    /// Mutable views of pages `which` (distinct) of `reg`, in that order.
    ///
    /// # Safety
    ///
    /// The caller makes no other view of those pages while the returned slices live.
    #[expect(
        clippy::mut_from_ref,
        reason = "registered memory is shared with the device, not owned by the registration"
    )]
    unsafe fn pages_mut<'a>(reg: &'a RegisteredPool, which: &[u32]) -> Vec<&'a mut [u8]> {
        let mut seen = which.to_vec();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), which.len(), "distinct pages");
        let page = usize::try_from(reg.page_bytes()).unwrap();
        let base = reg.memory().host_ptr().unwrap();
        which
            .iter()
            .map(|&p| {
                assert!(p < reg.pages());
                let off = usize::try_from(p).unwrap() * page;
                // SAFETY: page `p` lies inside the mapping, which lives as long as `reg`;
                // the pages are distinct (checked), and the caller makes no other view of
                // them while these live.
                unsafe { std::slice::from_raw_parts_mut(base.as_ptr().add(off), page) }
            })
            .collect()
    }

    /// Reads of window pages `from` (page indices inside the window) into pages `into` of
    /// the destination.
    fn page_reads<'a>(
        dst: &'a RegisteredPool,
        rkey: u32,
        raddr: u64,
        from: &[u32],
        into: &[u32],
    ) -> Vec<PageRead<'a>> {
        assert_eq!(from.len(), into.len());
        // SAFETY: the tests look at the destination (snapshot) only once the read that
        // consumes these views has returned.
        unsafe { pages_mut(dst, into) }
            .into_iter()
            .zip(from)
            .map(|(dst, &k)| PageRead {
                dst,
                rkey,
                raddr: raddr + u64::from(k) * PAGE,
            })
            .collect()
    }

    fn page(bytes: &[u8], p: u32) -> &[u8] {
        let page = usize::try_from(PAGE).unwrap();
        let at = usize::try_from(p).unwrap() * page;
        &bytes[at..at + page]
    }

    /// `before` with pool pages `from` copied over destination pages `into`.
    fn expected(before: &[u8], pool: &[u8], from: &[u32], into: &[u32]) -> Vec<u8> {
        let page_len = usize::try_from(PAGE).unwrap();
        let mut want = before.to_vec();
        for (&f, &t) in from.iter().zip(into) {
            let at = usize::try_from(t).unwrap() * page_len;
            want[at..at + page_len].copy_from_slice(page(pool, f));
        }
        want
    }

    fn read(
        qp: RdmaQp,
        dst: &RegisteredPool,
        pages: Vec<PageRead<'_>>,
    ) -> Result<(RdmaQp, ReadStats), RdmaError> {
        qp.read_pages(dst.mr(), pages, &mut || true)
    }

    #[test]
    fn read_through_a_read_window_gets_exactly_its_pages() {
        let Some(cfg) = device_under_test() else {
            return;
        };
        let fx = reads(&cfg);
        let (first, count) = (PageId(3), 5u32);
        let window = fx
            .pool
            .bind_window(&fx.owner, first, count, WindowAccess::Read)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(window.addr(), fx.pool.page_addr(first).unwrap());
        assert_eq!(window.len(), u64::from(count) * PAGE);
        assert_ne!(window.rkey(), fx.pool.mr().rkey());
        let pool = snapshot(fx.pool.memory());

        // the whole window into destination pages 2..7: contiguous on both sides
        let from: Vec<u32> = (0..count).collect();
        let into: Vec<u32> = (2..2 + count).collect();
        let pool_pages: Vec<u32> = from.iter().map(|k| first.0 + k).collect();
        let want = expected(&snapshot(fx.dst.memory()), &pool, &pool_pages, &into);
        let pages = page_reads(&fx.dst, window.rkey(), window.addr(), &from, &into);
        let (qp, stats) = read(fx.reader, &fx.dst, pages).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(stats.bytes, u64::from(count) * PAGE);
        assert_eq!(stats.reads, 1, "a contiguous run is one RDMA READ");
        assert!(
            snapshot(fx.dst.memory()) == want,
            "the destination holds exactly the window's pages, nothing else changed"
        );

        // the same pages scattered backwards over the destination: one read per page
        let into = [15, 13, 11, 9, 0];
        let want = expected(&snapshot(fx.dst.memory()), &pool, &pool_pages, &into);
        let pages = page_reads(&fx.dst, window.rkey(), window.addr(), &from, &into);
        let (_qp, scattered) = read(qp, &fx.dst, pages).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(scattered.reads, count, "scattered pages are not coalesced");
        assert_eq!(scattered.bytes, u64::from(count) * PAGE);
        assert!(
            snapshot(fx.dst.memory()) == want,
            "scattered pages landed where asked"
        );
        assert_eq!(
            snapshot(fx.pool.memory()),
            pool,
            "a read changes no pool page"
        );
        window.invalidate().unwrap_or_else(|e| panic!("{e}"));
        println!(
            "read of {count} pages through a read window: {} READ contiguous, {} scattered",
            stats.reads, scattered.reads
        );
    }

    #[test]
    fn read_after_invalidate_fails_and_leaves_the_destination() {
        let Some(cfg) = device_under_test() else {
            return;
        };
        let fx = reads(&cfg);
        let window = fx
            .pool
            .bind_window(&fx.owner, PageId(6), 2, WindowAccess::Read)
            .unwrap_or_else(|e| panic!("{e}"));
        let (rkey, addr) = (window.rkey(), window.addr());
        // the key works while the window is bound
        let pages = page_reads(&fx.dst, rkey, addr, &[0, 1], &[0, 1]);
        let (qp, _) = read(fx.reader, &fx.dst, pages).unwrap_or_else(|e| panic!("{e}"));
        let pool = snapshot(fx.pool.memory());
        assert!(
            page(&snapshot(fx.dst.memory()), 1) == page(&pool, 7),
            "read while bound"
        );
        window.invalidate().unwrap_or_else(|e| panic!("{e}"));

        let before = snapshot(fx.dst.memory());
        let pages = page_reads(&fx.dst, rkey, addr, &[0, 1], &[8, 9]);
        match read(qp, &fx.dst, pages) {
            Err(RdmaError::Completion { status, .. }) => {
                println!("read through an invalidated rkey: status {status}");
                assert_eq!(status, REM_ACCESS_ERR, "a remote access error");
            }
            Err(e) => panic!("expected a remote access error, got {e}"),
            Ok((_, stats)) => panic!("read through an invalidated rkey succeeded: {stats:?}"),
        }
        assert!(
            snapshot(fx.dst.memory()) == before,
            "the destination is left as it was"
        );
    }

    #[test]
    fn a_window_rkey_from_another_qp_is_refused() {
        let Some(cfg) = device_under_test() else {
            return;
        };
        let fx = reads(&cfg);
        let read_window = fx
            .pool
            .bind_window(&fx.owner, PageId(1), 4, WindowAccess::Read)
            .unwrap_or_else(|e| panic!("{e}"));
        let write_window = fx
            .pool
            .bind_window(&fx.owner, PageId(9), 4, WindowAccess::Write)
            .unwrap_or_else(|e| panic!("{e}"));
        let pool = snapshot(fx.pool.memory());
        // the read key works from the QP it was bound for
        let pages = page_reads(&fx.dst, read_window.rkey(), read_window.addr(), &[2], &[4]);
        let (_qp, _) = read(fx.reader, &fx.dst, pages).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            page(&snapshot(fx.dst.memory()), 4) == page(&pool, 3),
            "read from the QP the window was bound on"
        );

        // a second connected pair on the same device and PD: the keys are foreign to it
        let (_owner2, reader2) = pair(&fx.dev, &fx.owner, 0x5000, false);
        let before = snapshot(fx.dst.memory());
        let pages = page_reads(
            &fx.dst,
            read_window.rkey(),
            read_window.addr(),
            &[0, 1],
            &[10, 11],
        );
        match read(reader2, &fx.dst, pages) {
            Err(RdmaError::Completion { status, .. }) => {
                println!("read with a window rkey bound on another QP: status {status}");
                assert_eq!(status, REM_ACCESS_ERR);
            }
            Err(e) => panic!("expected a remote access error, got {e}"),
            Ok((_, stats)) => panic!("a foreign QP read through the window: {stats:?}"),
        }
        assert!(snapshot(fx.dst.memory()) == before, "nothing landed");

        // a fresh pair for the write probe: the refused read left the second pair in error
        let (_owner3, peer3) = pair(&fx.dev, &fx.owner, 0x6000, false);
        let c = peer3
            .write(
                fx.src.mr(),
                page(source_pages(&fx.src), 0),
                write_window.rkey(),
                write_window.addr(),
            )
            .unwrap_or_else(|e| panic!("{e}"));
        println!(
            "write with a window rkey bound on another QP: status {}",
            c.status
        );
        assert_eq!(c.status, REM_ACCESS_ERR, "the foreign write is refused");
        assert!(snapshot(fx.pool.memory()) == pool, "the pool is unchanged");
        read_window.invalidate().unwrap_or_else(|e| panic!("{e}"));
        write_window.invalidate().unwrap_or_else(|e| panic!("{e}"));
    }

    /// All of `reg`'s bytes, for a write source.
    fn source_pages(reg: &RegisteredPool) -> &[u8] {
        let ptr = reg.memory().host_ptr().unwrap();
        let len = usize::try_from(reg.memory().len()).unwrap();
        // SAFETY: the mapping is `len` bytes and lives as long as `reg`; nothing writes it
        // while the view lives (it is only ever the source of writes).
        unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) }
    }

    #[test]
    fn a_read_window_refuses_writes() {
        let Some(cfg) = device_under_test() else {
            return;
        };
        let fx = reads(&cfg);
        let window = fx
            .pool
            .bind_window(&fx.owner, PageId(2), 3, WindowAccess::Read)
            .unwrap_or_else(|e| panic!("{e}"));
        let pool = snapshot(fx.pool.memory());
        let len = usize::try_from(window.len()).unwrap();
        let c = fx
            .reader
            .write(
                fx.src.mr(),
                &source_pages(&fx.src)[..len],
                window.rkey(),
                window.addr(),
            )
            .unwrap_or_else(|e| panic!("{e}"));
        println!("write through a read window: status {}", c.status);
        assert_eq!(c.status, REM_ACCESS_ERR, "the write is refused");
        assert!(snapshot(fx.pool.memory()) == pool, "the pool is unchanged");
        // the refusal left both QPs in error: the invalidation cannot run any more, and
        // dropping the window deallocates it (which unbinds it) before its QP goes
        drop(window);
    }

    #[test]
    fn read_pages_refuses_a_destination_outside_its_region_before_posting() {
        let Some(cfg) = device_under_test() else {
            return;
        };
        let fx = reads(&cfg);
        let window = fx
            .pool
            .bind_window(&fx.owner, PageId(0), 4, WindowAccess::Read)
            .unwrap_or_else(|e| panic!("{e}"));
        let (rkey, addr) = (window.rkey(), window.addr());
        let before = snapshot(fx.dst.memory());

        // a valid page first, then one in memory no registration covers
        let mut outside = vec![0x55u8; usize::try_from(PAGE).unwrap()];
        let mut pages = page_reads(&fx.dst, rkey, addr, &[0], &[3]);
        pages.push(PageRead {
            dst: &mut outside,
            rkey,
            raddr: addr + PAGE,
        });
        match read(fx.reader, &fx.dst, pages) {
            Err(RdmaError::OutOfRange { what }) => println!("unregistered destination: {what}"),
            Err(e) => panic!("expected OutOfRange, got {e}"),
            Ok((_, stats)) => panic!("read into unregistered memory: {stats:?}"),
        }
        assert!(outside.iter().all(|&b| b == 0x55));

        // a page registered, but under another memory region than the one given
        let (_owner2, reader2) = pair(&fx.dev, &fx.owner, 0x7000, false);
        let mut pages = page_reads(&fx.dst, rkey, addr, &[0], &[3]);
        pages.extend(page_reads(&fx.src, rkey, addr + PAGE, &[0], &[5]));
        let src_before = snapshot(fx.src.memory());
        match read(reader2, &fx.dst, pages) {
            Err(RdmaError::OutOfRange { what }) => println!("destination of another MR: {what}"),
            Err(e) => panic!("expected OutOfRange, got {e}"),
            Ok((_, stats)) => panic!("read outside the given region: {stats:?}"),
        }
        assert!(snapshot(fx.src.memory()) == src_before);

        // an empty destination
        let (_owner3, reader3) = pair(&fx.dev, &fx.owner, 0x7800, false);
        let pages = vec![PageRead {
            dst: &mut [],
            rkey,
            raddr: addr,
        }];
        assert!(matches!(
            read(reader3, &fx.dst, pages),
            Err(RdmaError::OutOfRange { .. })
        ));
        // the valid page before the bad one was never read: nothing was posted
        assert!(
            snapshot(fx.dst.memory()) == before,
            "the destination is untouched"
        );
        window.invalidate().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Window bounds inside a memory region are the device's to enforce: real NICs refuse an
    /// access through a window key outside the window, rxe does not (it checks the MR's
    /// bounds only). kvfence checks page bounds itself before it binds or reads, so this is
    /// recorded as a fact on rxe and enforced on other devices.
    #[test]
    fn a_window_key_outside_its_window_but_inside_the_region() {
        let Some(cfg) = device_under_test() else {
            return;
        };
        let fx = reads(&cfg);
        let window = fx
            .pool
            .bind_window(&fx.owner, PageId(4), 2, WindowAccess::Read)
            .unwrap_or_else(|e| panic!("{e}"));
        let pool = snapshot(fx.pool.memory());
        // the key reads the window's own pages
        let pages = page_reads(&fx.dst, window.rkey(), window.addr(), &[1], &[1]);
        let (qp, _) = read(fx.reader, &fx.dst, pages).unwrap_or_else(|e| panic!("{e}"));
        assert!(page(&snapshot(fx.dst.memory()), 1) == page(&pool, 5));
        let before = snapshot(fx.dst.memory());
        // page 8: two pages past the window's end, well inside the pool's MR
        let pages = page_reads(&fx.dst, window.rkey(), window.addr(), &[4], &[0]);
        let rxe = fx.dev.name().starts_with("rxe");
        match read(qp, &fx.dst, pages) {
            Ok(_) => {
                let leaked = page(&snapshot(fx.dst.memory()), 0) == page(&pool, 8);
                assert!(
                    rxe,
                    "{}: a read outside the window succeeded",
                    fx.dev.name()
                );
                println!(
                    "FACT: {} does not enforce window bounds inside its MR: a READ through a \
                     window key two pages past the window succeeded{}; real NICs refuse it, \
                     and kvfence checks page bounds itself",
                    fx.dev.name(),
                    if leaked {
                        " and returned the page's bytes"
                    } else {
                        ""
                    }
                );
            }
            Err(RdmaError::Completion { status, .. }) => {
                assert_eq!(status, REM_ACCESS_ERR);
                assert!(snapshot(fx.dst.memory()) == before);
                println!(
                    "FACT: {} enforces window bounds: status {status}",
                    fx.dev.name()
                );
            }
            Err(e) => panic!("{e}"),
        }
        window.invalidate().unwrap_or_else(|e| panic!("{e}"));
    }
}
