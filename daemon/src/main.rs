//! kvctld: the kvfence control daemon.
//!
//! `kvctld --config PATH [--check-config]`, `kvctld --check-config PATH`.
//!
//! Exit codes: 0 after a clean stop (or `--check-config` found the file valid), 1 when
//! serving failed (another kvctld serves the socket, the socket cannot be bound), 2 for a
//! configuration error, or one the workers of this build would refuse on this host.

use clap::Parser;
use libkv::config::{Config, Side, TransportKind};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "kvctld",
    version,
    about = "kvfence control daemon: admission and bootstrap over a Unix socket"
)]
struct Args {
    /// Configuration file (TOML).
    #[arg(long, short, value_name = "PATH")]
    config: Option<PathBuf>,
    /// Validate the configuration (--config's, or PATH) and what the daemons of this build
    /// would refuse at start on this host, then exit: 0 valid, 2 not.
    #[arg(long, value_name = "PATH")]
    check_config: Option<Option<PathBuf>>,
}

/// What `--check-config` finds beyond [`Config::load`]: the socket group exists, and the
/// workers reading this file (the installed default pair does) would start on this host.
fn check_startable(cfg: &Config) -> Result<(), String> {
    kvctld::ctl::check_socket_settings(&cfg.control).map_err(|e| libkv::error_chain(&e))?;
    if cfg.election.enabled() {
        cfg.election
            .advertised(&cfg.tls)
            .map_err(|e| libkv::error_chain(&e))?;
        libkv::etcd::check(&cfg.election).map_err(|e| libkv::error_chain(&e))?;
    }
    for (side, daemon) in [(Side::Prefill, "prefilld"), (Side::Decode, "decoded")] {
        libkv::worker::preflight(cfg, side)
            .map_err(|e| format!("{daemon} would refuse it: {}", libkv::error_chain(&e)))?;
    }
    // On shared memory both pools live on this host at once.
    if cfg.transfer.transport == TransportKind::Shm
        && let Some((limit_bytes, limit)) = libkv::worker::memory_limit()
    {
        let both = cfg
            .prefill
            .pool_bytes(&cfg.geometry)
            .saturating_add(cfg.decode.pool_bytes(&cfg.geometry));
        if both > limit_bytes {
            return Err(format!(
                "the prefill and decode pools share this host (transfer.transport = \"shm\") and \
                 together take {both} bytes, more than the {limit_bytes} bytes of {limit}: lower \
                 [prefill] and [decode] pool_pages"
            ));
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args = Args::parse();
    let args = match libkv::worker::CommandLine::from_args(args.config, args.check_config, None) {
        Ok(args) => args,
        Err(e) => {
            log::error!("{e}");
            return ExitCode::from(2);
        }
    };
    let cfg = match Config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            log::error!("{}", libkv::error_chain(&e));
            return ExitCode::from(2);
        }
    };
    if args.check_config {
        if let Err(e) = check_startable(&cfg) {
            log::error!("{}: would not start: {e}", args.config.display());
            return ExitCode::from(2);
        }
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
