//! kvctld's Prometheus endpoint: `GET /metrics` answers in the text exposition format with
//! kvctld's counters, its latency histograms and every worker's pool, labelled by `worker`
//! and `role` (the series [`libkv::metrics`] defines for kvctld and the workers alike).
//!
//! The event loop publishes a [`Snapshot`] of its status every [`REFRESH`]; the HTTP thread
//! renders the latest one when scraped, so a request pays nothing for metrics and a scrape
//! never waits on the loop. Every metric kvctld adds is defined once, in [`render`]: its
//! name (units in the name), kind and help.

use crate::ctl::core::Stage;
use crate::ctl::latency::{BUCKETS_S, Histogram, Latencies};
use libkv::metrics::{
    Board, Exporter, Labels, WorkerSeries, build_info, counter_family, exposition, gauge,
    request_context_tokens,
};
use libkv::proto::StatusReply;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often the event loop publishes its status for scrapes.
pub const REFRESH: Duration = Duration::from_millis(100);

/// The latest status and latency histograms the event loop published, shared with the
/// HTTP thread.
#[derive(Debug, Clone, Default)]
pub struct Snapshot(Board<(StatusReply, Latencies)>);

impl Snapshot {
    pub fn publish(&self, status: StatusReply, latencies: Latencies) {
        self.0.publish((status, latencies));
    }
}

/// A histogram the core filled, exported as it is (prometheus-client's own histogram is
/// observed into, not set).
#[derive(Debug, Clone, Default)]
struct Fixed(Arc<Mutex<Histogram>>);

