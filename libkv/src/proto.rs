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
//!      4     2  version     PROTOCOL_VERSION (1)
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

use crate::geometry::PageGeometry;
use crate::ids::{Generation, Owner, PageId, RequestId};
use crate::verify::Manifest;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::fmt;
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// `magic` of every frame: the bytes "KVFC" read as a little-endian `u32`.
pub const MAGIC: u32 = 0x4346_564B;
/// The only protocol version this build speaks.
pub const PROTOCOL_VERSION: u16 = 1;
/// Bytes of the fixed frame header.
pub const HEADER_LEN: usize = 24;
/// Largest body a frame may carry (1 MiB). Checked from the header before any allocation.
pub const MAX_BODY_LEN: u32 = 1 << 20;
/// Largest whole frame: header plus the largest body.
pub const MAX_FRAME_LEN: usize = HEADER_LEN + MAX_BODY_LEN as usize;
/// Most file descriptors any message type carries.
pub const MAX_FDS_PER_FRAME: usize = 1;

/// Largest prompt in `Submit` and `PrefillRun` (512 KiB).
pub const MAX_PROMPT_BYTES: usize = 512 * 1024;
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
pub const MAX_WORKERS: usize = 256;
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
            Message::Done(_) => Ok(()),
            Message::Error(m) => check_text("message", &m.message),
            Message::StatusQuery(_) => Ok(()),
            Message::StatusReply(m) => m.check(),
            Message::DecodeReserve(m) => m.check(),
            Message::DecodeReserved(_) => Ok(()),
            Message::PrefillRun(m) => check_prompt(&m.prompt),
            Message::PrefillDone(m) => check_manifest(&m.manifest),
            Message::PrefillPool(m) => check_pool(&m.geometry, m.pool_pages),
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

fn check_prompt(prompt: &[u8]) -> Check {
    if prompt.is_empty() {
        return Err("empty prompt".to_owned());
    }
    if prompt.len() > MAX_PROMPT_BYTES {
        return Err(format!(
            "prompt of {} bytes exceeds {MAX_PROMPT_BYTES}",
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

/// Role of a peer, declared in `Hello`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Role {
    /// kvctl or another client submitting requests.
    Client,
    /// prefilld: computes the KV of prompts into its pool.
    Prefill,
    /// decoded: pulls KV into its pool and generates tokens.
    Decode,
}

/// A way of moving pages between pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Transport {
    /// Shared memory: the decode worker maps the prefill pool's memfd.
    Shm,
    /// TCP between hosts.
    Tcp,
    /// RDMA between hosts.
    Rdma,
}

/// Why a request failed. On the wire it is its `u16` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "u16", into = "u16")]
#[repr(u16)]
pub enum ErrorCode {
    /// Admission refused the request.
    Rejected = 1,
    /// No pool has room for the request.
    PoolFull = 2,
    /// The request's deadline passed.
    Timeout = 3,
    /// A worker holding the request disconnected.
    WorkerLost = 4,
    /// Transferred pages failed the coverage or digest check.
    VerifyFailed = 5,
    /// The peer sent an invalid frame or request.
    BadRequest = 6,
    /// A bug or an unexpected system error.
    Internal = 7,
    /// The peer may not do this.
    Unauthorized = 8,
    /// kvctld is shutting down.
    ShuttingDown = 9,
}

/// A `u16` that names no [`ErrorCode`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown error code {0}")]
pub struct UnknownErrorCode(pub u16);

impl From<ErrorCode> for u16 {
    fn from(c: ErrorCode) -> u16 {
        c as u16
    }
}

impl TryFrom<u16> for ErrorCode {
    type Error = UnknownErrorCode;

    fn try_from(v: u16) -> Result<ErrorCode, UnknownErrorCode> {
        Ok(match v {
            1 => ErrorCode::Rejected,
            2 => ErrorCode::PoolFull,
            3 => ErrorCode::Timeout,
            4 => ErrorCode::WorkerLost,
            5 => ErrorCode::VerifyFailed,
            6 => ErrorCode::BadRequest,
            7 => ErrorCode::Internal,
            8 => ErrorCode::Unauthorized,
            9 => ErrorCode::ShuttingDown,
            other => return Err(UnknownErrorCode(other)),
        })
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// First frame of every connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// What the peer is.
    pub role: Role,
    /// Oldest protocol version the peer speaks.
    pub min_version: u16,
    /// Newest protocol version the peer speaks.
    pub max_version: u16,
}

impl Hello {
    /// A hello for this build's version.
    pub fn new(role: Role) -> Hello {
        Hello {
            role,
            min_version: PROTOCOL_VERSION,
            max_version: PROTOCOL_VERSION,
        }
    }

    /// The version both ends speak, if any.
    pub fn negotiate(&self) -> Option<u16> {
        (self.min_version..=self.max_version)
            .contains(&PROTOCOL_VERSION)
            .then_some(PROTOCOL_VERSION)
    }

    fn check(&self) -> Check {
        if self.min_version == 0 || self.min_version > self.max_version {
            return Err(format!(
                "version range {}..={} is empty or starts at 0",
                self.min_version, self.max_version
            ));
        }
        Ok(())
    }
}

/// Answer to `Hello`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloAck {
    /// Negotiated protocol version.
    pub version: u16,
    /// kvctld's generation; owners of other generations are stale.
    pub generation: Generation,
}

impl HelloAck {
    fn check(&self) -> Check {
        if self.version == 0 {
            return Err("version 0".to_owned());
        }
        Ok(())
    }
}

/// A worker registers its pool. A prefill worker attaches the pool's sealed memfd.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterWorker {
    /// `Prefill` or `Decode`.
    pub role: Role,
    /// Shape of the worker's pages.
    pub geometry: PageGeometry,
    /// Pages in the worker's pool.
    pub pool_pages: u32,
    /// Transports the worker can use, without repeats.
    pub transports: Vec<Transport>,
    /// A prefill worker's TCP page server; then it lists `Tcp` and attaches no fd.
    pub endpoint: Option<TcpEndpoint>,
}

impl RegisterWorker {
    fn check(&self) -> Check {
        if self.role == Role::Client {
            return Err("a worker's role must be Prefill or Decode, not Client".to_owned());
        }
        check_pool(&self.geometry, self.pool_pages)?;
        if self.transports.is_empty() || self.transports.len() > 3 {
            return Err(format!(
                "{} transports, expected 1 to 3",
                self.transports.len()
            ));
        }
        let mut seen = HashSet::new();
        if let Some(dup) = self.transports.iter().find(|t| !seen.insert(**t)) {
            return Err(format!("transport {dup:?} listed twice"));
        }
        if let Some(endpoint) = &self.endpoint {
            if self.role != Role::Prefill || !self.transports.contains(&Transport::Tcp) {
                return Err("only a prefill worker listing Tcp may name a TCP endpoint".to_owned());
            }
            check_addr(&endpoint.addr)?;
        }
        Ok(())
    }
}

/// Longest `addr` of a [`TcpEndpoint`] ("[v6 address]:port" fits).
pub const MAX_ADDR_BYTES: usize = 64;
/// Bytes of the token a page server requires in every `PageRequest`.
pub const TOKEN_BYTES: usize = 16;

fn check_addr(addr: &str) -> Check {
    if addr.len() > MAX_ADDR_BYTES {
        return Err(format!(
            "address of {} bytes exceeds {MAX_ADDR_BYTES}",
            addr.len()
        ));
    }
    match addr.parse::<std::net::SocketAddr>() {
        Ok(a) if !a.ip().is_unspecified() && !a.ip().is_multicast() && a.port() != 0 => Ok(()),
        _ => Err(format!(
            "address {addr:?} is not IP:PORT with a unicast IP and a non-zero port"
        )),
    }
}

/// Where a prefill worker serves its pages over TCP, and the token it requires. The token
/// travels only on the authenticated Unix socket (prefilld to kvctld to decoded), so a host
/// that can reach the port but is not part of the stack cannot pull pages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcpEndpoint {
    /// `IP:PORT` the page server listens on.
    pub addr: String,
    /// Random bytes drawn by prefilld at start.
    pub token: [u8; TOKEN_BYTES],
}

