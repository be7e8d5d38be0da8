//! A small etcd v3 client over etcd's JSON gateway (HTTP/1.1 through hyper), for leadership
//! and membership: leases (grant, keep-alive, revoke), a put that succeeds only while the key
//! is absent (an election), and put, get, prefix range and delete.
//!
//! Blocking calls, each bounded by the client's timeout; the requests run on the runtime of
//! libkv's network helpers ([`crate::tls::runtime`]), so any thread may call. One TCP
//! connection per call: leadership and membership make a few calls a second at most.
//!
//! A client knows one or more members of a cluster ([`Endpoints`], from `[election] etcd`):
//! it calls the member that answered last, and when that one is out of reach (refused, no
//! answer in its share of the timeout, or a 5xx), the next, within the one timeout. Every
//! member serves every call (a follower forwards writes and linearizable reads to the
//! leader), so any one that answers is as good as another. With `https://` endpoints the
//! calls go over TLS, verified against `[election] etcd_ca`, with a client certificate when
//! etcd asks for one (`--client-cert-auth`).
//!
//! The gateway speaks JSON with keys and values in base64 and 64-bit integers as strings; it
//! accepts the protobuf field names (`create_revision`, `request_put`) this client sends and
//! answers with them.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use rustls::ClientConfig;
use rustls::pki_types::ServerName;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

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
    /// The TLS files of `[election]` could not be used: no call is made.
    #[error("etcd over TLS: {reason}")]
    Tls { reason: String },
    /// Several endpoints, none of which answered: what each said.
    #[error("no etcd endpoint answered {path}: {}", tried.join("; "))]
    NoneAnswered {
        path: &'static str,
        tried: Vec<String>,
    },
}

impl EtcdError {
    /// Whether another member may answer where this one did not.
    fn try_another(&self) -> bool {
        match self {
            EtcdError::Unreachable { .. } | EtcdError::Timeout { .. } => true,
            EtcdError::Status { status, .. } => *status >= 500,
            _ => false,
        }
    }
}

/// Where etcd is: the members' client addresses (`HOST:PORT`), and the TLS configuration
/// when they are `https://` ones.
#[derive(Clone)]
pub struct Endpoints {
    addrs: Vec<String>,
    tls: Option<Result<Arc<ClientConfig>, String>>,
}

