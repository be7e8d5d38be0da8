//! kvflood: opens many connections to kvctld and holds them, for the connection-limit,
//! idle and out-of-descriptors tests (`tests/hardening.rs`), which run it as another uid.
//!
//! `kvflood --socket PATH --connections N [--hello] [--hold-ms MS]` connects N times
//! without blocking (a full backlog counts as `backlog_full`, not a wait), says `Hello` as a
//! client on each connection if asked, reads each one's answer (`HelloAck`, an `Error` that
//! turns it away, or nothing), prints one JSON line with those counts and `"phase":
//! "holding"`, holds every connection for MS milliseconds (default 0) while counting those
//! kvctld closes, then prints a second JSON line (`"phase": "done"`) and exits, closing the
//! rest. Bounded: every wait has a deadline.

#![allow(clippy::print_stdout)]

use libkv::RequestId;
use libkv::proto::{Hello, Message, Role};
use libkv::sys::uds::{FrameReader, UdsError, send_frame};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Longest the answers to the Hellos are waited for, all together.
const ANSWER_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, clap::Parser)]
struct Args {
    #[arg(long)]
    socket: PathBuf,
    #[arg(long)]
    connections: usize,
    #[arg(long)]
    hello: bool,
    #[arg(long = "hold-ms", default_value_t = 0)]
    hold_ms: u64,
}

/// Whether the peer closed `fd` (EOF or an error frame followed by EOF): drains what is
/// there without blocking.
fn peer_closed(fd: &OwnedFd) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match nix::sys::socket::recv(
            fd.as_raw_fd(),
            &mut buf,
            nix::sys::socket::MsgFlags::MSG_DONTWAIT,
        ) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(nix::errno::Errno::EAGAIN) => return false,
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return true,
        }
    }
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
    let mut open: Vec<OwnedFd> = Vec::with_capacity(args.connections);
    let addr = UnixAddr::new(&args.socket).expect("socket path");
    for _ in 0..args.connections {
        let fd = match socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        ) {
            Ok(fd) => fd,
            Err(_) => {
                *counts.entry("no_fd_here").or_default() += 1;
                continue;
            }
        };
        match connect(fd.as_raw_fd(), &addr) {
            Ok(()) => {
                *counts.entry("connected").or_default() += 1;
                open.push(fd);
            }
            Err(nix::errno::Errno::EAGAIN) => *counts.entry("backlog_full").or_default() += 1,
            Err(_) => *counts.entry("connect_failed").or_default() += 1,
        }
    }
    if args.hello {
        let hello = Message::from(Hello::new(Role::Client))
            .encode(RequestId(0))
            .expect("encoding Hello");
        for fd in &open {
            if send_frame(fd, &hello, &[]).is_err() {
                *counts.entry("hello_send_failed").or_default() += 1;
            }
        }
        let deadline = Instant::now() + ANSWER_WAIT;
        let mut keep = Vec::with_capacity(open.len());
        for fd in open {
            let left = deadline.saturating_duration_since(Instant::now());
            match FrameReader::new().read_frame(&fd, Some(left.max(Duration::from_millis(1)))) {
                Ok((_, Message::HelloAck(_), _)) => {
                    *counts.entry("hello_ack").or_default() += 1;
                    keep.push(fd);
                }
                Ok((_, Message::Error(_), _)) => *counts.entry("turned_away").or_default() += 1,
                Ok(_) => *counts.entry("unexpected_frame").or_default() += 1,
                Err(UdsError::TimedOut { .. }) => {
                    *counts.entry("no_answer").or_default() += 1;
                    keep.push(fd);
                }
                Err(_) => *counts.entry("closed_before_answer").or_default() += 1,
            }
        }
        open = keep;
    }
    let line = |phase: &str, counts: &BTreeMap<&str, u64>| {
        let mut m = serde_json::Map::new();
        m.insert("phase".into(), phase.into());
        for (k, v) in counts {
            m.insert((*k).into(), (*v).into());
        }
        println!("{}", serde_json::Value::Object(m));
    };
    line("holding", &counts);
    let hold_until = Instant::now() + Duration::from_millis(args.hold_ms);
    let mut closed = vec![false; open.len()];
    while Instant::now() < hold_until && closed.iter().any(|c| !c) {
        let left = hold_until.saturating_duration_since(Instant::now());
        let wait = PollTimeout::try_from(left.as_millis().min(200)).unwrap_or(PollTimeout::ZERO);
        let mut fds: Vec<PollFd<'_>> = open
            .iter()
            .zip(&closed)
            .filter(|(_, c)| !**c)
            .map(|(fd, _)| PollFd::new(fd.as_fd(), PollFlags::POLLIN))
            .collect();
        let ready = poll(&mut fds, wait).unwrap_or(0);
        drop(fds);
        if ready > 0 {
            for (fd, c) in open.iter().zip(closed.iter_mut()) {
                if !*c && peer_closed(fd) {
                    *c = true;
                }
            }
        }
    }
    counts.insert(
        "closed_by_kvctld",
        closed.iter().filter(|c| **c).count() as u64,
    );
    line("done", &counts);
}
