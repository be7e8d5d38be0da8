//! Prometheus exposition for every kvfence daemon: the HTTP endpoint (`GET /metrics`), the
//! per-worker series, and the helpers that define a metric once.
//!
//! kvctld exports its own counters and every worker's pool as the workers last reported
//! them; each worker, when its `[metrics] listen` is set, exports its own pool and counters
//! with the same names and labels ([`WorkerSeries`]), so a dashboard or alert reads the same
//! whichever it scrapes. A daemon's loop publishes what it knows into a [`Board`] now and
//! then; a scrape renders the latest publication on the HTTP thread and never waits on the
//! loop, so requests pay nothing for metrics.
//!
//! Per worker, the pool's capacity in pages (`kvfence_worker_pool_pages`) and in tokens
//! (`kvfence_worker_pool_tokens`) stand beside the context one request may need of that pool
//! (`kvfence_worker_request_context_tokens`: `max_context`, plus `max_new_tokens` on decode),
//! so "a pool below the context" is one expression:
//! `kvfence_worker_pool_tokens < kvfence_worker_request_context_tokens`.

use crate::proto::{Role, WorkerStatus};
use log::{info, warn};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// A metric's labels, in the order they are exposed.
pub type Labels = Vec<(String, String)>;

/// The latest thing a daemon's loop published for scrapes (`None` until the first).
#[derive(Debug)]
pub struct Board<T>(Arc<Mutex<Option<T>>>);

impl<T> Clone for Board<T> {
    fn clone(&self) -> Self {
        Board(Arc::clone(&self.0))
    }
}

impl<T> Default for Board<T> {
    fn default() -> Self {
        Board(Arc::new(Mutex::new(None)))
    }
}

impl<T: Clone> Board<T> {
    /// Replaces what scrapes see.
    pub fn publish(&self, value: T) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(value);
    }

    /// What was published last.
    pub fn latest(&self) -> Option<T> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Starts the HTTP listener on `addr` on a thread of its own; `render` gives the exposition,
/// or `None` while the daemon has published nothing yet (answered 503). Returns the address
/// bound (port 0 picks a free port) and logs it as `metrics on http://ADDR/metrics`.
pub fn serve(
    addr: SocketAddr,
    daemon: &'static str,
    render: impl Fn() -> Option<String> + Send + 'static,
) -> io::Result<SocketAddr> {
    let server = tiny_http::Server::http(addr).map_err(io::Error::other)?;
    let bound = server
        .server_addr()
        .to_ip()
        .ok_or_else(|| io::Error::other("the metrics listener has no IP address"))?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for request in server.incoming_requests() {
                let response = answer(request.method(), request.url(), daemon, &render);
                if let Err(e) = request.respond(response) {
                    warn!("metrics: answering a scrape: {e}");
                }
            }
        })?;
    info!("metrics on http://{bound}/metrics");
    Ok(bound)
}

fn answer(
    method: &tiny_http::Method,
    url: &str,
    daemon: &str,
    render: &dyn Fn() -> Option<String>,
) -> tiny_http::Response<io::Cursor<Vec<u8>>> {
    let text = |code: u16, body: String, kind: &str| {
        let header = tiny_http::Header::from_bytes("Content-Type", kind).expect("static header");
        tiny_http::Response::from_string(body)
            .with_status_code(code)
            .with_header(header)
    };
    let path = url.split('?').next().unwrap_or("");
    match (method, path) {
        (tiny_http::Method::Get, "/metrics") => match render() {
            Some(body) => text(
                200,
                body,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            ),
            None => text(503, format!("{daemon} is starting\n"), "text/plain"),
        },
        (tiny_http::Method::Get, _) => text(404, "only /metrics is here\n".into(), "text/plain"),
        _ => text(405, "GET /metrics only\n".into(), "text/plain"),
    }
}

/// Registers a family of gauges.
pub fn gauge_family(registry: &mut Registry, name: &str, help: &str) -> Family<Labels, Gauge> {
    let f = Family::<Labels, Gauge>::default();
    registry.register(name, help, f.clone());
    f
}

