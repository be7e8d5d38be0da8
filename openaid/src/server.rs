//! The HTTP routes and how a request runs: parsed and checked here, submitted to kvctld
//! over the control socket on a blocking thread ([`kvctld::client::Client`]), its tokens
//! streamed back through a channel. The HTTP status is chosen only once the first tokens
//! (or kvctld's error) arrive, so a rejected request is always a 4xx; an error after the
//! first tokens of a stream ends it with an error event and no `[DONE]`. A client that
//! goes away drops the channel; a watcher sees it closed at once (before the first token,
//! during a long prefill, as well as later) and cancels the request, so kvctld aborts it
//! and frees its pages.

use crate::api::{ChatRequest, Common, CompletionRequest, Head, Kind, Prompt, Usage};
use crate::errors::ApiError;
use crate::keys::Keys;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use kvctld::client::{Canceller, ClientError, Endpoint};
use libkv::proto::{MAX_TEMPERATURE_MILLI, Role, Sampling, Submit};
use llama::codec::{Codec, TextStream};
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{Semaphore, mpsc, oneshot};

/// How long connecting to kvctld and its handshake may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The largest request body read (a prompt of 131,072 tokens fits several times).
pub const MAX_BODY_BYTES: usize = 8 << 20;

/// Token batches buffered between kvctld's client thread and the HTTP response.
const CHANNEL_DEPTH: usize = 64;

/// Everything a request needs, shared by all of them.
#[derive(Debug)]
pub struct App {
    /// Where kvctld is: its control socket, or over mutual TLS.
    pub kvctld: Endpoint,
    /// The served model's tokenizer and chat template.
    pub codec: Codec,
    /// `max_tokens` of a chat request that names none: kvctld's `limits.max_new_tokens`.
    pub default_chat_max_tokens: u32,
    /// The longest context, for `/v1/models`.
    pub max_context: u32,
    /// How long one request may take (`[deadlines] request`).
    pub request_deadline: Duration,
    /// The tenant without a key file.
    pub tenant: String,
    /// The keys of `[openai] api_keys`, when set.
    pub keys: Option<Keys>,
    /// Requests in flight, at most `max_requests`.
    pub in_flight: Arc<Semaphore>,
    pub max_requests: u32,
    /// Unix time openaid started (`created` of the model).
    pub started: u64,
    /// Names a request's `model` may use besides the model id and its name: the model
    /// file's (see [`App::with_model_file`]).
    aliases: Vec<String>,
    next_id: AtomicU64,
}

