//! The OpenAI request and response bodies openaid speaks: what it reads of a request, and
//! the JSON it answers with. Parameters it does not implement are refused when they ask for
//! behaviour (`n` > 1, `stop`, penalties, `logprobs`, `response_format`, `tools`,
//! `logit_bias`, `suffix`, `best_of`, any parameter it does not know), never silently
//! ignored.

use crate::errors::ApiError;
use llama::chat::Message;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    /// OpenAI's default is 16.
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(flatten)]
    pub common: Common,
    #[serde(default)]
    pub echo: Option<bool>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    #[serde(flatten)]
    pub common: Common,
}

/// What both endpoints take.
#[derive(Debug, Default, Deserialize)]
pub struct Common {
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub stop: Option<Value>,
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
    #[serde(default)]
    pub logprobs: Option<Value>,
    #[serde(default)]
    pub user: Option<String>,
    /// Every other parameter of the request: refused unless it asks for nothing
    /// ([`Common::check_supported`]).
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// A completion prompt: a string, one string in an array, or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

/// A chat message; `content` is a string or an array of text parts.
#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

impl ChatMessage {
    /// The message for the chat template: a known role and its text.
    pub fn to_message(&self) -> Result<Message, ApiError> {
        if !matches!(
            self.role.as_str(),
            "system" | "developer" | "user" | "assistant"
        ) {
            return Err(ApiError::invalid(
                "messages",
                format!(
                    "role {:?} is not one of system, developer, user, assistant",
                    self.role
                ),
            ));
        }
        let content = match &self.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(
                                "messages",
                                format!("content parts of type {:?} are not supported", p.kind),
                            ));
                        }
                    }
                }
                text
            }
        };
        // The template knows system, user and assistant; a developer message is a system
        // message, as OpenAI defines it.
        let role = if self.role == "developer" {
            "system"
        } else {
            self.role.as_str()
        };
        Ok(Message::new(role, content))
    }
}

impl Common {
    /// Refuses what openaid does not implement, naming the parameter.
    pub fn check_supported(&self) -> Result<(), ApiError> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid("n", "only n = 1 is supported"));
        }
        let stop_given = match &self.stop {
            None | Some(Value::Null) => false,
            Some(Value::Array(a)) => !a.is_empty(),
            Some(_) => true,
        };
        if stop_given {
            return Err(ApiError::invalid(
                "stop",
                "stop sequences are not supported; generation stops at the model's end-of-turn \
                 token or max_tokens",
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if v.is_some_and(|v| v != 0.0) {
                return Err(ApiError::invalid(name, format!("{name} is not supported")));
            }
        }
        if matches!(&self.logprobs, Some(v) if !v.is_null() && *v != Value::Bool(false)) {
            return Err(ApiError::invalid("logprobs", "logprobs are not supported"));
        }
        for (name, v) in &self.other {
            if let Some(why) = unsupported(name, v) {
                return Err(ApiError::invalid(name, why));
            }
        }
        Ok(())
    }

    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

/// Why the parameter `name` (one openaid does not read) cannot be honoured with the value
/// `v`, or `None` when `v` asks for what openaid does anyway: null, empty, the default.
fn unsupported(name: &str, v: &Value) -> Option<String> {
    let empty = match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(t) => t.is_empty(),
        _ => false,
    };
    if empty {
        return None;
    }
    let why = match name {
        "response_format" if v.get("type") == Some(&json!("text")) => return None,
        "response_format" => {
            "structured output is not supported: the answer is plain text (only \
             {\"type\": \"text\"})"
        }
        "tools" | "functions" => "tool calls are not supported",
        "tool_choice" | "function_call" if *v == json!("none") => return None,
        "tool_choice" | "function_call" => "tool calls are not supported",
        "parallel_tool_calls" if *v == json!(false) => return None,
        "logit_bias" => "logit_bias is not supported",
        "suffix" => "suffix (text after the completion) is not supported",
        "best_of" if *v == json!(1) => return None,
        "best_of" => "only best_of = 1 is supported",
        "top_logprobs" if *v == json!(0) => return None,
        "top_logprobs" => "logprobs are not supported",
        "store" if *v == json!(false) => return None,
        // Labels for the caller's own records: nothing to do.
        "metadata" => return None,
        _ => return Some(format!("{name} is not supported")),
    };
    Some(why.to_owned())
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt: usize, completion: usize) -> Usage {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
        }
    }
}

/// Which of the two endpoints a response belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