/// Registers a family of counters (exposed as `NAME_total`).
pub fn counter_family(registry: &mut Registry, name: &str, help: &str) -> Family<Labels, Counter> {
    let f = Family::<Labels, Counter>::default();
    registry.register(name, help, f.clone());
    f
}

/// Registers one gauge without labels, set to `value`.
pub fn gauge(registry: &mut Registry, name: &str, help: &str, value: u64) {
    let g = Gauge::<i64>::default();
    set(&g, value);
    registry.register(name, help, g);
}

/// Sets a gauge to `value` (saturating).
pub fn set(g: &Gauge, value: u64) {
    g.set(i64::try_from(value).unwrap_or(i64::MAX));
}

/// Registers `kvfence_build_info{version}`.
pub fn build_info(registry: &mut Registry) {
    registry.register(
        "kvfence_build",
        "The kvfence build serving",
        Info::new(vec![("version", env!("CARGO_PKG_VERSION"))]),
    );
}

/// The registry in the text exposition format.
pub fn exposition(registry: &Registry) -> String {
    let mut out = String::new();
    if let Err(e) = encode(&mut out, registry) {
        warn!("metrics: encoding: {e}");
    }
    out
}

/// The role's label value.
pub fn role_label(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Client => "client",
    }
}

/// `worker` and `role` of a worker's series.
pub fn worker_labels(w: &WorkerStatus) -> Labels {
    vec![
        ("worker".to_owned(), w.id.clone()),
        ("role".to_owned(), role_label(w.role).to_owned()),
    ]
}

/// Tokens one request of the largest size needs of a pool of `role`: `max_context` on
/// prefill, `max_context + max_new_tokens` on decode.
pub fn request_context_tokens(role: Role, max_context: u32, max_new_tokens: u32) -> u64 {
    match role {
        Role::Decode => u64::from(max_context) + u64::from(max_new_tokens),
        _ => u64::from(max_context),
    }
}

/// Who exports a worker's series: kvctld (from the worker's reports, with its ledger) or
/// the worker itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exporter {
    Kvctld,
    Worker,
}

/// The per-worker series, defined once for kvctld and the workers.
#[derive(Debug)]
pub struct WorkerSeries {
    exporter: Exporter,
    up: Family<Labels, Gauge>,
    draining: Family<Labels, Gauge>,
    pool_pages: Family<Labels, Gauge>,
    pool_tokens: Family<Labels, Gauge>,
    context: Family<Labels, Gauge>,
    pages: Family<Labels, Gauge>,
    in_flight: Family<Labels, Gauge>,
    decode_slots: Family<Labels, Gauge>,
    events: Family<Labels, Counter>,
    verify_failures: Family<Labels, Counter>,
    /// kvctld's ledger only.
    lent: Option<Family<Labels, Gauge>>,
    served: Option<Family<Labels, Counter>>,
}

impl WorkerSeries {
    /// Registers the families in `registry`.
    pub fn register(registry: &mut Registry, exporter: Exporter) -> WorkerSeries {
        let up_help = match exporter {
            Exporter::Kvctld => "1 while the worker is registered and connected, 0 once lost",
            Exporter::Worker => "1 while the worker is registered with kvctld, 0 while not",
        };
        let mut s = WorkerSeries {
            exporter,
            up: gauge_family(registry, "kvfence_worker_up", up_help),
            draining: gauge_family(
                registry,
                "kvfence_worker_draining",
                "1 while an operator or SIGTERM drains the worker",
            ),
            pool_pages: gauge_family(
                registry,
                "kvfence_worker_pool_pages",
                "Pages of the worker's pool",
            ),
            pool_tokens: gauge_family(
                registry,
                "kvfence_worker_pool_tokens",
                "Tokens the worker's pool holds (pages x tokens per page)",
            ),
            context: gauge_family(
                registry,
                "kvfence_worker_request_context_tokens",
                "Tokens one request of the largest size needs of this pool: max_context on \
                 prefill, max_context + max_new_tokens on decode",
            ),
            pages: gauge_family(
                registry,
                "kvfence_worker_pages",
                "Pages of the worker's pool by state (on kvctld: as the worker last reported)",
            ),
            in_flight: gauge_family(
                registry,
                "kvfence_worker_requests_in_flight",
                "Requests on the worker now",
            ),
            decode_slots: gauge_family(
                registry,
                "kvfence_worker_decode_slots",
                "A decode worker's batch slots ([decode] max_batch): kvctld assigns it no more \
                 requests at once, so its requests in flight are the slots taken",
            ),
            events: counter_family(
                registry,
                "kvfence_worker_events",
                "The worker's own counters, by name (prefill_runs, pages_served, pulls, \
                 verify_failed, windows_bound, ...)",
            ),
            verify_failures: counter_family(
                registry,
                "kvfence_worker_verify_failures",
                "Transfers decode refused before attention, by reason: coverage (tokens, pages \
                 or digests do not cover the reservation), ownership (a page not the \
                 request's, or not readable), writer (a writer may still touch the pages), \
                 digest (a page's bytes differ from the manifest's digest)",
            ),
            lent: None,
            served: None,
        };
        if exporter == Exporter::Kvctld {
            s.lent = Some(gauge_family(
                registry,
                "kvfence_worker_lent_pages",
                "Pages kvctld's ledger has lent to requests on the worker",
            ));
            s.served = Some(counter_family(
                registry,
                "kvfence_worker_requests_served",
                "Requests the worker took part in that ended (since it registered)",
            ));
        }
        s
    }