impl App {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        kvctld: Endpoint,
        codec: Codec,
        default_chat_max_tokens: u32,
        max_context: u32,
        request_deadline: Duration,
        tenant: String,
        keys: Option<Keys>,
        max_requests: u32,
    ) -> App {
        App {
            kvctld,
            codec,
            default_chat_max_tokens,
            max_context,
            request_deadline,
            tenant,
            keys,
            in_flight: Arc::new(Semaphore::new(max_requests as usize)),
            max_requests,
            started: unix_now(),
            aliases: Vec::new(),
            next_id: AtomicU64::new(
                u64::from(std::process::id()) << 32 | (unix_now() & 0xffff_ffff),
            ),
        }
    }

    /// The tenant a request is charged to: its key's, or `tenant` without a key file.
    fn tenant_of(&self, headers: &HeaderMap) -> Result<String, ApiError> {
        let Some(keys) = &self.keys else {
            return Ok(self.tenant.clone());
        };
        let auth = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| ApiError::unauthorized("missing Authorization: Bearer KEY"))?;
        let key = auth
            .strip_prefix("Bearer ")
            .ok_or_else(|| ApiError::unauthorized("Authorization is not \"Bearer KEY\""))?;
        keys.tenant(key.trim())
            .map(str::to_owned)
            .ok_or_else(|| ApiError::unauthorized("the API key is not valid"))
    }

    /// The same app also answering to the name of the model file at `path`: its file name,
    /// without `.gguf`, and without what follows its first `.` (the quantization), so that
    /// `SmolLM2-135M-Instruct.Q4_1.gguf` is served as `SmolLM2-135M-Instruct` too.
    pub fn with_model_file(mut self, path: Option<&std::path::Path>) -> App {
        let Some(file) = path.and_then(|p| p.file_name()).and_then(|f| f.to_str()) else {
            return self;
        };
        let stem = file.strip_suffix(".gguf").unwrap_or(file);
        let base = stem.split('.').next().unwrap_or(stem);
        for name in [file, stem, base] {
            if !name.is_empty() && !self.aliases.iter().any(|a| a == name) {
                self.aliases.push(name.to_owned());
            }
        }
        self
    }

    /// Checks the request's `model`: the model id the workers register under, its name (the
    /// part before the first `:`), or a name of the model file.
    fn check_model(&self, asked: &str) -> Result<(), ApiError> {
        let id = self.codec.model_id();
        let name = id.split(':').next().unwrap_or(id);
        if asked == id || asked == name || self.aliases.iter().any(|a| a == asked) {
            Ok(())
        } else {
            let mut served = vec![id];
            served.extend(self.aliases.iter().map(String::as_str));
            Err(ApiError::model_not_found(asked, &served))
        }
    }

    fn head(&self, kind: Kind) -> Head {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let prefix = match kind {
            Kind::Completion => "cmpl",
            Kind::Chat => "chatcmpl",
        };
        Head {
            kind,
            id: format!("{prefix}-{n:016x}"),
            created: unix_now(),
            model: self.codec.model_id().to_owned(),
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The routes.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(|uri: Uri| async move { ApiError::not_found(uri.path()) })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(app)
}

/// 200 when kvctld answers and has a prefill and a decode worker taking requests, running
/// the model openaid tokenizes for; 503 naming what is missing otherwise.
async fn health(State(app): State<Arc<App>>) -> Response {
    let kvctld = app.kvctld.clone();
    let status = tokio::task::spawn_blocking(move || {
        kvctld.connect(CONNECT_TIMEOUT).and_then(|mut c| c.status())
    })
    .await;
    let unavailable = |reason: String| {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "unavailable", "reason": reason})),
        )
            .into_response()
    };
    let status = match status {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return unavailable(format!("kvctld: {}", libkv::error_chain(&e))),
        Err(e) => return unavailable(format!("status query failed: {e}")),
    };
    let serving = |role| {
        status
            .workers
            .iter()
            .filter(|w| w.role == role && w.connected && !w.drain)
            .count()
    };
    let (prefill, decode) = (serving(Role::Prefill), serving(Role::Decode));
    let model = app.codec.model_id();
    if let Some(theirs) = status.model.as_deref()
        && theirs != model
    {
        return unavailable(format!(
            "the workers run {theirs:?}, but openaid tokenizes for {model:?} (its [model])"
        ));
    }
    if prefill == 0 || decode == 0 {
        return unavailable(format!(
            "{prefill} prefill and {decode} decode workers take requests; each role needs one"
        ));
    }
    Json(json!({
        "status": "ok",
        "model": model,
        "prefill_workers": prefill,
        "decode_workers": decode,
    }))
    .into_response()
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = app.tenant_of(&headers) {
        return e.into_response();
    }
    Json(json!({
        "object": "list",
        "data": [{
            "id": app.codec.model_id(),
            "object": "model",
            "created": app.started,
            "owned_by": "kvfence",
            "max_model_len": app.max_context,
        }],
    }))
    .into_response()
}

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad_body(format!("the body: {e}")))
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    let prepared = (|| {
        let tenant = app.tenant_of(&headers)?;
        let req: CompletionRequest = parse(&body)?;
        req.common.check_supported()?;
        if req.echo == Some(true) {
            return Err(ApiError::invalid("echo", "echo is not supported"));
        }
        app.check_model(&req.model)?;
        let prompt = match req.prompt {
            Prompt::Text(t) => app.codec.encode(&t),
            Prompt::Texts(t) if t.len() == 1 => app.codec.encode(&t[0]),
            Prompt::Texts(t) => {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("{} prompts in one request; send one", t.len()),
                ));
            }
            Prompt::Tokens(t) => {
                let vocab = app.codec.vocab_size();
                if let Some(bad) = t.iter().find(|&&id| id as usize >= vocab) {
                    return Err(ApiError::invalid(
                        "prompt",
                        format!("token id {bad} is outside the vocabulary of {vocab}"),
                    ));
                }
                t
            }
        };
        let max_tokens = req.max_tokens.unwrap_or(16);
        Ok((tenant, prompt, max_tokens, req.common))
    })();
    match prepared {
        Ok((tenant, prompt, max_tokens, common)) => {
            run(app, Kind::Completion, tenant, prompt, max_tokens, &common).await
        }
        Err(e) => e.into_response(),
    }
}

