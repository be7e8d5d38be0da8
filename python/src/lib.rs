//! `kvfence._native`: what a Python inference engine needs of kvfence.
//!
//! - [`Client`]: a blocking connection to kvctld over its Unix socket, which submits a
//!   request and returns when kvctld says `Done` or fails it. A failure raises
//!   `KvfenceError(code, message)`, `code` being kvctld's error code name ("Rejected",
//!   "PoolFull", "VerifyFailed", ...).
//! - [`Worker`]: prefilld or decoded, run on a thread of the engine's process with an
//!   [`EngineRunner`]: the engine prefills the prompts kvctld admitted (`next_job`,
//!   `deliver`) and loads the KV decoded verified (`take_verified`). KV crosses as
//!   little-endian f32 bytes in the layout `[layers][K, V][kv_heads][tokens][head_dim]`.
//!
//! Every blocking call releases the GIL.

use kvctld::client::{Client as KvClient, ClientError};
use libkv::config::Config;
use libkv::engine::EngineRunner;
use libkv::worker::{RunOptions, Shutdown};
use libkv::{Generation, Owner, RequestId};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

create_exception!(
    _native,
    KvfenceError,
    PyException,
    "A request kvfence failed or refused."
);

fn owner(request: u64, generation: u64) -> Owner {
    Owner {
        request: RequestId(request),
        generation: Generation(generation),
    }
}

fn client_error(e: &ClientError) -> PyErr {
    let code = e
        .server_code()
        .map_or_else(|| "Client".to_owned(), |c| format!("{c:?}"));
    KvfenceError::new_err((code, libkv::error_chain(e)))
}

/// A connection to kvctld.
#[pyclass(module = "kvfence._native")]
struct Client {
    socket: PathBuf,
    timeout: Duration,
    inner: Mutex<Option<KvClient>>,
}

#[pymethods]
impl Client {
    /// `socket`: kvctld's Unix socket; `connect_timeout_ms`: how long to wait for it.
    #[new]
    #[pyo3(signature = (socket, connect_timeout_ms = 5000))]
    fn new(socket: PathBuf, connect_timeout_ms: u64) -> Client {
        Client {
            socket,
            timeout: Duration::from_millis(connect_timeout_ms),
            inner: Mutex::new(None),
        }
    }

    /// Runs one request greedily and returns a dict: `request` and `generation` (the owner
    /// the workers knew it as), `tokens` (what decoded generated itself; none when an engine
    /// decodes), `pages`, `bytes`, `elapsed_us`, `prefill_worker`, `decode_worker`. Raises
    /// `KvfenceError` when kvctld refuses or fails it; a rejected request reached no worker.
    #[pyo3(signature = (tenant, prompt, max_new_tokens, deadline_ms = 0))]
    fn generate<'py>(
        &self,
        py: Python<'py>,
        tenant: String,
        prompt: Vec<u32>,
        max_new_tokens: u32,
        deadline_ms: u32,
    ) -> PyResult<Bound<'py, PyDict>> {
        let result = py.detach(|| {
            let mut slot = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            let mut client = match slot.take() {
                Some(c) => c,
                None => KvClient::connect(&self.socket, self.timeout)?,
            };
            let outcome = client.generate(&tenant, &prompt, max_new_tokens, deadline_ms, |_| {});
            let generation = client.generation();
            // A connection that saw anything but a clean end is not reused.
            if outcome.is_ok() || matches!(&outcome, Err(e) if e.server_code().is_some()) {
                *slot = Some(client);
            }
            outcome.map(|o| (o, generation))
        });
        let (o, generation) = result.map_err(|e| client_error(&e))?;
        let d = PyDict::new(py);
        d.set_item("request", o.request.0)?;
        d.set_item("generation", generation.0)?;
        d.set_item("tokens", o.tokens)?;
        d.set_item("pages", o.done.pages_transferred)?;
        d.set_item("bytes", o.done.bytes_transferred)?;
        d.set_item("elapsed_us", o.done.elapsed_us)?;
        d.set_item("prefill_worker", o.done.prefill_worker)?;
        d.set_item("decode_worker", o.done.decode_worker)?;
        Ok(d)
    }
}

/// prefilld or decoded inside the engine's process.
#[pyclass(module = "kvfence._native")]
struct Worker {
    runner: Arc<EngineRunner>,
    shutdown: Shutdown,
    thread: Mutex<Option<JoinHandle<Result<(), String>>>>,
}

