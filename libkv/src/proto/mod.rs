//! Wire protocol spoken on the kvfence Unix socket by kvctld, prefilld, decoded and kvctl.
//!
//! Every peer is untrusted. A frame is a fixed 24-byte little-endian header followed by a
//! postcard-encoded body of at most [`MAX_BODY_LEN`] bytes. Some message types also carry
//! file descriptors (SCM_RIGHTS) attached to the first byte of their frame; see
//! [`allowed_fds`] and [`crate::sys::uds`].
//!
//! # Frame layout
//!
//! ```text
//! offset  size  field       value
//! ------  ----  ----------  ---------------------------------------------------------------
//!      0     4  magic       0x4346_564B (the bytes "KVFC" on the wire)
//!      4     2  version     PROTOCOL_VERSION (4)
//!      6     2  msg_type    MsgType; 0 (Invalid) is never valid on the wire
//!      8     2  flags       all bits reserved, must be 0
//!     10     2  reserved    must be 0
//!     12     4  body_len    bytes of body that follow, <= MAX_BODY_LEN (1 MiB)
//!     16     8  request_id  the RequestId the frame concerns; 0 when none
//!     24     n  body        postcard encoding of the body struct of msg_type, no trailing bytes
//! ```
//!
//! All integers of the header are little-endian. In bodies, postcard writes integers as
//! varints, strings and vectors as a varint length then their elements, enums as a varint
//! variant index (in declaration order), except [`ErrorCode`], which is its `u16` value.
//!
//! # Validation layers
//!
//! A receiver refuses a frame at the first layer that fails, each with its own
//! [`ProtoError`] variant, and before anything touches a pool:
//!
//! 1. header: magic, version, flags and reserved field, message type ([`Header::parse`]);
//! 2. length: `body_len` against [`MAX_BODY_LEN`], before any byte of body is buffered;
//! 3. body: postcard decoding of exactly `body_len` bytes ([`Message::decode`]);
//! 4. file descriptors: the count allowed for the type ([`allowed_fds`]), then the exact
//!    count for the message ([`Message::check_fds`]);
//! 5. semantics: lengths, charsets and ranges ([`Message::validate`]).
//!
//! Checks that need daemon state (page ids inside a pool, owners that exist, the
//! connection's role) come after, in the daemons.
//!
//! # Sequence of one request
//!
//! Every connection starts with `Hello` / `HelloAck` (version negotiation, kvctld's
//! generation). Workers then send `RegisterWorker` (a prefill worker attaches its pool
//! memfd) and get `RegisterAck`. A request then runs:
//!
//! ```text
//! kvctl                 kvctld                         decoded               prefilld
//!   | Submit (id 0) ---->|                                |                      |
//!   |                    | admission: need() + ledger, both pools or neither;    |
//!   |                    |   a decode slot (RegisterWorker.max_batch) free;      |
//!   |<-- Error(Rejected) |   a rejected request ends here: no worker hears of it |
//!   |                    |-- DecodeReserve(owner) ------->|                      |
//!   |                    |<--------- DecodeReserved ------|                      |
//!   |                    |-- PrefillRun(owner, prompt) ------------------------->|
//!   |                    |<------------------------ PrefillDone(manifest) -------|
//!   |                    |-- PullKv(manifest) ----------->|                      |
//!   |                    |         decoded copies the manifest's pages from the
//!   |                    |         prefill pool (read-only, from PrefillPool) into
//!   |                    |         its own reservation, then verifies coverage and
//!   |                    |         the crc32c of every page before any attention
//!   |                    |<------------- PullDone(owner) -|                      |
//!   |                    |-- Release(owner) ------------------------------------>|
//!   |                    |<------------------------------ Freed(owner) ----------|
//!   |<-- Tokens ---------|<------------- Tokens ----------|                      |
//!   |<-- Done -----------|<------------- Done ------------|                      |
//!   |                    |<------------- Freed(owner) ----|                      |
//! ```
//!
//! # Pulling over TCP
//!
//! With `[transfer] transport = "tcp"` prefilld attaches no fd to `RegisterWorker`; it names
//! its page server instead (a [`TcpEndpoint`]: address and a random token), and kvctld hands
//! decoded a `PrefillEndpoint` instead of `PrefillPool`. Decode still pulls: for `PullKv` it
//! connects to the page server (kvfence frames on the TCP stream, the same header) and asks
//! for the manifest's pages:
//!
//! ```text
//! decoded                                    prefilld page server
//!   | PageRequest(token, owner, pages) ------->| token, owner held, every page in the
//!   |                                          | owner's manifest, or Error and close
//!   |<-- PageData(owner, 0, len) + len bytes --|  pages 0.. as whole pages, up to 1 MiB
//!   |<-- PageData(owner, k, len) + len bytes --|  ... the next ones, in order
//! ```
//!
//! The page bytes follow their `PageData` frame raw (a page can be larger than
//! [`MAX_BODY_LEN`]); decoded checks owner, index and `len` (whole pages, none past the
//! request's end) before reading them straight into its own reservation's pages with one
//! vectored read, then verifies as on shared memory.
//!
//! Frames about a request carry its [`RequestId`] in the header; the client's `Submit`
//! carries 0 and kvctld answers with the id it assigned. Every stage has a deadline. On
//! failure kvctld sends `Error` to the client and `Abort` to each worker told of the owner.
//! A worker sends exactly one `Freed` per owner it was told of by `DecodeReserve` or
//! `PrefillRun` (0 pages when it reserved none), and only once no writer can touch the
//! pages: kvctld lends ledger pages back on `Freed`, never earlier. Workers send
//! `PoolReport` when their page counts change; `StatusQuery` / `StatusReply` serve kvctl.

