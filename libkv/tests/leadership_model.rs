//! Exhaustive model check of fencing a control plane whose leader changes, on the sans-IO
//! core that kvctld and the workers use ([`libkv::fence`]: `Lease`, `EpochFence`).
//!
//! A breadth-first search over every interleaving, up to a time horizon, of two kvctld
//! candidates, a lease store (etcd's semantics: one leader key under a lease that expires
//! `TTL` after the store last renewed it; each win gets a new, larger epoch), and two workers
//! with one page each. The network delays every message arbitrarily (any message in flight
//! may be delivered next, across ticks) and loses any. Time advances in ticks; the store
//! expires leases on its own clock, the candidates judge theirs with `Lease`.
//!
//! The candidates campaign, renew, and, only while `Lease::may_admit`, send commands of their
//! epoch to the workers: reserve the page, start a transfer into it, free it. A worker takes a
//! command through its `EpochFence`: one of a newer epoch is a new leader (the worker aborts
//! what it held for older epochs: a reserved page is freed, a page under a transfer drains
//! until the transfer ends), one of an older epoch is refused. Transfers end on their own at
//! any time.
//!
//! Checked in every reachable state:
//! 1. no worker acts on a command of an older epoch after acting on a newer one;
//! 2. no page is free while a transfer of any epoch can still write it;
//! 3. a candidate that may admit holds the store's lease for its epoch right now (so two
//!    candidates never admit at once, and a deposed or partitioned one stops before its
//!    lease can expire, without being told).
//!
//! Each property is shown to catch a broken rule: counting a lease from the answer's arrival
//! breaks 3, a worker without the fence breaks 1, freeing a page under a transfer breaks 2.
//!
//! What is modelled rather than driven: the store and the page states (the pool's own
//! Draining rule is driven with the real pool by `model_check.rs`). Clocks do not drift here:
//! `margin` is what covers drift, and is one tick.

use libkv::Generation;
use libkv::fence::{EpochFence, Lease};
use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

const LEADERS: usize = 2;
const WORKERS: usize = 2;

/// One configuration of the search.
#[derive(Clone, Copy, Debug)]
struct Bounds {
    /// Lease time to live at the store, and the candidates' margin, in ticks.
    ttl: u32,
    margin: u32,
    /// Last tick.
    horizon: u32,
    /// Most messages in flight at once.
    net: usize,
    /// Most commands one candidate sends in all.
    commands: u8,
}

const SMALL: Bounds = Bounds {
    ttl: 3,
    margin: 1,
    horizon: 6,
    net: 2,
    commands: 2,
};

/// `SMALL`, or `KVFENCE_LEADER_MC=HORIZON,NET,COMMANDS` for a larger search.
fn bounds() -> Bounds {
    let Ok(v) = std::env::var("KVFENCE_LEADER_MC") else {
        return SMALL;
    };
    let n: Vec<u32> = v
        .split(',')
        .map(|x| x.trim().parse().expect("a number"))
        .collect();
    assert_eq!(n.len(), 3, "KVFENCE_LEADER_MC=HORIZON,NET,COMMANDS");
    Bounds {
        horizon: n[0],
        net: n[1] as usize,
        commands: u8::try_from(n[2]).expect("small"),
        ..SMALL
    }
}

