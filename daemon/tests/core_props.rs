//! Random event sequences over many workers, run on kvctld's sans-IO core.
//!
//! A small simulation stands in for the workers and clients: each simulated worker keeps
//! its own page count (the pages it really reserved) and answers the core's frames the way
//! prefilld and decoded do, in order per connection but at random moments; workers are lost
//! and come back under their id, drained and undrained, clients vanish, time jumps. After
//! every step, and once everything has settled, the invariants must hold:
//!
//! - no worker ever reserves more pages than its pool holds (admission never over-commits),
//!   and no decode worker has more requests in flight than its batch slots;
//! - a rejected request never reaches a worker;
//! - every worker's ledger equals its pool minus what live requests and unreported frees
//!   hold, and once all is settled every pool is whole again (no page is lost);
//! - no request outlives its deadline, and every request ends exactly once for its client.

use kvctld::ctl::core::{Action, Core, CoreConfig};
use libkv::admission::{Limits, Side};
use libkv::config::{DeadlineDurations, Pairing};
use libkv::proto::{
    DecodeReserved, Done, Drain, ErrorCode, Freed, Message, PrefillDone, PullDone, RegisterWorker,
    Role, Submit, TcpEndpoint, Tokens, Transport,
};
use libkv::verify::Manifest;
use libkv::{Dtype, Generation, Owner, PageGeometry, PageId, RequestId};
use proptest::prelude::*;
use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

const TPP: u32 = 16;
const MAX_CONTEXT: u32 = 64;
const MAX_NEW: u32 = 32;

fn geometry() -> PageGeometry {
    PageGeometry {
        tokens_per_page: TPP,
        layers: 1,
        kv_heads: 1,
        head_dim: 8,
        dtype: Dtype::F16,
    }
}

fn pages(tokens: u32) -> u32 {
    tokens.div_ceil(TPP)
}

fn config(pairing: Pairing, queue: usize) -> CoreConfig {
    CoreConfig {
        geometry: geometry(),
        limits: Limits {
            geometry: geometry(),
            max_context: MAX_CONTEXT,
            max_new_tokens: MAX_NEW,
            prefill_pages: pages(MAX_CONTEXT),
            decode_pages: pages(MAX_CONTEXT + MAX_NEW),
        },
        deadlines: DeadlineDurations {
            admission_wait: Duration::from_millis(200),
            bootstrap: Duration::from_millis(150),
            prefill: Duration::from_millis(150),
            transfer: Duration::from_millis(150),
            decode: Duration::from_millis(300),
            request: Duration::from_millis(800),
            drain: Duration::from_millis(100),
        },
        admission_queue: queue,
        pairing,
        seed: 7,
        placeholder_fault: false,
        model_kind: libkv::config::ModelKind::Reference,
    }
}

#[derive(Debug)]
struct SimWorker {
    id: String,
    side: Side,
    pool: u32,
    /// A decode worker's batch slots (1 to 4, so that they often bind); 0 on prefill.
    slots: u32,
    tcp: bool,
    conn: Option<usize>,
    used: u32,
    held: HashMap<Owner, u32>,
    inbox: VecDeque<(RequestId, Message)>,
    /// Decode jobs pulled and verified, not yet finished: (request, owner, new tokens).
    jobs: Vec<(RequestId, Owner, u32)>,
}

#[derive(Debug, Default)]
struct ClientLog {
    /// Terminal replies per request id (Done or Error).
    ended: HashMap<RequestId, u32>,
    /// Ids answered `Rejected`.
    rejected: HashSet<RequestId>,
    submitted: u64,
    /// The client of each request (the core numbers every Submit from 1).
    client_of: HashMap<RequestId, usize>,
}

struct Sim {
    core: Core,
    base: Instant,
    ms: u64,
    workers: Vec<SimWorker>,
    next_conn: usize,
    clients: Vec<Option<usize>>,
    log: ClientLog,
    /// Ids that some worker was sent a frame about.
    seen_by_workers: HashSet<RequestId>,
    /// Requests whose client went away.
    closed_ids: HashSet<RequestId>,
    /// WorkerLost errors sent to clients (or that would have been, for a closed client).
    lost_replies: u64,
}

