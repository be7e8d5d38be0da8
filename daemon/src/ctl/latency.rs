//! Latency histograms the core keeps: per request stage, time to the first token and the
//! whole request. Observing is an array increment (no allocation, no lock: the core is
//! single-threaded); `/metrics` exports them as Prometheus histograms.

use super::core::Stage;
use std::time::Duration;

/// Upper bounds of the buckets, in seconds, from 100 us to 30 s; one more bucket above.
pub const BUCKETS_S: [f64; 16] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    10.0, 30.0,
];

/// One histogram: observations per bucket (not cumulative; the last is above every bound),
/// their count and their sum.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    pub counts: [u64; BUCKETS_S.len() + 1],
    pub count: u64,
    pub sum_s: f64,
}

impl Histogram {
    pub fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        let i = BUCKETS_S
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(BUCKETS_S.len());
        self.counts[i] += 1;
        self.count += 1;
        self.sum_s += s;
    }
}

/// Every latency the core measures.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Latencies {
    /// Time spent in each stage by requests that went on to the next one (indexed by
    /// [`Stage::index`]); a request that fails in a stage is not counted there.
    pub stages: [Histogram; Stage::ALL.len()],
    /// From Submit to the first tokens relayed to the client.
    pub first_token: Histogram,
    /// From Submit to Done, for requests that completed.
    pub request: Histogram,
}

impl Latencies {
    pub fn stage(&mut self, stage: Stage) -> &mut Histogram {
        &mut self.stages[stage.index()]
    }

    /// Each histogram's count and sum as status counters, `latency_NAME_count` and
    /// `latency_NAME_us` (NAME a stage's label, `first_token` or `request`): two readings
    /// a while apart give the mean latency between them (`kvctl top`).
    pub fn counters(&self) -> Vec<(String, u64)> {
        let named = Stage::ALL
            .iter()
            .map(|s| (s.label(), &self.stages[s.index()]))
            .chain([
                ("first_token", &self.first_token),
                ("request", &self.request),
            ]);
        let mut out = Vec::new();
        for (name, h) in named {
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let us = (h.sum_s * 1e6).round() as u64;
            out.push((format!("latency_{name}_count"), h.count));
            out.push((format!("latency_{name}_us"), us));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_the_first_bucket_that_holds_them() {
        let mut h = Histogram::default();
        h.observe(Duration::from_micros(100));
        h.observe(Duration::from_micros(101));
        h.observe(Duration::from_secs(60));
        assert_eq!(h.counts[0], 1, "exactly on a bound counts in that bucket");
        assert_eq!(h.counts[1], 1);
        assert_eq!(h.counts[BUCKETS_S.len()], 1, "above every bound");
        assert_eq!(h.count, 3);
        assert!((h.sum_s - 60.000_201).abs() < 1e-9);
    }

    #[test]
    fn counters_carry_every_count_and_sum() {
        let mut l = Latencies::default();
        l.stage(Stage::Pulling).observe(Duration::from_micros(1500));
        l.stage(Stage::Pulling).observe(Duration::from_micros(500));
        l.request.observe(Duration::from_millis(3));
        let c = l.counters();
        let get = |n: &str| c.iter().find(|(k, _)| k == n).map(|(_, v)| *v);
        assert_eq!(get("latency_transfer_count"), Some(2));
        assert_eq!(get("latency_transfer_us"), Some(2000));
        assert_eq!(get("latency_request_us"), Some(3000));
        assert_eq!(get("latency_first_token_count"), Some(0));
        assert_eq!(c.len(), 2 * (Stage::ALL.len() + 2));
    }
}
