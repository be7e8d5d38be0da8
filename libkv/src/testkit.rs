//! Test helpers for the workers' unit tests (prefilld and decoded enable the `testkit`
//! feature from their dev-dependencies; no release build has it): a fake kvctld on a Unix
//! socket in a temporary directory, a worker running in-process on a thread, and frame
//! helpers that never wait longer than [`WAIT`].

use crate::config::Config;
use crate::proto::{
    DrainReply, Header, HelloAck, Message, PROTOCOL_VERSION, PoolReport, RegisterAck,
    RegisterWorker, Role, WorkerStatus,
};
use crate::sys::uds::{FrameReader, UdsError, send_frame};
use crate::worker::{RunFn, RunOptions, Shutdown, WorkerError};
use crate::{Generation, Owner, RequestId};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Longest any test waits for one thing.
pub const WAIT: Duration = Duration::from_secs(10);
/// The generation the fake kvctld hands out.
pub const GEN: Generation = Generation(7);

/// A small, fast stack configuration with its socket at `socket`.
pub fn test_config(socket: PathBuf) -> Config {
    let mut cfg = Config::embedded_default(socket);
    cfg.limits.max_context = 256;
    cfg.limits.max_new_tokens = 64;
    cfg.prefill.pool_pages = 64;
    cfg.decode.pool_pages = 64;
    cfg.validate().expect("test config is valid");
    cfg
}

/// The owner of `request` in [`GEN`].
pub fn owner(request: u64) -> Owner {
    Owner {
        request: RequestId(request),
        generation: GEN,
    }
}

/// Polls `done` every 10 ms until it holds, failing the test with `what` after [`WAIT`].
pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A fake kvctld: a listener on a socket in a temporary directory.
#[derive(Debug)]
pub struct FakeKvctld {
    _dir: tempfile::TempDir,
    /// The socket workers connect to.
    pub socket: PathBuf,
    listener: Option<UnixListener>,
}

impl FakeKvctld {
    /// A directory for the socket; `bind` makes it listen.
    pub fn unbound() -> FakeKvctld {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("kvctld.sock");
        FakeKvctld {
            _dir: dir,
            socket,
            listener: None,
        }
    }

    /// A fake kvctld listening on its socket.
    pub fn new() -> FakeKvctld {
        let mut k = FakeKvctld::unbound();
        k.bind();
        k
    }

    /// Starts listening.
    pub fn bind(&mut self) {
        let l = UnixListener::bind(&self.socket).expect("bind");
        l.set_nonblocking(true).expect("nonblocking");
        self.listener = Some(l);
    }

    /// Accepts the next worker connection, failing the test after [`WAIT`].
    pub fn accept(&self) -> Peer {
        let l = self.listener.as_ref().expect("bound");
        let deadline = Instant::now() + WAIT;
        loop {
            match l.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false).expect("blocking");
                    return Peer::new(s);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline, "no worker connected in time");
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("accept: {e}"),
            }
        }
    }
}

impl Default for FakeKvctld {
    fn default() -> Self {
        FakeKvctld::new()
    }
}

/// kvctld's end of one worker connection.
#[derive(Debug)]
pub struct Peer {
    /// The connection.
    pub stream: UnixStream,
    reader: FrameReader,
    /// The latest PoolReport skipped by [`Peer::next_frame`].
    pub report: Option<PoolReport>,
}

impl Peer {
    fn new(stream: UnixStream) -> Peer {
        Peer {
            stream,
            reader: FrameReader::new(),
            report: None,
        }
    }

    /// Sends one frame.
    pub fn send(&self, id: RequestId, msg: impl Into<Message>) {
        self.send_fd(id, msg, None);
    }

    /// Sends one frame with a descriptor attached.
    pub fn send_fd(&self, id: RequestId, msg: impl Into<Message>, fd: Option<&OwnedFd>) {
        let bytes = msg.into().encode(id).expect("encode");
        let fds: Vec<_> = fd.iter().map(|f| f.as_fd()).collect();
        send_frame(&self.stream, &bytes, &fds).expect("send");
    }

    /// The next frame, whatever it is.
    pub fn recv(&mut self) -> (Header, Message, Vec<OwnedFd>) {
        self.reader
            .read_frame(&self.stream, Some(WAIT))
            .expect("a frame from the worker in time")
    }

    /// The next frame that is not a PoolReport (those are kept in `report`).
    pub fn next_frame(&mut self) -> (Header, Message) {
        loop {
            let (h, m, _) = self.recv();
            match m {
                Message::PoolReport(r) => self.report = Some(r),
                m => return (h, m),
            }
        }
    }