impl std::fmt::Debug for Endpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoints")
            .field("addrs", &self.addrs)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Endpoints {
    /// One member over plain HTTP.
    pub fn plain(addr: impl Into<String>) -> Endpoints {
        Endpoints {
            addrs: vec![addr.into()],
            tls: None,
        }
    }

    /// The members of `[election] etcd`, `None` when the election is off. A TLS file that
    /// cannot be used is kept as the error every call then answers with
    /// ([`Endpoints::check`] finds it at start).
    pub fn from_election(cfg: &crate::config::Election) -> Option<Endpoints> {
        let list = cfg.etcd.as_ref()?;
        let addrs = list.addrs();
        let tls = list.uses_tls().then(|| {
            let ca = cfg
                .etcd_ca
                .as_deref()
                .ok_or_else(|| "[election] etcd_ca is not set".to_owned())?;
            let pair = match (&cfg.etcd_cert, &cfg.etcd_key) {
                (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
                _ => None,
            };
            crate::tls::client_config(ca, pair)
        });
        Some(Endpoints { addrs, tls })
    }

    /// The error calls would answer with, if the TLS files cannot be used.
    pub fn check(&self) -> Result<(), EtcdError> {
        match &self.tls {
            Some(Err(reason)) => Err(EtcdError::Tls {
                reason: reason.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// The members, for messages: `a:2379, b:2379`, with `https://` for TLS.
    pub fn describe(&self) -> String {
        let scheme = if self.tls.is_some() { "https://" } else { "" };
        self.addrs
            .iter()
            .map(|a| format!("{scheme}{a}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
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

/// Whether the TLS files `[election]` names for etcd can be used (nothing to check when the
/// election is off or etcd is plain): what a daemon checks before it starts.
pub fn check(cfg: &crate::config::Election) -> Result<(), EtcdError> {
    Endpoints::from_election(cfg).map_or(Ok(()), |e| e.check())
}

/// A client of an etcd cluster (one or more members, see [`Endpoints`]).
#[derive(Clone, Debug)]
pub struct Etcd {
    endpoints: Arc<Endpoints>,
    /// The member that answered last, tried first.
    current: Arc<AtomicUsize>,
    timeout: Duration,
}

/// One HTTP/1.1 exchange on `io`: the status and the whole body.
async fn exchange<S>(io: S, req: hyper::Request<Full<Bytes>>) -> Result<(u16, Bytes), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let io = hyper_util::rt::TokioIo::new(io);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, body))
}

/// The name a member's certificate must hold: the host of `HOST:PORT` (a DNS name or an
/// IP address, IPv6 in brackets).
fn server_name(endpoint: &str) -> Result<ServerName<'static>, String> {
    let host = endpoint.rsplit_once(':').map_or(endpoint, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_owned()).map_err(|e| format!("server name {host:?}: {e}"))
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
    /// A client of the one member at `endpoint` (`HOST:PORT`, plain HTTP).
    pub fn new(endpoint: impl Into<String>, timeout: Duration) -> Etcd {
        Etcd::of(Endpoints::plain(endpoint), timeout)
    }

    /// A client of `endpoints`; each call takes at most `timeout`, whatever the members.
    pub fn of(endpoints: Endpoints, timeout: Duration) -> Etcd {
        Etcd {
            endpoints: Arc::new(endpoints),
            current: Arc::new(AtomicUsize::new(0)),
            timeout,
        }
    }

    /// The client of `[election] etcd`, `None` when the election is off.
    pub fn for_election(cfg: &crate::config::Election, timeout: Duration) -> Option<Etcd> {
        Endpoints::from_election(cfg).map(|e| Etcd::of(e, timeout))
    }

    /// The member calls go to first: the one that answered last.
    pub fn endpoint(&self) -> &str {
        let addrs = &self.endpoints.addrs;
        &addrs[self.current.load(Ordering::Relaxed) % addrs.len()]
    }

    /// Every member, for messages.
    pub fn endpoints(&self) -> String {
        self.endpoints.describe()
    }

    /// POSTs `body` to `path` and returns the JSON answer of a 200: from the member that
    /// answered last, else from the next that answers, all within the timeout.
    fn call(&self, path: &'static str, body: &Value) -> Result<Value, EtcdError> {
        let tls = match &self.endpoints.tls {
            None => None,
            Some(Ok(config)) => Some(config.clone()),
            Some(Err(reason)) => {
                return Err(EtcdError::Tls {
                    reason: reason.clone(),
                });
            }
        };
        let addrs = &self.endpoints.addrs;
        let n = addrs.len();
        let deadline = Instant::now() + self.timeout;
        let first = self.current.load(Ordering::Relaxed) % n;
        let mut tried = Vec::new();
        for k in 0..n {
            let i = (first + k) % n;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            // Each member left gets an equal share of what is left: one that does not answer
            // leaves time for the others.
            let share = left / u32::try_from(n - k).unwrap_or(1);
            match self.call_one(&addrs[i], tls.clone(), share, path, body) {
                Ok(v) => {
                    self.current.store(i, Ordering::Relaxed);
                    return Ok(v);
                }
                Err(e) if n > 1 && e.try_another() => tried.push(e.to_string()),
                Err(e) => return Err(e),
            }
        }
        Err(EtcdError::NoneAnswered { path, tried })
    }

    /// One call to the member at `endpoint`, within `timeout`.
    fn call_one(
        &self,
        endpoint: &str,
        tls: Option<Arc<ClientConfig>>,
        timeout: Duration,
        path: &'static str,
        body: &Value,
    ) -> Result<Value, EtcdError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let host = endpoint.to_owned();
        let payload = body.to_string();
        crate::tls::runtime().spawn(async move {
            let exchange = async {
                let tcp = tokio::net::TcpStream::connect(&host)
                    .await
                    .map_err(|e| e.to_string())?;
                let req = hyper::Request::post(path)
                    .header(hyper::header::HOST, host.as_str())
                    .header(hyper::header::CONTENT_TYPE, "application/json")
                    .body(Full::new(Bytes::from(payload)))
                    .map_err(|e| e.to_string())?;
                match tls {
                    None => exchange(tcp, req).await,
                    Some(config) => {
                        let name = server_name(&host)?;
                        let stream = tokio_rustls::TlsConnector::from(config)
                            .connect(name, tcp)
                            .await
                            .map_err(|e| format!("TLS handshake: {e}"))?;
                        exchange(stream, req).await
                    }
                }
            };
            let _ = tx.send(tokio::time::timeout(timeout, exchange).await);
        });
        let answer = rx
            .recv_timeout(timeout + Duration::from_secs(1))
            .ok()
            .and_then(Result::ok);
        let (status, body) = match answer {
            None => {
                return Err(EtcdError::Timeout {
                    endpoint: endpoint.to_owned(),
                    path,
                    timeout,
                });
            }
            Some(Err(reason)) => {
                return Err(EtcdError::Unreachable {
                    endpoint: endpoint.to_owned(),
                    reason,
                });
            }
            Some(Ok(a)) => a,
        };
        let text = String::from_utf8_lossy(&body).into_owned();
        if status != 200 {
            return Err(EtcdError::Status {
                endpoint: endpoint.to_owned(),
                path,
                status,
                body: text,
            });
        }
        serde_json::from_slice(&body).map_err(|_| EtcdError::Unexpected {
            endpoint: endpoint.to_owned(),
            path,
            body: text,
        })
    }

    fn unexpected(&self, path: &'static str, body: &str) -> EtcdError {
        EtcdError::Unexpected {
            endpoint: self.endpoint().to_owned(),
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
