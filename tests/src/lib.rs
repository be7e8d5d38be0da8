//! Integration tests live under tests/tests; this library holds what they share.

use kvctld::stack::{Daemon, default_bin_dir};
use std::path::PathBuf;

/// The directory of the daemon binaries the tests spawn; fails with the command that
/// builds them when one is missing.
pub fn bin_dir() -> PathBuf {
    let dir = default_bin_dir().expect("locating the target directory");
    for name in ["kvctld", "prefilld", "decoded", "kvctl"] {
        assert!(
            dir.join(name).is_file(),
            "{} is missing: these tests spawn the real daemons; run `cargo build --bins` \
             (`cargo build --release --bins` for `cargo test --release`) first",
            dir.join(name).display()
        );
    }
    dir
}

/// Prints the end of every daemon log in its directory if the test panics, so a failure
/// shows what the daemons saw.
#[derive(Debug)]
pub struct LogsOnPanic(pub PathBuf);

impl Drop for LogsOnPanic {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        for d in Daemon::ALL {
            let path = self.0.join(format!("{}.log", d.binary()));
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(40)..].join("\n");
            eprintln!("---- {} (last 40 lines) ----\n{tail}", path.display());
        }
    }
}