async fn chat_completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let prepared = (|| {
        let tenant = app.tenant_of(&headers)?;
        let req: ChatRequest = parse(&body)?;
        req.common.check_supported()?;
        app.check_model(&req.model)?;
        if req.messages.is_empty() {
            return Err(ApiError::invalid("messages", "no messages"));
        }
        let messages = req
            .messages
            .iter()
            .map(crate::api::ChatMessage::to_message)
            .collect::<Result<Vec<_>, _>>()?;
        let prompt = app
            .codec
            .encode_chat(&messages)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        let max_tokens = req
            .max_completion_tokens
            .or(req.max_tokens)
            .unwrap_or(app.default_chat_max_tokens);
        Ok((tenant, prompt, max_tokens, req.common))
    })();
    match prepared {
        Ok((tenant, prompt, max_tokens, common)) => {
            run(app, Kind::Chat, tenant, prompt, max_tokens, &common).await
        }
        Err(e) => e.into_response(),
    }
}

/// `temperature` (default 1, as OpenAI's), `top_p` (default 1) and `seed` as kvctld's
/// fixed-point sampling. Without a seed a sampled request draws one.
fn sampling(common: &Common, fresh_seed: u64) -> Result<Sampling, ApiError> {
    let temperature = common.temperature.unwrap_or(1.0);
    let max_t = f64::from(MAX_TEMPERATURE_MILLI) / 1000.0;
    if !temperature.is_finite() || !(0.0..=max_t).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature",
            format!("temperature {temperature} is not between 0 and {max_t}"),
        ));
    }
    let top_p = common.top_p.unwrap_or(1.0);
    if !top_p.is_finite() || top_p <= 0.0 || top_p > 1.0 {
        return Err(ApiError::invalid(
            "top_p",
            format!("top_p {top_p} is not in (0, 1]"),
        ));
    }
    // Both are in range, so the products fit.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let (temperature_milli, top_p_milli) = (
        (temperature * 1000.0).round() as u32,
        ((top_p * 1000.0).round() as u32).max(1),
    );
    Ok(Sampling {
        temperature_milli,
        top_p_milli,
        seed: common.seed.map_or(fresh_seed, i64::cast_unsigned),
    })
}

/// What the client thread reports.
enum Update {
    Tokens(Vec<u32>),
    Done,
    Failed(ClientError),
}

