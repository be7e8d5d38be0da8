//! Fencing a control plane whose kvctld changes: the epoch a worker remembers, and the lease
//! rule under which a leader admits.
//!
//! Sans-IO: callers bring the time and the answers; nothing here reads a clock or touches a
//! socket, so the leadership model check (`tests/leadership_model.rs`) drives this very code.
//!
//! - **Epochs.** A kvctld's epoch is its [`Generation`]: every command it sends carries it
//!   (in the request's [`crate::Owner`]), and a worker takes commands only of the kvctld it
//!   registered with. [`EpochFence`] adds the memory across connections: a worker that has
//!   registered with epoch `e` never registers with, and so never acts for, a kvctld of an
//!   older epoch, however late that kvctld's messages arrive or whichever address it is
//!   reached at. Epochs only grow: kvctld takes the larger of the clock and one past the
//!   last epoch its host recorded.
//! - **Leases.** A leader may admit only while its lease surely holds. [`Lease`] counts each
//!   renewal from when it was *sent*, not from when the answer arrived: the store's own
//!   expiry starts no earlier than it received the renewal, so the leader's window ends
//!   before the store's does, by `margin` (for clock drift) at least, whatever the delays.
//!   It never waits to be told it lost. A leader whose window closed stops admitting and
//!   fails its in-flight requests; a standby can win only after the store's expiry.

use crate::Generation;
use std::time::{Duration, Instant};

/// A worker's memory of the newest kvctld epoch it has registered with.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct EpochFence {
    newest: Option<Generation>,
}

/// A kvctld of an epoch older than one this worker has already registered with: a deposed
/// or partitioned leader, or one whose epoch went backwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "kvctld epoch {} is older than epoch {} this worker already registered with \
     (a deposed or partitioned kvctld); not acting for it",
    got.0,
    newest.0
)]
pub struct Stale {
    pub got: Generation,
    pub newest: Generation,
}

impl EpochFence {
    pub const fn new() -> EpochFence {
        EpochFence { newest: None }
    }

    /// The newest epoch registered with, if any.
    pub fn newest(&self) -> Option<Generation> {
        self.newest
    }

    /// A kvctld of epoch `epoch` accepted this worker: remembered unless it is older than
    /// the newest seen, which is refused.
    pub fn observe(&mut self, epoch: Generation) -> Result<(), Stale> {
        self.check(epoch)?;
        self.newest = Some(epoch);
        Ok(())
    }

    /// Whether a command of `epoch` may be acted on: not if it is older than the newest
    /// epoch seen.
    pub fn check(&self, epoch: Generation) -> Result<(), Stale> {
        match self.newest {
            Some(newest) if epoch < newest => Err(Stale { got: epoch, newest }),
            _ => Ok(()),
        }
    }
}

/// A leader's view of its lease: the epoch it won, and until when it may admit under it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Lease {
    ttl: Duration,
    margin: Duration,
    /// The epoch held and the end of its window.
    term: Option<(Generation, Instant)>,
    /// The newest epoch ever won: an answer about an older one is stale.
    newest: Option<Generation>,
}

impl Lease {
    /// A lease of `ttl` at the store, of which the leader gives up `margin` at the end
    /// (at least the clock drift between the leader and the store over one `ttl`).
    pub fn new(ttl: Duration, margin: Duration) -> Lease {
        assert!(margin < ttl, "the margin must be shorter than the lease");
        Lease {
            ttl,
            margin,
            term: None,
            newest: None,
        }
    }

    /// The store made this candidate leader under `epoch`, answering a campaign sent at
    /// `sent_at`: it may admit until `sent_at + ttl - margin`. A win older than the newest
    /// one (an answer that arrived late) is stale and ignored: returns false.
    pub fn won(&mut self, epoch: Generation, sent_at: Instant) -> bool {
        if self.newest.is_some_and(|n| epoch <= n) {
            return false;
        }
        self.newest = Some(epoch);
        self.term = Some((epoch, sent_at + (self.ttl - self.margin)));
        true
    }

    /// The store renewed the lease of `epoch`, answering a renewal sent at `sent_at`: the
    /// window reaches `sent_at + ttl - margin`, unless a newer renewal reached further. A
    /// renewal of another epoch than the one held changes nothing.
    pub fn renewed(&mut self, epoch: Generation, sent_at: Instant) {
        if let Some((e, until)) = &mut self.term
            && *e == epoch
        {
            *until = (*until).max(sent_at + (self.ttl - self.margin));
        }
    }

    /// The store said the lease is gone, or the window closed: stop at once.
    pub fn lost(&mut self) {
        self.term = None;
    }

    /// The epoch held, whether or not its window is still open.
    pub fn epoch(&self) -> Option<Generation> {
        self.term.map(|(e, _)| e)
    }

    /// The epoch to admit under at `now`, if the window is open.
    pub fn may_admit(&self, now: Instant) -> Option<Generation> {
        self.term.filter(|&(_, until)| now < until).map(|(e, _)| e)
    }

    /// The end of the window, when there is one.
    pub fn valid_until(&self) -> Option<Instant> {
        self.term.map(|(_, t)| t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fence_refuses_older_epochs_only() {
        let mut f = EpochFence::new();
        assert_eq!(f.check(Generation(5)), Ok(()));
        f.observe(Generation(5)).unwrap();
        f.observe(Generation(5)).unwrap();
        let stale = f.observe(Generation(4)).unwrap_err();
        assert_eq!((stale.got, stale.newest), (Generation(4), Generation(5)));
        assert!(stale.to_string().contains("older than epoch 5"), "{stale}");
        assert_eq!(f.newest(), Some(Generation(5)), "a refusal changes nothing");
        f.observe(Generation(9)).unwrap();
        assert!(f.check(Generation(5)).is_err());
    }

    #[test]
    fn a_lease_counts_from_when_the_renewal_was_sent() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let (e1, e2) = (Generation(1), Generation(2));
        let mut l = Lease::new(3 * s, s);
        assert_eq!(l.may_admit(t0), None);
        // sent at t0, answered late: valid until t0 + 2 s, whenever the answer came
        assert!(l.won(e1, t0));
        assert_eq!(l.may_admit(t0 + s), Some(e1));
        assert_eq!(l.may_admit(t0 + 2 * s), None);
        // a late answer to an older renewal does not shorten a newer window
        l.renewed(e1, t0 + s);
        l.renewed(e1, t0);
        assert_eq!(l.valid_until(), Some(t0 + 3 * s));
        // a renewal of another epoch changes nothing
        l.renewed(e2, t0 + 2 * s);
        assert_eq!(l.valid_until(), Some(t0 + 3 * s));
        l.lost();
        assert_eq!(l.may_admit(t0 + s), None);
        // a win that arrives after a newer one is stale
        assert!(l.won(e2, t0 + s));
        assert!(!l.won(e1, t0 + 2 * s));
        assert_eq!(l.epoch(), Some(e2));
        l.lost();
        assert!(!l.won(e1, t0 + 2 * s), "still stale after losing e2");
    }
}
