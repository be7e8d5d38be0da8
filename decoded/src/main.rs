//! `decoded --config PATH [--check-config]`: the decode worker of kvfence.
//!
//! Exit codes: 0 stopped cleanly (SIGTERM/SIGINT) or the configuration is valid;
//! 1 runtime failure; 2 invalid configuration, or one this build cannot run.

use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;

/// The decode worker of kvfence: pulls and verifies prefilled KV, then generates tokens.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Path of the kvfence configuration file.
    #[arg(long, value_name = "PATH")]
    config: PathBuf,
    /// Load and validate the configuration, then exit.
    #[arg(long)]
    check_config: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let cfg = match libkv::config::Config::load(&args.config) {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("decoded: {}", decoded::error_chain(&e));
            return ExitCode::from(decoded::EXIT_CONFIG);
        }
    };
    if args.check_config {
        eprintln!("decoded: {}: configuration is valid", args.config.display());
        return ExitCode::from(decoded::EXIT_OK);
    }
    match decoded::run(cfg, decoded::RunOptions::default()) {
        Ok(()) => ExitCode::from(decoded::EXIT_OK),
        Err(e) => {
            eprintln!("decoded: {}", decoded::error_chain(&e));
            ExitCode::from(e.exit_code())
        }
    }
}
