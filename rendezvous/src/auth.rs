//! Authentication of connections with the job secret (`CCL_JOB_SECRET`).
//!
//! Every TCP connection of a job (to the store, and every link socket) starts
//! with this exchange, before any other byte is trusted. The side that
//! accepted the connection speaks first:
//!
//! 1. acceptor → connector, [`CHALLENGE_LEN`] bytes: `CCLA`, version, mode
//!    (0: this job has no secret, 1: prove you know it), two zero bytes, a
//!    random 32-byte nonce `na`.
//! 2. connector → acceptor (mode 1 only), [`RESPONSE_LEN`] bytes: `CCLR`,
//!    `HMAC-SHA256(secret, "ccl-auth-v1 connector" ‖ context ‖ na ‖ nc)`, and
//!    its own random nonce `nc`.
//! 3. acceptor → connector (mode 1 only), [`PROOF_LEN`] bytes: `CCLP`, a
//!    verdict byte (0 accepted, 1 refused), three zero bytes, and
//!    `HMAC-SHA256(secret, "ccl-auth-v1 acceptor" ‖ context ‖ nc ‖ na)`
//!    (zeros when refused).
//!
//! Both sides check the other's MAC in constant time, so the exchange is
//! mutual: a rank does not talk to a server or peer that cannot prove the
//! secret either. `context` names what the connection is for (the store, or
//! the links of one communicator), so a proof for one cannot be replayed to
//! the other. A side whose secret disagrees with the other's mode (one has a
//! secret, the other not) gives up with an error that says so.
//!
//! What this does not do: it authenticates connection set-up only. Bytes that
//! follow are neither encrypted nor integrity-protected, so an attacker who
//! can rewrite packets on the path can still tamper with a job; use a private
//! network (or, later, the QUIC transport) where that matters.
//!
//! The encoders and decoders here are plain functions over byte slices with no
//! I/O; the store and the TCP transport do the reading and writing.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub use ccl_core::JobSecret;
use ccl_core::{Error, Result};

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of an HMAC-SHA256 tag.
pub const MAC_LEN: usize = 32;
/// Bytes of every message's magic.
pub const MAGIC_LEN: usize = 4;
/// Bytes of an encoded [`Challenge`].
pub const CHALLENGE_LEN: usize = 8 + NONCE_LEN;
/// Bytes of an encoded [`Response`].
pub const RESPONSE_LEN: usize = 4 + MAC_LEN + NONCE_LEN;
/// Bytes of an encoded [`Proof`].
pub const PROOF_LEN: usize = 8 + MAC_LEN;

/// First bytes of a [`Challenge`].
pub const CHALLENGE_MAGIC: [u8; 4] = *b"CCLA";
/// First bytes of a [`Response`].
pub const RESPONSE_MAGIC: [u8; 4] = *b"CCLR";
/// First bytes of a [`Proof`].
pub const PROOF_MAGIC: [u8; 4] = *b"CCLP";
const VERSION: u8 = 1;
const CONNECTOR_LABEL: &[u8] = b"ccl-auth-v1 connector";
const ACCEPTOR_LABEL: &[u8] = b"ccl-auth-v1 acceptor";

/// Context of connections to the TCP store.
pub const STORE_CONTEXT: &[u8] = b"ccl store";

/// The context of the link sockets of communicator `comm`.
pub fn link_context(comm: u64) -> Vec<u8> {
    let mut c = b"ccl link ".to_vec();
    c.extend_from_slice(&comm.to_le_bytes());
    c
}

/// `HMAC-SHA256(secret, parts...)`.
fn mac(secret: &JobSecret, parts: &[&[u8]]) -> HmacSha256 {
    // HMAC takes keys of any length: this cannot fail.
    let mut m = HmacSha256::new_from_slice(secret.expose()).expect("HMAC accepts any key length");
    for p in parts {
        m.update(p);
    }
    m
}

