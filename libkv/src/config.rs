//! Configuration: one TOML file for the whole stack.
//!
//! kvctld reads `[control]`, `[limits]` and `[deadlines]`; prefilld reads `[prefill]` and
//! `[transfer]`; decoded reads `[decode]`; all of them read `[geometry]`, so that every process agrees on
//! what a page is. `kvfence.example.toml` next to this crate's `Cargo.toml` documents every
//! key; a test parses and validates it.
//!
//! Parsing is strict (`deny_unknown_fields` everywhere, so a misspelt key is an error, not a
//! silently ignored setting), and [`Config::validate`] refuses to start a stack that could
//! never serve a request of the configured maximum size. In particular a prompt of
//! `max_context` tokens must fit in the prefill pool, and `max_context + max_new_tokens` must
//! fit in the decode pool: a deployment whose context window was larger than its KV pool made
//! the scheduler take a rarely exercised rejection path that ended up reading other tenants'
//! stale pages. That configuration is refused here, before any daemon starts.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::geometry::{Dtype, PageGeometry};

/// Default path of kvctld's control socket.
pub const DEFAULT_SOCKET: &str = "/run/kvfence/kvctld.sock";
/// Longest accepted socket path, in bytes. `sun_path` holds 108 bytes including the NUL;
/// the margin leaves room for a temporary suffix during an atomic rebind.
pub const MAX_SOCKET_PATH_BYTES: usize = 100;
/// Most entries in `control.allowed_uids` and in `control.allowed_gids`.
pub const MAX_ALLOWED_IDS: usize = 64;
/// Largest accepted `control.admission_queue`.
pub const MAX_ADMISSION_QUEUE: u32 = 1 << 20;
/// Largest accepted pool, in bytes (1 TiB).
pub const MAX_POOL_BYTES: u64 = 1 << 40;
/// Largest accepted page, in bytes (1 GiB); the same bound as [`PageGeometry::is_valid`].
pub const MAX_PAGE_BYTES: u64 = 1 << 30;
/// Longest accepted deadline, in milliseconds (one hour).
pub const MAX_DEADLINE_MS: u32 = 3_600_000;
/// Most connections kvctld holds at once (every uid together); more are turned away at
/// accept. `control.max_connections_per_uid` may not exceed it.
pub const MAX_CONNECTIONS: u32 = 4096;
/// Permission bits `control.socket_mode` may set (no set-id or sticky bits).
pub const SOCKET_MODE_BITS: u32 = 0o777;

/// Which worker pool a setting or an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    Prefill,
    Decode,
}

impl Side {
    /// The configuration expression that sets how many tokens this side must hold.
    fn demand(self) -> &'static str {
        match self {
            Side::Prefill => "max_context",
            Side::Decode => "max_context + max_new_tokens",
        }
    }

    /// What the operator can change when the pool is too small.
    fn remedy(self) -> &'static str {
        match self {
            Side::Prefill => "enlarge [prefill] pool_pages or lower limits.max_context",
            Side::Decode => {
                "enlarge [decode] pool_pages or lower limits.max_context or limits.max_new_tokens"
            }
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        })
    }
}

/// Why a configuration was not loaded. Every variant means "do not start"; the binary prints
/// the whole chain once and exits.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("[tls]: {reason}")]
    BadTls { reason: String },

    #[error("max_batch = {max_batch}: it {reason}")]
    BadBatch {
        max_batch: u32,
        reason: &'static str,
    },

    #[error("[election]: {reason}")]
    BadElection { reason: String },

    #[error("cannot read configuration file {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("cannot parse configuration{}", in_file(path.as_deref()))]
    Parse {
        path: Option<PathBuf>,
        #[source]
        source: Box<toml::de::Error>,
    },

    #[error(
        "invalid page geometry {} tokens x {} layers x 2 (K, V) x {} kv_heads x {} head_dim x {} bytes ({:?}): \
         every dimension must be at least 1 and a page at most {MAX_PAGE_BYTES} bytes (1 GiB)",
        geometry.tokens_per_page, geometry.layers, geometry.kv_heads, geometry.head_dim,
        geometry.dtype.size(), geometry.dtype
    )]
    InvalidGeometry { geometry: PageGeometry },

    #[error("limits.{key} is 0; it must be at least 1 token")]
    ZeroLimit { key: &'static str },

    #[error(
        "{side} pool holds {pool_tokens} tokens ({pool_pages} pages of {tokens_per_page}) \
         but {} is {needed_tokens} tokens ({needed_pages} pages): a request this long could \
         never be admitted; {}",
        side.demand(), side.remedy()
    )]
    ContextExceedsPool {
        side: Side,
        needed_tokens: u64,
        needed_pages: u64,
        pool_tokens: u64,
        pool_pages: u32,
        tokens_per_page: u32,
    },

    #[error(
        "{side} pool of {pool_pages} pages of {bytes_per_page} bytes is {pool_bytes} bytes, \
         above the limit of {MAX_POOL_BYTES} bytes (1 TiB)"
    )]
    PoolTooLarge {
        side: Side,
        pool_pages: u32,
        bytes_per_page: u64,
        /// Exact product; u128 so that it cannot overflow.
        pool_bytes: u128,
    },

    #[error("deadlines.{key} is {ms} ms; it must be between 1 and {MAX_DEADLINE_MS} ms")]
    DeadlineOutOfRange { key: &'static str, ms: u32 },

    #[error(
        "limits.max_context is {max_context} tokens but one Submit frame carries at most \
         {max_prompt_tokens} prompt tokens: prompts that long could never be sent; lower \
         limits.max_context to at most {max_prompt_tokens}"
    )]
    ContextExceedsFrame {
        max_context: u32,
        max_prompt_tokens: usize,
    },

    #[error("model.kind is \"gguf\" but model.path is not set: name the GGUF file")]
    ModelPathMissing,

    #[error(
        "control.socket_mode is {mode:#o}; it must be permission bits only (at most 0o777) and \
         give the owner read and write (0o600)"
    )]
    BadSocketMode { mode: u32 },

    #[error("control.socket_group is empty; name a group or a numeric gid, or leave it out")]
    SocketGroupEmpty,

    #[error(
        "control.max_connections_per_uid is {count}; it must be between 1 and \
         {MAX_CONNECTIONS} (kvctld's limit over every uid)"
    )]
    BadConnectionLimit { count: u32 },

    #[error(
        "control.idle_timeout_ms is {ms} ms; it must be 0 (never) or between 1 and \
         {MAX_DEADLINE_MS} ms"
    )]
    IdleTimeoutOutOfRange { ms: u32 },

    #[error(
        "deadlines.request is {request_ms} ms, shorter than deadlines.bootstrap + \
         deadlines.transfer = {bootstrap_ms} + {transfer_ms} = {} ms: no request could finish \
         its KV transfer before its own deadline",
        u64::from(*bootstrap_ms) + u64::from(*transfer_ms)
    )]
    RequestDeadlineTooShort {
        request_ms: u32,
        bootstrap_ms: u32,
        transfer_ms: u32,
    },

    #[error("control.{key} has {count} entries; at most {MAX_ALLOWED_IDS} are allowed")]
    TooManyIds { key: &'static str, count: usize },

    #[error("control.admission_queue is {queued}; at most {MAX_ADMISSION_QUEUE} is allowed")]
    AdmissionQueueTooLong { queued: u32 },

    #[error("worker.id {id:?} is not 1 to 64 bytes of letters, digits and _ . @ : -")]
    BadWorkerId { id: String },

    #[error("control.socket is empty; it must be an absolute path")]
    SocketPathEmpty,

    #[error("control.socket {} is relative; it must be an absolute path", path.display())]
    SocketPathRelative { path: PathBuf },

    #[error(
        "control.socket {} is {len} bytes long; at most {MAX_SOCKET_PATH_BYTES} bytes fit in sun_path",
        path.display()
    )]
    SocketPathTooLong { path: PathBuf, len: usize },

    #[error(
        "transfer.listen is set but transfer.transport is \"shm\"; it is for \"tcp\" and \"rdma\" only"
    )]
    ListenWithoutTcp,

    #[error("transfer.transport is \"{transport}\" but transfer.listen (IP:PORT) is not set")]
    ListenMissing { transport: &'static str },

    #[error("transfer.transport is \"rdma\" but there is no [rdma] section naming the device")]
    RdmaSectionMissing,

    #[error(
        "transfer.listen {addr:?} is not IP:PORT with a unicast IP that decoded can reach \
         (not 0.0.0.0 or ::)"
    )]
    BadListen { addr: String },

    #[error("metrics.{key} {addr:?} is not IP:PORT (e.g. \"127.0.0.1:9470\")")]
    BadMetricsListen { key: &'static str, addr: String },

    #[error(
        "metrics.{key} and metrics.{other} are both {addr}: each daemon reading this file \
         needs an address of its own (or port 0)"
    )]
    SharedMetricsListen {
        key: &'static str,
        other: &'static str,
        addr: SocketAddr,
    },

    #[error("[openai] {reason}")]
    BadOpenAi { reason: String },

    #[error(
        "rdma.device is empty; name the RDMA device (as `ibv_devices` lists it, e.g. \"mlx5_0\")"
    )]
    RdmaDeviceEmpty,

    #[error("rdma.port is 0; RDMA ports are numbered from 1")]
    RdmaPortZero,
}

fn in_file(path: Option<&Path>) -> String {
    path.map(|p| format!(" file {}", p.display()))
        .unwrap_or_default()
}

/// Whole-stack configuration. See the module docs and `kvfence.example.toml`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub geometry: PageGeometry,
    pub limits: Limits,
    #[serde(default)]
    pub control: Control,
    /// This worker's identity (prefilld and decoded; kvctld ignores it).
    #[serde(default)]
    pub worker: WorkerConfig,
    pub prefill: PoolConfig,
    pub decode: PoolConfig,
    #[serde(default)]
    pub deadlines: Deadlines,
    #[serde(default)]
    pub probe: Probe,
    #[serde(default)]
    pub transfer: Transfer,
    /// The RDMA device, when RDMA is wanted; without it the workers use shm or TCP only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<RdmaConfig>,
    /// kvctld's Prometheus endpoint; off unless `listen` is set.
    #[serde(default)]
    pub metrics: Metrics,
    /// The model the workers run; the reference model unless set.
    #[serde(default)]
    pub model: ModelConfig,
    /// openaid, the OpenAI-compatible HTTP endpoint (kvctld and the workers ignore it).
    #[serde(default)]
    pub openai: OpenAi,
    /// kvctld over TCP with mutual TLS, for peers on other hosts; off unless set.
    #[serde(default)]
    pub tls: Tls,
    /// Several kvctld instances, one leading at a time, elected through etcd; off unless set.
    #[serde(default)]
    pub election: Election,
}