/// Submits the request and answers: the whole response, or a stream of chunks.
async fn run(
    app: Arc<App>,
    kind: Kind,
    tenant: String,
    prompt: Vec<u32>,
    max_tokens: u32,
    common: &Common,
) -> Response {
    let head = app.head(kind);
    let seed = head.created ^ app.next_id.load(Ordering::Relaxed).rotate_left(17);
    let sampling = match sampling(common, seed) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    if prompt.is_empty() {
        return ApiError::invalid("prompt", "the prompt is empty").into_response();
    }
    if max_tokens == 0 {
        return ApiError::invalid("max_tokens", "max_tokens is 0").into_response();
    }
    let Ok(permit) = app.in_flight.clone().try_acquire_owned() else {
        return ApiError::busy(app.max_requests).into_response();
    };
    let prompt_len = prompt.len();
    let submit = Submit {
        tenant: tenant.clone(),
        prompt,
        max_new_tokens: max_tokens,
        deadline_ms: u32::try_from(app.request_deadline.as_millis()).unwrap_or(u32::MAX),
        sampling,
    };
    let (tx, mut rx) = mpsc::channel(CHANNEL_DEPTH);
    let kvctld = app.kvctld.clone();
    let deadline = app.request_deadline;
    let id = head.id.clone();
    let started = Instant::now();
    // The watcher: cancels the request as soon as the response side drops the channel
    // (hyper drops a handler whose connection closed), and ends when the client thread does.
    let (canceller_tx, canceller_rx) = oneshot::channel::<Canceller>();
    let (finished_tx, finished_rx) = oneshot::channel::<()>();
    let watched = tx.clone();
    tokio::spawn(async move {
        let Ok(canceller) = canceller_rx.await else {
            return;
        };
        tokio::select! {
            () = watched.closed() => canceller.cancel(),
            _ = finished_rx => {}
        }
    });
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let _finished = finished_tx;
        let result = kvctld.connect(CONNECT_TIMEOUT).and_then(|mut client| {
            client.set_default_deadline(deadline);
            if let Ok(c) = client.canceller() {
                let _ = canceller_tx.send(c);
            }
            client.submit(submit, |tokens| {
                tx.blocking_send(Update::Tokens(tokens.to_vec())).is_ok()
            })
        });
        match &result {
            Ok(out) => log::info!(
                "{id}: tenant {tenant}: {prompt_len} prompt tokens, {} generated by {} in {} ms",
                out.tokens.len(),
                out.pair,
                started.elapsed().as_millis()
            ),
            Err(ClientError::Cancelled) => log::info!(
                "{id}: tenant {tenant}: the client went away after {} ms; request abandoned",
                started.elapsed().as_millis()
            ),
            Err(e) => log::warn!("{id}: tenant {tenant}: {}", libkv::error_chain(e)),
        }
        let _ = tx.blocking_send(match result {
            Ok(_) => Update::Done,
            Err(e) => Update::Failed(e),
        });
    });
    let first = match rx.recv().await {
        Some(Update::Failed(e)) => return ApiError::from_client(&e).into_response(),
        Some(u) => u,
        None => {
            return ApiError::from_client(&ClientError::Closed {
                while_doing: "running the request",
            })
            .into_response();
        }
    };
    let reply = Reply {
        app,
        head,
        text: TextStream::default(),
        generated: 0,
        prompt_len,
        max_tokens,
        include_usage: common.include_usage(),
        first_chunk: true,
    };
    if common.stream() {
        stream(reply, first, rx).into_response()
    } else {
        whole(reply, first, rx).await
    }
}

/// One request's answer as it is being built.
struct Reply {
    app: Arc<App>,
    head: Head,
    text: TextStream,
    generated: usize,
    prompt_len: usize,
    max_tokens: u32,
    include_usage: bool,
    first_chunk: bool,
}

impl Reply {
    fn add(&mut self, tokens: &[u32]) -> String {
        self.generated += tokens.len();
        let bytes = self.app.codec.decode(tokens);
        self.text.push(&bytes)
    }

    /// `length` when generation ran to `max_tokens`, `stop` when the model ended its turn.
    fn finish_reason(&self) -> &'static str {
        if self.generated >= self.max_tokens as usize {
            "length"
        } else {
            "stop"
        }
    }

    fn usage(&self) -> Usage {
        Usage::new(self.prompt_len, self.generated)
    }
}