mod control;
mod pages;
#[cfg(test)]
mod tests;

pub use control::*;
pub use pages::*;

use crate::geometry::PageGeometry;
use crate::ids::{PageId, RequestId};
use crate::verify::Manifest;
use std::collections::HashSet;
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// `magic` of every frame: the bytes "KVFC" read as a little-endian `u32`.
pub const MAGIC: u32 = 0x4346_564B;
/// The only protocol version this build speaks. 4: `RegisterWorker` and `WorkerStatus`
/// carry a decode worker's batch slots (`max_batch`).
pub const PROTOCOL_VERSION: u16 = 4;
/// Bytes of the fixed frame header.
pub const HEADER_LEN: usize = 24;
/// Largest body a frame may carry (1 MiB). Checked from the header before any allocation.
pub const MAX_BODY_LEN: u32 = 1 << 20;
/// Largest whole frame: header plus the largest body.
pub const MAX_FRAME_LEN: usize = HEADER_LEN + MAX_BODY_LEN as usize;
/// Most file descriptors any message type carries.
pub const MAX_FDS_PER_FRAME: usize = 1;

/// Most prompt tokens in `Submit` and `PrefillRun` (128 Ki): at most 640 KiB encoded (5-byte
/// varints), under [`MAX_BODY_LEN`]. It bounds `[limits] max_context`.
pub const MAX_PROMPT_TOKENS: usize = 128 * 1024;
/// Largest tenant name; tenants are 1 or more of `[A-Za-z0-9_.-]`.
pub const MAX_TENANT_BYTES: usize = 64;
/// Largest free text (`Error::message`, `Abort::reason`).
pub const MAX_TEXT_BYTES: usize = 4096;
/// Most pages in one manifest. Worst case encoding (5-byte varints for every page id and
/// digest) is about 640 KiB, under [`MAX_BODY_LEN`].
pub const MAX_MANIFEST_PAGES: usize = 1 << 16;
/// Most tokens in one `Tokens` frame (at most 320 KiB encoded).
pub const MAX_TOKENS_PER_FRAME: usize = 1 << 16;
/// Most workers in a `StatusReply`.
pub const MAX_WORKERS: usize = 1024;
/// Most batch slots a decode worker registers (`RegisterWorker::max_batch`).
pub const MAX_BATCH: u32 = 256;
/// Most counters in a `StatusReply`.
pub const MAX_COUNTERS: usize = 256;
/// Longest counter name in a `StatusReply`.
pub const MAX_COUNTER_NAME_BYTES: usize = 128;

