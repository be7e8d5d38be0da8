//! The worker runtime that prefilld and decoded share: the kvctld link and the event loop
//! ([`link`]), their error type and exit codes, start-up (model, pool, RDMA device, poller),
//! the command-line entry point both `main.rs` files call, counters, and the small helpers
//! every request handler uses (refusals, owner checks, pool reports).
//!
//! A worker is a [`Worker`] (its state and what it does with each frame) driven by
//! [`serve`]; everything around that is here, once.

pub mod link;

pub use link::{Link, LinkError, LinkEvent, Load, RunOptions, Shutdown, Worker, serve};

use crate::config::{Backend, Config, ConfigError, Side, TransportKind};
use crate::memory::HostMemory;
use crate::metrics::{Board, WorkerSample};
use crate::model::{ModelError, ModelRunner};
use crate::pool::{PagePool, PoolError, PoolOptions, Reservation};
use crate::proto::{ErrorCode, PoolReport, RegisterWorker, Role, TcpEndpoint, Transport};
use crate::rdma::{RdmaError, RdmaNode};
use crate::{Generation, Owner, RequestId};
use log::{debug, info};
use mio::{Poll, Waker};
use std::io;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Exit code: stopped cleanly (or `--check-config` found the configuration valid).
pub const EXIT_OK: u8 = 0;
/// Exit code: a runtime failure.
pub const EXIT_RUNTIME: u8 = 1;
/// Exit code: the configuration is invalid, cannot run in this build, or kvctld refused the
/// registration as one it can never accept.
pub const EXIT_CONFIG: u8 = 2;