/// The `[election]` section: several kvctld instances share one cluster, and one of them
/// leads, elected through etcd (v3, its JSON gateway, over plain HTTP or TLS, at any of
/// `etcd`'s members). A kvctld campaigns
/// before it serves anything: it takes a lease of `ttl_s` and creates `key` under it, with
/// `advertise` as its value; the store's revision of that put is its epoch (its generation,
/// which every worker fences on). While the key exists the others wait as standbys. The
/// leader renews the lease every third of `ttl_s` and admits only within `ttl_s - margin_ms`
/// of the last renewal it *sent*; when that window closes it fails what it holds and exits
/// (its service manager starts it again, as a standby). Workers, kvctl and openaid with
/// `etcd` set find the leader's address under `key` and reach it over `[tls]`, whose
/// `server_name` names the certificate every kvctld of the cluster presents.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Election {
    /// The etcd members' client addresses: one `HOST:PORT`, or a list of them, each plain
    /// or with `http://`, or all with `https://` for TLS; the election is off without it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub etcd: Option<EtcdList>,
    /// CA certificates (PEM) that `https://` etcd members' certificates are checked
    /// against; required with them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate and key (PEM) presented to etcd, for a cluster that requires
    /// them (`--client-cert-auth`); both or neither.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub etcd_cert: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub etcd_key: Option<PathBuf>,
    /// The key the leader holds; its value is the leader's `advertise` address.
    pub key: String,
    /// Where workers publish themselves, each under its own lease: `<members><id>` holds a
    /// [`crate::members::Member`] as JSON. The leader treats a registered worker whose key
    /// lapsed as lost.
    pub members: String,
    /// The lease's time to live at etcd, in seconds (etcd grants no less than 2).
    pub ttl_s: u32,
    /// How much of each lease window the leader gives up, in milliseconds: at least the
    /// clock drift between kvctld and etcd over one TTL.
    pub margin_ms: u32,
    /// `HOST:PORT` where peers reach this kvctld's TLS listener (kvctld only); `[tls]
    /// listen` when unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise: Option<String>,
}

impl Default for Election {
    fn default() -> Election {
        Election {
            etcd: None,
            etcd_ca: None,
            etcd_cert: None,
            etcd_key: None,
            key: "/kvfence/leader".into(),
            members: "/kvfence/workers/".into(),
            ttl_s: 5,
            margin_ms: 1000,
            advertise: None,
        }
    }
}

impl Election {
    pub fn enabled(&self) -> bool {
        self.etcd.is_some()
    }

    pub fn ttl(&self) -> std::time::Duration {
        std::time::Duration::from_secs(u64::from(self.ttl_s))
    }

    pub fn margin(&self) -> std::time::Duration {
        std::time::Duration::from_millis(u64::from(self.margin_ms))
    }

    /// The address this kvctld publishes: `advertise`, or `[tls] listen` when it names a
    /// host (not 0.0.0.0 or ::).
    pub fn advertised(&self, tls: &Tls) -> Result<String, ConfigError> {
        if let Some(a) = &self.advertise {
            return Ok(a.clone());
        }
        match tls.listen_addr()? {
            Some(addr) if !addr.ip().is_unspecified() => Ok(addr.to_string()),
            Some(addr) => Err(ConfigError::BadElection {
                reason: format!(
                    "[tls] listen = \"{addr}\" names no host peers can reach: set `advertise`"
                ),
            }),
            None => Err(ConfigError::BadElection {
                reason: "a kvctld in an election needs [tls] listen: peers reach the leader \
                         over TLS"
                    .into(),
            }),
        }
    }

    fn validate(&self, tls: &Tls) -> Result<(), ConfigError> {
        let bad = |reason: String| ConfigError::BadElection { reason };
        let Some(etcd) = &self.etcd else {
            return Ok(());
        };
        etcd.validate().map_err(bad)?;
        if let Some(v) = &self.advertise
            && !is_host_port(v)
        {
            return Err(bad(format!("advertise = {v:?} is not a HOST:PORT")));
        }
        match (etcd.uses_tls(), &self.etcd_ca) {
            (true, None) => {
                return Err(bad(
                    "etcd names https:// members: set etcd_ca, the CA their certificates are \
                     checked against"
                        .into(),
                ));
            }
            (false, Some(_)) => {
                return Err(bad(
                    "etcd_ca is set but etcd names plain members: write them https://".into(),
                ));
            }
            _ => {}
        }
        match (&self.etcd_cert, &self.etcd_key) {
            (Some(_), None) | (None, Some(_)) => {
                return Err(bad(
                    "etcd_cert and etcd_key go together: set both or neither".into(),
                ));
            }
            (Some(_), Some(_)) if !etcd.uses_tls() => {
                return Err(bad(
                    "etcd_cert is set but etcd names plain members: write them https://".into(),
                ));
            }
            _ => {}
        }
        if self.key.is_empty() {
            return Err(bad("`key` is empty".into()));
        }
        if !self.members.ends_with('/') || self.key.starts_with(&self.members) {
            return Err(bad(format!(
                "members = {:?} must end in '/' and not hold the leader key {:?}",
                self.members, self.key
            )));
        }
        if self.ttl_s < 2 {
            return Err(bad(format!(
                "ttl_s = {} is below 2 (etcd grants no shorter lease)",
                self.ttl_s
            )));
        }
        if u64::from(self.margin_ms) * 3 >= u64::from(self.ttl_s) * 1000 {
            return Err(bad(format!(
                "margin_ms = {} leaves too little of a {} s lease: keep it under a third",
                self.margin_ms, self.ttl_s
            )));
        }
        for (key, v) in [("cert", &tls.cert), ("key", &tls.key), ("ca", &tls.ca)] {
            if v.is_none() {
                return Err(bad(format!(
                    "[tls] `{key}` is required: peers reach the leader over mutual TLS"
                )));
            }
        }
        if tls.server_name.is_none() {
            return Err(bad(
                "[tls] server_name is required: it names the certificate every kvctld of the \
                 cluster presents"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// `[election] etcd`: one member's client address, or a list of them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EtcdList {
    One(String),
    Many(Vec<String>),
}

impl From<String> for EtcdList {
    fn from(addr: String) -> EtcdList {
        EtcdList::One(addr)
    }
}

/// Most etcd members one config names.
pub const MAX_ETCD_ENDPOINTS: usize = 16;

impl EtcdList {
    /// The entries as written.
    pub fn entries(&self) -> &[String] {
        match self {
            EtcdList::One(a) => std::slice::from_ref(a),
            EtcdList::Many(list) => list,
        }
    }

    /// Each member's `HOST:PORT`, without its scheme.
    pub fn addrs(&self) -> Vec<String> {
        self.entries()
            .iter()
            .map(|e| split_scheme(e).1.to_owned())
            .collect()
    }

    /// Whether the members are `https://` ones.
    pub fn uses_tls(&self) -> bool {
        self.entries()
            .iter()
            .any(|e| split_scheme(e).0 == Some("https"))
    }

    fn validate(&self) -> Result<(), String> {
        let entries = self.entries();
        if entries.is_empty() || entries.len() > MAX_ETCD_ENDPOINTS {
            return Err(format!(
                "etcd names {} members: give 1 to {MAX_ETCD_ENDPOINTS}",
                entries.len()
            ));
        }
        for e in entries {
            let (scheme, rest) = split_scheme(e);
            if !matches!(scheme, None | Some("http" | "https")) || !is_host_port(rest) {
                return Err(format!(
                    "etcd entry {e:?} is not HOST:PORT, http://HOST:PORT or https://HOST:PORT"
                ));
            }
        }
        let tls = self.uses_tls();
        if entries
            .iter()
            .any(|e| (split_scheme(e).0 == Some("https")) != tls)
        {
            return Err("etcd mixes https:// and plain members: give all one scheme".into());
        }
        let addrs = self.addrs();
        if let Some(dup) = addrs
            .iter()
            .enumerate()
            .find_map(|(i, a)| addrs[..i].contains(a).then_some(a))
        {
            return Err(format!("etcd names {dup} twice"));
        }
        Ok(())
    }
}

/// `("https", "host:2379")` of `https://host:2379` (a trailing `/` dropped); no scheme:
/// `(None, entry)`.
fn split_scheme(entry: &str) -> (Option<&str>, &str) {
    let entry = entry.strip_suffix('/').unwrap_or(entry);
    match entry.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, entry),
    }
}

/// `HOST:PORT` with a host and a port in 1..=65535.
fn is_host_port(v: &str) -> bool {
    matches!(v.rsplit_once(':'), Some((host, port))
        if !host.is_empty() && !host.contains('/') && port.parse::<u16>().is_ok_and(|p| p > 0))
}

/// The `[tls]` section: kvctld's control channel over TCP with mutual TLS, beside the Unix
/// socket. kvctld listens on `listen`; a worker, kvctl or openaid with `connect` set reaches
/// kvctld there instead of at `control.socket`. Every peer presents a certificate signed by
/// `ca`, and kvctld presents one too. A peer's identity is the first name of `workers`, then
/// of `clients`, that its certificate is valid for (a DNS name of its subject alternative
/// names): a name of `workers` may register as a worker (and drain), one of `clients` may
/// only submit requests and read status; a certificate valid for neither is turned away.
/// Shared-memory pools cannot cross TLS (no descriptor travels): peers on TLS use the TCP
/// or RDMA transport.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Tls {
    /// `IP:PORT` kvctld listens on (kvctld only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    /// `HOST:PORT` where this peer reaches kvctld (workers, kvctl, openaid).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connect: Option<String>,
    /// The name kvctld's certificate must be valid for; the host of `connect` by default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
    /// This peer's certificate chain (PEM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert: Option<PathBuf>,
    /// This peer's private key (PEM; PKCS#8, PKCS#1 or SEC1), readable by its daemon only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<PathBuf>,
    /// The certificate authority every peer's certificate must chain to (PEM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca: Option<PathBuf>,
    /// Certificate names that may register as workers (kvctld only).
    pub workers: Vec<String>,
    /// Certificate names that may connect as clients (kvctld only).
    pub clients: Vec<String>,
}

impl Tls {
    /// Whether kvctld listens for TLS peers or this peer connects over TLS.
    pub fn enabled(&self) -> bool {
        self.listen.is_some() || self.connect.is_some()
    }

    /// The address kvctld listens on, or `None` when TLS is off.
    pub fn listen_addr(&self) -> Result<Option<SocketAddr>, ConfigError> {
        let bad = |reason: String| ConfigError::BadTls { reason };
        match &self.listen {
            None => Ok(None),
            Some(text) => match text.parse::<SocketAddr>() {
                Ok(addr) if !addr.ip().is_multicast() => Ok(Some(addr)),
                _ => Err(bad(format!("listen = {text:?} is not an IP:PORT"))),
            },
        }
    }

    /// The name kvctld's certificate is checked against: `server_name`, or the host part
    /// of `connect`.
    pub fn server_name(&self) -> Option<String> {
        if let Some(n) = &self.server_name {
            return Some(n.clone());
        }
        let connect = self.connect.as_deref()?;
        let host = match connect.rsplit_once(':') {
            Some((host, _)) => host,
            None => connect,
        };
        Some(
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
        )
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |reason: String| ConfigError::BadTls { reason };
        self.listen_addr()?;
        if let Some(c) = &self.connect {
            match c.rsplit_once(':') {
                Some((host, port))
                    if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0) => {}
                _ => return Err(bad(format!("connect = {c:?} is not a HOST:PORT"))),
            }
        }
        if !self.enabled() {
            return Ok(());
        }
        for (key, v) in [("cert", &self.cert), ("key", &self.key), ("ca", &self.ca)] {
            if v.is_none() {
                return Err(bad(format!(
                    "`{key}` is required with `listen` or `connect` (mutual TLS: every peer \
                     presents a certificate)"
                )));
            }
        }
        if self.listen.is_some() && self.workers.is_empty() && self.clients.is_empty() {
            return Err(bad(
                "`listen` without `workers` or `clients` would let no certificate in".into(),
            ));
        }
        for name in self.workers.iter().chain(&self.clients) {
            if rustls_pki_types::ServerName::try_from(name.as_str()).is_err()
                || name.parse::<std::net::IpAddr>().is_ok()
            {
                return Err(bad(format!(
                    "{name:?} in `workers` or `clients` is not a DNS name"
                )));
            }
        }
        Ok(())
    }
}

