//! Cluster membership in etcd (`[election] members`): every worker publishes itself under
//! its own lease, so any host can list the cluster (`kvctl status`) and the leader can tell
//! a worker that stopped renewing from one that is merely quiet.
//!
//! - **Publishing** ([`Publisher`], a thread of each worker): grant a lease of the election's
//!   TTL, put `<members><id>` = [`Member`] as JSON under it, renew every third of the TTL.
//!   When etcd says the lease is gone (the worker was stopped, cut off or etcd lost it) the
//!   thread grants a new one and publishes again: a new key, with a new create revision. A
//!   worker that stops revokes its lease, so its key goes at once.
//! - **Watching** ([`sightings`], the leader's): one range read of the prefix gives each
//!   published id with the revision that created its key. The leader compares sightings
//!   (`kvctld::ctl::members`): a registered worker whose key vanished, or was created anew,
//!   let its lease lapse and is treated as lost.

use crate::config::Election;
use crate::etcd::{Etcd, EtcdError, LeaseId};
use crate::proto::{RegisterWorker, Role, Transport};
use log::{info, warn};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a worker publishes about itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub id: String,
    /// `prefill` or `decode`.
    pub role: String,
    /// The host's name.
    pub host: String,
    pub pid: u32,
    pub model: String,
    pub pool_pages: u32,
    pub page_bytes: u64,
    /// `shm`, `tcp`, `rdma`.
    pub transports: Vec<String>,
    /// A prefill worker's page server, `IP:PORT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
}

impl Member {
    /// The member a worker registering with `reg` publishes.
    pub fn of(reg: &RegisterWorker) -> Member {
        Member {
            id: reg.id.clone(),
            role: match reg.role {
                Role::Prefill => "prefill",
                Role::Decode => "decode",
                Role::Client => "client",
            }
            .into(),
            host: host_name(),
            pid: std::process::id(),
            model: reg.model.clone(),
            pool_pages: reg.pool_pages,
            page_bytes: reg.geometry.bytes_per_page(),
            transports: reg
                .transports
                .iter()
                .map(|t| {
                    match t {
                        Transport::Shm => "shm",
                        Transport::Tcp => "tcp",
                        Transport::Rdma => "rdma",
                    }
                    .to_owned()
                })
                .collect(),
            endpoint: reg.endpoint.as_ref().map(|e| e.addr.clone()),
        }
    }
}

/// This host's name (the kernel's), or `unknown`.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// The key of member `id` under `prefix`.
pub fn key_of(prefix: &str, id: &str) -> String {
    format!("{prefix}{id}")
}

/// Publishes one member and keeps its lease alive, on a thread of its own.
#[derive(Debug)]
pub struct Publisher {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    lease: Arc<Mutex<Option<LeaseId>>>,
    etcd: Etcd,
}

impl Publisher {
    /// Starts publishing `member`; `None` when `[election]` is off (or the thread could not
    /// start, said at warning level: the worker serves, unlisted).
    pub fn start(cfg: &Election, member: Member) -> Option<Publisher> {
        let ttl = cfg.ttl();
        let etcd = Etcd::for_election(cfg, ttl / 3)?;
        let stop = Arc::new(AtomicBool::new(false));
        let lease = Arc::new(Mutex::new(None));
        let key = key_of(&cfg.members, &member.id);
        let value = serde_json::to_vec(&member).ok()?;
        let thread = {
            let (etcd, stop, lease) = (etcd.clone(), Arc::clone(&stop), Arc::clone(&lease));
            let ttl_s = i64::from(cfg.ttl_s);
            std::thread::Builder::new()
                .name("membership".into())
                .spawn(move || publish(&etcd, &key, &value, ttl_s, &stop, &lease))
                .map_err(|e| warn!("cannot start the membership thread: {e}"))
                .ok()?
        };
        Some(Publisher {
            stop,
            thread: Some(thread),
            lease,
            etcd,
        })
    }
}

impl Drop for Publisher {
    /// Stops renewing and revokes the lease: the member's key goes now.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let lease = self.lease.lock().ok().and_then(|mut l| l.take());
        if let Some(l) = lease
            && let Err(e) = self.etcd.revoke(l)
        {
            warn!("withdrawing from etcd: {e}; the key goes when its lease expires");
        }
    }
}

/// Sleeps `d` in short steps; false when `stop` was set meanwhile.
fn nap(d: Duration, stop: &AtomicBool) -> bool {
    let until = Instant::now() + d;
    while !stop.load(Ordering::SeqCst) {
        let now = Instant::now();
        if now >= until {
            return true;
        }
        std::thread::sleep((until - now).min(Duration::from_millis(50)));
    }
    false
}

