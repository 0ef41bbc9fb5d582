//! Who a rank is on QUIC: a self-signed certificate made at start-up, known
//! to the others by the SHA-256 fingerprint it publishes through the store
//! (with an HMAC under the job secret, bound to the communicator and rank),
//! and rustls verifiers that accept exactly the expected fingerprints.

use std::{
    collections::HashSet,
    fmt,
    sync::{Arc, RwLock},
};

use ccl_core::{Error, JobSecret, Result};
use ccl_rendezvous::auth;
use rustls::{
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider},
    pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime},
    server::danger::{ClientCertVerified, ClientCertVerifier},
    DigitallySignedStruct, DistinguishedName, SignatureScheme,
};
use sha2::{Digest, Sha256};

/// SHA-256 of a certificate's DER bytes.
pub type Fingerprint = [u8; 32];

/// The fingerprint of `cert`.
pub fn fingerprint(cert: &[u8]) -> Fingerprint {
    Sha256::digest(cert).into()
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses exactly 64 hex digits.
pub fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// A rank's certificate and key, made at start-up.
pub struct Identity {
    pub cert: CertificateDer<'static>,
    key: Vec<u8>,
    pub fingerprint: Fingerprint,
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Identity({})", hex(&self.fingerprint))
    }
}

impl Identity {
    /// A new self-signed certificate (ECDSA P-256) and its key.
    pub fn generate() -> Result<Identity> {
        let made = rcgen::generate_simple_self_signed(vec!["ccl".to_string()])
            .map_err(|e| Error::Internal(format!("making a self-signed certificate: {e}")))?;
        let cert = made.cert.der().clone();
        Ok(Identity {
            fingerprint: fingerprint(&cert),
            cert,
            key: made.key_pair.serialize_der(),
        })
    }

    pub fn key(&self) -> PrivateKeyDer<'static> {
        PrivatePkcs8KeyDer::from(self.key.clone()).into()
    }
}

/// What the MAC of a published fingerprint covers: communicator and rank,
/// so that a fingerprint of an earlier job, or of another rank, is refused.
fn mac_label(comm: u64, rank: usize, fp: &Fingerprint) -> Vec<u8> {
    let mut label = b"ccl quic fingerprint v1 ".to_vec();
    label.extend_from_slice(&comm.to_le_bytes());
    label.extend_from_slice(&(rank as u64).to_le_bytes());
    label.extend_from_slice(fp);
    label
}

/// `HMAC-SHA256(secret, ...)` of rank `rank`'s fingerprint in communicator `comm`.
pub fn fingerprint_mac(secret: &JobSecret, comm: u64, rank: usize, fp: &Fingerprint) -> [u8; 32] {
    auth::tag(secret, &mac_label(comm, rank, fp))
}

/// What a rank publishes under `quic/{rank}`: `addr fingerprint mac` (mac `-`
/// without a secret).
pub fn encode_published(
    addr: &str,
    fp: &Fingerprint,
    secret: Option<&JobSecret>,
    comm: u64,
    rank: usize,
) -> String {
    let mac = match secret {
        Some(s) => hex(&fingerprint_mac(s, comm, rank, fp)),
        None => "-".into(),
    };
    format!("{addr} {} {mac}", hex(fp))
}

/// Decodes and checks what rank `rank` published: its address and
/// fingerprint, when the MAC proves the job secret (if this job has one).
pub fn decode_published(
    value: &[u8],
    secret: Option<&JobSecret>,
    comm: u64,
    rank: usize,
) -> std::result::Result<(std::net::SocketAddr, Fingerprint), String> {
    let text = std::str::from_utf8(value).map_err(|_| "not UTF-8".to_string())?;
    let mut f = text.split(' ');
    let (Some(addr), Some(fp), Some(mac), None) = (f.next(), f.next(), f.next(), f.next()) else {
        return Err(format!("malformed QUIC identity {text:?}"));
    };
    let addr = addr
        .parse()
        .map_err(|_| format!("{addr:?} is not a socket address"))?;
    let fp = parse_hex32(fp).ok_or_else(|| format!("{fp:?} is not a SHA-256 fingerprint"))?;
    if let Some(secret) = secret {
        let ok = parse_hex32(mac)
            .is_some_and(|m| auth::tag_matches(secret, &mac_label(comm, rank, &fp), &m));
        if !ok {
            return Err(format!(
                "the certificate fingerprint rank {rank} published is not authenticated with this \
                 job's secret for this communicator (another job, or a replay)"
            ));
        }
    }
    Ok((addr, fp))
}

/// The rustls crypto provider (aws-lc-rs, whose AES-GCM uses AVX-512 and
/// VAES where the CPU has them), with AES-128-GCM first: both ends are
/// ccl, so the suite offered first is the one used, and AES-128 takes 10
/// rounds per block where AES-256 takes 14. Every byte of a link is
/// encrypted and decrypted, so the cipher's speed is part of QUIC's cost.
pub fn provider() -> Arc<CryptoProvider> {
    use rustls::crypto::aws_lc_rs::{cipher_suite, default_provider};
    Arc::new(CryptoProvider {
        cipher_suites: vec![
            cipher_suite::TLS13_AES_128_GCM_SHA256,
            cipher_suite::TLS13_AES_256_GCM_SHA384,
            cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
        ],
        ..default_provider()
    })
}