    /// Adds the series of `w`, whose requests may need `context_tokens` of its pool. A worker
    /// kvctld lost shows only as down and not draining: its pool is not known.
    pub fn add(&self, w: &WorkerStatus, context_tokens: u64) {
        let labels = worker_labels(w);
        set(&self.up.get_or_create(&labels), u64::from(w.connected));
        set(&self.draining.get_or_create(&labels), u64::from(w.drain));
        if !w.connected && self.exporter == Exporter::Kvctld {
            return;
        }
        set(
            &self.pool_pages.get_or_create(&labels),
            u64::from(w.pool_pages),
        );
        set(
            &self.pool_tokens.get_or_create(&labels),
            u64::from(w.pool_pages) * u64::from(w.tokens_per_page),
        );
        set(&self.context.get_or_create(&labels), context_tokens);
        for (state, n) in [
            ("free", w.free),
            ("reserved", w.reserved),
            ("writing", w.writing),
            ("readable", w.readable),
            ("draining", w.draining),
        ] {
            let mut l = labels.clone();
            l.push(("state".to_owned(), state.to_owned()));
            set(&self.pages.get_or_create(&l), u64::from(n));
        }
        set(
            &self.in_flight.get_or_create(&labels),
            u64::from(w.in_flight),
        );
        if w.role == Role::Decode && w.max_batch > 0 {
            set(
                &self.decode_slots.get_or_create(&labels),
                u64::from(w.max_batch),
            );
        }
        if let Some(lent) = &self.lent {
            set(&lent.get_or_create(&labels), u64::from(w.held_pages));
        }
        if let Some(served) = &self.served {
            served.get_or_create(&labels).inc_by(w.served);
        }
        for (name, v) in &w.counters {
            let mut l = labels.clone();
            l.push(("counter".to_owned(), name.clone()));
            self.events.get_or_create(&l).inc_by(*v);
            if let Some(reason) = name.strip_prefix("verify_failed_") {
                let mut l = labels.clone();
                l.push(("reason".to_owned(), reason.to_owned()));
                self.verify_failures.get_or_create(&l).inc_by(*v);
            }
        }
    }
}

/// What a worker publishes for its own `/metrics`: its status as it sees it, and the
/// context one request may need of its pool.
#[derive(Clone, Debug)]
pub struct WorkerSample {
    pub status: WorkerStatus,
    pub context_tokens: u64,
}

/// A worker's exposition: build info and its own series.
pub fn render_worker(sample: &WorkerSample) -> String {
    let mut registry = Registry::default();
    build_info(&mut registry);
    WorkerSeries::register(&mut registry, Exporter::Worker)
        .add(&sample.status, sample.context_tokens);
    exposition(&registry)
}

