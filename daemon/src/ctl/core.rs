//! kvctld's core: the workers, the admission ledger and every request's state machine,
//! with no I/O.
//!
//! Events go in as method calls, each with the time it happened (`now`): a registration, a
//! frame from a worker or a client, a closed connection, a tick. What kvctld must send comes
//! out as [`Action`]s, taken with [`Core::take_actions`]; the event loop (`event_loop.rs`)
//! writes them to the connections. The core reads no clock and touches no socket, so the
//! invariants are tested on it directly (unit tests here, random event sequences over many
//! workers in `daemon/tests/core_props.rs`).
//!
//! A request goes `Queued -> Reserving -> Prefilling -> Pulling -> Decoding -> done`, each
//! stage with its own deadline, all under the request's deadline:
//!
//! 1. `Submit`: the static checks of [`admission::need`]; a request that can never fit is
//!    answered `Rejected` here and no worker ever hears of it (invariant 1).
//! 2. Admission: a (prefill, decode) pair whose ledgers both hold the request now, the
//!    decode worker with a free batch slot (its `max_batch` requests not ended), by the
//!    configured [`Pairing`]; both ledgers are charged or neither (invariant 2), and the
//!    request holds its decode slot until it ends. Otherwise the request waits, FIFO and
//!    bounded by `admission_queue` and `admission_wait`; one that waited out
//!    `admission_wait` only for a slot fails saying so (`PoolFull`, as a wait for pages).
//! 3. `DecodeReserve` to the decode worker, `PrefillRun` to the prefill worker once decode
//!    has reserved, `PullKv` naming the prefill worker once its manifest is in, `Release` to
//!    prefill once decode verified the pages, then `Tokens` and `Done` to the client.
//!
//! Ledger pages come back only on the worker's `Freed` (no writer left), or all at once when
//! the worker is lost. A failed request is aborted on every worker told of it; prefill's
//! abort waits while decode may still be copying its pages (invariant 4). A lost worker
//! fails only the requests paired with it.

use super::latency::Latencies;
use super::workers::{ConnId, Worker, WorkerKey, Workers};
use libkv::admission::{self, Limits, Need, RequestSpec, Side};
use libkv::config::ModelKind;
use libkv::config::{Config, DeadlineDurations, Pairing};
use libkv::model::REFERENCE_MODEL;
use libkv::proto::{
    self, Abort, DecodeReserve, Done, Drain, DrainReply, ErrorCode, Freed, Message, PoolReport,
    PrefillDone, PrefillEndpoint, PrefillGone, PrefillPool, PrefillRun, PullKv, RegisterAck,
    RegisterWorker, Release, Role, Sampling, StatusReply, Submit, Tokens, Transport, WorkerStatus,
};
use libkv::{Generation, Owner, PageGeometry, RequestId};
use log::{debug, info, warn};
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::time::{Duration, Instant};

/// Hashes a [`RequestId`] (kvctld numbers them from 1, so one multiply spreads them): the
/// request tables are looked up several times per event.
#[derive(Debug, Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type IdMap<V> = HashMap<RequestId, V, BuildHasherDefault<IdHasher>>;

/// What the event loop must do for the core.
#[derive(Debug, PartialEq, Eq)]
pub enum Action {
    /// Send `msg` about request `id` on `conn`.
    Send {
        conn: ConnId,
        id: RequestId,
        msg: Message,
    },
    /// Send `msg` on `conn` with the pool memfd that the prefill worker on `pool_of`
    /// registered attached.
    SendPool {
        conn: ConnId,
        msg: PrefillPool,
        pool_of: ConnId,
    },
    /// Send the error, then close `conn` (a peer that broke the protocol or may not stay).
    Refuse { conn: ConnId, error: proto::Error },
}

/// The settings the core runs by, from the validated config.
#[derive(Clone, Debug)]
pub struct CoreConfig {
    pub geometry: PageGeometry,
    pub limits: Limits,
    pub deadlines: DeadlineDurations,
    pub admission_queue: usize,
    pub pairing: Pairing,
    /// Seeds the random draws of [`Pairing::PowerOfTwo`].
    pub seed: u64,
    /// Fault-injection builds only: replace an over-long prompt by a one-token placeholder
    /// (the incident), to prove the test suite catches it.
    pub placeholder_fault: bool,
    /// `[model] kind`: workers must run the reference model, or a GGUF model (all the
    /// same one, whichever registers first).
    pub model_kind: ModelKind,
}

impl CoreConfig {
    pub fn from_config(cfg: &Config, seed: u64) -> CoreConfig {
        CoreConfig {
            geometry: cfg.geometry,
            limits: Limits {
                geometry: cfg.geometry,
                max_context: cfg.limits.max_context,
                max_new_tokens: cfg.limits.max_new_tokens,
                prefill_pages: cfg.prefill.pool_pages,
                decode_pages: cfg.decode.pool_pages,
            },
            deadlines: cfg.deadlines.as_durations(),
            model_kind: cfg.model.kind,
            admission_queue: cfg.control.admission_queue as usize,
            pairing: cfg.control.pairing,
            seed,
            placeholder_fault: false,
        }
    }

    /// Pages a worker of `side` must have to hold the largest request: `max_context` on
    /// prefill, `max_context + max_new_tokens` on decode.
    pub fn min_pool_pages(&self, side: Side) -> u64 {
        let context = u64::from(self.limits.max_context);
        let tokens = match side {
            Side::Prefill => context,
            Side::Decode => context + u64::from(self.limits.max_new_tokens),
        };
        self.geometry.pages_for_tokens(tokens)
    }
}

/// kvctld's own counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub submitted: u64,
    pub admitted: u64,
    pub rejected: u64,
    pub queued: u64,
    pub refused_full: u64,
    pub completed: u64,
    pub failed: u64,
    pub timeouts: u64,
    pub worker_lost: u64,
    pub verify_failed: u64,
    pub client_gone: u64,
    pub bootstraps: u64,
    pub transfers: u64,
    pub pages_transferred: u64,
    pub bytes_transferred: u64,
    /// Terminal rejections by reason: a bad request, a prompt over max_context, max_new_tokens
    /// over its limit, a request no pool of its role can ever hold.
    pub rejected_by_reason: [u64; 4],
    /// Pages and bytes moved, by the transport of the pair ([`transport_slot`]).
    pub pages_by_transport: [u64; 3],
    pub bytes_by_transport: [u64; 3],
    pub protocol_errors: u64,
    pub workers_registered: u64,
    pub workers_lost: u64,
    pub registrations_refused: u64,
    /// Queued requests that failed at a deadline (`admission_wait`, or their own) while
    /// they waited only for a decode batch slot (also counted in `timeouts`).
    pub slot_timeouts: u64,
}

impl Counters {
    /// Name and value of each, for status.
    pub fn list(&self) -> Vec<(String, u64)> {
        [
            ("submitted", self.submitted),
            ("admitted", self.admitted),
            ("rejected", self.rejected),
            ("queued", self.queued),
            ("refused_full", self.refused_full),
            ("completed", self.completed),
            ("failed", self.failed),
            ("timeouts", self.timeouts),
            ("worker_lost", self.worker_lost),
            ("verify_failed", self.verify_failed),
            ("client_gone", self.client_gone),
            ("bootstraps", self.bootstraps),
            ("transfers", self.transfers),
            ("pages_transferred", self.pages_transferred),
            ("bytes_transferred", self.bytes_transferred),
            ("rejected_bad_request", self.rejected_by_reason[0]),
            ("rejected_prompt_too_long", self.rejected_by_reason[1]),
            ("rejected_max_new_too_large", self.rejected_by_reason[2]),
            ("rejected_exceeds_capacity", self.rejected_by_reason[3]),
            (
                "pages_transferred_shm",
                self.pages_by_transport[transport_slot(Transport::Shm)],
            ),
            (
                "pages_transferred_tcp",
                self.pages_by_transport[transport_slot(Transport::Tcp)],
            ),
            (
                "pages_transferred_rdma",
                self.pages_by_transport[transport_slot(Transport::Rdma)],
            ),
            (
                "bytes_transferred_shm",
                self.bytes_by_transport[transport_slot(Transport::Shm)],
            ),
            (
                "bytes_transferred_tcp",
                self.bytes_by_transport[transport_slot(Transport::Tcp)],
            ),
            (
                "bytes_transferred_rdma",
                self.bytes_by_transport[transport_slot(Transport::Rdma)],
            ),
            ("protocol_errors", self.protocol_errors),
            ("workers_registered", self.workers_registered),
            ("workers_lost", self.workers_lost),
            ("registrations_refused", self.registrations_refused),
            ("slot_timeouts", self.slot_timeouts),
        ]
        .into_iter()
        .map(|(n, v)| (n.to_owned(), v))
        .collect()
    }
}

/// Where a request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Queued,
    Reserving,
    Prefilling,
    Pulling,
    Decoding,
}

impl Stage {
    /// Every stage, in the order a request goes through them.
    pub const ALL: [Stage; 5] = [
        Stage::Queued,
        Stage::Reserving,
        Stage::Prefilling,
        Stage::Pulling,
        Stage::Decoding,
    ];

    /// The stage's place in [`Stage::ALL`].
    pub fn index(self) -> usize {
        match self {
            Stage::Queued => 0,
            Stage::Reserving => 1,
            Stage::Prefilling => 2,
            Stage::Pulling => 3,
            Stage::Decoding => 4,
        }
    }

    /// The stage as a metric label (`stage="bootstrap"`).
    pub fn label(self) -> &'static str {
        match self {
            Stage::Queued => "admission_wait",
            Stage::Reserving => "bootstrap",
            Stage::Prefilling => "prefill",
            Stage::Pulling => "transfer",
            Stage::Decoding => "decode",
        }
    }

    /// The stage as an operator reads it.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Queued => "admission",
            Stage::Reserving => "decode reservation",
            Stage::Prefilling => "prefill",
            Stage::Pulling => "transfer",
            Stage::Decoding => "decode",
        }
    }

    /// The `[deadlines]` key that bounds the stage.
    pub fn deadline_key(self) -> &'static str {
        match self {
            Stage::Queued => "deadlines.admission_wait",
            Stage::Reserving => "deadlines.bootstrap",
            Stage::Prefilling => "deadlines.prefill",
            Stage::Pulling => "deadlines.transfer",
            Stage::Decoding => "deadlines.decode",
        }
    }
}

