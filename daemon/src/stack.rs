//! Spawning the local stack (one kvctld and any number of prefill and decode workers on one
//! host) for the demo and the integration tests.
//!
//! Every process of a stack has a name: `kvctld`, and for the workers the id each registers
//! under, passed with `--id`: `prefill-0`, `prefill-1`, ... and `decode-0`, ...
//! ([`prefill_id`], [`decode_id`]; [`StackOptions::prefill_workers`] and
//! [`StackOptions::decode_workers`] say how many, one of each by default). Every operation on
//! one process takes its name: [`Stack::kill`] (SIGKILL), [`Stack::signal`] (SIGTERM and
//! others), [`Stack::wait_exit`], [`Stack::restart`] (under the same id), [`Stack::pid`],
//! [`Stack::log`]. [`Daemon::Prefilld`] and [`Daemon::Decoded`] stand for the first worker
//! of their role, so single-pair callers can keep writing `stack.kill(Daemon::Prefilld)`.
//!
//! [`Stack::start`] writes the config as TOML into a directory (`kvfence.toml`, read by
//! kvctld and every worker without a config of its own; `<id>.toml` for a worker given one
//! in [`StackOptions::worker_configs`]), spawns kvctld, waits until its socket answers,
//! spawns every worker with `--config` and `--id` (stdout and stderr appended to
//! `<name>.log` in the same directory, `RUST_LOG` passed through), and waits, bounded, until
//! kvctld reports every worker connected under its id. When several prefill workers share
//! the config and its `[transfer] listen` names a port, the file is written with port 0, so
//! each binds a free port of its own and reports it when it registers.
//!
//! Every process is held by a guard that kills it with SIGKILL and reaps it when dropped, so
//! a failing test or demo never leaves daemons behind.

use crate::client::{Client, ClientError};
use libkv::config::{Config, ConfigError};
use libkv::proto::{Role, StatusReply, WorkerStatus};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::collections::BTreeMap;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// Name of the config file [`Stack::start`] writes into its directory for kvctld and the
/// workers without a config of their own.
pub const CONFIG_FILE: &str = "kvfence.toml";

/// kvctld's name in a stack (its log is `kvctld.log`).
pub const KVCTLD: &str = "kvctld";

/// How often [`wait_until`] polls.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// The id of the prefill worker number `index` of a stack: `prefill-<index>`.
pub fn prefill_id(index: usize) -> String {
    format!("prefill-{index}")
}

/// The id of the decode worker number `index` of a stack: `decode-<index>`.
pub fn decode_id(index: usize) -> String {
    format!("decode-{index}")
}

/// The three daemon binaries of the stack.
///
/// As the name of a process ([`AsRef<str>`], taken by every [`Stack`] method that addresses
/// one), `Kvctld` is kvctld and `Prefilld` and `Decoded` are the first worker of their role,
/// `prefill-0` and `decode-0`.
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

    /// The worker binary of `role`; `None` for `Client`.
    pub fn of_role(role: Role) -> Option<Daemon> {
        match role {
            Role::Prefill => Some(Daemon::Prefilld),
            Role::Decode => Some(Daemon::Decoded),
            Role::Client => None,
        }
    }

    /// The process this stands for in a stack: `kvctld`, `prefill-0` or `decode-0`.
    pub fn name(self) -> &'static str {
        match self {
            Daemon::Kvctld => KVCTLD,
            Daemon::Prefilld => "prefill-0",
            Daemon::Decoded => "decode-0",
        }
    }
}

impl AsRef<str> for Daemon {
    /// [`Daemon::name`].
    fn as_ref(&self) -> &str {
        self.name()
    }
}

impl fmt::Display for Daemon {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.binary())
    }
}

