//! openaid: an OpenAI-compatible HTTP endpoint in front of kvctld.
//!
//! `POST /v1/completions` and `POST /v1/chat/completions`, streamed as server-sent events
//! or whole; `GET /v1/models` (the model the workers run) and `GET /health` (whether kvctld
//! has a prefill and a decode worker taking requests). openaid is one more client of
//! kvctld's control socket: it turns text into the model's tokens (the tokenizer and chat
//! template of `[model]`), submits them, and turns the tokens back into text. Admission,
//! pages and verification stay with kvctld and the workers; every failure they report
//! becomes an HTTP status and an OpenAI-style error body ([`errors`]).
//!
//! - [`api`]: the request and response bodies.
//! - [`errors`]: kvfence's failures as HTTP errors.
//! - [`keys`]: the API key file, which maps keys to tenants.
//! - [`server`]: the routes and how a request runs.

pub mod api;
pub mod errors;
pub mod keys;
pub mod server;