fn pinned_error(side: &str, got: &Fingerprint, expected: &str) -> rustls::Error {
    rustls::Error::General(format!(
        "{side} certificate fingerprint {} is not {expected}: refused",
        hex(got)
    ))
}

/// Client side: the server must present the certificate of the peer dialled.
#[derive(Debug)]
pub struct PinnedServer {
    pub expected: Fingerprint,
    pub provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedServer {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let got = fingerprint(end_entity);
        if got == self.expected {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(pinned_error(
                "server",
                &got,
                &format!("the expected peer's {}", hex(&self.expected)),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The fingerprints a server accepts clients with: those of the peers that
/// dial this rank, filled in once they are read from the store.
pub type Allowed = Arc<RwLock<HashSet<Fingerprint>>>;

/// Server side: the client must present one of the allowed certificates
/// (which rank it is, the handshake after TLS checks).
#[derive(Debug)]
pub struct PinnedClients {
    pub allowed: Allowed,
    pub provider: Arc<CryptoProvider>,
}

impl ClientCertVerifier for PinnedClients {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> std::result::Result<ClientCertVerified, rustls::Error> {
        let got = fingerprint(end_entity);
        let allowed = self.allowed.read().unwrap_or_else(|e| e.into_inner());
        if allowed.contains(&got) {
            Ok(ClientCertVerified::assertion())
        } else {
            Err(pinned_error(
                "client",
                &got,
                "one of this communicator's ranks",
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_identity_round_trips_and_mac_binds_comm_and_rank() {
        let secret = JobSecret::new("s3cret-of-this-job").unwrap();
        let other = JobSecret::new("another-job-secret").unwrap();
        let fp = [7u8; 32];
        let v = encode_published("127.0.0.1:5000", &fp, Some(&secret), 42, 3);
        let (addr, got) = decode_published(v.as_bytes(), Some(&secret), 42, 3).unwrap();
        assert_eq!((addr.port(), got), (5000, fp));
        // Another job's secret, another communicator (a replay), another rank.
        for (s, comm, rank) in [(&other, 42, 3), (&secret, 43, 3), (&secret, 42, 2)] {
            let e = decode_published(v.as_bytes(), Some(s), comm, rank).unwrap_err();
            assert!(e.contains("not authenticated"), "{e}");
        }
        // Published without a secret: refused where the job has one.
        let bare = encode_published("127.0.0.1:5000", &fp, None, 42, 3);
        assert!(decode_published(bare.as_bytes(), Some(&secret), 42, 3).is_err());
        assert!(decode_published(bare.as_bytes(), None, 42, 3).is_ok());
        assert!(decode_published(b"garbage", None, 42, 3).is_err());
    }

    #[test]
    fn verifiers_accept_the_pinned_certificate_only() {
        let a = Identity::generate().unwrap();
        let b = Identity::generate().unwrap();
        let name = ServerName::try_from("ccl").unwrap();
        let server = PinnedServer {
            expected: a.fingerprint,
            provider: provider(),
        };
        assert!(server
            .verify_server_cert(&a.cert, &[], &name, &[], UnixTime::now())
            .is_ok());
        let e = server
            .verify_server_cert(&b.cert, &[], &name, &[], UnixTime::now())
            .unwrap_err();
        assert!(e.to_string().contains("refused"), "{e}");
        let allowed: Allowed = Default::default();
        allowed.write().unwrap().insert(a.fingerprint);
        let clients = PinnedClients {
            allowed,
            provider: provider(),
        };
        assert!(clients
            .verify_client_cert(&a.cert, &[], UnixTime::now())
            .is_ok());
        let e = clients
            .verify_client_cert(&b.cert, &[], UnixTime::now())
            .unwrap_err();
        assert!(e.to_string().contains("refused"), "{e}");
    }

    #[test]
    fn two_ranks_negotiate_aes_128_gcm() {
        use rustls::{ClientConnection, ServerConnection};
        let (a, b) = (Identity::generate().unwrap(), Identity::generate().unwrap());
        let allowed: Allowed = Default::default();
        allowed.write().unwrap().insert(b.fingerprint);
        let server = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_client_cert_verifier(Arc::new(PinnedClients {
                allowed,
                provider: provider(),
            }))
            .with_single_cert(vec![a.cert.clone()], a.key())
            .unwrap();
        let client = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PinnedServer {
                expected: a.fingerprint,
                provider: provider(),
            }))
            .with_client_auth_cert(vec![b.cert.clone()], b.key())
            .unwrap();
        let name = ServerName::try_from("ccl").unwrap();
        let mut c = ClientConnection::new(Arc::new(client), name).unwrap();
        let mut s = ServerConnection::new(Arc::new(server)).unwrap();
        // Hand each side's records to the other until both are done.
        for _ in 0..10 {
            let mut wire = Vec::new();
            while c.wants_write() {
                c.write_tls(&mut wire).unwrap();
            }
            s.read_tls(&mut &wire[..]).unwrap();
            s.process_new_packets().unwrap();
            wire.clear();
            while s.wants_write() {
                s.write_tls(&mut wire).unwrap();
            }
            c.read_tls(&mut &wire[..]).unwrap();
            c.process_new_packets().unwrap();
        }
        assert!(!c.is_handshaking() && !s.is_handshaking());
        for suite in [c.negotiated_cipher_suite(), s.negotiated_cipher_suite()] {
            assert_eq!(
                suite.map(|s| s.suite()),
                Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256)
            );
        }
    }
}
