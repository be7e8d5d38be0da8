//! A Llama-architecture model runner over kvfence pages.
//!
//! - [`gguf`]: the GGUF file format (metadata and tensors) and exact dequantization of the
//!   tensor types a model file holds.
//! - [`weights`]: the model's hyper-parameters and its weights, dequantized to f32, and the
//!   quantized blocks ([`quant`]) decode multiplies.
//! - [`tokenizer`]: byte-level BPE from the GGUF vocabulary; [`chat`]: the ChatML template.
//! - [`load`]: the runner and tokenizer a worker's `[model]` section names.
//! - [`codec`]: text to tokens and back for clients of the served model (kvctl, openaid).
//! - [`runner`]: the forward pass behind libkv's `ModelRunner`, prefilling into pages and
//!   decoding from them; [`sample`]: greedy or seeded sampling of the next token.
//! - [`layout`]: the page order kvfence chose and the one it did not, with the runner's page
//!   reads and writes in each, for `kvllmbench layout`.

mod attend;
pub mod chat;
pub mod codec;
pub mod gguf;
mod int8;
pub mod layout;
pub mod load;
mod math;
pub mod quant;
pub mod runner;
pub mod sample;
pub mod tokenizer;
pub mod weights;

pub use load::{LoadError, LoadedModel, load, worker_runner};