/// The `[openai]` section: where openaid, the OpenAI-compatible HTTP endpoint, listens and
/// whom it charges. Without `api_keys` every request is charged to `tenant` and openaid
/// listens on loopback only; with it, a request must carry `Authorization: Bearer KEY` for
/// a key of the file, which names its tenant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OpenAi {
    /// `IP:PORT` of the HTTP listener.
    pub listen: String,
    /// The tenant of every request when there is no key file.
    pub tenant: String,
    /// A file of `KEY TENANT` lines (`#` starts a comment), readable by openaid only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_keys: Option<PathBuf>,
    /// Most requests in flight at once; one more is answered 503 at once.
    pub max_requests: u32,
}

impl Default for OpenAi {
    fn default() -> OpenAi {
        OpenAi {
            listen: "127.0.0.1:8000".into(),
            tenant: "openai".into(),
            api_keys: None,
            max_requests: 256,
        }
    }
}

impl OpenAi {
    /// The address to listen on.
    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        let bad = |reason: &str| ConfigError::BadOpenAi {
            reason: format!("listen {:?}: {reason}", self.listen),
        };
        let addr: SocketAddr = self.listen.parse().map_err(|_| bad("not IP:PORT"))?;
        if addr.ip().is_multicast() {
            return Err(bad("a multicast address"));
        }
        if self.api_keys.is_none() && !addr.ip().is_loopback() {
            return Err(bad(
                "not a loopback address, and without api_keys anyone reaching it could \
                 submit requests",
            ));
        }
        Ok(addr)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.listen_addr()?;
        if !crate::proto::is_valid_tenant(&self.tenant) {
            return Err(ConfigError::BadOpenAi {
                reason: format!(
                    "tenant {:?} is not 1 to {} bytes of [A-Za-z0-9_.-]",
                    self.tenant,
                    crate::proto::MAX_TENANT_BYTES
                ),
            });
        }
        if self.max_requests == 0 {
            return Err(ConfigError::BadOpenAi {
                reason: "max_requests is 0".into(),
            });
        }
        Ok(())
    }
}

/// Which model prefilld and decoded run. Every worker of a kvctld runs the same one: kvctld
/// refuses a worker whose model differs from its own `[model]`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    #[serde(default)]
    pub kind: ModelKind,
    /// The GGUF file (`kind = "gguf"`); `kvctl fetch-model` puts SmolLM2-135M-Instruct in
    /// the cache directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// Threads one request's prefill or decode step uses; 0 (the default) for every core.
    #[serde(default)]
    pub threads: u32,
}

impl ModelConfig {
    /// The threads to run a model on: `threads`, or every core when 0.
    pub fn threads(&self) -> usize {
        match self.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n as usize,
        }
    }
}

/// The model runners there are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// The deterministic reference model (`libkv::model`): tokens are bytes, the output echoes
    /// the prompt; every output is checkable exactly.
    #[default]
    Reference,
    /// A Llama-architecture model from a GGUF file (the `llama` crate).
    Gguf,
    /// An inference engine's model: the workers run inside the engine (vLLM, through the
    /// kvfence connector), which computes and consumes the KV ([`crate::engine`]). A worker
    /// daemon started on its own refuses this kind.
    Engine,
}

/// Request size limits, in tokens. Both are required: there is no safe default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Longest accepted prompt, in tokens.
    pub max_context: u32,
    /// Most tokens one request may generate.
    pub max_new_tokens: u32,
}

/// kvctld's control socket and admission settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Control {
    /// Path of the control socket.
    pub socket: PathBuf,
    /// Peer uids allowed to connect besides the daemon's own uid, root and peers whose
    /// primary group is the daemon's own.
    pub allowed_uids: Vec<u32>,
    /// Peer gids allowed to connect.
    pub allowed_gids: Vec<u32>,
    /// Peer uids allowed to register as a worker (prefill or decode), besides the daemon's
    /// own uid and root. Being allowed to connect is not enough to become a worker: a worker
    /// sees prompts and KV of every tenant.
    pub worker_uids: Vec<u32>,
    /// Most requests queued while waiting for temporary pool capacity.
    pub admission_queue: u32,
    /// How kvctld picks the prefill and decode worker of a request.
    pub pairing: Pairing,
    /// Permission bits kvctld gives the socket it binds (not one passed by systemd, whose
    /// socket unit sets its own). A socket directory kvctld creates gets the search bits of
    /// the classes this mode lets in.
    pub socket_mode: u32,
    /// Group (a name or a numeric gid) kvctld gives the socket it binds, and the socket
    /// directory it creates; `None` keeps kvctld's own group.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket_group: Option<String>,
    /// A client connection with no request in flight and no frame for this long is closed;
    /// 0 never closes one. Workers are never closed for being quiet.
    pub idle_timeout_ms: u32,
    /// Most connections one uid may hold at once; more from that uid are turned away at
    /// accept, so that one user cannot take every connection from the others.
    pub max_connections_per_uid: u32,
}

impl Control {
    /// `idle_timeout_ms` as a [`Duration`]; `None` when idle connections are kept.
    pub fn idle_timeout(&self) -> Option<Duration> {
        (self.idle_timeout_ms > 0).then(|| ms(self.idle_timeout_ms))
    }
}

/// How kvctld picks a (prefill, decode) pair among the workers whose pools can hold a
/// request now. Draining and lost workers are never picked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pairing {
    /// The worker of each role with the most free pages (ties: fewest requests in flight,
    /// then the longest since it was last picked).
    #[default]
    MostFree,
    /// The worker of each role with the fewest requests in flight (ties: most free pages).
    FewestInFlight,
    /// Two workers of each role drawn at random; the one with more free pages.
    PowerOfTwo,
}

/// `[worker]`: who this prefill or decode worker is.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// The worker's id, unique among the workers of one kvctld: 1 to 64 bytes of
    /// `[A-Za-z0-9_.@:-]`. `--id` overrides it (the systemd units pass their instance name);
    /// without either a worker calls itself "prefill" or "decode".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

impl WorkerConfig {
    /// The id to register under: `id`, or the role's name.
    pub fn id_or(&self, role_default: &str) -> String {
        self.id.clone().unwrap_or_else(|| role_default.to_owned())
    }
}

impl Default for Control {
    fn default() -> Self {
        Control {
            socket: PathBuf::from(DEFAULT_SOCKET),
            allowed_uids: Vec::new(),
            allowed_gids: Vec::new(),
            worker_uids: Vec::new(),
            admission_queue: 1024,
            pairing: Pairing::default(),
            socket_mode: 0o660,
            socket_group: None,
            idle_timeout_ms: 60_000,
            max_connections_per_uid: 1024,
        }
    }
}

/// What a worker writes into a page when it is freed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoisonMode {
    /// Leave freed pages as they are.
    #[default]
    Off,
    /// Fill freed pages with a recognisable pattern derived from their last owner, so that a
    /// stale read shows up as that pattern instead of another tenant's data.
    Owner,
}

/// Whether a worker zeroes pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scrub {
    /// Never zero pages.
    #[default]
    Off,
    /// Zero every page when it is freed.
    OnFree,
}

/// Where a worker's pool lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// Host memory (a sealed memfd).
    #[default]
    Host,
    /// Device memory on the CUDA device `cuda_device`.
    Cuda,
}

/// One worker's KV pool (`[prefill]` or `[decode]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Pages in the pool; required.
    pub pool_pages: u32,
    #[serde(default)]
    pub poison: PoisonMode,
    #[serde(default)]
    pub scrub: Scrub,
    #[serde(default)]
    pub backend: Backend,
    /// CUDA device ordinal; ignored by the host backend.
    #[serde(default)]
    pub cuda_device: u32,
    /// `[decode]` only: most requests the worker decodes together, one forward step over
    /// all of them. kvctld admits no more to one decode worker at once and queues the rest
    /// (`deadlines.admission_wait`).
    /// `[prefill]` refuses it. See [`PoolConfig::max_batch`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batch: Option<u32>,
}

/// Largest accepted `decode.max_batch`: the most batch slots a decode worker may register.
pub const MAX_BATCH: u32 = crate::proto::MAX_BATCH;
/// `decode.max_batch` when it is not set.
pub const DEFAULT_MAX_BATCH: u32 = 16;

impl PoolConfig {
    /// Most requests decoded together: `max_batch`, else [`DEFAULT_MAX_BATCH`].
    pub fn max_batch(&self) -> u32 {
        self.max_batch.unwrap_or(DEFAULT_MAX_BATCH)
    }

    /// Bytes of the pool: `pool_pages * bytes_per_page`. Saturates at `u64::MAX`, which no
    /// validated configuration reaches (validation caps a pool at [`MAX_POOL_BYTES`]).
    pub fn pool_bytes(&self, geometry: &PageGeometry) -> u64 {
        u64::from(self.pool_pages).saturating_mul(geometry.bytes_per_page())
    }

    /// Token positions the pool can hold.
    pub fn pool_tokens(&self, geometry: &PageGeometry) -> u64 {
        geometry.tokens_for_pages(u64::from(self.pool_pages))
    }
}

/// Deadlines, in milliseconds. Each must be in `1..=MAX_DEADLINE_MS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Deadlines {
    /// Longest a request waits in the admission queue for temporary capacity: pages, a
    /// decode batch slot, a worker to register or be undrained; then it fails with
    /// `PoolFull` (retryable), saying what it waited for. The request's own deadline counts
    /// from its arrival, so the wait is part of it. The default, 50 s, leaves 10 s of the
    /// default 60 s request deadline to the request once admitted: a burst far larger than
    /// the decode slots (200 streams on a worker of 16) drains over most of the request
    /// deadline, and every request it cannot serve is refused before it starts rather than
    /// cut off mid-stream.
    pub admission_wait: u32,
    /// Longest the prefill/decode pair takes to agree on a transfer: the decode worker's
    /// reservation (and each worker's handshake with kvctld).
    pub bootstrap: u32,
    /// Longest the prefill worker may take to compute a prompt's KV. A prefill past it is
    /// abandoned, and the worker stops it between chunks.
    pub prefill: u32,
    /// Longest one KV transfer may take.
    pub transfer: u32,
    /// Longest decoding may take.
    pub decode: u32,
    /// Whole-request deadline; at least `bootstrap + transfer`.
    pub request: u32,
    /// Longest a graceful stop waits for requests in flight.
    pub drain: u32,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            admission_wait: 50_000,
            bootstrap: 2000,
            prefill: 30_000,
            transfer: 5000,
            decode: 30_000,
            request: 60_000,
            drain: 5000,
        }
    }
}

/// [`Deadlines`] as [`Duration`]s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeadlineDurations {
    pub admission_wait: Duration,
    pub bootstrap: Duration,
    pub prefill: Duration,
    pub transfer: Duration,
    pub decode: Duration,
    pub request: Duration,
    pub drain: Duration,
}

fn ms(v: u32) -> Duration {
    Duration::from_millis(u64::from(v))
}

