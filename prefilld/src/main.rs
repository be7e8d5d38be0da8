//! `prefilld --config PATH [--check-config]`: the prefill worker of kvfence.
//!
//! Exit codes: 0 stopped cleanly (SIGTERM/SIGINT) or the configuration is valid;
//! 1 runtime failure; 2 invalid configuration, or one this build cannot run.

use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;

/// The prefill worker of kvfence: computes prompt KV into its pool and lets decoded pull it.
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
            eprintln!("prefilld: {}", prefilld::error_chain(&e));
            return ExitCode::from(prefilld::EXIT_CONFIG);
        }
    };
    if args.check_config {
        eprintln!(
            "prefilld: {}: configuration is valid",
            args.config.display()
        );
        return ExitCode::from(prefilld::EXIT_OK);
    }
    match prefilld::run(cfg, prefilld::RunOptions::default()) {
        Ok(()) => ExitCode::from(prefilld::EXIT_OK),
        Err(e) => {
            eprintln!("prefilld: {}", prefilld::error_chain(&e));
            ExitCode::from(e.exit_code())
        }
    }
}
