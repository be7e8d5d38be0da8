//! kvctld's mutual TLS ([`libkv::tls`]) on loopback, without a stack: who a peer is comes
//! from its certificate, the relay carries the control protocol both ways, and every peer
//! without a valid certificate is turned away in the handshake with a clear error, never
//! handed to kvctld's loop. Certificates are made at test time ([`kvfence_tests::certs`]).

use kvctld::stack::wait_until;
use kvfence_tests::certs::{KVCTLD_NAME, TestCa};
use libkv::config::Tls;
use libkv::proto::{ErrorCode, Message};
use libkv::sys::uds::read_frame_timeout;
use libkv::tls::{Connector, ListenerCounters, TlsPeer};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(10);
const WORKER: &str = "prefill-0.kvfence.test";
const CLIENT: &str = "app.kvfence.test";

struct Fixture {
    _dir: tempfile::TempDir,
    ca: TestCa,
    rogue: TestCa,
    addr: String,
    counters: Arc<ListenerCounters>,
    peers: mpsc::Receiver<(UnixStream, TlsPeer)>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = TestCa::new(dir.path(), "ca");
    let rogue = TestCa::new(dir.path(), "rogue-ca");
    let server = ca.issue("kvctld", &[KVCTLD_NAME]);
    let tls = ca.kvctld(&server, "127.0.0.1:0", &[WORKER], &[CLIENT]);
    let counters = Arc::new(ListenerCounters::default());
    let (tx, peers) = mpsc::channel();
    let tx = Mutex::new(tx);
    let bound = libkv::tls::listen(&tls, WAIT, Arc::clone(&counters), move |s, p| {
        let _ = tx.lock().unwrap().send((s, p));
    })
    .expect("listening")
    .expect("an address");
    Fixture {
        _dir: dir,
        ca,
        rogue,
        addr: bound.to_string(),
        counters,
        peers,
    }
}

impl Fixture {
    fn connector(&self, tls: &Tls) -> Connector {
        Connector::from_config(tls)
            .expect("connector")
            .expect("connect is set")
    }

    /// A peer presenting a certificate of `ca` for `names`.
    fn peer(&self, ca: &TestCa, stem: &str, names: &[&str]) -> Connector {
        let leaf = ca.issue(stem, names);
        // The peer trusts the test CA for kvctld's certificate whoever signed its own.
        let mut tls = self.ca.peer(&leaf, &self.addr);
        tls.ca = Some(self.ca.path());
        self.connector(&tls)
    }

    fn refused(&self) -> u64 {
        self.counters.refused.load(Ordering::Relaxed)
    }
}

/// Bytes written on one end come out of the other, both ways.
fn carries_both_ways(client: &mut UnixStream, server: &mut UnixStream) {
    client.set_read_timeout(Some(WAIT)).unwrap();
    server.set_read_timeout(Some(WAIT)).unwrap();
    let mut buf = [0u8; 5];
    client.write_all(b"hello").unwrap();
    server.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"hello");
    server.write_all(b"again").unwrap();
    client.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"again");
}

#[test]
fn a_peers_identity_is_the_name_its_certificate_is_valid_for() {
    let f = fixture();
    for (stem, names, want, worker) in [
        ("worker", vec![WORKER], Some(WORKER), true),
        ("client", vec![CLIENT], Some(CLIENT), false),
        // a certificate for both is a worker: the workers' list is looked at first
        ("both", vec![CLIENT, WORKER], Some(WORKER), true),
        // valid, but for no name kvctld lets in: kvctld's loop turns it away
        ("stranger", vec!["stranger.kvfence.test"], None, false),
    ] {
        let mut client = f
            .peer(&f.ca, stem, &names)
            .connect(WAIT)
            .unwrap_or_else(|e| panic!("{stem}: {e}"));
        let (mut server, peer) = f.peers.recv_timeout(WAIT).expect("the peer handed over");
        assert_eq!(peer.name.as_deref(), want, "{stem}");
        assert_eq!(peer.worker, worker, "{stem}");
        assert!(peer.remote.ip().is_loopback());
        carries_both_ways(&mut client, &mut server);
        // kvctld closing its end closes the peer's
        drop(server);
        let mut rest = Vec::new();
        assert_eq!(client.read_to_end(&mut rest).unwrap(), 0, "{stem}: EOF");
    }
    assert_eq!(f.counters.accepted.load(Ordering::Relaxed), 4);
    assert_eq!(f.refused(), 0);
}