/// A tag that depends on the secret and `label` (to mix the secret into
/// identifiers, such as communicator ids, without revealing it).
pub fn tag(secret: &JobSecret, label: &[u8]) -> [u8; MAC_LEN] {
    tag_mac(secret, label).finalize().into_bytes().into()
}

/// Whether `tag` is [`tag`]`(secret, label)`, compared in constant time.
pub fn tag_matches(secret: &JobSecret, label: &[u8], tag: &[u8]) -> bool {
    tag_mac(secret, label).verify_slice(tag).is_ok()
}

/// The MAC state of [`tag`] over `label`.
fn tag_mac(secret: &JobSecret, label: &[u8]) -> HmacSha256 {
    mac(secret, &[b"ccl-tag-v1 ", label])
}

/// Logs, once per process, that connections are not authenticated.
pub fn warn_unauthenticated() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        tracing::warn!(
            "this job is unauthenticated: CCL_JOB_SECRET is not set, so anyone who can reach \
             the store and link ports can join it (ccl-run sets one for you)"
        );
    });
}

/// A fresh random nonce from the operating system.
pub fn nonce() -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut n).map_err(|e| {
        Error::io(
            "drawing a random nonce for authentication",
            std::io::Error::other(e.to_string()),
        )
    })?;
    Ok(n)
}

/// Why an authentication exchange failed. `Display` says it for humans.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AuthError {
    /// The bytes are not a ccl authentication message at all.
    NotCcl(String),
    /// The bytes start like one but are malformed.
    Malformed(String),
    /// The other side demands a secret and this side has none.
    NeedSecret,
    /// This side has a secret and the other side runs without one.
    PeerHasNoSecret,
    /// The acceptor refused this side's proof: the secrets differ.
    Refused,
    /// The connector's proof is wrong (acceptor side).
    WrongSecret,
    /// The acceptor's proof is wrong (connector side).
    BadPeerProof,
}

impl fmt::Display for AuthError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AuthError::NotCcl(m) => write!(f, "not a ccl authentication message ({m})"),
            AuthError::Malformed(m) => write!(f, "malformed authentication message: {m}"),
            AuthError::NeedSecret => f.write_str(
                "the peer requires a job secret and this process has none (set the same \
                 CCL_JOB_SECRET on every rank)",
            ),
            AuthError::PeerHasNoSecret => f.write_str(
                "the peer runs without a job secret but this process has one (CCL_JOB_SECRET \
                 must be set on every rank or on none)",
            ),
            AuthError::Refused => f.write_str(
                "the peer refused this process's proof of the job secret: CCL_JOB_SECRET \
                 differs between them",
            ),
            AuthError::WrongSecret => f.write_str("wrong job secret"),
            AuthError::BadPeerProof => f.write_str(
                "the peer could not prove the job secret: CCL_JOB_SECRET differs between them, \
                 or it is not part of this job",
            ),
        }
    }
}

/// Message 1, acceptor → connector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Challenge {
    /// Whether the acceptor has a secret and wants proof of it.
    pub required: bool,
    pub nonce: [u8; NONCE_LEN],
}

impl Challenge {
    pub fn encode(&self) -> [u8; CHALLENGE_LEN] {
        let mut b = [0u8; CHALLENGE_LEN];
        b[..4].copy_from_slice(&CHALLENGE_MAGIC);
        b[4] = VERSION;
        b[5] = self.required as u8;
        b[8..].copy_from_slice(&self.nonce);
        b
    }

    /// Decodes exactly [`CHALLENGE_LEN`] bytes; anything else is an error.
    pub fn decode(b: &[u8]) -> std::result::Result<Challenge, AuthError> {
        check_magic(b, &CHALLENGE_MAGIC, CHALLENGE_LEN, "challenge")?;
        if b[4] != VERSION {
            return Err(AuthError::Malformed(format!(
                "authentication version {} (this process speaks {VERSION})",
                b[4]
            )));
        }
        let required = match b[5] {
            0 => false,
            1 => true,
            m => return Err(AuthError::Malformed(format!("challenge mode {m}"))),
        };
        if b[6..8] != [0, 0] {
            return Err(AuthError::Malformed("reserved challenge bytes".into()));
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[8..]);
        Ok(Challenge { required, nonce })
    }
}

