//! Spawning the local stack (kvctld, prefilld, decoded on one host) for the demo and the
//! integration tests.
//!
//! [`Stack::start`] writes the config as TOML into a directory, spawns the three daemons
//! with `--config` pointing at it (their stdout and stderr appended to `<daemon>.log` in the
//! same directory, `RUST_LOG` passed through), and waits, bounded, until kvctld reports both
//! workers connected. Every daemon is held by a guard that kills it with SIGKILL and reaps it
//! when dropped, so a failing test or demo never leaves daemons behind.

use crate::client::{Client, ClientError};
use libkv::config::{Config, ConfigError};
use libkv::proto::{Role, StatusReply};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// Name of the config file [`Stack::start`] writes into its directory.
pub const CONFIG_FILE: &str = "kvfence.toml";

/// How often [`wait_until`] polls.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// One of the three daemons of the stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Daemon {
    Kvctld,
    Prefilld,
    Decoded,
}

impl Daemon {
    /// All three, in start order.
    pub const ALL: [Daemon; 3] = [Daemon::Kvctld, Daemon::Prefilld, Daemon::Decoded];

    /// The binary's file name.
    pub fn binary(self) -> &'static str {
        match self {
            Daemon::Kvctld => "kvctld",
            Daemon::Prefilld => "prefilld",
            Daemon::Decoded => "decoded",
        }
    }

    /// The worker role this daemon registers as, if it is a worker.
    pub fn role(self) -> Option<Role> {
        match self {
            Daemon::Kvctld => None,
            Daemon::Prefilld => Some(Role::Prefill),
            Daemon::Decoded => Some(Role::Decode),
        }
    }

    /// Position of the daemon in [`Daemon::ALL`] and in [`StackOptions::wrap`].
    pub fn index(self) -> usize {
        match self {
            Daemon::Kvctld => 0,
            Daemon::Prefilld => 1,
            Daemon::Decoded => 2,
        }
    }
}

impl fmt::Display for Daemon {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.binary())
    }
}