/// Starts a worker's endpoint on `addr`, answering from what its loop publishes on the
/// returned board; returns it with the address bound.
pub fn serve_worker(
    addr: SocketAddr,
    daemon: &'static str,
) -> io::Result<(SocketAddr, Board<WorkerSample>)> {
    let board = Board::<WorkerSample>::default();
    let latest = board.clone();
    let bound = serve(addr, daemon, move || {
        latest.latest().map(|s| render_worker(&s))
    })?;
    Ok((bound, board))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::Transport;

    fn status(connected: bool) -> WorkerStatus {
        WorkerStatus {
            id: "decode-3".into(),
            role: Role::Decode,
            connected,
            drain: true,
            in_flight: 2,
            held_pages: 7,
            transports: vec![Transport::Tcp],
            served: 11,
            counters: vec![
                ("pulls".into(), 5),
                ("verify_failed".into(), 1),
                ("verify_failed_digest".into(), 1),
            ],
            pool_pages: 100,
            tokens_per_page: 16,
            free: 90,
            reserved: 4,
            writing: 3,
            readable: 2,
            draining: 1,
            max_batch: 16,
        }
    }

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn a_worker_exports_its_own_pool_and_counters() {
        let text = render_worker(&WorkerSample {
            status: status(false),
            context_tokens: 1040,
        });
        let l = r#"worker="decode-3",role="decode""#;
        let get = |s: String| value(&text, &s).unwrap_or_else(|| panic!("no {s} in:\n{text}"));
        assert_eq!(get(format!("kvfence_worker_up{{{l}}}")), 0.0);
        assert_eq!(get(format!("kvfence_worker_draining{{{l}}}")), 1.0);
        // Not registered, the worker still knows its pool (kvctld would not).
        assert_eq!(get(format!("kvfence_worker_pool_tokens{{{l}}}")), 1600.0);
        assert_eq!(
            get(format!("kvfence_worker_request_context_tokens{{{l}}}")),
            1040.0
        );
        for (state, n) in [
            ("free", 90.0),
            ("reserved", 4.0),
            ("writing", 3.0),
            ("readable", 2.0),
            ("draining", 1.0),
        ] {
            assert_eq!(
                get(format!(r#"kvfence_worker_pages{{{l},state="{state}"}}"#)),
                n
            );
        }
        assert_eq!(
            get(format!(
                r#"kvfence_worker_events_total{{{l},counter="verify_failed"}}"#
            )),
            1.0
        );
        assert_eq!(
            get(format!("kvfence_worker_requests_in_flight{{{l}}}")),
            2.0
        );
        assert_eq!(get(format!("kvfence_worker_decode_slots{{{l}}}")), 16.0);
        assert!(!text.contains("kvfence_worker_lent_pages"), "{text}");
        assert!(!text.contains("kvfence_worker_requests_served"), "{text}");
        assert!(text.contains(r#"kvfence_build_info{version=""#), "{text}");
        assert!(text.trim_end().ends_with("# EOF"), "{text}");
    }

    #[test]
    fn kvctld_shows_a_lost_worker_as_down_without_a_pool() {
        let mut registry = Registry::default();
        let series = WorkerSeries::register(&mut registry, Exporter::Kvctld);
        series.add(&status(false), 1040);
        let text = exposition(&registry);
        assert_eq!(
            value(
                &text,
                r#"kvfence_worker_up{worker="decode-3",role="decode"}"#
            ),
            Some(0.0)
        );
        assert!(!text.contains("kvfence_worker_pool_pages{"), "{text}");
    }

    /// `GET path` on `addr`: the status code and the whole answer.
    fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        (body[9..12].parse().unwrap(), body)
    }

    #[test]
    fn a_worker_endpoint_answers_503_until_the_first_sample() {
        let (addr, board) = serve_worker("127.0.0.1:0".parse().unwrap(), "decoded").unwrap();
        let (code, body) = get(addr, "/metrics");
        assert_eq!(code, 503, "{body}");
        assert!(body.contains("decoded is starting"), "{body}");
        board.publish(WorkerSample {
            status: status(true),
            context_tokens: 1,
        });
        let (code, body) = get(addr, "/metrics");
        assert_eq!(code, 200, "{body}");
        assert!(
            body.contains(r#"kvfence_worker_up{worker="decode-3",role="decode"} 1"#),
            "{body}"
        );
        assert_eq!(get(addr, "/").0, 404);
    }
}
