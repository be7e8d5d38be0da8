//! The coherence probe: canary requests through the live system, checked against the
//! monolithic path.
//!
//! The incident went unnoticed for two weeks because every response was a success. The
//! probe sends a few canary prompts of known content through kvctld, prefilld and decoded
//! and compares every output (tokens and signature) with what the same model computes
//! without pages or transfers. A mismatch is the alarm: kvctl exits non-zero, kvctld logs at
//! error level and counts it. Each mismatch names the prefill and decode worker that served
//! the canary (kvctld picks the pair, so one run need not visit every worker).

use crate::client::{Client, ClientError};
use libkv::PageGeometry;
use libkv::model::{self, ModelError, ReferenceModel};
use std::path::Path;
use std::time::Duration;

/// Tenant name the probe's requests run under.
pub const PROBE_TENANT: &str = "kvfence-probe";

/// Canary prompts: different lengths so that they span one page, several pages and a
/// partly filled last page.
const CANARIES: [&[u8]; 4] = [
    b"probe: the quick brown fox",
    b"probe: 0123456789abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789",
    b"p",
    b"probe: a longer canary that spans several pages of sixteen tokens each, so that a stale page in the middle of a reservation would be read by the copy head",
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
    #[error("the reference model does not run on this geometry")]
    Model(#[source] ModelError),
    #[error("connecting to kvctld")]
    Connect(#[source] ClientError),
}

/// Sends every canary once, with `max_new` new tokens each, and compares.
pub fn run_probe(
    socket: &Path,
    geometry: PageGeometry,
    max_new: u32,
    timeout: Duration,
) -> Result<ProbeReport, ProbeError> {
    let model = ReferenceModel::new(geometry).map_err(ProbeError::Model)?;
    let mut client = Client::connect(socket, timeout).map_err(ProbeError::Connect)?;
    let mut report = ProbeReport::default();
    for prompt in CANARIES {
        report.requests += 1;
        let expected = model::monolithic(&model, &model::tokenize(prompt), max_new)
            .map_err(ProbeError::Model)?;
        match client.generate(PROBE_TENANT, prompt, max_new, 0, |_| {}) {
            Ok(out)
                if out.tokens == expected.tokens && out.done.signature == expected.signature =>
            {
                report.matched += 1;
            }
            Ok(out) => report.mismatches.push(format!(
                "{} via {}: got {:?} (signature {:#018x}), expected {:?} (signature {:#018x})",
                out.request,
                out.pair,
                model::detokenize(&out.tokens),
                out.done.signature,
                model::detokenize(&expected.tokens),
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
