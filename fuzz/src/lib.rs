//! Checks shared by the fuzz targets (kept in step with `libkv/tests/frame_fuzz.rs`, which
//! runs the same checks, bounded, on stable Rust in CI).

use libkv::proto::{
    HEADER_LEN, Header, MAGIC, MAX_BODY_LEN, MAX_FRAME_LEN, Message, MsgType, ProtoError,
    decode_frame,
};
use libkv::sys::uds::{FrameReader, ReadOutcome};
use std::io::Write;
use std::os::unix::net::UnixStream;

/// Checks a refusal of `frame` (received with `fds` descriptors) against the input. The
/// match is exhaustive: a new `ProtoError` variant must be added here.
pub fn check_error(e: &ProtoError, frame: &[u8], fds: usize) -> Result<(), String> {
    let ok = match e {
        ProtoError::BadMagic { got } => *got != MAGIC && frame.len() >= HEADER_LEN,
        ProtoError::BadVersion { got, supported } => got != supported,
        ProtoError::ReservedBits { flags, reserved } => flags | reserved != 0,
        ProtoError::UnknownType { got } => *got != 0 && MsgType::try_from(*got).is_err(),
        ProtoError::InvalidType => true,
        ProtoError::Oversized { len, max } => {
            *max == MAX_BODY_LEN as usize && len > max && frame.len() >= HEADER_LEN
        }
        ProtoError::Truncated { need, got } => got < need && *got == frame.len(),
        ProtoError::BadBody { reason, .. } => !reason.is_empty(),
        ProtoError::TrailingBytes { extra, .. } => *extra > 0,
        ProtoError::BadFds { expected, got, .. } => expected != got && *got == fds,
        ProtoError::Invalid { reason, .. } => !reason.is_empty(),
        // Only `encode` makes this one.
        ProtoError::Encode { .. } => false,
    };
    if !ok {
        return Err(format!("inconsistent error {e:?}"));
    }
    // Formatting and the reply policy never panic, and a reply is itself a valid frame.
    let _ = e.to_string();
    assert!(e.is_fatal());
    if let Some(reply) = e.reply() {
        let msg = Message::from(reply);
        msg.validate()
            .map_err(|v| format!("reply to {e:?} invalid: {v}"))?;
    }
    Ok(())
}

/// Decodes `frame` and checks the result: a typed, consistent refusal, or a message that
/// round-trips.
pub fn check_decode(frame: &[u8], fds: usize) -> Result<(), String> {
    match decode_frame(frame, fds) {
        Err(e) => check_error(&e, frame, fds),
        Ok((header, msg)) => {
            if header.frame_len() != frame.len() {
                return Err(format!(
                    "decoded {} of {} bytes",
                    header.frame_len(),
                    frame.len()
                ));
            }
            if msg.msg_type() != header.msg_type || msg.fd_count() != fds {
                return Err(format!("{header:?} decoded as {msg:?} with {fds} fds"));
            }
            let again = msg
                .encode(header.request_id)
                .map_err(|e| format!("re-encoding {msg:?}: {e}"))?;
            if again.len() > frame.len() {
                return Err(format!(
                    "re-encoding grew the frame from {} to {} bytes",
                    frame.len(),
                    again.len()
                ));
            }
            let (h2, m2) =
                decode_frame(&again, fds).map_err(|e| format!("re-encoded {msg:?}: {e}"))?;
            if h2.request_id != header.request_id || h2.msg_type != header.msg_type || m2 != msg {
                return Err(format!("round trip changed {msg:?} into {m2:?}"));
            }
            Ok(())
        }
    }
}

/// What decoding `stream` frame by frame yields: the frames up to the first error, and that
/// error (`Truncated` if the stream ends inside a frame).
pub fn reference(stream: &[u8]) -> (Vec<(Header, Message)>, Option<ProtoError>) {
    let mut frames = Vec::new();
    let mut rest = stream;
    while !rest.is_empty() {
        if rest.len() < HEADER_LEN {
            let e = ProtoError::Truncated {
                need: HEADER_LEN,
                got: rest.len(),
            };
            return (frames, Some(e));
        }
        let header = match Header::parse(rest) {
            Ok(h) => h,
            Err(e) => return (frames, Some(e)),
        };
        let need = header.frame_len();
        if rest.len() < need {
            let e = ProtoError::Truncated {
                need,
                got: rest.len(),
            };
            return (frames, Some(e));
        }
        match decode_frame(&rest[..need], 0) {
            Ok(f) => frames.push(f),
            Err(e) => return (frames, Some(e)),
        }
        rest = &rest[need..];
    }
    (frames, None)
}

/// Writes `stream` into a socket pair cut at `cuts`, reads it with a `FrameReader` after
/// each write, closes the writer and compares what the reader yields with [`reference`].
pub fn check_reader(stream: &[u8], cuts: &[usize]) -> Result<(), String> {
    let (mut tx, rx) = UnixStream::pair().map_err(|e| e.to_string())?;
    let mut reader = FrameReader::new();
    let mut frames = Vec::new();
    let mut error = None;
    let pump = |reader: &mut FrameReader, frames: &mut Vec<_>, error: &mut Option<_>| {
        loop {
            let outcome = reader
                .read_from(&rx)
                .map_err(|e| format!("read_from: {e}"))?;
            if reader.pending_bytes() > MAX_FRAME_LEN {
                return Err(format!("{} bytes pending", reader.pending_bytes()));
            }
            loop {
                match reader.next_frame() {
                    Ok(Some((h, m, fds))) => {
                        if !fds.is_empty() {
                            return Err("descriptors from nowhere".into());
                        }
                        frames.push((h, m));
                    }
                    Ok(None) => break,
                    Err(e) => {
                        if error.replace(e).is_some() {
                            return Err("two errors queued".into());
                        }
                    }
                }
            }
            if !matches!(outcome, ReadOutcome::Paused { .. }) {
                return Ok(outcome);
            }
        }
    };
    let mut at = 0;
    for &cut in cuts.iter().chain(std::iter::once(&stream.len())) {
        let cut = cut.clamp(at, stream.len());
        tx.write_all(&stream[at..cut]).map_err(|e| e.to_string())?;
        at = cut;
        pump(&mut reader, &mut frames, &mut error)?;
    }
    drop(tx);
    let last = pump(&mut reader, &mut frames, &mut error)?;
    if !matches!(last, ReadOutcome::Eof | ReadOutcome::Failed) {
        return Err(format!(
            "reader ended with {last:?} after the writer closed"
        ));
    }
    let (want_frames, want_error) = reference(stream);
    if frames != want_frames || error != want_error {
        return Err(format!(
            "reader gave {} frames and {error:?}; decoding frame by frame gives {} and {want_error:?}",
            frames.len(),
            want_frames.len()
        ));
    }
    Ok(())
}