/// The publishing loop: a lease, the key under it, renewals until the lease is gone (then
/// again) or `stop`. etcd out of reach is retried every third of the TTL, said once.
fn publish(
    etcd: &Etcd,
    key: &str,
    value: &[u8],
    ttl_s: i64,
    stop: &AtomicBool,
    current: &Mutex<Option<LeaseId>>,
) {
    let every = Duration::from_millis(u64::try_from(ttl_s).unwrap_or(2) * 1000 / 3);
    let mut said: Option<String> = None;
    let complain = |said: &mut Option<String>, what: &str, e: &EtcdError| {
        let text = format!("{what}: {e}");
        if said.as_deref() != Some(text.as_str()) {
            warn!(
                "membership: {text}; retrying every {} ms",
                every.as_millis()
            );
            *said = Some(text);
        }
    };
    while !stop.load(Ordering::SeqCst) {
        let lease = match etcd.grant(ttl_s) {
            Ok(l) => l,
            Err(e) => {
                complain(&mut said, "granting a lease", &e);
                nap(every, stop);
                continue;
            }
        };
        if let Ok(mut c) = current.lock() {
            *c = Some(lease);
        }
        if let Err(e) = etcd.put(key.as_bytes(), value, Some(lease)) {
            complain(&mut said, "publishing", &e);
            let _ = etcd.revoke(lease);
            nap(every, stop);
            continue;
        }
        info!("published as {key} in etcd (lease {:x})", lease.0);
        said = None;
        while nap(every, stop) {
            match etcd.keep_alive(lease) {
                Ok(Some(_)) => {}
                Ok(None) => {
                    warn!("membership: the lease of {key} lapsed; publishing again");
                    break;
                }
                Err(e) => complain(&mut said, "renewing the membership lease", &e),
            }
        }
    }
}

/// What one look at the members found: when it was sent, and each published id with the
/// revision that created its key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sighting {
    pub sent: Instant,
    pub created: HashMap<String, i64>,
}

/// Looks at every member under `prefix` now.
pub fn sightings(etcd: &Etcd, prefix: &str) -> Result<Sighting, EtcdError> {
    let sent = Instant::now();
    let created = etcd
        .prefix(prefix.as_bytes())?
        .into_iter()
        .filter_map(|kv| {
            let id = kv.key.strip_prefix(prefix.as_bytes())?;
            Some((String::from_utf8(id.to_vec()).ok()?, kv.create_revision))
        })
        .collect();
    Ok(Sighting { sent, created })
}

/// One published id, with its member, or the text of a value that is not a [`Member`].
pub type Listed = (String, Result<Member, String>);

/// Every member under `prefix`, in id order.
pub fn list(etcd: &Etcd, prefix: &str) -> Result<Vec<Listed>, EtcdError> {
    Ok(etcd
        .prefix(prefix.as_bytes())?
        .into_iter()
        .map(|kv| {
            let id =
                String::from_utf8_lossy(kv.key.strip_prefix(prefix.as_bytes()).unwrap_or(&kv.key))
                    .into_owned();
            let member = serde_json::from_slice::<Member>(&kv.value)
                .map_err(|_| String::from_utf8_lossy(&kv.value).into_owned());
            (id, member)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PageGeometry;
    use crate::proto::TcpEndpoint;

    #[test]
    fn a_member_says_who_and_where_in_json_that_reads_back() {
        let reg = RegisterWorker {
            id: "prefill-0".into(),
            role: Role::Prefill,
            geometry: PageGeometry {
                tokens_per_page: 16,
                layers: 2,
                kv_heads: 2,
                head_dim: 8,
                dtype: crate::Dtype::F16,
            },
            pool_pages: 64,
            transports: vec![Transport::Tcp, Transport::Rdma],
            endpoint: Some(TcpEndpoint {
                addr: "192.0.2.4:7471".into(),
                token: [0; crate::proto::TOKEN_BYTES],
            }),
            model: "reference".into(),
            max_batch: 0,
        };
        let m = Member::of(&reg);
        assert_eq!(m.role, "prefill");
        assert_eq!(m.transports, ["tcp", "rdma"]);
        assert_eq!(m.endpoint.as_deref(), Some("192.0.2.4:7471"));
        assert_eq!(m.page_bytes, reg.geometry.bytes_per_page());
        let json = serde_json::to_string(&m).unwrap();
        // the page server's token is a secret: it never goes to etcd
        assert!(!json.contains("token"));
        assert_eq!(serde_json::from_str::<Member>(&json).unwrap(), m);
        assert_eq!(
            key_of("/kvfence/workers/", "prefill-0"),
            "/kvfence/workers/prefill-0"
        );
    }
}