/// Errors of starting, restarting and stopping the stack.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    /// The config does not validate.
    #[error("invalid stack config")]
    Config(#[source] ConfigError),
    /// The config could not be written as TOML.
    #[error("serializing the config")]
    Serialize(#[source] toml::ser::Error),
    /// A file or directory of the stack could not be created or written.
    #[error("writing {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The directory of the current executable could not be found.
    #[error("locating the current executable")]
    CurrentExe(#[source] io::Error),
    /// A daemon binary is missing.
    #[error("{} not found: run `cargo build --bins` (or `cargo build --release --bins`) first", path.display())]
    MissingBinary { path: PathBuf },
    /// A daemon could not be spawned.
    #[error("spawning {daemon} ({})", path.display())]
    Spawn {
        daemon: Daemon,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A daemon exited while the stack was waiting for it. `log` holds the end of its log.
    #[error("{daemon} exited with {status} while {while_doing}; end of its log:\n{log}")]
    Exited {
        daemon: Daemon,
        status: ExitStatus,
        while_doing: &'static str,
        log: String,
    },
    /// The stack did not reach a state in time. `last` is the last status or error seen.
    #[error("timed out after {waited_ms} ms waiting for {what}; last seen: {last}")]
    NotReady {
        what: String,
        waited_ms: u128,
        last: String,
    },
    /// Signalling or reaping a daemon failed.
    #[error("signalling {daemon}")]
    Signal {
        daemon: Daemon,
        #[source]
        source: io::Error,
    },
    /// A client operation failed.
    #[error("talking to kvctld")]
    Client(#[from] ClientError),
}

/// What [`Stack::start`] needs.
#[derive(Clone, Debug)]
pub struct StackOptions {
    /// The config to write and run the daemons with. Its socket path must be under
    /// `MAX_SOCKET_PATH_BYTES` (use a directory under `/tmp`).
    pub config: Config,
    /// Directory for the config file and the daemons' logs; created if absent.
    pub dir: PathBuf,
    /// Directory holding the `kvctld`, `prefilld` and `decoded` binaries.
    pub bin_dir: PathBuf,
    /// `RUST_LOG` for the daemons; `None` passes the caller's `RUST_LOG` through.
    pub rust_log: Option<String>,
    /// Longest [`Stack::start`] and [`Stack::restart`] wait for the stack to be ready.
    pub ready_timeout: Duration,
    /// Longest [`Stack::stop`] waits after SIGTERM before SIGKILL.
    pub stop_timeout: Duration,
    /// Timeout of the handshake and status queries of clients made by [`Stack::client`].
    pub client_timeout: Duration,
    /// A command to run a daemon under, per daemon (for example `ip netns exec NAME`, to
    /// put a worker on another network namespace); empty runs it directly.
    pub wrap: [Vec<String>; 3],
}

impl StackOptions {
    /// Options with the binaries from [`default_bin_dir`] and default timeouts.
    pub fn new(config: Config, dir: PathBuf) -> Result<StackOptions, StackError> {
        let stop_timeout = config.deadlines.drain() + Duration::from_secs(3);
        Ok(StackOptions {
            config,
            dir,
            bin_dir: default_bin_dir()?,
            rust_log: None,
            ready_timeout: Duration::from_secs(15),
            stop_timeout,
            client_timeout: Duration::from_secs(5),
            wrap: Default::default(),
        })
    }
}

/// The directory the daemon binaries are expected in: the directory of the current
/// executable, or its parent when that is a `deps` directory (test executables live in
/// `target/<profile>/deps`, binaries in `target/<profile>`).
pub fn default_bin_dir() -> Result<PathBuf, StackError> {
    let exe = std::env::current_exe().map_err(StackError::CurrentExe)?;
    let dir = exe.parent().ok_or_else(|| {
        StackError::CurrentExe(io::Error::new(
            io::ErrorKind::NotFound,
            "executable has no parent directory",
        ))
    })?;
    match dir.parent() {
        Some(parent) if dir.file_name().is_some_and(|n| n == "deps") => Ok(parent.to_path_buf()),
        _ => Ok(dir.to_path_buf()),
    }
}

/// Polls `f` every 20 ms until it returns `Some`, for at most `timeout`. `f` is called at
/// least once, and once more at the deadline.
pub fn wait_until<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        thread::sleep(POLL_INTERVAL.min(deadline - now));
    }
}

/// A running daemon, killed with SIGKILL and reaped when dropped.
#[derive(Debug)]
struct Guard {
    daemon: Daemon,
    child: Child,
}

impl Guard {
    fn pid(&self) -> Option<Pid> {
        i32::try_from(self.child.id()).ok().map(Pid::from_raw)
    }

    /// Sends `signal` unless the child was already reaped (its pid may then be reused).
    fn signal(&mut self, signal: Signal) -> Result<(), StackError> {
        let err = |source| StackError::Signal {
            daemon: self.daemon,
            source,
        };
        if self.child.try_wait().map_err(err)?.is_some() {
            return Ok(());
        }
        let Some(pid) = self.pid() else {
            return Ok(());
        };
        match kill(pid, signal) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
            Err(e) => Err(StackError::Signal {
                daemon: self.daemon,
                source: e.into(),
            }),
        }
    }

    /// Waits up to `timeout` for the child to exit.
    fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        wait_until(timeout, || self.child.try_wait().ok().flatten())
    }

    /// SIGKILL, then reap.
    fn kill_and_wait(&mut self) -> Result<ExitStatus, StackError> {
        self.signal(Signal::SIGKILL)?;
        self.child.wait().map_err(|source| StackError::Signal {
            daemon: self.daemon,
            source,
        })
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Err(e) = self.kill_and_wait() {
            log::warn!("killing {}: {e}", self.daemon);
        }
    }
}

/// How one daemon ended in [`Stack::stop`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DaemonExit {
    pub daemon: Daemon,
    /// Its exit status.
    pub status: ExitStatus,
    /// Whether it had to be killed with SIGKILL after the stop timeout.
    pub killed: bool,
}

