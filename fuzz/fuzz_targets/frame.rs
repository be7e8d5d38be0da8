//! Arbitrary bytes into `libkv::proto::decode_frame`: the first byte is the number of file
//! descriptors the frame arrived with (0 to 3), the rest is the frame. A refusal must be a
//! consistent typed `ProtoError`; a frame that decodes must re-encode and decode to the same
//! header and message. See `libkv_fuzz::check_decode`.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&fds, frame)) = data.split_first() else {
        return;
    };
    if let Err(e) = libkv_fuzz::check_decode(frame, usize::from(fds % 4)) {
        panic!("{e}");
    }
});
