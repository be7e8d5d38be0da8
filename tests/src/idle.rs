//! The idle check of the crash campaign (`tests/crash.rs`), the network fault campaign
//! (`tests/netfaults.rs`) and the soak (`kvsoak`): a stack is idle when kvctld lists every worker of
//! the stack connected, and nothing else, each with every page of its pool free (none
//! reserved, being written, readable or draining), no page lent against it and no request
//! on it, and kvctld itself holds no request.
//!
//! A worker reports its pages after it frees them, so a status read right after the last
//! answer can still show that request's pages: the check is always waited for, bounded
//! ([`wait_idle`]), never read once.

use kvctld::stack::{Stack, error_chain, wait_until};
use libkv::proto::{StatusReply, WorkerStatus};
use std::time::{Duration, Instant};

// The ids of the stack's workers, and kvctld's own counters, as the rest of the library
// reads them.
pub use crate::{all_worker_ids as worker_ids, counter};

/// The worker's own counter `name` (from its last pool report), 0 if absent.
pub fn worker_counter(w: &WorkerStatus, name: &str) -> u64 {
    w.counters
        .iter()
        .find(|(n, _)| n == name)
        .map_or(0, |(_, v)| *v)
}

/// Pages of `w`'s pool not free.
pub fn pages_not_free(w: &WorkerStatus) -> u64 {
    u64::from(w.pool_pages.saturating_sub(w.free))
}

/// What keeps `status` from idle for a stack of the workers `ids`; empty when idle.
pub fn not_idle(status: &StatusReply, ids: &[String]) -> Vec<String> {
    let mut why = Vec::new();
    for id in ids {
        match status.workers.iter().find(|w| &w.id == id) {
            None => why.push(format!("{id} is not listed")),
            Some(w) if !w.connected => why.push(format!("{id} is not connected")),
            Some(w) => {
                let busy = w.free != w.pool_pages
                    || w.reserved != 0
                    || w.writing != 0
                    || w.readable != 0
                    || w.draining != 0
                    || w.held_pages != 0
                    || w.in_flight != 0;
                if busy {
                    why.push(format!("{id} is not idle"));
                }
            }
        }
    }
    for w in &status.workers {
        if !ids.contains(&w.id) {
            why.push(format!("kvctld lists {} that the stack does not run", w.id));
        }
    }
    for name in ["in_flight", "queue_len"] {
        match counter(status, name) {
            Some(0) => {}
            Some(n) => why.push(format!("kvctld's {name} is {n}")),
            None => why.push(format!("kvctld reports no {name}")),
        }
    }
    why
}

/// One line per worker kvctld lists: its pages by state, the pages lent against it and its
/// requests in flight.
pub fn page_states(status: &StatusReply) -> String {
    let mut lines = Vec::new();
    for w in &status.workers {
        lines.push(format!(
            "  {} ({:?}{}): {} pages: {} free, {} reserved, {} writing, {} readable, {} \
             draining; {} held, {} in flight",
            w.id,
            w.role,
            if w.connected { "" } else { ", not connected" },
            w.pool_pages,
            w.free,
            w.reserved,
            w.writing,
            w.readable,
            w.draining,
            w.held_pages,
            w.in_flight
        ));
    }
    lines.push(format!(
        "  kvctld: in_flight {:?}, queue_len {:?}",
        counter(status, "in_flight"),
        counter(status, "queue_len")
    ));
    lines.join("\n")
}

/// Why a stack did not go idle in time.
#[derive(Debug)]
pub struct NotIdle {
    /// The last status read, if any was.
    last: Option<StatusReply>,
    /// The whole story, for a failure message.
    pub message: String,
}

impl NotIdle {
    /// Pages not free over every worker in the last status read, if one was.
    pub fn pages_not_free(&self) -> Option<u64> {
        let last = self.last.as_ref()?;
        Some(last.workers.iter().map(pages_not_free).sum())
    }
}

/// Polls kvctld's status until the stack is idle, for at most `within`: the idle status,
/// or what was still held when the time ran out, worker by worker.
pub fn wait_idle(stack: &Stack, within: Duration) -> Result<StatusReply, NotIdle> {
    let ids = worker_ids(stack);
    let start = Instant::now();
    let mut last: Option<StatusReply> = None;
    let mut last_error = None;
    let idle = wait_until(within, || match stack.status() {
        Ok(s) if not_idle(&s, &ids).is_empty() => Some(s),
        Ok(s) => {
            last = Some(s);
            None
        }
        Err(e) => {
            last_error = Some(error_chain(&e));
            None
        }
    });
    if let Some(s) = idle {
        return Ok(s);
    }
    let waited = start.elapsed();
    let message = match &last {
        Some(s) => format!(
            "not idle {waited:?} after the load stopped: {}\n{}{}",
            not_idle(s, &ids).join("; "),
            page_states(s),
            last_error.map_or(String::new(), |e| format!("\n  last status error: {e}"))
        ),
        None => format!(
            "no status from kvctld within {waited:?}: {}",
            last_error.unwrap_or_default()
        ),
    };
    Err(NotIdle { last, message })
}