/// Errors of decoding, encoding and validating frames. Every peer is untrusted: each
/// failure has its own variant, carrying the numbers that made it fail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// Layer 1: the frame does not start with [`MAGIC`].
    #[error("bad magic {got:#010x}, expected {MAGIC:#010x}")]
    BadMagic { got: u32 },
    /// Layer 1: a protocol version this build does not speak.
    #[error("unsupported protocol version {got}, this build speaks {supported}")]
    BadVersion { got: u16, supported: u16 },
    /// Layer 1: a reserved header bit or field is not zero.
    #[error("reserved header bits set: flags {flags:#06x}, reserved {reserved:#06x}")]
    ReservedBits { flags: u16, reserved: u16 },
    /// Layer 1: a message type this build does not know.
    #[error("unknown message type {got}")]
    UnknownType { got: u16 },
    /// Layer 1: message type 0, which is never valid on the wire.
    #[error("message type 0 (Invalid)")]
    InvalidType,
    /// Layer 2: a body longer than the maximum (checked before allocating).
    #[error("body of {len} bytes exceeds the maximum of {max}")]
    Oversized { len: usize, max: usize },
    /// Fewer bytes than the header or its `body_len` announce.
    #[error("truncated frame: need {need} bytes, got {got}")]
    Truncated { need: usize, got: usize },
    /// Layer 3: the body does not decode as the body of its type.
    #[error("undecodable {msg_type:?} body: {reason}")]
    BadBody { msg_type: MsgType, reason: String },
    /// Layer 3: bytes left over after the body decoded.
    #[error("{extra} trailing bytes after the {msg_type:?} body")]
    TrailingBytes { msg_type: MsgType, extra: usize },
    /// Layer 4: a message arrived with the wrong number of file descriptors.
    #[error("{msg_type:?} carries {expected} file descriptors, got {got}")]
    BadFds {
        msg_type: MsgType,
        expected: usize,
        got: usize,
    },
    /// Layer 5: the body decoded but breaks a semantic limit.
    #[error("invalid {msg_type:?}: {reason}")]
    Invalid { msg_type: MsgType, reason: String },
    /// Sender side: the body could not be serialized.
    #[error("encoding a {msg_type:?} body: {reason}")]
    Encode { msg_type: MsgType, reason: String },
}

impl ProtoError {
    /// Whether the connection must be dropped. Always true: a peer that sends one bad frame
    /// is not trusted with the next, and the stream may have lost its framing.
    pub fn is_fatal(&self) -> bool {
        true
    }

    /// Whether to send the peer an [`Error`] frame (see [`ProtoError::reply`]) before
    /// disconnecting: only when the header showed it speaks this protocol and the
    /// connection can still carry a reply.
    pub fn should_reply(&self) -> bool {
        match self {
            ProtoError::BadMagic { .. } | ProtoError::Truncated { .. } => false,
            ProtoError::Encode { .. } => false,
            ProtoError::BadVersion { .. }
            | ProtoError::ReservedBits { .. }
            | ProtoError::UnknownType { .. }
            | ProtoError::InvalidType
            | ProtoError::Oversized { .. }
            | ProtoError::BadBody { .. }
            | ProtoError::TrailingBytes { .. }
            | ProtoError::BadFds { .. }
            | ProtoError::Invalid { .. } => true,
        }
    }

    /// The [`Error`] frame to send the peer, if [`ProtoError::should_reply`].
    pub fn reply(&self) -> Option<Error> {
        self.should_reply().then(|| Error {
            code: ErrorCode::BadRequest,
            message: truncate_text(&self.to_string(), MAX_TEXT_BYTES),
        })
    }
}

/// Cuts `s` to at most `max` bytes on a character boundary.
fn truncate_text(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// The header as it lies on the wire. Use [`Header`] for a validated one.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned,
)]
#[repr(C)]
pub struct RawHeader {
    pub magic: U32,
    pub version: U16,
    pub msg_type: U16,
    pub flags: U16,
    pub reserved: U16,
    pub body_len: U32,
    pub request_id: U64,
}