/// Errors of starting, restarting and stopping the stack. `name` is the process's name in
/// the stack (`kvctld`, `prefill-1`, ...).
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
    /// A name given to the stack (an operation, [`StackOptions::wrap`],
    /// [`StackOptions::worker_configs`]) is not one of its processes.
    #[error("the stack has no process {name:?} (it has {known})")]
    UnknownProcess { name: String, known: String },
    /// A process could not be spawned.
    #[error("spawning {name} ({})", path.display())]
    Spawn {
        name: String,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A process exited while the stack was waiting for it. `log` holds the end of its log.
    #[error("{name} exited with {status} while {while_doing}; end of its log:\n{log}")]
    Exited {
        name: String,
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
    /// Signalling or reaping a process failed.
    #[error("signalling {name}")]
    Signal {
        name: String,
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
    /// The config to write and run kvctld and the workers with. Its socket path must be
    /// under `MAX_SOCKET_PATH_BYTES` (use a directory under `/tmp`).
    pub config: Config,
    /// Directory for the config files and the logs; created if absent.
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
    /// Prefill workers to run, `prefill-0` to `prefill-<n-1>`. Default 1.
    pub prefill_workers: usize,
    /// Decode workers to run, `decode-0` to `decode-<n-1>`. Default 1.
    pub decode_workers: usize,
    /// A config of its own for some workers, by id, written as `<id>.toml` as given (not
    /// validated here: a worker refusing it exits, which the stack reports). The other
    /// workers read `config`.
    pub worker_configs: BTreeMap<String, Config>,
    /// A command to run a process under, by name (`kvctld` or a worker id), for example
    /// `ip netns exec NAME` to put a worker on another network namespace. A process not
    /// listed runs directly.
    pub wrap: BTreeMap<String, Vec<String>>,
}

impl StackOptions {
    /// Options for one prefill and one decode worker, with the binaries from
    /// [`default_bin_dir`] and default timeouts.
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
            prefill_workers: 1,
            decode_workers: 1,
            worker_configs: BTreeMap::new(),
            wrap: BTreeMap::new(),
        })
    }

    /// Sets the number of prefill and decode workers.
    pub fn with_workers(mut self, prefill: usize, decode: usize) -> StackOptions {
        self.prefill_workers = prefill;
        self.decode_workers = decode;
        self
    }

    /// The names of the processes these options start, in start order: `kvctld`, the
    /// prefill workers, the decode workers.
    pub fn names(&self) -> Vec<String> {
        let mut names = vec![KVCTLD.to_owned()];
        names.extend((0..self.prefill_workers).map(prefill_id));
        names.extend((0..self.decode_workers).map(decode_id));
        names
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

/// A running process, killed with SIGKILL and reaped when dropped.
#[derive(Debug)]
struct Guard {
    name: String,
    child: Child,
    /// Sent a signal that asks it to stop: its exit is expected, not a failure.
    stopping: bool,
}

impl Guard {
    fn pid(&self) -> Option<Pid> {
        i32::try_from(self.child.id()).ok().map(Pid::from_raw)
    }

    fn signal_err(&self, source: io::Error) -> StackError {
        StackError::Signal {
            name: self.name.clone(),
            source,
        }
    }

    /// Its exit status if it has exited (reaping it; the status is kept).
    fn exited(&mut self) -> Result<Option<ExitStatus>, StackError> {
        self.child.try_wait().map_err(|e| self.signal_err(e))
    }

    /// Sends `signal` unless the child was already reaped (its pid may then be reused).
    fn signal(&mut self, signal: Signal) -> Result<(), StackError> {
        if self.exited()?.is_some() {
            return Ok(());
        }
        let Some(pid) = self.pid() else {
            return Ok(());
        };
        match kill(pid, signal) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
            Err(e) => Err(self.signal_err(e.into())),
        }
    }

    /// Waits up to `timeout` for the child to exit.
    fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        wait_until(timeout, || self.child.try_wait().ok().flatten())
    }

    /// SIGKILL, then reap.
    fn kill_and_wait(&mut self) -> Result<ExitStatus, StackError> {
        self.signal(Signal::SIGKILL)?;
        self.child.wait().map_err(|e| self.signal_err(e))
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Err(e) = self.kill_and_wait() {
            log::warn!("killing {}: {e}", self.name);
        }
    }
}

/// How one process ended in [`Stack::stop`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DaemonExit {
    /// Its name in the stack (`kvctld`, `prefill-0`, ...).
    pub name: String,
    /// Its binary.
    pub daemon: Daemon,
    /// Its exit status.
    pub status: ExitStatus,
    /// Whether it had to be killed with SIGKILL after the stop timeout.
    pub killed: bool,
}

/// How the stack ended in [`Stack::stop`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StopReport {
    /// One entry per process that was running, workers first.
    pub exits: Vec<DaemonExit>,
}

impl StopReport {
    /// Whether every process exited on SIGTERM with status 0.
    pub fn is_clean(&self) -> bool {
        self.exits.iter().all(|e| !e.killed && e.status.success())
    }
}