/// Message 2, connector → acceptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Response {
    pub mac: [u8; MAC_LEN],
    pub nonce: [u8; NONCE_LEN],
}

impl Response {
    pub fn encode(&self) -> [u8; RESPONSE_LEN] {
        let mut b = [0u8; RESPONSE_LEN];
        b[..4].copy_from_slice(&RESPONSE_MAGIC);
        b[4..4 + MAC_LEN].copy_from_slice(&self.mac);
        b[4 + MAC_LEN..].copy_from_slice(&self.nonce);
        b
    }

    pub fn decode(b: &[u8]) -> std::result::Result<Response, AuthError> {
        check_magic(b, &RESPONSE_MAGIC, RESPONSE_LEN, "response")?;
        let mut mac = [0u8; MAC_LEN];
        mac.copy_from_slice(&b[4..4 + MAC_LEN]);
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[4 + MAC_LEN..]);
        Ok(Response { mac, nonce })
    }
}

/// Message 3, acceptor → connector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Proof {
    pub accepted: bool,
    pub mac: [u8; MAC_LEN],
}

impl Proof {
    pub fn encode(&self) -> [u8; PROOF_LEN] {
        let mut b = [0u8; PROOF_LEN];
        b[..4].copy_from_slice(&PROOF_MAGIC);
        b[4] = if self.accepted { 0 } else { 1 };
        b[8..].copy_from_slice(&self.mac);
        b
    }

    pub fn decode(b: &[u8]) -> std::result::Result<Proof, AuthError> {
        check_magic(b, &PROOF_MAGIC, PROOF_LEN, "proof")?;
        let accepted = match b[4] {
            0 => true,
            1 => false,
            v => return Err(AuthError::Malformed(format!("proof verdict {v}"))),
        };
        if b[5..8] != [0, 0, 0] {
            return Err(AuthError::Malformed("reserved proof bytes".into()));
        }
        let mut mac = [0u8; MAC_LEN];
        mac.copy_from_slice(&b[8..]);
        Ok(Proof { accepted, mac })
    }
}

fn check_magic(
    b: &[u8],
    magic: &[u8; 4],
    len: usize,
    what: &str,
) -> std::result::Result<(), AuthError> {
    if b.len() < MAGIC_LEN || b[..MAGIC_LEN] != magic[..] {
        let head = &b[..b.len().min(MAGIC_LEN)];
        return Err(AuthError::NotCcl(format!(
            "expected an authentication {what}, got bytes {head:02x?}"
        )));
    }
    if b.len() != len {
        return Err(AuthError::Malformed(format!(
            "{what} of {} bytes, expected {len}",
            b.len()
        )));
    }
    Ok(())
}

/// Whether the first bytes a connector reads look like a challenge (to tell
/// "the peer is not ccl" from "the peer is ccl but something else went wrong").
pub fn is_challenge_magic(head: &[u8]) -> bool {
    head.len() >= MAGIC_LEN && head[..MAGIC_LEN] == CHALLENGE_MAGIC
}

fn length_prefixed(context: &[u8]) -> [u8; 4] {
    (context.len() as u32).to_le_bytes()
}

/// The acceptor's half of the exchange.
#[derive(Debug)]
pub struct Acceptor {
    secret: Option<JobSecret>,
    context: Vec<u8>,
    nonce: [u8; NONCE_LEN],
}

impl Acceptor {
    /// A fresh exchange with a random nonce.
    pub fn new(secret: Option<&JobSecret>, context: &[u8]) -> Result<Acceptor> {
        Ok(Acceptor {
            secret: secret.cloned(),
            context: context.to_vec(),
            nonce: if secret.is_some() {
                nonce()?
            } else {
                [0; NONCE_LEN]
            },
        })
    }

