//! Control messages: what kvctld, the workers and clients say to each other on the Unix
//! socket (registration, a request's stages, status, drain). The frame layout and the
//! sequence of a request are in the module docs of [`super`].

use super::MAX_WORKERS;
use super::{Check, MAX_BATCH, MAX_COUNTER_NAME_BYTES, MAX_COUNTERS, MAX_TOKENS_PER_FRAME};
use super::{MAX_TENANT_BYTES, PROTOCOL_VERSION, check_manifest, check_pool, check_prompt};
use crate::geometry::PageGeometry;
use crate::ids::{Generation, Owner};
use crate::verify::Manifest;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::fmt;

/// Role of a peer, declared in `Hello`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Role {
    /// kvctl or another client submitting requests.
    Client,
    /// prefilld: computes the KV of prompts into its pool.
    Prefill,
    /// decoded: pulls KV into its pool and generates tokens.
    Decode,
}

/// A way of moving pages between pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Transport {
    /// Shared memory: the decode worker maps the prefill pool's memfd.
    Shm,
    /// TCP between hosts.
    Tcp,
    /// RDMA between hosts.
    Rdma,
}

/// Why a request failed. On the wire it is its `u16` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "u16", into = "u16")]
#[repr(u16)]
pub enum ErrorCode {
    /// Admission refused the request.
    Rejected = 1,
    /// No pool has room for the request, or no decode worker a free batch slot, now or
    /// within `deadlines.admission_wait`; retrying later may succeed.
    PoolFull = 2,
    /// The request's deadline passed.
    Timeout = 3,
    /// A worker holding the request disconnected.
    WorkerLost = 4,
    /// Transferred pages failed the coverage or digest check.
    VerifyFailed = 5,
    /// The peer sent an invalid frame or request.
    BadRequest = 6,
    /// A bug or an unexpected system error.
    Internal = 7,
    /// The peer may not do this.
    Unauthorized = 8,
    /// kvctld is shutting down.
    ShuttingDown = 9,
    /// A worker's registration can never be accepted as configured (geometry, pool too
    /// small for the context): retrying cannot help, the worker exits.
    Misconfigured = 10,
}

/// A `u16` that names no [`ErrorCode`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown error code {0}")]
pub struct UnknownErrorCode(pub u16);

impl From<ErrorCode> for u16 {
    fn from(c: ErrorCode) -> u16 {
        c as u16
    }
}

impl TryFrom<u16> for ErrorCode {
    type Error = UnknownErrorCode;

    fn try_from(v: u16) -> Result<ErrorCode, UnknownErrorCode> {
        Ok(match v {
            1 => ErrorCode::Rejected,
            2 => ErrorCode::PoolFull,
            3 => ErrorCode::Timeout,
            4 => ErrorCode::WorkerLost,
            5 => ErrorCode::VerifyFailed,
            6 => ErrorCode::BadRequest,
            7 => ErrorCode::Internal,
            8 => ErrorCode::Unauthorized,
            9 => ErrorCode::ShuttingDown,
            10 => ErrorCode::Misconfigured,
            other => return Err(UnknownErrorCode(other)),
        })
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// First frame of every connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// What the peer is.
    pub role: Role,
    /// Oldest protocol version the peer speaks.
    pub min_version: u16,
    /// Newest protocol version the peer speaks.
    pub max_version: u16,
}

impl Hello {
    /// A hello for this build's version.
    pub fn new(role: Role) -> Hello {
        Hello {
            role,
            min_version: PROTOCOL_VERSION,
            max_version: PROTOCOL_VERSION,
        }
    }

    /// The version both ends speak, if any.
    pub fn negotiate(&self) -> Option<u16> {
        (self.min_version..=self.max_version)
            .contains(&PROTOCOL_VERSION)
            .then_some(PROTOCOL_VERSION)
    }

    pub(super) fn check(&self) -> Check {
        if self.min_version == 0 || self.min_version > self.max_version {
            return Err(format!(
                "version range {}..={} is empty or starts at 0",
                self.min_version, self.max_version
            ));
        }
        Ok(())
    }
}

/// Answer to `Hello`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloAck {
    /// Negotiated protocol version.
    pub version: u16,
    /// kvctld's generation; owners of other generations are stale.
    pub generation: Generation,
}

