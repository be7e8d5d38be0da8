//! The coherence probe: canary requests through the live system, checked against the
//! monolithic path of the same model.
//!
//! The incident went unnoticed for two weeks because every response was a success. The
//! probe sends a few canary prompts of known content through kvctld, prefilld and decoded
//! and compares every output (tokens and signature) with what the same model computes
//! without a pool or transfers: the reference model, or the real model the workers run
//! (greedy, so its output is one exact token sequence). A mismatch is the alarm: kvctl exits non-zero, kvctld logs at
//! error level and counts it. Each mismatch names the prefill and decode worker that served
//! the canary (kvctld picks the pair, so one run need not visit every worker).

use crate::client::{Client, ClientError};
use libkv::model::{self, ModelError};
use libkv::proto::Sampling;
use llama::LoadedModel;
use std::path::Path;
use std::time::Duration;

/// Tenant name the probe's requests run under.
pub const PROBE_TENANT: &str = "kvfence-probe";

/// Canary prompts: different lengths so that they span one page, several pages and a
/// partly filled last page.
const CANARIES: [&str; 4] = [
    "probe: the quick brown fox",
    "probe: 0123456789abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789",
    "p",
    "probe: a longer canary that spans several pages of sixteen tokens each, so that a stale page in the middle of a reservation would be read by the copy head",
];

/// What one probe run found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProbeReport {
    /// Canary requests sent.
    pub requests: u32,
    /// Outputs equal to the monolithic path.
    pub matched: u32,
    /// Outputs that differ: each a description. Non-empty means the system is incoherent.
    pub mismatches: Vec<String>,
    /// Requests that failed with an error (not an incoherence, but no evidence either).
    pub errors: Vec<String>,
}

impl ProbeReport {
    /// Whether every canary came back equal to the monolithic path.
    pub fn is_coherent(&self) -> bool {
        self.mismatches.is_empty() && self.errors.is_empty() && self.matched == self.requests
    }
}

/// Errors that stop a probe before it could judge anything.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("computing a canary's expected output")]
    Model(#[source] ModelError),
    #[error("connecting to kvctld")]
    Connect(#[source] ClientError),
}

/// Sends every canary once, with `max_new` new tokens each, and compares.
pub fn run_probe(
    socket: &Path,
    model: &LoadedModel,
    max_new: u32,
    timeout: Duration,
) -> Result<ProbeReport, ProbeError> {
    let mut client = Client::connect(socket, timeout).map_err(ProbeError::Connect)?;
    let mut report = ProbeReport::default();
    for prompt in CANARIES {
        report.requests += 1;
        let prompt = model.encode(prompt);
        let expected =
            model::monolithic_paged(model.runner.as_ref(), &prompt, max_new, &Sampling::GREEDY)
                .map_err(ProbeError::Model)?;
        match client.generate(PROBE_TENANT, &prompt, max_new, 0, |_| {}) {
            Ok(out)
                if out.tokens == expected.tokens && out.done.signature == expected.signature =>
            {
                report.matched += 1;
            }
            Ok(out) => report.mismatches.push(format!(
                "{} via {}: got {:?} (signature {:#018x}), expected {:?} (signature {:#018x})",
                out.request,
                out.pair,
                model.decode(&out.tokens),
                out.done.signature,
                model.decode(&expected.tokens),
                expected.signature
            )),
            Err(e) => {
                report.errors.push(e.to_string());
                if !matches!(e, ClientError::Server { .. }) {
                    // The connection is unusable after a transport failure.
                    client = Client::connect(socket, timeout).map_err(ProbeError::Connect)?;
                }
            }
        }
    }
    Ok(report)
}