const _: () = assert!(size_of::<RawHeader>() == HEADER_LEN);

/// A header that passed layers 1 and 2: known type, body no longer than [`MAX_BODY_LEN`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub msg_type: MsgType,
    pub body_len: u32,
    pub request_id: RequestId,
}

impl Header {
    /// Parses and validates the header at the start of `bytes` (layers 1 and 2). Bytes past
    /// the first [`HEADER_LEN`] are ignored.
    pub fn parse(bytes: &[u8]) -> Result<Header, ProtoError> {
        let (raw, _) = RawHeader::read_from_prefix(bytes).map_err(|_| ProtoError::Truncated {
            need: HEADER_LEN,
            got: bytes.len(),
        })?;
        let magic = raw.magic.get();
        if magic != MAGIC {
            return Err(ProtoError::BadMagic { got: magic });
        }
        let version = raw.version.get();
        if version != PROTOCOL_VERSION {
            return Err(ProtoError::BadVersion {
                got: version,
                supported: PROTOCOL_VERSION,
            });
        }
        let (flags, reserved) = (raw.flags.get(), raw.reserved.get());
        if flags != 0 || reserved != 0 {
            return Err(ProtoError::ReservedBits { flags, reserved });
        }
        let msg_type = MsgType::try_from(raw.msg_type.get())?;
        let body_len = raw.body_len.get();
        check_body_len(body_len_usize(body_len))?;
        Ok(Header {
            msg_type,
            body_len,
            request_id: RequestId(raw.request_id.get()),
        })
    }

    /// The wire form of this header.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let raw = RawHeader {
            magic: U32::new(MAGIC),
            version: U16::new(PROTOCOL_VERSION),
            msg_type: U16::new(self.msg_type as u16),
            flags: U16::new(0),
            reserved: U16::new(0),
            body_len: U32::new(self.body_len),
            request_id: U64::new(self.request_id.0),
        };
        let mut out = [0u8; HEADER_LEN];
        out.copy_from_slice(raw.as_bytes());
        out
    }

    /// Body length in bytes.
    pub fn body_len(&self) -> usize {
        body_len_usize(self.body_len)
    }

    /// Header plus body, in bytes.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.body_len()
    }
}

fn body_len_usize(len: u32) -> usize {
    // A u32 always fits a usize on the 32- and 64-bit targets kvfence supports.
    usize::try_from(len).unwrap_or(usize::MAX)
}

fn check_body_len(len: usize) -> Result<(), ProtoError> {
    let max = body_len_usize(MAX_BODY_LEN);
    if len > max {
        return Err(ProtoError::Oversized { len, max });
    }
    Ok(())
}