/// How the stack ended in [`Stack::stop`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StopReport {
    /// One entry per daemon that was running.
    pub exits: Vec<DaemonExit>,
}

impl StopReport {
    /// Whether every daemon exited on SIGTERM with status 0.
    pub fn is_clean(&self) -> bool {
        self.exits.iter().all(|e| !e.killed && e.status.success())
    }
}

/// The local stack: three daemons on one control socket.
#[derive(Debug)]
pub struct Stack {
    opts: StackOptions,
    config_path: PathBuf,
    /// Indexed by [`Daemon::index`]; `None` when not running.
    guards: [Option<Guard>; 3],
}

impl Stack {
    /// Writes the config into `opts.dir`, spawns kvctld, waits until its socket answers,
    /// spawns prefilld and decoded, and waits until kvctld reports both workers connected.
    /// On any failure the daemons already started are killed.
    pub fn start(opts: StackOptions) -> Result<Stack, StackError> {
        opts.config.validate().map_err(StackError::Config)?;
        for d in Daemon::ALL {
            let path = opts.bin_dir.join(d.binary());
            if !path.is_file() {
                return Err(StackError::MissingBinary { path });
            }
        }
        let write_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| StackError::Write { path, source }
        };
        fs::create_dir_all(&opts.dir).map_err(write_err(&opts.dir))?;
        let config_path = opts.dir.join(CONFIG_FILE);
        let text = toml::to_string(&opts.config).map_err(StackError::Serialize)?;
        fs::write(&config_path, text).map_err(write_err(&config_path))?;
        let mut stack = Stack {
            opts,
            config_path,
            guards: [None, None, None],
        };
        stack.spawn(Daemon::Kvctld)?;
        stack.wait_for_socket()?;
        stack.spawn(Daemon::Prefilld)?;
        stack.spawn(Daemon::Decoded)?;
        stack.wait_ready()?;
        Ok(stack)
    }

    /// The config the daemons run with.
    pub fn config(&self) -> &Config {
        &self.opts.config
    }

    /// The config file the daemons were given.
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// The stack's directory (config and logs).
    pub fn dir(&self) -> &Path {
        &self.opts.dir
    }

    /// kvctld's control socket.
    pub fn socket(&self) -> &Path {
        &self.opts.config.control.socket
    }

    /// A new client of kvctld, whose default request deadline is the config's.
    pub fn client(&self) -> Result<Client, ClientError> {
        let mut client = Client::connect(self.socket(), self.opts.client_timeout)?;
        client.set_default_deadline(self.opts.config.deadlines.request());
        Ok(client)
    }

    /// kvctld's status, from a fresh client.
    pub fn status(&self) -> Result<StatusReply, ClientError> {
        self.client()?.status()
    }

    /// The pids of the running daemons.
    pub fn pids(&self) -> Vec<(Daemon, Pid)> {
        self.guards
            .iter()
            .flatten()
            .filter_map(|g| g.pid().map(|p| (g.daemon, p)))
            .collect()
    }

    /// The pid of `daemon`, if it is running.
    pub fn pid(&self, daemon: Daemon) -> Option<Pid> {
        self.guards[daemon.index()].as_ref().and_then(Guard::pid)
    }

    /// Path of `daemon`'s log file.
    pub fn log_path(&self, daemon: Daemon) -> PathBuf {
        self.opts.dir.join(format!("{}.log", daemon.binary()))
    }

    /// Everything `daemon` wrote to stdout and stderr, over all its restarts.
    pub fn log(&self, daemon: Daemon) -> String {
        fs::read(self.log_path(daemon))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// Kills `daemon` with SIGKILL and reaps it; its exit status, or `None` if it was not
    /// running.
    pub fn kill(&mut self, daemon: Daemon) -> Result<Option<ExitStatus>, StackError> {
        match self.guards[daemon.index()].take() {
            Some(mut g) => {
                let status = g.kill_and_wait()?;
                Ok(Some(status))
            }
            None => Ok(None),
        }
    }

    /// Kills `daemon` if it runs, then starts it again and waits until the stack is ready.
    /// For a worker, first waits until kvctld no longer lists the old process as connected,
    /// so that readiness is the new process's registration.
    pub fn restart(&mut self, daemon: Daemon) -> Result<(), StackError> {
        self.kill(daemon)?;
        let kvctld_up = self.guards[Daemon::Kvctld.index()].is_some();
        if let Some(role) = daemon.role()
            && kvctld_up
        {
            self.wait_status(&format!("{role:?} worker to be seen disconnected"), |s| {
                !worker_connected(s, role)
            })?;
        }
        self.spawn(daemon)?;
        if daemon == Daemon::Kvctld {
            self.wait_for_socket()?;
        }
        self.wait_ready()
    }

    /// Waits until kvctld reports both workers connected.
    pub fn wait_ready(&mut self) -> Result<(), StackError> {
        self.wait_status("both workers to be connected", |s| {
            worker_connected(s, Role::Prefill) && worker_connected(s, Role::Decode)
        })
        .map(drop)
    }

    /// Polls kvctld's status until `ready` holds, for at most the ready timeout. Fails early
    /// if a daemon exits.
    pub fn wait_status(
        &mut self,
        what: &str,
        mut ready: impl FnMut(&StatusReply) -> bool,
    ) -> Result<StatusReply, StackError> {
        let start = Instant::now();
        let mut last = String::from("nothing yet");
        let mut exited = None;
        let found = wait_until(self.opts.ready_timeout, || {
            if let Err(e) = self.check_alive("waiting for the stack") {
                exited = Some(e);
                return Some(None);
            }
            match self.status() {
                Ok(s) if ready(&s) => Some(Some(s)),
                Ok(s) => {
                    last = format!("{s:?}");
                    None
                }
                Err(e) => {
                    last = error_chain(&e);
                    None
                }
            }
        });
        match (found, exited) {
            (_, Some(e)) => Err(e),
            (Some(Some(s)), None) => Ok(s),
            _ => Err(StackError::NotReady {
                what: what.to_owned(),
                waited_ms: start.elapsed().as_millis(),
                last,
            }),
        }
    }

    /// Sends SIGTERM to every running daemon (workers first), waits for each up to the stop
    /// timeout, then kills what is left with SIGKILL.
    pub fn stop(&mut self) -> Result<StopReport, StackError> {
        let order = [Daemon::Prefilld, Daemon::Decoded, Daemon::Kvctld];
        for d in order {
            if let Some(g) = self.guards[d.index()].as_mut() {
                g.signal(Signal::SIGTERM)?;
            }
        }
        let deadline = Instant::now() + self.opts.stop_timeout;
        let mut exits = Vec::new();
        for d in order {
            let Some(mut g) = self.guards[d.index()].take() else {
                continue;
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let (status, killed) = match g.wait_timeout(left) {
                Some(status) => (status, false),
                None => (g.kill_and_wait()?, true),
            };
            exits.push(DaemonExit {
                daemon: d,
                status,
                killed,
            });
        }
        Ok(StopReport { exits })
    }

    fn spawn(&mut self, daemon: Daemon) -> Result<(), StackError> {
        let path = self.opts.bin_dir.join(daemon.binary());
        let log_path = self.log_path(daemon);
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|source| StackError::Write {
                path: log_path.clone(),
                source,
            })?;
        let log_err = |source| StackError::Write {
            path: log_path.clone(),
            source,
        };
        let stdout: File = log.try_clone().map_err(log_err)?;
        let wrap = &self.opts.wrap[daemon.index()];
        let mut cmd = match wrap.split_first() {
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg(&path);
                cmd
            }
            None => Command::new(&path),
        };
        cmd.arg("--config")
            .arg(&self.config_path)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(log);
        match &self.opts.rust_log {
            Some(level) => {
                cmd.env("RUST_LOG", level);
            }
            None => {
                // Inherited as is (or absent).
            }
        }
        let child = cmd.spawn().map_err(|source| StackError::Spawn {
            daemon,
            path,
            source,
        })?;
        self.guards[daemon.index()] = Some(Guard { daemon, child });
        Ok(())
    }

    /// Fails if a daemon that should run has exited.
    fn check_alive(&mut self, while_doing: &'static str) -> Result<(), StackError> {
        for d in Daemon::ALL {
            let Some(g) = self.guards[d.index()].as_mut() else {
                continue;
            };
            let status = g
                .child
                .try_wait()
                .map_err(|source| StackError::Signal { daemon: d, source })?;
            if let Some(status) = status {
                self.guards[d.index()] = None;
                return Err(StackError::Exited {
                    daemon: d,
                    status,
                    while_doing,
                    log: tail(&self.log(d), 40),
                });
            }
        }
        Ok(())
    }

    /// Waits until a client completes the handshake with kvctld.
    fn wait_for_socket(&mut self) -> Result<(), StackError> {
        let start = Instant::now();
        let mut last = String::from("nothing yet");
        let mut exited = None;
        let ok = wait_until(self.opts.ready_timeout, || {
            if let Err(e) = self.check_alive("waiting for kvctld's socket") {
                exited = Some(e);
                return Some(false);
            }
            match Client::connect(self.socket(), self.opts.client_timeout) {
                Ok(_) => Some(true),
                Err(e) => {
                    last = error_chain(&e);
                    None
                }
            }
        });
        match (ok, exited) {
            (_, Some(e)) => Err(e),
            (Some(true), None) => Ok(()),
            _ => Err(StackError::NotReady {
                what: format!("kvctld to answer on {}", self.socket().display()),
                waited_ms: start.elapsed().as_millis(),
                last,
            }),
        }
    }
}

