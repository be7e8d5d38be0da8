//! The tokenizer and chat template on the real SmolLM2 vocabulary, against token ids that
//! llama.cpp computed (`tests/fixtures/tokenizer_llamacpp.json`). The model file is
//! [`llama::gguf::default_model_path`] (`$KVFENCE_MODEL` to override); where it is absent
//! the tests that need it say so and pass.

use std::path::PathBuf;
use std::sync::OnceLock;

use llama::chat::{self, Message};
use llama::gguf::Gguf;
use llama::tokenizer::{TokenType, Tokenizer};
use proptest::prelude::*;

/// One fixture case: `text` encoded with `special` (parse special tokens) gives `ids`.
struct Case {
    text: String,
    special: bool,
    ids: Vec<u32>,
}

fn fixture() -> Vec<Case> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer_llamacpp.json");
    let raw = std::fs::read_to_string(&path).expect("read the fixture");
    let json: serde_json::Value = serde_json::from_str(&raw).expect("parse the fixture");
    json["cases"]
        .as_array()
        .expect("fixture cases")
        .iter()
        .map(|c| Case {
            text: c["text"].as_str().expect("case text").to_owned(),
            special: c["special"].as_bool().expect("case special"),
            ids: c["ids"]
                .as_array()
                .expect("case ids")
                .iter()
                .map(|id| u32::try_from(id.as_u64().expect("id")).expect("id fits u32"))
                .collect(),
        })
        .collect()
}

/// The real tokenizer, loaded once; `None` (after saying so) when the model file is absent.
fn tokenizer() -> Option<&'static Tokenizer> {
    static TOKENIZER: OnceLock<Option<Tokenizer>> = OnceLock::new();
    TOKENIZER
        .get_or_init(|| {
            let path = llama::gguf::default_model_path();
            if !path.exists() {
                eprintln!(
                    "skipped: model file {} is absent (set KVFENCE_MODEL to run against it)",
                    path.display()
                );
                return None;
            }
            let gguf = Gguf::open(&path).expect("open the model file");
            Some(Tokenizer::from_gguf(&gguf).expect("build the tokenizer"))
        })
        .as_ref()
}

#[test]
fn fixture_is_well_formed() {
    let cases = fixture();
    assert!(cases.len() >= 30, "{} cases", cases.len());
    assert!(cases.iter().all(|c| !c.ids.is_empty()));
    assert!(cases.iter().any(|c| c.special) && cases.iter().any(|c| !c.special));
}

#[test]
fn encodes_as_llamacpp_does() {
    let Some(tok) = tokenizer() else { return };
    for case in fixture() {
        let ids = tok.encode(&case.text, case.special);
        assert_eq!(ids, case.ids, "{:?} (special: {})", case.text, case.special);
        assert_eq!(tok.decode(&ids), case.text.as_bytes(), "{:?}", case.text);
    }
}

#[test]
fn chat_prompt_matches_llamacpp() {
    let Some(tok) = tokenizer() else { return };
    let messages = [Message::user("What is the capital of France?")];
    let text = chat::chatml(&messages, true);
    let expected = fixture()
        .into_iter()
        .find(|c| c.special && c.text == text)
        .expect("the fixture holds the ChatML prompt");
    let ids = chat::encode_chat(tok, &messages, true).expect("encode the chat");
    assert_eq!(ids, expected.ids);
    assert_eq!(ids[0], 1);
}

#[test]
fn vocabulary_is_smollm2s() {
    let Some(tok) = tokenizer() else { return };
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!((tok.bos(), tok.eos()), (Some(1), 2));
    assert_eq!(tok.id_of("<|endoftext|>"), Some(0));
    assert_eq!(tok.id_of("<|im_start|>"), Some(1));
    assert_eq!(tok.id_of("<|im_end|>"), Some(2));
    assert_eq!(tok.token_type(2), Some(TokenType::Control));
    assert!((0..17).all(|id| tok.is_special(id)));
    assert!(!tok.is_special(17));
    assert_eq!(chat::stop_tokens(tok), [2]);
    assert_eq!(tok.token_text(216), Some("Ġ"));
    assert_eq!(tok.token_bytes(216), Some(&b" "[..]));
}

/// Whether SmolLM2's vocabulary can spell `c`: it has no token for the bytes of six C0
/// controls, nor for the UTF-8 lead bytes F1 and F2 of planes 4 to 11 (all unassigned).
fn representable(c: char) -> bool {
    !matches!(
        c,
        '\u{4}' | '\u{6}' | '\u{13}' | '\u{14}' | '\u{16}' | '\u{1D}'
    ) && !('\u{40000}'..='\u{BFFFF}').contains(&c)
}

#[test]
fn unrepresentable_bytes_are_dropped() {
    let Some(tok) = tokenizer() else { return };
    // The control splits the word, then vanishes (llama.cpp gives these ids too).
    let ids = tok.encode("a\u{4}b", false);
    assert_eq!(ids, [81, 82]);
    assert_eq!(tok.decode(&ids), b"ab");
    // Only the lead byte goes: the continuation bytes have tokens.
    let ids = tok.encode("\u{50000}", false);
    assert_eq!(ids, [234, 218, 218]);
    assert_eq!(tok.decode(&ids), "\u{50000}".as_bytes()[1..]);
}

proptest! {
    #[test]
    fn round_trips_representable_text(text in any::<String>().prop_filter("representable", |s| s.chars().all(representable))) {
        let Some(tok) = tokenizer() else { return Ok(()) };
        prop_assert_eq!(tok.decode(&tok.encode(&text, false)), text.as_bytes());
        prop_assert_eq!(tok.decode(&tok.encode(&text, true)), text.as_bytes());
    }
}
