//! What `scripts/install.sh` installs starts on the host it is installed on, and
//! `--check-config` refuses what start would refuse.
//!
//! Runs the installer staged (`--destdir`, `--no-build`: it installs the binaries just
//! built), checks the configuration it wrote with the installed `kvctld --check-config`,
//! then starts kvctld and the default worker pair on that configuration (on a temporary
//! socket) and serves a request. The example configuration (GPU pools, `backend = "cuda"`)
//! is refused by `--check-config`, and by a start, with what is missing and what to edit. Build the binaries first
//! (`cargo build --release --bins`).

use kvctld::stack::{Stack, StackOptions, error_chain};
use kvfence_tests::ops::{describe, open_tempdir, run_bounded, workspace_root};
use kvfence_tests::{LogsOnPanic, bin_dir};
use libkv::config::{Backend, Config};
use libkv::model::{ReferenceModel, monolithic, tokenize};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn install(destdir: &Path, extra: &[&str]) -> kvfence_tests::ops::Ran {
    let target = bin_dir().parent().expect("target dir").to_path_buf();
    let mut cmd = Command::new(workspace_root().join("scripts/install.sh"));
    cmd.arg("--destdir")
        .arg(destdir)
        .arg("--no-build")
        .args(extra)
        .env("CARGO_TARGET_DIR", target);
    run_bounded(&mut cmd, None, Duration::from_secs(60))
}

fn check_config(bin: &Path, config: &Path) -> kvfence_tests::ops::Ran {
    let mut cmd = Command::new(bin.join("kvctld"));
    cmd.arg("--check-config").arg(config);
    run_bounded(&mut cmd, None, Duration::from_secs(30))
}

#[test]
fn the_installed_configuration_starts_on_this_host() {
    let dest = open_tempdir("kvinst.");
    let ran = install(dest.path(), &[]);
    assert!(ran.ok(), "{}", describe("install.sh", &ran));
    assert!(
        ran.stdout.contains("would start on this host"),
        "{}",
        describe("install.sh", &ran)
    );
    let etc = dest.path().join("etc/kvfence");
    let installed = etc.join("kvfence.toml");
    let cfg = Config::load(&installed).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    assert_eq!(cfg.prefill.backend, Backend::Host);
    assert_eq!(cfg.decode.backend, Backend::Host);
    // Every daemon accepts it as installed (the workers through the default pair's links).
    let bin = dest.path().join("usr/local/bin");
    let ran = check_config(&bin, &installed);
    assert!(ran.ok(), "{}", describe("kvctld --check-config", &ran));
    for (daemon, id) in [("prefilld", "prefill-0"), ("decoded", "decode-0")] {
        let mut cmd = Command::new(bin.join(daemon));
        cmd.arg("--id")
            .arg(id)
            .arg("--config")
            .arg(etc.join(format!("{id}.toml")))
            .arg("--check-config");
        let ran = run_bounded(&mut cmd, None, Duration::from_secs(30));
        assert!(ran.ok(), "{}", describe(daemon, &ran));
    }

    // And it starts: kvctld and the default pair on it, on a temporary socket.
    let dir = open_tempdir("kvinstrun.");
    let _logs = LogsOnPanic(dir.path().to_path_buf());
    let mut run_cfg = cfg.clone();
    run_cfg.control.socket = dir.path().join("kvctld.sock");
    run_cfg.probe.interval_s = 0;
    let mut opts = StackOptions::new(run_cfg, dir.path().to_path_buf()).expect("options");
    opts.bin_dir = bin_dir();
    // Pools of up to 4 GiB each are pre-faulted at start.
    opts.ready_timeout = Duration::from_secs(90);
    let stack = Stack::start(opts).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let model = ReferenceModel::new(stack.config().geometry).expect("model");
    let prompt = b"a request on the installed configuration";
    let out = stack
        .client()
        .and_then(|mut c| c.generate("acme", &libkv::model::tokenize(prompt), 8, 30_000, |_| {}))
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let want = monolithic(&model, &tokenize(prompt), 8).expect("monolithic");
    assert_eq!(out.tokens, want.tokens);
    assert_eq!(out.done.signature, want.signature);
}

#[test]
fn the_example_configuration_is_refused_with_what_to_edit() {
    let dest = open_tempdir("kvinst.");
    let ran = install(dest.path(), &["--example-config"]);
    assert!(
        ran.ok(),
        "{}",
        describe("install.sh --example-config", &ran)
    );
    assert!(
        ran.stderr.contains("would not start") && ran.stderr.contains("backend = \"host\""),
        "{}",
        describe("install.sh --example-config", &ran)
    );
    let ran = check_config(
        &bin_dir(),
        &workspace_root().join("libkv/kvfence.example.toml"),
    );
    assert_eq!(ran.code(), Some(2), "{}", describe("--check-config", &ran));
    // Without a driver the refusal names the library; with one, the model on the host.
    let why = if libkv::memory::cuda::driver_present() {
        "runs on the host CPU"
    } else {
        "libcuda.so.1 cannot be loaded"
    };
    assert!(
        ran.stderr.contains(why) && ran.stderr.contains("[prefill] backend = \"cuda\""),
        "{}",
        describe("--check-config", &ran)
    );
    // Each worker says so too, and so does a start.
    let example = workspace_root().join("libkv/kvfence.example.toml");
    for (daemon, side) in [("prefilld", "prefill"), ("decoded", "decode")] {
        let mut cmd = Command::new(bin_dir().join(daemon));
        cmd.arg("--check-config").arg(&example);
        let ran = run_bounded(&mut cmd, None, Duration::from_secs(30));
        assert_eq!(ran.code(), Some(2), "{}", describe(daemon, &ran));
        assert!(ran.stderr.contains("would not start"), "{}", ran.stderr);
        let mut cmd = Command::new(bin_dir().join(daemon));
        cmd.arg("--config").arg(&example);
        let ran = run_bounded(&mut cmd, None, Duration::from_secs(30));
        assert_eq!(ran.code(), Some(2), "{}", describe(daemon, &ran));
        assert!(
            ran.stderr.contains(why)
                && ran.stderr.contains(&format!("[{side}] backend = \"cuda\"")),
            "{}",
            describe(daemon, &ran)
        );
    }
}

#[test]
fn a_pool_larger_than_the_host_is_refused_by_check_config() {
    let (limit, _) = libkv::worker::memory_limit().expect("memory limit of this host");
    let dir = open_tempdir("kvinst.");
    let mut cfg = Config::embedded_default(dir.path().join("kvctld.sock"));
    let page = cfg.geometry.bytes_per_page();
    cfg.decode.pool_pages = u32::try_from(limit / page + 1).unwrap_or(u32::MAX);
    let path = dir.path().join("big.toml");
    kvfence_tests::ops::write_config(&path, &cfg);
    let ran = check_config(&bin_dir(), &path);
    assert_eq!(ran.code(), Some(2), "{}", describe("--check-config", &ran));
    assert!(
        ran.stderr.contains("[decode] pool of") && ran.stderr.contains(&limit.to_string()),
        "{}",
        describe("--check-config", &ran)
    );
}