impl Deadlines {
    /// Every deadline as a [`Duration`].
    pub fn as_durations(&self) -> DeadlineDurations {
        DeadlineDurations {
            admission_wait: self.admission_wait(),
            bootstrap: self.bootstrap(),
            prefill: self.prefill(),
            transfer: self.transfer(),
            decode: self.decode(),
            request: self.request(),
            drain: self.drain(),
        }
    }

    pub fn admission_wait(&self) -> Duration {
        ms(self.admission_wait)
    }

    pub fn bootstrap(&self) -> Duration {
        ms(self.bootstrap)
    }

    pub fn prefill(&self) -> Duration {
        ms(self.prefill)
    }

    pub fn transfer(&self) -> Duration {
        ms(self.transfer)
    }

    pub fn decode(&self) -> Duration {
        ms(self.decode)
    }

    pub fn request(&self) -> Duration {
        ms(self.request)
    }

    pub fn drain(&self) -> Duration {
        ms(self.drain)
    }

    fn named(&self) -> [(&'static str, u32); 7] {
        [
            ("admission_wait", self.admission_wait),
            ("bootstrap", self.bootstrap),
            ("prefill", self.prefill),
            ("transfer", self.transfer),
            ("decode", self.decode),
            ("request", self.request),
            ("drain", self.drain),
        ]
    }
}

/// How pages move from prefilld to decoded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransportKind {
    /// Shared memory on one host: decoded maps prefilld's pool read-only.
    #[default]
    Shm,
    /// TCP between hosts: decoded pulls pages from prefilld's page server.
    Tcp,
    /// RDMA between hosts: decoded reads pages from prefilld's pool with RDMA READ through
    /// per-request memory windows, set up over the page server's TCP connection. Where a
    /// host has no RDMA the workers say why once and move the pages over that TCP
    /// connection instead.
    Rdma,
}

/// The `[transfer]` section: which transport, and for TCP where prefilld serves its pages.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Transfer {
    pub transport: TransportKind,
    /// `IP:PORT` of prefilld's page server, required for TCP and only for TCP. decoded
    /// connects to this address, so the IP must be one decoded can reach (not 0.0.0.0);
    /// port 0 picks a free port, which kvctld passes on to decoded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
}

impl Transfer {
    /// The page server's address, validated; `None` for shared memory.
    pub fn listen_addr(&self) -> Result<Option<SocketAddr>, ConfigError> {
        match (self.transport, &self.listen) {
            (TransportKind::Shm, None) => Ok(None),
            (TransportKind::Shm, Some(_)) => Err(ConfigError::ListenWithoutTcp),
            (TransportKind::Tcp, None) => Err(ConfigError::ListenMissing { transport: "tcp" }),
            (TransportKind::Rdma, None) => Err(ConfigError::ListenMissing { transport: "rdma" }),
            (TransportKind::Tcp | TransportKind::Rdma, Some(text)) => {
                match text.parse::<SocketAddr>() {
                    Ok(addr) if !addr.ip().is_unspecified() && !addr.ip().is_multicast() => {
                        Ok(Some(addr))
                    }
                    _ => Err(ConfigError::BadListen { addr: text.clone() }),
                }
            }
        }
    }
}

/// The optional `[rdma]` section: which RDMA device, port and GID the workers use.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RdmaConfig {
    /// Device name as libibverbs reports it (`mlx5_0`, `rxe0`).
    pub device: String,
    /// Port number, from 1.
    #[serde(default = "default_rdma_port")]
    pub port: u8,
    /// Index in the port's GID table. On RoCE, index 0 is usually the link-local RoCE v1
    /// GID and index 1 the RoCE v2 GID of the first IP address.
    #[serde(default = "default_rdma_gid_index")]
    pub gid_index: u32,
}

fn default_rdma_port() -> u8 {
    1
}

fn default_rdma_gid_index() -> u32 {
    1
}

impl RdmaConfig {
    /// A configuration for `device` with the default port and GID index.
    pub fn for_device(device: impl Into<String>) -> RdmaConfig {
        RdmaConfig {
            device: device.into(),
            port: default_rdma_port(),
            gid_index: default_rdma_gid_index(),
        }
    }

    /// Checks what can be checked without the device.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.device.is_empty() {
            return Err(ConfigError::RdmaDeviceEmpty);
        }
        if self.port == 0 {
            return Err(ConfigError::RdmaPortZero);
        }
        Ok(())
    }
}

/// The optional `[metrics]` section: where each daemon reading this file answers
/// `GET /metrics` (Prometheus text exposition). `listen` is kvctld's, with its own counters
/// and every worker's pool, by worker; `prefill_listen` and `decode_listen` are those of the
/// prefilld and the decoded reading this file, with their own pool and counters
/// (`--metrics-listen` overrides them). Each is off when unset, so that one file can serve
/// kvctld and a pair of workers on one host, as install.sh links it. Addresses given must
/// differ (port 0 takes any free port, logged as `metrics on http://ADDR/metrics`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Metrics {
    /// kvctld's `IP:PORT` (loopback unless Prometheus scrapes from elsewhere).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    /// The prefill worker's `IP:PORT`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_listen: Option<String>,
    /// The decode worker's `IP:PORT`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decode_listen: Option<String>,
}

impl Metrics {
    /// kvctld's address, or `None` when its metrics are off.
    pub fn listen_addr(&self) -> Result<Option<SocketAddr>, ConfigError> {
        parse_metrics_addr("listen", self.listen.as_deref())
    }

    /// The address of the worker of `side`, or `None` when its metrics are off.
    pub fn worker_addr(&self, side: Side) -> Result<Option<SocketAddr>, ConfigError> {
        match side {
            Side::Prefill => parse_metrics_addr("prefill_listen", self.prefill_listen.as_deref()),
            Side::Decode => parse_metrics_addr("decode_listen", self.decode_listen.as_deref()),
        }
    }

    /// Each address parses, and no two name the same fixed port.
    fn validate(&self) -> Result<(), ConfigError> {
        let addrs = [
            ("listen", self.listen_addr()?),
            ("prefill_listen", self.worker_addr(Side::Prefill)?),
            ("decode_listen", self.worker_addr(Side::Decode)?),
        ];
        for (i, &(key, a)) in addrs.iter().enumerate() {
            for &(other, b) in &addrs[i + 1..] {
                if let (Some(a), Some(b)) = (a, b)
                    && a == b
                    && a.port() != 0
                {
                    return Err(ConfigError::SharedMetricsListen {
                        key,
                        other,
                        addr: a,
                    });
                }
            }
        }
        Ok(())
    }
}

fn parse_metrics_addr(
    key: &'static str,
    text: Option<&str>,
) -> Result<Option<SocketAddr>, ConfigError> {
    match text {
        None => Ok(None),
        Some(text) => match text.parse::<SocketAddr>() {
            Ok(addr) if !addr.ip().is_multicast() => Ok(Some(addr)),
            _ => Err(ConfigError::BadMetricsListen {
                key,
                addr: text.to_owned(),
            }),
        },
    }
}

/// Periodic health probe.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Probe {
    /// Seconds between probes; 0 turns probing off.
    pub interval_s: u32,
}

impl Probe {
    /// The probe interval, or `None` when probing is off.
    pub fn interval(&self) -> Option<Duration> {
        (self.interval_s > 0).then(|| Duration::from_secs(u64::from(self.interval_s)))
    }
}

impl Config {
    /// Parses `text` as TOML, then validates it.
    pub fn from_toml_str(text: &str) -> Result<Config, ConfigError> {
        Self::parse(text, None)
    }

    /// Reads, parses and validates the file at `path`.
    pub fn load(path: impl AsRef<Path>) -> Result<Config, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, Some(path))
    }

    fn parse(text: &str, path: Option<&Path>) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.map(Path::to_path_buf),
            source: Box::new(e),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// A small, valid stack for the local demo: a tiny bf16 model, 4096-token prompts, host
    /// pools of 1024 pages (4 MiB each) and short deadlines.
    pub fn embedded_default(socket: PathBuf) -> Config {
        Config {
            geometry: PageGeometry {
                tokens_per_page: 16,
                layers: 2,
                kv_heads: 2,
                head_dim: 16,
                dtype: Dtype::Bf16,
            },
            limits: Limits {
                max_context: 4096,
                max_new_tokens: 256,
            },
            control: Control {
                socket,
                ..Control::default()
            },
            worker: WorkerConfig::default(),
            prefill: PoolConfig {
                pool_pages: 1024,
                poison: PoisonMode::Owner,
                scrub: Scrub::Off,
                backend: Backend::Host,
                cuda_device: 0,
                max_batch: None,
            },
            decode: PoolConfig {
                pool_pages: 1024,
                poison: PoisonMode::Owner,
                scrub: Scrub::Off,
                backend: Backend::Host,
                cuda_device: 0,
                max_batch: Some(DEFAULT_MAX_BATCH),
            },
            deadlines: Deadlines {
                // A burst beyond the decode slots waits here for its turn to decode (as the
                // production default, most of the request deadline), not only for pages.
                admission_wait: 10_000,
                bootstrap: 1000,
                prefill: 5000,
                transfer: 2000,
                decode: 10_000,
                request: 15_000,
                drain: 2000,
            },
            probe: Probe::default(),
            transfer: Transfer::default(),
            rdma: None,
            metrics: Metrics::default(),
            model: ModelConfig::default(),
            openai: OpenAi::default(),
            tls: Tls::default(),
            election: Election::default(),
        }
    }

    /// The pool of one side.
    pub fn pool(&self, side: Side) -> &PoolConfig {
        match side {
            Side::Prefill => &self.prefill,
            Side::Decode => &self.decode,
        }
    }

    /// Token positions one request may need on `side`: `max_context` for prefill,
    /// `max_context + max_new_tokens` for decode.
    pub fn max_tokens(&self, side: Side) -> u64 {
        let context = u64::from(self.limits.max_context);
        match side {
            Side::Prefill => context,
            Side::Decode => context + u64::from(self.limits.max_new_tokens),
        }
    }

    /// Checks every rule; returns the first broken one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_geometry(&self.geometry)?;
        if self.limits.max_context == 0 {
            return Err(ConfigError::ZeroLimit { key: "max_context" });
        }
        if self.limits.max_new_tokens == 0 {
            return Err(ConfigError::ZeroLimit {
                key: "max_new_tokens",
            });
        }
        for side in [Side::Prefill, Side::Decode] {
            self.validate_pool(side)?;
        }
        let max_prompt_tokens = crate::proto::MAX_PROMPT_TOKENS;
        if usize::try_from(self.limits.max_context).map_or(true, |c| c > max_prompt_tokens) {
            return Err(ConfigError::ContextExceedsFrame {
                max_context: self.limits.max_context,
                max_prompt_tokens,
            });
        }
        validate_deadlines(&self.deadlines)?;
        validate_control(&self.control)?;
        if self.model.kind == ModelKind::Gguf && self.model.path.is_none() {
            return Err(ConfigError::ModelPathMissing);
        }
        if let Some(id) = &self.worker.id
            && !crate::ids::is_valid_worker_id(id)
        {
            return Err(ConfigError::BadWorkerId { id: id.clone() });
        }
        if let Some(rdma) = &self.rdma {
            rdma.validate()?;
        }
        if self.transfer.transport == TransportKind::Rdma && self.rdma.is_none() {
            return Err(ConfigError::RdmaSectionMissing);
        }
        self.metrics.validate()?;
        self.openai.validate()?;
        self.tls.validate()?;
        self.election.validate(&self.tls)?;
        self.transfer.listen_addr().map(drop)
    }

    fn validate_pool(&self, side: Side) -> Result<(), ConfigError> {
        let g = &self.geometry;
        let pool = self.pool(side);
        let needed_tokens = self.max_tokens(side);
        let needed_pages = g.pages_for_tokens(needed_tokens);
        if needed_pages > u64::from(pool.pool_pages) {
            return Err(ConfigError::ContextExceedsPool {
                side,
                needed_tokens,
                needed_pages,
                pool_tokens: pool.pool_tokens(g),
                pool_pages: pool.pool_pages,
                tokens_per_page: g.tokens_per_page,
            });
        }
        match (side, pool.max_batch) {
            (Side::Prefill, Some(max_batch)) => {
                return Err(ConfigError::BadBatch {
                    max_batch,
                    reason: "is a [decode] key; prefill has no batch",
                });
            }
            (Side::Decode, Some(max_batch)) if !(1..=MAX_BATCH).contains(&max_batch) => {
                return Err(ConfigError::BadBatch {
                    max_batch,
                    reason: "must be between 1 and 256",
                });
            }
            _ => {}
        }
        let bytes_per_page = g.bytes_per_page();
        let pool_bytes = u128::from(pool.pool_pages) * u128::from(bytes_per_page);
        if pool_bytes > u128::from(MAX_POOL_BYTES) {
            return Err(ConfigError::PoolTooLarge {
                side,
                pool_pages: pool.pool_pages,
                bytes_per_page,
                pool_bytes,
            });
        }
        Ok(())
    }
}