#[derive(Debug)]
struct Request {
    client: ConnId,
    spec: RequestSpec,
    prompt: Vec<u32>,
    /// How decode picks tokens, passed on in `PullKv`.
    sampling: Sampling,
    need: Need,
    stage: Stage,
    /// The (prefill, decode) pair, once admitted.
    pair: Option<(WorkerKey, WorkerKey)>,
    /// Whether each side was sent a frame about the request (it then holds an owner).
    told_prefill: bool,
    told_decode: bool,
    stage_deadline: Instant,
    stage_budget: Duration,
    stage_started: Instant,
    deadline: Instant,
    /// The whole request's budget (`deadline` minus its arrival).
    total: Duration,
    /// When its Submit arrived.
    arrived: Instant,
    /// Whether tokens were relayed to the client yet.
    first_token_sent: bool,
}

/// Ledger pages lent for a request and not yet reported free, per side, with the worker
/// that holds them.
#[derive(Debug, Default)]
struct Held {
    prefill: Option<(WorkerKey, u32)>,
    decode: Option<(WorkerKey, u32)>,
}

impl Held {
    fn slot(&mut self, side: Side) -> &mut Option<(WorkerKey, u32)> {
        match side {
            Side::Prefill => &mut self.prefill,
            Side::Decode => &mut self.decode,
        }
    }

    fn is_empty(&self) -> bool {
        self.prefill.is_none() && self.decode.is_none()
    }
}

/// A prefill abort held back until decode stops reading the pages.
#[derive(Debug)]
struct Deferred {
    prefill: WorkerKey,
    decode: WorkerKey,
    abort: Abort,
}

/// The last few thousand durations of something, for percentiles in status.
#[derive(Debug, Default)]
struct Samples {
    us: VecDeque<u64>,
}

impl Samples {
    const KEEP: usize = 4096;

    fn record(&mut self, d: Duration) {
        if self.us.len() == Self::KEEP {
            self.us.pop_front();
        }
        self.us
            .push_back(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    }

    /// The `q`-quantile (0..=1) of the kept samples, in microseconds.
    fn quantile(&self, q: f64) -> Option<u64> {
        let mut v: Vec<u64> = self.us.iter().copied().collect();
        v.sort_unstable();
        let last = v.len().checked_sub(1)?;
        // q in [0, 1] and last < 4096: the product fits and rounds to an index.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let i = ((last as f64) * q).round() as usize;
        v.get(i.min(last)).copied()
    }
}

/// Why a registration was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// It can never be accepted as configured; the worker must exit (`Misconfigured`).
    Misconfigured(String),
    /// Not now (the id is held by a live worker, kvctld is stopping); it may retry.
    NotNow(String),
}

/// The core. See the module docs.
#[derive(Debug)]
pub struct Core {
    cfg: CoreConfig,
    generation: Generation,
    workers: Workers,
    requests: IdMap<Request>,
    held: IdMap<Held>,
    queue: VecDeque<RequestId>,
    deferred: IdMap<Deferred>,
    next_id: u64,
    counters: Counters,
    /// DecodeReserve to DecodeReserved: the bootstrap round trip through decoded.
    bootstrap_rtt: Samples,
    latencies: Latencies,
    stopping_since: Option<Instant>,
    out: Vec<Action>,
}

impl Core {
    pub fn new(cfg: CoreConfig, generation: Generation) -> Core {
        Core {
            workers: Workers::new(cfg.pairing, cfg.seed),
            cfg,
            generation,
            requests: IdMap::default(),
            held: IdMap::default(),
            queue: VecDeque::new(),
            deferred: IdMap::default(),
            next_id: 1,
            counters: Counters::default(),
            bootstrap_rtt: Samples::default(),
            latencies: Latencies::default(),
            stopping_since: None,
            out: Vec::new(),
        }
    }

    /// What to send, in order, since the last call.
    /// The latency histograms so far (for `/metrics`).
    pub fn latencies(&self) -> &Latencies {
        &self.latencies
    }