/// Whether `status` lists a connected worker of `role`.
pub fn worker_connected(status: &StatusReply, role: Role) -> bool {
    status.workers.iter().any(|w| w.role == role && w.connected)
}

pub use libkv::error_chain;

/// The last `lines` lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_until_returns_early_and_gives_up_on_time() {
        let mut n = 0;
        assert_eq!(
            wait_until(Duration::from_secs(5), || {
                n += 1;
                (n == 3).then_some(n)
            }),
            Some(3)
        );
        let start = Instant::now();
        assert_eq!(wait_until(Duration::from_millis(50), || None::<()>), None);
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(50) && waited < Duration::from_secs(2));
    }

    #[test]
    fn default_config_round_trips_through_toml() {
        let config = Config::embedded_default("/tmp/kvfence-x/kvctld.sock".into());
        let text = toml::to_string(&config).unwrap();
        assert_eq!(Config::from_toml_str(&text).unwrap(), config);
    }

    #[test]
    fn missing_binaries_are_reported_with_the_build_command() {
        let dir = tempfile::tempdir().unwrap();
        let mut opts = StackOptions::new(
            Config::embedded_default(dir.path().join("s.sock")),
            dir.path().to_path_buf(),
        )
        .unwrap();
        opts.bin_dir = dir.path().join("no-such-dir");
        let err = Stack::start(opts).unwrap_err();
        assert!(matches!(err, StackError::MissingBinary { .. }), "{err:?}");
        assert!(err.to_string().contains("cargo build"), "{err}");
    }

    #[test]
    fn a_daemon_that_exits_at_once_is_reported_with_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        fs::create_dir(&bin).unwrap();
        for d in Daemon::ALL {
            let path = bin.join(d.binary());
            fs::write(&path, "#!/bin/sh\necho \"$0: refusing $*\" >&2\nexit 3\n").unwrap();
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
        }
        let mut opts = StackOptions::new(
            Config::embedded_default(dir.path().join("s.sock")),
            dir.path().join("run"),
        )
        .unwrap();
        opts.bin_dir = bin;
        let err = Stack::start(opts).unwrap_err();
        match &err {
            StackError::Exited { daemon, log, .. } => {
                assert_eq!(*daemon, Daemon::Kvctld);
                assert!(log.contains("refusing --config"), "{log}");
            }
            other => panic!("{other:?}"),
        }
        let written = fs::read_to_string(dir.path().join("run").join(CONFIG_FILE)).unwrap();
        assert!(Config::from_toml_str(&written).is_ok());
    }
}