/// One process of the stack, running or not.
#[derive(Debug)]
struct Proc {
    name: String,
    daemon: Daemon,
    /// The config file it is started with.
    config_path: PathBuf,
    guard: Option<Guard>,
}

impl Proc {
    /// Running and not asked to stop.
    fn is_up(&self) -> bool {
        self.guard.as_ref().is_some_and(|g| !g.stopping)
    }
}

/// The local stack: kvctld and its workers on one control socket.
#[derive(Debug)]
pub struct Stack {
    opts: StackOptions,
    config_path: PathBuf,
    /// kvctld first, then the prefill workers, then the decode workers.
    procs: Vec<Proc>,
}

impl Stack {
    /// Writes the configs into `opts.dir`, spawns kvctld, waits until its socket answers,
    /// spawns every worker, and waits until kvctld reports each connected under its id. On
    /// any failure the processes already started are killed.
    pub fn start(mut opts: StackOptions) -> Result<Stack, StackError> {
        opts.config.validate().map_err(StackError::Config)?;
        for d in Daemon::ALL {
            let path = opts.bin_dir.join(d.binary());
            if !path.is_file() {
                return Err(StackError::MissingBinary { path });
            }
        }
        let names = opts.names();
        let unknown = opts.wrap.keys().find(|n| !names.contains(n)).or_else(|| {
            opts.worker_configs
                .keys()
                .find(|n| !names.contains(n) || n.as_str() == KVCTLD)
        });
        if let Some(name) = unknown {
            return Err(StackError::UnknownProcess {
                name: name.clone(),
                known: names.join(", "),
            });
        }
        let shared_prefill = (0..opts.prefill_workers)
            .filter(|&i| !opts.worker_configs.contains_key(&prefill_id(i)))
            .count();
        if shared_prefill > 1 {
            free_listen_port(&mut opts.config);
        }
        fs::create_dir_all(&opts.dir).map_err(write_err(&opts.dir))?;
        let config_path = opts.dir.join(CONFIG_FILE);
        write_config(&config_path, &opts.config)?;
        let mut procs = Vec::with_capacity(names.len());
        for (i, name) in names.into_iter().enumerate() {
            let daemon = if i == 0 {
                Daemon::Kvctld
            } else if i <= opts.prefill_workers {
                Daemon::Prefilld
            } else {
                Daemon::Decoded
            };
            let path = match opts.worker_configs.get(&name) {
                Some(config) => {
                    let path = opts.dir.join(format!("{name}.toml"));
                    write_config(&path, config)?;
                    path
                }
                None => config_path.clone(),
            };
            procs.push(Proc {
                name,
                daemon,
                config_path: path,
                guard: None,
            });
        }
        let mut stack = Stack {
            opts,
            config_path,
            procs,
        };
        stack.spawn(0)?;
        stack.wait_for_socket()?;
        for i in 1..stack.procs.len() {
            stack.spawn(i)?;
        }
        stack.wait_ready()?;
        Ok(stack)
    }

    /// The config kvctld and the workers without a config of their own run with (with
    /// `[transfer] listen` on port 0 when several prefill workers share it).
    pub fn config(&self) -> &Config {
        &self.opts.config
    }

    /// The config file kvctld and the workers without a config of their own were given.
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// The config file the process `name` is started with.
    pub fn config_path_of(&self, name: impl AsRef<str>) -> Result<&Path, StackError> {
        let i = self.index(name.as_ref())?;
        Ok(&self.procs[i].config_path)
    }

    /// Gives the worker `id` a config of its own, written as `<id>.toml`, for its next
    /// start ([`Stack::restart`]); the running process is left alone.
    pub fn set_worker_config(
        &mut self,
        id: impl AsRef<str>,
        config: &Config,
    ) -> Result<(), StackError> {
        let id = id.as_ref();
        let i = self.index(id)?;
        if self.procs[i].daemon == Daemon::Kvctld {
            return Err(self.unknown(id));
        }
        let path = self.opts.dir.join(format!("{id}.toml"));
        write_config(&path, config)?;
        self.procs[i].config_path = path;
        self.opts
            .worker_configs
            .insert(id.to_owned(), config.clone());
        Ok(())
    }

