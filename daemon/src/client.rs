//! Client side of the control socket: a blocking connection to kvctld, used by `kvctl`, the
//! demo and the integration tests.
//!
//! A [`Client`] says `Hello { role: Client }` and waits for `HelloAck`, then runs one
//! operation at a time: [`Client::status`] (`StatusQuery` / `StatusReply`: every worker of
//! kvctld with its pool, drain state and requests in flight), [`Client::drain`] (`Drain` /
//! `DrainReply`: keep new requests off one worker, or take it back) or [`Client::generate`]
//! (`Submit`, then `Tokens`* and `Done`, which names the prefill and decode worker that
//! served the request, or `Error`). Every read has a deadline, so a client never hangs on a
//! daemon that stopped answering: the handshake, status and drain wait for the timeout given
//! to [`Client::connect`]; a request waits for its own deadline plus [`REPLY_SLACK`].
//!
//! Every failure is a [`ClientError`], whose [`ClientError::exit_code`] is the exit status
//! `kvctl` returns (see [`exit`]).

use libkv::config::{Config, Deadlines};
use libkv::proto::{
    Done, Drain, ErrorCode, Hello, Message, MsgType, ProtoError, Role, Sampling, StatusQuery,
    StatusReply, Submit, WorkerStatus,
};
use libkv::sys::uds::{FrameReader, UdsError, send_frame};
use libkv::{Generation, RequestId};
use std::fmt;
use std::io;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Time a client waits past a request's deadline before giving up on kvctld: covers the
/// admission wait and kvctld noticing the deadline and answering.
pub const REPLY_SLACK: Duration = Duration::from_secs(5);

/// Exit codes of `kvctl`, one per class of failure. [`ClientError::exit_code`] maps errors
/// onto them.
pub mod exit {
    /// Success.
    pub const OK: u8 = 0;
    /// Bad command line, config file or request (refused before or by kvctld as malformed).
    pub const USAGE: u8 = 1;
    /// kvctld rejected the request for good (admission: too long, too many new tokens).
    /// Retrying the same request cannot succeed.
    pub const REJECTED: u8 = 3;
    /// Temporary: pool full, a deadline passed, or kvctld shutting down. A retry may succeed.
    pub const UNAVAILABLE: u8 = 4;
    /// The request failed inside the stack: verification failed, a worker was lost, an
    /// internal error, or kvctld broke the protocol.
    pub const FAILED: u8 = 5;
    /// Cannot connect to kvctld, or this user is not allowed to.
    pub const CONNECT: u8 = 6;
    /// An output did not match the expected one (the demo's and the probe's check).
    pub const MISMATCH: u8 = 7;
    /// The local stack of the demo could not be started or stopped.
    pub const STACK: u8 = 8;
}

