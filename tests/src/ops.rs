//! What the operator-facing tests share (`tests/hardening.rs`, `tests/docs_commands.rs`,
//! `tests/install.rs`, `tests/long_prompts.rs`, `tests/netfault.rs`): daemons spawned by
//! hand on a temporary socket, their memory, waiting for an exit, running a command with a
//! deadline, and processes run as another uid.

use libkv::config::Config;
use std::fs;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// A uid no account has, for processes the tests run as another user.
pub const OTHER_UID: u32 = 4242;
/// Its gid.
pub const OTHER_GID: u32 = 4243;
/// A second such uid (and gid), allowed nothing.
pub const STRANGER_UID: u32 = 4244;

/// Whether the tests may run processes as other uids (they run as root).
pub fn can_switch_uid() -> bool {
    nix::unistd::geteuid().is_root()
}

/// A temporary directory under `/tmp` whose path is short enough for a socket inside it,
/// readable and searchable by every uid (so that processes of [`OTHER_UID`] reach the
/// socket in it).
pub fn open_tempdir(prefix: &str) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/tmp")
        .expect("temp dir");
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod temp dir");
    dir
}

/// Writes `config` as TOML to `path`.
pub fn write_config(path: &Path, config: &Config) {
    fs::write(path, toml::to_string(config).expect("config to TOML")).expect("writing config");
}

/// A child process killed (SIGKILL) and reaped when dropped.
#[derive(Debug)]
pub struct Reaped(pub Child);

impl Reaped {
    /// Its pid.
    pub fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(i32::try_from(self.0.id()).expect("pid"))
    }

    /// Sends `signal`.
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(self.pid(), signal);
    }

    /// Waits up to `timeout` for it to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        wait_exit(&mut self.0, timeout)
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Waits up to `timeout` for `child` to exit (polling).
pub fn wait_exit(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Spawns `kvctld --config CONFIG` with stdout and stderr into `log`.
pub fn spawn_kvctld(bin_dir: &Path, config: &Path, log: &Path) -> Reaped {
    let out = fs::File::create(log).expect("log file");
    let err = out.try_clone().expect("log file");
    let child = Command::new(bin_dir.join("kvctld"))
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "info")
        .env_remove("LISTEN_FDS")
        .env_remove("LISTEN_PID")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("spawning kvctld");
    Reaped(child)
}

/// Polls `f` every 20 ms until it is true, for at most `timeout`.
pub fn wait_for(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// The resident memory of process `pid` (VmRSS), in KiB.
pub fn rss_kib(pid: nix::unistd::Pid) -> u64 {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// The command `cmd` as another user: uid and gid set in the child before exec (the tests
/// run as root), with no supplementary groups.
pub fn as_user(cmd: &mut Command, uid: u32, gid: u32) -> &mut Command {
    // std drops the supplementary groups of a root parent when it sets the uid.
    cmd.uid(uid).gid(gid)
}

/// What [`run_bounded`] saw.
#[derive(Debug)]
pub struct Ran {
    /// Exit status, `None` if it was killed at the deadline.
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Ran {
    /// Whether it exited with status 0 in time.
    pub fn ok(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    /// Its exit code (`None`: killed or signalled).
    pub fn code(&self) -> Option<i32> {
        self.status.and_then(|s| s.code())
    }
}

/// Runs `cmd` with stdin from `input`, killing it after `timeout`.
pub fn run_bounded(cmd: &mut Command, input: Option<&[u8]>, timeout: Duration) -> Ran {
    let begun = Instant::now();
    let mut child = cmd
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning a command");
    let writer = input.map(|bytes| {
        let mut stdin = child.stdin.take().expect("stdin");
        let bytes = bytes.to_vec();
        thread::spawn(move || {
            let _ = std::io::Write::write_all(&mut stdin, &bytes);
        })
    });
    let pipe = |r: Option<Box<dyn Read + Send>>| {
        thread::spawn(move || {
            let mut s = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut s);
            }
            String::from_utf8_lossy(&s).into_owned()
        })
    };
    let out = pipe(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = pipe(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let status = wait_exit(&mut child, timeout);
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    if let Some(w) = writer {
        let _ = w.join();
    }
    Ran {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
        elapsed: begun.elapsed(),
    }
}

/// [`run_bounded`] of a finished [`Output`]-like result, for messages.
pub fn describe(what: &str, ran: &Ran) -> String {
    format!(
        "{what}: status {:?} after {:?}\n--- stdout\n{}\n--- stderr\n{}",
        ran.status, ran.elapsed, ran.stdout, ran.stderr
    )
}

/// Output of a command that must exist, for probing tools (`ip`, `tc`).
pub fn output_of(cmd: &mut Command) -> Option<Output> {
    cmd.stdin(Stdio::null()).output().ok()
}

/// The directory of this crate's checkout (the workspace root).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}
