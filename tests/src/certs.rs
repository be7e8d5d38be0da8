//! Certificates made at test time for kvctld's mutual TLS: a CA of the test's own, leaf
//! certificates it signs (for kvctld, workers and clients), and a second, unrelated CA whose
//! certificates kvctld must refuse. Everything is written as PEM into a directory the test
//! owns; nothing is kept.

use libkv::config::Tls;
use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};
use std::path::{Path, PathBuf};

/// kvctld's name in its certificate, which peers check (`[tls] server_name`).
pub const KVCTLD_NAME: &str = "kvctld.kvfence.test";

/// A certificate authority and the directory its files go to.
pub struct TestCa {
    dir: PathBuf,
    stem: String,
    cert: Certificate,
    key: KeyPair,
}

/// A leaf certificate's files.
#[derive(Clone, Debug)]
pub struct Leaf {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa")
            .field("dir", &self.dir)
            .field("stem", &self.stem)
            .finish_non_exhaustive()
    }
}

impl TestCa {
    /// A new CA named `stem`, its certificate written to `dir/stem.pem`.
    pub fn new(dir: &Path, stem: &str) -> TestCa {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("kvfence test CA {stem}"));
        let cert = params.self_signed(&key).expect("CA certificate");
        std::fs::write(dir.join(format!("{stem}.pem")), cert.pem()).expect("writing the CA");
        TestCa {
            dir: dir.to_path_buf(),
            stem: stem.to_owned(),
            cert,
            key,
        }
    }

    /// The CA certificate's file.
    pub fn path(&self) -> PathBuf {
        self.dir.join(format!("{}.pem", self.stem))
    }

    /// A certificate for `names` (DNS names or IP addresses) signed by this CA, for both
    /// server and client use, written to `dir/stem.pem` and `dir/stem.key`.
    pub fn issue(&self, stem: &str, names: &[&str]) -> Leaf {
        let key = KeyPair::generate().expect("leaf key");
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(names).expect("leaf params");
        params
            .distinguished_name
            .push(DnType::CommonName, stem.to_owned());
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .expect("leaf certificate");
        let leaf = Leaf {
            cert: self.dir.join(format!("{stem}.pem")),
            key: self.dir.join(format!("{stem}.key")),
        };
        std::fs::write(&leaf.cert, cert.pem()).expect("writing the certificate");
        std::fs::write(&leaf.key, key.serialize_pem()).expect("writing the key");
        leaf
    }

    /// `[tls]` for a peer that presents `leaf` and reaches kvctld at `connect`.
    pub fn peer(&self, leaf: &Leaf, connect: &str) -> Tls {
        Tls {
            connect: Some(connect.to_owned()),
            server_name: Some(KVCTLD_NAME.to_owned()),
            cert: Some(leaf.cert.clone()),
            key: Some(leaf.key.clone()),
            ca: Some(self.path()),
            ..Tls::default()
        }
    }

    /// `[tls]` for kvctld presenting `leaf` on `listen`, letting in `workers` and `clients`.
    pub fn kvctld(&self, leaf: &Leaf, listen: &str, workers: &[&str], clients: &[&str]) -> Tls {
        Tls {
            listen: Some(listen.to_owned()),
            cert: Some(leaf.cert.clone()),
            key: Some(leaf.key.clone()),
            ca: Some(self.path()),
            workers: workers.iter().map(|n| (*n).to_owned()).collect(),
            clients: clients.iter().map(|n| (*n).to_owned()).collect(),
            ..Tls::default()
        }
    }
}
