//! The worker registry of kvctld's core: every registered prefill and decode worker, its
//! page ledger, and the pairing policy that picks a worker of each role for a request.
//!
//! No I/O happens here. A worker is known by a [`WorkerKey`]: its role, its slot, and the
//! incarnation of that slot, so that a key kept by a request never names the worker that
//! registers later in the same slot. The ledger of a worker counts the pages kvctld may
//! still lend against its pool: a request takes pages at admission and they come back only
//! when the worker reports them `Freed` (no writer left), or when the worker is lost (its
//! pages went with its process). A decode worker also has batch slots (`max_batch`, as it
//! registered): a request takes one at admission and gives it back when it ends, and a
//! worker whose slots are all taken is not picked, however many pages it has free.

use libkv::admission::Side;
use libkv::config::Pairing;
use libkv::proto::{PoolReport, TcpEndpoint, Transport};
use slab::Slab;
use std::collections::{BTreeMap, HashMap};

/// The connection a worker registered on, as the event loop numbers connections.
pub type ConnId = usize;

/// One registration of one worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WorkerKey {
    pub side: Side,
    slot: usize,
    incarnation: u64,
}

/// A registered worker.
#[derive(Debug)]
pub struct Worker {
    /// Its id (`RegisterWorker.id`), unique among registered workers.
    pub id: String,
    pub side: Side,
    /// The connection it registered on.
    pub conn: ConnId,
    pub pool_pages: u32,
    /// Ledger: pages that may still be lent against its pool.
    pub free: u32,
    /// Requests paired with it and not ended.
    pub in_flight: u32,
    /// No new requests go to it.
    pub drain: bool,
    /// An operator drained it (`kvctl drain`): the part of `drain` that outlives this
    /// registration. A worker that drains itself because it is stopping comes back undrained.
    pub operator_drain: bool,
    /// The worker asked to drain itself and waits for `DrainReply` once idle.
    pub drain_waiter: bool,
    /// Its last `PoolReport`.
    pub report: Option<PoolReport>,
    /// A prefill worker's page server (TCP or RDMA); `None`: its pool is shared memory.
    pub endpoint: Option<TcpEndpoint>,
    pub transports: Vec<Transport>,
    /// Requests it took part in that completed.
    pub served: u64,
    /// When it was last picked (a count of picks), for ties.
    pub(super) last_pick: u64,
    /// A decode worker can map a prefill pool (it listed `Shm`) / use a page server (`Tcp`);
    /// kept apart from `transports` so the pairing scan reads no heap.
    pub(super) pulls_shm: bool,
    pub(super) pulls_tcp: bool,
    /// The model it runs, as registered.
    pub model: String,
    /// A decode worker's batch slots (`RegisterWorker::max_batch`): the most requests in
    /// flight on it at once. 0 on a prefill worker.
    pub max_batch: u32,
}

impl Worker {
    /// Nothing runs on it and no page is lent against its pool.
    pub fn idle(&self) -> bool {
        self.in_flight == 0 && self.free == self.pool_pages
    }

    /// Pages lent against its pool and not yet reported free.
    pub fn held_pages(&self) -> u32 {
        self.pool_pages - self.free
    }

    /// Whether it can take one more request: a prefill worker always (its pages are its only
    /// bound), a decode worker while a batch slot is free.
    pub fn has_slot(&self) -> bool {
        self.side == Side::Prefill || self.in_flight < self.max_batch
    }

    /// Whether a decode worker can pull from this prefill worker's pool.
    pub fn serves(&self, decode: &Worker) -> bool {
        match self.endpoint {
            None => decode.pulls_shm,
            Some(_) => decode.pulls_tcp,
        }
    }

    /// Whether a decode worker pulls from this prefill worker with RDMA (both opened a
    /// device and the prefill worker serves a page server).
    pub fn rdma_with(&self, decode: &Worker) -> bool {
        self.endpoint.is_some()
            && self.transports.contains(&Transport::Rdma)
            && decode.transports.contains(&Transport::Rdma)
    }
}

/// A worker that was lost, remembered for status and for an operator's drain until it comes
/// back under the same id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lost {
    pub side: Side,
    /// An operator had drained it (not: it drained itself to stop).
    pub drain: bool,
    /// Requests in flight on it that failed because it was lost.
    pub failed: u64,
}