/// Refuses zero dimensions and pages over [`MAX_PAGE_BYTES`] without overflowing:
/// [`PageGeometry::bytes_per_page`] multiplies unchecked, so it is only called once the
/// product is known to fit.
fn validate_geometry(g: &PageGeometry) -> Result<(), ConfigError> {
    let dims = [g.tokens_per_page, g.layers, g.kv_heads, g.head_dim];
    let fits = !dims.contains(&0)
        && dims
            .iter()
            .try_fold(2 * g.dtype.size() as u64, |acc, &d| {
                acc.checked_mul(u64::from(d))
            })
            .is_some_and(|bytes| bytes <= MAX_PAGE_BYTES);
    if fits && g.is_valid() {
        Ok(())
    } else {
        Err(ConfigError::InvalidGeometry { geometry: *g })
    }
}

fn validate_deadlines(d: &Deadlines) -> Result<(), ConfigError> {
    for (key, ms) in d.named() {
        if ms == 0 || ms > MAX_DEADLINE_MS {
            return Err(ConfigError::DeadlineOutOfRange { key, ms });
        }
    }
    if u64::from(d.request) < u64::from(d.bootstrap) + u64::from(d.transfer) {
        return Err(ConfigError::RequestDeadlineTooShort {
            request_ms: d.request,
            bootstrap_ms: d.bootstrap,
            transfer_ms: d.transfer,
        });
    }
    Ok(())
}