impl HelloAck {
    pub(super) fn check(&self) -> Check {
        if self.version == 0 {
            return Err("version 0".to_owned());
        }
        Ok(())
    }
}

/// A worker registers its pool. A prefill worker attaches the pool's sealed memfd.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterWorker {
    /// The worker's id, unique per kvctld ([`is_valid_worker_id`]): the systemd instance
    /// name or `[worker] id`. A registration under the id of a lost worker replaces it.
    pub id: String,
    /// `Prefill` or `Decode`.
    pub role: Role,
    /// Shape of the worker's pages.
    pub geometry: PageGeometry,
    /// Pages in the worker's pool.
    pub pool_pages: u32,
    /// Transports the worker can use, without repeats.
    pub transports: Vec<Transport>,
    /// A prefill worker's TCP page server; then it lists `Tcp` and attaches no fd.
    pub endpoint: Option<TcpEndpoint>,
    /// The model the worker runs ([`is_valid_model_id`]): kvctld pairs only workers that run
    /// the same one, since KV of one model is meaningless to another of the same geometry.
    pub model: String,
    /// A decode worker's batch slots: the most requests it decodes at once (`[decode]
    /// max_batch`), 1 to [`MAX_BATCH`]. kvctld assigns it no more requests at a time; the
    /// others wait in the admission queue. 0 from a prefill worker.
    pub max_batch: u32,
}

impl RegisterWorker {
    pub(super) fn check(&self) -> Check {
        if self.role == Role::Client {
            return Err("a worker's role must be Prefill or Decode, not Client".to_owned());
        }
        check_worker_id(&self.id)?;
        check_model_id(&self.model)?;
        check_pool(&self.geometry, self.pool_pages)?;
        match self.role {
            Role::Decode if !(1..=MAX_BATCH).contains(&self.max_batch) => {
                return Err(format!(
                    "a decode worker's max_batch is {}, expected 1 to {MAX_BATCH}",
                    self.max_batch
                ));
            }
            Role::Prefill if self.max_batch != 0 => {
                return Err(format!(
                    "a prefill worker's max_batch is {}, expected 0 (it decodes nothing)",
                    self.max_batch
                ));
            }
            _ => {}
        }
        if self.transports.is_empty() || self.transports.len() > 3 {
            return Err(format!(
                "{} transports, expected 1 to 3",
                self.transports.len()
            ));
        }
        let mut seen = HashSet::new();
        if let Some(dup) = self.transports.iter().find(|t| !seen.insert(**t)) {
            return Err(format!("transport {dup:?} listed twice"));
        }
        if let Some(endpoint) = &self.endpoint {
            if self.role != Role::Prefill || !self.transports.contains(&Transport::Tcp) {
                return Err("only a prefill worker listing Tcp may name a TCP endpoint".to_owned());
            }
            check_addr(&endpoint.addr)?;
        }
        Ok(())
    }
}

pub use crate::ids::{MAX_WORKER_ID_BYTES, is_valid_worker_id};

/// Longest model id of a [`RegisterWorker`].
pub const MAX_MODEL_ID_BYTES: usize = 128;

/// Whether `id` is 1 to [`MAX_MODEL_ID_BYTES`] printable ASCII bytes.
pub fn is_valid_model_id(id: &str) -> bool {
    (1..=MAX_MODEL_ID_BYTES).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic())
}

pub(super) fn check_model_id(id: &str) -> Check {
    if !is_valid_model_id(id) {
        return Err(format!(
            "model id of {} bytes: expected 1 to {MAX_MODEL_ID_BYTES} printable ASCII bytes",
            id.len()
        ));
    }
    Ok(())
}

pub(super) fn check_worker_id(id: &str) -> Check {
    if !is_valid_worker_id(id) {
        return Err(format!(
            "worker id of {} bytes: expected 1 to {MAX_WORKER_ID_BYTES} bytes of [A-Za-z0-9_.@:-]",
            id.len()
        ));
    }
    Ok(())
}

/// Longest `addr` of a [`TcpEndpoint`] ("[v6 address]:port" fits).
pub const MAX_ADDR_BYTES: usize = 64;
/// Bytes of the token a page server requires in every `PageRequest`.
pub const TOKEN_BYTES: usize = 16;

