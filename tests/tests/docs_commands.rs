//! Every command README.md and systemd/README.md show, run as written.
//!
//! The test takes each ```sh block of the two files and runs it with `sh -e`, in order, in
//! one temporary installation: `/etc/kvfence` becomes a temporary directory holding a small
//! host config (and the `prefill-0.toml` and `decode-0.toml` links install.sh makes), the
//! binaries are those just built, and a few names are shell functions:
//!
//! - `kvctl` talks to the temporary kvctld (`--config` of the temporary file, unless the
//!   line gives its own);
//! - `kvctld`, `prefilld`, `decoded` and `openaid` without `--check-config` start in the
//!   background (a daemon's documented command runs in the foreground) and return once it
//!   serves or has registered;
//! - `systemctl` does what the units would for `enable --now`, `start`, `stop` and
//!   `restart` of `kvctld.socket`, `kvctld.service`, `kvfence.target`, `prefilld@NAME` and
//!   `decoded@NAME` (the units run `prefilld --id NAME --config /etc/kvfence/NAME.toml`) and
//!   `openaid.service`, and nothing for the rest (`daemon-reload`, `reset-failed`).
//!
//! Lines that need what a test cannot have here are skipped and listed: the installer and
//! the VM scripts (tested by `tests/install.rs` and `tests/vm/`), cargo and the long runs,
//! and `...`. openaid's documented address, `127.0.0.1:8000`, becomes a free port of
//! loopback. `[--opt]` in a line is run both without and with the options. Everything is
//! bounded; build the binaries first (`cargo build --release --bins`).