    pub fn take_actions(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.out)
    }

    pub fn generation(&self) -> Generation {
        self.generation
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Counts a frame the event loop refused before it reached the core.
    pub fn count_protocol_error(&mut self) {
        self.counters.protocol_errors += 1;
    }

    /// Requests not yet ended.
    pub fn in_flight(&self) -> usize {
        self.requests.len()
    }

    /// Requests waiting for admission.
    pub fn queue_len(&self) -> usize {
        self.queue.len()
    }

    /// The registry, for status and tests.
    pub fn workers(&self) -> &Workers {
        &self.workers
    }

    /// Whether the connection is a registered worker's.
    pub fn is_worker(&self, conn: ConnId) -> bool {
        self.workers.by_conn(conn).is_some()
    }

    fn send(&mut self, conn: ConnId, id: RequestId, msg: impl Into<Message>) {
        self.out.push(Action::Send {
            conn,
            id,
            msg: msg.into(),
        });
    }

    fn error(&mut self, conn: ConnId, id: RequestId, code: ErrorCode, message: String) {
        self.send(conn, id, proto::Error { code, message });
    }

    fn refuse(&mut self, conn: ConnId, code: ErrorCode, message: String) {
        self.out.push(Action::Refuse {
            conn,
            error: proto::Error { code, message },
        });
    }

    fn owner(&self, id: RequestId) -> Owner {
        Owner {
            request: id,
            generation: self.generation,
        }
    }

    // ---- workers -----------------------------------------------------------------------

    /// A `RegisterWorker` on `conn`. `pool_fd_ok`: a prefill worker on shared memory
    /// attached a read-only pool fd (the event loop checked it). On success the worker is
    /// acknowledged, told of (or told about) the prefill pools, and requests may be admitted.
    pub fn register(
        &mut self,
        conn: ConnId,
        r: RegisterWorker,
        pool_fd_ok: bool,
        now: Instant,
    ) -> Result<WorkerKey, Refusal> {
        let side = match r.role {
            Role::Prefill => Side::Prefill,
            Role::Decode => Side::Decode,
            Role::Client => {
                return Err(self.refuse_registration(
                    conn,
                    Refusal::Misconfigured("a client cannot register as a worker".into()),
                ));
            }
        };
        if let Some(refusal) = self.check_registration(side, &r, pool_fd_ok) {
            return Err(self.refuse_registration(conn, refusal));
        }
        let worker = Worker {
            id: r.id.clone(),
            side,
            conn,
            pool_pages: r.pool_pages,
            free: r.pool_pages,
            in_flight: 0,
            drain: false,
            operator_drain: false,
            drain_waiter: false,
            report: None,
            endpoint: r.endpoint,
            transports: r.transports,
            served: 0,
            last_pick: 0,
            pulls_shm: false,
            pulls_tcp: false,
            model: r.model,
            max_batch: r.max_batch,
        };
        let key = self.workers.insert(worker);
        self.counters.workers_registered += 1;
        info!(
            "{side} worker {} registered ({} pages{})",
            r.id,
            r.pool_pages,
            if self.workers.get(key).is_some_and(|w| w.drain) {
                ", still drained"
            } else {
                ""
            }
        );
        let ack = RegisterAck {
            generation: self.generation,
            max_context: self.cfg.limits.max_context,
            max_new_tokens: self.cfg.limits.max_new_tokens,
        };
        self.send(conn, RequestId(0), ack);
        match side {
            Side::Prefill => {
                let decoders: Vec<WorkerKey> =
                    self.workers.iter(Side::Decode).map(|(k, _)| k).collect();
                for d in decoders {
                    self.share(key, d);
                }
            }
            Side::Decode => {
                let sources: Vec<WorkerKey> =
                    self.workers.iter(Side::Prefill).map(|(k, _)| k).collect();
                for p in sources {
                    self.share(p, key);
                }
            }
        }
        self.try_admit(now);
        Ok(key)
    }

    fn refuse_registration(&mut self, conn: ConnId, refusal: Refusal) -> Refusal {
        self.counters.registrations_refused += 1;
        let (code, msg) = match &refusal {
            Refusal::Misconfigured(m) => (ErrorCode::Misconfigured, m.clone()),
            Refusal::NotNow(m) => (ErrorCode::BadRequest, m.clone()),
        };
        warn!("registration refused: {msg}");
        self.refuse(conn, code, msg);
        refusal
    }

    fn check_registration(
        &self,
        side: Side,
        r: &RegisterWorker,
        pool_fd_ok: bool,
    ) -> Option<Refusal> {
        if self.stopping_since.is_some() {
            return Some(Refusal::NotNow("kvctld is stopping".into()));
        }
        if r.geometry != self.cfg.geometry {
            return Some(Refusal::Misconfigured(format!(
                "{side} worker {} has page geometry {}, kvctld has {}",
                r.id,
                describe(&r.geometry),
                describe(&self.cfg.geometry)
            )));
        }
        if let Some(refusal) = self.check_model(side, r) {
            return Some(refusal);
        }
        let need = self.cfg.min_pool_pages(side);
        if u64::from(r.pool_pages) < need {
            let tokens = need * u64::from(self.cfg.geometry.tokens_per_page);
            let what = match side {
                Side::Prefill => format!("max_context {}", self.cfg.limits.max_context),
                Side::Decode => format!(
                    "max_context {} + max_new_tokens {}",
                    self.cfg.limits.max_context, self.cfg.limits.max_new_tokens
                ),
            };
            return Some(Refusal::Misconfigured(format!(
                "{side} worker {} has a pool of {} pages ({} tokens); {what} needs {need} pages \
                 ({tokens} tokens)",
                r.id,
                r.pool_pages,
                u64::from(r.pool_pages) * u64::from(self.cfg.geometry.tokens_per_page),
            )));
        }
        if side == Side::Prefill && r.endpoint.is_none() && !pool_fd_ok {
            return Some(Refusal::Misconfigured(
                "the prefill pool fd must be a sealed, read-only memfd".into(),
            ));
        }
        if let Some(k) = self.workers.by_id(&r.id) {
            let live = self.workers.get(k).map_or("?", |w| match w.side {
                Side::Prefill => "prefill",
                Side::Decode => "decode",
            });
            return Some(Refusal::NotNow(format!(
                "worker id {} is registered by a live {live} worker",
                r.id
            )));
        }
        None
    }

    /// KV of one model is meaningless to another, even of the same geometry: every worker
    /// runs the kind of model `[model]` names, and the same one as those registered.
    fn check_model(&self, side: Side, r: &RegisterWorker) -> Option<Refusal> {
        let reference = r.model == REFERENCE_MODEL;
        let engine = r.model.starts_with(libkv::engine::ENGINE_MODEL_PREFIX);
        let wanted = match self.cfg.model_kind {
            ModelKind::Reference if !reference => "the reference model",
            ModelKind::Gguf if reference || engine => "a GGUF model",
            ModelKind::Engine if !engine => "an engine's model (a worker inside vLLM)",
            _ => "",
        };
        if !wanted.is_empty() {
            return Some(Refusal::Misconfigured(format!(
                "{side} worker {} runs model {}, kvctld's [model] asks for {wanted}",
                r.id, r.model
            )));
        }
        let (_, other) = self.workers.iter_all().find(|(_, w)| w.model != r.model)?;
        Some(Refusal::Misconfigured(format!(
            "{side} worker {} runs model {}, worker {} runs {}: every worker of a kvctld runs \
             the same model",
            r.id, r.model, other.id, other.model
        )))
    }

    /// Tells decode worker `d` how to pull from prefill worker `p`.
    fn share(&mut self, p: WorkerKey, d: WorkerKey) {
        let (Some(pw), Some(dw)) = (self.workers.get(p), self.workers.get(d)) else {
            return;
        };
        if !pw.serves(dw) {
            warn!(
                "decode worker {} cannot pull from prefill worker {}: no common transport",
                dw.id, pw.id
            );
            return;
        }
        let dconn = dw.conn;
        match &pw.endpoint {
            Some(endpoint) => {
                let msg = PrefillEndpoint {
                    worker: pw.id.clone(),
                    geometry: self.cfg.geometry,
                    pool_pages: pw.pool_pages,
                    endpoint: endpoint.clone(),
                    rdma: pw.rdma_with(dw),
                };
                debug!(
                    "decode worker {} pulls from {} at {} over {}",
                    dw.id,
                    pw.id,
                    endpoint.addr,
                    if msg.rdma { "RDMA" } else { "TCP" }
                );
                self.send(dconn, RequestId(0), msg);
            }
            None => {
                let msg = PrefillPool {
                    worker: pw.id.clone(),
                    geometry: self.cfg.geometry,
                    pool_pages: pw.pool_pages,
                };
                let pool_of = pw.conn;
                self.out.push(Action::SendPool {
                    conn: dconn,
                    msg,
                    pool_of,
                });
            }
        }
    }

    /// The connection `conn` closed (or was dropped by the event loop).
    /// The client connections with a request in flight (queued or running): the event loop
    /// never closes those for being idle.
    pub fn busy_clients(&self) -> std::collections::HashSet<ConnId> {
        self.requests.values().map(|r| r.client).collect()
    }

    pub fn conn_closed(&mut self, conn: ConnId, now: Instant) {
        if let Some(key) = self.workers.by_conn(conn) {
            self.worker_lost(key, now);
            return;
        }
        let mine: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, r)| r.client == conn)
            .map(|(id, _)| *id)
            .collect();
        for id in mine {
            self.counters.client_gone += 1;
            self.fail(id, ErrorCode::Internal, "client disconnected".into(), now);
        }
    }

    fn worker_lost(&mut self, key: WorkerKey, now: Instant) {
        let Some(w) = self.workers.remove(key) else {
            return;
        };
        self.counters.workers_lost += 1;
        warn!("{} worker {} lost", w.side, w.id);
        // Deferred prefill aborts: the lost prefill needs none; a lost decode reads no more.
        let ids: Vec<RequestId> = self
            .deferred
            .iter()
            .filter(|(_, d)| d.prefill == key || d.decode == key)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if let Some(d) = self.deferred.remove(&id)
                && d.decode == key
            {
                self.send_abort_to(d.prefill, id, d.abort);
            }
        }
        // Its pages went with its process: nothing of them is lent any more.
        for h in self.held.values_mut() {
            let slot = h.slot(key.side);
            if slot.is_some_and(|(k, _)| k == key) {
                *slot = None;
            }
        }
        self.held.retain(|_, h| !h.is_empty());
        let hit: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, r)| r.pair.is_some_and(|(p, d)| p == key || d == key))
            .map(|(id, _)| *id)
            .collect();
        self.workers.lost_failed(&w.id, hit.len() as u64);
        for id in hit {
            self.counters.worker_lost += 1;
            let msg = format!("the {} worker {} was lost", w.side, w.id);
            self.fail(id, ErrorCode::WorkerLost, msg, now);
        }
        if w.side == Side::Prefill {
            let decoders: Vec<ConnId> = self
                .workers
                .iter(Side::Decode)
                .map(|(_, d)| d.conn)
                .collect();
            for conn in decoders {
                let gone = PrefillGone {
                    worker: w.id.clone(),
                };
                self.send(conn, RequestId(0), gone);
            }
        }
        self.try_admit(now);
    }

    /// A frame from the registered worker on `conn`.
    pub fn worker_frame(&mut self, conn: ConnId, id: RequestId, msg: Message, now: Instant) {
        let Some(key) = self.workers.by_conn(conn) else {
            return;
        };
        let side = key.side;
        match msg {
            Message::PoolReport(r) => self.pool_report(key, r),
            Message::Freed(f) => self.freed(key, &f, now),
            Message::DecodeReserved(r) if side == Side::Decode => {
                self.reserved(id, key, r.owner, now);
            }
            Message::PrefillDone(d) if side == Side::Prefill => self.prefill_done(id, key, d, now),
            Message::PullDone(p) if side == Side::Decode => self.pulled(id, key, p.owner, now),
            Message::Tokens(t) if side == Side::Decode => self.tokens(id, key, t, now),
            Message::Done(d) if side == Side::Decode => self.done(id, key, d, now),
            Message::Error(e) => {
                if self.told(id, key) {
                    if e.code == ErrorCode::VerifyFailed {
                        self.counters.verify_failed += 1;
                    }
                    let name = self.workers.get(key).map_or("", |w| w.id.as_str());
                    let msg = format!("{side} worker {name}: {}", e.message);
                    self.fail(id, e.code, msg, now);
                }
            }
            Message::Drain(d) => self.worker_drain(key, &d, now),
            other => {
                self.counters.protocol_errors += 1;
                let msg = format!("a {side} worker may not send {:?}", other.msg_type());
                self.refuse(conn, ErrorCode::BadRequest, msg);
            }
        }
    }

    fn pool_report(&mut self, key: WorkerKey, r: PoolReport) {
        if let Some(w) = self.workers.get_mut(key) {
            w.report = Some(r);
        }
    }

    /// Whether the request `id` is live and worker `key` is its worker on that side and was
    /// told of it.
    fn told(&self, id: RequestId, key: WorkerKey) -> bool {
        self.requests.get(&id).is_some_and(|r| match r.pair {
            Some((p, _)) if p == key => r.told_prefill,
            Some((_, d)) if d == key => r.told_decode,
            _ => false,
        })
    }

    /// The request `id` if it is live, in `stage`, and `key` was told of it; a frame for a
    /// request that ended is stale and ignored; one in the wrong stage fails the request.
    fn expect(
        &mut self,
        id: RequestId,
        key: WorkerKey,
        owner: Owner,
        stage: Stage,
        now: Instant,
    ) -> bool {
        if owner.request != id || owner.generation != self.generation || !self.told(id, key) {
            debug!("{id}: stale reply for {} ignored", stage.name());
            return false;
        }
        let current = self.requests.get(&id).map(|r| r.stage);
        if current != Some(stage) {
            let msg = format!("{id}: reply for stage {stage:?} in stage {current:?}");
            self.fail(id, ErrorCode::Internal, msg, now);
            return false;
        }
        true
    }

    fn enter(&mut self, id: RequestId, stage: Stage, budget: Duration, now: Instant) {
        if let Some(r) = self.requests.get_mut(&id) {
            self.latencies
                .stage(r.stage)
                .observe(now.saturating_duration_since(r.stage_started));
            r.stage = stage;
            r.stage_started = now;
            r.stage_deadline = now + budget;
            r.stage_budget = budget;
        }
    }

    fn reserved(&mut self, id: RequestId, key: WorkerKey, owner: Owner, now: Instant) {
        if !self.expect(id, key, owner, Stage::Reserving, now) {
            return;
        }
        let Some((started, Some((p, _)))) =
            self.requests.get(&id).map(|r| (r.stage_started, r.pair))
        else {
            return;
        };
        self.bootstrap_rtt
            .record(now.saturating_duration_since(started));
        let Some(pconn) = self.workers.get(p).map(|w| w.conn) else {
            self.fail(id, ErrorCode::WorkerLost, "prefill worker lost".into(), now);
            return;
        };
        let Some(r) = self.requests.get_mut(&id) else {
            return;
        };
        r.told_prefill = true;
        let msg = PrefillRun {
            owner,
            prompt: r.prompt.clone(),
        };
        self.enter(id, Stage::Prefilling, self.cfg.deadlines.prefill, now);
        self.send(pconn, id, msg);
    }

    fn prefill_done(&mut self, id: RequestId, key: WorkerKey, d: PrefillDone, now: Instant) {
        let m = d.manifest;
        if !self.expect(id, key, m.owner, Stage::Prefilling, now) {
            return;
        }
        let Some(r) = self.requests.get(&id) else {
            return;
        };
        // Defence in depth; decoded verifies it all again against its own reservation.
        if m.tokens != r.spec.prompt_tokens {
            self.counters.verify_failed += 1;
            let msg = format!(
                "prefill manifest covers {} tokens, the request has {}",
                m.tokens, r.spec.prompt_tokens
            );
            self.fail(id, ErrorCode::VerifyFailed, msg, now);
            return;
        }
        let Some((p, d)) = r.pair else { return };
        let max_new_tokens = r.spec.max_new_tokens;
        // Admission refuses an empty prompt, so there is always a last token.
        let last_token = r.prompt.last().copied().unwrap_or_default();
        let sampling = r.sampling;
        let (Some(prefill), Some(decode)) = (self.workers.get(p), self.workers.get(d)) else {
            return;
        };
        let (source, dconn) = (prefill.id.clone(), decode.conn);
        // The transport the pair moves pages with, as decoded picks it: the shared pool where
        // prefill has no page server, RDMA where both speak it, TCP otherwise.
        let transport = transport_slot(if prefill.endpoint.is_none() {
            Transport::Shm
        } else if prefill.rdma_with(decode) {
            Transport::Rdma
        } else {
            Transport::Tcp
        });
        let pages = m.pages.len() as u64;
        let bytes = pages.saturating_mul(self.cfg.geometry.bytes_per_page());
        self.counters.transfers += 1;
        self.counters.pages_transferred += pages;
        self.counters.bytes_transferred += bytes;
        self.counters.pages_by_transport[transport] += pages;
        self.counters.bytes_by_transport[transport] += bytes;
        self.enter(id, Stage::Pulling, self.cfg.deadlines.transfer, now);
        let pull = PullKv {
            source,
            manifest: m,
            max_new_tokens,
            last_token,
            sampling,
        };
        self.send(dconn, id, pull);
    }

    fn pulled(&mut self, id: RequestId, key: WorkerKey, owner: Owner, now: Instant) {
        if !self.expect(id, key, owner, Stage::Pulling, now) {
            return;
        }
        self.enter(id, Stage::Decoding, self.cfg.deadlines.decode, now);
        // Decode holds verified copies now: prefill's pages can go.
        let p = self.requests.get(&id).and_then(|r| r.pair).map(|(p, _)| p);
        if let Some(pconn) = p.and_then(|p| self.workers.get(p)).map(|w| w.conn) {
            self.send(pconn, id, Release { owner });
        }
    }

    fn tokens(&mut self, id: RequestId, key: WorkerKey, t: Tokens, now: Instant) {
        if !self.told(id, key) {
            return;
        }
        let Some(r) = self.requests.get(&id) else {
            return;
        };
        if r.stage != Stage::Decoding {
            self.fail(
                id,
                ErrorCode::Internal,
                "tokens before verified transfer".into(),
                now,
            );
            return;
        }
        let client = r.client;
        if !r.first_token_sent {
            let since = now.saturating_duration_since(r.arrived);
            self.latencies.first_token.observe(since);
            if let Some(r) = self.requests.get_mut(&id) {
                r.first_token_sent = true;
            }
        }
        self.send(client, id, t);
    }

    fn done(&mut self, id: RequestId, key: WorkerKey, mut d: Done, now: Instant) {
        if !self.told(id, key) {
            return;
        }
        if self.requests.get(&id).map(|r| r.stage) != Some(Stage::Decoding) {
            let msg = "Done before verified transfer".into();
            self.fail(id, ErrorCode::Internal, msg, now);
            return;
        }
        let Some(r) = self.end(id) else { return };
        self.latencies
            .stage(Stage::Decoding)
            .observe(now.saturating_duration_since(r.stage_started));
        self.latencies
            .request
            .observe(now.saturating_duration_since(r.arrived));
        if let Some((p, dk)) = r.pair {
            for (k, name) in [(p, &mut d.prefill_worker), (dk, &mut d.decode_worker)] {
                if let Some(w) = self.workers.get_mut(k) {
                    w.served += 1;
                    name.clone_from(&w.id);
                }
            }
        }
        self.counters.completed += 1;
        self.send(r.client, id, d);
        self.after_end(r.pair);
        // Its decode slot is free (its pages come back with the worker's Freed).
        self.try_admit(now);
    }

    fn freed(&mut self, key: WorkerKey, f: &Freed, now: Instant) {
        let id = f.owner.request;
        if f.owner.generation != self.generation {
            return;
        }
        if let Some(h) = self.held.get_mut(&id) {
            let slot = h.slot(key.side);
            if let Some((k, pages)) = *slot
                && k == key
            {
                *slot = None;
                if let Some(w) = self.workers.get_mut(key) {
                    w.free = w.free.saturating_add(pages).min(w.pool_pages);
                }
            }
            if h.is_empty() {
                self.held.remove(&id);
            }
        }
        if key.side == Side::Decode
            && self.deferred.get(&id).is_some_and(|d| d.decode == key)
            && let Some(d) = self.deferred.remove(&id)
        {
            self.send_abort_to(d.prefill, id, d.abort);
        }
        self.check_drained(key);
        self.try_admit(now);
    }

    fn send_abort_to(&mut self, key: WorkerKey, id: RequestId, abort: Abort) {
        if let Some(conn) = self.workers.get(key).map(|w| w.conn) {
            self.send(conn, id, abort);
        }
    }

    // ---- drain -------------------------------------------------------------------------

    /// A worker asks to drain itself (it is stopping): no new requests; `DrainReply` once
    /// it is idle.
    fn worker_drain(&mut self, key: WorkerKey, d: &Drain, now: Instant) {
        let Some(w) = self.workers.get_mut(key) else {
            return;
        };
        if d.worker != w.id {
            let (conn, msg) = (w.conn, format!("worker {} may drain only itself", w.id));
            self.counters.protocol_errors += 1;
            self.refuse(conn, ErrorCode::BadRequest, msg);
            return;
        }
        w.drain = d.drain;
        w.drain_waiter = d.drain;
        info!(
            "{} worker {} is stopping: {} requests in flight",
            w.side, w.id, w.in_flight
        );
        self.check_drained(key);
        if !d.drain {
            self.try_admit(now);
        }
    }

    /// A client's `kvctl drain ID` / `kvctl undrain ID`.
    pub fn client_drain(&mut self, conn: ConnId, id: RequestId, d: &Drain, now: Instant) {
        let Some(key) = self.workers.by_id(&d.worker) else {
            let msg = if self.workers.lost(&d.worker).is_some() {
                format!("worker {} is not connected", d.worker)
            } else {
                format!("no worker {} is registered", d.worker)
            };
            self.error(conn, id, ErrorCode::BadRequest, msg);
            return;
        };
        if let Some(w) = self.workers.get_mut(key) {
            if w.drain != d.drain {
                info!(
                    "{} worker {}: {}",
                    w.side,
                    w.id,
                    if d.drain { "drained" } else { "undrained" }
                );
            }
            w.drain = d.drain;
            w.operator_drain = d.drain;
        }
        if let Some(status) = self.worker_status(key) {
            self.send(conn, id, DrainReply { worker: status });
        }
        if !d.drain {
            self.try_admit(now);
        }
    }

    /// Answers a worker that drains itself once it is idle.
    fn check_drained(&mut self, key: WorkerKey) {
        let Some(w) = self.workers.get_mut(key) else {
            return;
        };
        if !(w.drain_waiter && w.idle()) {
            return;
        }
        w.drain_waiter = false;
        let conn = w.conn;
        info!("{} worker {} is idle and may stop", w.side, w.id);
        if let Some(status) = self.worker_status(key) {
            self.send(conn, RequestId(0), DrainReply { worker: status });
        }
    }

    // ---- requests ----------------------------------------------------------------------

    /// A client's `Submit`.
    pub fn submit(&mut self, conn: ConnId, s: Submit, now: Instant) {
        self.counters.submitted += 1;
        let id = RequestId(self.next_id);
        self.next_id += 1;
        if self.stopping_since.is_some() {
            self.error(
                conn,
                id,
                ErrorCode::ShuttingDown,
                "kvctld is stopping".into(),
            );
            return;
        }
        let prompt_tokens = u32::try_from(s.prompt.len()).unwrap_or(u32::MAX);
        let spec = RequestSpec {
            tenant: s.tenant,
            prompt_tokens,
            max_new_tokens: s.max_new_tokens,
        };
        let sampling = s.sampling;
        let mut prompt = s.prompt;
        let need = match admission::need(&spec, &self.cfg.limits) {
            Ok(n) => n,
            Err(admission::Rejection::PromptExceedsContext { .. })
                if self.cfg.placeholder_fault =>
            {
                // The incident, on purpose (fault-injection builds only): the over-long
                // prompt is replaced by a one-token placeholder for prefill while decode
                // still reserves the whole prompt.
                prompt.truncate(1);
                let g = &self.cfg.geometry;
                let total = u64::from(spec.prompt_tokens) + u64::from(spec.max_new_tokens);
                Need {
                    prefill_pages: 1,
                    decode_pages: u32::try_from(g.pages_for_tokens(total)).unwrap_or(u32::MAX),
                }
            }
            Err(reason) => {
                // Terminal: answered here, before any worker hears of the request.
                self.counters.rejected += 1;
                let by = match reason {
                    admission::Rejection::BadRequest { .. } => 0,
                    admission::Rejection::PromptExceedsContext { .. } => 1,
                    admission::Rejection::MaxNewExceedsLimit { .. } => 2,
                    admission::Rejection::ExceedsCapacity { .. }
                    | admission::Rejection::PoolFull { .. } => 3,
                };
                self.counters.rejected_by_reason[by] += 1;
                debug!("{id} of tenant {} rejected: {reason}", spec.tenant);
                self.error(conn, id, ErrorCode::Rejected, reason.to_string());
                return;
            }
        };
        let wait = self.cfg.deadlines.admission_wait;
        let asked = Duration::from_millis(u64::from(s.deadline_ms));
        let total = if s.deadline_ms == 0 {
            self.cfg.deadlines.request
        } else {
            asked.min(self.cfg.deadlines.request)
        };
        self.requests.insert(
            id,
            Request {
                client: conn,
                spec,
                prompt,
                sampling,
                need,
                stage: Stage::Queued,
                pair: None,
                told_prefill: false,
                told_decode: false,
                stage_deadline: now + wait,
                stage_budget: wait,
                stage_started: now,
                deadline: now + total,
                total,
                arrived: now,
                first_token_sent: false,
            },
        );
        // Admitted at once when nobody waits ahead and a pair has room now.
        if self.queue.is_empty() && self.admit(id, now) {
            return;
        }
        if self.queue.len() >= self.cfg.admission_queue {
            self.requests.remove(&id);
            self.counters.refused_full += 1;
            let msg = if self.cfg.admission_queue == 0 {
                "no pool has room now, and admission_queue = 0 does not queue".to_owned()
            } else {
                format!("admission queue is full ({} waiting)", self.queue.len())
            };
            self.error(conn, id, ErrorCode::PoolFull, msg);
            return;
        }
        self.counters.queued += 1;
        self.queue.push_back(id);
    }

    /// Admits queued requests in order while a pair has room for the one at the head.
    fn try_admit(&mut self, now: Instant) {
        while let Some(&id) = self.queue.front() {
            match self.requests.get(&id) {
                None => {
                    self.queue.pop_front();
                    continue;
                }
                // Past its own deadline: the tick ends it; it is not let in to be aborted.
                Some(r) if now >= r.deadline => return,
                Some(_) => {}
            }
            if !self.admit(id, now) {
                return;
            }
            self.queue.pop_front();
        }
    }

    /// Pairs request `id` and sends its `DecodeReserve`, or returns false (nothing taken).
    fn admit(&mut self, id: RequestId, now: Instant) -> bool {
        let Some(need) = self.requests.get(&id).map(|r| r.need) else {
            return false;
        };
        let Some((p, d)) = self.workers.pair(need.prefill_pages, need.decode_pages) else {
            return false;
        };
        self.counters.admitted += 1;
        self.counters.bootstraps += 1;
        self.held.insert(
            id,
            Held {
                prefill: Some((p, need.prefill_pages)),
                decode: Some((d, need.decode_pages)),
            },
        );
        let Some(dconn) = self.workers.get(d).map(|w| w.conn) else {
            return true;
        };
        let owner = self.owner(id);
        let Some(r) = self.requests.get_mut(&id) else {
            return true;
        };
        r.pair = Some((p, d));
        r.told_decode = true;
        let msg = DecodeReserve {
            owner,
            prompt_tokens: r.spec.prompt_tokens,
            max_new_tokens: r.spec.max_new_tokens,
        };
        self.enter(id, Stage::Reserving, self.cfg.deadlines.bootstrap, now);
        self.send(dconn, id, msg);
        true
    }

    /// Removes a request that ended; its workers have one request fewer in flight.
    fn end(&mut self, id: RequestId) -> Option<Request> {
        let r = self.requests.remove(&id)?;
        if let Some((p, d)) = r.pair {
            for k in [p, d] {
                if let Some(w) = self.workers.get_mut(k) {
                    w.in_flight = w.in_flight.saturating_sub(1);
                }
            }
        }
        Some(r)
    }

    fn after_end(&mut self, pair: Option<(WorkerKey, WorkerKey)>) {
        if let Some((p, d)) = pair {
            self.check_drained(p);
            self.check_drained(d);
        }
    }

    /// Ends a request with an error to its client and aborts it on the workers that were
    /// told of it. Ledger pages of a side never told return at once; the others return when
    /// that worker reports them freed (or is lost).
    fn fail(&mut self, id: RequestId, code: ErrorCode, message: String, now: Instant) {
        let Some(r) = self.end(id) else {
            return;
        };
        self.counters.failed += 1;
        if r.stage == Stage::Queued {
            self.queue.retain(|q| *q != id);
        }
        debug!("{id} failed in {}: {message}", r.stage.name());
        if let Some((p, d)) = r.pair {
            let abort = Abort {
                owner: self.owner(id),
                code,
                reason: cut_text(&message),
            };
            // While decode may still be copying prefill's pages (a pull in flight), prefill
            // must not free them: they would be reused under the copy. Its Abort waits for
            // decode's Freed (or for decode to be lost).
            let decode_reading = r.stage == Stage::Pulling
                && self.workers.get(d).is_some()
                && self.held.get(&id).is_some_and(|h| h.decode.is_some());
            for (side, key, told) in [
                (Side::Decode, d, r.told_decode),
                (Side::Prefill, p, r.told_prefill),
            ] {
                let alive = self.workers.get(key).is_some();
                if told && alive {
                    if side == Side::Prefill && decode_reading {
                        let deferred = Deferred {
                            prefill: p,
                            decode: d,
                            abort: abort.clone(),
                        };
                        self.deferred.insert(id, deferred);
                    } else {
                        self.send_abort_to(key, id, abort.clone());
                    }
                } else {
                    // Never told, or gone: nothing on that side holds pages for it.
                    self.give_back(id, side, key);
                }
            }
        }
        if self.held.get(&id).is_some_and(Held::is_empty) {
            self.held.remove(&id);
        }
        self.error(r.client, id, code, message);
        self.after_end(r.pair);
        self.try_admit(now);
    }

    /// Returns the ledger pages `id` holds on `side` to worker `key`, if it is still live.
    fn give_back(&mut self, id: RequestId, side: Side, key: WorkerKey) {
        let Some(h) = self.held.get_mut(&id) else {
            return;
        };
        if let Some((k, pages)) = h.slot(side).take()
            && k == key
            && let Some(w) = self.workers.get_mut(key)
        {
            w.free = w.free.saturating_add(pages).min(w.pool_pages);
        }
    }

    // ---- time --------------------------------------------------------------------------

    /// The earliest deadline of any request.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.requests
            .values()
            .map(|r| r.stage_deadline.min(r.deadline))
            .min()
    }

    /// Ends what passed its deadline by `now`.
    pub fn tick(&mut self, now: Instant) {
        // Whether each queued one waited for a decode slot is read now, before any of them
        // ends: requests that ended at this tick free slots they did not wait for.
        let due: Vec<(RequestId, bool)> = self
            .requests
            .iter()
            .filter(|(_, r)| now >= r.stage_deadline || now >= r.deadline)
            .map(|(id, r)| {
                let n = r.need;
                let for_slot = r.stage == Stage::Queued
                    && self.workers.waits_for_slot(n.prefill_pages, n.decode_pages);
                (*id, for_slot)
            })
            .collect();
        for (id, for_slot) in due {
            // An earlier one's end may have let this one in (its slot, its pages) just as
            // its admission wait ran out: it is in the next stage now, with a deadline of
            // its own ahead. (A request past its own deadline is never let in.)
            let Some((stage, budget, whole)) = self
                .requests
                .get(&id)
                .filter(|r| now >= r.stage_deadline || now >= r.deadline)
                .map(|r| (r.stage, r.stage_budget, now >= r.deadline))
            else {
                continue;
            };
            self.counters.timeouts += 1;
            let ms = budget.as_millis();
            // Queued while a pair had the pages: the request waited for a decode slot.
            let for_slot = for_slot && stage == Stage::Queued;
            if for_slot {
                self.counters.slot_timeouts += 1;
            }
            let (code, msg) = match (stage, whole) {
                (_, true) => (
                    ErrorCode::Timeout,
                    format!(
                        "request deadline of {} ms exceeded in {}{} (the client's deadline, at \
                         most deadlines.request)",
                        self.requests.get(&id).map_or(0, |r| r.total.as_millis()),
                        stage.name(),
                        if for_slot {
                            ", waiting for a decode slot: every decode worker with room for \
                             its pages was decoding its max_batch requests"
                        } else {
                            ""
                        }
                    ),
                ),
                (Stage::Queued, false) if !self.workers.can_serve_later() => (
                    ErrorCode::WorkerLost,
                    format!(
                        "no undrained prefill and decode workers registered within {ms} ms \
                         (deadlines.admission_wait)"
                    ),
                ),
                (Stage::Queued, false) if for_slot => (
                    ErrorCode::PoolFull,
                    format!(
                        "no decode slot within {ms} ms (deadlines.admission_wait): every \
                         decode worker with room for its pages was decoding its max_batch \
                         requests"
                    ),
                ),
                (Stage::Queued, false) => (
                    ErrorCode::PoolFull,
                    format!("no pool capacity within {ms} ms (deadlines.admission_wait)"),
                ),
                (s, false) => (
                    ErrorCode::Timeout,
                    format!(
                        "{} exceeded its deadline of {ms} ms ({})",
                        s.name(),
                        s.deadline_key()
                    ),
                ),
            };
            self.fail(id, code, msg, now);
        }
    }

    /// Stop admitting: queued requests fail, requests in flight may finish.
    pub fn start_shutdown(&mut self, now: Instant) {
        if self.stopping_since.is_some() {
            return;
        }
        info!(
            "draining: no new requests, {} in flight",
            self.requests.len()
        );
        self.stopping_since = Some(now);
        let queued: Vec<RequestId> = self.queue.drain(..).collect();
        for id in queued {
            self.fail(
                id,
                ErrorCode::ShuttingDown,
                "kvctld is stopping".into(),
                now,
            );
        }
    }

    /// Whether kvctld may exit now: stopping and every request ended, or the drain deadline
    /// passed (then what is left fails).
    pub fn shutdown_due(&mut self, now: Instant) -> bool {
        let Some(since) = self.stopping_since else {
            return false;
        };
        if !self.requests.is_empty()
            && now.saturating_duration_since(since) < self.cfg.deadlines.drain
        {
            return false;
        }
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in ids {
            self.fail(
                id,
                ErrorCode::ShuttingDown,
                "kvctld is stopping".into(),
                now,
            );
        }
        true
    }

    /// This kvctld may no longer lead (its lease window closed): admit nothing more and
    /// end every request now, queued or in flight, with `message` (the client retries with
    /// the next leader). The workers free the pages under their own rules, as after any
    /// abort or lost connection.
    pub fn abandon(&mut self, now: Instant, message: &str) {
        self.stopping_since.get_or_insert(now);
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in ids {
            self.fail(id, ErrorCode::ShuttingDown, message.to_owned(), now);
        }
    }

    pub fn is_stopping(&self) -> bool {
        self.stopping_since.is_some()
    }

    // ---- status ------------------------------------------------------------------------

    fn worker_status(&self, key: WorkerKey) -> Option<WorkerStatus> {
        let w = self.workers.get(key)?;
        Some(status_of(w, self.cfg.geometry.tokens_per_page))
    }

    /// kvctld's status: every worker (lost ones as not connected, with the one counter
    /// [`proto::FAILED_WHEN_LOST`]), counters, limits.
    pub fn status(&self, extra: &[(String, u64)]) -> StatusReply {
        let tpp = self.cfg.geometry.tokens_per_page;
        let mut workers = Vec::new();
        for side in [Side::Prefill, Side::Decode] {
            let mut live: Vec<&Worker> = self.workers.iter(side).map(|(_, w)| w).collect();
            live.sort_by(|a, b| a.id.cmp(&b.id));
            workers.extend(live.into_iter().map(|w| status_of(w, tpp)));
        }
        for (id, lost) in self.workers.lost_all() {
            workers.push(WorkerStatus {
                id: id.clone(),
                role: role_of(lost.side),
                connected: false,
                drain: lost.drain,
                in_flight: 0,
                held_pages: 0,
                transports: Vec::new(),
                served: 0,
                counters: vec![(proto::FAILED_WHEN_LOST.into(), lost.failed)],
                pool_pages: 0,
                tokens_per_page: tpp,
                free: 0,
                reserved: 0,
                writing: 0,
                readable: 0,
                draining: 0,
                max_batch: 0,
            });
        }
        workers.truncate(proto::MAX_WORKERS);
        let mut counters = self.counters.list();
        counters.push(("in_flight".into(), self.requests.len() as u64));
        counters.push(("queue_len".into(), self.queue.len() as u64));
        let (slots, used) = self.workers.decode_slots();
        counters.push(("decode_slots".into(), slots));
        counters.push(("decode_slots_used".into(), used));
        for (name, q) in [
            ("bootstrap_rtt_p50_us", 0.5),
            ("bootstrap_rtt_p99_us", 0.99),
        ] {
            if let Some(v) = self.bootstrap_rtt.quantile(q) {
                counters.push((name.into(), v));
            }
        }
        counters.extend(self.latencies.counters());
        counters.extend(extra.iter().cloned());
        counters.truncate(proto::MAX_COUNTERS);
        StatusReply {
            generation: self.generation,
            max_context: self.cfg.limits.max_context,
            max_new_tokens: self.cfg.limits.max_new_tokens,
            workers,
            counters,
            transport: self.transport(),
            model: self.workers.iter_all().next().map(|(_, w)| w.model.clone()),
        }
    }

    /// How pages move: shared memory if any prefill pool is shared, RDMA if every pair
    /// reads with it, TCP otherwise; `None` until a worker of each role is registered.
    fn transport(&self) -> Option<Transport> {
        let prefill: Vec<&Worker> = self.workers.iter(Side::Prefill).map(|(_, w)| w).collect();
        let decode: Vec<&Worker> = self.workers.iter(Side::Decode).map(|(_, w)| w).collect();
        if prefill.is_empty() || decode.is_empty() {
            return None;
        }
        if prefill.iter().any(|p| p.endpoint.is_none()) {
            return Some(Transport::Shm);
        }
        let all_rdma = prefill
            .iter()
            .all(|p| decode.iter().all(|d| p.rdma_with(d)));
        Some(if all_rdma {
            Transport::Rdma
        } else {
            Transport::Tcp
        })
    }
}

