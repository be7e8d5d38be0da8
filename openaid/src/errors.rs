//! kvfence's failures as HTTP statuses and OpenAI-style error bodies
//! (`{"error": {"message", "type", "param", "code"}}`). A request kvctld rejects is a 4xx
//! that says why; a temporary failure is a 503 or 504 with `Retry-After`, so clients retry
//! it; a failure inside the stack is a 5xx. Never a 200 with text.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvctld::client::ClientError;
use libkv::proto::ErrorCode;
use serde_json::{Value, json};

/// An error answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `server_error`, `overloaded_error`, `timeout_error`.
    pub kind: &'static str,
    /// A short machine-readable code.
    pub code: &'static str,
    pub message: String,
    /// The request parameter at fault, if one is.
    pub param: Option<String>,
    /// Seconds after which a retry may succeed (temporary failures).
    pub retry_after: Option<u32>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: String) -> Self {
        ApiError {
            status,
            kind,
            code,
            message,
            param: None,
            retry_after: None,
        }
    }

    /// A request openaid refuses itself: a bad or unsupported parameter.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.to_owned()),
            ..ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_request",
                message.into(),
            )
        }
    }

    /// A body that is not the JSON the endpoint takes.
    pub fn bad_body(message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_body",
            message.into(),
        )
    }

    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid_api_key",
            message.into(),
        )
    }

    /// `served`: the model's id first, then the other names it answers to.
    pub fn model_not_found(asked: &str, served: &[&str]) -> ApiError {
        let names = served
            .iter()
            .map(|n| format!("{n:?}"))
            .collect::<Vec<_>>()
            .join(" or ");
        ApiError {
            param: Some("model".into()),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found_error",
                "model_not_found",
                format!("the model {asked:?} is not served here; this endpoint serves {names}"),
            )
        }
    }

    pub fn not_found(path: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            "unknown_url",
            format!("no endpoint {path}"),
        )
    }

    /// Too many requests in flight at openaid itself.
    pub fn busy(limit: u32) -> ApiError {
        ApiError {
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded_error",
                "overloaded",
                format!("{limit} requests are in flight, the most [openai] max_requests allows"),
            )
        }
    }

    /// What `e`, the failure of a request through kvctld, means to an HTTP client.
    pub fn from_client(e: &ClientError) -> ApiError {
        let chain = libkv::error_chain(e);
        let temporary = |status, kind, code, message: String| ApiError {
            retry_after: Some(1),
            ..ApiError::new(status, kind, code, message)
        };
        match e {
            ClientError::Server { code, message } => {
                let message = message.clone();
                match code {
                    ErrorCode::Rejected => {
                        let code = if message.starts_with("prompt of") {
                            "context_length_exceeded"
                        } else if message.starts_with("max_new_tokens") {
                            "max_tokens_exceeded"
                        } else {
                            "request_too_large"
                        };
                        ApiError::new(
                            StatusCode::BAD_REQUEST,
                            "invalid_request_error",
                            code,
                            format!("rejected: {message}"),
                        )
                    }
                    ErrorCode::BadRequest => ApiError::new(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        "invalid_request",
                        message,
                    ),
                    ErrorCode::PoolFull => temporary(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "overloaded_error",
                        "pool_full",
                        message,
                    ),
                    ErrorCode::ShuttingDown => temporary(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "overloaded_error",
                        "shutting_down",
                        message,
                    ),
                    ErrorCode::WorkerLost => temporary(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "server_error",
                        "worker_lost",
                        message,
                    ),
                    ErrorCode::Timeout => temporary(
                        StatusCode::GATEWAY_TIMEOUT,
                        "timeout_error",
                        "timeout",
                        message,
                    ),
                    ErrorCode::VerifyFailed => ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "server_error",
                        "verification_failed",
                        format!(
                            "the request's KV pages failed verification, so decode refused them: \
                             {message}"
                        ),
                    ),
                    ErrorCode::Unauthorized => ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "server_error",
                        "control_plane_refused",
                        format!("kvctld refused this endpoint: {message}"),
                    ),
                    ErrorCode::Internal | ErrorCode::Misconfigured => ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "server_error",
                        "internal",
                        message,
                    ),
                }
            }
            ClientError::Connect { .. }
            | ClientError::Handshake { .. }
            | ClientError::HelloRefused { .. } => temporary(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "control_plane_unavailable",
                format!("cannot reach kvctld: {chain}"),
            ),
            ClientError::TimedOut { .. } => temporary(
                StatusCode::GATEWAY_TIMEOUT,
                "timeout_error",
                "timeout",
                chain,
            ),
            ClientError::InvalidRequest(_) => ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_request",
                chain,
            ),
            ClientError::Send { .. }
            | ClientError::Encode(_)
            | ClientError::Closed { .. }
            | ClientError::Recv(_)
            | ClientError::Unexpected { .. }
            | ClientError::BadReply { .. }
            | ClientError::Unusable
            | ClientError::Cancelled => ApiError::new(
                StatusCode::BAD_GATEWAY,
                "server_error",
                "control_plane_failed",
                chain,
            ),
        }
    }

    /// The `{"error": ...}` body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(code: ErrorCode, message: &str) -> ApiError {
        ApiError::from_client(&ClientError::Server {
            code,
            message: message.into(),
        })
    }

    #[test]
    fn a_rejection_is_a_4xx_that_says_why() {
        let e = server(
            ErrorCode::Rejected,
            "prompt of 5000 tokens exceeds the maximum context of 4096",
        );
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.code, "context_length_exceeded");
        assert!(e.message.contains("5000 tokens"), "{}", e.message);
        assert_eq!(e.retry_after, None);
        let e = server(
            ErrorCode::Rejected,
            "max_new_tokens 900 exceeds the limit of 256",
        );
        assert_eq!(
            (e.status, e.code),
            (StatusCode::BAD_REQUEST, "max_tokens_exceeded")
        );
    }

    #[test]
    fn temporary_failures_say_when_to_retry() {
        for (code, status) in [
            (ErrorCode::PoolFull, StatusCode::SERVICE_UNAVAILABLE),
            (ErrorCode::ShuttingDown, StatusCode::SERVICE_UNAVAILABLE),
            (ErrorCode::WorkerLost, StatusCode::SERVICE_UNAVAILABLE),
            (ErrorCode::Timeout, StatusCode::GATEWAY_TIMEOUT),
        ] {
            let e = server(code, "x");
            assert_eq!(e.status, status, "{code:?}");
            assert_eq!(e.retry_after, Some(1), "{code:?}");
        }
        let e = ApiError::from_client(&ClientError::TimedOut { waited_ms: 5 });
        assert_eq!(e.status, StatusCode::GATEWAY_TIMEOUT);
    }

    #[test]
    fn failures_inside_the_stack_are_5xx_and_never_retried_blindly() {
        for code in [
            ErrorCode::VerifyFailed,
            ErrorCode::Internal,
            ErrorCode::Misconfigured,
        ] {
            let e = server(code, "x");
            assert!(e.status.is_server_error(), "{code:?}");
            assert_eq!(e.retry_after, None, "{code:?}");
        }
        let e = ApiError::from_client(&ClientError::Closed { while_doing: "x" });
        assert_eq!(e.status, StatusCode::BAD_GATEWAY);
    }

    #[test]
    fn the_body_has_openais_shape() {
        let b = ApiError::invalid("n", "only n = 1").body();
        assert_eq!(b["error"]["param"], "n");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["message"], "only n = 1");
    }
}