/// The fields every response and chunk of one request shares.
#[derive(Clone, Debug)]
pub struct Head {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Head {
    /// The whole response of a request that is not streamed.
    pub fn response(&self, text: &str, finish: &str, usage: Usage) -> Value {
        let choice = match self.kind {
            Kind::Completion => json!({
                "index": 0, "text": text, "finish_reason": finish, "logprobs": null,
            }),
            Kind::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
                "logprobs": null,
            }),
        };
        json!({
            "id": self.id,
            "object": match self.kind {
                Kind::Completion => "text_completion",
                Kind::Chat => "chat.completion",
            },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        })
    }

    /// One streamed chunk: `text` so far unsent (the chat's first chunk also names the
    /// role), and the finish reason on the last one.
    pub fn chunk(&self, text: &str, first: bool, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Completion => json!({
                "index": 0, "text": text, "finish_reason": finish, "logprobs": null,
            }),
            Kind::Chat => {
                let delta = match (first, finish) {
                    (true, _) => json!({"role": "assistant", "content": text}),
                    (false, Some(_)) if text.is_empty() => json!({}),
                    _ => json!({"content": text}),
                };
                json!({"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null})
            }
        };
        self.envelope(json!([choice]))
    }

    /// The usage chunk of `stream_options.include_usage`: no choices.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        let mut v = self.envelope(json!([]));
        v["usage"] = serde_json::to_value(usage).unwrap_or(Value::Null);
        v
    }

    fn envelope(&self, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": match self.kind {
                Kind::Completion => "text_completion",
                Kind::Chat => "chat.completion.chunk",
            },
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_parameters_are_refused_by_name() {
        let req: ChatRequest = serde_json::from_value(json!({
            "model": "m", "messages": [], "stop": ["\n"],
        }))
        .unwrap();
        let e = req.common.check_supported().unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop"));
        let req: ChatRequest = serde_json::from_value(json!({
            "model": "m", "messages": [], "n": 2,
        }))
        .unwrap();
        assert_eq!(
            req.common.check_supported().unwrap_err().param.as_deref(),
            Some("n")
        );
        let ok: ChatRequest = serde_json::from_value(json!({
            "model": "m", "messages": [], "n": 1, "stop": null, "presence_penalty": 0,
            "logprobs": false,
        }))
        .unwrap();
        ok.common.check_supported().unwrap();
    }

    #[test]
    fn parameters_openaid_does_not_read_are_refused_unless_they_ask_for_nothing() {
        let refused = [
            ("response_format", json!({"type": "json_object"})),
            (
                "tools",
                json!([{"type": "function", "function": {"name": "f"}}]),
            ),
            ("tool_choice", json!("auto")),
            ("logit_bias", json!({"50256": -100})),
            ("suffix", json!(" the end")),
            ("best_of", json!(3)),
            ("top_logprobs", json!(2)),
            ("guided_json", json!({"type": "object"})),
        ];
        for (name, v) in refused {
            let mut body = json!({"model": "m", "prompt": "hi"});
            body[name] = v.clone();
            let req: CompletionRequest = serde_json::from_value(body).unwrap();
            let e = req
                .common
                .check_supported()
                .expect_err(&format!("{name} = {v} was accepted"));
            assert_eq!(e.param.as_deref(), Some(name), "{name} = {v}");
        }
        let harmless = json!({
            "model": "m", "messages": [], "response_format": {"type": "text"}, "tools": [],
            "tool_choice": "none", "logit_bias": {}, "suffix": "", "best_of": 1,
            "metadata": {"run": "a"}, "store": false, "user": "u", "seed": 1,
        });
        let req: ChatRequest = serde_json::from_value(harmless).unwrap();
        assert!(req.common.other.keys().all(|k| k != "user" && k != "seed"));
        req.common.check_supported().unwrap();
        // The endpoints' own fields are theirs, not unknown.
        let req: CompletionRequest = serde_json::from_value(
            json!({"model": "m", "prompt": "hi", "max_tokens": 3, "echo": false}),
        )
        .unwrap();
        assert!(req.common.other.is_empty(), "{:?}", req.common.other);
        req.common.check_supported().unwrap();
    }

    #[test]
    fn message_content_may_be_text_parts() {
        let m: ChatMessage = serde_json::from_value(json!({
            "role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        }))
        .unwrap();
        assert_eq!(m.to_message().unwrap().content, "ab");
        let m: ChatMessage = serde_json::from_value(json!({
            "role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}],
        }))
        .unwrap();
        assert!(m.to_message().is_err());
        let m: ChatMessage =
            serde_json::from_value(json!({"role": "tool", "content": "x"})).unwrap();
        assert!(m.to_message().is_err());
    }

    #[test]
    fn prompts_are_text_or_tokens() {
        let p: Prompt = serde_json::from_value(json!("hi")).unwrap();
        assert!(matches!(p, Prompt::Text(t) if t == "hi"));
        let p: Prompt = serde_json::from_value(json!([1, 2])).unwrap();
        assert!(matches!(p, Prompt::Tokens(t) if t == [1, 2]));
        let p: Prompt = serde_json::from_value(json!(["a"])).unwrap();
        assert!(matches!(p, Prompt::Texts(t) if t == ["a"]));
    }

    #[test]
    fn the_first_chat_chunk_names_the_role_and_the_last_the_reason() {
        let h = Head {
            kind: Kind::Chat,
            id: "chatcmpl-1".into(),
            created: 1,
            model: "m".into(),
        };
        let first = h.chunk("Hi", true, None);
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(first["object"], "chat.completion.chunk");
        let last = h.chunk("", false, Some("stop"));
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        let usage = h.usage_chunk(Usage::new(3, 2));
        assert_eq!(usage["usage"]["total_tokens"], 5);
        assert_eq!(usage["choices"], json!([]));
    }
}