impl Fixed {
    fn set(&self, h: &Histogram) {
        h.clone_into(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

impl TypedMetric for Fixed {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Fixed {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let h = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // Per bucket, not cumulative; the last bound is +Inf (f64::MAX to the encoder).
        let buckets: Vec<(f64, u64)> = BUCKETS_S
            .iter()
            .copied()
            .chain(std::iter::once(f64::MAX))
            .zip(h.counts.iter().copied())
            .collect();
        encoder.encode_histogram::<NoLabelSet>(h.sum_s, h.count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// Starts the HTTP listener on `addr` on a thread of its own; returns the address bound
/// (port 0 picks a free port).
pub fn serve(addr: SocketAddr, snapshot: Snapshot) -> io::Result<SocketAddr> {
    libkv::metrics::serve(addr, "kvctld", move || {
        snapshot
            .0
            .latest()
            .map(|(status, latencies)| render(&status, &latencies))
    })
}

/// One of kvctld's counters as a metric: status name, metric name (without `_total`), help,
/// and the label it carries, if one.
type CounterDef = (
    &'static str,
    &'static str,
    &'static str,
    Option<(&'static str, &'static str)>,
);

/// kvctld's own counters as metrics.
const COUNTERS: &[CounterDef] = &[
    (
        "submitted",
        "kvfence_requests_submitted",
        "Requests submitted by clients",
        None,
    ),
    (
        "admitted",
        "kvfence_requests_admitted",
        "Requests admitted (both pools reserved)",
        None,
    ),
    (
        "queued",
        "kvfence_requests_queued",
        "Requests that waited for room before admission",
        None,
    ),
    (
        "completed",
        "kvfence_requests",
        "Requests ended, by outcome",
        Some(("outcome", "completed")),
    ),
    (
        "failed",
        "kvfence_requests",
        "Requests ended, by outcome",
        Some(("outcome", "failed")),
    ),
    (
        "rejected",
        "kvfence_requests",
        "Requests ended, by outcome",
        Some(("outcome", "rejected")),
    ),
    (
        "rejected_bad_request",
        "kvfence_rejections",
        "Requests rejected for good before any worker heard of them, by reason",
        Some(("reason", "bad_request")),
    ),
    (
        "rejected_prompt_too_long",
        "kvfence_rejections",
        "Requests rejected for good before any worker heard of them, by reason",
        Some(("reason", "prompt_too_long")),
    ),
    (
        "rejected_max_new_too_large",
        "kvfence_rejections",
        "Requests rejected for good before any worker heard of them, by reason",
        Some(("reason", "max_new_too_large")),
    ),
    (
        "rejected_exceeds_capacity",
        "kvfence_rejections",
        "Requests rejected for good before any worker heard of them, by reason",
        Some(("reason", "exceeds_capacity")),
    ),
    (
        "refused_full",
        "kvfence_requests",
        "Requests ended, by outcome",
        Some(("outcome", "pool_full")),
    ),
    (
        "client_gone",
        "kvfence_requests",
        "Requests ended, by outcome",
        Some(("outcome", "client_gone")),
    ),
    (
        "timeouts",
        "kvfence_request_failures",
        "Failed requests, by reason",
        Some(("reason", "timeout")),
    ),
    (
        "worker_lost",
        "kvfence_request_failures",
        "Failed requests, by reason",
        Some(("reason", "worker_lost")),
    ),
    (
        "verify_failed",
        "kvfence_request_failures",
        "Failed requests, by reason",
        Some(("reason", "verify_failed")),
    ),
    (
        "bootstraps",
        "kvfence_bootstraps",
        "Decode reservations confirmed (bootstrap round trips)",
        None,
    ),
    (
        "transfers",
        "kvfence_transfers",
        "Page transfers (pulls) completed",
        None,
    ),
    (
        "pages_transferred",
        "kvfence_transferred_pages",
        "Pages moved from prefill to decode",
        None,
    ),
    (
        "bytes_transferred",
        "kvfence_transferred_bytes",
        "Bytes moved from prefill to decode",
        None,
    ),
    (
        "pages_transferred_shm",
        "kvfence_transport_pages",
        "Pages moved from prefill to decode, by the transport of the pair",
        Some(("transport", "shm")),
    ),
    (
        "pages_transferred_tcp",
        "kvfence_transport_pages",
        "Pages moved from prefill to decode, by the transport of the pair",
        Some(("transport", "tcp")),
    ),
    (
        "pages_transferred_rdma",
        "kvfence_transport_pages",
        "Pages moved from prefill to decode, by the transport of the pair",
        Some(("transport", "rdma")),
    ),
    (
        "bytes_transferred_shm",
        "kvfence_transport_bytes",
        "Bytes moved from prefill to decode, by the transport of the pair",
        Some(("transport", "shm")),
    ),
    (
        "bytes_transferred_tcp",
        "kvfence_transport_bytes",
        "Bytes moved from prefill to decode, by the transport of the pair",
        Some(("transport", "tcp")),
    ),
    (
        "bytes_transferred_rdma",
        "kvfence_transport_bytes",
        "Bytes moved from prefill to decode, by the transport of the pair",
        Some(("transport", "rdma")),
    ),
    (
        "protocol_errors",
        "kvfence_protocol_errors",
        "Frames refused as invalid or out of role",
        None,
    ),
    (
        "workers_registered",
        "kvfence_worker_registrations",
        "Worker registrations accepted",
        None,
    ),
    (
        "registrations_refused",
        "kvfence_worker_registrations_refused",
        "Worker registrations refused (geometry, pool too small, duplicate id)",
        None,
    ),
    (
        "workers_lost",
        "kvfence_workers_lost",
        "Worker connections lost",
        None,
    ),
    (
        "probe_runs",
        "kvfence_probe_runs",
        "Coherence probe runs",
        None,
    ),
    (
        "probe_mismatches",
        "kvfence_probe_mismatches",
        "Coherence probe outputs that differed from the monolithic path",
        None,
    ),
    (
        "probe_errors",
        "kvfence_probe_errors",
        "Coherence probe canaries that failed to run",
        None,
    ),
    (
        "unauthorized",
        "kvfence_unauthorized",
        "Peers refused for their uid",
        None,
    ),
    (
        "connections_refused_uid_limit",
        "kvfence_connections_refused",
        "Connections turned away at accept, by reason",
        Some(("reason", "uid_limit")),
    ),
    (
        "connections_refused_full",
        "kvfence_connections_refused",
        "Connections turned away at accept, by reason",
        Some(("reason", "full")),
    ),
    (
        "connections_refused_no_fds",
        "kvfence_connections_refused",
        "Connections turned away at accept, by reason",
        Some(("reason", "no_fds")),
    ),
    (
        "connections_closed_idle",
        "kvfence_connections_closed_idle",
        "Client connections closed for being idle",
        None,
    ),
    (
        "slot_timeouts",
        "kvfence_decode_slot_timeouts",
        "Queued requests that failed at a deadline while they waited only for a decode batch \
         slot (also counted as failures by reason timeout)",
        None,
    ),
];

/// kvctld's gauges: status name, metric name, help.
const GAUGES: &[(&str, &str, &str)] = &[
    (
        "in_flight",
        "kvfence_requests_in_flight",
        "Requests admitted and not yet ended",
    ),
    (
        "queue_len",
        "kvfence_admission_queue_length",
        "Requests waiting for room",
    ),
    (
        "connections",
        "kvfence_connections",
        "Connections open to kvctld",
    ),
    (
        "decode_slots",
        "kvfence_decode_slots",
        "Batch slots of the registered decode workers (each its [decode] max_batch)",
    ),
    (
        "decode_slots_used",
        "kvfence_decode_slots_used",
        "Decode batch slots taken: requests assigned to a decode worker and not ended",
    ),
];

/// The exposition of `status` and `latencies`.
pub fn render(status: &StatusReply, latencies: &Latencies) -> String {
    let mut registry = Registry::default();
    let stages = Family::<Labels, Fixed>::default();
    registry.register(
        "kvfence_stage_duration_seconds",
        "Time requests spent in each stage they went on from: admission_wait (Submit to \
         admitted), bootstrap (decode reservation), prefill, transfer (the verified pull), \
         decode",
        stages.clone(),
    );
    for stage in Stage::ALL {
        let labels = vec![("stage".to_owned(), stage.label().to_owned())];
        stages
            .get_or_create(&labels)
            .set(&latencies.stages[stage.index()]);
    }
    let first = Fixed::default();
    first.set(&latencies.first_token);
    registry.register(
        "kvfence_time_to_first_token_seconds",
        "From Submit to the first tokens relayed to the client",
        first,
    );
    let whole = Fixed::default();
    whole.set(&latencies.request);
    registry.register(
        "kvfence_request_duration_seconds",
        "From Submit to Done, for requests that completed",
        whole,
    );
    build_info(&mut registry);
    let value = |name: &str| {
        status
            .counters
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
    };

    let mut counter_families: Vec<(&str, Family<Labels, Counter>)> = Vec::new();
    for (status_name, metric, help, label) in COUNTERS {
        let Some(v) = value(status_name) else {
            continue;
        };
        let Some((key, label_value)) = label else {
            let c = Counter::<u64>::default();
            c.inc_by(v);
            registry.register(*metric, *help, c);
            continue;
        };
        let family = match counter_families.iter().find(|(m, _)| m == metric) {
            Some((_, f)) => f.clone(),
            None => {
                let f = counter_family(&mut registry, metric, help);
                counter_families.push((metric, f.clone()));
                f
            }
        };
        let labels: Labels = vec![((*key).to_owned(), (*label_value).to_owned())];
        family.get_or_create(&labels).inc_by(v);
    }
    for (status_name, metric, help) in GAUGES {
        if let Some(v) = value(status_name) {
            gauge(&mut registry, metric, help, v);
        }
    }
    gauge(
        &mut registry,
        "kvfence_max_context_tokens",
        "Longest prompt admitted, in tokens (limits.max_context)",
        u64::from(status.max_context),
    );
    gauge(
        &mut registry,
        "kvfence_max_new_tokens",
        "Most tokens one request may generate (limits.max_new_tokens)",
        u64::from(status.max_new_tokens),
    );

    let workers = WorkerSeries::register(&mut registry, Exporter::Kvctld);
    for w in &status.workers {
        workers.add(
            w,
            request_context_tokens(w.role, status.max_context, status.max_new_tokens),
        );
    }
    exposition(&registry)
}

#[cfg(test)]
mod tests {
    use super::*;
    use libkv::Generation;
    use libkv::proto::{Role, Transport, WorkerStatus};

    fn worker(id: &str, role: Role, pool_pages: u32, connected: bool) -> WorkerStatus {
        WorkerStatus {
            id: id.into(),
            role,
            connected,
            drain: false,
            in_flight: 1,
            held_pages: 3,
            transports: vec![Transport::Shm],
            served: 9,
            counters: vec![("pulls".into(), 5)],
            pool_pages,
            tokens_per_page: 16,
            free: pool_pages - 3,
            reserved: 1,
            writing: 0,
            readable: 2,
            draining: 0,
            max_batch: if role == Role::Decode { 16 } else { 0 },
        }
    }

    fn status() -> StatusReply {
        StatusReply {
            generation: Generation(7),
            max_context: 4096,
            max_new_tokens: 64,
            workers: vec![
                worker("prefill-0", Role::Prefill, 256, true),
                worker("decode-0", Role::Decode, 260, true),
                worker("decode-1", Role::Decode, 0, false),
            ],
            counters: vec![
                ("submitted".into(), 12),
                ("completed".into(), 10),
                ("rejected".into(), 2),
                ("timeouts".into(), 0),
                ("in_flight".into(), 1),
                ("probe_mismatches".into(), 0),
                ("decode_slots".into(), 16),
                ("decode_slots_used".into(), 1),
                ("slot_timeouts".into(), 3),
            ],
            transport: Some(Transport::Shm),
            model: None,
        }
    }

    fn latencies() -> Latencies {
        let mut l = Latencies::default();
        for ms in [1, 3, 700] {
            l.stage(Stage::Pulling).observe(Duration::from_millis(ms));
        }
        l.request.observe(Duration::from_millis(40));
        l
    }

    /// The value of the sample `name{labels}` (labels as exposed, in order).
    fn sample(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn status_becomes_labelled_series() {
        let text = render(&status(), &latencies());
        let get = |s: &str| sample(&text, s).unwrap_or_else(|| panic!("no {s} in:\n{text}"));
        assert_eq!(get("kvfence_requests_submitted_total"), 12.0);
        assert_eq!(get(r#"kvfence_requests_total{outcome="completed"}"#), 10.0);
        assert_eq!(get(r#"kvfence_requests_total{outcome="rejected"}"#), 2.0);
        assert_eq!(
            get(r#"kvfence_request_failures_total{reason="timeout"}"#),
            0.0
        );
        assert_eq!(get("kvfence_requests_in_flight"), 1.0);
        assert_eq!(get("kvfence_decode_slots"), 16.0);
        assert_eq!(get("kvfence_decode_slots_used"), 1.0);
        assert_eq!(get("kvfence_decode_slot_timeouts_total"), 3.0);
        assert_eq!(
            get(r#"kvfence_worker_decode_slots{worker="decode-0",role="decode"}"#),
            16.0
        );
        assert!(
            !text.contains(r#"kvfence_worker_decode_slots{worker="prefill-0""#),
            "a prefill worker has no decode slots"
        );
        assert_eq!(get("kvfence_max_context_tokens"), 4096.0);
        let p = r#"worker="prefill-0",role="prefill""#;
        let d = r#"worker="decode-0",role="decode""#;
        assert_eq!(get(&format!("kvfence_worker_pool_pages{{{p}}}")), 256.0);
        assert_eq!(get(&format!("kvfence_worker_pool_tokens{{{p}}}")), 4096.0);
        assert_eq!(
            get(&format!("kvfence_worker_request_context_tokens{{{p}}}")),
            4096.0
        );
        assert_eq!(
            get(&format!("kvfence_worker_request_context_tokens{{{d}}}")),
            4160.0,
            "decode needs max_context + max_new_tokens"
        );
        assert_eq!(get(&format!("kvfence_worker_pool_tokens{{{d}}}")), 4160.0);
        assert_eq!(
            get(&format!(r#"kvfence_worker_pages{{{p},state="readable"}}"#)),
            2.0
        );
        assert_eq!(get(&format!("kvfence_worker_up{{{p}}}")), 1.0);
        assert_eq!(
            get(r#"kvfence_worker_up{worker="decode-1",role="decode"}"#),
            0.0
        );
        assert!(
            !text.contains(r#"kvfence_worker_pool_pages{worker="decode-1""#),
            "a lost worker has no pool"
        );
        assert_eq!(
            get(&format!(
                r#"kvfence_worker_events_total{{{d},counter="pulls"}}"#
            )),
            5.0
        );
        let t = r#"stage="transfer""#;
        assert_eq!(
            get(&format!("kvfence_stage_duration_seconds_count{{{t}}}")),
            3.0
        );
        assert!((get(&format!("kvfence_stage_duration_seconds_sum{{{t}}}")) - 0.704).abs() < 1e-9);
        // Cumulative buckets: 1 ms in le=0.001, 3 ms by le=0.005, 700 ms by le=1.0.
        assert_eq!(
            get(&format!(
                r#"kvfence_stage_duration_seconds_bucket{{le="0.001",{t}}}"#
            )),
            1.0
        );
        assert_eq!(
            get(&format!(
                r#"kvfence_stage_duration_seconds_bucket{{le="0.005",{t}}}"#
            )),
            2.0
        );
        assert_eq!(
            get(&format!(
                r#"kvfence_stage_duration_seconds_bucket{{le="0.5",{t}}}"#
            )),
            2.0
        );
        assert_eq!(
            get(&format!(
                r#"kvfence_stage_duration_seconds_bucket{{le="+Inf",{t}}}"#
            )),
            3.0
        );
        assert_eq!(
            get(r#"kvfence_stage_duration_seconds_count{stage="prefill"}"#),
            0.0
        );
        assert_eq!(get("kvfence_request_duration_seconds_count"), 1.0);
        assert!(text.contains(r#"kvfence_build_info{version=""#), "{text}");
        assert!(text.contains("# TYPE kvfence_requests counter"), "{text}");
        assert!(text.trim_end().ends_with("# EOF"), "{text}");
    }

    /// Every series name the endpoint exports for a status that has every counter kvctld
    /// reports and a connected worker of each role.
    fn exported_names() -> std::collections::BTreeSet<String> {
        let mut st = status();
        st.counters = COUNTERS
            .iter()
            .map(|(n, ..)| ((*n).to_owned(), 1))
            .chain(GAUGES.iter().map(|(n, ..)| ((*n).to_owned(), 1)))
            .collect();
        render(&st, &latencies())
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|l| l.split(['{', ' ']).next().unwrap_or("").to_owned())
            .collect()
    }

    /// The `kvfence_...` identifiers in `text`.
    fn metric_names(text: &str) -> Vec<String> {
        let mut names = Vec::new();
        let mut rest = text;
        while let Some(i) = rest.find("kvfence_") {
            let tail = &rest[i..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            names.push(tail[..end].to_owned());
            rest = &tail[end..];
        }
        names
    }

    #[test]
    fn the_dashboard_and_the_alerts_use_only_metrics_kvctld_exports() {
        let exported = exported_names();
        let dashboard: serde_json::Value =
            serde_json::from_str(include_str!("../../monitoring/kvfence-dashboard.json"))
                .expect("the dashboard is JSON");
        let mut exprs = Vec::new();
        for panel in dashboard["panels"].as_array().expect("panels") {
            for target in panel["targets"].as_array().expect("targets") {
                exprs.push(target["expr"].as_str().expect("expr").to_owned());
            }
        }
        assert!(exprs.len() >= 10, "{exprs:?}");
        let rules = include_str!("../../monitoring/kvfence.rules.yml");
        let mut used = 0;
        for (source, text) in exprs
            .iter()
            .map(|e| ("the dashboard", e.as_str()))
            .chain([("the alert rules", rules)])
        {
            for name in metric_names(text) {
                used += 1;
                assert!(
                    exported.contains(&name),
                    "{source} uses {name}, which kvctld does not export; it exports {exported:?}"
                );
            }
        }
        assert!(used > 20, "only {used} metric names found");
    }

    #[test]
    fn the_endpoint_answers_metrics_only_and_waits_for_a_first_status() {
        let snapshot = Snapshot::default();
        let addr = serve("127.0.0.1:0".parse().unwrap(), snapshot.clone()).unwrap();
        let get = |path: &str| -> (u16, String) {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
            let mut body = String::new();
            s.read_to_string(&mut body).unwrap();
            let code = body[9..12].parse().unwrap();
            (code, body)
        };
        assert_eq!(get("/metrics").0, 503, "no status published yet");
        snapshot.publish(status(), latencies());
        let (code, body) = get("/metrics");
        assert_eq!(code, 200);
        assert!(
            body.contains("kvfence_requests_submitted_total 12"),
            "{body}"
        );
        assert_eq!(get("/other").0, 404);
        // Garbage and other methods get an answer (or a close), and the endpoint serves on.
        {
            use std::io::{Read, Write};
            for junk in [
                &b"\x00\xff garbage\r\n\r\n"[..],
                b"POST /metrics HTTP/1.0\r\n\r\n",
            ] {
                let mut s = std::net::TcpStream::connect(addr).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                s.write_all(junk).unwrap();
                let mut answer = Vec::new();
                let _ = s.read_to_end(&mut answer);
                assert!(
                    answer.is_empty()
                        || !answer.starts_with(b"HTTP/1.0 200")
                            && !answer.starts_with(b"HTTP/1.1 200"),
                    "{}",
                    String::from_utf8_lossy(&answer)
                );
            }
        }
        assert_eq!(get("/metrics").0, 200, "still serving after bad requests");
    }
}