pub(super) fn check_addr(addr: &str) -> Check {
    if addr.len() > MAX_ADDR_BYTES {
        return Err(format!(
            "address of {} bytes exceeds {MAX_ADDR_BYTES}",
            addr.len()
        ));
    }
    match addr.parse::<std::net::SocketAddr>() {
        Ok(a) if !a.ip().is_unspecified() && !a.ip().is_multicast() && a.port() != 0 => Ok(()),
        _ => Err(format!(
            "address {addr:?} is not IP:PORT with a unicast IP and a non-zero port"
        )),
    }
}

/// Where a prefill worker serves its pages over TCP, and the token it requires. The token
/// travels only on the authenticated Unix socket (prefilld to kvctld to decoded), so a host
/// that can reach the port but is not part of the stack cannot pull pages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcpEndpoint {
    /// `IP:PORT` the page server listens on.
    pub addr: String,
    /// Random bytes drawn by prefilld at start.
    pub token: [u8; TOKEN_BYTES],
}

/// Answer to `RegisterWorker`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterAck {
    /// kvctld's generation.
    pub generation: Generation,
    /// Longest context (prompt plus new tokens) kvctld admits.
    pub max_context: u32,
    /// Most new tokens one request may ask for.
    pub max_new_tokens: u32,
}

impl RegisterAck {
    pub(super) fn check(&self) -> Check {
        if self.max_context == 0 || self.max_new_tokens == 0 {
            return Err(format!(
                "max_context {} and max_new_tokens {} must be non-zero",
                self.max_context, self.max_new_tokens
            ));
        }
        Ok(())
    }
}

/// A client asks for one request to run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Submit {
    /// Who pays: 1 to [`MAX_TENANT_BYTES`] bytes of `[A-Za-z0-9_.-]`.
    pub tenant: String,
    /// The prompt's token ids, 1 to [`MAX_PROMPT_TOKENS`](super::MAX_PROMPT_TOKENS) of them.
    pub prompt: Vec<u32>,
    /// Most tokens to generate, at least 1.
    pub max_new_tokens: u32,
    /// Milliseconds the client will wait; 0 for kvctld's default.
    pub deadline_ms: u32,
    /// How decode picks each new token.
    pub sampling: Sampling,
}

/// How decode picks each new token from the model's logits. Greedy (temperature 0) by
/// default; otherwise a draw from the softmax at `temperature`, cut to the smallest set of
/// tokens whose probability reaches `top_p`, from a generator seeded by `seed` and the step,
/// so one seed always gives the same output. Fixed point, so that frames compare exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Sampling {
    /// Temperature in thousandths: 0 is greedy, at most [`MAX_TEMPERATURE_MILLI`].
    pub temperature_milli: u32,
    /// Top-p in thousandths, 1 to 1000; 0 reads as 1000 (no cut).
    pub top_p_milli: u32,
    /// Seeds the draws.
    pub seed: u64,
}

/// Highest temperature a request may ask for (in thousandths): 2.0, as OpenAI's API.
pub const MAX_TEMPERATURE_MILLI: u32 = 2000;

impl Sampling {
    /// Greedy decoding: always the most likely token.
    pub const GREEDY: Sampling = Sampling {
        temperature_milli: 0,
        top_p_milli: 0,
        seed: 0,
    };

    /// Whether every step takes the most likely token.
    pub fn is_greedy(&self) -> bool {
        self.temperature_milli == 0
    }

    /// The temperature as a float.
    pub fn temperature(&self) -> f32 {
        self.temperature_milli as f32 / 1000.0
    }

    /// Top-p as a float in (0, 1].
    pub fn top_p(&self) -> f32 {
        if self.top_p_milli == 0 {
            1.0
        } else {
            self.top_p_milli as f32 / 1000.0
        }
    }

    pub(super) fn check(&self) -> Check {
        if self.temperature_milli > MAX_TEMPERATURE_MILLI {
            return Err(format!(
                "temperature {} exceeds {}",
                self.temperature(),
                MAX_TEMPERATURE_MILLI as f32 / 1000.0
            ));
        }
        if self.top_p_milli > 1000 {
            return Err(format!(
                "top_p {} exceeds 1",
                self.top_p_milli as f32 / 1000.0
            ));
        }
        Ok(())
    }
}

