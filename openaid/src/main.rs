//! openaid: the OpenAI-compatible HTTP endpoint of kvfence.
//!
//! `openaid --config PATH [--listen IP:PORT]`, `openaid --check-config PATH`.
//!
//! Reads `[openai]`, `[model]`, `[limits]`, `[deadlines]` and `[control] socket` of the
//! kvfence config, listens on `[openai] listen` (logged as `openaid on http://ADDR`; port 0
//! takes a free one) and serves until SIGTERM or SIGINT, letting requests in flight finish.
//! Exit codes: 0 after a clean stop or a valid `--check-config`, 1 when serving failed (the
//! address cannot be bound), 2 for a configuration error.

use clap::Parser;
use libkv::config::{Config, ModelKind};
use openaid::keys::Keys;
use openaid::server::{App, router};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(
    name = "openaid",
    version,
    about = "kvfence's OpenAI-compatible HTTP endpoint, a client of kvctld"
)]
struct Args {
    /// Configuration file (TOML).
    #[arg(long, short, value_name = "PATH")]
    config: Option<PathBuf>,
    /// Validate the configuration (--config's, or PATH), the model's tokenizer and the key
    /// file, then exit: 0 valid, 2 not.
    #[arg(long, value_name = "PATH")]
    check_config: Option<Option<PathBuf>>,
    /// Listen here instead of `[openai] listen`.
    #[arg(long, value_name = "IP:PORT")]
    listen: Option<String>,
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args = Args::parse();
    let cli = match libkv::worker::CommandLine::from_args(args.config, args.check_config, None) {
        Ok(c) => c,
        Err(e) => {
            log::error!("{e}");
            return ExitCode::from(2);
        }
    };
    let app = match Config::load(&cli.config)
        .map_err(|e| libkv::error_chain(&e))
        .and_then(|mut cfg| {
            if let Some(l) = args.listen {
                cfg.openai.listen = l;
            }
            prepare(&cfg)
        }) {
        Ok(app) => app,
        Err(e) => {
            log::error!("{}: {e}", cli.config.display());
            return ExitCode::from(2);
        }
    };
    if cli.check_config {
        log::info!("{}: configuration is valid", cli.config.display());
        return ExitCode::SUCCESS;
    }
    match serve(app) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            log::error!("{e}");
            ExitCode::from(1)
        }
    }
}

/// Everything a start needs, checked: the listen address, the tokenizer, the key file.
struct Prepared {
    addr: std::net::SocketAddr,
    app: App,
}

fn prepare(cfg: &Config) -> Result<Prepared, String> {
    let addr = cfg
        .openai
        .listen_addr()
        .map_err(|e| libkv::error_chain(&e))?;
    let codec = llama::codec::Codec::from_model(&cfg.model).map_err(|e| libkv::error_chain(&e))?;
    let keys = cfg.openai.api_keys.as_deref().map(Keys::load).transpose()?;
    let kvctld = kvctld::client::Endpoint::from_config(cfg).map_err(|e| libkv::error_chain(&e))?;
    let app = App::new(
        kvctld,
        codec,
        cfg.limits.max_new_tokens,
        cfg.limits.max_context,
        cfg.deadlines.request(),
        cfg.openai.tenant.clone(),
        keys,
        cfg.openai.max_requests,
    )
    .with_model_file(match cfg.model.kind {
        ModelKind::Gguf => cfg.model.path.as_deref(),
        ModelKind::Reference | ModelKind::Engine => None,
    });
    Ok(Prepared { addr, app })
}

fn serve(p: Prepared) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("openaid")
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(p.addr)
            .await
            .map_err(|e| format!("binding {}: {e}", p.addr))?;
        let local = listener
            .local_addr()
            .map_err(|e| format!("the bound address: {e}"))?;
        log::info!(
            "openaid on http://{local} for kvctld at {}, model {}",
            p.app.kvctld,
            p.app.codec.model_id()
        );
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
        axum::serve(listener, router(Arc::new(p.app)))
            .with_graceful_shutdown(stop_signal())
            .await
            .map_err(|e| format!("serving: {e}"))
    })
}

async fn stop_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        log::error!("cannot watch SIGTERM and SIGINT; stop openaid with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    log::info!("stopping: no new connections; requests in flight finish");
}