    /// The stack's directory (configs and logs).
    pub fn dir(&self) -> &Path {
        &self.opts.dir
    }

    /// kvctld's control socket.
    pub fn socket(&self) -> &Path {
        &self.opts.config.control.socket
    }

    /// The names of every process of the stack, running or not, in start order: `kvctld`,
    /// then the prefill workers, then the decode workers.
    pub fn names(&self) -> Vec<String> {
        self.procs.iter().map(|p| p.name.clone()).collect()
    }

    /// The ids of the workers of `role`, in order (`prefill-0`, `prefill-1`, ...).
    pub fn worker_ids(&self, role: Role) -> Vec<String> {
        self.procs
            .iter()
            .filter(|p| p.daemon.role() == Some(role))
            .map(|p| p.name.clone())
            .collect()
    }

    /// The binary the process `name` runs.
    pub fn daemon(&self, name: impl AsRef<str>) -> Result<Daemon, StackError> {
        let i = self.index(name.as_ref())?;
        Ok(self.procs[i].daemon)
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

    /// The pids of the processes the stack holds, by name.
    pub fn pids(&self) -> Vec<(String, Pid)> {
        self.procs
            .iter()
            .filter_map(|p| Some((p.name.clone(), p.guard.as_ref()?.pid()?)))
            .collect()
    }

    /// The pid of the process `name`, if the stack holds it: it is running, or it was
    /// signalled to stop and not yet reaped by [`Stack::wait_exit`]. `None` for a name the
    /// stack does not have.
    pub fn pid(&self, name: impl AsRef<str>) -> Option<Pid> {
        let i = self.index(name.as_ref()).ok()?;
        self.procs[i].guard.as_ref().and_then(Guard::pid)
    }

    /// Path of the log file of the process `name`: `<name>.log` in the stack's directory.
    pub fn log_path(&self, name: impl AsRef<str>) -> PathBuf {
        self.opts.dir.join(format!("{}.log", name.as_ref()))
    }

    /// Everything the process `name` wrote to stdout and stderr, over all its restarts.
    pub fn log(&self, name: impl AsRef<str>) -> String {
        fs::read(self.log_path(name))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// Kills the process `name` with SIGKILL and reaps it; its exit status, or `None` if it
    /// was not running.
    pub fn kill(&mut self, name: impl AsRef<str>) -> Result<Option<ExitStatus>, StackError> {
        let i = self.index(name.as_ref())?;
        match self.procs[i].guard.take() {
            Some(mut g) => Ok(Some(g.kill_and_wait()?)),
            None => Ok(None),
        }
    }

    /// Sends `signal` to the process `name` if it runs. After SIGTERM, SIGINT or SIGQUIT the
    /// process is expected to exit: the stack's waits no longer count on it or fail when it
    /// does, and [`Stack::wait_exit`] reaps it.
    pub fn signal(&mut self, name: impl AsRef<str>, signal: Signal) -> Result<(), StackError> {
        let i = self.index(name.as_ref())?;
        let Some(g) = self.procs[i].guard.as_mut() else {
            return Ok(());
        };
        if matches!(signal, Signal::SIGTERM | Signal::SIGINT | Signal::SIGQUIT) {
            g.stopping = true;
        }
        g.signal(signal)
    }

    /// Waits up to `timeout` for the process `name` to exit, and reaps it: its exit status,
    /// or `None` if it still runs (it is left running) or was not running.
    pub fn wait_exit(
        &mut self,
        name: impl AsRef<str>,
        timeout: Duration,
    ) -> Result<Option<ExitStatus>, StackError> {
        let i = self.index(name.as_ref())?;
        let Some(g) = self.procs[i].guard.as_mut() else {
            return Ok(None);
        };
        let status = g.wait_timeout(timeout);
        if status.is_some() {
            self.procs[i].guard = None;
        }
        Ok(status)
    }

    /// Kills the process `name` if it runs, then starts it again (a worker under the same
    /// id) and waits until the stack is ready. For a worker, first waits until kvctld no
    /// longer lists the old process as connected, so that readiness is the new process's
    /// registration.
    pub fn restart(&mut self, name: impl AsRef<str>) -> Result<(), StackError> {
        let name = name.as_ref();
        let i = self.index(name)?;
        self.kill(name)?;
        let daemon = self.procs[i].daemon;
        if daemon != Daemon::Kvctld && self.procs[0].guard.is_some() {
            self.wait_status(&format!("{name} to be seen disconnected"), |s| {
                !worker_id_connected(s, name)
            })?;
        }
        self.spawn(i)?;
        if daemon == Daemon::Kvctld {
            self.wait_for_socket()?;
        }
        self.wait_ready()
    }

    /// Waits until kvctld reports every running worker connected under its id (workers that
    /// were killed, or signalled to stop, are not waited for).
    pub fn wait_ready(&mut self) -> Result<(), StackError> {
        let ids: Vec<String> = self
            .procs
            .iter()
            .filter(|p| p.daemon != Daemon::Kvctld && p.is_up())
            .map(|p| p.name.clone())
            .collect();
        let what = match ids.len() {
            0 => "kvctld's status".to_owned(),
            _ => format!("{} to be connected", ids.join(", ")),
        };
        self.wait_status(&what, |s| ids.iter().all(|id| worker_id_connected(s, id)))
            .map(drop)
    }

    /// Polls kvctld's status until `ready` holds, for at most the ready timeout. Fails early
    /// if a process exits that was not signalled to stop.
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

    /// Sends SIGTERM to every running process (workers first, then kvctld), waits for each
    /// up to the stop timeout, then kills what is left with SIGKILL.
    pub fn stop(&mut self) -> Result<StopReport, StackError> {
        let n = self.procs.len();
        // Workers, then kvctld.
        let order: Vec<usize> = (1..n).chain([0]).collect();
        for &i in &order {
            if let Some(g) = self.procs[i].guard.as_mut() {
                g.stopping = true;
                g.signal(Signal::SIGTERM)?;
            }
        }
        let deadline = Instant::now() + self.opts.stop_timeout;
        let mut exits = Vec::new();
        for &i in &order {
            let Some(mut g) = self.procs[i].guard.take() else {
                continue;
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let (status, killed) = match g.wait_timeout(left) {
                Some(status) => (status, false),
                None => (g.kill_and_wait()?, true),
            };
            exits.push(DaemonExit {
                name: self.procs[i].name.clone(),
                daemon: self.procs[i].daemon,
                status,
                killed,
            });
        }
        Ok(StopReport { exits })
    }

    /// The position of the process `name` in `procs`.
    fn index(&self, name: &str) -> Result<usize, StackError> {
        self.procs
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| self.unknown(name))
    }

    fn unknown(&self, name: &str) -> StackError {
        StackError::UnknownProcess {
            name: name.to_owned(),
            known: self.names().join(", "),
        }
    }

    fn spawn(&mut self, i: usize) -> Result<(), StackError> {
        let p = &self.procs[i];
        let name = p.name.clone();
        let path = self.opts.bin_dir.join(p.daemon.binary());
        let log_path = self.log_path(&name);
        let log_err = |source| StackError::Write {
            path: log_path.clone(),
            source,
        };
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(log_err)?;
        let stdout: File = log.try_clone().map_err(log_err)?;
        let mut cmd = match self.opts.wrap.get(&name).and_then(|w| w.split_first()) {
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg(&path);
                cmd
            }
            None => Command::new(&path),
        };
        cmd.arg("--config").arg(&p.config_path);
        if p.daemon != Daemon::Kvctld {
            cmd.arg("--id").arg(&name);
        }
        cmd.stdin(Stdio::null()).stdout(stdout).stderr(log);
        match &self.opts.rust_log {
            Some(level) => {
                cmd.env("RUST_LOG", level);
            }
            None => {
                // Inherited as is (or absent).
            }
        }
        let child = cmd.spawn().map_err(|source| StackError::Spawn {
            name: name.clone(),
            path,
            source,
        })?;
        self.procs[i].guard = Some(Guard {
            name,
            child,
            stopping: false,
        });
        Ok(())
    }

    /// Fails if a process that should run has exited (one signalled to stop may).
    fn check_alive(&mut self, while_doing: &'static str) -> Result<(), StackError> {
        for i in 0..self.procs.len() {
            let Some(g) = self.procs[i].guard.as_mut() else {
                continue;
            };
            if g.stopping {
                continue;
            }
            if let Some(status) = g.exited()? {
                let p = &mut self.procs[i];
                p.guard = None;
                let (name, daemon) = (p.name.clone(), p.daemon);
                return Err(StackError::Exited {
                    log: tail(&self.log(&name), 40),
                    name,
                    daemon,
                    status,
                    while_doing,
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

fn write_err(path: &Path) -> impl FnOnce(io::Error) -> StackError + use<> {
    let path = path.to_path_buf();
    move |source| StackError::Write { path, source }
}

fn write_config(path: &Path, config: &Config) -> Result<(), StackError> {
    let text = toml::to_string(config).map_err(StackError::Serialize)?;
    fs::write(path, text).map_err(write_err(path))
}

/// Sets the port of `[transfer] listen` to 0 (each prefill worker then binds a free one).
fn free_listen_port(config: &mut Config) {
    if let Ok(Some(addr)) = config.transfer.listen_addr()
        && addr.port() != 0
    {
        config.transfer.listen = Some(SocketAddr::new(addr.ip(), 0).to_string());
    }
}

/// Whether `status` lists a connected worker of `role`.
pub fn worker_connected(status: &StatusReply, role: Role) -> bool {
    status.workers.iter().any(|w| w.role == role && w.connected)
}

/// The worker `id` in `status`, if kvctld lists it.
pub fn find_worker<'a>(status: &'a StatusReply, id: &str) -> Option<&'a WorkerStatus> {
    status.workers.iter().find(|w| w.id == id)
}

/// Whether `status` lists the worker `id` as connected.
pub fn worker_id_connected(status: &StatusReply, id: &str) -> bool {
    find_worker(status, id).is_some_and(|w| w.connected)
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
    use libkv::config::{Transfer, TransportKind};
    use std::os::unix::fs::PermissionsExt;

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
    fn names_ids_and_the_single_worker_shorthands() {
        let dir = tempfile::tempdir().unwrap();
        let opts = StackOptions::new(
            Config::embedded_default(dir.path().join("s.sock")),
            dir.path().to_path_buf(),
        )
        .unwrap();
        assert_eq!(opts.names(), ["kvctld", "prefill-0", "decode-0"]);
        assert_eq!(
            opts.with_workers(2, 3).names(),
            [
                "kvctld",
                "prefill-0",
                "prefill-1",
                "decode-0",
                "decode-1",
                "decode-2"
            ]
        );
        for d in Daemon::ALL {
            assert_eq!(
                Daemon::ALL.iter().filter(|o| o.name() == d.name()).count(),
                1
            );
            if let Some(role) = d.role() {
                assert_eq!(Daemon::of_role(role), Some(d));
            }
        }
        assert_eq!(Daemon::Prefilld.name(), prefill_id(0));
        assert_eq!(Daemon::Decoded.name(), decode_id(0));
        assert!(libkv::proto::is_valid_worker_id(&prefill_id(usize::MAX)));
    }

    #[test]
    fn a_shared_listen_port_becomes_port_0_for_several_prefill_workers() {
        let mut config = Config::embedded_default("/tmp/kvfence-x/kvctld.sock".into());
        config.transfer = Transfer {
            transport: TransportKind::Tcp,
            listen: Some("127.0.0.1:7470".into()),
        };
        free_listen_port(&mut config);
        assert_eq!(config.transfer.listen.as_deref(), Some("127.0.0.1:0"));
        config.transfer.listen = Some("[::1]:7470".into());
        free_listen_port(&mut config);
        assert_eq!(config.transfer.listen.as_deref(), Some("[::1]:0"));
        assert!(config.validate().is_ok());
        let mut shm = Config::embedded_default("/tmp/kvfence-x/kvctld.sock".into());
        let before = shm.clone();
        free_listen_port(&mut shm);
        assert_eq!(shm, before);
    }

    /// Fake daemons: kvctld, prefilld and decoded as shell scripts.
    fn fake_bin(dir: &Path, script: &str) -> PathBuf {
        let bin = dir.join("bin");
        fs::create_dir(&bin).unwrap();
        for d in Daemon::ALL {
            let path = bin.join(d.binary());
            fs::write(&path, script).unwrap();
            fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
        }
        bin
    }

    #[test]
    fn a_daemon_that_exits_at_once_is_reported_with_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let bin = fake_bin(
            dir.path(),
            "#!/bin/sh\necho \"$0: refusing $*\" >&2\nexit 3\n",
        );
        let mut opts = StackOptions::new(
            Config::embedded_default(dir.path().join("s.sock")),
            dir.path().join("run"),
        )
        .unwrap();
        opts.bin_dir = bin;
        let err = Stack::start(opts).unwrap_err();
        match &err {
            StackError::Exited {
                name, daemon, log, ..
            } => {
                assert_eq!((name.as_str(), *daemon), (KVCTLD, Daemon::Kvctld));
                assert!(log.contains("refusing --config"), "{log}");
            }
            other => panic!("{other:?}"),
        }
        let written = fs::read_to_string(dir.path().join("run").join(CONFIG_FILE)).unwrap();
        assert!(Config::from_toml_str(&written).is_ok());
    }

    #[test]
    fn unknown_names_in_the_options_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let bin = fake_bin(dir.path(), "#!/bin/sh\nexit 3\n");
        let config = Config::embedded_default(dir.path().join("s.sock"));
        let mut opts = StackOptions::new(config.clone(), dir.path().join("run"))
            .unwrap()
            .with_workers(2, 1);
        opts.bin_dir = bin.clone();
        let mut wrapped = opts.clone();
        wrapped.wrap.insert("decode-1".into(), vec!["env".into()]);
        let err = Stack::start(wrapped).unwrap_err();
        assert!(
            matches!(&err, StackError::UnknownProcess { name, .. } if name == "decode-1"),
            "{err:?}"
        );
        assert!(err.to_string().contains("prefill-1"), "{err}");
        let mut configured = opts.clone();
        configured.worker_configs.insert(KVCTLD.into(), config);
        assert!(matches!(
            Stack::start(configured),
            Err(StackError::UnknownProcess { .. })
        ));
    }

    /// Answers as kvctld would on `socket`: `HelloAck`, and a `StatusReply` listing as
    /// connected every fake worker whose pid file in `bin` names a live process.
    fn fake_kvctld(socket: &Path, bin: PathBuf) {
        use libkv::Generation;
        use libkv::proto::{HelloAck, Message, Transport};
        use libkv::sys::uds::{read_frame_timeout, send_frame};
        use std::os::unix::net::{UnixListener, UnixStream};
        let alive = |pid: &str| {
            fs::read_to_string(format!("/proc/{}/stat", pid.trim()))
                .is_ok_and(|stat| !stat.contains(") Z "))
        };
        let serve = move |s: UnixStream| {
            while let Ok((h, msg, _)) = read_frame_timeout(&s, Duration::from_secs(30)) {
                let reply: Message = match msg {
                    Message::Hello(_) => HelloAck {
                        version: 2,
                        generation: Generation(1),
                    }
                    .into(),
                    Message::StatusQuery(_) => {
                        let mut workers = Vec::new();
                        for entry in fs::read_dir(&bin).unwrap().flatten() {
                            let file = entry.file_name().to_string_lossy().into_owned();
                            let Some(id) = file.strip_suffix(".pid") else {
                                continue;
                            };
                            let pid = fs::read_to_string(entry.path()).unwrap_or_default();
                            workers.push(WorkerStatus {
                                id: id.to_owned(),
                                role: if id.starts_with("prefill") {
                                    Role::Prefill
                                } else {
                                    Role::Decode
                                },
                                connected: alive(&pid),
                                drain: false,
                                in_flight: 0,
                                held_pages: 0,
                                transports: vec![Transport::Shm],
                                served: 0,
                                counters: Vec::new(),
                                pool_pages: 8,
                                tokens_per_page: 16,
                                free: 8,
                                reserved: 0,
                                writing: 0,
                                readable: 0,
                                draining: 0,
                                max_batch: 0,
                            });
                        }
                        StatusReply {
                            generation: Generation(1),
                            max_context: 64,
                            max_new_tokens: 16,
                            workers,
                            counters: Vec::new(),
                            transport: Some(Transport::Shm),
                            model: None,
                        }
                        .into()
                    }
                    other => panic!("fake kvctld: unexpected {other:?}"),
                };
                let frame = reply.encode(h.request_id).unwrap();
                if send_frame(&s, &frame, &[]).is_err() {
                    break;
                }
            }
        };
        let listener = UnixListener::bind(socket).unwrap();
        thread::spawn(move || {
            for s in listener.incoming().flatten() {
                let serve = serve.clone();
                thread::spawn(move || serve(s));
            }
        });
    }

    /// Four workers under one (fake) kvctld: each is given `--id` and its config, and is
    /// killed, signalled, reaped and restarted by its id alone.
    #[test]
    fn workers_are_started_with_their_id_and_addressed_by_it() {
        use std::os::unix::process::ExitStatusExt;
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        // kvctld's part is played by fake_kvctld; a worker records its arguments and pid.
        let script = r#"#!/bin/sh
case $0 in */kvctld) exec sleep 60 ;; esac
echo "args: $*"
id=
while [ $# -gt 0 ]; do
  [ "$1" = --id ] && id=$2
  shift
done
echo $$ > "$(dirname "$0")/$id.pid"
exec sleep 60
"#;
        let bin = fake_bin(dir.path(), script);
        let socket = dir.path().join("s.sock");
        fake_kvctld(&socket, bin.clone());
        let config = Config::embedded_default(socket);
        let mut opts = StackOptions::new(config.clone(), run.clone())
            .unwrap()
            .with_workers(2, 2);
        opts.bin_dir = bin.clone();
        opts.ready_timeout = Duration::from_secs(10);
        opts.worker_configs
            .insert("decode-1".into(), config.clone());
        let mut stack = Stack::start(opts).unwrap_or_else(|e| panic!("{}", error_chain(&e)));
        assert_eq!(
            stack.names(),
            ["kvctld", "prefill-0", "prefill-1", "decode-0", "decode-1"]
        );
        assert_eq!(stack.worker_ids(Role::Decode), ["decode-0", "decode-1"]);
        assert_eq!(stack.daemon("prefill-1").unwrap(), Daemon::Prefilld);
        let shared = run.join(CONFIG_FILE);
        for (id, path) in [
            ("prefill-0", shared.clone()),
            ("prefill-1", shared.clone()),
            ("decode-0", shared),
            ("decode-1", run.join("decode-1.toml")),
        ] {
            let want = format!("args: --config {} --id {id}", path.display());
            assert!(stack.log(id).contains(&want), "{id}: {:?}", stack.log(id));
            assert_eq!(stack.config_path_of(id).unwrap(), path);
        }
        assert_eq!(stack.log(Daemon::Prefilld), stack.log("prefill-0"));
        assert_eq!(stack.pids().len(), 5);
        let pidfile = |id: &str| fs::read_to_string(bin.join(format!("{id}.pid"))).unwrap();
        let old = stack.pid("prefill-1").unwrap();
        assert_eq!(pidfile("prefill-1").trim(), old.to_string());

        let status = stack.kill("prefill-1").unwrap().unwrap();
        assert_eq!(status.signal(), Some(9));
        assert_eq!(stack.pid("prefill-1"), None);
        assert_eq!(stack.kill("prefill-1").unwrap(), None);
        stack.restart("prefill-1").unwrap();
        let new = stack.pid("prefill-1").unwrap();
        assert_ne!(new, old);
        assert_eq!(pidfile("prefill-1").trim(), new.to_string());
        assert_eq!(stack.log("prefill-1").matches("args:").count(), 2);

        stack.signal(Daemon::Decoded, Signal::SIGTERM).unwrap();
        let status = stack
            .wait_exit("decode-0", Duration::from_secs(10))
            .unwrap()
            .unwrap();
        assert_eq!(status.signal(), Some(15));
        assert_eq!(stack.pid("decode-0"), None);
        // The stopped worker is not waited for; the others still are.
        stack.wait_ready().unwrap();
        assert_eq!(
            stack
                .wait_exit("decode-1", Duration::from_millis(50))
                .unwrap(),
            None
        );
        assert!(stack.pid("decode-1").is_some());

        for err in [
            stack.kill("decode-7").unwrap_err(),
            stack.restart("prefill").unwrap_err(),
            stack.set_worker_config(KVCTLD, &config).unwrap_err(),
        ] {
            assert!(matches!(err, StackError::UnknownProcess { .. }), "{err:?}");
        }
        stack.set_worker_config("prefill-0", &config).unwrap();
        assert_eq!(
            stack.config_path_of("prefill-0").unwrap(),
            run.join("prefill-0.toml")
        );

        let report = stack.stop().unwrap();
        let names: Vec<&str> = report.exits.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["prefill-0", "prefill-1", "decode-1", "kvctld"]);
        assert!(report.exits.iter().all(|e| !e.killed));
        assert!(stack.pids().is_empty());
    }
}