    /// Message 1.
    pub fn challenge(&self) -> [u8; CHALLENGE_LEN] {
        Challenge {
            required: self.secret.is_some(),
            nonce: self.nonce,
        }
        .encode()
    }

    /// Whether a response must be read (the acceptor has a secret); if not,
    /// the connection goes on unauthenticated after the challenge.
    pub fn expects_response(&self) -> bool {
        self.secret.is_some()
    }

    /// Checks message 2 and returns message 3 to send: an accepting proof,
    /// or, with the error, a refusal (sending it lets an honest rank with the
    /// wrong secret fail at once with a clear error).
    pub fn check(
        &self,
        response: &[u8],
    ) -> std::result::Result<[u8; PROOF_LEN], (AuthError, Option<[u8; PROOF_LEN]>)> {
        let Some(secret) = &self.secret else {
            return Err((
                AuthError::Malformed("no response expected without a secret".into()),
                None,
            ));
        };
        let r = Response::decode(response).map_err(|e| (e, None))?;
        let refuse = Proof {
            accepted: false,
            mac: [0; MAC_LEN],
        }
        .encode();
        let len = length_prefixed(&self.context);
        mac(
            secret,
            &[CONNECTOR_LABEL, &len, &self.context, &self.nonce, &r.nonce],
        )
        .verify_slice(&r.mac)
        .map_err(|_| (AuthError::WrongSecret, Some(refuse)))?;
        let mac = mac(
            secret,
            &[ACCEPTOR_LABEL, &len, &self.context, &r.nonce, &self.nonce],
        )
        .finalize()
        .into_bytes()
        .into();
        Ok(Proof {
            accepted: true,
            mac,
        }
        .encode())
    }
}

/// What a connector does after reading the challenge.
#[derive(Debug)]
pub enum Answer {
    /// Neither side has a secret: go on unauthenticated.
    Open,
    /// Send `response`, then read a proof and [`Pending::verify`] it.
    Respond {
        response: [u8; RESPONSE_LEN],
        pending: Pending,
    },
}

/// A connector waiting for the acceptor's proof.
#[derive(Debug)]
pub struct Pending {
    expected: [u8; MAC_LEN],
}