/// Why a worker stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// `[tls]` is set and its files cannot be used.
    #[error("reaching kvctld over TLS")]
    Tls(#[source] crate::tls::TlsError),
    /// `backend = "cuda"` on a host that lacks the CUDA driver, NVRTC, the device or a
    /// capability the device pools need (what is missing is the source).
    #[error(
        "[{side}] backend = \"cuda\" (cuda_device = {device}) cannot run on this host; set \
         backend = \"host\" to run the pool in host memory"
    )]
    Cuda {
        side: Side,
        device: u32,
        #[source]
        source: crate::memory::cuda::CudaError,
    },
    /// `backend = "cuda"` on a host that has the device, for a worker whose model computes
    /// on the host CPU and so writes its KV through host pages.
    #[error(
        "[{side}] backend = \"cuda\": the pool would be on CUDA device {device} ({name}), but \
         the model of [model] runs on the host CPU and writes KV only into host pages; set \
         backend = \"host\""
    )]
    HostModel {
        side: Side,
        device: u32,
        name: String,
    },
    /// The host pool is larger than the memory this host (or this process's cgroup) has.
    #[error(
        "[{side}] pool of {pool_bytes} bytes ({pool_pages} pages) exceeds the {limit_bytes} \
         bytes of {limit}: lower [{side}] pool_pages (and limits.max_context to fit)"
    )]
    PoolExceedsMemory {
        side: Side,
        pool_bytes: u64,
        pool_pages: u32,
        limit_bytes: u64,
        limit: String,
    },
    /// The page geometry cannot run the reference model.
    #[error("the page geometry cannot run the reference model")]
    Model(#[source] ModelError),
    /// The model of `[model]` could not be loaded, or does not fit `[geometry]`.
    #[error("loading the model of [model]")]
    ModelLoad(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// Creating the pool's shared memory failed.
    #[error("creating {bytes} bytes of pool memory")]
    Memory {
        bytes: u64,
        #[source]
        source: io::Error,
    },
    /// Re-opening the pool memory read-only failed.
    #[error("re-opening the pool memory read-only")]
    ReadOnlyFd(#[source] io::Error),
    /// Creating the page pool failed.
    #[error("creating the page pool")]
    Pool(#[source] PoolError),
    /// The configuration does not name a usable page server address.
    #[error("the [transfer] section")]
    Transfer(#[source] ConfigError),
    /// Starting the TCP page server failed.
    #[error("starting the page server on {addr}")]
    PageServer {
        addr: std::net::SocketAddr,
        #[source]
        source: io::Error,
    },
    /// The configured RDMA device, port or GID cannot be used.
    #[error("opening the RDMA device of [rdma]")]
    Rdma(#[source] RdmaError),
    /// The TLS files of `[election]` for etcd cannot be used.
    #[error("[election]")]
    Etcd(#[source] crate::etcd::EtcdError),
    /// The `[metrics]` section does not name a usable address.
    #[error("the [metrics] section")]
    MetricsListen(#[source] ConfigError),
    /// Starting the `/metrics` listener of `[metrics] prefill_listen` or `decode_listen`
    /// failed.
    #[error("starting the metrics endpoint on {addr}")]
    Metrics {
        addr: std::net::SocketAddr,
        #[source]
        source: io::Error,
    },
    /// Starting the job threads failed.
    #[error("starting the job threads")]
    Threads(#[source] io::Error),
    /// The event loop failed, or kvctld refused the registration for good.
    #[error(transparent)]
    Link(#[from] LinkError),
}

impl WorkerError {
    /// Whether the error is the configuration's (exit [`EXIT_CONFIG`]) rather than the
    /// system's (exit [`EXIT_RUNTIME`]).
    pub fn is_config(&self) -> bool {
        match self {
            WorkerError::HostModel { .. }
            | WorkerError::PoolExceedsMemory { .. }
            | WorkerError::Model(_)
            | WorkerError::ModelLoad(_)
            | WorkerError::Transfer(_)
            | WorkerError::MetricsListen(_)
            | WorkerError::Etcd(_)
            | WorkerError::Tls(_) => true,
            WorkerError::Cuda { source, .. } => source.is_unavailable(),
            WorkerError::Rdma(e) => e.is_config(),
            WorkerError::Link(e) => e.is_config(),
            WorkerError::Memory { .. }
            | WorkerError::ReadOnlyFd(_)
            | WorkerError::Pool(_)
            | WorkerError::PageServer { .. }
            | WorkerError::Metrics { .. }
            | WorkerError::Threads(_) => false,
        }
    }

    /// The documented exit code for this error.
    pub fn exit_code(&self) -> u8 {
        if self.is_config() {
            EXIT_CONFIG
        } else {
            EXIT_RUNTIME
        }
    }
}

/// A worker's `run`: prefilld's or decoded's.
pub type RunFn = fn(Config, RunOptions) -> Result<(), WorkerError>;

/// What a worker's command line says (`--config PATH [--id ID] [--check-config]`, or
/// `--check-config PATH`).
#[derive(Clone, Debug)]
pub struct CommandLine {
    /// Path of the kvfence configuration file.
    pub config: PathBuf,
    /// The worker id, overriding `[worker] id`.
    pub id: Option<String>,
    /// The worker's metrics address, overriding `[metrics] prefill_listen` or
    /// `decode_listen`.
    pub metrics_listen: Option<String>,
    /// Load and validate the configuration, then exit.
    pub check_config: bool,
}

impl CommandLine {
    /// The command line from `--config` and `--check-config [PATH]` as clap parsed them
    /// (`check_config` is `Some(None)` for a bare `--check-config`): the file is `--config`'s
    /// or `--check-config`'s, and when both name one they must agree.
    pub fn from_args(
        config: Option<PathBuf>,
        check_config: Option<Option<PathBuf>>,
        id: Option<String>,
    ) -> Result<CommandLine, String> {
        let config = match (config, check_config.clone().flatten()) {
            (Some(c), Some(k)) if c != k => {
                return Err(format!(
                    "--config {} and --check-config {} name different files; give one",
                    c.display(),
                    k.display()
                ));
            }
            (Some(c), _) | (None, Some(c)) => c,
            (None, None) => {
                return Err(
                    "the configuration file is missing: give --config PATH (or --check-config PATH)"
                        .to_owned(),
                );
            }
        };
        Ok(CommandLine {
            config,
            id,
            metrics_listen: None,
            check_config: check_config.is_some(),
        })
    }
}

/// The memory a host pool must fit in: this host's `MemTotal`, or the memory limit of this
/// process's cgroup when that is lower. `None` when neither can be read.
pub fn memory_limit() -> Option<(u64, String)> {
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .map(|kib| {
                    (
                        kib.saturating_mul(1024),
                        "this host's memory (MemTotal)".to_owned(),
                    )
                })
        });
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("0::"))
                .map(|p| format!("/sys/fs/cgroup{}/memory.max", p.trim()))
        })
        .and_then(|path| {
            let v = std::fs::read_to_string(&path).ok()?;
            let bytes = v.trim().parse::<u64>().ok()?;
            Some((bytes, format!("this process's cgroup ({path})")))
        });
    match (total, cgroup) {
        (Some(t), Some(c)) if c.0 < t.0 => Some(c),
        (Some(t), _) => Some(t),
        (None, c) => c,
    }
}

/// What [`Startup::new`] refuses on this host, checked without allocating anything: a host
/// pool larger than the memory it must fit in ([`memory_limit`]); for `backend = "cuda"`, a
/// host without the CUDA driver or NVRTC (named), a device that does not exist or lacks the
/// virtual memory API, a pool larger than the device, and a model that runs on the host.
/// `--check-config` runs it, so that a file it calls valid starts.
pub fn preflight(cfg: &Config, side: Side) -> Result<(), WorkerError> {
    crate::etcd::check(&cfg.election).map_err(WorkerError::Etcd)?;
    let pool_cfg = cfg.pool(side);
    let pool_bytes = pool_cfg.pool_bytes(&cfg.geometry);
    if pool_cfg.backend == Backend::Cuda {
        let device = pool_cfg.cuda_device;
        let info = crate::memory::cuda::probe(device).map_err(|source| WorkerError::Cuda {
            side,
            device,
            source,
        })?;
        if pool_bytes > info.total_bytes {
            return Err(WorkerError::PoolExceedsMemory {
                side,
                pool_bytes,
                pool_pages: pool_cfg.pool_pages,
                limit_bytes: info.total_bytes,
                limit: format!("CUDA device {device} ({})", info.name),
            });
        }
        // Both workers' models (the reference model and llama) compute on the CPU.
        return Err(WorkerError::HostModel {
            side,
            device,
            name: info.name,
        });
    }
    if let Some((limit_bytes, limit)) = memory_limit()
        && pool_bytes > limit_bytes
    {
        return Err(WorkerError::PoolExceedsMemory {
            side,
            pool_bytes,
            pool_pages: pool_cfg.pool_pages,
            limit_bytes,
            limit,
        });
    }
    Ok(())
}

/// Everything a worker's `main` does after parsing its arguments and starting the logger:
/// loads and validates the configuration (with `--id` applied), runs the worker with signal
/// handling, prints an error chain once as `NAME: error: cause...`, and returns the
/// documented exit code.
pub fn main(name: &str, args: CommandLine, run: RunFn) -> ExitCode {
    let mut cfg = match Config::load(&args.config) {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("{name}: {}", crate::error_chain(&e));
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let side = if name == "decoded" {
        Side::Decode
    } else {
        Side::Prefill
    };
    if let Some(id) = args.id {
        cfg.worker.id = Some(id);
        if let Err(e) = cfg.validate() {
            eprintln!("{name}: --id: {}", crate::error_chain(&e));
            return ExitCode::from(EXIT_CONFIG);
        }
    }
    if let Some(addr) = args.metrics_listen {
        match side {
            Side::Prefill => cfg.metrics.prefill_listen = Some(addr),
            Side::Decode => cfg.metrics.decode_listen = Some(addr),
        }
        if let Err(e) = cfg.validate() {
            eprintln!("{name}: --metrics-listen: {}", crate::error_chain(&e));
            return ExitCode::from(EXIT_CONFIG);
        }
    }
    if args.check_config {
        if let Err(e) = preflight(&cfg, side) {
            eprintln!(
                "{name}: {}: would not start: {}",
                args.config.display(),
                crate::error_chain(&e)
            );
            return ExitCode::from(e.exit_code());
        }
        eprintln!("{name}: {}: configuration is valid", args.config.display());
        return ExitCode::from(EXIT_OK);
    }
    match run(cfg, RunOptions::default()) {
        Ok(()) => ExitCode::from(EXIT_OK),
        Err(e) => {
            eprintln!("{name}: {}", crate::error_chain(&e));
            ExitCode::from(e.exit_code())
        }
    }
}

/// What both workers set up the same way before their loop runs.
#[derive(Debug)]
pub struct Startup {
    /// The id to register under: `[worker] id` (or `--id`), else the role's name.
    pub id: String,
    /// Which worker this is.
    pub side: Side,
    /// The model of `[model]`, over the configured geometry.
    pub model: Arc<dyn ModelRunner>,
    /// The worker's page pool, on a sealed memfd.
    pub pool: PagePool,
    /// A read-only re-open of the pool's memfd: only for prefilld on shared memory, the one
    /// case in which the pool leaves the process (to decoded, through kvctld).
    pub read_only_fd: Option<OwnedFd>,
    /// The RDMA device with the pool registered, when `[transfer]` says RDMA and the host has
    /// it (prefilld may bind windows over its pool; decoded's is for local access only).
    pub rdma: Option<Arc<RdmaNode>>,
    /// The worker's poller.
    pub poll: Poll,
    /// Wakes the poller (job threads, page server, [`Shutdown`]).
    pub waker: Arc<Waker>,
    /// Where the worker's `/metrics` reads its status, when `[metrics] listen` is set.
    pub metrics: Option<Board<WorkerSample>>,
    /// A decode worker's batch slots (`[decode] max_batch`); 0 for a prefill worker.
    pub max_batch: u32,
}

impl Startup {
    /// Checks that `side`'s pool can run in this build and that `model` (loaded from
    /// `[model]` by the worker) runs on the configured geometry, then creates the pool, the
    /// RDMA device and the poller.
    pub fn new(
        cfg: &Config,
        side: Side,
        model: Arc<dyn ModelRunner>,
    ) -> Result<Startup, WorkerError> {
        let pool_cfg = cfg.pool(side);
        preflight(cfg, side)?;
        if *model.geometry() != cfg.geometry {
            return Err(WorkerError::ModelLoad(
                format!(
                    "the model {} runs on {:?}, [geometry] is {:?}",
                    model.model_id(),
                    model.geometry(),
                    cfg.geometry
                )
                .into(),
            ));
        }
        let bytes = pool_cfg.pool_bytes(&cfg.geometry);
        let (name, default_id) = match side {
            Side::Prefill => (c"kvfence-prefill", "prefill"),
            Side::Decode => (c"kvfence-decode", "decode"),
        };
        let memory =
            HostMemory::new(name, bytes).map_err(|source| WorkerError::Memory { bytes, source })?;
        let read_only_fd = match (side, cfg.transfer.transport) {
            (Side::Prefill, TransportKind::Shm) => {
                Some(memory.read_only_fd().map_err(WorkerError::ReadOnlyFd)?)
            }
            _ => None,
        };
        let pool = PagePool::new(
            cfg.geometry,
            pool_cfg.pool_pages,
            Box::new(memory),
            PoolOptions {
                poison: pool_cfg.poison,
                scrub: pool_cfg.scrub,
            },
        )
        .map_err(WorkerError::Pool)?;
        let rdma =
            crate::rdma::open_node(cfg, &pool, side == Side::Prefill).map_err(WorkerError::Rdma)?;
        let poll = Poll::new().map_err(LinkError::Setup)?;
        let waker = Arc::new(Waker::new(poll.registry(), link::WAKER).map_err(LinkError::Setup)?);
        let metrics = match cfg
            .metrics
            .worker_addr(side)
            .map_err(WorkerError::MetricsListen)?
        {
            None => {
                if let Some(kvctld) = &cfg.metrics.listen {
                    let key = match side {
                        Side::Prefill => "prefill_listen",
                        Side::Decode => "decode_listen",
                    };
                    info!(
                        "no metrics endpoint: [metrics] listen ({kvctld}) is kvctld's; set \
                         [metrics] {key} or --metrics-listen for this worker's"
                    );
                }
                None
            }
            Some(addr) => {
                let daemon = match side {
                    Side::Prefill => "prefilld",
                    Side::Decode => "decoded",
                };
                let (_, board) = crate::metrics::serve_worker(addr, daemon)
                    .map_err(|source| WorkerError::Metrics { addr, source })?;
                Some(board)
            }
        };
        Ok(Startup {
            id: cfg.worker.id_or(default_id),
            side,
            model,
            pool,
            read_only_fd,
            rdma,
            poll,
            waker,
            metrics,
            max_batch: match side {
                Side::Prefill => 0,
                Side::Decode => pool_cfg.max_batch(),
            },
        })
    }

    /// The link to kvctld that registers with `register` (attaching the read-only pool fd,
    /// if this worker has one) and publishes to the worker's `/metrics`, when it is on.
    /// Over TLS when `[tls] connect` is set: its certificate, key and CA are read now, so
    /// that a worker whose files are missing or wrong refuses to start.
    pub fn link(&mut self, cfg: &Config, register: RegisterWorker) -> Result<Link, WorkerError> {
        let leader = crate::leader::LeaderLookup::from_config(&cfg.election);
        let tls = match leader {
            // the address comes from etcd at each connection
            Some(_) => Some(crate::tls::Connector::new(&cfg.tls, String::new())),
            None => crate::tls::Connector::from_config(&cfg.tls).transpose(),
        }
        .transpose()
        .map_err(WorkerError::Tls)?;
        let mut link = Link::new(cfg, register, self.read_only_fd.take(), tls);
        if let Some(lookup) = leader {
            link.follow_leader(lookup, cfg.election.ttl());
            link.publish_membership(&cfg.election);
        }
        if let Some(board) = self.metrics.take() {
            link.publish_to(board, cfg);
        }
        Ok(link)
    }

    /// The `RegisterWorker` of this worker: its id, role, geometry and pool size, with the
    /// transports it speaks, (prefilld on TCP or RDMA) its page server and (decoded) its
    /// batch slots.
    pub fn registration(
        &self,
        transports: Vec<Transport>,
        endpoint: Option<TcpEndpoint>,
    ) -> RegisterWorker {
        RegisterWorker {
            id: self.id.clone(),
            role: match self.side {
                Side::Prefill => Role::Prefill,
                Side::Decode => Role::Decode,
            },
            geometry: *self.pool.geometry(),
            pool_pages: self.pool.pages(),
            transports,
            endpoint,
            model: self.model.model_id(),
            max_batch: self.max_batch,
        }
    }
}

/// Declares a worker's counters: a struct of `AtomicU64` fields with `Default`, and a
/// `snapshot()` that names each counter after its field, as a `PoolReport` carries them.
///
/// ```
/// libkv::worker_counters! {
///     /// What this worker counts.
///     pub struct Counters {
///         /// Requests served.
///         requests,
///     }
/// }
/// let c = Counters::default();
/// libkv::worker::add(&c.requests, 2);
/// assert_eq!(c.snapshot(), vec![("requests".to_owned(), 2)]);
/// ```
#[macro_export]
macro_rules! worker_counters {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $($(#[$field_meta:meta])* $field:ident,)*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Default)]
        $vis struct $name {
            $($(#[$field_meta])* pub $field: ::std::sync::atomic::AtomicU64,)*
        }

        impl $name {
            /// Every counter by name, in declaration order.
            pub fn snapshot(&self) -> ::std::vec::Vec<(::std::string::String, u64)> {
                ::std::vec![$((
                    ::std::string::String::from(::std::stringify!($field)),
                    self.$field.load(::std::sync::atomic::Ordering::Relaxed),
                ),)*]
            }
        }
    };
}

/// Adds `n` to a counter.
pub fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// Cuts `s` to at most [`crate::proto::MAX_TEXT_BYTES`] on a character boundary, for the
/// text of an `Error` or `Abort`.
pub fn text(s: String) -> String {
    if s.len() <= crate::proto::MAX_TEXT_BYTES {
        return s;
    }
    let mut end = crate::proto::MAX_TEXT_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// Answers `Error{code, message}` for request `id`.
pub fn refuse(link: &mut Link, id: RequestId, code: ErrorCode, message: String) {
    debug!("refusing {id}: {code}: {message}");
    link.send(
        id,
        crate::proto::Error {
            code,
            message: text(message),
        },
    );
}

/// The error code a worker answers for a reservation its pool refused.
pub fn pool_error_code(e: &PoolError) -> ErrorCode {
    match e {
        PoolError::Full { .. } => ErrorCode::PoolFull,
        PoolError::NeverFits { .. } => ErrorCode::BadRequest,
        _ => ErrorCode::Internal,
    }
}

/// Pages of a reservation, as the wire counts them.
pub fn page_count(res: &Reservation) -> u32 {
    u32::try_from(res.pages().len()).unwrap_or(u32::MAX)
}

/// Refuses an owner of another generation than `current` (the one kvctld registered this
/// worker under), or one that is not the frame's request `id`.
pub fn check_owner(current: Option<Generation>, id: RequestId, owner: Owner) -> Result<(), String> {
    match current {
        Some(g) if g == owner.generation => {}
        Some(g) => {
            return Err(format!(
                "owner {owner} is not of the current generation {}",
                g.0
            ));
        }
        None => return Err("not registered".to_owned()),
    }
    if owner.request != id {
        return Err(format!("frame for {id} names owner {owner}"));
    }
    Ok(())
}

/// Sends kvctld the pool's page counts by state and the worker's counters, after
/// `frames_received` (counted by the link).
pub fn send_report(link: &mut Link, pool: &PagePool, counters: Vec<(String, u64)>) {
    let u = pool.usage();
    link.reported(u);
    let mut all = Vec::with_capacity(counters.len() + 1);
    all.push(("frames_received".to_owned(), link.frames_received()));
    all.extend(counters);
    link.send(
        RequestId(0),
        PoolReport {
            free: u.free,
            reserved: u.reserved,
            writing: u.writing,
            readable: u.readable,
            draining: u.draining,
            counters: all,
        },
    );
}

/// Sends a `PoolReport` (with the counters `counters` gives) only if the pool's page counts
/// differ from the last one sent: [`Worker::refresh_report`] for both workers.
pub fn report_if_changed(
    link: &mut Link,
    pool: &PagePool,
    counters: impl FnOnce() -> Vec<(String, u64)>,
) {
    if link.last_reported() != Some(pool.usage()) {
        send_report(link, pool, counters());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_for_good_is_a_config_error() {
        let e = WorkerError::from(LinkError::Misconfigured {
            id: "decode-0".into(),
            message: "pool too small".into(),
        });
        assert_eq!(e.exit_code(), EXIT_CONFIG);
        assert_eq!(
            crate::error_chain(&e),
            "kvctld refused the registration of worker decode-0: pool too small"
        );
        let e = WorkerError::from(LinkError::Wait(io::Error::other("boom")));
        assert_eq!(e.exit_code(), EXIT_RUNTIME);
        assert_eq!(crate::error_chain(&e), "waiting for events: boom");
    }

    #[test]
    fn text_is_cut_on_a_character_boundary() {
        let s = "é".repeat(crate::proto::MAX_TEXT_BYTES);
        let t = text(s);
        assert!(t.len() <= crate::proto::MAX_TEXT_BYTES);
        assert!(t.chars().all(|c| c == 'é'));
    }
}
