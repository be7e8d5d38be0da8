//! kvctld's control channel over TCP with mutual TLS (`[tls]`), for peers on other hosts.
//!
//! The TLS session ends in a relay: on each side a task copies bytes between the TLS stream
//! and one end of a Unix socket pair, and the event loops (kvctld's, the worker's link, the
//! client's) get the other end, exactly as if they had connected to the control socket.
//! Framing, limits, deadlines and every protocol rule therefore run unchanged over both
//! transports; what differs is where a peer's identity comes from: its certificate, checked
//! against `[tls] ca`, instead of `SO_PEERCRED`. No descriptor crosses TLS (a shared-memory
//! pool cannot be handed to another host): peers on TLS use the TCP or RDMA transport.
//!
//! The relays run on one small runtime of this process ([`runtime`]), started on first use.
//! A relay ends when either side closes, after giving the other direction [`LINGER`] to
//! deliver what it holds (the last error frame kvctld sends a peer it turns away).
//!
//! A peer turned away during the TLS handshake (no certificate, or one the CA did not
//! sign) sees only a TLS alert; the client relay turns that into an `Unauthorized` error
//! frame naming the TLS error, so kvctl, openaid and the workers report it like any other
//! refusal instead of as a closed connection.

use crate::RequestId;
use crate::config::Tls;
use crate::proto::{self, ErrorCode, Message};
use log::{debug, warn};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use std::net::SocketAddr;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixStream};

/// How long one direction of a relay may go on after the other ended.
pub const LINGER: Duration = Duration::from_secs(2);
/// Most TLS handshakes kvctld runs at once; connections beyond them are closed at accept.
pub const MAX_HANDSHAKES: usize = 256;

/// Why TLS could not be set up, or a connection could not be made.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("[tls] {what} {}: {source}", path.display())]
    File {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("[tls] {what} {}: {reason}", path.display())]
    Pem {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("[tls]: {0}")]
    Setup(String),
    #[error("cannot listen for TLS peers on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot reach kvctld at {addr} over TLS: {reason}")]
    Connect { addr: String, reason: String },
}

/// The runtime the relays run on: one worker thread, started on first use.
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvfence-tls")
            .enable_io()
            .enable_time()
            .build()
            .expect("starting the TLS runtime")
    })
}

/// *ring*'s provider: no C toolchain beyond cc. Its key exchange is classical (X25519,
/// ECDHE), which rustls marks deprecated for lacking post-quantum groups; moving to the
/// aws-lc-rs provider brings those.
#[allow(deprecated)]
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn required<'a>(v: &'a Option<PathBuf>, key: &str) -> Result<&'a Path, TlsError> {
    v.as_deref()
        .ok_or_else(|| TlsError::Setup(format!("`{key}` is not set")))
}

