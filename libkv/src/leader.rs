//! Finding the leading kvctld through etcd (`[election]`): its key holds the address peers
//! reach it at over TLS, and the key's create revision is the leader's epoch. Workers,
//! kvctl and openaid look it up before each connection.
//!
//! The campaign itself is kvctld's (`kvctld::ctl::leader`); this side only reads.

use crate::config::Election;
use crate::etcd::{Etcd, EtcdError};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long one lookup may take: a worker looks up only while kvctld is out of reach.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(1);

/// The leader as etcd names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leader {
    /// `HOST:PORT` of its TLS listener.
    pub addr: String,
    /// Its epoch: the revision that created its key.
    pub epoch: u64,
}

/// Reads the leader's key.
#[derive(Clone, Debug)]
pub struct LeaderLookup {
    etcd: Etcd,
    key: Vec<u8>,
}

impl LeaderLookup {
    /// `None` when `[election]` is off.
    pub fn from_config(cfg: &Election) -> Option<LeaderLookup> {
        Some(LeaderLookup {
            etcd: Etcd::for_election(cfg, LOOKUP_TIMEOUT)?,
            key: cfg.key.clone().into_bytes(),
        })
    }

    /// Where etcd is, for messages.
    pub fn place(&self) -> String {
        format!(
            "the leader under {} in etcd at {}",
            String::from_utf8_lossy(&self.key),
            self.etcd.endpoints()
        )
    }

    /// The leader now, or why there is none to reach.
    pub fn find(&self) -> Result<Leader, LookupError> {
        let kv = self
            .etcd
            .get(&self.key)?
            .ok_or_else(|| LookupError::NoLeader {
                place: self.place(),
            })?;
        let addr = String::from_utf8(kv.value).map_err(|_| LookupError::BadValue {
            place: self.place(),
        })?;
        Ok(Leader {
            addr,
            epoch: u64::try_from(kv.create_revision).unwrap_or(0),
        })
    }
}

/// Why no leader was found.
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    #[error("no kvctld leads: {place} does not exist (is a kvctld campaigning?)")]
    NoLeader { place: String },
    #[error("{place} is not an address")]
    BadValue { place: String },
}

/// Watches the leader's key from a thread of its own, so that a worker registered with one
/// kvctld notices when etcd names a newer one. A leader that is stopped (SIGSTOP, a hung
/// host) keeps its TCP connections open: the kernel still answers keepalives, and only
/// etcd, where its lease lapses and a standby's key appears, says it no longer leads.
///
/// Every `every` the thread reads the key; when the epoch it finds is newer than any seen
/// before it records it and wakes the worker's loop, which leaves the old kvctld
/// ([`crate::worker::Link`]). Errors (etcd out of reach, no leader for a moment) change
/// nothing: the worker stays where it is, and its lease keeps it listed or not.
#[derive(Debug)]
pub struct LeaderWatch {
    newest: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl LeaderWatch {
    /// Starts watching through `lookup` every `every`, waking `wake` whenever a newer epoch
    /// appears. `None` if the thread cannot start (the worker then learns of a new leader
    /// only when its connection ends, as before).
    pub fn start(
        lookup: LeaderLookup,
        every: Duration,
        wake: impl Fn() + Send + 'static,
    ) -> Option<LeaderWatch> {
        let newest = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (newest, stop) = (Arc::clone(&newest), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("leader-watch".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        if let Ok(leader) = lookup.find()
                            && newest.fetch_max(leader.epoch, Ordering::SeqCst) < leader.epoch
                        {
                            wake();
                        }
                        // sleep in short steps so that a stop is quick
                        let until = Instant::now() + every;
                        while !stop.load(Ordering::Relaxed) {
                            let left = until.saturating_duration_since(Instant::now());
                            if left.is_zero() {
                                break;
                            }
                            std::thread::sleep(left.min(Duration::from_millis(50)));
                        }
                    }
                })
                .map_err(|e| log::warn!("cannot start the leader watch: {e}"))
                .ok()?
        };
        Some(LeaderWatch {
            newest,
            stop,
            thread: Some(thread),
        })
    }

    /// The newest epoch etcd named since the watch started (0: none read yet).
    pub fn newest(&self) -> u64 {
        self.newest.load(Ordering::SeqCst)
    }

    /// How often a worker with an election of lease `ttl` reads the key: a tenth of the
    /// TTL, so that it follows a new leader well within a second of etcd naming it.
    pub fn interval(ttl: Duration) -> Duration {
        (ttl / 10).clamp(Duration::from_millis(50), Duration::from_millis(500))
    }
}

impl Drop for LeaderWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
