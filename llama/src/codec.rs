//! Text to tokens and back, for clients of the served model (`kvctl`, `openaid`): the GGUF
//! model's tokenizer and chat template, or bytes for the reference model. Only the
//! tokenizer is read from the file; the weights stay with the workers.

use crate::chat::{self, ChatError, Message};
use crate::load::{LoadError, load_tokenizer};
use crate::tokenizer::Tokenizer;
use libkv::config::{ModelConfig, ModelKind};

/// Why a [`Codec`] could not be built or could not encode.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error(
        "model.kind is \"engine\": the engine tokenizes (kvctl and openaid speak only to \
         kvfence's own models; use the engine's front, kvfence.proxy)"
    )]
    Engine,
    /// `kind = "gguf"` without a file.
    #[error("[model] kind is \"gguf\" but path is not set")]
    NoPath,
    /// The GGUF file's tokenizer could not be read.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The model's chat template cannot be built from its vocabulary.
    #[error("chat template: {0}")]
    Chat(#[from] ChatError),
}

/// Text to tokens and back: bytes for the reference model, the GGUF model's tokenizer
/// otherwise.
#[derive(Debug)]
pub enum Codec {
    /// The reference model: a token is a byte.
    Bytes,
    /// A GGUF model's tokenizer, with the model id the workers register under.
    Gguf {
        tokenizer: Box<Tokenizer>,
        model_id: String,
    },
}

impl Codec {
    /// The codec of `[model]`.
    pub fn from_model(model: &ModelConfig) -> Result<Codec, CodecError> {
        match (model.kind, &model.path) {
            (ModelKind::Reference, _) => Ok(Codec::Bytes),
            (ModelKind::Gguf, None) => Err(CodecError::NoPath),
            (ModelKind::Engine, _) => Err(CodecError::Engine),
            (ModelKind::Gguf, Some(path)) => {
                let (tokenizer, model_id) = load_tokenizer(path)?;
                Ok(Codec::Gguf {
                    tokenizer: Box::new(tokenizer),
                    model_id,
                })
            }
        }
    }

    /// The id the workers of this model register under (`reference` for the reference
    /// model).
    pub fn model_id(&self) -> &str {
        match self {
            Codec::Bytes => libkv::model::REFERENCE_MODEL,
            Codec::Gguf { model_id, .. } => model_id,
        }
    }

    /// How many token ids there are (ids are below it).
    pub fn vocab_size(&self) -> usize {
        match self {
            Codec::Bytes => 256,
            Codec::Gguf { tokenizer, .. } => tokenizer.vocab_size(),
        }
    }

    /// Plain `text` as tokens, control-token texts in it encoded as plain characters.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match self {
            Codec::Bytes => libkv::model::tokenize(text.as_bytes()),
            Codec::Gguf { tokenizer, .. } => tokenizer.encode(text, false),
        }
    }

    /// `messages` in the model's chat template, ending with the opening of the assistant's
    /// turn. The reference model has no template: it takes the contents, one per line.
    pub fn encode_chat(&self, messages: &[Message]) -> Result<Vec<u32>, CodecError> {
        match self {
            Codec::Bytes => {
                let text: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
                Ok(libkv::model::tokenize(text.join("\n").as_bytes()))
            }
            Codec::Gguf { tokenizer, .. } => Ok(chat::encode_chat(tokenizer, messages, true)?),
        }
    }

    /// Tokens as bytes (UTF-8 for text; a character may be split between two calls, which
    /// [`TextStream`] handles).
    pub fn decode(&self, tokens: &[u32]) -> Vec<u8> {
        match self {
            Codec::Bytes => tokens
                .iter()
                .map(|&t| u8::try_from(t).unwrap_or(b'?'))
                .collect(),
            Codec::Gguf { tokenizer, .. } => tokenizer.decode(tokens),
        }
    }
}

/// Output bytes as text while they arrive: [`TextStream::push`] returns what is complete
/// UTF-8 and holds back the start of a character the next token finishes. Bytes that can
/// never be UTF-8 come out as U+FFFD.
#[derive(Debug, Default)]
pub struct TextStream {
    pending: Vec<u8>,
}

impl TextStream {
    /// The text `bytes` complete, after what was held back.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // An incomplete character at the end: wait for the rest.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// What is still held back, as text (the output ended inside a character).
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_character_split_between_pushes_comes_out_whole() {
        let mut s = TextStream::default();
        let e = "é".as_bytes();
        assert_eq!(s.push(b"caf"), "caf");
        assert_eq!(s.push(&e[..1]), "");
        assert_eq!(s.push(&e[1..]), "é");
        assert_eq!(s.finish(), "");
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut s = TextStream::default();
        assert_eq!(s.push(b"a\xffb"), "a\u{fffd}b");
        assert_eq!(s.push(b"\xe6\x9d"), "");
        assert_eq!(s.finish(), "\u{fffd}");
    }

    proptest! {
        /// However a valid text is cut into pushes, the pieces join to the text.
        #[test]
        fn pieces_join_to_the_text(text in "\\PC{0,40}", cuts in proptest::collection::vec(0usize..200, 0..8)) {
            let bytes = text.as_bytes();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut s = TextStream::default();
            let (mut out, mut at) = (String::new(), 0);
            for c in cuts.into_iter().chain([bytes.len()]) {
                out.push_str(&s.push(&bytes[at..c]));
                at = c;
            }
            out.push_str(&s.finish());
            prop_assert_eq!(out, text);
        }
    }
}
