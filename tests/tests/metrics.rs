//! kvctld's `/metrics` endpoint on a running stack of 2 prefill + 2 decode workers: after
//! a known load (requests that succeed, one that is rejected), a scrape says the same
//! counts (the latency histograms hold one sample per served request and stage), every
//! worker is up with its pool in pages and tokens beside the context one
//! request needs of it, and a lost worker shows as down.
//!
//! One file for every daemon, as install.sh links it: `[metrics] listen` is kvctld's fixed
//! address and the workers reading the same file do not try to bind it (they start, serve,
//! and log where their own endpoint would be set); `prefill_listen` gives the prefill worker
//! its own, and an address shared by two daemons is refused at `--check-config`.
//!
//! Build the binaries first (`cargo build --release --bins`). Bounded in time.

use kvctld::stack::{error_chain, wait_until};
use kvfence_tests::{
    assert_matches, bin_dir, expected, metrics_addr, model, prompt, scrape, serves_again,
    start_stack,
};
use std::process::Command;
use std::time::Duration;

/// The value of the series `series` (name and labels exactly as exposed).
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn a_scrape_says_what_the_stack_did() {
    let mut running = start_stack("kvmet.", 2, 2, |c| {
        c.metrics.listen = Some("127.0.0.1:0".into());
        c.metrics.prefill_listen = Some("127.0.0.1:0".into());
        c.metrics.decode_listen = Some("127.0.0.1:0".into());
    });
    let stack = &mut running.stack;
    let addr = wait_until(Duration::from_secs(10), || {
        metrics_addr(&stack.log("kvctld"))
    })
    .unwrap_or_else(|| panic!("kvctld logged no metrics address:\n{}", stack.log("kvctld")));

    let model = model(stack);
    let served = 20usize;
    for i in 0..served {
        let tenant = ["acme", "globex"][i % 2];
        let p = prompt(tenant, i, 30 + i * 37);
        let out = stack
            .client()
            .and_then(|mut c| c.generate(tenant, &libkv::model::tokenize(&p), 5, 10_000, |_| {}))
            .unwrap_or_else(|e| panic!("request {i}: {}", error_chain(&e)));
        assert_matches(&out, &expected(&model, &p, 5), &format!("request {i}"));
    }
    let cfg = stack.config().clone();
    let too_long = vec![b'x'; cfg.limits.max_context as usize + 1];
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
            .is_err(),
        "an over-long prompt was served"
    );

    // The loop publishes its status every 100 ms: wait for the counts, never read once.
    let tpp = u64::from(cfg.geometry.tokens_per_page);
    let want = |text: &str| -> Result<(), String> {
        let get = |s: &str| value(text, s).ok_or_else(|| format!("no {s}"));
        let check = |s: &str, v: f64| -> Result<(), String> {
            let got = get(s)?;
            if (got - v).abs() < 0.5 {
                Ok(())
            } else {
                Err(format!("{s} is {got}, want {v}"))
            }
        };
        check(
            r#"kvfence_requests_total{outcome="completed"}"#,
            served as f64,
        )?;
        check(r#"kvfence_requests_total{outcome="rejected"}"#, 1.0)?;
        check(r#"kvfence_rejections_total{reason="prompt_too_long"}"#, 1.0)?;
        check(r#"kvfence_rejections_total{reason="bad_request"}"#, 0.0)?;
        check("kvfence_requests_submitted_total", served as f64 + 1.0)?;
        check("kvfence_requests_in_flight", 0.0)?;
        // Every page moved over the shared pools, none over TCP or RDMA.
        let bytes = get("kvfence_transferred_bytes_total")?;
        if bytes <= 0.0 {
            return Err("no bytes transferred".into());
        }
        check(r#"kvfence_transport_bytes_total{transport="shm"}"#, bytes)?;
        check(r#"kvfence_transport_bytes_total{transport="tcp"}"#, 0.0)?;
        check(r#"kvfence_transport_pages_total{transport="rdma"}"#, 0.0)?;
        check(
            r#"kvfence_transport_pages_total{transport="shm"}"#,
            get("kvfence_transferred_pages_total")?,
        )?;
        // Every served request went through every stage once, and the rejected one none.
        check("kvfence_request_duration_seconds_count", served as f64)?;
        check("kvfence_time_to_first_token_seconds_count", served as f64)?;
        for stage in [
            "admission_wait",
            "bootstrap",
            "prefill",
            "transfer",
            "decode",
        ] {
            check(
                &format!(r#"kvfence_stage_duration_seconds_count{{stage="{stage}"}}"#),
                served as f64,
            )?;
        }
        let mut prefill_served = 0.0;
        for (id, role, pool, need) in [
            (
                "prefill-0",
                "prefill",
                cfg.prefill.pool_pages,
                cfg.limits.max_context,
            ),
            (
                "prefill-1",
                "prefill",
                cfg.prefill.pool_pages,
                cfg.limits.max_context,
            ),
            (
                "decode-0",
                "decode",
                cfg.decode.pool_pages,
                cfg.limits.max_context + cfg.limits.max_new_tokens,
            ),
            (
                "decode-1",
                "decode",
                cfg.decode.pool_pages,
                cfg.limits.max_context + cfg.limits.max_new_tokens,
            ),
        ] {
            let l = format!(r#"worker="{id}",role="{role}""#);
            check(&format!("kvfence_worker_up{{{l}}}"), 1.0)?;
            check(
                &format!("kvfence_worker_pool_pages{{{l}}}"),
                f64::from(pool),
            )?;
            check(
                &format!("kvfence_worker_pool_tokens{{{l}}}"),
                (u64::from(pool) * tpp) as f64,
            )?;
            check(
                &format!("kvfence_worker_request_context_tokens{{{l}}}"),
                f64::from(need),
            )?;
            check(
                &format!(r#"kvfence_worker_pages{{{l},state="free"}}"#),
                f64::from(pool),
            )?;
            if role == "prefill" {
                prefill_served += get(&format!("kvfence_worker_requests_served_total{{{l}}}"))?;
            }
        }
        if (prefill_served - served as f64).abs() > 0.5 {
            return Err(format!(
                "prefill workers served {prefill_served}, want {served}"
            ));
        }
        Ok(())
    };
    let mut last = String::new();
    let ok = wait_until(Duration::from_secs(10), || {
        let text = scrape(&addr)?;
        match want(&text) {
            Ok(()) => Some(()),
            Err(e) => {
                last = format!("{e}\n{text}");
                None
            }
        }
    });
    assert!(ok.is_some(), "the scrape never matched the load: {last}");

    // A worker killed shows as down.
    stack.kill("decode-1").expect("kill decode-1");
    let down = wait_until(Duration::from_secs(10), || {
        let text = scrape(&addr)?;
        (value(
            &text,
            r#"kvfence_worker_up{worker="decode-1",role="decode"}"#,
        ) == Some(0.0))
        .then_some(())
    });
    assert!(down.is_some(), "decode-1 killed but not down in /metrics");
    workers_export_their_own(stack, served as f64);
}

/// Each worker's own `/metrics` (the shared config's `[metrics]` addresses are port 0, so
/// every daemon binds one of its own): its pool, the context it must hold, and its counters, which
/// add up to the requests served. A worker still answers, as not registered, once kvctld is
/// gone.
fn workers_export_their_own(stack: &mut kvctld::stack::Stack, served: f64) {
    let cfg = stack.config().clone();
    let tpp = u64::from(cfg.geometry.tokens_per_page);
    let mut addrs = Vec::new();
    for id in ["prefill-0", "prefill-1", "decode-0"] {
        let addr = wait_until(Duration::from_secs(10), || metrics_addr(&stack.log(id)))
            .unwrap_or_else(|| panic!("{id} logged no metrics address:\n{}", stack.log(id)));
        addrs.push((id, addr));
    }
    let mut last = String::new();
    let ok = wait_until(Duration::from_secs(10), || {
        let mut prefill_runs = 0.0;
        for (id, addr) in &addrs {
            let text = scrape(addr)?;
            let (role, pool, need) = if id.starts_with("prefill") {
                ("prefill", cfg.prefill.pool_pages, cfg.limits.max_context)
            } else {
                (
                    "decode",
                    cfg.decode.pool_pages,
                    cfg.limits.max_context + cfg.limits.max_new_tokens,
                )
            };
            let l = format!(r#"worker="{id}",role="{role}""#);
            let want = [
                (format!("kvfence_worker_up{{{l}}}"), 1.0),
                (format!("kvfence_worker_pool_pages{{{l}}}"), f64::from(pool)),
                (
                    format!("kvfence_worker_pool_tokens{{{l}}}"),
                    (u64::from(pool) * tpp) as f64,
                ),
                (
                    format!("kvfence_worker_request_context_tokens{{{l}}}"),
                    f64::from(need),
                ),
                (
                    format!(r#"kvfence_worker_pages{{{l},state="free"}}"#),
                    f64::from(pool),
                ),
                (format!("kvfence_worker_requests_in_flight{{{l}}}"), 0.0),
            ];
            for (series, v) in want {
                if value(&text, &series) != Some(v) {
                    last = format!("{id}: {series} is not {v}:\n{text}");
                    return None;
                }
            }
            if role == "prefill" {
                prefill_runs += value(
                    &text,
                    &format!(r#"kvfence_worker_events_total{{{l},counter="prefill_runs"}}"#),
                )?;
            }
        }
        if (prefill_runs - served).abs() > 0.5 {
            last = format!("the prefill workers ran {prefill_runs} prefills, want {served}");
            return None;
        }
        Some(())
    });
    assert!(ok.is_some(), "a worker's /metrics never matched: {last}");

    stack.kill("kvctld").expect("kill kvctld");
    let (id, addr) = &addrs[0];
    let alone = wait_until(Duration::from_secs(10), || {
        let text = scrape(addr)?;
        (value(
            &text,
            &format!(r#"kvfence_worker_up{{worker="{id}",role="prefill"}}"#),
        ) == Some(0.0))
        .then_some(())
    });
    assert!(
        alone.is_some(),
        "{id} answered no scrape as unregistered with kvctld gone"
    );
}

#[test]
fn one_file_with_kvctlds_fixed_metrics_address_starts_every_daemon() {
    let mut running = start_stack("kvmetone.", 1, 1, |c| {
        c.metrics.listen = Some("127.0.0.1:0".into());
    });
    let stack = &mut running.stack;
    // kvctld's address, now fixed in the file every daemon reads.
    let kvctld = wait_until(Duration::from_secs(10), || {
        metrics_addr(&stack.log("kvctld"))
    })
    .unwrap_or_else(|| panic!("kvctld logged no metrics address:\n{}", stack.log("kvctld")));
    let mut shared = stack.config().clone();
    shared.metrics.listen = Some(kvctld.clone());
    let mut with_prefill = shared.clone();
    with_prefill.metrics.prefill_listen = Some("127.0.0.1:0".into());
    stack
        .set_worker_config("decode-0", &shared)
        .expect("config");
    stack
        .set_worker_config("prefill-0", &with_prefill)
        .expect("config");
    let decode_log_before = stack.log("decode-0").len();
    let prefill_log_before = stack.log("prefill-0").len();
    for id in ["decode-0", "prefill-0"] {
        stack.restart(id).unwrap_or_else(|e| {
            panic!(
                "{id} with kvctld's metrics address in its file: {}",
                error_chain(&e)
            )
        });
    }
    let model = model(stack);
    serves_again(stack, &model, "prefill-0");
    let decode_log = stack.log("decode-0")[decode_log_before..].to_owned();
    assert!(
        decode_log.contains(&format!("[metrics] listen ({kvctld}) is kvctld's"))
            && decode_log.contains("decode_listen"),
        "decode-0 did not say why it has no metrics endpoint:\n{decode_log}"
    );
    let prefill_log = stack.log("prefill-0")[prefill_log_before..].to_owned();
    let own = metrics_addr(&prefill_log)
        .unwrap_or_else(|| panic!("prefill-0 logged no metrics address:\n{prefill_log}"));
    assert_ne!(own, kvctld, "prefill-0 served metrics on kvctld's address");
    let up = wait_until(Duration::from_secs(10), || {
        let text = scrape(&own)?;
        (value(
            &text,
            r#"kvfence_worker_up{worker="prefill-0",role="prefill"}"#,
        ) == Some(1.0))
        .then_some(())
    });
    assert!(
        up.is_some(),
        "prefill-0's own /metrics at {own} never said it is up"
    );
    let text = scrape(&kvctld).expect("kvctld still answers on its address");
    assert!(
        text.contains(r#"kvfence_worker_up{worker="decode-0",role="decode"} 1"#),
        "kvctld's /metrics lost decode-0:\n{text}"
    );

    // One fixed address for two daemons is refused before anything binds.
    let path = stack.dir().join("clash.toml");
    std::fs::write(&path, toml::to_string(&shared).expect("toml")).expect("write");
    let out = Command::new(bin_dir().join("decoded"))
        .arg("--config")
        .arg(&path)
        .args(["--metrics-listen", &kvctld, "--check-config"])
        .output()
        .expect("decoded --check-config");
    let text = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains(&format!(
            "metrics.listen and metrics.decode_listen are both {kvctld}"
        )),
        "{text}"
    );
}
