//! `decoded --config PATH [--id ID] [--metrics-listen IP:PORT] [--check-config]`, `decoded --check-config PATH`: the decode worker of kvfence.
//!
//! Exit codes: 0 stopped cleanly (SIGTERM/SIGINT, after draining) or the configuration is
//! valid; 1 runtime failure; 2 invalid configuration, one this build cannot run, or one
//! kvctld refuses for good (`Misconfigured`).

use clap::Parser;
use libkv::worker::CommandLine;
use std::path::PathBuf;
use std::process::ExitCode;

/// The decode worker of kvfence: pulls and verifies prefilled KV, then generates tokens.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Path of the kvfence configuration file.
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
    /// This worker's id, unique per kvctld (overrides `[worker] id`; default "decode").
    #[arg(long, value_name = "ID")]
    id: Option<String>,
    /// `IP:PORT` of this worker's `/metrics` (overrides `[metrics] decode_listen`; port 0:
    /// any free port, logged).
    #[arg(long, value_name = "IP:PORT")]
    metrics_listen: Option<String>,
    /// Load and validate the configuration (--config's, or PATH), check what start would
    /// refuse on this host and build, then exit: 0 valid, 2 not.
    #[arg(long, value_name = "PATH")]
    check_config: Option<Option<PathBuf>>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args = match CommandLine::from_args(args.config, args.check_config, args.id) {
        Ok(cmd) => CommandLine {
            metrics_listen: args.metrics_listen,
            ..cmd
        },
        Err(e) => {
            eprintln!("decoded: {e}");
            return ExitCode::from(2);
        }
    };
    libkv::worker::main("decoded", args, decoded::run)
}