/// Errors of a [`Client`]. Variants name the operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The socket could not be connected (absent, refused, permission denied).
    #[error("connecting to {}", path.display())]
    Connect {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The connection closed or failed during the `Hello` exchange.
    #[error("handshake with kvctld at {}", path.display())]
    Handshake {
        path: PathBuf,
        #[source]
        source: UdsError,
    },
    /// kvctld closed the connection before the `Hello` could be sent, without a reply.
    #[error("kvctld at {} closed the connection before the handshake", path.display())]
    HelloRefused {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The request is malformed; refused before it was sent.
    #[error("invalid request")]
    InvalidRequest(#[source] ProtoError),
    /// Sending a frame failed.
    #[error("sending {msg_type:?} to kvctld")]
    Send {
        msg_type: MsgType,
        #[source]
        source: io::Error,
    },
    /// A frame could not be encoded.
    #[error("encoding a frame")]
    Encode(#[source] ProtoError),
    /// No reply arrived before the deadline.
    #[error("no reply from kvctld within {waited_ms} ms")]
    TimedOut { waited_ms: u128 },
    /// kvctld closed the connection before the reply was complete.
    #[error("kvctld closed the connection while {while_doing}")]
    Closed { while_doing: &'static str },
    /// Receiving a reply failed (an I/O error or an invalid frame).
    #[error("receiving a reply from kvctld")]
    Recv(#[source] UdsError),
    /// kvctld answered with an `Error` frame.
    #[error("kvctld answered {code}: {message}")]
    Server { code: ErrorCode, message: String },
    /// kvctld sent a frame that does not belong here.
    #[error("unexpected {got:?} frame while waiting for {expected}")]
    Unexpected {
        got: MsgType,
        expected: &'static str,
    },
    /// kvctld's replies contradict each other or the protocol.
    #[error("inconsistent reply from kvctld: {reason}")]
    BadReply { reason: String },
    /// An earlier operation failed half-way, so frames may still be in flight on this
    /// connection; connect again.
    #[error("connection unusable after an earlier failure; connect again")]
    Unusable,
    /// The caller abandoned the request while its tokens arrived; the connection is shut
    /// down, so kvctld aborts the request.
    #[error("request abandoned by the caller")]
    Cancelled,
}

impl ClientError {
    /// The `ErrorCode` kvctld answered with, if it did.
    pub fn server_code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Server { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The exit status `kvctl` returns for this error (see [`exit`]).
    pub fn exit_code(&self) -> u8 {
        match self {
            ClientError::Connect { .. }
            | ClientError::Handshake { .. }
            | ClientError::HelloRefused { .. } => exit::CONNECT,
            ClientError::InvalidRequest(_) => exit::USAGE,
            ClientError::TimedOut { .. } => exit::UNAVAILABLE,
            ClientError::Server { code, .. } => match code {
                ErrorCode::Rejected => exit::REJECTED,
                ErrorCode::PoolFull | ErrorCode::Timeout | ErrorCode::ShuttingDown => {
                    exit::UNAVAILABLE
                }
                ErrorCode::VerifyFailed
                | ErrorCode::WorkerLost
                | ErrorCode::Internal
                | ErrorCode::Misconfigured => exit::FAILED,
                ErrorCode::BadRequest => exit::USAGE,
                ErrorCode::Unauthorized => exit::CONNECT,
            },
            ClientError::Send { .. }
            | ClientError::Encode(_)
            | ClientError::Closed { .. }
            | ClientError::Recv(_)
            | ClientError::Unexpected { .. }
            | ClientError::BadReply { .. }
            | ClientError::Unusable
            | ClientError::Cancelled => exit::FAILED,
        }
    }

    /// Whether the same request may succeed if tried again later.
    pub fn is_temporary(&self) -> bool {
        self.exit_code() == exit::UNAVAILABLE
    }
}

/// The prefill and decode worker that served a request, by id (from `Done`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServingPair {
    /// The prefill worker's id; empty if kvctld did not name it.
    pub prefill: String,
    /// The decode worker's id; empty if kvctld did not name it.
    pub decode: String,
}

impl ServingPair {
    /// The pair `Done` names.
    pub fn from_done(done: &Done) -> ServingPair {
        ServingPair {
            prefill: done.prefill_worker.clone(),
            decode: done.decode_worker.clone(),
        }
    }
}

/// `prefill-0 -> decode-1`, with `?` for a worker kvctld did not name.
impl fmt::Display for ServingPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = |id: &str| {
            if id.is_empty() {
                "?".to_owned()
            } else {
                id.to_owned()
            }
        };
        write!(f, "{} -> {}", name(&self.prefill), name(&self.decode))
    }
}

/// A finished request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GenerateOutcome {
    /// The id kvctld gave the request.
    pub request: RequestId,
    /// Every generated token, in order.
    pub tokens: Vec<u32>,
    /// The workers that served it (the same ids as `done.prefill_worker` and
    /// `done.decode_worker`).
    pub pair: ServingPair,
    /// kvctld's `Done`: signature and transfer figures.
    pub done: Done,
}

/// A blocking connection to kvctld.
#[derive(Debug)]
pub struct Client {
    stream: UnixStream,
    reader: FrameReader,
    generation: Generation,
    timeout: Duration,
    default_deadline: Duration,
    broken: bool,
    /// Set by a [`Canceller`] of this client.
    cancelled: Arc<AtomicBool>,
}

/// Abandons a [`Client`]'s request from another thread ([`Client::canceller`]): a client
/// that waits for a long prefill would otherwise learn that its own caller went away only
/// when the first tokens arrive.
#[derive(Debug)]
pub struct Canceller {
    stream: UnixStream,
    cancelled: Arc<AtomicBool>,
}

impl Canceller {
    /// Shuts the client's connection down: kvctld sees it close and aborts the request
    /// (freeing its pages as after any abort), and a [`Client::submit`] waiting for its
    /// output returns [`ClientError::Cancelled`] at once. The client is unusable afterwards.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// Where a client reaches kvctld: its control socket, or over mutual TLS.
#[derive(Clone, Debug)]
pub enum Endpoint {
    Socket(PathBuf),
    Tls(libkv::tls::Connector),
    /// Over TLS to the leader etcd names at each connection (`[election]`).
    Leader(libkv::leader::LeaderLookup, libkv::tls::Connector),
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Socket(path) => write!(f, "{}", path.display()),
            Endpoint::Tls(c) => write!(f, "tls://{}", c.addr()),
            Endpoint::Leader(l, _) => write!(f, "{}", l.place()),
        }
    }
}

impl Endpoint {
    /// Over TLS to the leader when `[election]` is on, over TLS to `[tls] connect` when
    /// that is set, else `[control] socket`.
    pub fn from_config(cfg: &Config) -> Result<Endpoint, ClientError> {
        if let Some(lookup) = libkv::leader::LeaderLookup::from_config(&cfg.election) {
            return libkv::tls::Connector::new(&cfg.tls, String::new())
                .map(|c| Endpoint::Leader(lookup.clone(), c))
                .map_err(|e| ClientError::Connect {
                    path: PathBuf::from(lookup.place()),
                    source: io::Error::other(e),
                });
        }
        match libkv::tls::Connector::from_config(&cfg.tls) {
            Ok(Some(c)) => Ok(Endpoint::Tls(c)),
            Ok(None) => Ok(Endpoint::Socket(cfg.control.socket.clone())),
            Err(e) => Err(ClientError::Connect {
                path: PathBuf::from(format!(
                    "tls://{}",
                    cfg.tls.connect.as_deref().unwrap_or_default()
                )),
                source: io::Error::other(e),
            }),
        }
    }

    /// Connects and says `Hello` ([`Client::connect`], [`Client::connect_tls`]).
    pub fn connect(&self, timeout: Duration) -> Result<Client, ClientError> {
        match self {
            Endpoint::Socket(path) => Client::connect(path, timeout),
            Endpoint::Tls(c) => Client::connect_tls(c, timeout),
            Endpoint::Leader(lookup, c) => {
                let leader = lookup.find().map_err(|e| ClientError::Connect {
                    path: PathBuf::from(lookup.place()),
                    source: io::Error::other(libkv::error_chain(&e)),
                })?;
                Client::connect_tls(&c.to(&leader.addr), timeout)
            }
        }
    }
}

impl Client {
    /// Connects to kvctld at `socket`, says `Hello { role: Client }` and waits for
    /// `HelloAck`. `timeout` bounds the handshake and every later status query.
    pub fn connect(socket: &Path, timeout: Duration) -> Result<Client, ClientError> {
        let stream = connect_within(socket, timeout).map_err(|source| ClientError::Connect {
            path: socket.to_path_buf(),
            source,
        })?;
        Client::handshake(stream, socket, timeout)
    }

    /// Connects to kvctld over mutual TLS (`[tls] connect`), then as [`Client::connect`].
    pub fn connect_tls(
        connector: &libkv::tls::Connector,
        timeout: Duration,
    ) -> Result<Client, ClientError> {
        let place = PathBuf::from(format!("tls://{}", connector.addr()));
        let stream = connector
            .connect(timeout)
            .map_err(|e| ClientError::Connect {
                path: place.clone(),
                source: io::Error::other(e),
            })?;
        Client::handshake(stream, &place, timeout)
    }

    /// Connects where `cfg` says ([`Endpoint::from_config`]).
    pub fn connect_configured(cfg: &Config, timeout: Duration) -> Result<Client, ClientError> {
        Endpoint::from_config(cfg)?.connect(timeout)
    }

    fn handshake(
        stream: UnixStream,
        socket: &Path,
        timeout: Duration,
    ) -> Result<Client, ClientError> {
        let connect_err = |source| ClientError::Connect {
            path: socket.to_path_buf(),
            source,
        };
        // Bounds a send to a kvctld that stopped reading.
        stream
            .set_write_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(connect_err)?;
        let mut client = Client {
            stream,
            reader: FrameReader::new(),
            generation: Generation(0),
            timeout,
            default_deadline: Deadlines::default().request(),
            broken: false,
            cancelled: Arc::default(),
        };
        // kvctld may refuse a peer (SO_PEERCRED) as soon as it connects, answering Error
        // and closing before it reads the Hello: the send then fails, but the Error is
        // still there to read.
        let sent = client.send(&Hello::new(Role::Client).into());
        let handshake = |source| ClientError::Handshake {
            path: socket.to_path_buf(),
            source,
        };
        let frame = client.reader.read_frame(&client.stream, Some(timeout));
        match frame {
            Ok((_, Message::HelloAck(ack), _)) => {
                sent?;
                client.generation = ack.generation;
                Ok(client)
            }
            Ok((_, Message::Error(e), _)) => Err(ClientError::Server {
                code: e.code,
                message: e.message,
            }),
            Ok((_, other, _)) => Err(ClientError::Unexpected {
                got: other.msg_type(),
                expected: "HelloAck",
            }),
            Err(e) => Err(match sent {
                Ok(()) => handshake(e),
                Err(ClientError::Send { source, .. }) => ClientError::HelloRefused {
                    path: socket.to_path_buf(),
                    source,
                },
                Err(other) => other,
            }),
        }
    }

    /// Sets how long a request submitted with `deadline_ms` 0 (kvctld's default) may take
    /// before the client gives up (plus [`REPLY_SLACK`]). Defaults to the default
    /// `[deadlines].request`; set it from the config when kvctld's differs.
    pub fn set_default_deadline(&mut self, deadline: Duration) {
        self.default_deadline = deadline;
    }

    /// kvctld's generation, from `HelloAck`.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// Asks kvctld for its status.
    pub fn status(&mut self) -> Result<StatusReply, ClientError> {
        self.check_usable()?;
        self.send(&StatusQuery {}.into())?;
        let deadline = Instant::now() + self.timeout;
        let result = match self.read_until(deadline, "waiting for StatusReply")? {
            (_, Message::StatusReply(reply)) => Ok(reply),
            (_, Message::Error(e)) => Err(ClientError::Server {
                code: e.code,
                message: e.message,
            }),
            (_, other) => Err(ClientError::Unexpected {
                got: other.msg_type(),
                expected: "StatusReply",
            }),
        };
        if matches!(result, Err(ClientError::Unexpected { .. })) {
            self.broken = true;
        }
        result
    }

    /// Keeps new requests off the worker `worker` (`drain` true) or lets them reach it again
    /// (false), and returns the worker's status as kvctld holds it after the change (a
    /// worker that is stopping stays drained after an undrain). Requests in flight on it finish; [`WorkerStatus::idle`] tells when none is left. An
    /// id that is not 1 to 64 bytes of `[A-Za-z0-9_.@:-]` is refused before sending
    /// ([`ClientError::InvalidRequest`]); one kvctld does not know comes back as its
    /// `Error` ([`ClientError::Server`]).
    pub fn drain(&mut self, worker: &str, drain: bool) -> Result<WorkerStatus, ClientError> {
        self.check_usable()?;
        let msg = Message::from(Drain {
            worker: worker.to_owned(),
            drain,
        });
        msg.validate().map_err(ClientError::InvalidRequest)?;
        self.send(&msg)?;
        let deadline = Instant::now() + self.timeout;
        let result = match self.read_until(deadline, "waiting for DrainReply")? {
            (_, Message::DrainReply(reply)) if reply.worker.id != worker => {
                Err(ClientError::BadReply {
                    reason: format!(
                        "DrainReply for worker {:?} to a Drain of {worker:?}",
                        reply.worker.id
                    ),
                })
            }
            (_, Message::DrainReply(reply)) => Ok(reply.worker),
            (_, Message::Error(e)) => Err(ClientError::Server {
                code: e.code,
                message: e.message,
            }),
            (_, other) => Err(ClientError::Unexpected {
                got: other.msg_type(),
                expected: "DrainReply",
            }),
        };
        if matches!(
            result,
            Err(ClientError::Unexpected { .. } | ClientError::BadReply { .. })
        ) {
            self.broken = true;
        }
        result
    }

    /// Runs one request: submits `prompt` (token ids of the served model) for `tenant`,
    /// decoded greedily, calls `on_tokens` with every batch of tokens as it arrives, and
    /// returns the whole output and the workers that served it once `Done` arrives.
    /// `deadline_ms` 0 takes kvctld's default deadline. An `Error` frame becomes
    /// [`ClientError::Server`]; no reply within the deadline plus [`REPLY_SLACK`] becomes
    /// [`ClientError::TimedOut`].
    pub fn generate(
        &mut self,
        tenant: &str,
        prompt: &[u32],
        max_new_tokens: u32,
        deadline_ms: u32,
        mut on_tokens: impl FnMut(&[u32]),
    ) -> Result<GenerateOutcome, ClientError> {
        let submit = Submit {
            tenant: tenant.to_owned(),
            prompt: prompt.to_vec(),
            max_new_tokens,
            deadline_ms,
            sampling: Sampling::GREEDY,
        };
        self.submit(submit, |t| {
            on_tokens(t);
            true
        })
    }

    /// What abandons this client's request from another thread (see [`Canceller`]).
    pub fn canceller(&self) -> io::Result<Canceller> {
        Ok(Canceller {
            stream: self.stream.try_clone()?,
            cancelled: Arc::clone(&self.cancelled),
        })
    }

    /// Runs the request `submit` as [`Client::generate`] does, with its own sampling. When
    /// `on_tokens` answers `false`, or a [`Canceller`] cancels, the request is abandoned:
    /// the connection is shut down, so kvctld aborts the request and frees its pages, and
    /// the call returns [`ClientError::Cancelled`]; connect again for the next request.
    pub fn submit(
        &mut self,
        submit: Submit,
        mut on_tokens: impl FnMut(&[u32]) -> bool,
    ) -> Result<GenerateOutcome, ClientError> {
        self.check_usable()?;
        let wait = if submit.deadline_ms == 0 {
            self.default_deadline
        } else {
            Duration::from_millis(u64::from(submit.deadline_ms))
        };
        let submit = Message::from(submit);
        submit.validate().map_err(ClientError::InvalidRequest)?;
        self.send(&submit)?;
        let deadline = Instant::now() + wait + REPLY_SLACK;
        let mut result = self.collect(deadline, &mut on_tokens);
        if result.is_err() && self.cancelled.load(Ordering::SeqCst) {
            result = Err(ClientError::Cancelled);
        }
        // After anything but a clean end (Done, or kvctld's Error for the request), frames
        // of this request may still arrive: do not let them answer the next one.
        if matches!(result, Err(ref e) if e.server_code().is_none()) {
            self.broken = true;
        }
        if matches!(result, Err(ClientError::Cancelled)) {
            // kvctld sees the connection close and aborts the request.
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
        }
        result
    }

    fn collect(
        &mut self,
        deadline: Instant,
        on_tokens: &mut impl FnMut(&[u32]) -> bool,
    ) -> Result<GenerateOutcome, ClientError> {
        let mut request: Option<RequestId> = None;
        let mut tokens: Vec<u32> = Vec::new();
        loop {
            let (id, msg) = self.read_until(deadline, "waiting for the request's output")?;
            match msg {
                Message::Error(e) => {
                    return Err(ClientError::Server {
                        code: e.code,
                        message: e.message,
                    });
                }
                Message::Tokens(t) => {
                    check_request_id(&mut request, id, MsgType::Tokens)?;
                    let have = tokens.len();
                    if usize::try_from(t.first_index).ok() != Some(have) {
                        return Err(ClientError::BadReply {
                            reason: format!(
                                "Tokens frame starts at index {} after {have} tokens",
                                t.first_index
                            ),
                        });
                    }
                    tokens.extend_from_slice(&t.tokens);
                    if !on_tokens(&t.tokens) {
                        return Err(ClientError::Cancelled);
                    }
                }
                Message::Done(done) => {
                    let request = check_request_id(&mut request, id, MsgType::Done)?;
                    if usize::try_from(done.tokens).ok() != Some(tokens.len()) {
                        return Err(ClientError::BadReply {
                            reason: format!(
                                "Done reports {} tokens, {} arrived",
                                done.tokens,
                                tokens.len()
                            ),
                        });
                    }
                    return Ok(GenerateOutcome {
                        request,
                        tokens,
                        pair: ServingPair::from_done(&done),
                        done,
                    });
                }
                other => {
                    return Err(ClientError::Unexpected {
                        got: other.msg_type(),
                        expected: "Tokens, Done or Error",
                    });
                }
            }
        }
    }

    fn check_usable(&self) -> Result<(), ClientError> {
        if self.broken {
            return Err(ClientError::Unusable);
        }
        Ok(())
    }

    fn send(&mut self, msg: &Message) -> Result<(), ClientError> {
        let frame = msg.encode(RequestId(0)).map_err(ClientError::Encode)?;
        send_frame(&self.stream, &frame, &[]).map_err(|source| {
            self.broken = true;
            ClientError::Send {
                msg_type: msg.msg_type(),
                source,
            }
        })
    }

    /// Reads the next frame, waiting at most until `deadline`.
    fn read_until(
        &mut self,
        deadline: Instant,
        while_doing: &'static str,
    ) -> Result<(RequestId, Message), ClientError> {
        let start = Instant::now();
        let left = deadline.saturating_duration_since(start);
        let result = if left.is_zero() {
            Err(UdsError::TimedOut { timeout_ms: 0 })
        } else {
            self.reader.read_frame(&self.stream, Some(left))
        };
        match result {
            Ok((header, msg, _fds)) => Ok((header.request_id, msg)),
            Err(e) => {
                self.broken = true;
                Err(match e {
                    UdsError::TimedOut { .. } => ClientError::TimedOut {
                        waited_ms: start.elapsed().as_millis(),
                    },
                    UdsError::Closed => ClientError::Closed { while_doing },
                    other => ClientError::Recv(other),
                })
            }
        }
    }
}

/// Checks that a frame about the request carries its id: non-zero, and the same as earlier
/// frames. Returns the id.
fn check_request_id(
    seen: &mut Option<RequestId>,
    id: RequestId,
    msg_type: MsgType,
) -> Result<RequestId, ClientError> {
    if id == RequestId(0) {
        return Err(ClientError::BadReply {
            reason: format!("{msg_type:?} frame carries request id 0"),
        });
    }
    match *seen {
        Some(prev) if prev != id => Err(ClientError::BadReply {
            reason: format!("{msg_type:?} frame for {id} during {prev}"),
        }),
        _ => {
            *seen = Some(id);
            Ok(id)
        }
    }
}

/// Connects to the Unix socket at `path` without waiting on a full backlog for ever: a
/// kvctld that does not accept leaves the connect answering `EAGAIN`, retried every 10 ms
/// until `timeout` passes. The stream returned is blocking.
pub fn connect_within(path: &Path, timeout: Duration) -> io::Result<UnixStream> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
    use std::os::fd::AsRawFd;
    let addr = UnixAddr::new(path)?;
    let deadline = Instant::now() + timeout;
    loop {
        let fd = socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        match connect(fd.as_raw_fd(), &addr) {
            Ok(()) => {
                let stream = UnixStream::from(fd);
                stream.set_nonblocking(false)?;
                return Ok(stream);
            }
            Err(nix::errno::Errno::EAGAIN) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(nix::errno::Errno::EAGAIN) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "its backlog stayed full for {} ms: kvctld is not accepting connections",
                        timeout.as_millis()
                    ),
                ));
            }
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libkv::proto::{DrainReply, Error, HelloAck, Tokens, Transport};
    use libkv::sys::uds::read_frame_timeout;
    use std::os::unix::net::UnixListener;
    use std::thread;

    fn reply(stream: &UnixStream, id: u64, msg: impl Into<Message>) {
        let frame = msg.into().encode(RequestId(id)).unwrap();
        send_frame(stream, &frame, &[]).unwrap();
    }

    /// A fake kvctld that acks the hello, then runs `script` on the connection.
    fn fake_server(
        script: impl FnOnce(&UnixStream) + Send + 'static,
    ) -> (tempfile::TempDir, PathBuf, thread::JoinHandle<()>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let handle = thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let (_, hello, _) = read_frame_timeout(&stream, Duration::from_secs(5)).unwrap();
            assert!(matches!(hello, Message::Hello(h) if h.role == Role::Client));
            reply(
                &stream,
                0,
                HelloAck {
                    version: 1,
                    generation: Generation(9),
                },
            );
            script(&stream);
        });
        (dir, path, handle)
    }

    fn done(tokens: u32) -> Done {
        Done {
            tokens,
            signature: 0xabc,
            pages_transferred: 1,
            bytes_transferred: 4096,
            elapsed_us: 10,
            prefill_worker: "prefill-1".into(),
            decode_worker: "gpu@host:3".into(),
        }
    }

    fn worker(id: &str, drain: bool, in_flight: u32) -> WorkerStatus {
        WorkerStatus {
            id: id.into(),
            role: Role::Decode,
            connected: true,
            drain,
            in_flight,
            held_pages: 2 * in_flight,
            transports: vec![Transport::Shm],
            served: 4,
            counters: vec![("pulls".into(), 4)],
            pool_pages: 64,
            tokens_per_page: 16,
            free: 64 - 2 * in_flight,
            reserved: 2 * in_flight,
            writing: 0,
            readable: 0,
            draining: 0,
            max_batch: 0,
        }
    }

    #[test]
    fn generate_collects_tokens_and_done() {
        let (_dir, path, server) = fake_server(|s| {
            let (h, msg, _) = read_frame_timeout(s, Duration::from_secs(5)).unwrap();
            assert_eq!(h.request_id, RequestId(0));
            assert!(matches!(msg, Message::Submit(ref m) if m.tenant == "acme"));
            let tokens = |first_index, tokens| Tokens {
                first_index,
                tokens,
            };
            reply(s, 7, tokens(0, vec![104, 105]));
            reply(s, 7, tokens(2, vec![33]));
            reply(s, 7, done(3));
        });
        let mut c = Client::connect(&path, Duration::from_secs(5)).unwrap();
        assert_eq!(c.generation(), Generation(9));
        let mut batches = Vec::new();
        let out = c
            .generate("acme", &libkv::model::tokenize(b"hi!"), 3, 1000, |t| {
                batches.push(t.to_vec())
            })
            .unwrap();
        assert_eq!(out.request, RequestId(7));
        assert_eq!(out.tokens, vec![104, 105, 33]);
        assert_eq!(out.done, done(3));
        assert_eq!(
            out.pair,
            ServingPair {
                prefill: "prefill-1".into(),
                decode: "gpu@host:3".into(),
            }
        );
        assert_eq!(out.pair.to_string(), "prefill-1 -> gpu@host:3");
        assert_eq!(batches, vec![vec![104, 105], vec![33]]);
        server.join().unwrap();
    }

    #[test]
    fn error_frame_is_a_server_error_with_its_exit_code() {
        let (_dir, path, server) = fake_server(|s| {
            read_frame_timeout(s, Duration::from_secs(5)).unwrap();
            reply(
                s,
                0,
                Error {
                    code: ErrorCode::Rejected,
                    message: "prompt of 5000 tokens exceeds max_context 4096".into(),
                },
            );
        });
        let mut c = Client::connect(&path, Duration::from_secs(5)).unwrap();
        let err = c
            .generate("acme", &libkv::model::tokenize(b"x"), 1, 1000, |_| {})
            .unwrap_err();
        assert_eq!(err.server_code(), Some(ErrorCode::Rejected));
        assert_eq!(err.exit_code(), exit::REJECTED);
        assert!(err.to_string().contains("max_context"), "{err}");
        server.join().unwrap();
    }

    #[test]
    fn silent_server_times_out_and_the_client_is_then_unusable() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (_dir, path, server) = fake_server(move |s| {
            read_frame_timeout(s, Duration::from_secs(5)).unwrap();
            // Hold the connection open without answering.
            let _ = rx.recv_timeout(Duration::from_secs(10));
        });
        let mut c = Client::connect(&path, Duration::from_secs(5)).unwrap();
        c.set_default_deadline(Duration::ZERO);
        let start = Instant::now();
        let err = c
            .generate("acme", &libkv::model::tokenize(b"x"), 1, 1, |_| {})
            .unwrap_err();
        assert!(matches!(err, ClientError::TimedOut { .. }), "{err:?}");
        assert!(start.elapsed() < REPLY_SLACK + Duration::from_secs(2));
        assert_eq!(err.exit_code(), exit::UNAVAILABLE);
        assert!(matches!(c.status(), Err(ClientError::Unusable)));
        tx.send(()).unwrap();
        server.join().unwrap();
    }

    #[test]
    fn out_of_order_tokens_and_short_done_are_refused() {
        let (_dir, path, server) = fake_server(|s| {
            read_frame_timeout(s, Duration::from_secs(5)).unwrap();
            reply(
                s,
                3,
                Tokens {
                    first_index: 1,
                    tokens: vec![1],
                },
            );
        });
        let mut c = Client::connect(&path, Duration::from_secs(5)).unwrap();
        let err = c
            .generate("acme", &libkv::model::tokenize(b"x"), 1, 1000, |_| {})
            .unwrap_err();
        assert!(matches!(err, ClientError::BadReply { .. }), "{err:?}");
        server.join().unwrap();

        let (_dir, path, server) = fake_server(|s| {
            read_frame_timeout(s, Duration::from_secs(5)).unwrap();
            reply(s, 3, done(2));
        });
        let mut c = Client::connect(&path, Duration::from_secs(5)).unwrap();
        let err = c
            .generate("acme", &libkv::model::tokenize(b"x"), 2, 1000, |_| {})
            .unwrap_err();
        assert!(matches!(err, ClientError::BadReply { .. }), "{err:?}");
        assert_eq!(err.exit_code(), exit::FAILED);
        server.join().unwrap();
    }

    #[test]
    fn unauthorized_hello_and_missing_socket_map_to_connect_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let err = Client::connect(&path, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, ClientError::Connect { .. }));
        assert_eq!(err.exit_code(), exit::CONNECT);

        let listener = UnixListener::bind(&path).unwrap();
        let server = thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            read_frame_timeout(&s, Duration::from_secs(5)).unwrap();
            reply(
                &s,
                0,
                Error {
                    code: ErrorCode::Unauthorized,
                    message: "uid 65534 is not allowed".into(),
                },
            );
        });
        let err = Client::connect(&path, Duration::from_secs(5)).unwrap_err();
        assert_eq!(err.server_code(), Some(ErrorCode::Unauthorized));
        assert_eq!(err.exit_code(), exit::CONNECT);
        server.join().unwrap();
    }

    #[test]
    fn refusal_sent_before_the_hello_is_read_is_still_seen() {
        // kvctld checks SO_PEERCRED on accept: it answers Error and closes without reading
        // the Hello, before or after it arrived (EPIPE on send, or unread data at close).
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let delays = [0u64, 50, 0, 50];
        let server = thread::spawn(move || {
            for delay_ms in delays {
                let (s, _) = listener.accept().unwrap();
                reply(
                    &s,
                    0,
                    Error {
                        code: ErrorCode::Unauthorized,
                        message: "uid 65534 is not allowed".into(),
                    },
                );
                thread::sleep(Duration::from_millis(delay_ms));
            }
        });
        for _ in delays {
            let err = Client::connect(&path, Duration::from_secs(5)).unwrap_err();
            assert_eq!(err.server_code(), Some(ErrorCode::Unauthorized), "{err:?}");
            assert_eq!(err.exit_code(), exit::CONNECT);
        }
        server.join().unwrap();
    }

    #[test]
    fn invalid_requests_are_refused_before_sending() {
        let (_dir, path, server) = fake_server(|_| {});
        let mut c = Client::connect(&path, Duration::from_secs(5)).unwrap();
        for (tenant, prompt, max_new) in [("a b", &b"x"[..], 1), ("acme", b"", 1), ("t", b"x", 0)] {
            let err = c
                .generate(tenant, &libkv::model::tokenize(prompt), max_new, 0, |_| {})
                .unwrap_err();
            assert!(matches!(err, ClientError::InvalidRequest(_)), "{err:?}");
            assert_eq!(err.exit_code(), exit::USAGE);
        }
        server.join().unwrap();
    }

    #[test]
    fn pair_kvctld_did_not_name_shows_as_question_marks() {
        let (_dir, path, server) = fake_server(|s| {
            read_frame_timeout(s, Duration::from_secs(5)).unwrap();
            reply(
                s,
                5,
                Tokens {
                    first_index: 0,
                    tokens: vec![1],
                },
            );
            reply(
                s,
                5,
                Done {
                    prefill_worker: String::new(),
                    decode_worker: String::new(),
                    ..done(1)
                },
            );
        });
        let mut c = Client::connect(&path, Duration::from_secs(5)).unwrap();
        let out = c
            .generate("acme", &libkv::model::tokenize(b"x"), 1, 1000, |_| {})
            .unwrap();
        assert_eq!(out.pair, ServingPair::default());
        assert_eq!(out.pair.to_string(), "? -> ?");
        server.join().unwrap();
    }

    #[test]
    fn drain_and_undrain_return_the_worker() {
        let (_dir, path, server) = fake_server(|s| {
            for (drain, in_flight) in [(true, 2), (false, 0)] {
                let (h, msg, _) = read_frame_timeout(s, Duration::from_secs(5)).unwrap();
                assert_eq!(h.request_id, RequestId(0));
                match msg {
                    Message::Drain(d) => {
                        assert_eq!(d.worker, "decode-1");
                        assert_eq!(d.drain, drain);
                    }
                    other => panic!("expected Drain, got {other:?}"),
                }
                reply(
                    s,
                    0,
                    DrainReply {
                        worker: worker("decode-1", drain, in_flight),
                    },
                );
            }
            // The connection stays usable for a status query.
            read_frame_timeout(s, Duration::from_secs(5)).unwrap();
            reply(
                s,
                0,
                StatusReply {
                    generation: Generation(9),
                    max_context: 64,
                    max_new_tokens: 16,
                    workers: vec![worker("decode-1", false, 0)],
                    counters: Vec::new(),
                    transport: Some(Transport::Shm),
                    model: None,
                },
            );
        });
        let mut c = Client::connect(&path, Duration::from_secs(5)).unwrap();
        let w = c.drain("decode-1", true).unwrap();
        assert_eq!((w.id.as_str(), w.drain, w.in_flight), ("decode-1", true, 2));
        assert!(!w.idle());
        let w = c.drain("decode-1", false).unwrap();
        assert!(!w.drain && w.idle());
        assert_eq!(
            c.status().unwrap().workers,
            vec![worker("decode-1", false, 0)]
        );
        server.join().unwrap();
    }

    #[test]
    fn drain_of_an_unknown_worker_is_kvctlds_error() {
        let (_dir, path, server) = fake_server(|s| {
            read_frame_timeout(s, Duration::from_secs(5)).unwrap();
            reply(
                s,
                0,
                Error {
                    code: ErrorCode::BadRequest,
                    message: "no worker \"decode-9\"".into(),
                },
            );
        });
        let mut c = Client::connect(&path, Duration::from_secs(5)).unwrap();
        let err = c.drain("decode-9", true).unwrap_err();
        assert_eq!(err.server_code(), Some(ErrorCode::BadRequest));
        assert!(err.to_string().contains("decode-9"), "{err}");
        server.join().unwrap();
    }

    #[test]
    fn drain_reply_for_another_worker_or_another_frame_is_refused() {
        let (_dir, path, server) = fake_server(|s| {
            read_frame_timeout(s, Duration::from_secs(5)).unwrap();
            reply(
                s,
                0,
                DrainReply {
                    worker: worker("decode-0", true, 0),
                },
            );
        });
        let mut c = Client::connect(&path, Duration::from_secs(5)).unwrap();
        let err = c.drain("decode-1", true).unwrap_err();
        assert!(matches!(err, ClientError::BadReply { .. }), "{err:?}");
        assert_eq!(err.exit_code(), exit::FAILED);
        assert!(matches!(
            c.drain("decode-1", true),
            Err(ClientError::Unusable)
        ));
        server.join().unwrap();

        let (_dir, path, server) = fake_server(|s| {
            read_frame_timeout(s, Duration::from_secs(5)).unwrap();
            reply(
                s,
                0,
                Tokens {
                    first_index: 0,
                    tokens: vec![1],
                },
            );
        });
        let mut c = Client::connect(&path, Duration::from_secs(5)).unwrap();
        let err = c.drain("decode-1", false).unwrap_err();
        assert!(
            matches!(
                err,
                ClientError::Unexpected {
                    got: MsgType::Tokens,
                    ..
                }
            ),
            "{err:?}"
        );
        server.join().unwrap();
    }

    #[test]
    fn drain_of_an_invalid_id_is_refused_before_sending() {
        let (_dir, path, server) = fake_server(|_| {});
        let mut c = Client::connect(&path, Duration::from_secs(5)).unwrap();
        let long = "w".repeat(65);
        for id in ["", "a b", "gpu/0", long.as_str()] {
            let err = c.drain(id, true).unwrap_err();
            assert!(
                matches!(err, ClientError::InvalidRequest(_)),
                "{id:?}: {err:?}"
            );
            assert_eq!(err.exit_code(), exit::USAGE);
        }
        // Nothing was sent, so the connection is still good.
        assert!(c.check_usable().is_ok());
        server.join().unwrap();
    }

    #[test]
    fn silent_server_times_out_a_drain() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (_dir, path, server) = fake_server(move |s| {
            read_frame_timeout(s, Duration::from_secs(5)).unwrap();
            let _ = rx.recv_timeout(Duration::from_secs(10));
        });
        let mut c = Client::connect(&path, Duration::from_millis(200)).unwrap();
        let start = Instant::now();
        let err = c.drain("prefill-0", true).unwrap_err();
        assert!(matches!(err, ClientError::TimedOut { .. }), "{err:?}");
        assert!(start.elapsed() < Duration::from_secs(3));
        assert_eq!(err.exit_code(), exit::UNAVAILABLE);
        tx.send(()).unwrap();
        server.join().unwrap();
    }
}
