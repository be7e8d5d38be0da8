//! Leadership through etcd (`[election]`): a kvctld campaigns before it serves, leads under
//! a lease, and stops on its own when it can no longer be sure it leads.
//!
//! - **Campaign.** Grant a lease of `ttl_s`, then create the leader key under it with this
//!   kvctld's TLS address as its value, only if the key is absent (one etcd transaction).
//!   The store's revision of that put is the epoch: kvctld's generation, larger at every
//!   win, which workers fence on ([`libkv::fence::EpochFence`]). While another holds the key
//!   this kvctld is a standby: it polls the key every [`poll_interval`] and campaigns again
//!   once the key is gone (its holder's lease revoked or expired).
//! - **Term.** A thread renews the lease every third of the TTL. Each renewal extends the
//!   window from when it was *sent* ([`libkv::fence::Lease`]), to `ttl - margin`: the store's
//!   lease cannot have expired before the window closes, whatever the network delayed. The
//!   event loop admits only while the window is open; when it closes (etcd out of reach,
//!   this host cut off, the lease gone) kvctld fails every request it holds with a
//!   retryable error and exits, without waiting for etcd to say that it lost.
//! - **Resignation.** A kvctld that stops on SIGTERM revokes its lease after draining, so
//!   the standby need not wait out the TTL.