fn certs(path: &Path, what: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = |reason: String| TlsError::Pem {
        what,
        path: path.to_path_buf(),
        reason,
    };
    std::fs::metadata(path).map_err(|source| TlsError::File {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    let list = CertificateDer::pem_file_iter(path)
        .map_err(|e| pem(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem(e.to_string()))?;
    if list.is_empty() {
        return Err(pem("holds no certificate".into()));
    }
    Ok(list)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    std::fs::metadata(path).map_err(|source| TlsError::File {
        what: "key",
        path: path.to_path_buf(),
        source,
    })?;
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::Pem {
        what: "key",
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

fn roots(path: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let mut store = RootCertStore::empty();
    for c in certs(path, "ca")? {
        store.add(c).map_err(|e| TlsError::Pem {
            what: "ca",
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    }
    Ok(Arc::new(store))
}

/// A client configuration that trusts the CA certificates of `ca` and, when given,
/// presents `cert` with `key` (for etcd's `--client-cert-auth`). Errors name the file and
/// what is wrong with it, not the section it came from.
pub fn client_config(
    ca: &Path,
    cert_and_key: Option<(&Path, &Path)>,
) -> Result<Arc<ClientConfig>, String> {
    let plain = |e: TlsError| match e {
        TlsError::File { path, source, .. } => format!("{}: {source}", path.display()),
        TlsError::Pem { path, reason, .. } => format!("{}: {reason}", path.display()),
        other => other.to_string(),
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots(ca).map_err(plain)?);
    let config = match cert_and_key {
        None => builder.with_no_client_auth(),
        Some((cert, k)) => builder
            .with_client_auth_cert(certs(cert, "cert").map_err(plain)?, key(k).map_err(plain)?)
            .map_err(|e| format!("certificate and key: {e}"))?,
    };
    Ok(Arc::new(config))
}

/// Who a TLS peer is: the name its certificate was found valid for, if any, and whether
/// that name may register as a worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsPeer {
    pub name: Option<String>,
    pub worker: bool,
    pub remote: SocketAddr,
}

/// What kvctld's TLS listener counts, shown by status.
#[derive(Debug, Default)]
pub struct ListenerCounters {
    /// Connections whose handshake completed with a valid client certificate.
    pub accepted: AtomicU64,
    /// Connections turned away in the handshake (no certificate, an invalid one, a
    /// handshake past the deadline, too many handshakes at once).
    pub refused: AtomicU64,
}

/// kvctld's side: binds `[tls] listen` now (so a bad address fails at start) and hands each
/// peer that completes the handshake to `on_peer`, with its identity, as a Unix stream.
/// Returns the address bound (port 0 picks one).
pub fn listen(
    tls: &Tls,
    handshake_timeout: Duration,
    counters: Arc<ListenerCounters>,
    on_peer: impl Fn(StdUnixStream, TlsPeer) + Send + Sync + 'static,
) -> Result<Option<SocketAddr>, TlsError> {
    let Some(addr) = tls
        .listen_addr()
        .map_err(|e| TlsError::Setup(e.to_string()))?
    else {
        return Ok(None);
    };
    let roots = roots(required(&tls.ca, "ca")?)?;
    let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
        .build()
        .map_err(|e| TlsError::Setup(format!("client verifier: {e}")))?;
    let config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Setup(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            certs(required(&tls.cert, "cert")?, "cert")?,
            key(required(&tls.key, "key")?)?,
        )
        .map_err(|e| TlsError::Setup(format!("certificate and key: {e}")))?;
    let names = Arc::new(Names {
        workers: tls.workers.clone(),
        clients: tls.clients.clone(),
    });
    let std_listener =
        std::net::TcpListener::bind(addr).map_err(|source| TlsError::Bind { addr, source })?;
    let bound = std_listener
        .local_addr()
        .map_err(|source| TlsError::Bind { addr, source })?;
    std_listener
        .set_nonblocking(true)
        .map_err(|source| TlsError::Bind { addr, source })?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let on_peer = Arc::new(on_peer);
    let rt = runtime();
    let listener = {
        let _guard = rt.enter();
        TcpListener::from_std(std_listener).map_err(|source| TlsError::Bind { addr, source })?
    };
    rt.spawn(async move {
        let pending = Arc::new(AtomicUsize::new(0));
        loop {
            let (tcp, remote) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // out of descriptors and the like: the connection waits in the backlog
                    debug!("TLS accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            notice_dead_peers(&tcp);
            if pending.load(Ordering::Relaxed) >= MAX_HANDSHAKES {
                counters.refused.fetch_add(1, Ordering::Relaxed);
                debug!("TLS peer {remote}: {MAX_HANDSHAKES} handshakes already running");
                continue;
            }
            let _ = tcp.set_nodelay(true);
            pending.fetch_add(1, Ordering::Relaxed);
            let (acceptor, names, on_peer, counters, pending) = (
                acceptor.clone(),
                names.clone(),
                on_peer.clone(),
                counters.clone(),
                pending.clone(),
            );
            tokio::spawn(async move {
                let shaken = tokio::time::timeout(handshake_timeout, acceptor.accept(tcp)).await;
                pending.fetch_sub(1, Ordering::Relaxed);
                let stream = match shaken {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        counters.refused.fetch_add(1, Ordering::Relaxed);
                        warn!("refused TLS peer {remote}: {e}");
                        return;
                    }
                    Err(_) => {
                        counters.refused.fetch_add(1, Ordering::Relaxed);
                        warn!(
                            "refused TLS peer {remote}: no handshake within {} ms",
                            handshake_timeout.as_millis()
                        );
                        return;
                    }
                };
                let (name, worker) = stream
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .map_or((None, false), |c| names.identify(c));
                counters.accepted.fetch_add(1, Ordering::Relaxed);
                let (ours, theirs) = match pair() {
                    Ok(p) => p,
                    Err(e) => {
                        warn!("TLS peer {remote}: cannot make its socket pair: {e}");
                        return;
                    }
                };
                on_peer(
                    theirs,
                    TlsPeer {
                        name,
                        worker,
                        remote,
                    },
                );
                relay(stream, ours, None).await;
            });
        }
    });
    Ok(Some(bound))
}

/// The names a certificate may stand for, workers first.
struct Names {
    workers: Vec<String>,
    clients: Vec<String>,
}

impl Names {
    fn identify(&self, cert: &CertificateDer<'_>) -> (Option<String>, bool) {
        let Ok(ee) = webpki::EndEntityCert::try_from(cert) else {
            return (None, false);
        };
        let valid_for = |name: &String| {
            ServerName::try_from(name.as_str())
                .is_ok_and(|n| ee.verify_is_valid_for_subject_name(&n).is_ok())
        };
        if let Some(n) = self.workers.iter().find(|n| valid_for(n)) {
            return (Some(n.clone()), true);
        }
        (self.clients.iter().find(|n| valid_for(n)).cloned(), false)
    }
}

/// A socket pair: the relay's end (on the runtime) and the event loop's (blocking).
fn pair() -> std::io::Result<(UnixStream, StdUnixStream)> {
    let (ours, theirs) = StdUnixStream::pair()?;
    ours.set_nonblocking(true)?;
    let _guard = runtime().enter();
    Ok((UnixStream::from_std(ours)?, theirs))
}

/// Copies both ways until either side closes, then gives the other direction [`LINGER`].
/// On the client side, `refusal` turns a TLS error on the way in into an error frame.
async fn relay<S>(tls: S, unix: UnixStream, refusal: Option<String>)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (mut tr, mut tw) = tokio::io::split(tls);
    let (mut ur, mut uw) = unix.into_split();
    let inward = async move {
        let copied = copy(&mut tr, &mut uw).await;
        if let (Err(e), Some(addr)) = (&copied, &refusal)
            && is_alert(e)
        {
            // kvctld ended the session with an alert (most often: it refused this peer's
            // certificate): say so on the stream, as kvctld says a refusal. Any other end
            // (a reset, kvctld gone) reaches the peer as a closed connection, as on the
            // control socket.
            let msg = Message::from(proto::Error {
                code: ErrorCode::Unauthorized,
                message: format!("kvctld at {addr} ended the TLS session: {e}"),
            });
            if let Ok(frame) = msg.encode(RequestId(0)) {
                let _ = uw.write_all(&frame).await;
            }
        }
        let _ = uw.shutdown().await;
    };
    let outward = async move {
        let _ = copy(&mut ur, &mut tw).await;
        let _ = tw.shutdown().await;
    };
    tokio::pin!(inward, outward);
    tokio::select! {
        () = &mut inward => { let _ = tokio::time::timeout(LINGER, outward).await; }
        () = &mut outward => { let _ = tokio::time::timeout(LINGER, inward).await; }
    }
}

/// Whether a TLS stream failed on an alert the other side sent.
fn is_alert(e: &std::io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|t| matches!(t, rustls::Error::AlertReceived(_)))
}

async fn copy<R, W>(r: &mut R, w: &mut W) -> std::io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = r.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        w.write_all(&buf[..n]).await?;
    }
}

/// Makes a connection whose peer vanished (its host cut off, not closed) fail within seconds
/// rather than the kernel's two hours: keepalive probes when idle, and a bound on how long
/// sent data may go unacknowledged. A peer on the other end then reconnects (to a new leader)
/// instead of waiting on a dead one.
fn notice_dead_peers(tcp: &TcpStream) {
    use nix::sys::socket::{setsockopt, sockopt};
    let set = [
        setsockopt(tcp, sockopt::KeepAlive, &true),
        setsockopt(tcp, sockopt::TcpKeepIdle, &DEAD_PEER_IDLE_S),
        setsockopt(tcp, sockopt::TcpKeepInterval, &1),
        setsockopt(tcp, sockopt::TcpKeepCount, &DEAD_PEER_PROBES),
        setsockopt(tcp, sockopt::TcpUserTimeout, &DEAD_PEER_UNACKED_MS),
    ];
    if let Some(Err(e)) = set.into_iter().find(Result::is_err) {
        debug!("TCP keepalive: {e}");
    }
}

/// Seconds idle before the first keepalive probe, probes unanswered before the connection
/// fails (one a second), and milliseconds sent data may go unacknowledged.
const DEAD_PEER_IDLE_S: u32 = 2;
const DEAD_PEER_PROBES: u32 = 3;
const DEAD_PEER_UNACKED_MS: u32 = 5_000;

/// A peer's side: reaches kvctld at `[tls] connect` with this peer's certificate.
#[derive(Clone)]
pub struct Connector {
    config: Arc<ClientConfig>,
    addr: String,
    server_name: ServerName<'static>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("addr", &self.addr)
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl Connector {
    /// `None` when `[tls] connect` is not set (the peer uses the control socket).
    pub fn from_config(tls: &Tls) -> Result<Option<Connector>, TlsError> {
        match tls.connect.clone() {
            Some(addr) => Connector::new(tls, addr).map(Some),
            None => Ok(None),
        }
    }

    /// A connector to `addr` with the certificate, key, CA and server name of `tls` (for a
    /// leader found through etcd, [`Connector::to`] moves it to the next one).
    pub fn new(tls: &Tls, addr: String) -> Result<Connector, TlsError> {
        let name = tls.server_name().unwrap_or_default();
        let server_name = ServerName::try_from(name.clone())
            .map_err(|e| TlsError::Setup(format!("server name {name:?}: {e}")))?;
        let config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Setup(e.to_string()))?
            .with_root_certificates(roots(required(&tls.ca, "ca")?)?)
            .with_client_auth_cert(
                certs(required(&tls.cert, "cert")?, "cert")?,
                key(required(&tls.key, "key")?)?,
            )
            .map_err(|e| TlsError::Setup(format!("certificate and key: {e}")))?;
        Ok(Connector {
            config: Arc::new(config),
            addr,
            server_name,
        })
    }

    /// The same connector, to another address.
    pub fn to(&self, addr: &str) -> Connector {
        Connector {
            addr: addr.to_owned(),
            ..self.clone()
        }
    }

    /// Where this connector reaches kvctld.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Connects and completes the handshake within `timeout`; the stream returned
    /// (blocking) carries the control protocol as the control socket would.
    pub fn connect(&self, timeout: Duration) -> Result<StdUnixStream, TlsError> {
        let fail = |reason: String| TlsError::Connect {
            addr: self.addr.clone(),
            reason,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let me = self.clone();
        // Runs on the relay runtime and answers on a channel, so that any thread (one of
        // another runtime too) may connect.
        runtime().spawn(async move {
            let shake = async {
                let tcp = TcpStream::connect(&me.addr)
                    .await
                    .map_err(|e| e.to_string())?;
                let _ = tcp.set_nodelay(true);
                notice_dead_peers(&tcp);
                tokio_rustls::TlsConnector::from(me.config.clone())
                    .connect(me.server_name.clone(), tcp)
                    .await
                    .map_err(|e| format!("TLS handshake: {e}"))
            };
            let stream = match tokio::time::timeout(timeout, shake).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    let _ = tx.send(Err(e));
                    return;
                }
                Err(_) => {
                    let _ = tx.send(Err(format!(
                        "no TLS session within {} ms",
                        timeout.as_millis()
                    )));
                    return;
                }
            };
            match pair() {
                Ok((ours, theirs)) => {
                    if tx.send(Ok(theirs)).is_ok() {
                        relay(stream, ours, Some(me.addr.clone())).await;
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(format!("socket pair: {e}")));
                }
            }
        });
        let theirs = rx
            .recv_timeout(timeout + Duration::from_secs(1))
            .map_err(|_| fail(format!("no TLS session within {} ms", timeout.as_millis())))?
            .map_err(fail)?;
        theirs
            .set_nonblocking(false)
            .map_err(|e| fail(e.to_string()))?;
        Ok(theirs)
    }
}