    /// The next PoolReport (skipping nothing else: other frames fail the test).
    pub fn pool_report(&mut self) -> PoolReport {
        match self.recv() {
            (_, Message::PoolReport(r), _) => {
                self.report = Some(r.clone());
                r
            }
            (h, m, _) => panic!("expected a PoolReport, got {m:?} for {}", h.request_id),
        }
    }

    /// Hello / HelloAck, then the worker's RegisterWorker (not answered yet).
    pub fn hello(&mut self) -> (RegisterWorker, Option<OwnedFd>) {
        let (_, hello, _) = self.recv();
        let Message::Hello(hello) = hello else {
            panic!("expected Hello, got {hello:?}");
        };
        assert_eq!(hello.negotiate(), Some(PROTOCOL_VERSION));
        self.send(
            RequestId(0),
            HelloAck {
                version: PROTOCOL_VERSION,
                generation: GEN,
            },
        );
        let (_, reg, mut fds) = self.recv();
        let Message::RegisterWorker(reg) = reg else {
            panic!("expected RegisterWorker, got {reg:?}");
        };
        assert_eq!(reg.role, hello.role);
        (reg, fds.pop())
    }

    /// Hello / HelloAck, RegisterWorker / RegisterAck, then the first PoolReport.
    pub fn handshake(&mut self, cfg: &Config) -> (RegisterWorker, Option<OwnedFd>) {
        let (reg, fd) = self.hello();
        self.send(
            RequestId(0),
            RegisterAck {
                generation: GEN,
                max_context: cfg.limits.max_context,
                max_new_tokens: cfg.limits.max_new_tokens,
            },
        );
        let report = self.pool_report();
        let pages = match reg.role {
            Role::Prefill => cfg.prefill.pool_pages,
            _ => cfg.decode.pool_pages,
        };
        assert_eq!(report.free, pages, "registered with an empty pool");
        (reg, fd)
    }

    /// Waits for the worker to close the connection.
    pub fn expect_closed(&mut self) {
        loop {
            match self.reader.read_frame(&self.stream, Some(WAIT)) {
                Ok((_, Message::PoolReport(_) | Message::Freed(_), _)) => {}
                Ok((_, m, _)) => panic!("expected the connection to close, got {m:?}"),
                Err(UdsError::Closed) => return,
                // Closed with our last frames unread.
                Err(UdsError::Recv(e)) if e.kind() == io::ErrorKind::ConnectionReset => return,
                Err(e) => panic!("expected the connection to close: {e}"),
            }
        }
    }
}

/// A counter out of a PoolReport.
pub fn counter(report: &PoolReport, name: &str) -> u64 {
    report
        .counters
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| *v)
        .unwrap_or_else(|| panic!("no counter {name}"))
}

/// kvctld's `DrainReply` to the worker that registered with `reg`: drained and idle.
pub fn drain_reply(reg: &RegisterWorker) -> DrainReply {
    DrainReply {
        worker: WorkerStatus {
            id: reg.id.clone(),
            role: reg.role,
            connected: true,
            drain: true,
            in_flight: 0,
            held_pages: 0,
            transports: reg.transports.clone(),
            served: 0,
            counters: Vec::new(),
            pool_pages: reg.pool_pages,
            tokens_per_page: reg.geometry.tokens_per_page,
            free: reg.pool_pages,
            reserved: 0,
            writing: 0,
            readable: 0,
            draining: 0,
            max_batch: reg.max_batch,
        },
    }
}

/// A worker running in-process on a thread, without signal handlers. Dropping it stops the
/// worker at once.
#[derive(Debug)]
pub struct Daemon {
    shutdown: Shutdown,
    done: mpsc::Receiver<Result<(), WorkerError>>,
}

impl Daemon {
    /// Runs `run` (prefilld's or decoded's) with `cfg` on a new thread.
    pub fn start(run: RunFn, cfg: Config) -> Daemon {
        let shutdown = Shutdown::new();
        let opts = RunOptions {
            handle_signals: false,
            shutdown: shutdown.clone(),
            model: None,
        };
        let (tx, done) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(run(cfg, opts));
        });
        Daemon { shutdown, done }
    }

    /// Asks the worker to stop as SIGTERM does (it drains first while registered).
    pub fn request_stop(&self) {
        self.shutdown.request();
    }

    /// Stops the worker at once (no drain) and waits (bounded) for `run` to return.
    pub fn stop(self) -> Result<(), WorkerError> {
        self.shutdown.request_now();
        self.wait()
    }

    /// Waits up to [`WAIT`] for `run` to return by itself.
    pub fn wait(self) -> Result<(), WorkerError> {
        self.done
            .recv_timeout(WAIT)
            .expect("the worker stopped in time")
    }

    /// `run`'s result if it has returned, without waiting.
    pub fn try_result(&self) -> Option<Result<(), WorkerError>> {
        self.done.try_recv().ok()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.shutdown.request_now();
    }
}
