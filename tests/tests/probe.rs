//! The coherence probe: canaries through the live system against the monolithic path.
//!
//! On a healthy stack `kvctl probe` passes and kvctld's periodic probe counts runs and no
//! mismatch. On a build whose prefill leaves stale pages behind while reporting full
//! coverage (the incident's failure seen from decode: every check on counts passes), the
//! probe is the alarm: `kvctl probe` exits 7 and kvctld counts mismatches.

use kvctld::stack::{Stack, StackOptions, default_bin_dir, wait_until};
use libkv::config::Config;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn start(bin_dir: PathBuf, probe_every_s: u32) -> (tempfile::TempDir, Stack) {
    let dir = tempfile::Builder::new()
        .prefix("kvprobe")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg = Config::embedded_default(dir.path().join("ctl.sock"));
    cfg.probe.interval_s = probe_every_s;
    let mut opts = StackOptions::new(cfg, dir.path().join("stack")).unwrap();
    opts.bin_dir = bin_dir;
    let stack = Stack::start(opts)
        .unwrap_or_else(|e| panic!("starting the stack: {}", kvctld::stack::error_chain(&e)));
    (dir, stack)
}

fn kvctl_probe(bin: &Path, stack: &Stack) -> (Option<i32>, String) {
    let out = Command::new(bin.join("kvctl"))
        .arg("--config")
        .arg(stack.config_path())
        .arg("probe")
        .output()
        .expect("running kvctl probe");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

fn counter(stack: &Stack, name: &str) -> u64 {
    let st = stack.status().expect("status");
    st.counters
        .iter()
        .find(|(n, _)| n == name)
        .map_or(0, |c| c.1)
}

#[test]
fn probe_passes_on_a_healthy_stack() {
    let bin = default_bin_dir().unwrap();
    let (_d, mut stack) = start(bin.clone(), 1);
    let (code, text) = kvctl_probe(&bin, &stack);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("4 of 4 canaries matched"), "{text}");
    // The periodic probe inside kvctld runs too, and finds nothing.
    let runs = wait_until(Duration::from_secs(10), || {
        let n = counter(&stack, "probe_runs");
        (n >= 2).then_some(n)
    });
    assert!(runs.is_some(), "kvctld's periodic probe did not run");
    assert_eq!(counter(&stack, "probe_mismatches"), 0);
    let _ = stack.stop();
}

#[test]
fn probe_catches_a_prefill_that_leaves_stale_pages() {
    let bin = default_bin_dir().unwrap();
    let faulty = bin
        .parent()
        .map(|t| t.join("faulty/release"))
        .unwrap_or(bin);
    if !faulty.join("prefilld").is_file() {
        assert!(
            std::env::var_os("CI").is_none(),
            "no fault-injection build in {}",
            faulty.display()
        );
        eprintln!(
            "SKIPPED: no fault-injection build in {} (scripts/test builds one)",
            faulty.display()
        );
        return;
    }
    // SAFETY: this test binary runs no C code that reads the environment; std serialises its
    // own environment reads (Command::spawn) and writes with a lock.
    unsafe { std::env::set_var("KVFENCE_FAULT", "stale-kv") };
    let (_d, mut stack) = start(faulty.clone(), 1);
    // Other tenants' requests leave their KV in the pages first.
    let mut c = stack.client().unwrap();
    for i in 0..8 {
        let prompt = format!("tenant other secret {i} {}", "z".repeat(40 + i * 10));
        let _ = c.generate(
            "other",
            &libkv::model::tokenize(prompt.as_bytes()),
            8,
            0,
            |_| {},
        );
    }
    let (code, text) = kvctl_probe(&faulty, &stack);
    eprintln!("{text}");
    assert_eq!(code, Some(7), "the probe missed a broken prefill: {text}");
    assert!(text.contains("MISMATCH"), "{text}");
    let seen = wait_until(Duration::from_secs(10), || {
        let n = counter(&stack, "probe_mismatches");
        (n > 0).then_some(n)
    });
    assert!(
        seen.is_some(),
        "kvctld's periodic probe did not count the mismatch"
    );
    let _ = stack.stop();
}