macro_rules! msg_types {
    ($($(#[$doc:meta])* $name:ident = $value:literal,)*) => {
        /// Message type in the header. 0 is reserved and never valid on the wire.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u16)]
        pub enum MsgType {
            /// Never valid on the wire.
            Invalid = 0,
            $($(#[$doc])* $name = $value,)*
        }

        impl TryFrom<u16> for MsgType {
            type Error = ProtoError;

            fn try_from(v: u16) -> Result<MsgType, ProtoError> {
                match v {
                    0 => Err(ProtoError::InvalidType),
                    $($value => Ok(MsgType::$name),)*
                    got => Err(ProtoError::UnknownType { got }),
                }
            }
        }

        /// A decoded body, one variant per [`MsgType`] but `Invalid`.
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub enum Message {
            $($(#[$doc])* $name($name),)*
        }

        impl Message {
            /// The type of this message.
            pub fn msg_type(&self) -> MsgType {
                match self {
                    $(Message::$name(_) => MsgType::$name,)*
                }
            }

            fn encode_body(&self, frame: Vec<u8>) -> Result<Vec<u8>, postcard::Error> {
                match self {
                    $(Message::$name(m) => postcard::to_extend(m, frame),)*
                }
            }

            fn decode_body(msg_type: MsgType, body: &[u8]) -> Result<Message, ProtoError> {
                match msg_type {
                    MsgType::Invalid => Err(ProtoError::InvalidType),
                    $(MsgType::$name => take_body(msg_type, body).map(Message::$name),)*
                }
            }
        }

        $(impl From<$name> for Message {
            fn from(m: $name) -> Message {
                Message::$name(m)
            }
        })*
    };
}

msg_types! {
    /// Any peer to kvctld: first frame of every connection.
    Hello = 1,
    /// kvctld to peer: the negotiated version and kvctld's generation.
    HelloAck = 2,
    /// Worker to kvctld: role, geometry and pool; a prefill worker attaches its pool memfd.
    RegisterWorker = 3,
    /// kvctld to worker: registration accepted.
    RegisterAck = 4,
    /// Client to kvctld: run one request.
    Submit = 5,
    /// Decode worker to kvctld, and kvctld to client: generated tokens.
    Tokens = 6,
    /// Decode worker to kvctld, and kvctld to client: request finished.
    Done = 7,
    /// kvctld to client: request failed, or a frame was refused.
    Error = 8,
    /// Client to kvctld: ask for status.
    StatusQuery = 9,
    /// kvctld to client: status.
    StatusReply = 10,
    /// kvctld to decode worker: reserve pages for a request.
    DecodeReserve = 11,
    /// Decode worker to kvctld: pages reserved.
    DecodeReserved = 12,
    /// kvctld to prefill worker: run prefill for a request.
    PrefillRun = 13,
    /// Prefill worker to kvctld: prefill done, pages described by the manifest.
    PrefillDone = 14,
    /// kvctld to decode worker: the prefill pool to pull from; attaches its memfd.
    PrefillPool = 15,
    /// kvctld to decode worker: pull and verify the pages of a manifest.
    PullKv = 16,
    /// Decode worker to kvctld: pages pulled and verified.
    PullDone = 17,
    /// kvctld to worker: free the pages of an owner.
    Release = 18,
    /// kvctld to worker: abandon the request of an owner and free its pages.
    Abort = 19,
    /// Worker to kvctld: page counts by ownership state.
    PoolReport = 20,
    /// Worker to kvctld: the pages of an owner are back on the free list (no writer left).
    Freed = 21,
    /// kvctld to decode worker: the prefill page server to pull from over TCP.
    PrefillEndpoint = 22,
    /// Decode worker to prefill page server (TCP): send these pages of an owner.
    PageRequest = 23,
    /// Prefill page server to decode worker (TCP): one page follows, `len` raw bytes.
    PageData = 24,
    /// Decode worker to prefill page server and back (TCP): the QP each side reads or is
    /// read through; the connection then carries an RDMA session.
    RdmaConnect = 25,
    /// Prefill page server to decode worker (RDMA session): the windows over a request's
    /// pages, one per run of consecutive pages.
    RdmaWindows = 26,
    /// Decode worker to prefill page server (RDMA session): the reads of an owner are done;
    /// its windows may be invalidated.
    RdmaReadDone = 27,
    /// kvctld to decode worker: a prefill worker is gone; forget its pool or page server.
    PrefillGone = 28,
    /// Client to kvctld: stop (or resume) sending new requests to a worker. A worker sends
    /// it for itself when it is asked to stop.
    Drain = 29,
    /// kvctld to client: the drained worker's status.
    DrainReply = 30,
}

/// How many file descriptors a frame of `msg_type` may carry: 1 for `RegisterWorker` and
/// `PrefillPool`, 0 for every other type. [`Message::fd_count`] gives the exact count.
pub fn allowed_fds(msg_type: MsgType) -> usize {
    match msg_type {
        MsgType::RegisterWorker | MsgType::PrefillPool => 1,
        _ => 0,
    }
}

fn take_body<T: serde::de::DeserializeOwned>(
    msg_type: MsgType,
    body: &[u8],
) -> Result<T, ProtoError> {
    match postcard::take_from_bytes::<T>(body) {
        Ok((value, [])) => Ok(value),
        Ok((_, rest)) => Err(ProtoError::TrailingBytes {
            msg_type,
            extra: rest.len(),
        }),
        Err(e) => Err(ProtoError::BadBody {
            msg_type,
            reason: e.to_string(),
        }),
    }
}

impl Message {
    /// Encodes header and body into one frame. Refuses a body over [`MAX_BODY_LEN`]. Does
    /// not run [`Message::validate`]; senders may.
    pub fn encode(&self, request_id: RequestId) -> Result<Vec<u8>, ProtoError> {
        let msg_type = self.msg_type();
        let mut frame =
            self.encode_body(vec![0u8; HEADER_LEN])
                .map_err(|e| ProtoError::Encode {
                    msg_type,
                    reason: e.to_string(),
                })?;
        let len = frame.len() - HEADER_LEN;
        check_body_len(len)?;
        let body_len = u32::try_from(len).map_err(|_| ProtoError::Oversized {
            len,
            max: body_len_usize(MAX_BODY_LEN),
        })?;
        frame[..HEADER_LEN].copy_from_slice(
            &Header {
                msg_type,
                body_len,
                request_id,
            }
            .to_bytes(),
        );
        Ok(frame)
    }

    /// Decodes the body of a frame whose header passed [`Header::parse`] (layer 3). `body`
    /// must be exactly `header.body_len` bytes.
    pub fn decode(header: &Header, body: &[u8]) -> Result<Message, ProtoError> {
        let need = header.body_len();
        check_body_len(need)?;
        if body.len() < need {
            return Err(ProtoError::Truncated {
                need,
                got: body.len(),
            });
        }
        if body.len() > need {
            return Err(ProtoError::TrailingBytes {
                msg_type: header.msg_type,
                extra: body.len() - need,
            });
        }
        Message::decode_body(header.msg_type, body)
    }

    /// Layers 3 to 5 for a frame that arrived with `fds` file descriptors: decode, check the
    /// descriptor count, validate.
    pub fn from_frame(header: &Header, body: &[u8], fds: usize) -> Result<Message, ProtoError> {
        let msg = Message::decode(header, body)?;
        msg.check_fds(fds)?;
        msg.validate()?;
        Ok(msg)
    }

    /// File descriptors this message carries: 1 for `RegisterWorker` from a prefill
    /// worker on shared memory (its pool memfd; none with a TCP endpoint) and for
    /// `PrefillPool`, 0 otherwise.
    pub fn fd_count(&self) -> usize {
        match self {
            Message::RegisterWorker(r) if r.role == Role::Prefill && r.endpoint.is_none() => 1,
            Message::PrefillPool(_) => 1,
            _ => 0,
        }
    }

    /// Layer 4: refuses `got` descriptors unless it is the count allowed for the type
    /// ([`allowed_fds`]) and then exactly [`Message::fd_count`].
    pub fn check_fds(&self, got: usize) -> Result<(), ProtoError> {
        let msg_type = self.msg_type();
        let allowed = allowed_fds(msg_type);
        if got > allowed {
            return Err(ProtoError::BadFds {
                msg_type,
                expected: allowed,
                got,
            });
        }
        let expected = self.fd_count();
        if got != expected {
            return Err(ProtoError::BadFds {
                msg_type,
                expected,
                got,
            });
        }
        Ok(())
    }

    /// Layer 5: semantic limits that need no daemon state. Each failure is
    /// [`ProtoError::Invalid`] with a reason naming the limit.
    pub fn validate(&self) -> Result<(), ProtoError> {
        let msg_type = self.msg_type();
        let r = match self {
            Message::Hello(m) => m.check(),
            Message::HelloAck(m) => m.check(),
            Message::RegisterWorker(m) => m.check(),
            Message::RegisterAck(m) => m.check(),
            Message::Submit(m) => m.check(),
            Message::Tokens(m) => m.check(),
            Message::Done(m) => [&m.prefill_worker, &m.decode_worker]
                .into_iter()
                .filter(|w| !w.is_empty())
                .try_for_each(|w| check_worker_id(w)),
            Message::Error(m) => check_text("message", &m.message),
            Message::StatusQuery(_) => Ok(()),
            Message::StatusReply(m) => m.check(),
            Message::DecodeReserve(m) => m.check(),
            Message::DecodeReserved(_) => Ok(()),
            Message::PrefillRun(m) => check_prompt(&m.prompt),
            Message::PrefillDone(m) => check_manifest(&m.manifest),
            Message::PrefillPool(m) => m.check(),
            Message::PullKv(m) => m.check(),
            Message::PullDone(_) => Ok(()),
            Message::Release(_) => Ok(()),
            Message::Abort(m) => check_text("reason", &m.reason),
            Message::PoolReport(m) => check_counters(&m.counters),
            Message::Freed(_) => Ok(()),
            Message::PrefillEndpoint(m) => m.check(),
            Message::PageRequest(m) => m.check(),
            Message::PageData(_) => Ok(()),
            Message::RdmaConnect(m) => m.check(),
            Message::RdmaWindows(m) => m.check(),
            Message::RdmaReadDone(_) => Ok(()),
            Message::PrefillGone(m) => check_worker_id(&m.worker),
            Message::Drain(m) => check_worker_id(&m.worker),
            Message::DrainReply(m) => m.worker.check(),
        };
        r.map_err(|reason| ProtoError::Invalid { msg_type, reason })
    }
}

/// Parses and fully validates one whole frame held in `frame` that arrived with `fds` file
/// descriptors (layers 1 to 5).
pub fn decode_frame(frame: &[u8], fds: usize) -> Result<(Header, Message), ProtoError> {
    let header = Header::parse(frame)?;
    let need = header.frame_len();
    if frame.len() < need {
        return Err(ProtoError::Truncated {
            need,
            got: frame.len(),
        });
    }
    let msg = Message::from_frame(&header, &frame[HEADER_LEN..], fds)?;
    Ok((header, msg))
}

type Check = Result<(), String>;

fn check_text(what: &str, s: &str) -> Check {
    if s.len() > MAX_TEXT_BYTES {
        return Err(format!(
            "{what} of {} bytes exceeds {MAX_TEXT_BYTES}",
            s.len()
        ));
    }
    Ok(())
}

fn check_prompt(prompt: &[u32]) -> Check {
    if prompt.is_empty() {
        return Err("empty prompt".to_owned());
    }
    if prompt.len() > MAX_PROMPT_TOKENS {
        return Err(format!(
            "prompt of {} tokens exceeds {MAX_PROMPT_TOKENS}",
            prompt.len()
        ));
    }
    Ok(())
}

fn check_pool(geometry: &PageGeometry, pool_pages: u32) -> Check {
    if !geometry.is_valid() {
        return Err(format!(
            "invalid geometry: {} tokens/page, {} layers, {} kv heads, head dim {}, {} bytes/page",
            geometry.tokens_per_page,
            geometry.layers,
            geometry.kv_heads,
            geometry.head_dim,
            geometry.bytes_per_page()
        ));
    }
    if pool_pages == 0 {
        return Err("pool of 0 pages".to_owned());
    }
    Ok(())
}

fn check_manifest(m: &Manifest) -> Check {
    if m.pages.len() != m.digests.len() {
        return Err(format!(
            "{} pages but {} digests",
            m.pages.len(),
            m.digests.len()
        ));
    }
    if m.pages.len() > MAX_MANIFEST_PAGES {
        return Err(format!(
            "{} pages exceed {MAX_MANIFEST_PAGES}",
            m.pages.len()
        ));
    }
    if m.tokens == 0 || m.pages.is_empty() {
        return Err(format!(
            "{} tokens in {} pages: both must be non-zero",
            m.tokens,
            m.pages.len()
        ));
    }
    let mut seen: HashSet<PageId> = HashSet::with_capacity(m.pages.len());
    if let Some(dup) = m.pages.iter().find(|p| !seen.insert(**p)) {
        return Err(format!("{dup} listed twice"));
    }
    Ok(())
}