/// Answer to `RegisterWorker`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterAck {
    /// kvctld's generation.
    pub generation: Generation,
    /// Longest context (prompt plus new tokens) kvctld admits.
    pub max_context: u32,
    /// Most new tokens one request may ask for.
    pub max_new_tokens: u32,
}

impl RegisterAck {
    fn check(&self) -> Check {
        if self.max_context == 0 || self.max_new_tokens == 0 {
            return Err(format!(
                "max_context {} and max_new_tokens {} must be non-zero",
                self.max_context, self.max_new_tokens
            ));
        }
        Ok(())
    }
}

/// A client asks for one request to run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Submit {
    /// Who pays: 1 to [`MAX_TENANT_BYTES`] bytes of `[A-Za-z0-9_.-]`.
    pub tenant: String,
    /// The prompt, 1 to [`MAX_PROMPT_BYTES`] bytes.
    pub prompt: Vec<u8>,
    /// Most tokens to generate, at least 1.
    pub max_new_tokens: u32,
    /// Milliseconds the client will wait; 0 for kvctld's default.
    pub deadline_ms: u32,
}

/// Whether `tenant` is 1 to [`MAX_TENANT_BYTES`] bytes of `[A-Za-z0-9_.-]`.
pub fn is_valid_tenant(tenant: &str) -> bool {
    (1..=MAX_TENANT_BYTES).contains(&tenant.len())
        && tenant
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

impl Submit {
    fn check(&self) -> Check {
        if !is_valid_tenant(&self.tenant) {
            return Err(format!(
                "tenant of {} bytes: expected 1 to {MAX_TENANT_BYTES} bytes of [A-Za-z0-9_.-]",
                self.tenant.len()
            ));
        }
        check_prompt(&self.prompt)?;
        if self.max_new_tokens == 0 {
            return Err("max_new_tokens 0".to_owned());
        }
        Ok(())
    }
}

/// Generated tokens, `first_index` being the index of `tokens[0]` among the new tokens.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tokens {
    /// Index of the first token of this frame among the request's new tokens.
    pub first_index: u32,
    /// Token ids, at most [`MAX_TOKENS_PER_FRAME`].
    pub tokens: Vec<u32>,
}

impl Tokens {
    fn check(&self) -> Check {
        if self.tokens.len() > MAX_TOKENS_PER_FRAME {
            return Err(format!(
                "{} tokens exceed {MAX_TOKENS_PER_FRAME}",
                self.tokens.len()
            ));
        }
        let end = u64::from(self.first_index) + self.tokens.len() as u64;
        if end > u64::from(u32::MAX) {
            return Err(format!(
                "token indices {}..{end} overflow u32",
                self.first_index
            ));
        }
        Ok(())
    }
}

/// A request finished.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {
    /// New tokens generated.
    pub tokens: u32,
    /// Signature of the generated tokens, for end-to-end checks.
    pub signature: u64,
    /// KV pages moved from prefill to decode.
    pub pages_transferred: u32,
    /// KV bytes moved from prefill to decode.
    pub bytes_transferred: u64,
    /// Microseconds from admission to the last token.
    pub elapsed_us: u64,
}

/// A request failed, or a frame was refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Error {
    /// What failed.
    pub code: ErrorCode,
    /// Details for humans, at most [`MAX_TEXT_BYTES`].
    pub message: String,
}

/// Ask kvctld for its status.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusQuery {}

/// kvctld's status.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReply {
    /// kvctld's generation.
    pub generation: Generation,
    /// Longest context admitted.
    pub max_context: u32,
    /// Most new tokens per request.
    pub max_new_tokens: u32,
    /// Registered workers, at most [`MAX_WORKERS`].
    pub workers: Vec<WorkerStatus>,
    /// Named counters, at most [`MAX_COUNTERS`], names 1 to [`MAX_COUNTER_NAME_BYTES`].
    pub counters: Vec<(String, u64)>,
    /// How pages move from prefill to decode, once both workers are registered.
    pub transport: Option<Transport>,
}

impl StatusReply {
    fn check(&self) -> Check {
        if self.workers.len() > MAX_WORKERS {
            return Err(format!(
                "{} workers exceed {MAX_WORKERS}",
                self.workers.len()
            ));
        }
        for (i, w) in self.workers.iter().enumerate() {
            let used = [w.free, w.reserved, w.writing, w.readable, w.draining]
                .iter()
                .map(|&n| u64::from(n))
                .sum::<u64>();
            if used > u64::from(w.pool_pages) {
                return Err(format!(
                    "worker {i}: {used} pages by state exceed its pool of {}",
                    w.pool_pages
                ));
            }
        }
        check_counters(&self.counters)?;
        Ok(())
    }
}

