//! kvctld: the kvfence control daemon.
//!
//! Exit codes: 0 after a clean stop, 1 when serving failed, 2 for a configuration error.

use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "kvctld",
    about = "kvfence control daemon: admission and bootstrap over a Unix socket"
)]
struct Args {
    /// Configuration file (TOML).
    #[arg(long, short)]
    config: PathBuf,
    /// Validate the configuration and exit.
    #[arg(long)]
    check_config: bool,
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args = Args::parse();
    let cfg = match libkv::config::Config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            log::error!("{}", libkv::error_chain(&e));
            return ExitCode::from(2);
        }
    };
    if args.check_config {
        log::info!("{}: configuration is valid", args.config.display());
        return ExitCode::SUCCESS;
    }
    match kvctld::ctl::run(cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            log::error!("{}", libkv::error_chain(&e));
            ExitCode::from(1)
        }
    }
}
