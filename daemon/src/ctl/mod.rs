//! kvctld: the control daemon.
//!
//! kvctld decides *which* request runs, on *which* pair of workers and in *what order* the
//! workers act; the workers enforce page ownership themselves and nothing here touches a
//! page. It holds any number of prefill and decode workers (one per GPU or pool), each
//! registered under its id.
//!
//! - [`core`]: the workers, the admission ledger and the request state machine, with no
//!   I/O (events in, actions out), where the invariants are tested;
//! - [`workers`]: the worker registry and the pairing policy;
//! - [`event_loop`]: the control socket and the TLS listener, connections, peer
//!   authentication, frames;
//! - [`leader`] and [`members`] (with `[election]`): the campaign and lease in etcd, and the
//!   workers' own leases there.
//!
//! This file starts them: the listening socket (bound, or passed by systemd), the optional
//! coherence probe thread, then the loop until SIGTERM/SIGINT.
//!
//! # The socket path
//!
//! One path, one kvctld. Before it binds, kvctld takes an exclusive `flock` on the lock
//! file `SOCKET.lock` beside the socket (kept for its whole life, released by the kernel
//! when it dies) and refuses to start while another process holds it. It then probes a
//! socket already at the path with a connect: one that accepts belongs to a live daemon (a
//! kvctld of an older build, or the service manager) and is never replaced; one that
//! refuses is the socket of a daemon that died, and is replaced. At exit kvctld removes the
//! path only if it is still the socket it bound (same device and inode). The lock file
//! stays: removing it would let two daemons lock two different files. A socket passed by
//! systemd belongs to the socket unit: kvctld neither replaces nor removes it, and still
//! takes the lock, so that a kvctld started by hand beside the activated one refuses.

pub mod core;
pub mod event_loop;
pub mod latency;
pub mod leader;
pub mod members;
pub mod workers;