fn check_counters(counters: &[(String, u64)]) -> Result<(), String> {
    if counters.len() > MAX_COUNTERS {
        return Err(format!("{} counters exceed {MAX_COUNTERS}", counters.len()));
    }
    if let Some((name, _)) = counters
        .iter()
        .find(|(n, _)| n.is_empty() || n.len() > MAX_COUNTER_NAME_BYTES)
    {
        return Err(format!(
            "counter name of {} bytes, expected 1 to {MAX_COUNTER_NAME_BYTES}",
            name.len()
        ));
    }
    Ok(())
}

/// One worker in a `StatusReply`: its pool's pages by ownership state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerStatus {
    /// `Prefill` or `Decode`.
    pub role: Role,
    /// Whether the worker is connected now.
    pub connected: bool,
    /// Pages in the pool.
    pub pool_pages: u32,
    /// Token positions per page.
    pub tokens_per_page: u32,
    /// Pages owned by no request.
    pub free: u32,
    /// Pages reserved for a request, not yet written.
    pub reserved: u32,
    /// Pages being written.
    pub writing: u32,
    /// Pages written and readable by their owner.
    pub readable: u32,
    /// Pages released, waiting for readers to finish.
    pub draining: u32,
}

/// kvctld asks a decode worker to reserve pages for a request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecodeReserve {
    /// The request and generation the pages will belong to.
    pub owner: Owner,
    /// Prompt tokens whose KV will be pulled.
    pub prompt_tokens: u32,
    /// New tokens to leave room for.
    pub max_new_tokens: u32,
}

impl DecodeReserve {
    fn check(&self) -> Check {
        if self.prompt_tokens == 0 || self.max_new_tokens == 0 {
            return Err(format!(
                "prompt_tokens {} and max_new_tokens {} must be non-zero",
                self.prompt_tokens, self.max_new_tokens
            ));
        }
        Ok(())
    }
}

/// A decode worker reserved pages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecodeReserved {
    /// The owner the pages belong to.
    pub owner: Owner,
    /// Pages reserved.
    pub pages: u32,
}

/// kvctld asks a prefill worker to compute the KV of a prompt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillRun {
    /// The owner of the pages to write.
    pub owner: Owner,
    /// The prompt, 1 to [`MAX_PROMPT_BYTES`] bytes.
    pub prompt: Vec<u8>,
}

/// A prefill worker wrote the KV of a prompt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillDone {
    /// Pages written and their digests.
    pub manifest: Manifest,
}

/// kvctld hands a decode worker the prefill pool to pull from; attaches the pool memfd.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillPool {
    /// Shape of the prefill pool's pages.
    pub geometry: PageGeometry,
    /// Pages in the prefill pool.
    pub pool_pages: u32,
}

/// kvctld hands a decode worker the prefill page server to pull from over TCP.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillEndpoint {
    /// Shape of the prefill pool's pages.
    pub geometry: PageGeometry,
    /// Pages in the prefill pool.
    pub pool_pages: u32,
    /// The page server and its token.
    pub endpoint: TcpEndpoint,
    /// Whether to read the pages with RDMA (both workers have it), over a session set up on
    /// a connection to the page server; otherwise the pages come over that TCP connection.
    pub rdma: bool,
}

impl PrefillEndpoint {
    fn check(&self) -> Check {
        check_pool(&self.geometry, self.pool_pages)?;
        check_addr(&self.endpoint.addr)
    }
}

/// Decode worker to prefill page server, on TCP: send the listed pages of `owner`, in order.
/// The server answers with [`PageData`] frames, each followed by whole pages, or with one [`Error`]
/// and closes the connection: it serves a page only if it holds a reservation for exactly
/// `owner` (request and generation) and the page is in that owner's manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageRequest {
    /// The token of the server's [`TcpEndpoint`].
    pub token: [u8; TOKEN_BYTES],
    /// Whose pages.
    pub owner: Owner,
    /// Pages of the prefill pool, 1 to [`MAX_MANIFEST_PAGES`], no repeats.
    pub pages: Vec<PageId>,
}

impl PageRequest {
    fn check(&self) -> Check {
        if self.pages.is_empty() || self.pages.len() > MAX_MANIFEST_PAGES {
            return Err(format!(
                "{} pages, expected 1 to {MAX_MANIFEST_PAGES}",
                self.pages.len()
            ));
        }
        let mut seen: HashSet<PageId> = HashSet::with_capacity(self.pages.len());
        if let Some(dup) = self.pages.iter().find(|p| !seen.insert(**p)) {
            return Err(format!("{dup} listed twice"));
        }
        Ok(())
    }
}

/// Page server to decode worker, on TCP: pages `index ..` of the request follow the frame
/// as `len` raw bytes (not part of the frame body), `len / page bytes` whole pages; the
/// server batches up to [`crate::tcp::PAGE_BATCH_BYTES`] per frame (one page when pages are
/// larger). The receiver checks `owner`, `index` (the next page it expects) and `len` (at
/// least one whole page, none past the request's end) before reading a byte.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageData {
    /// Whose page.
    pub owner: Owner,
    /// Position in the `PageRequest` of the first page that follows.
    pub index: u32,
    /// Bytes that follow.
    pub len: u32,
}

/// Bytes of an RDMA GID (an IPv6 address; IPv4-mapped on RoCE v2).
pub const GID_BYTES: usize = 16;

/// One side of an RDMA session: the queue pair to connect to. The decode worker sends it
/// with the page server's token; the page server answers with its own (token all zeros).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaConnect {
    /// The page server's token from the decode worker; zeros in the answer.
    pub token: [u8; TOKEN_BYTES],
    /// Queue pair number, 24 bits.
    pub qp_num: u32,
    /// First packet sequence number, 24 bits.
    pub psn: u32,
    /// The GID the queue pair's packets come from.
    pub gid: [u8; GID_BYTES],
}

impl RdmaConnect {
    fn check(&self) -> Check {
        if self.qp_num == 0 || self.qp_num > 0x00ff_ffff {
            return Err(format!("QP number {} is not 1 to 2^24 - 1", self.qp_num));
        }
        if self.psn > 0x00ff_ffff {
            return Err(format!("PSN {} exceeds 24 bits", self.psn));
        }
        if self.gid == [0; GID_BYTES] {
            return Err("GID is all zeros".to_owned());
        }
        Ok(())
    }
}