async fn whole(mut reply: Reply, first: Update, mut rx: mpsc::Receiver<Update>) -> Response {
    let mut text = String::new();
    let mut update = Some(first);
    loop {
        let next = match update.take() {
            Some(u) => Some(u),
            None => rx.recv().await,
        };
        match next {
            Some(Update::Tokens(t)) => text.push_str(&reply.add(&t)),
            Some(Update::Done) => break,
            Some(Update::Failed(e)) => return ApiError::from_client(&e).into_response(),
            None => {
                return ApiError::from_client(&ClientError::Closed {
                    while_doing: "running the request",
                })
                .into_response();
            }
        }
    }
    text.push_str(&reply.text.finish());
    Json(
        reply
            .head
            .response(&text, reply.finish_reason(), reply.usage()),
    )
    .into_response()
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

/// The chunks of a streamed answer: one per batch of tokens, then the last chunk with the
/// finish reason, the usage chunk if asked for, and `[DONE]`; or, after a failure, an
/// `{"error": ...}` event and the end of the stream.
fn stream(
    reply: Reply,
    first: Update,
    rx: mpsc::Receiver<Update>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    struct S {
        reply: Reply,
        rx: mpsc::Receiver<Update>,
        out: VecDeque<SseEvent>,
        ended: bool,
    }
    impl S {
        fn on(&mut self, update: Option<Update>) {
            let r = &mut self.reply;
            match update {
                Some(Update::Tokens(t)) => {
                    let text = r.add(&t);
                    let first = std::mem::replace(&mut r.first_chunk, false);
                    if first || !text.is_empty() {
                        self.out.push_back(data(&r.head.chunk(&text, first, None)));
                    }
                }
                Some(Update::Done) => {
                    let rest = r.text.finish();
                    let first = std::mem::replace(&mut r.first_chunk, false);
                    let finish = r.finish_reason();
                    self.out
                        .push_back(data(&r.head.chunk(&rest, first, Some(finish))));
                    if r.include_usage {
                        self.out.push_back(data(&r.head.usage_chunk(r.usage())));
                    }
                    self.out.push_back(SseEvent::default().data("[DONE]"));
                    self.ended = true;
                }
                Some(Update::Failed(e)) => {
                    self.out.push_back(data(&ApiError::from_client(&e).body()));
                    self.ended = true;
                }
                None => {
                    let e = ClientError::Closed {
                        while_doing: "running the request",
                    };
                    self.out.push_back(data(&ApiError::from_client(&e).body()));
                    self.ended = true;
                }
            }
        }
    }
    let mut s = S {
        reply,
        rx,
        out: VecDeque::new(),
        ended: false,
    };
    s.on(Some(first));
    Sse::new(futures_util::stream::unfold(s, |mut s| async move {
        loop {
            if let Some(e) = s.out.pop_front() {
                return Some((Ok(e), s));
            }
            if s.ended {
                return None;
            }
            let update = s.rx.recv().await;
            s.on(update);
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_follows_openai_defaults_and_ranges() {
        let c = Common::default();
        let s = sampling(&c, 7).unwrap();
        assert_eq!(
            (s.temperature_milli, s.top_p_milli, s.seed),
            (1000, 1000, 7)
        );
        let c = Common {
            temperature: Some(0.0),
            seed: Some(-1),
            top_p: Some(0.0004),
            ..Common::default()
        };
        let s = sampling(&c, 7).unwrap();
        assert_eq!(
            (s.temperature_milli, s.top_p_milli, s.seed),
            (0, 1, u64::MAX)
        );
        for bad in [
            Common {
                temperature: Some(2.5),
                ..Common::default()
            },
            Common {
                temperature: Some(f64::NAN),
                ..Common::default()
            },
            Common {
                top_p: Some(0.0),
                ..Common::default()
            },
        ] {
            assert!(sampling(&bad, 0).is_err(), "{bad:?}");
        }
    }
}
