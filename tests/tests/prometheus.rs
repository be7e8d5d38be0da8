//! A real Prometheus server scrapes a running stack (2 prefill + 2 decode workers, kvctld's
//! `/metrics` on a free loopback port) every second while clients send a known load; then
//! its HTTP API must say what the load was: the completed and rejected request counters
//! equal the clients' own counts, the latency histograms hold as many samples, each prefill
//! worker's served counter adds up to them, and
//! the pool-versus-context expression of the `KvfencePoolBelowContext` alert holds the
//! configured numbers for every worker (and does not fire).
//!
//! Needs Debian's `prometheus` package (`.ci/run` installs it); without the binary it says
//! SKIPPED. Bounded in time; build the binaries first (`cargo build --release --bins`).

use kvctld::stack::{error_chain, wait_until};
use kvfence_tests::ops::{Reaped, open_tempdir};
use kvfence_tests::{assert_matches, expected, model, prompt, start_stack};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::thread;
use std::time::Duration;

fn prometheus_binary() -> Option<String> {
    let out = Command::new("prometheus")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .ok()?;
    out.success().then(|| "prometheus".to_owned())
}

/// A free loopback port (bound, then let go).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// `GET path` on `addr`: the status code and body.
fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_owned()))
}

/// Percent-encodes a PromQL expression for a query string.
fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The instant vector of `query`: (labels, value) of each series.
fn query(prom: &str, q: &str) -> Option<Vec<(serde_json::Value, f64)>> {
    let (code, body) = get(prom, &format!("/api/v1/query?query={}", encode(q)))?;
    if code != 200 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    let result = v.get("data")?.get("result")?.as_array()?;
    result
        .iter()
        .map(|r| {
            let value = r.get("value")?.get(1)?.as_str()?.parse().ok()?;
            Some((r.get("metric")?.clone(), value))
        })
        .collect()
}

/// The one value of `q`, if it has exactly one series.
fn scalar(prom: &str, q: &str) -> Option<f64> {
    match query(prom, q)?.as_slice() {
        [(_, v)] => Some(*v),
        _ => None,
    }
}

