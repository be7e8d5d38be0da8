//! A small etcd v3 client over etcd's JSON gateway (HTTP/1.1 through hyper), for leadership
//! and membership: leases (grant, keep-alive, revoke), a put that succeeds only while the key
//! is absent (an election), and put, get, prefix range and delete.
//!
//! Blocking calls, each bounded by the client's timeout; the requests run on the runtime of
//! libkv's network helpers ([`crate::tls::runtime`]), so any thread may call. One TCP
//! connection per call: leadership and membership make a few calls a second at most.
//!
//! The gateway speaks JSON with keys and values in base64 and 64-bit integers as strings; it
//! accepts the protobuf field names (`create_revision`, `request_put`) this client sends and
//! answers with them.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use serde_json::{Value, json};
use std::time::Duration;

/// Why an etcd call failed.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("etcd at {endpoint}: {reason}")]
    Unreachable { endpoint: String, reason: String },
    #[error("etcd at {endpoint} answered {status} to {path}: {body}")]
    Status {
        endpoint: String,
        path: &'static str,
        status: u16,
        body: String,
    },
    #[error("etcd at {endpoint}: no answer to {path} within {} ms", timeout.as_millis())]
    Timeout {
        endpoint: String,
        path: &'static str,
        timeout: Duration,
    },
    #[error("etcd at {endpoint}: unexpected answer to {path}: {body}")]
    Unexpected {
        endpoint: String,
        path: &'static str,
        body: String,
    },
}

/// A lease's id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LeaseId(pub i64);

/// A key's value and revisions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub create_revision: i64,
    pub mod_revision: i64,
    pub lease: Option<LeaseId>,
}

/// A client of one etcd endpoint (`HOST:PORT` of its client URL, plain HTTP).
#[derive(Clone, Debug)]
pub struct Etcd {
    endpoint: String,
    timeout: Duration,
}

/// An int64 of the gateway: a string, a number, or absent (zero).
fn int(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

fn b64(v: &[u8]) -> String {
    B64.encode(v)
}

/// The key just past every key that starts with `prefix` (etcd's range end for a prefix).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // every byte 0xff, or empty: to the end of the keyspace
    vec![0]
}