use libkv::Generation;
use libkv::config::Election;
use libkv::etcd::{Etcd, EtcdError, LeaseId};
use libkv::fence::Lease;
use log::{debug, info, warn};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often a standby looks at the leader key: a tenth of the TTL, between 100 ms and 1 s.
pub fn poll_interval(ttl: Duration) -> Duration {
    (ttl / 10).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

/// The window this kvctld may admit in, shared between the renewing thread and the loop.
#[derive(Clone, Debug)]
pub struct Term {
    lease: Arc<Mutex<Lease>>,
    epoch: Generation,
}

impl Term {
    pub fn epoch(&self) -> Generation {
        self.epoch
    }

    /// Whether this kvctld still leads at `now`.
    pub fn may_admit(&self, now: Instant) -> bool {
        self.lease
            .lock()
            .map(|l| l.may_admit(now) == Some(self.epoch))
            .unwrap_or(false)
    }

    /// When the window closes unless renewed.
    pub fn valid_until(&self) -> Option<Instant> {
        self.lease.lock().ok().and_then(|l| l.valid_until())
    }
}

/// A won election: the term, and the thread that renews it.
#[derive(Debug)]
pub struct Leadership {
    term: Term,
    etcd: Etcd,
    lease_id: LeaseId,
    stop: Arc<AtomicBool>,
    renewer: Option<JoinHandle<()>>,
}

impl Leadership {
    /// Campaigns until this kvctld leads, publishing `advertise` as the leader's address;
    /// `None` when `stop` is set first (SIGTERM while a standby). etcd out of reach is
    /// retried, said once at warning level.
    pub fn campaign(cfg: &Election, advertise: &str, stop: &AtomicBool) -> Option<Leadership> {
        let ttl = cfg.ttl();
        // One call may take a third of the TTL at most: a renewal stuck longer is as good
        // as lost, and the next one goes out on time.
        let etcd = Etcd::for_election(cfg, ttl / 3)?;
        let key = cfg.key.as_bytes();
        let poll = poll_interval(ttl);
        let mut said: Option<String> = None;
        let mut waited_for: Option<Vec<u8>> = None;
        let mut complain = |e: &EtcdError| {
            let text = e.to_string();
            if said.as_deref() != Some(text.as_str()) {
                warn!("campaign: {text}; retrying every {} ms", poll.as_millis());
                said = Some(text);
            }
        };
        while !stop.load(Ordering::SeqCst) {
            let sent = Instant::now();
            let lease_id = match etcd.grant(i64::from(cfg.ttl_s)) {
                Ok(id) => id,
                Err(e) => {
                    complain(&e);
                    std::thread::sleep(poll);
                    continue;
                }
            };
            match etcd.create(key, advertise.as_bytes(), Some(lease_id)) {
                Ok(Some(revision)) => {
                    let epoch = Generation(u64::try_from(revision).unwrap_or(0));
                    let mut lease = Lease::new(ttl, cfg.margin());
                    lease.won(epoch, sent);
                    info!(
                        "elected leader under {} (epoch {}, lease {:x}, ttl {} s)",
                        cfg.key, epoch.0, lease_id.0, cfg.ttl_s
                    );
                    return Some(Leadership::start(etcd, lease_id, lease, epoch, cfg));
                }
                Ok(None) => {
                    let _ = etcd.revoke(lease_id);
                }
                Err(e) => {
                    let _ = etcd.revoke(lease_id);
                    complain(&e);
                }
            }
            // A standby: wait for the leader's key to go.
            while !stop.load(Ordering::SeqCst) {
                match etcd.get(key) {
                    Ok(Some(kv)) => {
                        if waited_for.as_ref() != Some(&kv.value) {
                            info!(
                                "standby: {} leads (epoch {})",
                                String::from_utf8_lossy(&kv.value),
                                kv.create_revision
                            );
                            waited_for = Some(kv.value);
                        }
                    }
                    Ok(None) => break,
                    Err(e) => complain(&e),
                }
                std::thread::sleep(poll);
            }
        }
        None
    }

    fn start(
        etcd: Etcd,
        lease_id: LeaseId,
        lease: Lease,
        epoch: Generation,
        cfg: &Election,
    ) -> Leadership {
        let term = Term {
            lease: Arc::new(Mutex::new(lease)),
            epoch,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let every = cfg.ttl() / 3;
        let renewer = {
            let (etcd, term, stop) = (etcd.clone(), term.clone(), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("lease".into())
                .spawn(move || renew(&etcd, lease_id, &term, &stop, every))
                .map_err(|e| warn!("cannot start the lease thread: {e}"))
                .ok()
        };
        Leadership {
            term,
            etcd,
            lease_id,
            stop,
            renewer,
        }
    }

    pub fn term(&self) -> &Term {
        &self.term
    }

    /// Stops renewing and revokes the lease: the leader key goes now, and a standby wins at
    /// its next look instead of after the TTL.
    pub fn resign(mut self) {
        self.stop_renewing();
        match self.etcd.revoke(self.lease_id) {
            Ok(()) => info!("resigned: lease of epoch {} revoked", self.term.epoch.0),
            Err(e) => warn!("resigning: {e}; the lease expires on its own"),
        }
    }

    fn stop_renewing(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.renewer.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Leadership {
    /// Tells the renewer to stop without waiting for it: a kvctld that lost its lease exits
    /// at once, even while a renewal is stuck in a call to an unreachable etcd.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Renews `lease_id` every `every` until `stop`: each answer extends the term's window from
/// the renewal's send time; an answer that the lease is gone closes it at once.
fn renew(etcd: &Etcd, lease_id: LeaseId, term: &Term, stop: &AtomicBool, every: Duration) {
    let mut next = Instant::now() + every;
    while !stop.load(Ordering::SeqCst) {
        let now = Instant::now();
        if now < next {
            std::thread::sleep((next - now).min(Duration::from_millis(50)));
            continue;
        }
        next = now + every;
        let sent = Instant::now();
        let answer = etcd.keep_alive(lease_id);
        let Ok(mut lease) = term.lease.lock() else {
            return;
        };
        match answer {
            Ok(Some(_)) => {
                lease.renewed(term.epoch, sent);
                debug!("lease of epoch {} renewed", term.epoch.0);
            }
            Ok(None) => {
                warn!(
                    "etcd says the lease of epoch {} is gone: no longer leading",
                    term.epoch.0
                );
                lease.lost();
                return;
            }
            Err(e) => warn!(
                "renewing the lease of epoch {}: {e} (the window closes in {} ms unless a \
                 renewal gets through)",
                term.epoch.0,
                lease.valid_until().map_or(0, |t| t
                    .saturating_duration_since(Instant::now())
                    .as_millis())
            ),
        }
    }
}
