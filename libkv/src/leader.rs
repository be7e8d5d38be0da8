//! Finding the leading kvctld through etcd (`[election]`): its key holds the address peers
//! reach it at over TLS, and the key's create revision is the leader's epoch. Workers,
//! kvctl and openaid look it up before each connection.
//!
//! The campaign itself is kvctld's (`kvctld::ctl::leader`); this side only reads.

use crate::config::Election;
use crate::etcd::{Etcd, EtcdError};
use std::time::Duration;

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
        let endpoint = cfg.etcd.clone()?;
        Some(LeaderLookup {
            etcd: Etcd::new(endpoint, LOOKUP_TIMEOUT),
            key: cfg.key.clone().into_bytes(),
        })
    }

    /// Where etcd is, for messages.
    pub fn place(&self) -> String {
        format!(
            "the leader under {} in etcd at {}",
            String::from_utf8_lossy(&self.key),
            self.etcd.endpoint()
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