/// Every registered worker, by role.
#[derive(Debug)]
pub struct Workers {
    prefill: Slab<(u64, Worker)>,
    decode: Slab<(u64, Worker)>,
    by_conn: HashMap<ConnId, WorkerKey>,
    by_id: HashMap<String, WorkerKey>,
    lost: BTreeMap<String, Lost>,
    next_incarnation: u64,
    picks: u64,
    pairing: Pairing,
    rng: u64,
}

impl Workers {
    /// An empty registry picking by `pairing`; `seed` drives the random draws of
    /// [`Pairing::PowerOfTwo`].
    pub fn new(pairing: Pairing, seed: u64) -> Workers {
        Workers {
            prefill: Slab::new(),
            decode: Slab::new(),
            by_conn: HashMap::new(),
            by_id: HashMap::new(),
            lost: BTreeMap::new(),
            next_incarnation: 1,
            picks: 0,
            pairing,
            rng: seed | 1,
        }
    }

    fn slab(&self, side: Side) -> &Slab<(u64, Worker)> {
        match side {
            Side::Prefill => &self.prefill,
            Side::Decode => &self.decode,
        }
    }

    fn slab_mut(&mut self, side: Side) -> &mut Slab<(u64, Worker)> {
        match side {
            Side::Prefill => &mut self.prefill,
            Side::Decode => &mut self.decode,
        }
    }

    /// The worker of `key`, if that registration is still live.
    pub fn get(&self, key: WorkerKey) -> Option<&Worker> {
        match self.slab(key.side).get(key.slot) {
            Some((inc, w)) if *inc == key.incarnation => Some(w),
            _ => None,
        }
    }

    pub fn get_mut(&mut self, key: WorkerKey) -> Option<&mut Worker> {
        match self.slab_mut(key.side).get_mut(key.slot) {
            Some((inc, w)) if *inc == key.incarnation => Some(w),
            _ => None,
        }
    }

    /// The worker registered on `conn`.
    pub fn by_conn(&self, conn: ConnId) -> Option<WorkerKey> {
        self.by_conn.get(&conn).copied()
    }

    /// The live worker registered under `id`.
    pub fn by_id(&self, id: &str) -> Option<WorkerKey> {
        self.by_id.get(id).copied()
    }

    /// A lost worker's record.
    pub fn lost(&self, id: &str) -> Option<Lost> {
        self.lost.get(id).copied()
    }

    /// Every lost worker not registered again.
    pub fn lost_all(&self) -> impl Iterator<Item = (&String, &Lost)> {
        self.lost.iter()
    }

    /// Registers `worker` (its ledger full, drained if an operator had drained it when it was
    /// lost) and returns its key. The caller checked that no live worker has its id.
    pub fn insert(&mut self, mut worker: Worker) -> WorkerKey {
        if let Some(lost) = self.lost.remove(&worker.id) {
            worker.drain = lost.drain;
            worker.operator_drain = lost.drain;
        }
        worker.pulls_shm = worker.transports.contains(&Transport::Shm);
        worker.pulls_tcp = worker.transports.contains(&Transport::Tcp);
        let incarnation = self.next_incarnation;
        self.next_incarnation += 1;
        let side = worker.side;
        let (conn, id) = (worker.conn, worker.id.clone());
        let slot = self.slab_mut(side).insert((incarnation, worker));
        let key = WorkerKey {
            side,
            slot,
            incarnation,
        };
        self.by_conn.insert(conn, key);
        self.by_id.insert(id, key);
        key
    }

    /// Removes a lost worker and remembers it as lost.
    pub fn remove(&mut self, key: WorkerKey) -> Option<Worker> {
        self.get(key)?;
        let (_, w) = self.slab_mut(key.side).remove(key.slot);
        self.by_conn.remove(&w.conn);
        self.by_id.remove(&w.id);
        self.lost.insert(
            w.id.clone(),
            Lost {
                side: w.side,
                drain: w.operator_drain,
                failed: 0,
            },
        );
        Some(w)
    }

    /// Records that `failed` requests failed because the worker `id` was lost.
    pub fn lost_failed(&mut self, id: &str, failed: u64) {
        if let Some(lost) = self.lost.get_mut(id) {
            lost.failed += failed;
        }
    }

    /// Every live worker of `side`, with its key.
    pub fn iter(&self, side: Side) -> impl Iterator<Item = (WorkerKey, &Worker)> {
        self.slab(side).iter().map(move |(slot, (inc, w))| {
            (
                WorkerKey {
                    side,
                    slot,
                    incarnation: *inc,
                },
                w,
            )
        })
    }