/// A memory window over a run of consecutive pages of a `PageRequest`: pages `first ..
/// first + pages` of the request, readable at `addr .. addr + pages * page bytes` with
/// `rkey`, through the session's queue pair only, until the reader says `RdmaReadDone` or
/// the owner is released.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaWindow {
    /// Index in the `PageRequest` of the window's first page.
    pub first: u32,
    /// Pages in the window, at least 1.
    pub pages: u32,
    /// The first page's address, as the reader names it.
    pub addr: u64,
    /// The window's key.
    pub rkey: u32,
}

/// The page server's answer to a `PageRequest` on an RDMA session: windows that cover the
/// request's pages exactly once, in order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaWindows {
    /// Whose pages.
    pub owner: Owner,
    /// 1 to [`MAX_MANIFEST_PAGES`] windows.
    pub windows: Vec<RdmaWindow>,
}

impl RdmaWindows {
    fn check(&self) -> Check {
        if self.windows.is_empty() || self.windows.len() > MAX_MANIFEST_PAGES {
            return Err(format!(
                "{} windows, expected 1 to {MAX_MANIFEST_PAGES}",
                self.windows.len()
            ));
        }
        let mut next = 0u64;
        for w in &self.windows {
            if w.pages == 0 || u64::from(w.first) != next {
                return Err(format!(
                    "window at page {} of {} pages does not continue at page {next}",
                    w.first, w.pages
                ));
            }
            next += u64::from(w.pages);
        }
        if next > MAX_MANIFEST_PAGES as u64 {
            return Err(format!(
                "windows cover {next} pages, over {MAX_MANIFEST_PAGES}"
            ));
        }
        Ok(())
    }

    /// Pages the windows cover.
    pub fn pages(&self) -> u64 {
        self.windows.iter().map(|w| u64::from(w.pages)).sum()
    }
}

/// The reader is done with an owner's windows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaReadDone {
    /// Whose windows.
    pub owner: Owner,
}

/// kvctld asks a decode worker to pull and verify the pages of a manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullKv {
    /// Source pages, digests and owner.
    pub manifest: Manifest,
    /// New tokens to generate once pulled.
    pub max_new_tokens: u32,
}

impl PullKv {
    fn check(&self) -> Check {
        check_manifest(&self.manifest)?;
        if self.max_new_tokens == 0 {
            return Err("max_new_tokens 0".to_owned());
        }
        Ok(())
    }
}

/// A decode worker pulled and verified the pages of an owner.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullDone {
    /// The owner whose pages were pulled.
    pub owner: Owner,
}

/// Free the pages of an owner.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Release {
    /// The owner whose pages to free.
    pub owner: Owner,
}

/// Abandon the request of an owner and free its pages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Abort {
    /// The owner whose request to abandon.
    pub owner: Owner,
    /// Why.
    pub code: ErrorCode,
    /// Details for humans, at most [`MAX_TEXT_BYTES`].
    pub reason: String,
}

/// A worker's pages by ownership state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolReport {
    /// Pages owned by no request.
    pub free: u32,
    /// Pages reserved, not yet written.
    pub reserved: u32,
    /// Pages being written.
    pub writing: u32,
    /// Pages written and readable.
    pub readable: u32,
    /// Pages released while a writer may still touch them, waiting for it to end.
    pub draining: u32,
    /// The worker's counters, at most [`MAX_COUNTERS`].
    pub counters: Vec<(String, u64)>,
}