#[test]
fn prometheus_scraping_a_stack_sees_the_load_it_served() {
    let Some(prometheus) = prometheus_binary() else {
        eprintln!("SKIPPED: no prometheus binary (install Debian's prometheus package)");
        return;
    };
    let running = start_stack("kvprom.", 2, 2, |c| {
        c.metrics.listen = Some("127.0.0.1:0".into());
        c.metrics.prefill_listen = Some("127.0.0.1:0".into());
        c.metrics.decode_listen = Some("127.0.0.1:0".into());
    });
    let stack = &running.stack;
    let target = wait_until(Duration::from_secs(10), || {
        kvfence_tests::metrics_addr(&stack.log("kvctld"))
    })
    .expect("kvctld logged its metrics address");

    let dir = open_tempdir("kvprom-server.");
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\n\
             scrape_configs:\n  - job_name: kvfence\n    static_configs:\n      - targets: \
             ['{target}']\n",
            kvfence_tests::ops::workspace_root()
                .join("monitoring/kvfence.rules.yml")
                .display()
        ),
    )
    .expect("prometheus.yml");
    let prom = format!("127.0.0.1:{}", free_port());
    let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log");
    let child = Command::new(prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address={prom}"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("starting prometheus");
    let _prometheus = Reaped(child);
    let prom_log =
        || std::fs::read_to_string(dir.path().join("prometheus.log")).unwrap_or_default();
    let ready = wait_until(Duration::from_secs(30), || {
        (get(&prom, "/-/ready")?.0 == 200).then_some(())
    });
    assert!(
        ready.is_some(),
        "prometheus never became ready:\n{}",
        prom_log()
    );

    // The load: 4 clients, 10 requests each, then 2 over-long prompts.
    let model = model(stack);
    let (clients, each) = (4usize, 10usize);
    thread::scope(|s| {
        for t in 0..clients {
            let model = &model;
            s.spawn(move || {
                for n in 0..each {
                    let tenant = ["acme", "globex", "initech", "umbrella"][t];
                    let p = prompt(tenant, t * 100 + n, 20 + n * 113);
                    let out = stack
                        .client()
                        .and_then(|mut c| {
                            c.generate(tenant, &libkv::model::tokenize(&p), 6, 10_000, |_| {})
                        })
                        .unwrap_or_else(|e| panic!("{tenant} {n}: {}", error_chain(&e)));
                    assert_matches(&out, &expected(model, &p, 6), tenant);
                }
            });
        }
    });
    let cfg = stack.config().clone();
    let too_long = vec![b'y'; cfg.limits.max_context as usize + 1];
    for _ in 0..2 {
        assert!(
            stack
                .client()
                .and_then(|mut c| c.generate(
                    "acme",
                    &libkv::model::tokenize(&too_long),
                    1,
                    10_000,
                    |_| {}
                ))
                .is_err()
        );
    }
    let served = (clients * each) as f64;

    // Scraped every second: wait for Prometheus to have seen the end of the load.
    let seen = wait_until(Duration::from_secs(30), || {
        let completed = scalar(&prom, r#"kvfence_requests_total{outcome="completed"}"#)?;
        let rejected = scalar(&prom, r#"kvfence_requests_total{outcome="rejected"}"#)?;
        (completed == served && rejected == 2.0).then_some(())
    });
    assert!(
        seen.is_some(),
        "prometheus never saw {served} completed and 2 rejected: completed {:?}, rejected {:?}\n{}",
        query(&prom, r#"kvfence_requests_total"#),
        query(&prom, "up"),
        prom_log()
    );
    // The latency histograms hold one sample per served request, per stage.
    for q in [
        "kvfence_request_duration_seconds_count".to_owned(),
        "kvfence_time_to_first_token_seconds_count".to_owned(),
        r#"kvfence_stage_duration_seconds_count{stage="transfer"}"#.to_owned(),
        r#"kvfence_stage_duration_seconds_count{stage="decode"}"#.to_owned(),
    ] {
        assert_eq!(scalar(&prom, &q), Some(served), "{q}");
    }
    let p99 = scalar(
        &prom,
        "histogram_quantile(0.99, kvfence_request_duration_seconds_bucket)",
    )
    .expect("a p99 of the request duration");
    assert!(p99 > 0.0 && p99 <= 30.0, "p99 {p99}");
    let by_prefill = scalar(
        &prom,
        r#"sum(kvfence_worker_requests_served_total{role="prefill"})"#,
    );
    assert_eq!(
        by_prefill,
        Some(served),
        "requests served by prefill workers"
    );

    // The alert's expression, by parts, for every worker: capacity and need as configured.
    let tpp = f64::from(cfg.geometry.tokens_per_page);
    let pools = query(&prom, "kvfence_worker_pool_tokens").expect("pool tokens");
    let needs = query(&prom, "kvfence_worker_request_context_tokens").expect("context tokens");
    assert_eq!(pools.len(), 4, "{pools:?}");
    assert_eq!(needs.len(), 4, "{needs:?}");
    for (labels, v) in &pools {
        let role = labels["role"].as_str().unwrap_or("");
        let want = match role {
            "prefill" => f64::from(cfg.prefill.pool_pages) * tpp,
            _ => f64::from(cfg.decode.pool_pages) * tpp,
        };
        assert_eq!(*v, want, "pool tokens of {labels}");
    }
    for (labels, v) in &needs {
        let want = match labels["role"].as_str().unwrap_or("") {
            "prefill" => f64::from(cfg.limits.max_context),
            _ => f64::from(cfg.limits.max_context + cfg.limits.max_new_tokens),
        };
        assert_eq!(*v, want, "context tokens of {labels}");
    }
    let below = query(
        &prom,
        "kvfence_worker_pool_tokens < kvfence_worker_request_context_tokens",
    )
    .expect("the alert's expression");
    assert!(
        below.is_empty(),
        "pools below context on a valid stack: {below:?}"
    );
    // The rules loaded, and none of them fires on this healthy stack.
    let (code, rules) = get(&prom, "/api/v1/rules").expect("rules");
    assert_eq!(code, 200);
    assert!(rules.contains("KvfencePoolBelowContext"), "{rules}");
    let firing = query(&prom, r#"ALERTS{alertstate="firing"}"#).expect("alerts");
    assert!(
        firing.is_empty(),
        "alerts firing on a healthy stack: {firing:?}"
    );
}