use kvfence_tests::bin_dir;
use kvfence_tests::ops::{open_tempdir, run_bounded, workspace_root, write_config};
use libkv::config::Config;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Shell functions every block runs under; `$T` is the temporary installation.
const PREAMBLE: &str = r#"
CFG="$T/etc/kvfence/kvfence.toml"
log() { echo "docs: $*" >&2; }
kvctl() {
  case "$1" in
    --config|--socket) command kvctl "$@" ;;
    *) command kvctl --config "$CFG" "$@" ;;
  esac
}
running() { [ -f "$T/pids/$1" ] && kill -0 "$(cat "$T/pids/$1")" 2>/dev/null; }
wait_serving() {
  local n
  n=0
  until command kvctl --config "$CFG" status >/dev/null 2>&1; do
    n=$((n + 1)); [ $n -le 150 ] || { log "kvctld does not serve"; return 1; }; sleep 0.1
  done
}
wait_registered() {
  local n
  n=0
  until grep -q "registered with kvctld" "$T/logs/$1.log" 2>/dev/null; do
    n=$((n + 1))
    [ $n -le 300 ] || { log "$1 did not register"; cat "$T/logs/$1.log" >&2; return 1; }
    running "$1" || { log "$1 exited"; cat "$T/logs/$1.log" >&2; return 1; }
    sleep 0.1
  done
}
is_check() { for a in "$@"; do [ "$a" = --check-config ] && return 0; done; return 1; }
# A daemon's command, in the background; NAME is its worker id (or kvctld).
start_daemon() {
  local name
  name=$1; shift
  running "$name" && return 0
  : > "$T/logs/$name.log"
  RUST_LOG=info command "$@" >> "$T/logs/$name.log" 2>&1 &
  echo $! > "$T/pids/$name"
  if [ "$name" = kvctld ]; then wait_serving; else wait_registered "$name"; fi
}
stop_daemon() {
  local pid n
  running "$1" || return 0
  pid=$(cat "$T/pids/$1"); kill -TERM "$pid"
  n=0; while kill -0 "$pid" 2>/dev/null; do
    n=$((n + 1)); [ $n -le 200 ] || { log "$1 did not stop"; return 1; }; sleep 0.1
  done
  rm -f "$T/pids/$1"
}
id_of() {
  local prev a
  prev=; for a in "$@"; do [ "$prev" = --id ] && { echo "$a"; return; }; prev=$a; done
  echo "$1"
}
kvctld() { if is_check "$@"; then command kvctld "$@"; else start_daemon kvctld kvctld "$@"; fi; }
prefilld() { if is_check "$@"; then command prefilld "$@"; else start_daemon "$(id_of "$@")" prefilld "$@"; fi; }
decoded() { if is_check "$@"; then command decoded "$@"; else start_daemon "$(id_of "$@")" decoded "$@"; fi; }
start_openaid() {
  local n
  running openaid && return 0
  : > "$T/logs/openaid.log"
  RUST_LOG=info command openaid "$@" >> "$T/logs/openaid.log" 2>&1 &
  echo $! > "$T/pids/openaid"
  n=0
  until grep -q "openaid on http://" "$T/logs/openaid.log"; do
    n=$((n + 1))
    [ $n -le 300 ] || { log "openaid did not start"; cat "$T/logs/openaid.log" >&2; return 1; }
    running openaid || { log "openaid exited"; cat "$T/logs/openaid.log" >&2; return 1; }
    sleep 0.1
  done
}
openaid() { if is_check "$@"; then command openaid "$@"; else start_openaid "$@"; fi; }
unit_start() {
  local u n w
  u=${1%.service}
  case $u in
    kvctld.socket|kvctld) start_daemon kvctld kvctld --config "$CFG" ;;
    kvfence.target)
      start_daemon kvctld kvctld --config "$CFG"
      for w in $(cat "$T/enabled" 2>/dev/null); do unit_start "$w"; done ;;
    prefilld@*) n=${u#prefilld@}; start_daemon "$n" prefilld --id "$n" --config "$T/etc/kvfence/$n.toml" ;;
    decoded@*) n=${u#decoded@}; start_daemon "$n" decoded --id "$n" --config "$T/etc/kvfence/$n.toml" ;;
    openaid) start_openaid --config "$CFG" ;;
    *) log "systemctl: nothing to do for $u" ;;
  esac
}
unit_stop() {
  local u w
  u=${1%.service}
  case $u in
    prefilld@*) stop_daemon "${u#prefilld@}" ;;
    decoded@*) stop_daemon "${u#decoded@}" ;;
    openaid) stop_daemon openaid ;;
    kvfence.target|kvctld|kvctld.socket)
      for w in $(cat "$T/enabled" 2>/dev/null); do unit_stop "$w"; done
      stop_daemon kvctld ;;
  esac
}
systemctl() {
  local verb now u
  verb=$1; shift
  [ "$1" = --now ] && { now=1; shift; } || now=
  for u in "$@"; do
    case $verb in
      enable)
        case $u in prefilld@*|decoded@*) echo "${u%.service}" >> "$T/enabled" ;; esac
        [ -n "$now" ] && unit_start "$u" ;;
      start) unit_start "$u" ;;
      stop) unit_stop "$u" ;;
      restart) unit_stop "$u"; unit_start "$u" ;;
      *) log "systemctl $verb $u: not emulated, skipped" ;;
    esac
  done
}
"#;

/// Whether a line is one the test cannot run here, and why.
fn skipped(line: &str) -> Option<&'static str> {
    let first = line.split_whitespace().next().unwrap_or("");
    match first {
        "..." => Some("a placeholder"),
        "cargo" => Some("builds or runs the test suite (that is what this is part of)"),
        "scripts/test" => Some("the whole suite"),
        "scripts/crosscheck-llamacpp.sh" => Some("builds llama.cpp (several minutes)"),
        "scripts/install.sh" | "sudo" => Some("installs into / (tests/install.rs runs it)"),
        f if f.starts_with("tests/vm/") => Some("boots a VM (tests/vm/)"),
        f if f.starts_with("KVFENCE_CRASH_ROUNDS") || f.starts_with("KVFENCE_NETFAULT_ROUNDS") => {
            Some("a long run")
        }
        f if f.starts_with("target/release/kv") => Some("a benchmark or a long run"),
        _ => None,
    }
}

/// The address the docs give openaid.
const OPENAI_DOC_ADDR: &str = "127.0.0.1:8000";

/// A port of loopback free now (the listener is closed again at once).
fn free_loopback_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("address").to_string()
}

/// The address openaid of the temporary installation listens on.
fn openai_addr(tmp: &Path) -> String {
    std::fs::read_to_string(tmp.join("openai.addr")).expect("openai.addr")
}

