//! kvctld, the control daemon, and the pieces kvctl shares with it.

pub mod client;
pub mod ctl;
pub mod metrics;
pub mod probe;
pub mod stack;
