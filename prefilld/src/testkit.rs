//! Test helpers shared by prefilld's and decoded's unit tests (decoded compiles this file with
//! `#[path]`): a fake kvctld on a Unix socket in a temporary directory, a worker running
//! in-process on a thread, and frame helpers that never wait longer than [`WAIT`].

use crate::{RunOptions, Shutdown, WorkerError};
use libkv::config::Config;
use libkv::proto::{Header, HelloAck, Message, PoolReport, RegisterAck, RegisterWorker, Role};
use libkv::sys::uds::{FrameReader, send_frame};
use libkv::{Generation, Owner, RequestId};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Longest any test waits for one thing.
pub(crate) const WAIT: Duration = Duration::from_secs(10);
/// The generation the fake kvctld hands out.
pub(crate) const GEN: Generation = Generation(7);

/// A small, fast stack configuration with its socket in `dir`.
pub(crate) fn test_config(socket: PathBuf) -> Config {
    let mut cfg = Config::embedded_default(socket);
    cfg.limits.max_context = 256;
    cfg.limits.max_new_tokens = 64;
    cfg.prefill.pool_pages = 64;
    cfg.decode.pool_pages = 64;
    cfg.validate().expect("test config is valid");
    cfg
}

pub(crate) fn owner(request: u64) -> Owner {
    Owner {
        request: RequestId(request),
        generation: GEN,
    }
}

/// A fake kvctld: a listener on a socket in a temporary directory.
#[derive(Debug)]
pub(crate) struct FakeKvctld {
    _dir: tempfile::TempDir,
    pub socket: PathBuf,
    listener: Option<UnixListener>,
}

impl FakeKvctld {
    /// A directory for the socket; `bind` makes it listen.
    pub(crate) fn unbound() -> FakeKvctld {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("kvctld.sock");
        FakeKvctld {
            _dir: dir,
            socket,
            listener: None,
        }
    }

    pub(crate) fn new() -> FakeKvctld {
        let mut k = FakeKvctld::unbound();
        k.bind();
        k
    }

    pub(crate) fn bind(&mut self) {
        let l = UnixListener::bind(&self.socket).expect("bind");
        l.set_nonblocking(true).expect("nonblocking");
        self.listener = Some(l);
    }

    /// Accepts the next worker connection, failing the test after [`WAIT`].
    pub(crate) fn accept(&self) -> Peer {
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

/// kvctld's end of one worker connection.
#[derive(Debug)]
pub(crate) struct Peer {
    pub stream: UnixStream,
    reader: FrameReader,
    /// The latest PoolReport skipped by [`Peer::next`].
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

    pub(crate) fn send(&self, id: RequestId, msg: impl Into<Message>) {
        self.send_fd(id, msg, None);
    }

    pub(crate) fn send_fd(&self, id: RequestId, msg: impl Into<Message>, fd: Option<&OwnedFd>) {
        let bytes = msg.into().encode(id).expect("encode");
        let fds: Vec<_> = fd.iter().map(|f| f.as_fd()).collect();
        send_frame(&self.stream, &bytes, &fds).expect("send");
    }

    /// The next frame, whatever it is.
    pub(crate) fn recv(&mut self) -> (Header, Message, Vec<OwnedFd>) {
        self.reader
            .read_frame(&self.stream, Some(WAIT))
            .expect("a frame from the worker in time")
    }

    /// The next frame that is not a PoolReport (those are kept in `report`).
    pub(crate) fn next(&mut self) -> (Header, Message) {
        loop {
            let (h, m, _) = self.recv();
            match m {
                Message::PoolReport(r) => self.report = Some(r),
                m => return (h, m),
            }
        }
    }

    /// The next PoolReport (skipping nothing else: other frames fail the test).
    pub(crate) fn pool_report(&mut self) -> PoolReport {
        match self.recv() {
            (_, Message::PoolReport(r), _) => {
                self.report = Some(r.clone());
                r
            }
            (h, m, _) => panic!("expected a PoolReport, got {m:?} for {}", h.request_id),
        }
    }

    /// Hello / HelloAck, RegisterWorker / RegisterAck, then the first PoolReport.
    pub(crate) fn handshake(&mut self, cfg: &Config) -> (RegisterWorker, Option<OwnedFd>) {
        let (_, hello, _) = self.recv();
        let Message::Hello(hello) = hello else {
            panic!("expected Hello, got {hello:?}");
        };
        assert_eq!(hello.negotiate(), Some(libkv::proto::PROTOCOL_VERSION));
        self.send(
            RequestId(0),
            HelloAck {
                version: libkv::proto::PROTOCOL_VERSION,
                generation: GEN,
            },
        );
        let (_, reg, mut fds) = self.recv();
        let Message::RegisterWorker(reg) = reg else {
            panic!("expected RegisterWorker, got {reg:?}");
        };
        assert_eq!(reg.role, hello.role);
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
        (reg, fds.pop())
    }

    /// Waits for the worker to close the connection.
    pub(crate) fn expect_closed(&mut self) {
        loop {
            match self.reader.read_frame(&self.stream, Some(WAIT)) {
                Ok((_, Message::PoolReport(_) | Message::Freed(_), _)) => {}
                Ok((_, m, _)) => panic!("expected the connection to close, got {m:?}"),
                Err(libkv::sys::uds::UdsError::Closed) => return,
                // Closed with our last frames unread.
                Err(libkv::sys::uds::UdsError::Recv(e))
                    if e.kind() == io::ErrorKind::ConnectionReset =>
                {
                    return;
                }
                Err(e) => panic!("expected the connection to close: {e}"),
            }
        }
    }
}

/// A counter out of a PoolReport.
pub(crate) fn counter(report: &PoolReport, name: &str) -> u64 {
    report
        .counters
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| *v)
        .unwrap_or_else(|| panic!("no counter {name}"))
}

/// This crate's worker running in-process on a thread.
#[derive(Debug)]
pub(crate) struct Daemon {
    shutdown: Shutdown,
    done: mpsc::Receiver<Result<(), WorkerError>>,
}

impl Daemon {
    pub(crate) fn start(cfg: Config) -> Daemon {
        let shutdown = Shutdown::new();
        let opts = RunOptions {
            handle_signals: false,
            shutdown: shutdown.clone(),
        };
        let (tx, done) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(crate::run(cfg, opts));
        });
        Daemon { shutdown, done }
    }

    /// Requests a stop and waits (bounded) for `run` to return.
    pub(crate) fn stop(self) -> Result<(), WorkerError> {
        self.shutdown.request();
        self.done
            .recv_timeout(WAIT)
            .expect("the worker stopped in time")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.shutdown.request();
    }
}