/// The line without its trailing comment (`  # ...`).
fn strip_comment(line: &str) -> &str {
    match line.find("  #").or_else(|| line.find("\t#")) {
        Some(i) => line[..i].trim_end(),
        None if line.trim_start().starts_with('#') => "",
        None => line.trim_end(),
    }
}

/// `kvctl status [--json] [-v]`: once without the optional parts, once with all of them.
fn variants(line: &str) -> Vec<String> {
    if !line.contains('[') || line.contains("$(") || line.contains("\\[") {
        return vec![line.to_owned()];
    }
    let (mut without, mut with) = (String::new(), String::new());
    let mut depth = 0;
    for c in line.chars() {
        match c {
            '[' => depth += 1,
            ']' if depth > 0 => depth -= 1,
            _ if depth > 0 => with.push(c),
            _ => {
                with.push(c);
                without.push(c);
            }
        }
    }
    let squash = |s: String| s.split_whitespace().collect::<Vec<_>>().join(" ");
    vec![squash(without), squash(with)]
}

/// The ```sh blocks of a markdown file, in order.
fn sh_blocks(text: &str) -> Vec<Vec<String>> {
    let mut blocks = Vec::new();
    let mut current: Option<Vec<String>> = None;
    for line in text.lines() {
        let t = line.trim();
        match &mut current {
            None if t == "```sh" => current = Some(Vec::new()),
            Some(b) if t == "```" => {
                blocks.push(std::mem::take(b));
                current = None;
            }
            Some(b) => b.push(line.to_owned()),
            None => {}
        }
    }
    blocks
}

fn run_file(file: &str, tmp: &Path, ran: &mut Vec<String>, skips: &mut Vec<String>) {
    let text = std::fs::read_to_string(workspace_root().join(file)).expect("reading docs");
    let etc = tmp.join("etc/kvfence");
    let path = format!(
        "{}:{}",
        bin_dir().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    for (i, block) in sh_blocks(&text).into_iter().enumerate() {
        let mut script = String::new();
        for raw in &block {
            let line = strip_comment(raw);
            if line.is_empty() {
                continue;
            }
            if let Some(why) = skipped(line) {
                skips.push(format!("{file}: `{line}`: {why}"));
                continue;
            }
            for v in variants(line) {
                let v = v
                    .replace("/etc/kvfence", &etc.display().to_string())
                    .replace(OPENAI_DOC_ADDR, &openai_addr(tmp));
                ran.push(format!("{file}: {v}"));
                script.push_str(&v);
                script.push('\n');
            }
        }
        if script.is_empty() {
            continue;
        }
        let mut sh = Command::new("sh");
        sh.arg("-ec")
            .arg(format!("{PREAMBLE}\n{script}"))
            .env("T", tmp)
            .env("PATH", &path)
            .current_dir(tmp);
        let out = run_bounded(&mut sh, Some(b""), Duration::from_secs(120));
        assert!(
            out.ok(),
            "{file}, block {} failed:\n{script}\n{}\nlogs: {}",
            i + 1,
            kvfence_tests::ops::describe("sh", &out),
            tmp.join("logs").display()
        );
    }
}

/// The `--check-config` commands the docs show inline (`` `kvctld --check-config PATH` ``),
/// with `PATH` the file given.
fn inline_checks(text: &str, config: &Path) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|span| {
            ["kvctld ", "prefilld ", "decoded "]
                .iter()
                .any(|d| span.starts_with(d))
                && span.contains("--check-config")
        })
        .map(|span| span.replace("PATH", &config.display().to_string()))
        .collect()
}

/// Stops whatever the blocks left running.
struct StopAll<'a>(&'a Path);