/// The pages a worker held for an owner are free again: no writer can touch them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Freed {
    /// The owner whose pages were freed.
    pub owner: Owner,
    /// How many pages went back to the free list.
    pub pages: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Dtype;
    use proptest::prelude::*;

    fn owner() -> Owner {
        Owner {
            request: RequestId(42),
            generation: Generation(7),
        }
    }

    fn geometry() -> PageGeometry {
        PageGeometry {
            tokens_per_page: 16,
            layers: 2,
            kv_heads: 2,
            head_dim: 8,
            dtype: Dtype::F16,
        }
    }

    fn manifest() -> Manifest {
        Manifest {
            owner: owner(),
            tokens: 20,
            pages: vec![PageId(3), PageId(9)],
            digests: vec![0xdead_beef, 1],
        }
    }

    /// One valid message of every type.
    fn every_message() -> Vec<Message> {
        vec![
            Hello::new(Role::Client).into(),
            HelloAck {
                version: 1,
                generation: Generation(3),
            }
            .into(),
            RegisterWorker {
                role: Role::Prefill,
                geometry: geometry(),
                pool_pages: 128,
                transports: vec![Transport::Shm, Transport::Rdma],
                endpoint: None,
            }
            .into(),
            RegisterAck {
                generation: Generation(3),
                max_context: 8192,
                max_new_tokens: 512,
            }
            .into(),
            Submit {
                tenant: "team-a.prod_1".into(),
                prompt: b"hello".to_vec(),
                max_new_tokens: 16,
                deadline_ms: 0,
            }
            .into(),
            Tokens {
                first_index: 4,
                tokens: vec![1, 2, 70_000],
            }
            .into(),
            Done {
                tokens: 16,
                signature: u64::MAX,
                pages_transferred: 2,
                bytes_transferred: 1 << 40,
                elapsed_us: 99,
            }
            .into(),
            Error {
                code: ErrorCode::PoolFull,
                message: "no room".into(),
            }
            .into(),
            StatusQuery {}.into(),
            StatusReply {
                generation: Generation(3),
                max_context: 8192,
                max_new_tokens: 512,
                workers: vec![WorkerStatus {
                    role: Role::Decode,
                    connected: true,
                    pool_pages: 10,
                    tokens_per_page: 16,
                    free: 5,
                    reserved: 1,
                    writing: 1,
                    readable: 2,
                    draining: 1,
                }],
                counters: vec![("admitted".into(), 12), ("rejected".into(), 0)],
                transport: Some(Transport::Tcp),
            }
            .into(),
            DecodeReserve {
                owner: owner(),
                prompt_tokens: 20,
                max_new_tokens: 16,
            }
            .into(),
            DecodeReserved {
                owner: owner(),
                pages: 3,
            }
            .into(),
            PrefillRun {
                owner: owner(),
                prompt: vec![0, 255, 7],
            }
            .into(),
            PrefillDone {
                manifest: manifest(),
            }
            .into(),
            PrefillPool {
                geometry: geometry(),
                pool_pages: 64,
            }
            .into(),
            PullKv {
                manifest: manifest(),
                max_new_tokens: 16,
            }
            .into(),
            PullDone { owner: owner() }.into(),
            Release { owner: owner() }.into(),
            Abort {
                owner: owner(),
                code: ErrorCode::Timeout,
                reason: "deadline".into(),
            }
            .into(),
            PoolReport {
                free: 1,
                reserved: 2,
                writing: 3,
                readable: 4,
                draining: 5,
                counters: vec![("pulls".into(), 3)],
            }
            .into(),
            Freed {
                owner: owner(),
                pages: 9,
            }
            .into(),
            PrefillEndpoint {
                geometry: geometry(),
                pool_pages: 64,
                endpoint: endpoint(),
                rdma: true,
            }
            .into(),
            PageRequest {
                token: [7; TOKEN_BYTES],
                owner: owner(),
                pages: vec![PageId(3), PageId(9)],
            }
            .into(),
            PageData {
                owner: owner(),
                index: 1,
                len: 4096,
            }
            .into(),
            RdmaConnect {
                token: [3; TOKEN_BYTES],
                qp_num: 17,
                psn: 0x00ab_cdef,
                gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 0, 2, 1],
            }
            .into(),
            RdmaWindows {
                owner: owner(),
                windows: vec![
                    RdmaWindow {
                        first: 0,
                        pages: 3,
                        addr: 0x7f00_0000_0000,
                        rkey: 0x1234_5601,
                    },
                    RdmaWindow {
                        first: 3,
                        pages: 1,
                        addr: 0x7f00_0010_0000,
                        rkey: 0x1234_5702,
                    },
                ],
            }
            .into(),
            RdmaReadDone { owner: owner() }.into(),
        ]
    }

    fn endpoint() -> TcpEndpoint {
        TcpEndpoint {
            addr: "192.0.2.1:7470".into(),
            token: [0xa5; TOKEN_BYTES],
        }
    }

    fn frame_with(msg: &Message, edit: impl FnOnce(&mut RawHeader)) -> Vec<u8> {
        let mut frame = msg.encode(RequestId(5)).unwrap();
        let (mut raw, _) = RawHeader::read_from_prefix(&frame).unwrap();
        edit(&mut raw);
        frame[..HEADER_LEN].copy_from_slice(raw.as_bytes());
        frame
    }

    #[test]
    fn every_type_round_trips() {
        let all = every_message();
        assert_eq!(all.len(), 27, "one message per MsgType but Invalid");
        for (i, msg) in all.iter().enumerate() {
            assert_eq!(msg.msg_type() as usize, i + 1);
            let frame = msg.encode(RequestId(0x0102_0304_0506_0708)).unwrap();
            let (header, back) = decode_frame(&frame, msg.fd_count()).unwrap();
            assert_eq!(header.msg_type, msg.msg_type());
            assert_eq!(header.request_id, RequestId(0x0102_0304_0506_0708));
            assert_eq!(header.frame_len(), frame.len());
            assert_eq!(&back, msg);
        }
    }

    #[test]
    fn header_layout_matches_the_docs() {
        let frame = Message::from(StatusQuery {})
            .encode(RequestId(0x1122_3344_5566_7788))
            .unwrap();
        assert_eq!(&frame[0..4], b"KVFC");
        assert_eq!(&frame[4..6], &[1, 0]);
        assert_eq!(&frame[6..8], &[9, 0]);
        assert_eq!(&frame[8..12], &[0, 0, 0, 0]);
        assert_eq!(&frame[12..16], &[0, 0, 0, 0]);
        assert_eq!(
            &frame[16..24],
            &[0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11]
        );
        assert_eq!(frame.len(), HEADER_LEN);
    }

    #[test]
    fn error_code_is_its_u16_on_the_wire() {
        let msg = Message::from(Error {
            code: ErrorCode::ShuttingDown,
            message: String::new(),
        });
        let frame = msg.encode(RequestId(0)).unwrap();
        assert_eq!(frame[HEADER_LEN], 9);
        let mut bad = frame.clone();
        bad[HEADER_LEN] = 10;
        assert!(matches!(
            decode_frame(&bad, 0),
            Err(ProtoError::BadBody {
                msg_type: MsgType::Error,
                ..
            })
        ));
    }

    #[test]
    fn truncated_header() {
        let frame = Message::from(StatusQuery {}).encode(RequestId(1)).unwrap();
        for n in 0..HEADER_LEN {
            let r = Header::parse(&frame[..n]);
            assert!(
                matches!(r, Err(ProtoError::Truncated { need: HEADER_LEN, got }) if got == n),
                "{r:?}"
            );
        }
    }

    #[test]
    fn truncated_body() {
        let frame = Message::from(Hello::new(Role::Decode))
            .encode(RequestId(1))
            .unwrap();
        let header = Header::parse(&frame).unwrap();
        let body = &frame[HEADER_LEN..frame.len() - 1];
        assert!(matches!(
            Message::decode(&header, body),
            Err(ProtoError::Truncated { need, got }) if need == body.len() + 1 && got == body.len()
        ));
        assert!(matches!(
            decode_frame(&frame[..frame.len() - 1], 0),
            Err(ProtoError::Truncated { .. })
        ));
    }

    #[test]
    fn body_shorter_than_its_type_needs() {
        let msg = Message::from(Hello::new(Role::Decode));
        // Claim one byte less than the encoding: the body itself is cut short.
        let mut frame = frame_with(&msg, |h| h.body_len = U32::new(h.body_len.get() - 1));
        frame.pop();
        assert!(matches!(
            decode_frame(&frame, 0),
            Err(ProtoError::BadBody {
                msg_type: MsgType::Hello,
                ..
            })
        ));
    }

    #[test]
    fn oversized_length_field() {
        let msg = Message::from(StatusQuery {});
        let frame = frame_with(&msg, |h| h.body_len = U32::new(MAX_BODY_LEN + 1));
        let max_body = MAX_BODY_LEN as usize;
        assert!(matches!(
            Header::parse(&frame),
            Err(ProtoError::Oversized { len, max }) if len == max_body + 1 && max == max_body
        ));
        let frame = frame_with(&msg, |h| h.body_len = U32::new(u32::MAX));
        assert!(matches!(
            Header::parse(&frame),
            Err(ProtoError::Oversized { .. })
        ));
        let frame = frame_with(&msg, |h| h.body_len = U32::new(MAX_BODY_LEN));
        assert!(Header::parse(&frame).is_ok());
    }

    #[test]
    fn encode_refuses_an_oversized_body() {
        let msg = Message::from(Tokens {
            first_index: 0,
            tokens: vec![u32::MAX; 300_000],
        });
        let r = msg.encode(RequestId(1));
        assert!(
            matches!(r, Err(ProtoError::Oversized { max, .. }) if max == MAX_BODY_LEN as usize),
            "{r:?}"
        );
    }

    #[test]
    fn unknown_and_invalid_types() {
        let msg = Message::from(StatusQuery {});
        let frame = frame_with(&msg, |h| h.msg_type = U16::new(28));
        assert!(matches!(
            Header::parse(&frame),
            Err(ProtoError::UnknownType { got: 28 })
        ));
        let frame = frame_with(&msg, |h| h.msg_type = U16::new(u16::MAX));
        assert!(matches!(
            Header::parse(&frame),
            Err(ProtoError::UnknownType { got: u16::MAX })
        ));
        let frame = frame_with(&msg, |h| h.msg_type = U16::new(0));
        assert!(matches!(
            Header::parse(&frame),
            Err(ProtoError::InvalidType)
        ));
        assert!(matches!(MsgType::try_from(0), Err(ProtoError::InvalidType)));
        for v in 1..=20u16 {
            assert_eq!(MsgType::try_from(v).unwrap() as u16, v);
        }
    }

    #[test]
    fn bad_version_and_magic() {
        let msg = Message::from(StatusQuery {});
        let frame = frame_with(&msg, |h| h.version = U16::new(2));
        assert!(matches!(
            Header::parse(&frame),
            Err(ProtoError::BadVersion {
                got: 2,
                supported: PROTOCOL_VERSION
            })
        ));
        let frame = frame_with(&msg, |h| h.magic = U32::new(0x4346_564C));
        assert!(matches!(
            Header::parse(&frame),
            Err(ProtoError::BadMagic { got: 0x4346_564C })
        ));
    }

    #[test]
    fn reserved_bits_and_field() {
        let msg = Message::from(StatusQuery {});
        let frame = frame_with(&msg, |h| h.flags = U16::new(0x8000));
        assert!(matches!(
            Header::parse(&frame),
            Err(ProtoError::ReservedBits {
                flags: 0x8000,
                reserved: 0
            })
        ));
        let frame = frame_with(&msg, |h| h.reserved = U16::new(1));
        assert!(matches!(
            Header::parse(&frame),
            Err(ProtoError::ReservedBits {
                flags: 0,
                reserved: 1
            })
        ));
    }

    #[test]
    fn trailing_bytes() {
        let msg = Message::from(Release { owner: owner() });
        let mut frame = frame_with(&msg, |h| h.body_len = U32::new(h.body_len.get() + 3));
        frame.extend_from_slice(&[0, 0, 0]);
        assert!(matches!(
            decode_frame(&frame, 0),
            Err(ProtoError::TrailingBytes {
                msg_type: MsgType::Release,
                extra: 3
            })
        ));
        // A body slice longer than body_len is refused the same way.
        let frame = msg.encode(RequestId(1)).unwrap();
        let header = Header::parse(&frame).unwrap();
        let mut body = frame[HEADER_LEN..].to_vec();
        body.push(0);
        assert!(matches!(
            Message::decode(&header, &body),
            Err(ProtoError::TrailingBytes {
                msg_type: MsgType::Release,
                extra: 1
            })
        ));
    }

    #[test]
    fn wrong_fd_counts() {
        let query = Message::from(StatusQuery {});
        let frame = query.encode(RequestId(1)).unwrap();
        assert!(matches!(
            decode_frame(&frame, 1),
            Err(ProtoError::BadFds {
                msg_type: MsgType::StatusQuery,
                expected: 0,
                got: 1
            })
        ));
        let pool = Message::from(PrefillPool {
            geometry: geometry(),
            pool_pages: 8,
        });
        let frame = pool.encode(RequestId(1)).unwrap();
        assert!(matches!(
            decode_frame(&frame, 0),
            Err(ProtoError::BadFds {
                expected: 1,
                got: 0,
                ..
            })
        ));
        assert!(matches!(
            decode_frame(&frame, 2),
            Err(ProtoError::BadFds {
                expected: 1,
                got: 2,
                ..
            })
        ));
        let decode = RegisterWorker {
            role: Role::Decode,
            geometry: geometry(),
            pool_pages: 8,
            transports: vec![Transport::Shm],
            endpoint: None,
        };
        let frame = Message::from(decode.clone()).encode(RequestId(1)).unwrap();
        assert!(decode_frame(&frame, 0).is_ok());
        assert!(matches!(
            decode_frame(&frame, 1),
            Err(ProtoError::BadFds {
                msg_type: MsgType::RegisterWorker,
                expected: 0,
                got: 1
            })
        ));
        let prefill = RegisterWorker {
            role: Role::Prefill,
            ..decode
        };
        let frame = Message::from(prefill.clone()).encode(RequestId(1)).unwrap();
        assert!(decode_frame(&frame, 1).is_ok());
        assert!(matches!(
            decode_frame(&frame, 0),
            Err(ProtoError::BadFds {
                msg_type: MsgType::RegisterWorker,
                expected: 1,
                got: 0
            })
        ));
        // A prefill worker on TCP attaches no fd.
        let tcp = RegisterWorker {
            transports: vec![Transport::Tcp],
            endpoint: Some(endpoint()),
            ..prefill
        };
        let frame = Message::from(tcp).encode(RequestId(1)).unwrap();
        assert!(decode_frame(&frame, 0).is_ok());
        assert!(matches!(
            decode_frame(&frame, 1),
            Err(ProtoError::BadFds {
                msg_type: MsgType::RegisterWorker,
                expected: 0,
                got: 1
            })
        ));
    }

    fn invalid(msg: impl Into<Message>) -> String {
        match msg.into().validate() {
            Err(ProtoError::Invalid { reason, .. }) => reason,
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    #[test]
    fn semantic_limits() {
        let submit = Submit {
            tenant: "t".into(),
            prompt: vec![1],
            max_new_tokens: 1,
            deadline_ms: 0,
        };
        assert!(Message::from(submit.clone()).validate().is_ok());
        invalid(Submit {
            prompt: vec![],
            ..submit.clone()
        });
        let reason = invalid(Submit {
            prompt: vec![0; MAX_PROMPT_BYTES + 1],
            ..submit.clone()
        });
        assert!(reason.contains(&MAX_PROMPT_BYTES.to_string()), "{reason}");
        invalid(Submit {
            tenant: String::new(),
            ..submit.clone()
        });
        invalid(Submit {
            tenant: "a".repeat(MAX_TENANT_BYTES + 1),
            ..submit.clone()
        });
        invalid(Submit {
            tenant: "a b".into(),
            ..submit.clone()
        });
        invalid(Submit {
            tenant: "é".into(),
            ..submit.clone()
        });
        invalid(Submit {
            max_new_tokens: 0,
            ..submit.clone()
        });
        assert!(
            Message::from(Submit {
                tenant: "a".repeat(MAX_TENANT_BYTES),
                ..submit
            })
            .validate()
            .is_ok()
        );

        let pull = PullKv {
            manifest: manifest(),
            max_new_tokens: 4,
        };
        let mut m = manifest();
        m.digests.pop();
        assert_eq!(
            invalid(PullKv {
                manifest: m,
                ..pull.clone()
            }),
            "2 pages but 1 digests"
        );
        let mut m = manifest();
        m.pages[1] = m.pages[0];
        invalid(PullKv {
            manifest: m,
            ..pull.clone()
        });
        let mut m = manifest();
        m.pages = (0..=u32::try_from(MAX_MANIFEST_PAGES).unwrap())
            .map(PageId)
            .collect();
        m.digests = vec![0; m.pages.len()];
        invalid(PrefillDone { manifest: m });
        invalid(PullKv {
            manifest: Manifest {
                tokens: 0,
                ..manifest()
            },
            ..pull
        });

        invalid(Hello {
            role: Role::Client,
            min_version: 2,
            max_version: 1,
        });
        invalid(RegisterWorker {
            role: Role::Client,
            geometry: geometry(),
            pool_pages: 1,
            transports: vec![Transport::Shm],
            endpoint: None,
        });
        invalid(RegisterWorker {
            role: Role::Decode,
            geometry: geometry(),
            pool_pages: 1,
            transports: vec![],
            endpoint: None,
        });
        invalid(RegisterWorker {
            role: Role::Decode,
            geometry: geometry(),
            pool_pages: 1,
            transports: vec![Transport::Tcp, Transport::Tcp],
            endpoint: None,
        });
        let tcp = RegisterWorker {
            role: Role::Prefill,
            geometry: geometry(),
            pool_pages: 1,
            transports: vec![Transport::Tcp],
            endpoint: Some(endpoint()),
        };
        assert!(Message::from(tcp.clone()).validate().is_ok());
        invalid(RegisterWorker {
            role: Role::Decode,
            ..tcp.clone()
        });
        invalid(RegisterWorker {
            transports: vec![Transport::Shm],
            ..tcp.clone()
        });
        for addr in [
            "0.0.0.0:7470",
            "192.0.2.1:0",
            "192.0.2.1",
            "host:80",
            "224.0.0.1:1",
        ] {
            let reason = invalid(RegisterWorker {
                endpoint: Some(TcpEndpoint {
                    addr: addr.into(),
                    ..endpoint()
                }),
                ..tcp.clone()
            });
            assert!(reason.contains("IP:PORT"), "{addr}: {reason}");
        }
        invalid(PrefillEndpoint {
            geometry: geometry(),
            pool_pages: 1,
            rdma: false,
            endpoint: TcpEndpoint {
                addr: "1".repeat(MAX_ADDR_BYTES + 1),
                ..endpoint()
            },
        });
        let request = PageRequest {
            token: [0; TOKEN_BYTES],
            owner: owner(),
            pages: vec![PageId(1)],
        };
        assert!(Message::from(request.clone()).validate().is_ok());
        invalid(PageRequest {
            pages: vec![],
            ..request.clone()
        });
        invalid(PageRequest {
            pages: vec![PageId(1), PageId(1)],
            ..request
        });
        let connect = RdmaConnect {
            token: [0; TOKEN_BYTES],
            qp_num: 5,
            psn: 1,
            gid: [1; GID_BYTES],
        };
        assert!(Message::from(connect.clone()).validate().is_ok());
        for bad in [
            RdmaConnect {
                qp_num: 0,
                ..connect.clone()
            },
            RdmaConnect {
                qp_num: 1 << 24,
                ..connect.clone()
            },
            RdmaConnect {
                psn: 1 << 24,
                ..connect.clone()
            },
            RdmaConnect {
                gid: [0; GID_BYTES],
                ..connect
            },
        ] {
            invalid(bad);
        }
        let w = |first, pages| RdmaWindow {
            first,
            pages,
            addr: 4096,
            rkey: 9,
        };
        let windows = |windows| RdmaWindows {
            owner: owner(),
            windows,
        };
        assert!(
            Message::from(windows(vec![w(0, 2), w(2, 1)]))
                .validate()
                .is_ok()
        );
        invalid(windows(vec![]));
        invalid(windows(vec![w(1, 2)])); // does not start at the first page
        invalid(windows(vec![w(0, 2), w(1, 1)])); // overlaps
        invalid(windows(vec![w(0, 2), w(3, 1)])); // leaves a gap
        invalid(windows(vec![w(0, 0)]));
        invalid(windows(vec![w(0, u32::MAX)])); // more pages than a manifest holds
        invalid(PrefillPool {
            geometry: PageGeometry {
                layers: 0,
                ..geometry()
            },
            pool_pages: 1,
        });
        invalid(PrefillPool {
            geometry: geometry(),
            pool_pages: 0,
        });
        invalid(Error {
            code: ErrorCode::Internal,
            message: "x".repeat(MAX_TEXT_BYTES + 1),
        });
        invalid(Abort {
            owner: owner(),
            code: ErrorCode::Internal,
            reason: "x".repeat(MAX_TEXT_BYTES + 1),
        });
        invalid(Tokens {
            first_index: u32::MAX,
            tokens: vec![1],
        });
        invalid(StatusReply {
            generation: Generation(1),
            max_context: 1,
            max_new_tokens: 1,
            workers: vec![],
            counters: vec![(String::new(), 1)],
            transport: Some(Transport::Rdma),
        });
        invalid(StatusReply {
            generation: Generation(1),
            max_context: 1,
            max_new_tokens: 1,
            workers: vec![],
            counters: vec![("c".into(), 1); MAX_COUNTERS + 1],
            transport: Some(Transport::Rdma),
        });
    }

    #[test]
    fn largest_valid_bodies_fit_a_frame() {
        let pages = (0..MAX_MANIFEST_PAGES)
            .map(|i| PageId(u32::MAX - u32::try_from(i).unwrap()))
            .collect();
        let m = Manifest {
            owner: Owner {
                request: RequestId(u64::MAX),
                generation: Generation(u64::MAX),
            },
            tokens: u32::MAX,
            pages,
            digests: vec![u32::MAX; MAX_MANIFEST_PAGES],
        };
        let msgs: Vec<Message> = vec![
            PullKv {
                manifest: m,
                max_new_tokens: u32::MAX,
            }
            .into(),
            Submit {
                tenant: "t".repeat(MAX_TENANT_BYTES),
                prompt: vec![0xff; MAX_PROMPT_BYTES],
                max_new_tokens: u32::MAX,
                deadline_ms: u32::MAX,
            }
            .into(),
            Tokens {
                first_index: 0,
                tokens: vec![u32::MAX; MAX_TOKENS_PER_FRAME],
            }
            .into(),
            StatusReply {
                generation: Generation(u64::MAX),
                max_context: u32::MAX,
                max_new_tokens: u32::MAX,
                workers: vec![
                    WorkerStatus {
                        role: Role::Decode,
                        connected: true,
                        pool_pages: u32::MAX,
                        tokens_per_page: u32::MAX,
                        free: u32::MAX,
                        reserved: 0,
                        writing: 0,
                        readable: 0,
                        draining: 0,
                    };
                    MAX_WORKERS
                ],
                counters: vec![("c".repeat(MAX_COUNTER_NAME_BYTES), u64::MAX); MAX_COUNTERS],
                transport: Some(Transport::Tcp),
            }
            .into(),
        ];
        for msg in msgs {
            msg.validate().unwrap();
            let frame = msg.encode(RequestId(1)).unwrap();
            assert_eq!(decode_frame(&frame, 0).unwrap().1, msg);
        }
    }

    #[test]
    fn error_policy() {
        let errors = [
            ProtoError::BadMagic { got: 0 },
            ProtoError::Truncated { need: 24, got: 0 },
            ProtoError::BadVersion {
                got: 9,
                supported: 1,
            },
            ProtoError::Invalid {
                msg_type: MsgType::Submit,
                reason: "é".repeat(MAX_TEXT_BYTES),
            },
        ];
        assert!(errors.iter().all(ProtoError::is_fatal));
        assert!(errors[0].reply().is_none());
        assert!(errors[1].reply().is_none());
        let reply = errors[3].reply().unwrap();
        assert_eq!(reply.code, ErrorCode::BadRequest);
        assert!(Message::from(reply).validate().is_ok());
        assert_eq!(Hello::new(Role::Client).negotiate(), Some(PROTOCOL_VERSION));
        assert_eq!(
            Hello {
                role: Role::Client,
                min_version: 2,
                max_version: 3
            }
            .negotiate(),
            None
        );
    }

    fn arb_owner() -> impl Strategy<Value = Owner> {
        (any::<u64>(), any::<u64>()).prop_map(|(r, g)| Owner {
            request: RequestId(r),
            generation: Generation(g),
        })
    }

    fn arb_submit() -> impl Strategy<Value = Submit> {
        (
            "[A-Za-z0-9_.-]{1,64}",
            proptest::collection::vec(any::<u8>(), 1..2048),
            1..=u32::MAX,
            any::<u32>(),
        )
            .prop_map(|(tenant, prompt, max_new_tokens, deadline_ms)| Submit {
                tenant,
                prompt,
                max_new_tokens,
                deadline_ms,
            })
    }

    fn arb_pull() -> impl Strategy<Value = PullKv> {
        (
            arb_owner(),
            1..=u32::MAX,
            proptest::collection::hash_set(any::<u32>(), 1..512),
            any::<u32>(),
            1..=u32::MAX,
        )
            .prop_map(|(owner, tokens, pages, seed, max_new_tokens)| {
                let pages: Vec<PageId> = pages.into_iter().map(PageId).collect();
                let digests = pages.iter().map(|p| p.0.wrapping_mul(seed)).collect();
                PullKv {
                    manifest: Manifest {
                        owner,
                        tokens,
                        pages,
                        digests,
                    },
                    max_new_tokens,
                }
            })
    }

    /// Any known type with an arbitrary body, so random bodies reach the postcard layer.
    fn arb_framed_body() -> impl Strategy<Value = Vec<u8>> {
        (
            1..=24u16,
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 0..256),
        )
            .prop_map(|(t, id, body)| {
                let header = Header {
                    msg_type: MsgType::try_from(t).unwrap(),
                    body_len: u32::try_from(body.len()).unwrap(),
                    request_id: RequestId(id),
                };
                let mut frame = header.to_bytes().to_vec();
                frame.extend_from_slice(&body);
                frame
            })
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..512),
            fds in 0..3usize,
        ) {
            if let Ok(header) = Header::parse(&bytes) {
                let end = bytes.len().min(header.frame_len());
                let _ = Message::decode(&header, &bytes[HEADER_LEN..end]);
            }
            let _ = decode_frame(&bytes, fds);
        }

        #[test]
        fn random_bodies_never_panic(frame in arb_framed_body(), fds in 0..3usize) {
            let header = Header::parse(&frame).unwrap();
            if let Ok(msg) = Message::decode(&header, &frame[HEADER_LEN..]) {
                let _ = msg.check_fds(fds);
                let _ = msg.validate();
                // Whatever decodes re-encodes to the same type.
                let again = msg.encode(header.request_id).unwrap();
                prop_assert_eq!(Header::parse(&again).unwrap().msg_type, header.msg_type);
            }
            let _ = decode_frame(&frame, fds);
        }

        #[test]
        fn submit_round_trips(submit in arb_submit(), id in any::<u64>()) {
            let msg = Message::from(submit);
            let frame = msg.encode(RequestId(id)).unwrap();
            let (header, back) = decode_frame(&frame, 0).unwrap();
            prop_assert_eq!(header.request_id, RequestId(id));
            prop_assert_eq!(back, msg);
        }

        #[test]
        fn pull_kv_round_trips(pull in arb_pull(), id in any::<u64>()) {
            let msg = Message::from(pull);
            let frame = msg.encode(RequestId(id)).unwrap();
            let (header, back) = decode_frame(&frame, 0).unwrap();
            prop_assert_eq!(header.msg_type, MsgType::PullKv);
            prop_assert_eq!(back, msg);
        }
    }
}