    /// Every live worker, prefill first.
    pub fn iter_all(&self) -> impl Iterator<Item = (WorkerKey, &Worker)> {
        self.iter(Side::Prefill).chain(self.iter(Side::Decode))
    }

    /// Live workers of `side`.
    pub fn count(&self, side: Side) -> usize {
        self.slab(side).len()
    }

    /// Whether a live, undrained pair exists: a request that fits the limits will find room
    /// once requests in flight end (every registered pool holds the largest request).
    pub fn can_serve_later(&self) -> bool {
        self.iter(Side::Prefill).any(|(_, p)| {
            !p.drain
                && self
                    .iter(Side::Decode)
                    .any(|(_, d)| !d.drain && p.serves(d))
        })
    }

    /// Whether a request of `prefill_pages` and `decode_pages` waits only for a decode
    /// slot: some undrained pair has the pages for it now, but every such decode worker has
    /// all its slots taken.
    pub fn waits_for_slot(&self, prefill_pages: u32, decode_pages: u32) -> bool {
        let mut fits = false;
        for (_, p) in self.iter(Side::Prefill) {
            if p.drain || p.free < prefill_pages {
                continue;
            }
            for (_, d) in self.iter(Side::Decode) {
                if d.drain || d.free < decode_pages || !p.serves(d) {
                    continue;
                }
                if d.has_slot() {
                    return false;
                }
                fits = true;
            }
        }
        fits
    }

    /// Decode batch slots of the live decode workers, and how many of them are taken.
    pub fn decode_slots(&self) -> (u64, u64) {
        self.iter(Side::Decode).fold((0, 0), |(all, used), (_, d)| {
            (all + u64::from(d.max_batch), used + u64::from(d.in_flight))
        })
    }

    /// Picks a prefill and a decode worker that can hold `prefill_pages` and `decode_pages`
    /// now (the decode worker with a free batch slot), by the pairing policy, and takes the
    /// pages from both ledgers and a slot of the decode worker; or takes nothing.
    pub fn pair(
        &mut self,
        prefill_pages: u32,
        decode_pages: u32,
    ) -> Option<(WorkerKey, WorkerKey)> {
        let p = self.pick(Side::Prefill, prefill_pages, None)?;
        let d = self.pick(Side::Decode, decode_pages, Some(p))?;
        self.picks += 1;
        let picks = self.picks;
        for (key, pages) in [(p, prefill_pages), (d, decode_pages)] {
            if let Some(w) = self.get_mut(key) {
                w.free -= pages;
                w.in_flight += 1;
                w.last_pick = picks;
            }
        }
        Some((p, d))
    }

    fn eligible(&self, w: &Worker, pages: u32, source: Option<&Worker>) -> bool {
        !w.drain && w.free >= pages && w.has_slot() && source.is_none_or(|p| p.serves(w))
    }

    /// The pairing policy's order: the eligible worker with the highest score is picked.
    fn score(&self, w: &Worker) -> u128 {
        let (free, idle, older) = (
            u128::from(w.free),
            u128::from(u32::MAX - w.in_flight),
            u128::from(u64::MAX - w.last_pick),
        );
        match self.pairing {
            Pairing::MostFree | Pairing::PowerOfTwo => (free << 96) | (idle << 64) | older,
            Pairing::FewestInFlight => (idle << 96) | (free << 64) | older,
        }
    }

    fn pick(&mut self, side: Side, pages: u32, source: Option<WorkerKey>) -> Option<WorkerKey> {
        let source = source.and_then(|k| self.get(k));
        let mut best: Option<(u128, usize)> = None;
        let slab = self.slab(side);
        if self.pairing == Pairing::PowerOfTwo {
            let n = slab
                .iter()
                .filter(|(_, (_, w))| self.eligible(w, pages, source))
                .count();
            if n == 0 {
                return None;
            }
            let (i, j) = (self.draw(n, 1), self.draw(n, 2));
            for (k, (slot, (_, w))) in slab
                .iter()
                .filter(|(_, (_, w))| self.eligible(w, pages, source))
                .enumerate()
            {
                let score = self.score(w);
                if (k == i || k == j) && best.is_none_or(|(b, _)| score > b) {
                    best = Some((score, slot));
                }
            }
        } else {
            for (slot, (_, w)) in slab.iter() {
                if !self.eligible(w, pages, source) {
                    continue;
                }
                let score = self.score(w);
                if best.is_none_or(|(b, _)| score > b) {
                    best = Some((score, slot));
                }
            }
        }
        let (_, slot) = best?;
        let incarnation = slab.get(slot)?.0;
        Some(WorkerKey {
            side,
            slot,
            incarnation,
        })
    }