impl Drop for StopAll<'_> {
    fn drop(&mut self) {
        for entry in std::fs::read_dir(self.0.join("pids"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if let Some(pid) = std::fs::read_to_string(entry.path())
                .ok()
                .and_then(|p| p.trim().parse::<i32>().ok())
            {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}

#[test]
fn every_command_of_the_readmes_runs_as_written() {
    let dir = open_tempdir("kvdocs.");
    // KVFENCE_DOCS_KEEP=1 keeps the installation (configs, logs) for a look afterwards.
    let keep = std::env::var_os("KVFENCE_DOCS_KEEP").is_some();
    let tmp_buf = dir.path().to_path_buf();
    let tmp = tmp_buf.as_path();
    let etc = tmp.join("etc/kvfence");
    for d in [etc.as_path(), &tmp.join("pids"), &tmp.join("logs")] {
        std::fs::create_dir_all(d).unwrap();
    }
    // As install.sh leaves it: kvfence.toml (here small, on a temporary socket) and the
    // default pair's links to it.
    let mut cfg = Config::embedded_default(tmp.join("run/kvctld.sock"));
    cfg.openai.listen = free_loopback_addr();
    std::fs::write(tmp.join("openai.addr"), &cfg.openai.listen).unwrap();
    write_config(&etc.join("kvfence.toml"), &cfg);
    for w in ["prefill-0", "decode-0"] {
        std::os::unix::fs::symlink("kvfence.toml", etc.join(format!("{w}.toml"))).unwrap();
    }
    // The prompt file the README's `--prompt-file` example reads.
    std::fs::write(tmp.join("prompt.txt"), "a prompt from a file\n".repeat(64)).unwrap();
    let _dir = if keep {
        eprintln!("keeping {}", dir.keep().display());
        None
    } else {
        Some(dir)
    };
    // Declared after the directory, so dropped before it: it reads the pids from it.
    let _stop = StopAll(tmp);
    let (mut ran, mut skips) = (Vec::new(), Vec::new());
    run_file("README.md", tmp, &mut ran, &mut skips);
    // systemd/README.md on a fresh "host": the README's daemons are stopped first.
    let mut stop = Command::new("sh");
    stop.arg("-ec")
        .arg(format!("{PREAMBLE}\nfor p in $T/pids/*; do [ -e \"$p\" ] && stop_daemon \"$(basename \"$p\")\"; done; :"))
        .env("T", tmp);
    assert!(run_bounded(&mut stop, None, Duration::from_secs(60)).ok());
    run_file("systemd/README.md", tmp, &mut ran, &mut skips);
    // The check commands the docs mention in their text, as written.
    let cfg_path = etc.join("kvfence.toml");
    for file in [
        "README.md",
        "systemd/README.md",
        "libkv/kvfence.example.toml",
    ] {
        let text = std::fs::read_to_string(workspace_root().join(file)).unwrap();
        for cmd in inline_checks(&text, &cfg_path) {
            let words: Vec<&str> = cmd.split_whitespace().collect();
            let mut c = Command::new(bin_dir().join(words[0]));
            c.args(&words[1..]);
            let out = run_bounded(&mut c, None, Duration::from_secs(30));
            assert!(out.ok(), "{}", kvfence_tests::ops::describe(&cmd, &out));
            ran.push(format!("{file}: {cmd}"));
        }
    }
    eprintln!("ran {} commands:\n  {}", ran.len(), ran.join("\n  "));
    eprintln!("skipped {}:\n  {}", skips.len(), skips.join("\n  "));
    // The commands the issue found broken are among those run.
    for must in [
        "kvctld --check-config",
        "kvctl generate --tenant acme",
        "--prompt-file prompt.txt",
        "kvctl generate --tenant acme -",
        "kvctl drain prefill-0 --wait",
        "probe",
        "prefilld --id $f --config $f.toml --check-config",
    ] {
        assert!(
            ran.iter().any(|r| r.contains(must)),
            "no documented command contains {must:?}"
        );
    }
}

#[test]
fn optional_parts_expand_and_comments_go() {
    assert_eq!(
        variants("kvctl status [--json] [-v]"),
        vec!["kvctl status", "kvctl status --json -v"]
    );
    assert_eq!(
        strip_comment("kvctl undrain prefill-0   # let requests reach it again"),
        "kvctl undrain prefill-0"
    );
    assert_eq!(strip_comment("# a comment"), "");
    assert!(skipped("scripts/install.sh --no-build").is_some());
    assert!(skipped("kvctl status").is_none());
}