#[pymethods]
impl Worker {
    /// Starts the worker of `role` ("prefill" or "decode") with the kvfence configuration at
    /// `config` (its `[geometry]` must be the engine's model's KV shape), registering as
    /// `worker_id` when given and as model `model_id`. `wait_ms`: longest a prefill waits
    /// for the engine; `export_ttl_ms`: how long verified KV waits to be taken.
    #[new]
    #[pyo3(signature = (role, config, model_id, vocab, worker_id = None, wait_ms = 30000, export_ttl_ms = 60000))]
    fn new(
        role: &str,
        config: PathBuf,
        model_id: String,
        vocab: u32,
        worker_id: Option<String>,
        wait_ms: u64,
        export_ttl_ms: u64,
    ) -> PyResult<Worker> {
        let run: fn(Config, RunOptions) -> Result<(), libkv::worker::WorkerError> = match role {
            "prefill" => prefilld::run,
            "decode" => decoded::run,
            other => {
                return Err(PyValueError::new_err(format!(
                    "role {other:?}: prefill or decode"
                )));
            }
        };
        let mut cfg =
            Config::load(&config).map_err(|e| PyValueError::new_err(libkv::error_chain(&e)))?;
        if worker_id.is_some() {
            cfg.worker.id = worker_id;
            cfg.validate()
                .map_err(|e| PyValueError::new_err(libkv::error_chain(&e)))?;
        }
        let runner = Arc::new(EngineRunner::new(
            cfg.geometry,
            model_id,
            vocab,
            Duration::from_millis(wait_ms),
            Duration::from_millis(export_ttl_ms),
        ));
        let shutdown = Shutdown::new();
        let opts = RunOptions {
            handle_signals: false,
            shutdown: shutdown.clone(),
            model: Some(Arc::clone(&runner) as Arc<dyn libkv::model::ModelRunner>),
        };
        let thread = std::thread::Builder::new()
            .name(format!("kvfence-{role}"))
            .spawn(move || run(cfg, opts).map_err(|e| libkv::error_chain(&e)))
            .map_err(|e| PyRuntimeError::new_err(format!("starting the worker thread: {e}")))?;
        Ok(Worker {
            runner,
            shutdown,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The worker's geometry: tokens_per_page, layers, kv_heads, head_dim.
    fn geometry<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        use libkv::model::ModelRunner;
        let g = self.runner.geometry();
        let d = PyDict::new(py);
        d.set_item("tokens_per_page", g.tokens_per_page)?;
        d.set_item("layers", g.layers)?;
        d.set_item("kv_heads", g.kv_heads)?;
        d.set_item("head_dim", g.head_dim)?;
        Ok(d)
    }

    /// `None` while the worker runs; once it stopped, why (an empty string when cleanly).
    fn stopped(&self) -> Option<String> {
        let mut slot = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        if slot.as_ref().is_some_and(|t| t.is_finished()) {
            let t = slot.take()?;
            return Some(match t.join() {
                Ok(Ok(())) => String::new(),
                Ok(Err(e)) => e,
                Err(_) => "the worker thread panicked".into(),
            });
        }
        if slot.is_none() {
            return Some("stopped".into());
        }
        None
    }

    /// The next prompt kvctld admitted for prefill: `(request, generation, tokens)`, or
    /// `None` after `timeout_ms`.
    fn next_job(&self, py: Python<'_>, timeout_ms: u64) -> Option<(u64, u64, Vec<u32>)> {
        py.detach(|| self.runner.next_job(Duration::from_millis(timeout_ms)))
            .map(|j| (j.owner.request.0, j.owner.generation.0, j.prompt))
    }

    /// The engine's KV of a job's prompt (f32 bytes in the interface layout).
    fn deliver(
        &self,
        py: Python<'_>,
        request: u64,
        generation: u64,
        prompt: Vec<u32>,
        kv: &[u8],
    ) -> PyResult<()> {
        if !kv.len().is_multiple_of(4) {
            return Err(PyValueError::new_err("KV bytes are not whole f32s"));
        }
        let floats: Vec<f32> = kv
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        py.detach(|| {
            self.runner
                .deliver(owner(request, generation), prompt, floats)
        })
        .map_err(|e| KvfenceError::new_err(("Engine", e.to_string())))
    }

    /// The engine could not prefill a job.
    fn fail(&self, request: u64, generation: u64, reason: String) -> PyResult<()> {
        self.runner
            .fail(owner(request, generation), reason)
            .map_err(|e| KvfenceError::new_err(("Engine", e.to_string())))
    }

    /// The KV decoded verified for this owner, once: `(prompt_len, last_token, bytes,
    /// exported_unix_us)`, or
    /// `None` when there is none (never verified, taken, or expired).
    fn take_verified<'py>(
        &self,
        py: Python<'py>,
        request: u64,
        generation: u64,
    ) -> Option<(u32, u32, Bound<'py, PyBytes>, u64)> {
        let e = self.runner.take_verified(owner(request, generation))?;
        let mut bytes = Vec::with_capacity(e.kv.len() * 4);
        for v in &e.kv {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        Some((
            e.prompt_len,
            e.last_token,
            PyBytes::new(py, &bytes),
            e.unix_us,
        ))
    }

    /// Verified KV waiting to be taken.
    fn exports(&self) -> usize {
        self.runner.exports()
    }

    /// Stops the worker (it drains first while registered) and waits for it.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        self.shutdown.request();
        let t = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = t {
            py.detach(|| t.join())
                .map_err(|_| PyRuntimeError::new_err("the worker thread panicked"))?
                .map_err(PyRuntimeError::new_err)?;
        }
        Ok(())
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // The workers' logs go to the engine's stderr: warnings by default, RUST_LOG to change.
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .try_init();
    m.add_class::<Client>()?;
    m.add_class::<Worker>()?;
    m.add("KvfenceError", m.py().get_type::<KvfenceError>())?;
    m.add("HANDED_OFF", libkv::engine::HANDED_OFF)?;
    Ok(())
}