impl Sim {
    fn new(n_prefill: usize, n_decode: usize, sizes: &[u32], tcp: bool, cfg: CoreConfig) -> Sim {
        let generation = Generation(99);
        let mut sim = Sim {
            core: Core::new(cfg, generation),
            base: Instant::now(),
            ms: 0,
            workers: Vec::new(),
            next_conn: 1,
            clients: vec![None; 3],
            log: ClientLog::default(),
            seen_by_workers: HashSet::new(),
            closed_ids: HashSet::new(),
            lost_replies: 0,
        };
        for i in 0..n_prefill + n_decode {
            let side = if i < n_prefill {
                Side::Prefill
            } else {
                Side::Decode
            };
            let min = match side {
                Side::Prefill => pages(MAX_CONTEXT),
                Side::Decode => pages(MAX_CONTEXT + MAX_NEW),
            };
            let extra = sizes.get(i).copied().unwrap_or(0);
            sim.workers.push(SimWorker {
                id: format!("{}-{i}", if side == Side::Prefill { "p" } else { "d" }),
                side,
                pool: min + extra,
                slots: if side == Side::Decode {
                    1 + extra % 4
                } else {
                    0
                },
                tcp,
                conn: None,
                used: 0,
                held: HashMap::new(),
                inbox: VecDeque::new(),
                jobs: Vec::new(),
            });
        }
        for c in 0..sim.clients.len() {
            sim.clients[c] = Some(sim.conn_id());
        }
        for w in 0..sim.workers.len() {
            sim.join(w);
        }
        sim
    }

    fn now(&self) -> Instant {
        self.base + Duration::from_millis(self.ms)
    }

    fn conn_id(&mut self) -> usize {
        self.next_conn += 1;
        self.next_conn
    }

    fn join(&mut self, w: usize) {
        if self.workers[w].conn.is_some() {
            return;
        }
        let conn = self.conn_id();
        let sw = &mut self.workers[w];
        sw.conn = Some(conn);
        sw.used = 0;
        sw.held.clear();
        sw.inbox.clear();
        sw.jobs.clear();
        let endpoint = (sw.tcp && sw.side == Side::Prefill).then(|| TcpEndpoint {
            addr: "192.0.2.1:7000".into(),
            token: [1; 16],
        });
        let r = RegisterWorker {
            id: sw.id.clone(),
            role: if sw.side == Side::Prefill {
                Role::Prefill
            } else {
                Role::Decode
            },
            geometry: geometry(),
            pool_pages: sw.pool,
            transports: vec![Transport::Shm, Transport::Tcp],
            endpoint,
            model: "reference".into(),
            max_batch: sw.slots,
        };
        let now = self.now();
        assert!(self.core.register(conn, r, true, now).is_ok());
        self.route();
    }

    fn lose(&mut self, w: usize) {
        let id = self.workers[w].id.clone();
        let paired = self.core.requests_paired_with(&id);
        let Some(conn) = self.workers[w].conn.take() else {
            return;
        };
        let lost_before = self.lost_replies;
        let now = self.now();
        self.core.conn_closed(conn, now);
        self.route();
        // Every request on the lost worker ends at once, with WorkerLost; no other does.
        assert_eq!(self.core.requests_paired_with(&id), 0);
        assert_eq!(
            self.lost_replies - lost_before,
            paired as u64,
            "requests on lost worker {id}"
        );
    }

    fn worker_of(&self, conn: usize) -> Option<usize> {
        self.workers.iter().position(|w| w.conn == Some(conn))
    }

