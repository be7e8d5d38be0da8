//! The leader's view of the members in etcd (`[election] members`, published by every
//! worker under its own lease: [`libkv::members`]).
//!
//! A [`Watcher`] thread reads the members prefix every [`super::leader::poll_interval`] and
//! leaves the latest [`Sighting`] for the event loop. [`Lapses`], with no I/O, compares each
//! sighting with the workers registered now: a worker whose key was seen after it
//! registered and then vanished, or came back with a new create revision, let its lease
//! lapse (stopped, hung, or cut off from etcd while its kvctld connection lives), and the
//! loop treats it as lost: its connection closes, its requests fail, and it must register
//! again once it is back. A worker not yet seen is left alone (its first publication may
//! trail its registration), and so is every worker while etcd is out of reach: no sighting,
//! no verdict.

use super::workers::ConnId;
use libkv::config::Election;
use libkv::etcd::Etcd;
use libkv::members::{Sighting, sightings};
use log::warn;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Reads the members prefix on a thread of its own.
#[derive(Debug)]
pub struct Watcher {
    latest: Arc<Mutex<Option<Sighting>>>,
    stop: Arc<AtomicBool>,
}

impl Watcher {
    /// `None` when `[election]` is off.
    pub fn start(cfg: &Election) -> Option<Watcher> {
        let every = super::leader::poll_interval(cfg.ttl());
        let etcd = Etcd::for_election(cfg, cfg.ttl() / 3)?;
        let prefix = cfg.members.clone();
        let latest = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let (out, halt) = (Arc::clone(&latest), Arc::clone(&stop));
        std::thread::Builder::new()
            .name("members".into())
            .spawn(move || {
                let mut said = None;
                while !halt.load(Ordering::SeqCst) {
                    match sightings(&etcd, &prefix) {
                        Ok(s) => {
                            said = None;
                            if let Ok(mut l) = out.lock() {
                                *l = Some(s);
                            }
                        }
                        Err(e) => {
                            let text = e.to_string();
                            if said.as_ref() != Some(&text) {
                                warn!("reading the members: {text}");
                                said = Some(text);
                            }
                        }
                    }
                    std::thread::sleep(every);
                }
            })
            .map_err(|e| warn!("cannot start the members thread: {e}"))
            .ok()?;
        Some(Watcher { latest, stop })
    }

    /// The sighting made since the last call, if any.
    pub fn take(&self) -> Option<Sighting> {
        self.latest.lock().ok()?.take()
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// What is known of one registration.
#[derive(Debug)]
struct Known {
    id: String,
    /// When the loop first saw it registered: only sightings sent later speak of it.
    since: Instant,
    /// The create revision of its key, once a sighting held it.
    created: Option<i64>,
}

/// Which registered workers let their membership lapse.
#[derive(Debug, Default)]
pub struct Lapses {
    known: HashMap<ConnId, Known>,
}

impl Lapses {
    /// Compares `sighting` with the workers registered at `now` (their connection and id):
    /// the connections of those whose membership lapsed, each with why.
    pub fn check<'a>(
        &mut self,
        now: Instant,
        registered: impl IntoIterator<Item = (ConnId, &'a str)>,
        sighting: &Sighting,
    ) -> Vec<(ConnId, String)> {
        let mut live = HashMap::new();
        for (conn, id) in registered {
            let k = self.known.remove(&conn).filter(|k| k.id == id);
            live.insert(
                conn,
                k.unwrap_or_else(|| Known {
                    id: id.to_owned(),
                    since: now,
                    created: None,
                }),
            );
        }
        self.known = live;
        let mut lapsed = Vec::new();
        for (conn, k) in &mut self.known {
            if sighting.sent <= k.since {
                continue;
            }
            match (k.created, sighting.created.get(&k.id)) {
                (None, Some(&rev)) => k.created = Some(rev),
                (Some(was), Some(&rev)) if rev != was => lapsed.push((
                    *conn,
                    format!(
                        "worker {}: its key in etcd was created again (revision {was}, now \
                         {rev}): its lease lapsed in between",
                        k.id
                    ),
                )),
                (Some(_), None) => lapsed.push((
                    *conn,
                    format!("worker {}: its key in etcd is gone: its lease lapsed", k.id),
                )),
                _ => {}
            }
        }
        for (conn, _) in &lapsed {
            self.known.remove(conn);
        }
        lapsed.sort();
        lapsed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn seen(sent: Instant, members: &[(&str, i64)]) -> Sighting {
        Sighting {
            sent,
            created: members
                .iter()
                .map(|(id, r)| ((*id).to_owned(), *r))
                .collect(),
        }
    }

    #[test]
    fn a_worker_whose_key_vanished_or_was_created_again_has_lapsed() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut l = Lapses::default();
        let both = [(1, "p"), (2, "d")];
        // registered before it published: absence says nothing yet
        assert!(l.check(at(0), both, &seen(at(10), &[])).is_empty());
        assert!(
            l.check(at(20), both, &seen(at(30), &[("p", 5), ("d", 6)]))
                .is_empty()
        );
        assert!(
            l.check(at(40), both, &seen(at(50), &[("p", 5), ("d", 6)]))
                .is_empty()
        );
        // d's key gone, p's created anew: both lapsed, once
        let out = l.check(at(60), both, &seen(at(70), &[("p", 9)]));
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].0, 1);
        assert!(out[0].1.contains("created again"), "{}", out[0].1);
        assert_eq!(out[1].0, 2);
        assert!(out[1].1.contains("is gone"), "{}", out[1].1);
    }

    #[test]
    fn only_sightings_sent_after_a_registration_speak_of_it() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut l = Lapses::default();
        assert!(
            l.check(at(0), [(1, "d")], &seen(at(10), &[("d", 6)]))
                .is_empty()
        );
        // d registered again on connection 3 (restarted): the old key's absence in a
        // sighting sent before that says nothing, a later one with its new key is its own
        assert!(l.check(at(100), [(3, "d")], &seen(at(90), &[])).is_empty());
        assert!(
            l.check(at(110), [(3, "d")], &seen(at(120), &[("d", 8)]))
                .is_empty()
        );
        assert!(
            l.check(at(130), [(3, "d")], &seen(at(140), &[("d", 8)]))
                .is_empty()
        );
        // a connection now held by another id starts over
        assert!(l.check(at(150), [(3, "e")], &seen(at(160), &[])).is_empty());
        // gone from the registry: forgotten
        assert!(l.check(at(170), [], &seen(at(180), &[])).is_empty());
    }
}
