//! Progress of long runs (the benchmarks, the soak, the crash campaign): a bar on stderr
//! when stderr is a terminal, nothing at all otherwise or when `CI` is set, so logs and CI
//! output stay as they were. Results never go through it; they go to stdout as before.

pub use indicatif::ProgressBar;
use indicatif::{ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

/// Whether bars are drawn: stderr is a terminal and `CI` is unset (or empty).
pub fn shown() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("CI").is_none_or(|v| v.is_empty())
}

/// A bar of `len` steps labelled `what`, hidden where [`shown`] is false.
pub fn bar(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(len), target());
    bar.set_style(
        ProgressStyle::with_template(
            "{prefix:>12} [{bar:32}] {pos}/{len} {msg} ({elapsed}, eta {eta})",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    bar.set_prefix(what.to_owned());
    bar
}

fn target() -> ProgressDrawTarget {
    if shown() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bar_counts_even_when_hidden() {
        // Under `cargo test` stderr is captured or CI is set: hidden, and still counting.
        let b = bar(3, "rounds");
        b.inc(2);
        assert_eq!(b.position(), 2);
        assert_eq!(b.length(), Some(3));
        if !shown() {
            assert!(b.is_hidden());
        }
        b.finish_and_clear();
    }
}