    /// Delivers the core's actions to simulated peers and checks what may be sent.
    fn route(&mut self) {
        for action in self.core.take_actions() {
            match action {
                Action::Send { conn, id, msg } => {
                    if matches!(&msg, Message::Error(e) if e.code == ErrorCode::WorkerLost) {
                        self.lost_replies += 1;
                    }
                    if let Some(w) = self.worker_of(conn) {
                        if matches!(msg, Message::DecodeReserve(_)) {
                            let drained = self
                                .core
                                .workers()
                                .by_id(&self.workers[w].id)
                                .and_then(|k| self.core.workers().get(k))
                                .is_some_and(|cw| cw.drain);
                            assert!(!drained, "a drained worker was paired");
                        }
                        if id != RequestId(0) {
                            assert!(
                                !self.log.rejected.contains(&id),
                                "rejected {id} reached worker {}: {msg:?}",
                                self.workers[w].id
                            );
                            self.seen_by_workers.insert(id);
                        }
                        self.workers[w].inbox.push_back((id, msg));
                    } else if self.clients.contains(&Some(conn)) {
                        self.client_frame(id, &msg);
                    }
                }
                Action::SendPool { conn, .. } => {
                    assert!(self.worker_of(conn).is_some(), "pool sent to a non-worker");
                }
                Action::Refuse { conn, error } => {
                    assert!(
                        self.worker_of(conn).is_none(),
                        "a simulated worker was refused: {error:?}"
                    );
                }
            }
        }
    }

    fn client_frame(&mut self, id: RequestId, msg: &Message) {
        if id == RequestId(0) {
            // Answers to drains, which carry no request.
            return;
        }
        match msg {
            Message::Done(_) => *self.log.ended.entry(id).or_default() += 1,
            Message::Error(e) => {
                *self.log.ended.entry(id).or_default() += 1;
                if e.code == ErrorCode::Rejected {
                    assert!(
                        !self.seen_by_workers.contains(&id),
                        "{id} was rejected after a worker heard of it"
                    );
                    self.log.rejected.insert(id);
                }
            }
            Message::Tokens(_) | Message::DrainReply(_) => {}
            other => panic!("unexpected frame to a client: {other:?}"),
        }
    }

    fn send_from(&mut self, w: usize, id: RequestId, msg: impl Into<Message>) {
        let Some(conn) = self.workers[w].conn else {
            return;
        };
        let now = self.now();
        self.core.worker_frame(conn, id, msg.into(), now);
        self.route();
    }

    fn reserve(&mut self, w: usize, owner: Owner, n: u32) -> bool {
        let sw = &mut self.workers[w];
        if sw.held.contains_key(&owner) {
            return false;
        }
        assert!(
            sw.used + n <= sw.pool,
            "worker {} over-committed: {} used + {n} > pool {}",
            sw.id,
            sw.used,
            sw.pool
        );
        sw.used += n;
        sw.held.insert(owner, n);
        true
    }

    fn free(&mut self, w: usize, owner: Owner) {
        let Some(n) = self.workers[w].held.remove(&owner) else {
            return;
        };
        self.workers[w].used -= n;
        self.workers[w].jobs.retain(|(_, o, _)| *o != owner);
        self.send_from(w, owner.request, Freed { owner, pages: n });
    }

    /// The worker handles the first frame of its inbox, as prefilld or decoded would.
    fn deliver(&mut self, w: usize) {
        let Some((id, msg)) = self.workers[w].inbox.pop_front() else {
            return;
        };
        match msg {
            Message::DecodeReserve(m) => {
                let n = pages(m.prompt_tokens + m.max_new_tokens);
                if self.reserve(w, m.owner, n) {
                    self.send_from(
                        w,
                        id,
                        DecodeReserved {
                            owner: m.owner,
                            pages: n,
                        },
                    );
                }
            }
            Message::PrefillRun(m) => {
                let tokens = u32::try_from(m.prompt.len()).unwrap();
                let n = pages(tokens);
                if self.reserve(w, m.owner, n) {
                    let manifest = Manifest {
                        owner: m.owner,
                        tokens,
                        pages: (0..n).map(PageId).collect(),
                        digests: vec![0; n as usize],
                    };
                    self.send_from(w, id, PrefillDone { manifest });
                }
            }
            Message::PullKv(m) => {
                let source = self
                    .workers
                    .iter()
                    .find(|s| s.id == m.source && s.side == Side::Prefill);
                assert!(source.is_some(), "PullKv names unknown source {}", m.source);
                let owner = m.manifest.owner;
                if self.workers[w].held.contains_key(&owner) {
                    self.workers[w].jobs.push((id, owner, m.max_new_tokens));
                    self.send_from(w, id, PullDone { owner });
                }
            }
            Message::Release(m) => self.free(w, m.owner),
            Message::Abort(m) => self.free(w, m.owner),
            Message::PrefillPool(_)
            | Message::PrefillEndpoint(_)
            | Message::PrefillGone(_)
            | Message::RegisterAck(_)
            | Message::DrainReply(_) => {}
            other => panic!("unexpected frame to a worker: {other:?}"),
        }
    }