    /// A number below `n`, the `salt`-th draw of this pick (a xorshift64* mix of the seed,
    /// the pick count and the salt: the core reads no clock and no entropy).
    fn draw(&self, n: usize, salt: u64) -> usize {
        let mut x = self.rng
            ^ self.picks.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ salt.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let r = x.wrapping_mul(0x2545_F491_4F6C_DD1D);
        // n is a count of workers (far below 2^32): the remainder fits a usize.
        usize::try_from(r % n as u64).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(id: &str, side: Side, conn: ConnId) -> Worker {
        Worker {
            id: id.to_owned(),
            side,
            conn,
            pool_pages: 8,
            free: 8,
            in_flight: 0,
            drain: false,
            operator_drain: false,
            drain_waiter: false,
            report: None,
            endpoint: None,
            transports: vec![Transport::Shm],
            served: 0,
            last_pick: 0,
            pulls_shm: false,
            pulls_tcp: false,
            model: "reference".into(),
            max_batch: if side == Side::Decode { 4 } else { 0 },
        }
    }

    /// A worker that drained itself to stop comes back undrained under its id; one an
    /// operator drained comes back drained.
    #[test]
    fn only_an_operators_drain_outlives_a_registration() {
        let mut workers = Workers::new(Pairing::MostFree, 1);
        workers.insert(worker("p0", Side::Prefill, 10));
        let key = workers.insert(worker("d0", Side::Decode, 1));
        let w = workers.get_mut(key).unwrap();
        w.drain = true;
        w.drain_waiter = true;
        workers.remove(key).unwrap();
        assert_eq!(workers.lost("d0").map(|l| l.drain), Some(false));
        let key = workers.insert(worker("d0", Side::Decode, 2));
        assert!(
            !workers.get(key).unwrap().drain,
            "a stopped worker came back drained"
        );
        let (_, d) = workers.pair(1, 1).expect("the worker is paired again");
        assert_eq!(d, key);

        let w = workers.get_mut(key).unwrap();
        w.drain = true;
        w.operator_drain = true;
        workers.remove(key).unwrap();
        assert_eq!(workers.lost("d0").map(|l| l.drain), Some(true));
        let key = workers.insert(worker("d0", Side::Decode, 3));
        let w = workers.get(key).unwrap();
        assert!(w.drain && w.operator_drain, "the operator's drain was lost");
        assert_eq!(workers.pair(1, 1), None, "a drained worker was paired");
    }

    /// Slots bound a decode worker as pages do: a full one is passed over for one with a
    /// free slot, and with none free nothing is paired, and the wait is said to be for a
    /// slot only while the pages would fit.
    #[test]
    fn a_decode_worker_with_every_slot_taken_is_not_picked() {
        let mut workers = Workers::new(Pairing::MostFree, 1);
        workers.insert(worker("p0", Side::Prefill, 10));
        let mut big = worker("d0", Side::Decode, 1);
        big.pool_pages = 100;
        big.free = 100;
        big.max_batch = 2;
        let d0 = workers.insert(big);
        let d1 = workers.insert(worker("d1", Side::Decode, 2));
        // d0 has the most pages free: picked until its two slots are taken.
        for _ in 0..2 {
            assert_eq!(workers.pair(1, 1).map(|(_, d)| d), Some(d0));
        }
        assert_eq!(workers.decode_slots(), (6, 2));
        assert!(!workers.waits_for_slot(1, 1));
        for _ in 0..4 {
            assert_eq!(workers.pair(1, 1).map(|(_, d)| d), Some(d1));
        }
        assert_eq!(workers.decode_slots(), (6, 6));
        assert!(
            workers.waits_for_slot(1, 1),
            "pages fit, every slot is taken"
        );
        assert!(
            !workers.waits_for_slot(1, 200),
            "no decode worker has the pages: not a wait for a slot"
        );
        assert_eq!(workers.pair(1, 1), None, "a full decode worker was paired");
        workers.get_mut(d1).unwrap().in_flight -= 1;
        assert_eq!(workers.pair(1, 1).map(|(_, d)| d), Some(d1));
    }
}