use self::core::{Core, CoreConfig};
use event_loop::{EventLoop, ProbeCounters};
use libkv::Generation;
use libkv::config::Config;
use log::{debug, info, warn};
use mio::net::UnixListener;
use nix::fcntl::{Flock, FlockArg};
use std::fs::File;
use std::io::{self, Read, Seek, Write};
use std::os::fd::FromRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Errors that stop kvctld.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    #[error("creating socket directory {path}")]
    SocketDir { path: PathBuf, source: io::Error },
    #[error("binding control socket {path}")]
    Bind { path: PathBuf, source: io::Error },
    #[error("setting owner and mode of {path}")]
    Permissions { path: PathBuf, source: io::Error },
    #[error("TLS listener")]
    Tls(#[source] libkv::tls::TlsError),
    #[error("control.socket_group {group:?} names no group on this host")]
    UnknownGroup { group: String },
    #[error("looking up control.socket_group {group:?}")]
    GroupLookup { group: String, source: io::Error },
    #[error("opening the lock file {path}")]
    Lock { path: PathBuf, source: io::Error },
    #[error(
        "another kvctld{} serves {socket} (it holds {lock}); stop it first, or give this one \
         another control.socket",
        pid.map(|p| format!(" (pid {p})")).unwrap_or_default(),
        socket = socket.display(),
        lock = lock.display()
    )]
    AlreadyRunning {
        socket: PathBuf,
        lock: PathBuf,
        pid: Option<u32>,
    },
    #[error(
        "{} is a live socket: something accepts connections on it (a kvctld not using the \
         lock file, or the service manager's kvctld.socket); refusing to replace it",
        path.display()
    )]
    SocketInUse { path: PathBuf },
    #[error(
        "{} exists and is {what}, not a socket: kvctld replaces only a socket a kvctld left; \
         move it away, or set [control] socket to another path",
        path.display()
    )]
    NotASocket { path: PathBuf, what: &'static str },
    #[error("probing the socket already at {path}")]
    Probe { path: PathBuf, source: io::Error },
    #[error("setting up the event loop")]
    Poll(#[source] io::Error),
    #[error("[election]")]
    Election(#[source] libkv::config::ConfigError),
    #[error("[election]")]
    Etcd(#[source] libkv::etcd::EtcdError),
    #[error("no longer leading: the lease of epoch {epoch} was not renewed in time")]
    LostLeadership { epoch: u64 },
    #[error("serving metrics on {addr} (metrics.listen)")]
    Metrics {
        addr: std::net::SocketAddr,
        source: io::Error,
    },
}

/// Runs kvctld until SIGTERM or SIGINT, then drains.
pub fn run(cfg: Config) -> Result<(), CtlError> {
    let activated = activated_listener()?;
    if activated.is_none() {
        create_socket_dir(&cfg.control)?;
    }
    let lock = match SocketLock::take(&cfg.control.socket) {
        Ok(lock) => Some(lock),
        Err(e @ CtlError::AlreadyRunning { .. }) => return Err(e),
        Err(e) if activated.is_some() => {
            // The socket unit owns the path; the lock only guards against a second kvctld
            // started by hand, which the service manager's socket turns away anyway.
            warn!(
                "{}; serving the socket passed by the service manager without it",
                libkv::error_chain(&e)
            );
            None
        }
        Err(e) => return Err(e),
    };
    // With [election], nothing is served until this kvctld leads: a standby holds its lock
    // and waits, its socket unbound and its TLS listener closed.
    let leadership = match elect(&cfg)? {
        Elected::Leads(l) => Some(l),
        Elected::Alone => None,
        Elected::Stopped => return Ok(()),
    };
    let (listener, bound) = match activated {
        Some(l) => (l, None),
        None => {
            let (l, identity) = bind(&cfg.control)?;
            (l, Some(identity))
        }
    };
    // Workers never serve a kvctld older than one they registered with (libkv::fence), so
    // a kvctld restarted on a clock that went back must still start later than the last.
    let mut lock = lock;
    let generation = match &leadership {
        // etcd's revision: larger at every win, across every kvctld of the cluster
        Some(l) => l.term().epoch(),
        None => next_generation(lock.as_ref().and_then(|l| l.previous)),
    };
    if let Some(l) = lock.as_mut() {
        l.record(Some(generation));
    }
    let mut core_cfg = CoreConfig::from_config(&cfg, generation.0);
    core_cfg.placeholder_fault = placeholder_fault();
    info!(
        "kvctld generation {} serving {} (max context {}, max new tokens {}, pairing {:?})",
        generation.0,
        cfg.control.socket.display(),
        cfg.limits.max_context,
        cfg.limits.max_new_tokens,
        cfg.control.pairing,
    );
    let probe = Arc::new(ProbeCounters::default());
    if let Some(every) = cfg.probe.interval() {
        start_probe(&cfg, every, Arc::clone(&probe));
    }
    let metrics = match cfg.metrics.listen_addr() {
        Ok(Some(addr)) => {
            let snapshot = crate::metrics::Snapshot::default();
            crate::metrics::serve(addr, snapshot.clone())
                .map_err(|source| CtlError::Metrics { addr, source })?;
            Some(snapshot)
        }
        // Validated at load.
        Ok(None) | Err(_) => None,
    };
    let socket = cfg.control.socket.clone();
    let core = Core::new(core_cfg, generation);
    let watcher = leadership
        .as_ref()
        .and_then(|_| members::Watcher::start(&cfg.election));
    let mut event_loop =
        EventLoop::new(cfg, listener, core, probe, metrics).map_err(CtlError::Poll)?;
    if let Some(addr) = event_loop.listen_tls().map_err(CtlError::Tls)? {
        info!("kvctld serving TLS peers on {addr}");
    }
    if let Some(l) = &leadership {
        event_loop.lead(l.term().clone());
    }
    if let Some(w) = watcher {
        event_loop.watch_members(w);
    }
    let served = event_loop.serve();
    if let Some(identity) = bound {
        identity.remove_if_mine(&socket);
    }
    drop(lock);
    match served {
        Ok(event_loop::Ended::Stopped) => {
            if let Some(l) = leadership {
                l.resign();
            }
            Ok(())
        }
        Ok(event_loop::Ended::LostLeadership) => Err(CtlError::LostLeadership {
            epoch: generation.0,
        }),
        Err(e) => Err(CtlError::Poll(e)),
    }
}

/// The outcome of the election, before anything is served.
enum Elected {
    /// No `[election]`: this kvctld serves alone.
    Alone,
    Leads(leader::Leadership),
    /// SIGTERM or SIGINT while a standby.
    Stopped,
}

/// Campaigns when `[election]` is on, until this kvctld leads or is told to stop.
fn elect(cfg: &Config) -> Result<Elected, CtlError> {
    if !cfg.election.enabled() {
        return Ok(Elected::Alone);
    }
    let advertise = cfg
        .election
        .advertised(&cfg.tls)
        .map_err(CtlError::Election)?;
    libkv::etcd::check(&cfg.election).map_err(CtlError::Etcd)?;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(signal, Arc::clone(&stop)).map_err(CtlError::Poll)?;
    }
    info!(
        "campaigning under {} in etcd at {} as {advertise}",
        cfg.election.key,
        libkv::etcd::Endpoints::from_election(&cfg.election)
            .map(|e| e.describe())
            .unwrap_or_default()
    );
    Ok(
        match leader::Leadership::campaign(&cfg.election, &advertise, &stop) {
            Some(l) => Elected::Leads(l),
            None => {
                info!("stopped while a standby");
                Elected::Stopped
            }
        },
    )
}

/// Whether this build replaces an over-long prompt by a placeholder (the incident):
/// `KVFENCE_FAULT=placeholder` in builds with the `fault-injection` feature, which exist to
/// prove the test suite catches a broken build; release builds have no such switch.
fn placeholder_fault() -> bool {
    #[cfg(feature = "fault-injection")]
    {
        std::env::var("KVFENCE_FAULT")
            .is_ok_and(|v| v.split(',').any(|f| f.trim() == "placeholder"))
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        false
    }
}

/// Runs the coherence probe every `every` on a thread of its own, as a client of this
/// kvctld, on the model of `[model]` (loaded on that thread, so a large model does not hold up
/// kvctld's start). A mismatch is logged at error level and counted (`probe_mismatches`).
fn start_probe(cfg: &Config, every: Duration, counters: Arc<ProbeCounters>) {
    let socket = cfg.control.socket.clone();
    let geometry = cfg.geometry;
    let model_cfg = cfg.model.clone();
    let timeout = cfg.deadlines.request() + cfg.deadlines.admission_wait();
    info!("coherence probe every {} s", every.as_secs());
    let spawned = std::thread::Builder::new()
        .name("probe".into())
        .spawn(move || {
            let model = match llama::load(&model_cfg, geometry, 1) {
                Ok(m) => m,
                Err(e) => {
                    counters.errors.fetch_add(1, Ordering::Relaxed);
                    log::error!("coherence probe disabled: {}", libkv::error_chain(&e));
                    return;
                }
            };
            loop {
                std::thread::sleep(every);
                counters.runs.fetch_add(1, Ordering::Relaxed);
                match crate::probe::run_probe(&socket, &model, 16, timeout) {
                    Ok(r) if !r.mismatches.is_empty() => {
                        counters
                            .mismatches
                            .fetch_add(r.mismatches.len() as u64, Ordering::Relaxed);
                        for m in &r.mismatches {
                            log::error!(
                                "coherence probe: output differs from the monolithic path: {m}"
                            );
                        }
                    }
                    Ok(r) if !r.errors.is_empty() => {
                        counters
                            .errors
                            .fetch_add(r.errors.len() as u64, Ordering::Relaxed);
                        warn!(
                            "coherence probe: {} canaries failed: {}",
                            r.errors.len(),
                            r.errors[0]
                        );
                    }
                    Ok(_) => debug!("coherence probe: all canaries matched"),
                    Err(e) => {
                        counters.errors.fetch_add(1, Ordering::Relaxed);
                        warn!("coherence probe could not run: {e}");
                    }
                }
            }
        });
    if let Err(e) = spawned {
        warn!("cannot start the coherence probe: {e}");
    }
}

/// The listening socket systemd passed (socket activation), if any.
fn activated_listener() -> Result<Option<UnixListener>, CtlError> {
    let fds: Vec<_> = match sd_notify::listen_fds() {
        Ok(fds) => fds.collect(),
        Err(_) => return Ok(None),
    };
    let [fd] = fds[..] else {
        if !fds.is_empty() {
            warn!(
                "{} sockets passed by the service manager, expected 1; binding my own",
                fds.len()
            );
        }
        return Ok(None);
    };
    // SAFETY: `listen_fds` checked LISTEN_PID against our pid, so the service manager passed
    // this fd to this process, and nothing else in kvctld has taken ownership of it.
    let std_listener = unsafe { std::os::unix::net::UnixListener::from_raw_fd(fd) };
    std_listener.set_nonblocking(true).map_err(CtlError::Poll)?;
    info!("using the control socket passed by the service manager");
    Ok(Some(UnixListener::from_std(std_listener)))
}

/// The lock file of the socket at `socket`: `SOCKET.lock`.
pub fn lock_path(socket: &Path) -> PathBuf {
    let mut name = socket.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

/// The exclusive lock on `SOCKET.lock`, held while kvctld runs (see the module doc). The
/// file holds the pid of the kvctld holding it and its generation, so that the next one
/// can name the holder and start at a later generation.
#[derive(Debug)]
struct SocketLock {
    lock: Flock<File>,
    /// The generation the last kvctld on this socket recorded.
    previous: Option<Generation>,
}

impl SocketLock {
    /// Locks `SOCKET.lock` (in the socket's directory, which must exist) or says who holds
    /// it. Writes this process's pid into the file for the next one's error message.
    fn take(socket: &Path) -> Result<SocketLock, CtlError> {
        let path = lock_path(socket);
        let lock_err = |source| CtlError::Lock {
            path: path.clone(),
            source,
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .custom_flags(nix::libc::O_CLOEXEC | nix::libc::O_NOFOLLOW)
            .open(&path)
            .map_err(lock_err)?;
        let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => lock,
            Err((mut file, nix::errno::Errno::EWOULDBLOCK)) => {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                return Err(CtlError::AlreadyRunning {
                    socket: socket.to_owned(),
                    lock: path,
                    pid: text.split_whitespace().next().and_then(|p| p.parse().ok()),
                });
            }
            Err((_, e)) => return Err(lock_err(e.into())),
        };
        let mut text = String::new();
        let _ = lock.read_to_string(&mut text);
        let previous = text
            .split_whitespace()
            .nth(1)
            .and_then(|g| g.parse().ok())
            .map(Generation);
        let mut lock = SocketLock { lock, previous };
        lock.record(None);
        Ok(lock)
    }

    /// Writes this process's pid, and its generation once chosen, into the lock file.
    fn record(&mut self, generation: Option<Generation>) {
        let pid = std::process::id();
        let line = match generation {
            Some(g) => format!("{pid} {}", g.0),
            None => format!("{pid}"),
        };
        let lock = &mut self.lock;
        let written = lock
            .set_len(0)
            .and_then(|()| lock.rewind())
            .and_then(|()| writeln!(lock, "{line}"));
        if let Err(e) = written {
            debug!("writing the lock file: {e}");
        }
    }
}

/// The device and inode of the socket kvctld bound, to recognise it at exit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct BoundSocket {
    dev: u64,
    ino: u64,
}

impl BoundSocket {
    fn of(path: &Path) -> io::Result<BoundSocket> {
        let meta = std::fs::symlink_metadata(path)?;
        Ok(BoundSocket {
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }

    /// Removes `path` if it is still this socket; leaves anything else there alone.
    fn remove_if_mine(self, path: &Path) {
        match BoundSocket::of(path) {
            Ok(now) if now == self => {
                if let Err(e) = std::fs::remove_file(path) {
                    warn!("removing {}: {e}", path.display());
                }
            }
            Ok(_) => info!(
                "{} is no longer the socket this kvctld bound; leaving it",
                path.display()
            ),
            Err(e) => debug!("{} at exit: {e}", path.display()),
        }
    }
}

/// Whether a socket at `path` accepts connections: `Ok(true)` live, `Ok(false)` stale (no
/// listener: the connect is refused) or absent. Never blocks: a live daemon with a full
/// backlog answers `EAGAIN`, which counts as live.
fn socket_is_live(path: &Path) -> io::Result<bool> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
    use std::os::fd::AsRawFd;
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let addr = UnixAddr::new(path)?;
    match connect(fd.as_raw_fd(), &addr) {
        Ok(()) | Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINPROGRESS) => Ok(true),
        Err(nix::errno::Errno::ECONNREFUSED | nix::errno::Errno::ENOENT) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The gid `control.socket_group` names: a group name, or a number.
fn socket_gid(group: &str) -> Result<nix::unistd::Gid, CtlError> {
    match nix::unistd::Group::from_name(group) {
        Ok(Some(g)) => Ok(g.gid),
        Ok(None) => group
            .parse::<u32>()
            .map(nix::unistd::Gid::from_raw)
            .map_err(|_| CtlError::UnknownGroup {
                group: group.to_owned(),
            }),
        Err(e) => Err(CtlError::GroupLookup {
            group: group.to_owned(),
            source: e.into(),
        }),
    }
}

/// The mode of a socket directory kvctld creates: rwx for the owner, and r-x for the
/// group and for others where `socket_mode` lets that class use the socket.
pub fn socket_dir_mode(socket_mode: u32) -> u32 {
    let mut mode = 0o700;
    if socket_mode & 0o060 != 0 {
        mode |= 0o050;
    }
    if socket_mode & 0o006 != 0 {
        mode |= 0o005;
    }
    mode
}

/// Checks what `bind` would need from the host beyond the file: the socket group exists,
/// and nothing but a socket is at the socket's path. (`--check-config` calls it.)
pub fn check_socket_settings(control: &libkv::config::Control) -> Result<(), CtlError> {
    if let Some(group) = &control.socket_group {
        socket_gid(group)?;
    }
    check_socket_path(&control.socket)
}

/// Refuses a path where something other than a socket (or nothing) is: bind would fail on
/// it with "Address already in use", which says nothing of a file in the way.
fn check_socket_path(path: &Path) -> Result<(), CtlError> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    let t = meta.file_type();
    let what = if t.is_socket() {
        return Ok(());
    } else if t.is_file() {
        "a regular file"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "a special file"
    };
    Err(CtlError::NotASocket {
        path: path.to_owned(),
        what,
    })
}

fn set_owner_and_mode(
    path: &Path,
    gid: Option<nix::unistd::Gid>,
    mode: u32,
) -> Result<(), CtlError> {
    let err = |source| CtlError::Permissions {
        path: path.to_owned(),
        source,
    };
    if let Some(gid) = gid {
        nix::unistd::chown(path, None, Some(gid)).map_err(|e| err(e.into()))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(err)
}

/// Creates the socket's directory when it does not exist, with the group of
/// `control.socket_group` and the mode [`socket_dir_mode`] gives; an existing directory is
/// left as it is.
fn create_socket_dir(control: &libkv::config::Control) -> Result<(), CtlError> {
    let gid = control
        .socket_group
        .as_deref()
        .map(socket_gid)
        .transpose()?;
    if let Some(dir) = control
        .socket
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        && !dir.exists()
    {
        std::fs::create_dir_all(dir).map_err(|source| CtlError::SocketDir {
            path: dir.to_owned(),
            source,
        })?;
        set_owner_and_mode(dir, gid, socket_dir_mode(control.socket_mode))?;
    }
    Ok(())
}

/// Binds the control socket at `control.socket` with its mode and group, replacing the
/// socket of a daemon that died but never a live one. The caller holds the lock.
fn bind(control: &libkv::config::Control) -> Result<(UnixListener, BoundSocket), CtlError> {
    let path = control.socket.as_path();
    let gid = control
        .socket_group
        .as_deref()
        .map(socket_gid)
        .transpose()?;
    // A socket left by a daemon that died would make bind fail; a live one is refused, and
    // only a socket is ever removed.
    check_socket_path(path)?;
    if let Ok(meta) = std::fs::symlink_metadata(path)
        && meta.file_type().is_socket()
    {
        let live = socket_is_live(path).map_err(|source| CtlError::Probe {
            path: path.to_owned(),
            source,
        })?;
        if live {
            return Err(CtlError::SocketInUse {
                path: path.to_owned(),
            });
        }
        info!("replacing the stale socket {}", path.display());
        let _ = std::fs::remove_file(path);
    }
    let listener = UnixListener::bind(path).map_err(|source| CtlError::Bind {
        path: path.to_owned(),
        source,
    })?;
    let identity = BoundSocket::of(path).map_err(|source| CtlError::Bind {
        path: path.to_owned(),
        source,
    })?;
    set_owner_and_mode(path, gid, control.socket_mode)?;
    if (!control.allowed_uids.is_empty() || !control.allowed_gids.is_empty())
        && gid.is_none()
        && control.socket_mode & 0o006 == 0
    {
        warn!(
            "control.allowed_uids/allowed_gids list peers, but {} is {:#o} for kvctld's own \
             user and group only: they cannot open it (set control.socket_group to a group \
             they are in, or control.socket_mode = 0o666)",
            path.display(),
            control.socket_mode
        );
    }
    Ok((listener, identity))
}

/// This start's generation: the clock in microseconds, or one past `previous` (the last
/// generation recorded on this socket) when the clock is behind it.
fn next_generation(previous: Option<Generation>) -> Generation {
    let micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    let after = previous.map_or(0, |p| p.0.saturating_add(1));
    Generation(micros.max(after))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generation_never_goes_back_on_one_socket() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("kvctld.sock");
        let mut lock = SocketLock::take(&socket).unwrap();
        assert_eq!(lock.previous, None);
        // the last kvctld recorded a generation ahead of this clock
        let ahead = Generation(next_generation(None).0 + 3_600_000_000);
        lock.record(Some(ahead));
        drop(lock);
        let lock = SocketLock::take(&socket).unwrap();
        assert_eq!(lock.previous, Some(ahead));
        assert_eq!(next_generation(lock.previous), Generation(ahead.0 + 1));
        // behind the clock, the clock wins
        assert!(next_generation(Some(Generation(5))).0 > 5_000_000);
    }

    #[test]
    fn a_file_at_the_socket_path_is_named_not_taken_for_a_socket_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let mut control =
            libkv::config::Config::embedded_default(dir.path().join("kvctld.sock")).control;
        std::fs::write(&control.socket, "notes").unwrap();
        let want = format!(
            "{} exists and is a regular file, not a socket: kvctld replaces only a socket a \
             kvctld left; move it away, or set [control] socket to another path",
            control.socket.display()
        );
        assert_eq!(bind(&control).unwrap_err().to_string(), want);
        assert_eq!(
            check_socket_settings(&control).unwrap_err().to_string(),
            want
        );
        assert_eq!(
            std::fs::read(&control.socket).unwrap(),
            b"notes",
            "the file was touched"
        );
        control.socket = dir.path().join("sub");
        std::fs::create_dir(&control.socket).unwrap();
        assert!(matches!(
            bind(&control),
            Err(CtlError::NotASocket {
                what: "a directory",
                ..
            })
        ));
        // A socket a kvctld left (nothing listens) is still replaced.
        control.socket = dir.path().join("stale.sock");
        drop(UnixListener::bind(&control.socket).unwrap());
        check_socket_settings(&control).unwrap();
        bind(&control).unwrap();
    }
}