impl Etcd {
    pub fn new(endpoint: impl Into<String>, timeout: Duration) -> Etcd {
        Etcd {
            endpoint: endpoint.into(),
            timeout,
        }
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// POSTs `body` to `path` and returns the JSON answer of a 200.
    fn call(&self, path: &'static str, body: &Value) -> Result<Value, EtcdError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let endpoint = self.endpoint.clone();
        let payload = body.to_string();
        let timeout = self.timeout;
        crate::tls::runtime().spawn(async move {
            let exchange = async {
                let tcp = tokio::net::TcpStream::connect(&endpoint)
                    .await
                    .map_err(|e| e.to_string())?;
                let io = hyper_util::rt::TokioIo::new(tcp);
                let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
                    .await
                    .map_err(|e| e.to_string())?;
                tokio::spawn(conn);
                let req = hyper::Request::post(path)
                    .header(hyper::header::HOST, endpoint.as_str())
                    .header(hyper::header::CONTENT_TYPE, "application/json")
                    .body(Full::new(Bytes::from(payload)))
                    .map_err(|e| e.to_string())?;
                let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
                let status = resp.status().as_u16();
                let body = resp
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?
                    .to_bytes();
                Ok::<_, String>((status, body))
            };
            let _ = tx.send(tokio::time::timeout(timeout, exchange).await);
        });
        let answer = rx
            .recv_timeout(self.timeout + Duration::from_secs(1))
            .ok()
            .and_then(Result::ok);
        let (status, body) = match answer {
            None => {
                return Err(EtcdError::Timeout {
                    endpoint: self.endpoint.clone(),
                    path,
                    timeout: self.timeout,
                });
            }
            Some(Err(reason)) => {
                return Err(EtcdError::Unreachable {
                    endpoint: self.endpoint.clone(),
                    reason,
                });
            }
            Some(Ok(a)) => a,
        };
        let text = String::from_utf8_lossy(&body).into_owned();
        if status != 200 {
            return Err(EtcdError::Status {
                endpoint: self.endpoint.clone(),
                path,
                status,
                body: text,
            });
        }
        serde_json::from_slice(&body).map_err(|_| self.unexpected(path, &text))
    }

    fn unexpected(&self, path: &'static str, body: &str) -> EtcdError {
        EtcdError::Unexpected {
            endpoint: self.endpoint.clone(),
            path,
            body: body.to_owned(),
        }
    }

    /// A new lease of `ttl_s` seconds.
    pub fn grant(&self, ttl_s: i64) -> Result<LeaseId, EtcdError> {
        let path = "/v3/lease/grant";
        let v = self.call(path, &json!({ "TTL": ttl_s }))?;
        match int(&v["ID"]) {
            0 => Err(self.unexpected(path, &v.to_string())),
            id => Ok(LeaseId(id)),
        }
    }

    /// Renews `lease`; `None` once it has expired or was revoked.
    pub fn keep_alive(&self, lease: LeaseId) -> Result<Option<i64>, EtcdError> {
        let v = self.call("/v3/lease/keepalive", &json!({ "ID": lease.0.to_string() }))?;
        let ttl = int(&v["result"]["TTL"]);
        Ok((ttl > 0).then_some(ttl))
    }

    /// Ends `lease` now: the keys under it go.
    pub fn revoke(&self, lease: LeaseId) -> Result<(), EtcdError> {
        self.call("/v3/lease/revoke", &json!({ "ID": lease.0.to_string() }))
            .map(drop)
    }

    /// Puts `key` = `value` under `lease` only if `key` does not exist: the store's revision
    /// of the put when it did not (the winner's epoch), `None` when it did.
    pub fn create(
        &self,
        key: &[u8],
        value: &[u8],
        lease: Option<LeaseId>,
    ) -> Result<Option<i64>, EtcdError> {
        let mut put = json!({ "key": b64(key), "value": b64(value) });
        if let Some(l) = lease {
            put["lease"] = json!(l.0.to_string());
        }
        let v = self.call(
            "/v3/kv/txn",
            &json!({
                "compare": [{ "target": "CREATE", "key": b64(key), "create_revision": "0" }],
                "success": [{ "request_put": put }],
            }),
        )?;
        let won = v["succeeded"].as_bool().unwrap_or(false);
        Ok(won.then(|| int(&v["header"]["revision"])))
    }

    /// Puts `key` = `value`, under `lease` if given.
    pub fn put(&self, key: &[u8], value: &[u8], lease: Option<LeaseId>) -> Result<(), EtcdError> {
        let mut put = json!({ "key": b64(key), "value": b64(value) });
        if let Some(l) = lease {
            put["lease"] = json!(l.0.to_string());
        }
        self.call("/v3/kv/put", &put).map(drop)
    }

    /// The value of `key`, if it exists.
    pub fn get(&self, key: &[u8]) -> Result<Option<KeyValue>, EtcdError> {
        let v = self.call("/v3/kv/range", &json!({ "key": b64(key) }))?;
        Ok(self.kvs(&v).into_iter().next())
    }

    /// Every key that starts with `prefix`, in key order.
    pub fn prefix(&self, prefix: &[u8]) -> Result<Vec<KeyValue>, EtcdError> {
        let v = self.call(
            "/v3/kv/range",
            &json!({ "key": b64(prefix), "range_end": b64(&prefix_end(prefix)) }),
        )?;
        Ok(self.kvs(&v))
    }

    /// Deletes `key`.
    pub fn delete(&self, key: &[u8]) -> Result<(), EtcdError> {
        self.call("/v3/kv/deleterange", &json!({ "key": b64(key) }))
            .map(drop)
    }

    fn kvs(&self, v: &Value) -> Vec<KeyValue> {
        let bytes = |v: &Value| {
            v.as_str()
                .and_then(|s| B64.decode(s).ok())
                .unwrap_or_default()
        };
        v["kvs"]
            .as_array()
            .map(|kvs| {
                kvs.iter()
                    .map(|kv| KeyValue {
                        key: bytes(&kv["key"]),
                        value: bytes(&kv["value"]),
                        create_revision: int(&kv["create_revision"]),
                        mod_revision: int(&kv["mod_revision"]),
                        lease: match int(&kv["lease"]) {
                            0 => None,
                            l => Some(LeaseId(l)),
                        },
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_past_every_key_that_starts_with_it() {
        assert_eq!(prefix_end(b"kvfence/workers/"), b"kvfence/workers0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
        assert_eq!(int(&json!("42")), 42);
        assert_eq!(int(&json!(7)), 7);
        assert_eq!(int(&Value::Null), 0);
    }
}