    /// A decode worker finishes its oldest job: tokens, Done, then its pages are freed.
    fn finish_job(&mut self, w: usize, fail: bool) {
        if self.workers[w].jobs.is_empty() {
            return;
        }
        let (id, owner, n) = self.workers[w].jobs.remove(0);
        if fail {
            let e = libkv::proto::Error {
                code: ErrorCode::VerifyFailed,
                message: "digest mismatch".into(),
            };
            self.send_from(w, id, e);
        } else {
            self.send_from(
                w,
                id,
                Tokens {
                    first_index: 0,
                    tokens: vec![1; n as usize],
                },
            );
            self.send_from(
                w,
                id,
                Done {
                    tokens: n,
                    signature: 0,
                    pages_transferred: 0,
                    bytes_transferred: 0,
                    elapsed_us: 0,
                    prefill_worker: String::new(),
                    decode_worker: String::new(),
                },
            );
        }
        self.free(w, owner);
    }

    fn submit(&mut self, client: usize, prompt: u32, max_new: u32, deadline_ms: u32) {
        let Some(conn) = self.clients[client] else {
            return;
        };
        self.log.submitted += 1;
        self.log
            .client_of
            .insert(RequestId(self.log.submitted), client);
        let s = Submit {
            tenant: format!("t{client}"),
            prompt: vec![u32::from(b'x'); prompt as usize],
            max_new_tokens: max_new,
            deadline_ms,
            sampling: libkv::proto::Sampling::GREEDY,
        };
        let now = self.now();
        self.core.submit(conn, s, now);
        self.route();
    }

    fn tick(&mut self, ms: u64) {
        self.ms += ms;
        let now = self.now();
        self.core.tick(now);
        self.route();
        for (id, deadline) in self.core.deadlines() {
            assert!(deadline > now, "{id} outlived its deadline");
        }
    }

    fn check(&self) {
        if let Err(e) = self.core.check_ledgers() {
            panic!("ledger: {e}");
        }
        for (id, n) in &self.log.ended {
            assert_eq!(*n, 1, "{id} ended {n} times for its client");
        }
    }

    /// Lets every worker come back and answer everything, time pass, jobs finish.
    fn settle(&mut self) {
        for w in 0..self.workers.len() {
            self.join(w);
        }
        for _ in 0..200 {
            for w in 0..self.workers.len() {
                while !self.workers[w].inbox.is_empty() {
                    self.deliver(w);
                }
                while !self.workers[w].jobs.is_empty() {
                    self.finish_job(w, false);
                }
            }
            self.tick(20);
            if self.core.in_flight() == 0
                && self
                    .workers
                    .iter()
                    .all(|w| w.inbox.is_empty() && w.jobs.is_empty())
            {
                break;
            }
        }
        self.check();
        assert_eq!(self.core.in_flight(), 0, "requests left after settling");
        for side in [Side::Prefill, Side::Decode] {
            for (_, w) in self.core.workers().iter(side) {
                assert!(
                    w.idle(),
                    "worker {} not idle after settling: {} free of {}, {} in flight",
                    w.id,
                    w.free,
                    w.pool_pages,
                    w.in_flight
                );
            }
        }
        for sw in &self.workers {
            assert_eq!(sw.used, 0, "simulated worker {} holds pages", sw.id);
        }
        for id in self.log.client_of.keys() {
            if !self.closed_ids.contains(id) {
                assert_eq!(
                    self.log.ended.get(id).copied(),
                    Some(1),
                    "{id} of a connected client did not end exactly once"
                );
            }
        }
    }

    /// The client goes away (its requests must fail cleanly) and a new one takes its place.
    fn close_client(&mut self, client: usize) {
        if let Some(conn) = self.clients[client].take() {
            let now = self.now();
            self.core.conn_closed(conn, now);
            self.route();
        }
        self.closed_ids.extend(
            self.log
                .client_of
                .iter()
                .filter(|(_, c)| **c == client)
                .map(|(id, _)| *id),
        );
        self.clients[client] = Some(self.conn_id());
    }

