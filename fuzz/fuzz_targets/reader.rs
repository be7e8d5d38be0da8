//! Arbitrary byte streams, cut into arbitrary writes, through a real
//! `libkv::sys::uds::FrameReader` over a Unix socket pair. Input: one byte `n`, then `n % 8`
//! little-endian `u16` cut offsets, then the stream (at most 64 KiB used). The reader must
//! yield exactly the frames, and the first error, that decoding the stream frame by frame
//! yields. See `libkv_fuzz::check_reader`.

#![no_main]

use libfuzzer_sys::fuzz_target;

/// Longest stream fed to the reader (well under a socket's send buffer).
const MAX_STREAM: usize = 64 * 1024;

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(n % 8);
    if rest.len() < 2 * n {
        return;
    }
    let (cut_bytes, stream) = rest.split_at(2 * n);
    let stream = &stream[..stream.len().min(MAX_STREAM)];
    let mut cuts: Vec<usize> = cut_bytes
        .chunks_exact(2)
        .map(|c| usize::from(u16::from_le_bytes([c[0], c[1]])) % (stream.len() + 1))
        .collect();
    cuts.sort_unstable();
    if let Err(e) = libkv_fuzz::check_reader(stream, &cuts) {
        panic!("{e}");
    }
});