#[test]
fn a_certificate_of_another_ca_is_refused_with_a_clear_error() {
    let f = fixture();
    let stream = match f.peer(&f.rogue, "rogue", &[WORKER]).connect(WAIT) {
        // TLS 1.3: the client's handshake completes before kvctld checks its certificate;
        // kvctld's alert then arrives as an Unauthorized error frame
        Ok(s) => s,
        Err(e) => panic!("the refusal should come as an error frame, got {e}"),
    };
    let frame = read_frame_timeout(&stream, WAIT).expect("an error frame");
    match frame.1 {
        Message::Error(e) => {
            assert_eq!(e.code, ErrorCode::Unauthorized);
            assert!(e.message.contains("ended the TLS session"), "{}", e.message);
            assert!(
                e.message.to_lowercase().contains("unknown"),
                "names the TLS alert: {}",
                e.message
            );
        }
        other => panic!("expected Error, got {other:?}"),
    }
    assert!(
        wait_until(WAIT, || (f.refused() == 1).then_some(())).is_some(),
        "counted refused"
    );
    assert!(
        f.peers.try_recv().is_err(),
        "a refused peer never reaches kvctld's loop"
    );
}

#[test]
fn a_peer_without_a_certificate_is_refused() {
    let f = fixture();
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(f.ca.path()).unwrap();
    for c in rustls::pki_types::pem::PemObject::pem_slice_iter(&pem) {
        roots.add(c.unwrap()).unwrap();
    }
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let addr = f.addr.clone();
    let got: Result<usize, String> = rt.block_on(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let tcp = tokio::net::TcpStream::connect(&addr)
            .await
            .map_err(|e| e.to_string())?;
        let name = rustls::pki_types::ServerName::try_from(KVCTLD_NAME).unwrap();
        let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .map_err(|e| e.to_string())?;
        tls.write_all(b"hello").await.map_err(|e| e.to_string())?;
        let mut buf = [0u8; 16];
        tokio::time::timeout(WAIT, tls.read(&mut buf))
            .await
            .map_err(|_| "no answer".to_string())?
            .map_err(|e| e.to_string())
    });
    let err = got.expect_err("kvctld must not talk to a peer without a certificate");
    assert!(err.contains("CertificateRequired"), "{err}");
    assert!(wait_until(WAIT, || (f.refused() == 1).then_some(())).is_some());
    assert!(f.peers.try_recv().is_err());
}

#[test]
fn a_kvctld_whose_certificate_the_peer_does_not_trust_is_not_talked_to() {
    let f = fixture();
    let leaf = f.rogue.issue("worker", &[WORKER]);
    // the peer trusts only the rogue CA, which did not sign kvctld's certificate
    let tls = f.rogue.peer(&leaf, &f.addr);
    let err = f.connector(&tls).connect(WAIT).expect_err("refused");
    let text = err.to_string();
    assert!(text.contains("TLS handshake"), "{text}");
    assert!(text.contains("UnknownIssuer"), "{text}");
}

#[test]
fn missing_files_are_named_at_start() {
    let f = fixture();
    let leaf = f.ca.issue("worker", &[WORKER]);
    let mut tls = f.ca.peer(&leaf, &f.addr);
    tls.key = Some(f._dir.path().join("absent.key"));
    let err = Connector::from_config(&tls).expect_err("no key file");
    assert!(err.to_string().contains("absent.key"), "{err}");
}