    fn client_drain(&mut self, w: usize, drain: bool) {
        let Some(conn) = self.clients[0] else { return };
        let d = Drain {
            worker: self.workers[w].id.clone(),
            drain,
        };
        let now = self.now();
        self.core.client_drain(conn, RequestId(0), &d, now);
        self.route();
    }

    fn self_drain(&mut self, w: usize) {
        let d = Drain {
            worker: self.workers[w].id.clone(),
            drain: true,
        };
        self.send_from(w, RequestId(0), d);
    }
}

#[derive(Clone, Debug)]
enum Op {
    Submit {
        client: usize,
        prompt: u32,
        max_new: u32,
        deadline_ms: u32,
    },
    Deliver(usize),
    Finish(usize),
    Fail(usize),
    Lose(usize),
    Rejoin(usize),
    Drain(usize, bool),
    SelfDrain(usize),
    Tick(u64),
    CloseClient(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..3usize, 1..=80u32, 1..=40u32, prop_oneof![Just(0u32), 1..400u32]).prop_map(
            |(client, prompt, max_new, deadline_ms)| Op::Submit {
                client,
                prompt,
                max_new,
                deadline_ms,
            }
        ),
        30 => (0..16usize).prop_map(Op::Deliver),
        8 => (0..16usize).prop_map(Op::Finish),
        1 => (0..16usize).prop_map(Op::Fail),
        1 => (0..16usize).prop_map(Op::Lose),
        4 => (0..16usize).prop_map(Op::Rejoin),
        1 => (0..16usize, any::<bool>()).prop_map(|(w, d)| Op::Drain(w, d)),
        1 => (0..16usize).prop_map(Op::SelfDrain),
        4 => (1..25u64).prop_map(Op::Tick),
        1 => (0..3usize).prop_map(Op::CloseClient),
    ]
}

fn run(sim: &mut Sim, ops: &[Op]) {
    let n = sim.workers.len();
    for op in ops {
        match *op {
            Op::Submit {
                client,
                prompt,
                max_new,
                deadline_ms,
            } => sim.submit(client, prompt, max_new, deadline_ms),
            Op::Deliver(w) => sim.deliver(w % n),
            Op::Finish(w) => sim.finish_job(w % n, false),
            Op::Fail(w) => sim.finish_job(w % n, true),
            Op::Lose(w) => sim.lose(w % n),
            Op::Rejoin(w) => sim.join(w % n),
            Op::Drain(w, d) => sim.client_drain(w % n, d),
            Op::SelfDrain(w) => sim.self_drain(w % n),
            Op::Tick(ms) => sim.tick(ms),
            Op::CloseClient(c) => sim.close_client(c),
        }
        sim.check();
    }
    // Undrain everyone so that settling can finish what is queued.
    for w in 0..n {
        sim.client_drain(w, false);
    }
    sim.settle();
}

fn pairing() -> impl Strategy<Value = Pairing> {
    prop_oneof![
        Just(Pairing::MostFree),
        Just(Pairing::FewestInFlight),
        Just(Pairing::PowerOfTwo),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_events_over_many_workers_keep_the_invariants(
        n_prefill in 1..5usize,
        n_decode in 1..5usize,
        sizes in proptest::collection::vec(0..6u32, 8),
        tcp in any::<bool>(),
        pairing in pairing(),
        queue in prop_oneof![Just(0usize), 1..8usize, Just(1024usize)],
        ops in proptest::collection::vec(op(), 1..300),
    ) {
        let mut sim = Sim::new(n_prefill, n_decode, &sizes, tcp, config(pairing, queue));
        run(&mut sim, &ops);
    }
}

/// Many workers, long runs: 8 + 8 workers and a few thousand events.
#[test]
fn eight_and_eight_workers_under_a_long_random_run() {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 16,
        ..ProptestConfig::default()
    });
    let strategy = (pairing(), proptest::collection::vec(op(), 2000..3000));
    runner
        .run(&strategy, |(pairing, ops)| {
            let sizes = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3];
            let mut sim = Sim::new(8, 8, &sizes, false, config(pairing, 64));
            run(&mut sim, &ops);
            Ok(())
        })
        .unwrap();
}