impl Pending {
    /// Checks message 3 (constant time).
    pub fn verify(&self, proof: &[u8]) -> std::result::Result<(), AuthError> {
        let p = Proof::decode(proof)?;
        if !p.accepted {
            return Err(AuthError::Refused);
        }
        let diff = p
            .mac
            .iter()
            .zip(self.expected.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if diff != 0 {
            return Err(AuthError::BadPeerProof);
        }
        Ok(())
    }
}

/// The connector's half: answers message 1.
pub fn answer(
    secret: Option<&JobSecret>,
    context: &[u8],
    challenge: &[u8],
) -> std::result::Result<Answer, AuthError> {
    let c = Challenge::decode(challenge)?;
    match (secret, c.required) {
        (None, false) => Ok(Answer::Open),
        (None, true) => Err(AuthError::NeedSecret),
        (Some(_), false) => Err(AuthError::PeerHasNoSecret),
        (Some(secret), true) => {
            let nc = nonce().map_err(|e| AuthError::Malformed(e.to_string()))?;
            let len = length_prefixed(context);
            let response_mac = mac(secret, &[CONNECTOR_LABEL, &len, context, &c.nonce, &nc])
                .finalize()
                .into_bytes()
                .into();
            let expected = mac(secret, &[ACCEPTOR_LABEL, &len, context, &nc, &c.nonce])
                .finalize()
                .into_bytes()
                .into();
            Ok(Answer::Respond {
                response: Response {
                    mac: response_mac,
                    nonce: nc,
                }
                .encode(),
                pending: Pending { expected },
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> JobSecret {
        JobSecret::new(s).unwrap()
    }

    /// Runs the whole exchange in memory.
    fn exchange(
        acc: Option<&JobSecret>,
        con: Option<&JobSecret>,
        ctx_a: &[u8],
        ctx_c: &[u8],
    ) -> (
        std::result::Result<(), AuthError>,
        std::result::Result<(), AuthError>,
    ) {
        let a = Acceptor::new(acc, ctx_a).unwrap();
        let answer = match answer(con, ctx_c, &a.challenge()) {
            Ok(x) => x,
            Err(e) => return (Err(AuthError::Malformed("closed".into())), Err(e)),
        };
        match answer {
            Answer::Open => {
                assert!(!a.expects_response());
                (Ok(()), Ok(()))
            }
            Answer::Respond { response, pending } => match a.check(&response) {
                Ok(proof) => (Ok(()), pending.verify(&proof)),
                Err((e, Some(refusal))) => (Err(e), pending.verify(&refusal)),
                Err((e, None)) => (Err(e.clone()), Err(e)),
            },
        }
    }

    #[test]
    fn same_secret_passes_both_ways() {
        let s = secret("hunter2");
        assert_eq!(
            exchange(Some(&s), Some(&s), b"ctx", b"ctx"),
            (Ok(()), Ok(()))
        );
        assert_eq!(exchange(None, None, b"ctx", b"ctx"), (Ok(()), Ok(())));
    }

    #[test]
    fn mismatches_fail_clearly() {
        let (a, b) = (secret("a"), secret("b"));
        assert_eq!(
            exchange(Some(&a), Some(&b), b"c", b"c"),
            (Err(AuthError::WrongSecret), Err(AuthError::Refused))
        );
        // Same secret, other context (a store proof replayed to a link).
        assert_eq!(
            exchange(Some(&a), Some(&a), STORE_CONTEXT, &link_context(1)),
            (Err(AuthError::WrongSecret), Err(AuthError::Refused))
        );
        assert_eq!(
            exchange(Some(&a), None, b"c", b"c").1,
            Err(AuthError::NeedSecret)
        );
        assert_eq!(
            exchange(None, Some(&a), b"c", b"c").1,
            Err(AuthError::PeerHasNoSecret)
        );
    }

    #[test]
    fn a_forged_proof_is_refused() {
        let s = secret("s");
        let a = Acceptor::new(Some(&s), b"c").unwrap();
        let Answer::Respond { pending, .. } = answer(Some(&s), b"c", &a.challenge()).unwrap()
        else {
            panic!("expected a response")
        };
        let forged = Proof {
            accepted: true,
            mac: [7; MAC_LEN],
        };
        assert_eq!(
            pending.verify(&forged.encode()),
            Err(AuthError::BadPeerProof)
        );
    }

    #[test]
    fn round_trips() {
        let c = Challenge {
            required: true,
            nonce: [9; NONCE_LEN],
        };
        assert_eq!(Challenge::decode(&c.encode()), Ok(c));
        let r = Response {
            mac: [1; MAC_LEN],
            nonce: [2; NONCE_LEN],
        };
        assert_eq!(Response::decode(&r.encode()), Ok(r));
        let p = Proof {
            accepted: false,
            mac: [3; MAC_LEN],
        };
        assert_eq!(Proof::decode(&p.encode()), Ok(p));
        assert!(matches!(
            Challenge::decode(b"CC"),
            Err(AuthError::NotCcl(_))
        ));
        assert!(matches!(
            Challenge::decode(b"CCLAxx"),
            Err(AuthError::Malformed(_))
        ));
    }

    #[test]
    fn secrets_are_redacted_and_bounded() {
        let s = secret("top secret");
        assert!(!format!("{s:?}").contains("top"));
        assert!(JobSecret::new("").is_err());
        assert!(JobSecret::new(vec![1u8; ccl_core::secret::MAX_SECRET + 1]).is_err());
        assert_ne!(tag(&s, b"x"), tag(&secret("other"), b"x"));
        assert_eq!(s, secret("top secret"));
    }
}