/// Whether `tenant` is 1 to [`MAX_TENANT_BYTES`] bytes of `[A-Za-z0-9_.-]`.
pub fn is_valid_tenant(tenant: &str) -> bool {
    (1..=MAX_TENANT_BYTES).contains(&tenant.len())
        && tenant
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

impl Submit {
    pub(super) fn check(&self) -> Check {
        if !is_valid_tenant(&self.tenant) {
            return Err(format!(
                "tenant of {} bytes: expected 1 to {MAX_TENANT_BYTES} bytes of [A-Za-z0-9_.-]",
                self.tenant.len()
            ));
        }
        check_prompt(&self.prompt)?;
        if self.max_new_tokens == 0 {
            return Err("max_new_tokens 0".to_owned());
        }
        self.sampling.check()
    }
}

/// Generated tokens, `first_index` being the index of `tokens[0]` among the new tokens.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tokens {
    /// Index of the first token of this frame among the request's new tokens.
    pub first_index: u32,
    /// Token ids, at most [`MAX_TOKENS_PER_FRAME`].
    pub tokens: Vec<u32>,
}

impl Tokens {
    pub(super) fn check(&self) -> Check {
        if self.tokens.len() > MAX_TOKENS_PER_FRAME {
            return Err(format!(
                "{} tokens exceed {MAX_TOKENS_PER_FRAME}",
                self.tokens.len()
            ));
        }
        let end = u64::from(self.first_index) + self.tokens.len() as u64;
        if end > u64::from(u32::MAX) {
            return Err(format!(
                "token indices {}..{end} overflow u32",
                self.first_index
            ));
        }
        Ok(())
    }
}

/// A request finished.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {
    /// New tokens generated.
    pub tokens: u32,
    /// Signature of the generated tokens, for end-to-end checks.
    pub signature: u64,
    /// KV pages moved from prefill to decode.
    pub pages_transferred: u32,
    /// KV bytes moved from prefill to decode.
    pub bytes_transferred: u64,
    /// Microseconds from admission to the last token.
    pub elapsed_us: u64,
    /// The prefill worker that served the request (filled in by kvctld; empty from decoded).
    pub prefill_worker: String,
    /// The decode worker that served the request (filled in by kvctld; empty from decoded).
    pub decode_worker: String,
}

/// A request failed, or a frame was refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Error {
    /// What failed.
    pub code: ErrorCode,
    /// Details for humans, at most [`MAX_TEXT_BYTES`].
    pub message: String,
}

/// Ask kvctld for its status.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusQuery {}

/// kvctld's status.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReply {
    /// kvctld's generation.
    pub generation: Generation,
    /// Longest context admitted.
    pub max_context: u32,
    /// Most new tokens per request.
    pub max_new_tokens: u32,
    /// Registered workers, at most [`MAX_WORKERS`].
    pub workers: Vec<WorkerStatus>,
    /// Named counters, at most [`MAX_COUNTERS`], names 1 to [`MAX_COUNTER_NAME_BYTES`].
    pub counters: Vec<(String, u64)>,
    /// How pages move from prefill to decode, once both workers are registered.
    pub transport: Option<Transport>,
    /// The model the registered workers run, once one has registered.
    pub model: Option<String>,
}

impl StatusReply {
    pub(super) fn check(&self) -> Check {
        if self.workers.len() > MAX_WORKERS {
            return Err(format!(
                "{} workers exceed {MAX_WORKERS}",
                self.workers.len()
            ));
        }
        for w in &self.workers {
            w.check()?;
        }
        check_counters(&self.counters)?;
        if let Some(model) = &self.model {
            check_model_id(model)?;
        }
        Ok(())
    }
}

pub(super) fn check_counters(counters: &[(String, u64)]) -> Result<(), String> {
    if counters.len() > MAX_COUNTERS {
        return Err(format!("{} counters exceed {MAX_COUNTERS}", counters.len()));
    }
    if let Some((name, _)) = counters
        .iter()
        .find(|(n, _)| n.is_empty() || n.len() > MAX_COUNTER_NAME_BYTES)
    {
        return Err(format!(
            "counter name of {} bytes, expected 1 to {MAX_COUNTER_NAME_BYTES}",
            name.len()
        ));
    }
    Ok(())
}