/// A rule of the protocol, or one broken on purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    Correct,
    /// The candidate counts a renewal from the answer's arrival.
    LeaseFromArrival,
    /// The worker acts on every command, whatever its epoch.
    NoFence,
    /// A new epoch frees the page even under a transfer of the old one.
    FreeUnderTransfer,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Kind {
    Reserve,
    Transfer,
    Free,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Msg {
    Campaign { l: usize, sent: u32 },
    Renew { l: usize, epoch: u64, sent: u32 },
    Won { l: usize, epoch: u64, sent: u32 },
    Renewed { l: usize, epoch: u64, sent: u32 },
    Refused { l: usize },
    Cmd { w: usize, epoch: u64, kind: Kind },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Page {
    Free,
    Reserved(u64),
    /// A transfer of the epoch writes it.
    Transferring(u64),
    /// Its request is gone; a transfer of the epoch may still write it.
    Draining(u64),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Candidate {
    /// The epoch held and its window (the code under test).
    lease: Lease,
    campaigning: bool,
    commands: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Worker {
    fence: EpochFence,
    page: Page,
    /// The epoch of the transfer in flight into the page.
    transfer: Option<u64>,
    /// The newest epoch it acted on (the property's own record, apart from the fence).
    acted: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    now: u32,
    /// The store: (candidate, epoch, expiry tick) of the leader key, and the next epoch.
    holder: Option<(usize, u64, u32)>,
    next_epoch: u64,
    candidates: [Candidate; LEADERS],
    workers: [Worker; WORKERS],
    /// Messages in flight, sorted (their order means nothing: any may come next).
    net: Vec<Msg>,
}

struct Model {
    bounds: Bounds,
    variant: Variant,
    base: Instant,
}

impl Model {
    fn at(&self, tick: u32) -> Instant {
        self.base + Duration::from_millis(u64::from(tick))
    }

    fn initial(&self) -> State {
        let lease = Lease::new(
            Duration::from_millis(u64::from(self.bounds.ttl)),
            Duration::from_millis(u64::from(self.bounds.margin)),
        );
        let c = Candidate {
            lease,
            campaigning: false,
            commands: 0,
        };
        let w = Worker {
            fence: EpochFence::new(),
            page: Page::Free,
            transfer: None,
            acted: 0,
        };
        State {
            now: 0,
            holder: None,
            next_epoch: 1,
            candidates: [c.clone(), c],
            workers: [w.clone(), w],
            net: Vec::new(),
        }
    }

    /// Every state one step from `s`, with a violation if reaching it broke a rule.
    fn successors(&self, s: &State, out: &mut Vec<(State, Option<String>)>) {
        let b = self.bounds;
        let send = |s: &State, m: Msg| -> Option<State> {
            (s.net.len() < b.net).then(|| {
                let mut n = s.clone();
                n.net.push(m);
                n.net.sort();
                n
            })
        };
        // time passes; the store expires the leader key on its own clock
        if s.now < b.horizon {
            let mut n = s.clone();
            n.now += 1;
            if n.holder.is_some_and(|(_, _, exp)| exp <= n.now) {
                n.holder = None;
            }
            out.push((n, None));
        }
        for l in 0..LEADERS {
            let c = &s.candidates[l];
            if c.lease.epoch().is_none()
                && !c.campaigning
                && let Some(mut n) = send(s, Msg::Campaign { l, sent: s.now })
            {
                n.candidates[l].campaigning = true;
                out.push((n, None));
            }
            if let Some(epoch) = c.lease.epoch() {
                let epoch = epoch.0;
                if let Some(n) = send(
                    s,
                    Msg::Renew {
                        l,
                        epoch,
                        sent: s.now,
                    },
                ) {
                    out.push((n, None));
                }
                // a candidate whose window closed steps down (it may notice late)
                if c.lease.may_admit(self.at(s.now)).is_none() {
                    let mut n = s.clone();
                    n.candidates[l].lease.lost();
                    out.push((n, None));
                }
            }
            if let Some(epoch) = c.lease.may_admit(self.at(s.now))
                && c.commands < b.commands
            {
                for w in 0..WORKERS {
                    for kind in [Kind::Reserve, Kind::Transfer, Kind::Free] {
                        let m = Msg::Cmd {
                            w,
                            epoch: epoch.0,
                            kind,
                        };
                        if let Some(mut n) = send(s, m) {
                            n.candidates[l].commands += 1;
                            out.push((n, None));
                        }
                    }
                }
            }
        }
        for w in 0..WORKERS {
            if let Some(e) = s.workers[w].transfer {
                let mut n = s.clone();
                let wk = &mut n.workers[w];
                wk.transfer = None;
                wk.page = match wk.page {
                    Page::Transferring(p) if p == e => Page::Reserved(e),
                    Page::Draining(p) if p == e => Page::Free,
                    other => other,
                };
                out.push((n, None));
            }
        }
        let mut seen = HashSet::new();
        for (i, &m) in s.net.iter().enumerate() {
            if !seen.insert(m) {
                continue;
            }
            let mut n = s.clone();
            n.net.remove(i);
            // lost
            out.push((n.clone(), None));
            // delivered
            let violation = self.deliver(&mut n, m);
            n.net.sort();
            out.push((n, violation));
        }
    }

    fn deliver(&self, n: &mut State, m: Msg) -> Option<String> {
        let now = n.now;
        let reply = |n: &mut State, r: Msg| {
            // a reply that does not fit the network is lost
            if n.net.len() < self.bounds.net {
                n.net.push(r);
            }
        };
        match m {
            Msg::Campaign { l, sent } => match n.holder {
                None => {
                    let epoch = n.next_epoch;
                    n.next_epoch += 1;
                    n.holder = Some((l, epoch, now + self.bounds.ttl));
                    reply(n, Msg::Won { l, epoch, sent });
                }
                Some(_) => reply(n, Msg::Refused { l }),
            },
            Msg::Renew { l, epoch, sent } => match n.holder {
                Some((h, e, _)) if h == l && e == epoch => {
                    n.holder = Some((l, epoch, now + self.bounds.ttl));
                    reply(n, Msg::Renewed { l, epoch, sent });
                }
                _ => reply(n, Msg::Refused { l }),
            },
            Msg::Won { l, epoch, sent } | Msg::Renewed { l, epoch, sent } => {
                let from = match self.variant {
                    Variant::LeaseFromArrival => now,
                    _ => sent,
                };
                let c = &mut n.candidates[l];
                if matches!(m, Msg::Won { .. }) {
                    c.campaigning = false;
                    if c.lease.won(Generation(epoch), self.at(from)) {
                        c.commands = 0;
                    }
                } else {
                    c.lease.renewed(Generation(epoch), self.at(from));
                }
            }
            Msg::Refused { l } => {
                let c = &mut n.candidates[l];
                c.campaigning = false;
                c.lease.lost();
            }
            Msg::Cmd { w, epoch, kind } => return self.command(&mut n.workers[w], epoch, kind),
        }
        None
    }

    fn command(&self, wk: &mut Worker, epoch: u64, kind: Kind) -> Option<String> {
        let e = Generation(epoch);
        if self.variant != Variant::NoFence {
            if wk.fence.check(e).is_err() {
                return None;
            }
            if wk.fence.newest() < Some(e) {
                wk.fence.observe(e).expect("checked");
                // a new leader: what older epochs held is aborted
                wk.page = match wk.page {
                    Page::Reserved(_) => Page::Free,
                    Page::Transferring(p) if self.variant == Variant::FreeUnderTransfer => {
                        let _ = p;
                        Page::Free
                    }
                    Page::Transferring(p) => Page::Draining(p),
                    other => other,
                };
            }
        }
        if epoch < wk.acted {
            return Some(format!(
                "a worker acted on a {kind:?} of epoch {epoch} after acting on epoch {}",
                wk.acted
            ));
        }
        wk.acted = epoch;
        match (kind, wk.page) {
            (Kind::Reserve, Page::Free) => wk.page = Page::Reserved(epoch),
            (Kind::Transfer, Page::Reserved(p)) if p == epoch && wk.transfer.is_none() => {
                wk.page = Page::Transferring(epoch);
                wk.transfer = Some(epoch);
            }
            (Kind::Free, Page::Reserved(p)) if p == epoch => wk.page = Page::Free,
            (Kind::Free, Page::Transferring(p)) if p == epoch => wk.page = Page::Draining(epoch),
            _ => {}
        }
        None
    }

    /// What is wrong in `s`, if anything.
    fn check(&self, s: &State) -> Option<String> {
        for (w, wk) in s.workers.iter().enumerate() {
            if let Some(e) = wk.transfer {
                match wk.page {
                    Page::Transferring(p) | Page::Draining(p) if p == e => {}
                    page => {
                        return Some(format!(
                            "worker {w}'s page is {page:?} while a transfer of epoch {e} can \
                             still write it"
                        ));
                    }
                }
            }
        }
        let now = self.at(s.now);
        for (l, c) in s.candidates.iter().enumerate() {
            if let Some(Generation(e)) = c.lease.may_admit(now) {
                match s.holder {
                    Some((h, he, exp)) if h == l && he == e && exp > s.now => {}
                    other => {
                        return Some(format!(
                            "candidate {l} may admit for epoch {e} at tick {} while the store \
                             holds {other:?}",
                            s.now
                        ));
                    }
                }
            }
        }
        None
    }

    /// Searches every reachable state: the first violation found, or the number of states.
    /// States seen are kept as 64-bit fingerprints (hash compaction: two states colliding
    /// within a few million are about one chance in a million, and would only prune).
    fn search(&self) -> Result<usize, String> {
        let start = self.initial();
        let mut seen: HashSet<u64> = HashSet::new();
        let mut queue = VecDeque::new();
        seen.insert(fingerprint(&start));
        queue.push_back((start, 0usize));
        let mut next = Vec::new();
        while let Some((s, depth)) = queue.pop_front() {
            next.clear();
            self.successors(&s, &mut next);
            for (n, violation) in next.drain(..) {
                if let Some(v) = violation.or_else(|| self.check(&n)) {
                    return Err(format!("{v} (depth {})", depth + 1));
                }
                if seen.insert(fingerprint(&n)) {
                    queue.push_back((n, depth + 1));
                }
            }
        }
        Ok(seen.len())
    }
}

fn fingerprint(s: &State) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    s.hash(&mut h);
    h.finish()
}

fn run(variant: Variant, bounds: Bounds) -> Result<usize, String> {
    Model {
        bounds,
        variant,
        base: Instant::now(),
    }
    .search()
}

#[test]
fn no_reachable_state_breaks_the_fencing_rules() {
    let b = bounds();
    let t = Instant::now();
    let states = run(Variant::Correct, b).unwrap_or_else(|v| panic!("{v}"));
    eprintln!(
        "leadership model: {states} states, every one checked, in {:.1} s ({b:?})",
        t.elapsed().as_secs_f64()
    );
    assert!(states > 10_000, "the search reached only {states} states");
}

#[test]
fn a_lease_counted_from_the_answers_arrival_is_caught() {
    let v = run(Variant::LeaseFromArrival, SMALL).expect_err("must be caught");
    assert!(v.contains("may admit"), "{v}");
}

#[test]
fn a_worker_without_the_fence_is_caught() {
    let v = run(Variant::NoFence, SMALL).expect_err("must be caught");
    assert!(v.contains("after acting on epoch"), "{v}");
}

#[test]
fn freeing_a_page_under_a_transfer_is_caught() {
    let v = run(Variant::FreeUnderTransfer, SMALL).expect_err("must be caught");
    assert!(v.contains("can still write it"), "{v}");
}