/// The index of a transport in the per-transport counters.
const fn transport_slot(t: Transport) -> usize {
    match t {
        Transport::Shm => 0,
        Transport::Tcp => 1,
        Transport::Rdma => 2,
    }
}

/// `s` cut to at most [`proto::MAX_TEXT_BYTES`] on a character boundary.
fn cut_text(s: &str) -> String {
    let mut end = s.len().min(proto::MAX_TEXT_BYTES);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// A page geometry as an operator compares two: every dimension and the page size.
fn describe(g: &PageGeometry) -> String {
    format!(
        "{} tokens/page x {} layers x {} kv heads x head dim {} of {:?} ({} bytes/page)",
        g.tokens_per_page,
        g.layers,
        g.kv_heads,
        g.head_dim,
        g.dtype,
        g.bytes_per_page()
    )
}

fn role_of(side: Side) -> Role {
    match side {
        Side::Prefill => Role::Prefill,
        Side::Decode => Role::Decode,
    }
}

fn status_of(w: &Worker, tokens_per_page: u32) -> WorkerStatus {
    let r = w.report.as_ref();
    let mut counters = r.map(|r| r.counters.clone()).unwrap_or_default();
    counters.truncate(proto::MAX_COUNTERS);
    WorkerStatus {
        id: w.id.clone(),
        role: role_of(w.side),
        connected: true,
        drain: w.drain,
        in_flight: w.in_flight,
        held_pages: w.held_pages(),
        transports: w.transports.clone(),
        served: w.served,
        counters,
        pool_pages: w.pool_pages,
        tokens_per_page,
        free: r.map_or(0, |r| r.free),
        reserved: r.map_or(0, |r| r.reserved),
        writing: r.map_or(0, |r| r.writing),
        readable: r.map_or(0, |r| r.readable),
        draining: r.map_or(0, |r| r.draining),
        max_batch: w.max_batch,
    }
}

/// Internal consistency, for tests: every worker's ledger equals its pool minus the pages
/// its live and ended requests still hold, and no request holds pages of a lost worker.
#[doc(hidden)]
impl Core {
    pub fn check_ledgers(&self) -> Result<(), String> {
        let mut lent: HashMap<WorkerKey, u64> = HashMap::new();
        for h in self.held.values() {
            for (k, n) in [h.prefill, h.decode].into_iter().flatten() {
                if self.workers.get(k).is_none() {
                    return Err(format!("pages held on a lost worker {k:?}"));
                }
                *lent.entry(k).or_default() += u64::from(n);
            }
        }
        for side in [Side::Prefill, Side::Decode] {
            for (k, w) in self.workers.iter(side) {
                let l = lent.get(&k).copied().unwrap_or(0);
                if u64::from(w.free) + l != u64::from(w.pool_pages) {
                    return Err(format!(
                        "worker {}: {} free + {l} lent != pool of {}",
                        w.id, w.free, w.pool_pages
                    ));
                }
                let in_flight = self
                    .requests
                    .values()
                    .filter(|r| r.pair.is_some_and(|(p, d)| p == k || d == k))
                    .count();
                if in_flight != w.in_flight as usize {
                    return Err(format!(
                        "worker {}: in_flight {} but {in_flight} requests",
                        w.id, w.in_flight
                    ));
                }
                if side == Side::Decode && w.in_flight > w.max_batch {
                    return Err(format!(
                        "decode worker {}: {} requests in flight, {} batch slots",
                        w.id, w.in_flight, w.max_batch
                    ));
                }
            }
        }
        Ok(())
    }

    /// Live requests paired with the worker registered under `id`, for tests.
    pub fn requests_paired_with(&self, id: &str) -> usize {
        let Some(key) = self.workers.by_id(id) else {
            return 0;
        };
        self.requests
            .values()
            .filter(|r| r.pair.is_some_and(|(p, d)| p == key || d == key))
            .count()
    }

    /// Deadlines of every live request, for tests.
    pub fn deadlines(&self) -> Vec<(RequestId, Instant)> {
        self.requests
            .iter()
            .map(|(id, r)| (*id, r.deadline))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libkv::Dtype;
    use libkv::proto::{DecodeReserved, Transport};

    const TPP: u32 = 16;

    fn geometry() -> PageGeometry {
        PageGeometry {
            tokens_per_page: TPP,
            layers: 2,
            kv_heads: 2,
            head_dim: 8,
            dtype: Dtype::F16,
        }
    }

    /// max_context 64 tokens (4 pages), max_new 32: decode needs 6 pages per worker.
    fn config(queue: usize) -> CoreConfig {
        CoreConfig {
            geometry: geometry(),
            limits: Limits {
                geometry: geometry(),
                max_context: 64,
                max_new_tokens: 32,
                prefill_pages: 4,
                decode_pages: 6,
            },
            deadlines: DeadlineDurations {
                admission_wait: Duration::from_millis(100),
                bootstrap: Duration::from_millis(100),
                prefill: Duration::from_millis(100),
                transfer: Duration::from_millis(100),
                decode: Duration::from_millis(100),
                request: Duration::from_millis(1000),
                drain: Duration::from_millis(100),
            },
            admission_queue: queue,
            pairing: Pairing::MostFree,
            seed: 1,
            placeholder_fault: false,
            model_kind: libkv::config::ModelKind::Reference,
        }
    }

    const CLIENT: ConnId = 1;

    /// The batch slots of a decode worker the tests register: more than any test runs at
    /// once, except those of slots, which register their own.
    const SLOTS: u32 = 64;

    fn slots(role: Role) -> u32 {
        if role == Role::Decode { SLOTS } else { 0 }
    }

    fn register(
        core: &mut Core,
        conn: ConnId,
        id: &str,
        role: Role,
        pages: u32,
    ) -> Result<WorkerKey, Refusal> {
        register_slots(core, conn, id, role, pages, slots(role))
    }

    fn register_slots(
        core: &mut Core,
        conn: ConnId,
        id: &str,
        role: Role,
        pages: u32,
        max_batch: u32,
    ) -> Result<WorkerKey, Refusal> {
        let r = RegisterWorker {
            id: id.into(),
            role,
            geometry: geometry(),
            pool_pages: pages,
            transports: vec![Transport::Shm, Transport::Tcp],
            endpoint: None,
            model: "reference".into(),
            max_batch,
        };
        core.register(conn, r, true, Instant::now())
    }

    fn submit(core: &mut Core, prompt: usize, max_new: u32) {
        let s = Submit {
            tenant: "t".into(),
            prompt: vec![u32::from(b'a'); prompt],
            max_new_tokens: max_new,
            deadline_ms: 0,
            sampling: libkv::proto::Sampling::GREEDY,
        };
        core.submit(CLIENT, s, Instant::now());
    }

    fn sent_to(actions: &[Action], conn: ConnId) -> Vec<&Message> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Send { conn: c, msg, .. } if *c == conn => Some(msg),
                _ => None,
            })
            .collect()
    }

    fn client_error(actions: &[Action]) -> Option<proto::Error> {
        sent_to(actions, CLIENT).into_iter().find_map(|m| match m {
            Message::Error(e) => Some(e.clone()),
            _ => None,
        })
    }

    #[test]
    fn stage_names_are_for_humans() {
        assert_eq!(Stage::Pulling.name(), "transfer");
        assert_eq!(Stage::Queued.name(), "admission");
        assert_eq!(Stage::Reserving.deadline_key(), "deadlines.bootstrap");
        assert_eq!(Stage::Prefilling.deadline_key(), "deadlines.prefill");
        // Every key a stage names is one the config file has.
        let keys: Vec<String> = toml::Table::try_from(libkv::config::Deadlines::default())
            .unwrap()
            .keys()
            .map(|k| format!("deadlines.{k}"))
            .collect();
        for stage in [
            Stage::Queued,
            Stage::Reserving,
            Stage::Prefilling,
            Stage::Pulling,
            Stage::Decoding,
        ] {
            assert!(
                keys.iter().any(|k| k == stage.deadline_key()),
                "{:?} names {}, not one of {keys:?}",
                stage,
                stage.deadline_key()
            );
        }
    }

    #[test]
    fn a_pool_one_page_too_small_is_refused_with_both_numbers() {
        let mut core = Core::new(config(8), Generation(1));
        let err = register(&mut core, 10, "d0", Role::Decode, 5).unwrap_err();
        let Refusal::Misconfigured(msg) = err else {
            panic!("expected Misconfigured, got {err:?}");
        };
        assert!(
            msg.contains("5 pages") && msg.contains("needs 6 pages"),
            "{msg}"
        );
        assert!(msg.contains("max_context 64 + max_new_tokens 32"), "{msg}");
        let refused = core.take_actions();
        assert!(matches!(&refused[..], [Action::Refuse { conn: 10, error }]
            if error.code == ErrorCode::Misconfigured));
        // One page more is enough; the prefill side needs max_context alone.
        assert!(register(&mut core, 11, "d0", Role::Decode, 6).is_ok());
        assert!(register(&mut core, 12, "p0", Role::Prefill, 3).is_err());
        assert!(register(&mut core, 13, "p0", Role::Prefill, 4).is_ok());
    }

    fn register_model(
        core: &mut Core,
        conn: ConnId,
        id: &str,
        role: Role,
        model: &str,
    ) -> Result<WorkerKey, Refusal> {
        let r = RegisterWorker {
            id: id.into(),
            role,
            geometry: geometry(),
            pool_pages: 100,
            transports: vec![Transport::Shm, Transport::Tcp],
            endpoint: None,
            model: model.into(),
            max_batch: slots(role),
        };
        core.register(conn, r, true, Instant::now())
    }

    #[test]
    fn workers_of_different_models_are_never_paired() {
        let mut cfg = config(8);
        cfg.model_kind = ModelKind::Gguf;
        let mut core = Core::new(cfg, Generation(1));
        // kvctld's [model] asks for a GGUF model: a reference-model worker is refused.
        let Err(Refusal::Misconfigured(msg)) =
            register_model(&mut core, 10, "p0", Role::Prefill, REFERENCE_MODEL)
        else {
            panic!("a reference worker registered with a GGUF control plane");
        };
        assert!(msg.contains("a GGUF model") && msg.contains("p0"), "{msg}");
        // The first GGUF worker sets the model; another file is refused, naming both.
        assert!(
            register_model(&mut core, 11, "p0", Role::Prefill, "smol:98362432:0a0b0c0d").is_ok()
        );
        let Err(Refusal::Misconfigured(msg)) =
            register_model(&mut core, 12, "d0", Role::Decode, "smol:98362432:ffffffff")
        else {
            panic!("a decode worker of another model registered");
        };
        assert!(
            msg.contains("smol:98362432:ffffffff") && msg.contains("smol:98362432:0a0b0c0d"),
            "{msg}"
        );
        assert!(
            register_model(&mut core, 13, "d0", Role::Decode, "smol:98362432:0a0b0c0d").is_ok()
        );
        assert_eq!(
            core.status(&[]).model.as_deref(),
            Some("smol:98362432:0a0b0c0d")
        );
        // And a reference control plane refuses a GGUF worker.
        let mut core = Core::new(config(8), Generation(1));
        assert!(register_model(&mut core, 10, "p0", Role::Prefill, "smol:1:2").is_err());
        assert!(register_model(&mut core, 11, "p0", Role::Prefill, REFERENCE_MODEL).is_ok());
    }

    #[test]
    fn an_engine_control_plane_registers_only_workers_inside_an_engine() {
        let mut cfg = config(8);
        cfg.model_kind = ModelKind::Engine;
        let mut core = Core::new(cfg, Generation(1));
        for model in [REFERENCE_MODEL, "smol:98362432:0a0b0c0d"] {
            let Err(Refusal::Misconfigured(msg)) =
                register_model(&mut core, 10, "p0", Role::Prefill, model)
            else {
                panic!("{model} registered with an engine control plane");
            };
            assert!(msg.contains("an engine's model"), "{msg}");
        }
        assert!(register_model(&mut core, 11, "p0", Role::Prefill, "engine:vllm:smol").is_ok());
        assert!(register_model(&mut core, 12, "d0", Role::Decode, "engine:vllm:other").is_err());
        assert!(register_model(&mut core, 13, "d0", Role::Decode, "engine:vllm:smol").is_ok());
        // A GGUF control plane refuses an engine's worker.
        let mut cfg = config(8);
        cfg.model_kind = ModelKind::Gguf;
        let mut core = Core::new(cfg, Generation(1));
        assert!(register_model(&mut core, 10, "p0", Role::Prefill, "engine:vllm:smol").is_err());
    }

    #[test]
    fn another_geometry_is_refused_naming_both() {
        let mut core = Core::new(config(8), Generation(1));
        let r = RegisterWorker {
            id: "p0".into(),
            role: Role::Prefill,
            geometry: PageGeometry {
                head_dim: 16,
                ..geometry()
            },
            pool_pages: 100,
            transports: vec![Transport::Shm],
            endpoint: None,
            model: "reference".into(),
            max_batch: 0,
        };
        let Err(Refusal::Misconfigured(msg)) = core.register(10, r, true, Instant::now()) else {
            panic!("a different geometry was accepted");
        };
        assert!(
            msg.contains("head dim 16") && msg.contains("head dim 8"),
            "{msg}"
        );
    }

    #[test]
    fn a_live_id_is_not_taken_but_a_lost_one_is_replaced() {
        let mut core = Core::new(config(8), Generation(1));
        register(&mut core, 10, "p0", Role::Prefill, 8).unwrap();
        let err = register(&mut core, 11, "p0", Role::Prefill, 8).unwrap_err();
        assert!(matches!(err, Refusal::NotNow(_)), "{err:?}");
        core.conn_closed(10, Instant::now());
        assert!(core.workers().lost("p0").is_some());
        register(&mut core, 11, "p0", Role::Prefill, 8).unwrap();
        assert!(core.workers().lost("p0").is_none());
        assert_eq!(core.workers().count(Side::Prefill), 1);
    }

    #[test]
    fn a_rejected_request_reaches_no_worker() {
        let mut core = Core::new(config(8), Generation(1));
        register(&mut core, 10, "p0", Role::Prefill, 8).unwrap();
        register(&mut core, 11, "d0", Role::Decode, 8).unwrap();
        core.take_actions();
        submit(&mut core, 65, 1); // one token over max_context
        let actions = core.take_actions();
        assert_eq!(actions.len(), 1, "{actions:?}");
        assert_eq!(
            client_error(&actions).map(|e| e.code),
            Some(ErrorCode::Rejected)
        );
        assert_eq!(core.in_flight(), 0);
        core.check_ledgers().unwrap();
    }

    #[test]
    fn admission_queue_zero_serves_what_fits_and_refuses_what_must_wait() {
        let mut core = Core::new(config(0), Generation(1));
        register(&mut core, 10, "p0", Role::Prefill, 8).unwrap();
        register(&mut core, 11, "d0", Role::Decode, 6).unwrap();
        core.take_actions();
        submit(&mut core, 64, 32); // needs the whole decode pool
        let first = core.take_actions();
        assert!(matches!(
            sent_to(&first, 11)[..],
            [Message::DecodeReserve(_)]
        ));
        submit(&mut core, 1, 1); // fits the limits, but must wait for pages
        let second = core.take_actions();
        let e = client_error(&second).expect("refused at once");
        assert_eq!(e.code, ErrorCode::PoolFull);
        assert!(e.message.contains("admission_queue = 0"), "{}", e.message);
        assert_eq!(core.in_flight(), 1);
    }

    #[test]
    fn most_free_spreads_requests_over_every_pair() {
        let mut core = Core::new(config(64), Generation(1));
        for i in 0..3 {
            register(&mut core, 10 + i, &format!("p{i}"), Role::Prefill, 40).unwrap();
            register(&mut core, 20 + i, &format!("d{i}"), Role::Decode, 60).unwrap();
        }
        core.take_actions();
        for _ in 0..6 {
            submit(&mut core, 16, 16);
        }
        let actions = core.take_actions();
        for d in 20..23 {
            assert_eq!(sent_to(&actions, d).len(), 2, "decode {d}: {actions:?}");
        }
        core.check_ledgers().unwrap();
    }

    #[test]
    fn a_drained_worker_gets_no_new_request_and_says_when_idle() {
        let mut core = Core::new(config(64), Generation(1));
        register(&mut core, 10, "p0", Role::Prefill, 40).unwrap();
        register(&mut core, 20, "d0", Role::Decode, 60).unwrap();
        register(&mut core, 21, "d1", Role::Decode, 60).unwrap();
        core.take_actions();
        submit(&mut core, 16, 16);
        let first = core.take_actions();
        let (on, other) = if sent_to(&first, 20).is_empty() {
            (21, 20)
        } else {
            (20, 21)
        };
        let id = first
            .iter()
            .find_map(|a| match a {
                Action::Send { conn, id, .. } if *conn == on => Some(*id),
                _ => None,
            })
            .unwrap();
        // The busy decode worker drains itself (SIGTERM): no DrainReply while busy.
        let name = if on == 20 { "d0" } else { "d1" };
        let drain = Drain {
            worker: name.into(),
            drain: true,
        };
        core.worker_frame(on, RequestId(0), drain.into(), Instant::now());
        assert!(core.take_actions().is_empty());
        submit(&mut core, 16, 16);
        let second = core.take_actions();
        assert!(
            sent_to(&second, on).is_empty(),
            "drained worker picked: {second:?}"
        );
        assert_eq!(sent_to(&second, other).len(), 1);
        // Its request fails; once its pages are freed it is idle and told so.
        let owner = Owner {
            request: id,
            generation: Generation(1),
        };
        let err = proto::Error {
            code: ErrorCode::VerifyFailed,
            message: "bad digest".into(),
        };
        core.worker_frame(on, id, err.into(), Instant::now());
        assert!(
            !sent_to(&core.take_actions(), on)
                .iter()
                .any(|m| matches!(m, Message::DrainReply(_)))
        );
        let freed = Freed { owner, pages: 2 };
        core.worker_frame(on, id, freed.into(), Instant::now());
        let last = core.take_actions();
        assert!(
            sent_to(&last, on)
                .iter()
                .any(|m| matches!(m, Message::DrainReply(r) if r.worker.idle())),
            "{last:?}"
        );
        core.check_ledgers().unwrap();
    }

    /// Counter `name` of kvctld's status.
    fn status_counter(core: &Core, name: &str) -> Option<u64> {
        let s = core.status(&[]);
        s.counters.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }

    #[test]
    fn a_decode_worker_takes_no_more_requests_than_its_slots() {
        let mut cfg = config(64);
        let long = Duration::from_secs(10);
        cfg.deadlines.bootstrap = long;
        cfg.deadlines.prefill = long;
        cfg.deadlines.transfer = long;
        cfg.deadlines.decode = long;
        cfg.deadlines.request = 2 * long;
        let mut core = Core::new(cfg, Generation(1));
        register(&mut core, 10, "p0", Role::Prefill, 40).unwrap();
        register_slots(&mut core, 20, "d0", Role::Decode, 60, 2).unwrap();
        core.take_actions();
        for _ in 0..3 {
            submit(&mut core, 16, 16);
        }
        // Pages for all three, slots for two: the third waits.
        let actions = core.take_actions();
        let reserves: Vec<Owner> = sent_to(&actions, 20)
            .into_iter()
            .filter_map(|m| match m {
                Message::DecodeReserve(r) => Some(r.owner),
                _ => None,
            })
            .collect();
        assert_eq!(reserves.len(), 2, "{actions:?}");
        assert_eq!(core.queue_len(), 1);
        assert_eq!(status_counter(&core, "decode_slots"), Some(2));
        assert_eq!(status_counter(&core, "decode_slots_used"), Some(2));
        let d0 = core.status(&[]).workers.into_iter().find(|w| w.id == "d0");
        assert_eq!(d0.map(|w| (w.max_batch, w.in_flight)), Some((2, 2)));
        core.check_ledgers().unwrap();

        // The first one runs to its end: its slot lets the third in, before any Freed.
        let a = reserves[0];
        let now = Instant::now();
        let reserved = DecodeReserved { owner: a, pages: 2 };
        core.worker_frame(20, a.request, reserved.into(), now);
        let manifest = libkv::verify::Manifest {
            owner: a,
            tokens: 16,
            pages: vec![libkv::PageId(0)],
            digests: vec![0],
        };
        core.worker_frame(10, a.request, PrefillDone { manifest }.into(), now);
        core.worker_frame(20, a.request, proto::PullDone { owner: a }.into(), now);
        core.take_actions();
        let done = Done {
            tokens: 16,
            signature: 1,
            pages_transferred: 1,
            bytes_transferred: 1,
            elapsed_us: 1,
            prefill_worker: String::new(),
            decode_worker: String::new(),
        };
        core.worker_frame(20, a.request, done.into(), now);
        let after = core.take_actions();
        assert!(
            sent_to(&after, CLIENT)
                .iter()
                .any(|m| matches!(m, Message::Done(_)))
        );
        assert!(
            sent_to(&after, 20)
                .iter()
                .any(|m| matches!(m, Message::DecodeReserve(_))),
            "the waiting request was not admitted on the freed slot: {after:?}"
        );
        assert_eq!(core.queue_len(), 0);
        assert_eq!(status_counter(&core, "decode_slots_used"), Some(2));

        // A fourth one finds both slots taken, pages free: past admission_wait it fails
        // saying it waited for a decode slot; the others go on.
        submit(&mut core, 16, 16);
        assert!(sent_to(&core.take_actions(), 20).is_empty());
        core.tick(Instant::now() + Duration::from_millis(150));
        let e = client_error(&core.take_actions()).expect("the fourth fails");
        assert_eq!(e.code, ErrorCode::PoolFull);
        assert_eq!(
            e.message,
            "no decode slot within 100 ms (deadlines.admission_wait): every decode worker with \
             room for its pages was decoding its max_batch requests"
        );
        assert_eq!(core.in_flight(), 2);
        assert_eq!(status_counter(&core, "slot_timeouts"), Some(1));
        core.check_ledgers().unwrap();
    }

    #[test]
    fn a_request_let_in_while_deadlines_are_handled_is_not_failed_for_its_old_stage() {
        let mut core = Core::new(config(64), Generation(1));
        register(&mut core, 10, "p0", Role::Prefill, 40).unwrap();
        register_slots(&mut core, 20, "d0", Role::Decode, 60, 1).unwrap();
        core.take_actions();
        submit(&mut core, 16, 16);
        submit(&mut core, 16, 16);
        core.take_actions();
        // At one tick the first passes its bootstrap deadline and the second its admission
        // wait: if the first ends first, its slot lets the second in, which then is not
        // failed for a wait it no longer has.
        core.tick(Instant::now() + Duration::from_millis(150));
        let actions = core.take_actions();
        let errors = sent_to(&actions, CLIENT)
            .into_iter()
            .filter(|m| matches!(m, Message::Error(_)))
            .count();
        let admitted = sent_to(&actions, 20)
            .iter()
            .any(|m| matches!(m, Message::DecodeReserve(_)));
        assert_eq!(
            errors + usize::from(admitted),
            2,
            "each ended or started: {actions:?}"
        );
        core.check_ledgers().unwrap();
    }

    #[test]
    fn requests_that_end_at_one_tick_say_what_each_waited_for() {
        let mut core = Core::new(config(64), Generation(1));
        register(&mut core, 10, "p0", Role::Prefill, 40).unwrap();
        register_slots(&mut core, 20, "d0", Role::Decode, 60, 1).unwrap();
        core.take_actions();
        for _ in 0..3 {
            submit(&mut core, 16, 16);
        }
        core.take_actions();
        // Past every request's deadline at once: the admitted one's end frees the slot, but
        // the queued ones waited for it all along, and say so.
        core.tick(Instant::now() + Duration::from_millis(1100));
        let actions = core.take_actions();
        let errors: Vec<&proto::Error> = sent_to(&actions, CLIENT)
            .into_iter()
            .filter_map(|m| match m {
                Message::Error(e) => Some(e),
                _ => None,
            })
            .collect();
        assert_eq!(errors.len(), 3, "{actions:?}");
        let waited = errors
            .iter()
            .filter(|e| {
                e.message
                    .contains("exceeded in admission, waiting for a decode slot")
            })
            .count();
        assert_eq!(waited, 2, "{errors:?}");
        assert_eq!(status_counter(&core, "slot_timeouts"), Some(2));
        core.check_ledgers().unwrap();
    }

    #[test]
    fn losing_a_worker_fails_only_its_requests() {
        let mut core = Core::new(config(64), Generation(1));
        register(&mut core, 10, "p0", Role::Prefill, 40).unwrap();
        register(&mut core, 20, "d0", Role::Decode, 60).unwrap();
        register(&mut core, 21, "d1", Role::Decode, 60).unwrap();
        core.take_actions();
        submit(&mut core, 16, 16);
        submit(&mut core, 16, 16);
        let actions = core.take_actions();
        assert_eq!(sent_to(&actions, 20).len(), 1);
        assert_eq!(sent_to(&actions, 21).len(), 1);
        let reserve = |a: &[Action], conn| match sent_to(a, conn)[..] {
            [Message::DecodeReserve(r)] => r.owner,
            _ => panic!("no DecodeReserve to {conn}"),
        };
        let (o0, o1) = (reserve(&actions, 20), reserve(&actions, 21));
        for (conn, owner) in [(20, o0), (21, o1)] {
            let r = DecodeReserved { owner, pages: 2 };
            core.worker_frame(conn, owner.request, r.into(), Instant::now());
        }
        core.take_actions();
        core.conn_closed(20, Instant::now());
        let after = core.take_actions();
        let e = client_error(&after).unwrap();
        assert_eq!(e.code, ErrorCode::WorkerLost);
        assert!(e.message.contains("d0"), "{}", e.message);
        // The prefill worker that ran the lost request's prefill is told to abort it.
        assert!(
            sent_to(&after, 10)
                .iter()
                .any(|m| matches!(m, Message::Abort(a) if a.owner == o0))
        );
        assert_eq!(core.in_flight(), 1);
        assert_eq!(core.requests_paired_with("d1"), 1);
        core.check_ledgers().unwrap();
    }
}