/// One worker in a `StatusReply`: its pool's pages by ownership state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerStatus {
    /// The worker's id.
    pub id: String,
    /// `Prefill` or `Decode`.
    pub role: Role,
    /// Whether the worker is connected now.
    pub connected: bool,
    /// Whether new requests are kept off it (`kvctl drain`, or the worker is stopping).
    pub drain: bool,
    /// Requests on it now.
    pub in_flight: u32,
    /// Ledger pages lent against its pool and not yet reported free.
    pub held_pages: u32,
    /// Transports it registered.
    pub transports: Vec<Transport>,
    /// Requests it took part in that completed, by kvctld's count.
    pub served: u64,
    /// The worker's own counters from its last `PoolReport`, at most [`MAX_COUNTERS`].
    pub counters: Vec<(String, u64)>,
    /// Pages in the pool.
    pub pool_pages: u32,
    /// Token positions per page.
    pub tokens_per_page: u32,
    /// Pages owned by no request.
    pub free: u32,
    /// Pages reserved for a request, not yet written.
    pub reserved: u32,
    /// Pages being written.
    pub writing: u32,
    /// Pages written and readable by their owner.
    pub readable: u32,
    /// Pages released, waiting for readers to finish.
    pub draining: u32,
    /// A decode worker's batch slots (its `RegisterWorker::max_batch`): kvctld assigns it at
    /// most this many requests at once, so `in_flight` of them are taken. 0 for a prefill
    /// worker, and for a lost one.
    pub max_batch: u32,
}

/// The one counter of a lost worker's [`WorkerStatus`]: how many requests in flight on it
/// failed (`WorkerLost`) because it was lost.
pub const FAILED_WHEN_LOST: &str = "failed_when_lost";

impl WorkerStatus {
    /// Whether nothing runs on the worker and no page is lent against its pool. A lost
    /// worker is idle too: what ran on it failed.
    pub fn idle(&self) -> bool {
        self.in_flight == 0 && self.held_pages == 0
    }

    /// Whether an operator may stop the worker now: connected, drained and idle, so that
    /// stopping it fails no request.
    pub fn safe_to_stop(&self) -> bool {
        self.connected && self.drain && self.idle()
    }

    /// For a lost worker, the requests that failed because it was lost.
    pub fn failed_when_lost(&self) -> Option<u64> {
        if self.connected {
            return None;
        }
        self.counters
            .iter()
            .find(|(name, _)| name == FAILED_WHEN_LOST)
            .map(|&(_, n)| n)
    }

    pub(super) fn check(&self) -> Check {
        check_worker_id(&self.id)?;
        let used = [
            self.free,
            self.reserved,
            self.writing,
            self.readable,
            self.draining,
        ]
        .iter()
        .map(|&n| u64::from(n))
        .sum::<u64>();
        if used > u64::from(self.pool_pages) {
            return Err(format!(
                "worker {}: {used} pages by state exceed its pool of {}",
                self.id, self.pool_pages
            ));
        }
        if self.transports.len() > 3 {
            return Err(format!(
                "worker {}: {} transports",
                self.id,
                self.transports.len()
            ));
        }
        if self.max_batch > MAX_BATCH {
            return Err(format!(
                "worker {}: max_batch {} exceeds {MAX_BATCH}",
                self.id, self.max_batch
            ));
        }
        check_counters(&self.counters)
    }
}

/// kvctld asks a decode worker to reserve pages for a request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecodeReserve {
    /// The request and generation the pages will belong to.
    pub owner: Owner,
    /// Prompt tokens whose KV will be pulled.
    pub prompt_tokens: u32,
    /// New tokens to leave room for.
    pub max_new_tokens: u32,
}

impl DecodeReserve {
    pub(super) fn check(&self) -> Check {
        if self.prompt_tokens == 0 || self.max_new_tokens == 0 {
            return Err(format!(
                "prompt_tokens {} and max_new_tokens {} must be non-zero",
                self.prompt_tokens, self.max_new_tokens
            ));
        }
        Ok(())
    }
}

/// A decode worker reserved pages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecodeReserved {
    /// The owner the pages belong to.
    pub owner: Owner,
    /// Pages reserved.
    pub pages: u32,
}

/// kvctld asks a prefill worker to compute the KV of a prompt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillRun {
    /// The owner of the pages to write.
    pub owner: Owner,
    /// The prompt's token ids, 1 to [`MAX_PROMPT_TOKENS`](super::MAX_PROMPT_TOKENS) of them.
    pub prompt: Vec<u32>,
}