fn validate_control(c: &Control) -> Result<(), ConfigError> {
    for (key, ids) in [
        ("allowed_uids", &c.allowed_uids),
        ("allowed_gids", &c.allowed_gids),
        ("worker_uids", &c.worker_uids),
    ] {
        if ids.len() > MAX_ALLOWED_IDS {
            return Err(ConfigError::TooManyIds {
                key,
                count: ids.len(),
            });
        }
    }
    if c.socket_mode & !SOCKET_MODE_BITS != 0 || c.socket_mode & 0o600 != 0o600 {
        return Err(ConfigError::BadSocketMode {
            mode: c.socket_mode,
        });
    }
    if c.socket_group.as_deref().is_some_and(str::is_empty) {
        return Err(ConfigError::SocketGroupEmpty);
    }
    if c.max_connections_per_uid == 0 || c.max_connections_per_uid > MAX_CONNECTIONS {
        return Err(ConfigError::BadConnectionLimit {
            count: c.max_connections_per_uid,
        });
    }
    if c.idle_timeout_ms > MAX_DEADLINE_MS {
        return Err(ConfigError::IdleTimeoutOutOfRange {
            ms: c.idle_timeout_ms,
        });
    }
    if c.admission_queue > MAX_ADMISSION_QUEUE {
        return Err(ConfigError::AdmissionQueueTooLong {
            queued: c.admission_queue,
        });
    }
    let len = c.socket.as_os_str().len();
    if len == 0 {
        return Err(ConfigError::SocketPathEmpty);
    }
    if !c.socket.is_absolute() {
        return Err(ConfigError::SocketPathRelative {
            path: c.socket.clone(),
        });
    }
    if len > MAX_SOCKET_PATH_BYTES {
        return Err(ConfigError::SocketPathTooLong {
            path: c.socket.clone(),
            len,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::error::Error as _;

    const EXAMPLE: &str = include_str!("../kvfence.example.toml");

    /// A config with only the required keys, one section per blank-line-separated block.
    fn minimal(tpp: u32, max_context: u32, max_new: u32, prefill: u32, decode: u32) -> String {
        format!(
            "[geometry]\ntokens_per_page = {tpp}\nlayers = 32\nkv_heads = 8\nhead_dim = 128\n\
             dtype = \"bf16\"\n\n[limits]\nmax_context = {max_context}\n\
             max_new_tokens = {max_new}\n\n[prefill]\npool_pages = {prefill}\n\n\
             [decode]\npool_pages = {decode}\n"
        )
    }

    fn llama(max_context: u32, max_new: u32, prefill: u32, decode: u32) -> Config {
        let mut c = Config::embedded_default(PathBuf::from(DEFAULT_SOCKET));
        c.geometry = PageGeometry {
            tokens_per_page: 16,
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
            dtype: Dtype::Bf16,
        };
        c.limits = Limits {
            max_context,
            max_new_tokens: max_new,
        };
        c.prefill.pool_pages = prefill;
        c.decode.pool_pages = decode;
        c
    }

    /// Every dotted key path in a TOML table.
    fn key_paths(table: &toml::Table, prefix: &str, out: &mut Vec<String>) {
        for (k, v) in table {
            let path = format!("{prefix}{k}");
            if let toml::Value::Table(t) = v {
                key_paths(t, &format!("{path}."), out);
            } else {
                out.push(path);
            }
        }
    }

    #[test]
    fn metrics_addresses_are_one_per_daemon() {
        let base = minimal(16, 1024, 64, 64, 68);
        let with = |m: &str| Config::from_toml_str(&format!("{base}\n[metrics]\n{m}\n"));
        let c = with("listen = \"127.0.0.1:9470\"").unwrap();
        assert_eq!(
            c.metrics.listen_addr().unwrap(),
            Some("127.0.0.1:9470".parse().unwrap())
        );
        // kvctld's address is not a worker's: one file serves all three.
        assert_eq!(c.metrics.worker_addr(Side::Prefill).unwrap(), None);
        assert_eq!(c.metrics.worker_addr(Side::Decode).unwrap(), None);
        let c = with(
            "listen = \"127.0.0.1:9470\"\nprefill_listen = \"127.0.0.1:9471\"\n\
             decode_listen = \"127.0.0.1:9472\"",
        )
        .unwrap();
        assert_eq!(
            c.metrics.worker_addr(Side::Decode).unwrap(),
            Some("127.0.0.1:9472".parse().unwrap())
        );
        // Port 0 may repeat; a fixed port may not.
        with("listen = \"127.0.0.1:0\"\nprefill_listen = \"127.0.0.1:0\"").unwrap();
        let e = with("prefill_listen = \"127.0.0.1:9471\"\ndecode_listen = \"127.0.0.1:9471\"")
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "metrics.prefill_listen and metrics.decode_listen are both 127.0.0.1:9471: each \
             daemon reading this file needs an address of its own (or port 0)"
        );
        let e = with("decode_listen = \"localhost:9472\"").unwrap_err();
        assert_eq!(
            e.to_string(),
            "metrics.decode_listen \"localhost:9472\" is not IP:PORT (e.g. \"127.0.0.1:9470\")"
        );
    }

    #[test]
    fn the_example_states_the_largest_max_context_a_daemon_takes() {
        let stated: u32 = EXAMPLE
            .split("max_context is also at most ")
            .nth(1)
            .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok())
            .expect("the example states the largest max_context");
        assert_eq!(
            usize::try_from(stated).unwrap(),
            crate::proto::MAX_PROMPT_TOKENS,
            "the example's stated limit is not the frame's"
        );
        let pages = stated.div_ceil(16) + 64;
        llama(stated, 64, pages, pages + 4).validate().unwrap();
        assert!(matches!(
            llama(stated + 1, 64, pages + 1, pages + 5).validate(),
            Err(ConfigError::ContextExceedsFrame { .. })
        ));
    }

    #[test]
    fn example_file_parses_and_validates() {
        let c = Config::from_toml_str(EXAMPLE).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            c.geometry.bytes_per_page(),
            2 << 20,
            "Llama-3-8B-shaped page is 2 MiB"
        );
        assert!(c.max_tokens(Side::Prefill) <= c.prefill.pool_tokens(&c.geometry));
        assert!(c.max_tokens(Side::Decode) <= c.decode.pool_tokens(&c.geometry));
    }

    #[test]
    fn example_file_sets_every_key() {
        let example: toml::Table = toml::from_str(EXAMPLE).unwrap();
        let mut all = Config::embedded_default(DEFAULT_SOCKET.into());
        // optional sections: the example documents them too
        all.rdma = Some(RdmaConfig::for_device("mlx5_0"));
        let all = toml::Table::try_from(all).unwrap();
        let (mut want, mut got) = (Vec::new(), Vec::new());
        key_paths(&all, "", &mut want);
        key_paths(&example, "", &mut got);
        want.sort();
        got.sort();
        assert_eq!(
            got, want,
            "kvfence.example.toml must set and document every key"
        );
    }

    #[test]
    fn etcd_may_name_several_members_and_tls() {
        let base = minimal(16, 4096, 256, 1024, 1024);
        let tls = "[tls]\nserver_name = \"kvctld.example\"\ncert = \"/c.pem\"\nkey = \"/c.key\"\n\
                   ca = \"/ca.pem\"";
        let with = |election: &str| {
            Config::from_toml_str(&format!("{base}\n[election]\n{election}\n{tls}\n"))
        };
        let err = |e: &str| with(e).unwrap_err().to_string();
        let c = with("etcd = [\"192.0.2.10:2379\", \"http://192.0.2.11:2379/\"]").unwrap();
        let list = c.election.etcd.as_ref().unwrap();
        assert_eq!(list.addrs(), ["192.0.2.10:2379", "192.0.2.11:2379"]);
        assert!(!list.uses_tls());
        let c = with(
            "etcd = [\"https://etcd-a.example:2379\", \"https://192.0.2.11:2379\"]\n\
             etcd_ca = \"/etcd-ca.pem\"\netcd_cert = \"/e.pem\"\netcd_key = \"/e.key\"",
        )
        .unwrap();
        assert!(c.election.etcd.as_ref().unwrap().uses_tls());
        // The one-string form is still one member.
        let c = with("etcd = \"192.0.2.10:2379\"").unwrap();
        assert_eq!(
            c.election.etcd,
            Some(EtcdList::One("192.0.2.10:2379".into()))
        );
        for (election, says) in [
            ("etcd = []", "give 1 to 16"),
            ("etcd = [\"192.0.2.10\"]", "is not HOST:PORT"),
            ("etcd = [\"unix:///run/etcd.sock\"]", "is not HOST:PORT"),
            ("etcd = [\"https://192.0.2.10:2379\"]", "set etcd_ca"),
            (
                "etcd = [\"https://192.0.2.10:2379\", \"192.0.2.11:2379\"]\netcd_ca = \"/a.pem\"",
                "mixes",
            ),
            (
                "etcd = \"192.0.2.10:2379\"\netcd_ca = \"/a.pem\"",
                "write them https://",
            ),
            (
                "etcd = \"https://192.0.2.10:2379\"\netcd_ca = \"/a.pem\"\netcd_cert = \"/e.pem\"",
                "both or neither",
            ),
            (
                "etcd = [\"192.0.2.10:2379\", \"http://192.0.2.10:2379\"]",
                "twice",
            ),
        ] {
            let e = err(election);
            assert!(e.contains(says), "{election}: {e}");
        }
    }

    #[test]
    fn an_election_needs_etcd_a_sane_lease_and_tls() {
        let base = minimal(16, 4096, 256, 1024, 1024);
        let files = "cert = \"/c.pem\"\nkey = \"/c.key\"\nca = \"/ca.pem\"";
        let with = |election: &str, tls: &str| {
            Config::from_toml_str(&format!("{base}\n[election]\n{election}\n[tls]\n{tls}\n"))
        };
        let err = |e: &str, t: &str| with(e, t).unwrap_err().to_string();
        let etcd = "etcd = \"192.0.2.10:2379\"";
        let peer = format!("server_name = \"kvctld.example\"\n{files}");
        let c = with(etcd, &peer).unwrap();
        assert!(c.election.enabled());
        assert!(!Config::from_toml_str(&base).unwrap().election.enabled());
        assert!(err("etcd = \"etcd\"", &peer).contains("HOST:PORT"));
        assert!(err(&format!("{etcd}\nttl_s = 1"), &peer).contains("below 2"));
        assert!(err(&format!("{etcd}\nttl_s = 3\nmargin_ms = 1000"), &peer).contains("a third"));
        assert!(err(&format!("{etcd}\nmembers = \"/kvfence/w\""), &peer).contains("end in '/'"));
        assert!(err(&format!("{etcd}\nmembers = \"/kvfence/\""), &peer).contains("leader key"));
        assert!(err(etcd, files).contains("server_name"));
        assert!(err(etcd, "server_name = \"kvctld.example\"").contains("`cert`"));
        // kvctld publishes its listener, or `advertise` where it listens on every address
        assert!(
            c.election
                .advertised(&c.tls)
                .unwrap_err()
                .to_string()
                .contains("listen")
        );
        let listen = format!("{peer}\nlisten = \"192.0.2.1:7443\"\nworkers = [\"w.example\"]");
        let c = with(etcd, &listen).unwrap();
        assert_eq!(c.election.advertised(&c.tls).unwrap(), "192.0.2.1:7443");
        let any = listen.replace("192.0.2.1:7443", "0.0.0.0:7443");
        let c = with(etcd, &any).unwrap();
        assert!(
            c.election
                .advertised(&c.tls)
                .unwrap_err()
                .to_string()
                .contains("advertise")
        );
        let c = with(
            &format!("{etcd}\nadvertise = \"kvctld-a.example:7443\""),
            &any,
        )
        .unwrap();
        assert_eq!(
            c.election.advertised(&c.tls).unwrap(),
            "kvctld-a.example:7443"
        );
    }

    #[test]
    fn tls_needs_its_files_and_dns_names() {
        let base = minimal(16, 4096, 256, 1024, 1024);
        let with = |tls: &str| Config::from_toml_str(&format!("{base}\n[tls]\n{tls}\n"));
        let files = "cert = \"/c.pem\"\nkey = \"/c.key\"\nca = \"/ca.pem\"";
        let err = |tls: &str| with(tls).unwrap_err().to_string();
        assert!(err("listen = \"192.0.2.1:7443\"\nworkers = [\"a.example\"]").contains("`cert`"));
        assert!(err("connect = \"kvctld:7443\"\ncert = \"/c\"\nkey = \"/k\"").contains("`ca`"));
        assert!(
            err(&format!("listen = \"192.0.2.1:7443\"\n{files}")).contains("let no certificate in")
        );
        assert!(
            err(&format!(
                "listen = \"192.0.2.1:7443\"\n{files}\nworkers = [\"192.0.2.9\"]"
            ))
            .contains("not a DNS name")
        );
        assert!(err(&format!("listen = \"kvctld:7443\"\n{files}")).contains("IP:PORT"));
        assert!(err(&format!("connect = \"kvctld\"\n{files}")).contains("HOST:PORT"));
        let c = with(&format!("connect = \"kvctld.example:7443\"\n{files}")).unwrap();
        assert_eq!(c.tls.server_name().as_deref(), Some("kvctld.example"));
        let c = with(&format!(
            "listen = \"192.0.2.1:0\"\n{files}\nworkers = [\"prefill-0.example\"]"
        ))
        .unwrap();
        assert!(c.tls.enabled());
        assert!(!Config::from_toml_str(&base).unwrap().tls.enabled());
    }

    #[test]
    fn rdma_section_is_optional_with_defaults() {
        let base = minimal(16, 4096, 256, 1024, 1024);
        assert_eq!(Config::from_toml_str(&base).unwrap().rdma, None);
        let c = Config::from_toml_str(&format!("{base}\n[rdma]\ndevice = \"rxe0\"\n")).unwrap();
        assert_eq!(c.rdma, Some(RdmaConfig::for_device("rxe0")));
        let rdma = c.rdma.unwrap();
        assert_eq!((rdma.port, rdma.gid_index), (1, 1));
        let c = Config::from_toml_str(&format!(
            "{base}\n[rdma]\ndevice = \"mlx5_1\"\nport = 2\ngid_index = 3\n"
        ))
        .unwrap();
        let rdma = c.rdma.unwrap();
        assert_eq!(
            (rdma.device.as_str(), rdma.port, rdma.gid_index),
            ("mlx5_1", 2, 3)
        );
    }

    #[test]
    fn rdma_section_is_strict() {
        let base = minimal(16, 4096, 256, 1024, 1024);
        for (body, what) in [
            ("device = \"rxe0\"\ngid = 1\n", "unknown key"),
            ("port = 1\n", "device missing"),
            ("device = \"rxe0\"\nport = 256\n", "port out of range"),
            ("device = \"rxe0\"\ngid_index = -1\n", "negative GID index"),
        ] {
            let err = Config::from_toml_str(&format!("{base}\n[rdma]\n{body}")).unwrap_err();
            assert!(matches!(err, ConfigError::Parse { .. }), "{what}: {err}");
        }
        let err = Config::from_toml_str(&format!("{base}\n[rdma]\ndevice = \"\"\n")).unwrap_err();
        assert!(matches!(err, ConfigError::RdmaDeviceEmpty), "{err}");
        let err = Config::from_toml_str(&format!("{base}\n[rdma]\ndevice = \"rxe0\"\nport = 0\n"))
            .unwrap_err();
        assert!(matches!(err, ConfigError::RdmaPortZero), "{err}");
    }

    #[test]
    fn embedded_default_validates_and_round_trips() {
        let c = Config::embedded_default(PathBuf::from("/tmp/kvfence-test/kvctld.sock"));
        c.validate().unwrap();
        let text = toml::to_string(&c).unwrap();
        assert_eq!(Config::from_toml_str(&text).unwrap(), c);
    }

    #[test]
    fn defaults_are_applied() {
        let c = Config::from_toml_str(&minimal(16, 4096, 256, 1024, 1024)).unwrap();
        assert_eq!(c.control, Control::default());
        assert_eq!(c.control.socket, Path::new(DEFAULT_SOCKET));
        assert_eq!(c.control.admission_queue, 1024);
        assert_eq!(c.deadlines, Deadlines::default());
        assert_eq!(c.deadlines.as_durations().request, Duration::from_secs(60));
        assert_eq!(
            c.deadlines.request() - c.deadlines.admission_wait(),
            Duration::from_secs(10),
            "a request admitted at the end of its admission wait has 10 s to be served"
        );
        assert_eq!(c.deadlines.transfer(), Duration::from_secs(5));
        assert_eq!(c.probe.interval(), None);
        assert_eq!(c.prefill.poison, PoisonMode::Off);
        assert_eq!(c.prefill.scrub, Scrub::Off);
        assert_eq!(c.prefill.backend, Backend::Host);
        assert_eq!(c.prefill.cuda_device, 0);
        assert_eq!(c.prefill.pool_bytes(&c.geometry), 1024 * (2 << 20));
    }

    #[test]
    fn enum_spellings() {
        let text = minimal(16, 4096, 256, 1024, 1024).replace(
            "[decode]\n",
            "[decode]\npoison = \"owner\"\nscrub = \"on-free\"\nbackend = \"cuda\"\ncuda_device = 3\n",
        );
        let c = Config::from_toml_str(&text).unwrap();
        assert_eq!(c.decode.poison, PoisonMode::Owner);
        assert_eq!(c.decode.scrub, Scrub::OnFree);
        assert_eq!(c.decode.backend, Backend::Cuda);
        assert_eq!(c.decode.cuda_device, 3);
        assert_eq!(c.decode.max_batch(), DEFAULT_MAX_BATCH, "the default batch");
        for (batch, ok) in [
            (0, false),
            (1, true),
            (MAX_BATCH, true),
            (MAX_BATCH + 1, false),
        ] {
            let text = minimal(16, 4096, 256, 1024, 1024)
                .replace("[decode]\n", &format!("[decode]\nmax_batch = {batch}\n"));
            let parsed = Config::from_toml_str(&text);
            assert_eq!(parsed.is_ok(), ok, "max_batch {batch}: {parsed:?}");
            if !ok {
                assert!(
                    matches!(parsed, Err(ConfigError::BadBatch { max_batch, .. }) if max_batch == batch)
                );
            }
        }
        let prefill =
            minimal(16, 4096, 256, 1024, 1024).replace("[prefill]\n", "[prefill]\nmax_batch = 4\n");
        assert!(matches!(
            Config::from_toml_str(&prefill),
            Err(ConfigError::BadBatch { max_batch: 4, .. })
        ));
        let bad = minimal(16, 4096, 256, 1024, 1024)
            .replace("[decode]\n", "[decode]\nscrub = \"always\"\n");
        assert!(matches!(
            Config::from_toml_str(&bad),
            Err(ConfigError::Parse { .. })
        ));
    }

    /// The incident: a 1,048,576-token context window over a prefill pool of 681,280 tokens.
    #[test]
    fn incident_context_exceeding_prefill_pool_is_refused() {
        let err = llama(1_048_576, 8192, 42_580, 127_500)
            .validate()
            .unwrap_err();
        assert!(
            matches!(
                err,
                ConfigError::ContextExceedsPool {
                    side: Side::Prefill,
                    needed_tokens: 1_048_576,
                    needed_pages: 65_536,
                    pool_tokens: 681_280,
                    pool_pages: 42_580,
                    tokens_per_page: 16,
                }
            ),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("1048576") && msg.contains("681280"), "{msg}");
        assert_eq!(
            msg,
            "prefill pool holds 681280 tokens (42580 pages of 16) but max_context is 1048576 \
             tokens (65536 pages): a request this long could never be admitted; enlarge \
             [prefill] pool_pages or lower limits.max_context"
        );
        // The same numbers from TOML are refused too, before any daemon could start.
        let text = minimal(16, 1_048_576, 8192, 42_580, 127_500);
        assert!(matches!(
            Config::from_toml_str(&text),
            Err(ConfigError::ContextExceedsPool {
                side: Side::Prefill,
                ..
            })
        ));
    }

    /// The remediation's pools (2.04M tokens) hold the incident's context window, but a
    /// prompt of 1,048,576 tokens does not fit in one Submit frame: refused with both
    /// numbers. The largest window a frame carries is accepted over the same pools.
    #[test]
    fn incident_remediation_pool_holds_the_window_but_frames_limit_it() {
        let c = llama(1_048_576, 8192, 127_500, 127_500);
        assert_eq!(c.prefill.pool_tokens(&c.geometry), 2_040_000);
        let err = c.validate().unwrap_err();
        assert!(
            matches!(
                err,
                ConfigError::ContextExceedsFrame {
                    max_context: 1_048_576,
                    max_prompt_tokens: crate::proto::MAX_PROMPT_TOKENS,
                }
            ),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("1048576") && msg.contains("131072"), "{msg}");
        let fits = u32::try_from(crate::proto::MAX_PROMPT_TOKENS).unwrap();
        llama(fits, 8192, 127_500, 127_500).validate().unwrap();
        Config::from_toml_str(&minimal(16, fits, 8192, 127_500, 127_500)).unwrap();
        assert!(matches!(
            llama(fits + 1, 8192, 127_500, 127_500).validate(),
            Err(ConfigError::ContextExceedsFrame { .. })
        ));
    }

    #[test]
    fn a_config_without_the_prefill_deadline_gets_the_default() {
        let text = format!(
            "{}[deadlines]\nbootstrap = 1000\ntransfer = 2000\nrequest = 15000\n",
            minimal(16, 4096, 256, 1024, 1024)
        );
        let c = Config::from_toml_str(&text).unwrap();
        assert_eq!(c.deadlines.prefill(), Duration::from_secs(30));
        assert_eq!(c.deadlines.bootstrap(), Duration::from_secs(1));
        let text = format!(
            "{}[deadlines]\nprefill = 90000\n",
            minimal(16, 4096, 256, 1024, 1024)
        );
        assert_eq!(
            Config::from_toml_str(&text).unwrap().deadlines.prefill(),
            Duration::from_secs(90)
        );
    }

    #[test]
    fn socket_and_connection_settings_are_checked() {
        let base = llama(4096, 256, 1024, 1024);
        let check = |f: &dyn Fn(&mut Control)| {
            let mut c = base.clone();
            f(&mut c.control);
            c.validate()
        };
        assert_eq!(base.control.socket_mode, 0o660);
        assert_eq!(base.control.idle_timeout(), Some(Duration::from_secs(60)));
        for ok in [0o600, 0o660, 0o666, 0o777] {
            assert!(check(&|c| c.socket_mode = ok).is_ok(), "{ok:#o}");
        }
        for bad in [0o4660, 0o1777, 0o060, 0o400, 0o200] {
            let err = check(&|c| c.socket_mode = bad).unwrap_err();
            assert!(matches!(err, ConfigError::BadSocketMode { mode } if mode == bad));
            assert!(err.to_string().contains(&format!("{bad:#o}")), "{err}");
        }
        assert!(matches!(
            check(&|c| c.socket_group = Some(String::new())),
            Err(ConfigError::SocketGroupEmpty)
        ));
        assert!(check(&|c| c.socket_group = Some("kvfence".into())).is_ok());
        for bad in [0, MAX_CONNECTIONS + 1] {
            let err = check(&|c| c.max_connections_per_uid = bad).unwrap_err();
            assert!(matches!(err, ConfigError::BadConnectionLimit { count } if count == bad));
            assert!(err.to_string().contains("4096"), "{err}");
        }
        assert!(check(&|c| c.max_connections_per_uid = MAX_CONNECTIONS).is_ok());
        assert!(check(&|c| c.idle_timeout_ms = 0).is_ok());
        assert_eq!(
            {
                let mut c = base.control.clone();
                c.idle_timeout_ms = 0;
                c.idle_timeout()
            },
            None
        );
        assert!(matches!(
            check(&|c| c.idle_timeout_ms = MAX_DEADLINE_MS + 1),
            Err(ConfigError::IdleTimeoutOutOfRange { .. })
        ));
        // TOML's octal integers are the natural spelling of a mode.
        let text = format!(
            "{}[control]\nsocket_mode = 0o666\nsocket_group = \"kvfence\"\n",
            minimal(16, 4096, 256, 1024, 1024)
        );
        let c = Config::from_toml_str(&text).unwrap();
        assert_eq!(c.control.socket_mode, 0o666);
        assert_eq!(c.control.socket_group.as_deref(), Some("kvfence"));
    }

    #[test]
    fn decode_pool_must_hold_context_plus_new_tokens() {
        // 4096 + 256 tokens = 272 pages; 256 pages hold the prompt but not the generation.
        let err = llama(4096, 256, 256, 256).validate().unwrap_err();
        assert!(
            matches!(
                err,
                ConfigError::ContextExceedsPool {
                    side: Side::Decode,
                    needed_tokens: 4352,
                    needed_pages: 272,
                    pool_tokens: 4096,
                    pool_pages: 256,
                    tokens_per_page: 16,
                }
            ),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("max_context + max_new_tokens is 4352 tokens"),
            "{msg}"
        );
        assert!(
            msg.starts_with("decode pool holds 4096 tokens (256 pages of 16)"),
            "{msg}"
        );
    }

    #[test]
    fn pools_exactly_at_capacity_are_accepted_and_one_token_over_is_refused() {
        // Prefill: 4096 tokens = 256 pages exactly; decode: 4096 + 256 = 272 pages exactly.
        llama(4096, 256, 256, 272).validate().unwrap();
        let over_prefill = llama(4097, 255, 256, 272).validate().unwrap_err();
        assert!(matches!(
            over_prefill,
            ConfigError::ContextExceedsPool {
                side: Side::Prefill,
                needed_pages: 257,
                ..
            }
        ));
        let over_decode = llama(4096, 257, 256, 272).validate().unwrap_err();
        assert!(matches!(
            over_decode,
            ConfigError::ContextExceedsPool {
                side: Side::Decode,
                needed_pages: 273,
                ..
            }
        ));
        // A partial last page still needs a whole page.
        llama(4095, 1, 256, 256).validate().unwrap();
        llama(4081, 1, 256, 256).validate().unwrap();
        assert!(llama(4096, 1, 256, 256).validate().is_err());
    }

    #[test]
    fn transfer_section() {
        let base = minimal(16, 4096, 256, 1024, 1024);
        let c = Config::from_toml_str(&base).unwrap();
        assert_eq!(c.transfer.transport, TransportKind::Shm);
        assert_eq!(c.transfer.listen_addr().unwrap(), None);
        let tcp = format!("{base}[transfer]\ntransport = \"tcp\"\nlisten = \"192.0.2.1:7470\"\n");
        let c = Config::from_toml_str(&tcp).unwrap();
        assert_eq!(c.transfer.transport, TransportKind::Tcp);
        assert_eq!(
            c.transfer.listen_addr().unwrap(),
            Some("192.0.2.1:7470".parse().unwrap())
        );
        let text = toml::to_string(&c).unwrap();
        assert_eq!(Config::from_toml_str(&text).unwrap(), c);
        let rdma = format!(
            "{base}[transfer]\ntransport = \"rdma\"\nlisten = \"192.0.2.1:0\"\n\
             [rdma]\ndevice = \"rxe0\"\n"
        );
        let c = Config::from_toml_str(&rdma).unwrap();
        assert_eq!(c.transfer.transport, TransportKind::Rdma);
        assert_eq!(
            c.transfer.listen_addr().unwrap(),
            Some("192.0.2.1:0".parse().unwrap())
        );
        let refused = |section: &str| Config::from_toml_str(&format!("{base}{section}")).err();
        assert!(matches!(
            refused("[transfer]\ntransport = \"tcp\"\n"),
            Some(ConfigError::ListenMissing { transport: "tcp" })
        ));
        assert!(matches!(
            refused("[transfer]\nlisten = \"192.0.2.1:7470\"\n"),
            Some(ConfigError::ListenWithoutTcp)
        ));
        for bad in [
            "0.0.0.0:7470",
            "[::]:7470",
            "192.0.2.1",
            "prefill:7470",
            "224.0.0.1:1",
        ] {
            let section = format!("[transfer]\ntransport = \"tcp\"\nlisten = \"{bad}\"\n");
            match refused(&section) {
                Some(e @ ConfigError::BadListen { .. }) => {
                    assert!(e.to_string().contains(bad), "{e}");
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        assert!(matches!(
            refused("[transfer]\ntransport = \"rdma\"\n[rdma]\ndevice = \"rxe0\"\n"),
            Some(ConfigError::ListenMissing { transport: "rdma" })
        ));
        assert!(matches!(
            refused("[transfer]\ntransport = \"rdma\"\nlisten = \"192.0.2.1:7470\"\n"),
            Some(ConfigError::RdmaSectionMissing)
        ));
        assert!(matches!(
            refused("[transfer]\ntransport = \"infiniband\"\n"),
            Some(ConfigError::Parse { .. })
        ));
    }

    #[test]
    fn unknown_key_anywhere_is_refused() {
        let base = minimal(16, 4096, 256, 1024, 1024);
        Config::from_toml_str(&base).unwrap();
        let cases = [
            format!("colour = 1\n{base}"),
            base.replace("[geometry]\n", "[geometry]\nlayer = 32\n"),
            base.replace("[limits]\n", "[limits]\nmax_contex = 4096\n"),
            base.replace("[prefill]\n", "[prefill]\npool_page = 4\n"),
            base.replace("[decode]\n", "[decode]\nscrubb = \"off\"\n"),
            format!("{base}[control]\nsocket_path = \"/run/x.sock\"\n"),
            format!("{base}[deadlines]\ntransfer_ms = 5000\n"),
            format!("{base}[probe]\ninterval = 5\n"),
            format!("{base}[transfer]\nlisten_addr = \"192.0.2.1:1\"\n"),
            format!("{base}[prefil]\npool_pages = 4\n"),
        ];
        for text in cases {
            match Config::from_toml_str(&text) {
                Err(ConfigError::Parse { path: None, .. }) => {}
                other => panic!("accepted or wrong error {other:?} for:\n{text}"),
            }
        }
    }

    #[test]
    fn missing_required_keys_are_refused() {
        let base = minimal(16, 4096, 256, 1024, 1024);
        let required = [
            "tokens_per_page",
            "layers",
            "kv_heads",
            "head_dim",
            "dtype",
            "max_context",
            "max_new_tokens",
        ];
        for key in required {
            let text: String = base
                .lines()
                .filter(|l| !l.starts_with(&format!("{key} ")))
                .map(|l| format!("{l}\n"))
                .collect();
            assert_ne!(text, base);
            assert!(
                matches!(Config::from_toml_str(&text), Err(ConfigError::Parse { .. })),
                "{key}"
            );
        }
        for section in ["[geometry]", "[limits]", "[prefill]", "[decode]"] {
            let blocks: Vec<&str> = base
                .split("\n\n")
                .filter(|b| !b.starts_with(section))
                .collect();
            assert_eq!(blocks.len(), 3);
            let text = blocks.join("\n\n");
            let err = Config::from_toml_str(&text).unwrap_err();
            assert!(
                matches!(err, ConfigError::Parse { .. }),
                "{section}: {err:?}"
            );
            let name = section.trim_matches(['[', ']']);
            assert!(
                err.source().unwrap().to_string().contains(name),
                "{section}: {err:?}"
            );
        }
        // pool_pages is required on each side.
        let no_pool = base.replacen("pool_pages = 1024", "poison = \"off\"", 1);
        assert!(matches!(
            Config::from_toml_str(&no_pool),
            Err(ConfigError::Parse { .. })
        ));
        let msg = Config::from_toml_str("")
            .unwrap_err()
            .source()
            .unwrap()
            .to_string();
        assert!(msg.contains("geometry"), "{msg}");
    }

    #[test]
    fn zero_and_overlong_deadlines_are_refused() {
        let keys = [
            "admission_wait",
            "bootstrap",
            "prefill",
            "transfer",
            "decode",
            "request",
            "drain",
        ];
        for key in keys {
            for bad in [0, MAX_DEADLINE_MS + 1] {
                let text = format!(
                    "{}[deadlines]\n{key} = {bad}\n",
                    minimal(16, 4096, 256, 1024, 1024)
                );
                let err = Config::from_toml_str(&text).unwrap_err();
                assert!(
                    matches!(err, ConfigError::DeadlineOutOfRange { key: k, ms } if k == key && ms == bad),
                    "{key} = {bad}: {err:?}"
                );
                assert!(err.to_string().contains("3600000"), "{err}");
            }
        }
        let mut c = llama(4096, 256, 1024, 1024);
        c.deadlines = Deadlines {
            admission_wait: MAX_DEADLINE_MS,
            bootstrap: 1,
            prefill: 1,
            transfer: 1,
            decode: MAX_DEADLINE_MS,
            request: MAX_DEADLINE_MS,
            drain: MAX_DEADLINE_MS,
        };
        c.validate().unwrap();
    }

    #[test]
    fn request_deadline_must_cover_bootstrap_and_transfer() {
        let mut c = llama(4096, 256, 1024, 1024);
        c.deadlines.bootstrap = 2000;
        c.deadlines.transfer = 5000;
        c.deadlines.request = 6999;
        let err = c.validate().unwrap_err();
        assert!(matches!(
            err,
            ConfigError::RequestDeadlineTooShort {
                request_ms: 6999,
                ..
            }
        ));
        assert!(err.to_string().contains("2000 + 5000 = 7000 ms"), "{err}");
        c.deadlines.request = 7000;
        c.validate().unwrap();
    }

    #[test]
    fn invalid_geometry_is_refused_without_overflow() {
        let base = llama(4096, 256, 1024, 1024);
        let mut cases = Vec::new();
        for i in 0..4 {
            let mut g = base.geometry;
            *[
                &mut g.tokens_per_page,
                &mut g.layers,
                &mut g.kv_heads,
                &mut g.head_dim,
            ][i] = 0;
            cases.push(g);
        }
        // Products that overflow u64 must be refused, not wrap or panic.
        cases.push(PageGeometry {
            tokens_per_page: u32::MAX,
            layers: u32::MAX,
            kv_heads: u32::MAX,
            head_dim: u32::MAX,
            dtype: Dtype::F32,
        });
        cases.push(PageGeometry {
            tokens_per_page: 0,
            layers: u32::MAX,
            kv_heads: u32::MAX,
            head_dim: u32::MAX,
            dtype: Dtype::F32,
        });
        // 1 GiB + one element.
        cases.push(PageGeometry {
            tokens_per_page: 1,
            layers: 1,
            kv_heads: 1,
            head_dim: (1 << 28) + 1,
            dtype: Dtype::F16,
        });
        for g in cases {
            let mut c = base.clone();
            c.geometry = g;
            let err = c.validate().unwrap_err();
            assert!(
                matches!(err, ConfigError::InvalidGeometry { .. }),
                "{g:?}: {err:?}"
            );
        }
        // Exactly 1 GiB is allowed (the pool limit then caps it at 1024 pages).
        let mut c = llama(1, 1, 1, 2);
        c.geometry = PageGeometry {
            tokens_per_page: 1,
            layers: 1,
            kv_heads: 1,
            head_dim: 1 << 28,
            dtype: Dtype::F16,
        };
        c.validate().unwrap();
    }

    #[test]
    fn zero_limits_are_refused() {
        assert!(matches!(
            llama(0, 256, 1024, 1024).validate(),
            Err(ConfigError::ZeroLimit { key: "max_context" })
        ));
        assert!(matches!(
            llama(4096, 0, 1024, 1024).validate(),
            Err(ConfigError::ZeroLimit {
                key: "max_new_tokens"
            })
        ));
    }

    #[test]
    fn pool_over_one_tib_is_refused() {
        // 2 MiB pages: 524288 pages are exactly 1 TiB.
        llama(4096, 256, 1024, 524_288).validate().unwrap();
        let err = llama(4096, 256, 1024, 524_289).validate().unwrap_err();
        assert!(matches!(
            err,
            ConfigError::PoolTooLarge { side: Side::Decode, pool_pages: 524_289, pool_bytes, .. }
                if pool_bytes == 524_289 * (2 << 20)
        ));
        assert!(err.to_string().contains("1099511627776"), "{err}");
        let err = llama(4096, 256, u32::MAX, 1024).validate().unwrap_err();
        assert!(matches!(
            err,
            ConfigError::PoolTooLarge {
                side: Side::Prefill,
                ..
            }
        ));
    }

    #[test]
    fn control_limits_are_enforced() {
        let base = llama(4096, 256, 1024, 1024);
        let check = |f: &dyn Fn(&mut Control)| {
            let mut c = base.clone();
            f(&mut c.control);
            c.validate()
        };
        assert!(check(&|c| c.allowed_uids = (0..64).collect()).is_ok());
        assert!(matches!(
            check(&|c| c.allowed_uids = (0..65).collect()),
            Err(ConfigError::TooManyIds {
                key: "allowed_uids",
                count: 65
            })
        ));
        assert!(matches!(
            check(&|c| c.allowed_gids = (0..65).collect()),
            Err(ConfigError::TooManyIds {
                key: "allowed_gids",
                count: 65
            })
        ));
        assert!(matches!(
            check(&|c| c.admission_queue = MAX_ADMISSION_QUEUE + 1),
            Err(ConfigError::AdmissionQueueTooLong { .. })
        ));
        assert!(check(&|c| c.admission_queue = 0).is_ok());
        assert!(matches!(
            check(&|c| c.socket = PathBuf::new()),
            Err(ConfigError::SocketPathEmpty)
        ));
        assert!(matches!(
            check(&|c| c.socket = "run/kvctld.sock".into()),
            Err(ConfigError::SocketPathRelative { .. })
        ));
        let at_limit = format!("/{}", "a".repeat(MAX_SOCKET_PATH_BYTES - 1));
        assert!(check(&|c| c.socket = at_limit.clone().into()).is_ok());
        assert!(matches!(
            check(&|c| c.socket = format!("{at_limit}b").into()),
            Err(ConfigError::SocketPathTooLong { len: 101, .. })
        ));
    }

    #[test]
    fn load_reads_the_file_and_names_it_on_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kvfence.toml");
        std::fs::write(&path, EXAMPLE).unwrap();
        assert_eq!(
            Config::load(&path).unwrap(),
            Config::from_toml_str(EXAMPLE).unwrap()
        );

        let missing = dir.path().join("absent.toml");
        let err = Config::load(&missing).unwrap_err();
        assert!(matches!(err, ConfigError::Read { .. }));
        assert!(err.to_string().contains("absent.toml"));
        assert!(err.source().is_some());

        std::fs::write(&path, "[geometry\n").unwrap();
        let err = Config::load(&path).unwrap_err();
        assert!(matches!(&err, ConfigError::Parse { path: Some(p), .. } if *p == path));
        // The message names the file; the TOML diagnostic lives only in the source.
        let source = err.source().unwrap().to_string();
        assert!(!err.to_string().contains(&source));
        assert!(!source.is_empty());
    }

    fn pages(tokens: u64, tpp: u32) -> u64 {
        // Written independently of `div_ceil`, as the oracle for the code under test.
        let tpp = u64::from(tpp);
        let whole = tokens / tpp;
        if whole * tpp < tokens {
            whole + 1
        } else {
            whole
        }
    }

    /// A pool size near the boundary (`needed + delta`) or anywhere.
    fn pool_near(needed: u64, delta: i64, anywhere: Option<u32>) -> u32 {
        anywhere.unwrap_or_else(|| {
            let p = i128::from(needed) + i128::from(delta);
            u32::try_from(p.clamp(0, i128::from(u32::MAX))).unwrap()
        })
    }

    proptest! {
        #[test]
        fn accepts_iff_the_page_arithmetic_fits(
            tpp in 1u32..=4096,
            max_context in prop_oneof![1u32..=1 << 20, 1u32..=u32::MAX],
            max_new in 1u32..=u32::MAX,
            prefill_delta in -3i64..=3,
            decode_delta in -3i64..=3,
            prefill_any in proptest::option::weighted(0.2, any::<u32>()),
            decode_any in proptest::option::weighted(0.2, any::<u32>()),
        ) {
            let context = u64::from(max_context);
            let total = context + u64::from(max_new);
            let prefill = pool_near(pages(context, tpp), prefill_delta, prefill_any);
            let decode = pool_near(pages(total, tpp), decode_delta, decode_any);
            let mut c = llama(max_context, max_new, prefill, decode);
            // 4 bytes a token: token counts from two u32s then stay far below 1 TiB.
            c.geometry = PageGeometry { tokens_per_page: tpp, layers: 1, kv_heads: 1, head_dim: 1, dtype: Dtype::F16 };
            let page_bytes = u128::from(4 * tpp);
            let too_big = |p: u32| u128::from(p) * page_bytes > u128::from(MAX_POOL_BYTES);

            let prefill_fits = context <= u64::from(prefill) * u64::from(tpp);
            let decode_fits = total <= u64::from(decode) * u64::from(tpp);
            let result = c.validate();
            match (prefill_fits, decode_fits) {
                (false, _) => prop_assert!(matches!(
                    result,
                    Err(ConfigError::ContextExceedsPool { side: Side::Prefill, .. })
                ), "{:?}", result),
                (true, _) if too_big(prefill) => prop_assert!(matches!(
                    result,
                    Err(ConfigError::PoolTooLarge { side: Side::Prefill, .. })
                ), "{:?}", result),
                (true, false) => prop_assert!(matches!(
                    result,
                    Err(ConfigError::ContextExceedsPool { side: Side::Decode, .. })
                ), "{:?}", result),
                (true, true) if too_big(decode) => prop_assert!(matches!(
                    result,
                    Err(ConfigError::PoolTooLarge { side: Side::Decode, .. })
                ), "{:?}", result),
                (true, true) if context > crate::proto::MAX_PROMPT_TOKENS as u64 => {
                    prop_assert!(matches!(
                        result,
                        Err(ConfigError::ContextExceedsFrame { .. })
                    ), "{:?}", result)
                }
                (true, true) => prop_assert!(result.is_ok(), "{:?}", result),
            }
        }
    }
}