/// A prefill worker wrote the KV of a prompt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillDone {
    /// Pages written and their digests.
    pub manifest: Manifest,
}

/// kvctld hands a decode worker the prefill pool to pull from; attaches the pool memfd.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillPool {
    /// The prefill worker whose pool this is; `PullKv` names it as its source.
    pub worker: String,
    /// Shape of the prefill pool's pages.
    pub geometry: PageGeometry,
    /// Pages in the prefill pool.
    pub pool_pages: u32,
}

/// kvctld hands a decode worker the prefill page server to pull from over TCP.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillEndpoint {
    /// The prefill worker that serves these pages; `PullKv` names it as its source.
    pub worker: String,
    /// Shape of the prefill pool's pages.
    pub geometry: PageGeometry,
    /// Pages in the prefill pool.
    pub pool_pages: u32,
    /// The page server and its token.
    pub endpoint: TcpEndpoint,
    /// Whether to read the pages with RDMA (both workers have it), over a session set up on
    /// a connection to the page server; otherwise the pages come over that TCP connection.
    pub rdma: bool,
}

impl PrefillPool {
    pub(super) fn check(&self) -> Check {
        check_worker_id(&self.worker)?;
        check_pool(&self.geometry, self.pool_pages)
    }
}

/// kvctld tells a decode worker that a prefill worker is gone: it unmaps that pool and
/// closes its page-server connections. A later `PrefillPool` or `PrefillEndpoint` of the
/// same id (the worker restarted) replaces it as well.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillGone {
    /// The prefill worker's id.
    pub worker: String,
}

impl PrefillEndpoint {
    pub(super) fn check(&self) -> Check {
        check_worker_id(&self.worker)?;
        check_pool(&self.geometry, self.pool_pages)?;
        check_addr(&self.endpoint.addr)
    }
}

/// kvctld asks a decode worker to pull and verify the pages of a manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullKv {
    /// The prefill worker that holds the pages (its `PrefillPool` or `PrefillEndpoint`).
    pub source: String,
    /// Source pages, digests and owner.
    pub manifest: Manifest,
    /// New tokens to generate once pulled.
    pub max_new_tokens: u32,
    /// The prompt's last token: a real model's first decode step runs it through the model
    /// (its KV is in the pages already) to get the first new token.
    pub last_token: u32,
    /// How to pick each new token, as the client asked.
    pub sampling: Sampling,
}

impl PullKv {
    pub(super) fn check(&self) -> Check {
        check_worker_id(&self.source)?;
        check_manifest(&self.manifest)?;
        if self.max_new_tokens == 0 {
            return Err("max_new_tokens 0".to_owned());
        }
        self.sampling.check()
    }
}

/// A decode worker pulled and verified the pages of an owner.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullDone {
    /// The owner whose pages were pulled.
    pub owner: Owner,
}

/// Free the pages of an owner.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Release {
    /// The owner whose pages to free.
    pub owner: Owner,
}

/// Abandon the request of an owner and free its pages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Abort {
    /// The owner whose request to abandon.
    pub owner: Owner,
    /// Why.
    pub code: ErrorCode,
    /// Details for humans, at most [`MAX_TEXT_BYTES`].
    pub reason: String,
}

/// A worker's pages by ownership state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolReport {
    /// Pages owned by no request.
    pub free: u32,
    /// Pages reserved, not yet written.
    pub reserved: u32,
    /// Pages being written.
    pub writing: u32,
    /// Pages written and readable.
    pub readable: u32,
    /// Pages released while a writer may still touch them, waiting for it to end.
    pub draining: u32,
    /// The worker's counters, at most [`MAX_COUNTERS`].
    pub counters: Vec<(String, u64)>,
}

/// The pages a worker held for an owner are free again: no writer can touch them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Freed {
    /// The owner whose pages were freed.
    pub owner: Owner,
    /// How many pages went back to the free list.
    pub pages: u32,
}

/// Keep new requests off a worker (`drain: true`) or take it back (`false`). Requests in
/// flight on it finish. A worker may send it only for itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drain {
    /// The worker's id.
    pub worker: String,
    /// Drain (true) or undrain (false).
    pub drain: bool,
}

/// kvctld's answer to a client's `Drain`: the worker as it is now.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainReply {
    /// The worker.
    pub worker: WorkerStatus,
}
