//! Every decoder of bytes from the wire (ccl-core's frames, this crate's
//! authentication and store messages), fed arbitrary and mutated bytes: it
//! must answer with an error or a value, never panic, and never allocate
//! more than the bytes it was given justify. Then the regression corpus in
//! `tests/fuzz-corpus/<decoder>/` is replayed: files named `ok-*` must
//! decode, files named `err-*` must be rejected.
//!
//! `PROPTEST_CASES` sets the number of cases of each property (default 2048
//! here); `cargo test --release -p ccl-rendezvous --test fuzz` with a large value
//! is the local fuzzing run.

use std::path::Path;

use ccl_core::{AbortNotice, CollectiveKind, DataType, Fingerprint, FrameHeader, ReduceOp};
use ccl_rendezvous::{
    auth::{self, Acceptor, Answer, Challenge, JobSecret, Proof, Response},
    store::tcp_fuzz,
};
use proptest::prelude::*;

type Decoder = fn(&[u8]) -> Result<(), String>;

fn frame_header(b: &[u8]) -> Result<(), String> {
    FrameHeader::decode(b).map(|_| ())
}

fn abort_notice(b: &[u8]) -> Result<(), String> {
    AbortNotice::decode(b).map(|_| ())
}

fn auth_challenge(b: &[u8]) -> Result<(), String> {
    Challenge::decode(b).map(|_| ()).map_err(|e| e.to_string())
}

fn auth_response(b: &[u8]) -> Result<(), String> {
    Response::decode(b).map(|_| ()).map_err(|e| e.to_string())
}

fn auth_proof(b: &[u8]) -> Result<(), String> {
    Proof::decode(b).map(|_| ()).map_err(|e| e.to_string())
}

/// Every decoder with the corpus folder it owns.
const DECODERS: [(&str, Decoder); 7] = [
    ("frame_header", frame_header),
    ("abort_notice", abort_notice),
    ("auth_challenge", auth_challenge),
    ("auth_response", auth_response),
    ("auth_proof", auth_proof),
    ("store_request", tcp_fuzz::request),
    ("store_reply", tcp_fuzz::reply),
];

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2048)
}

/// Valid encodings of each kind, for mutation.
fn seeds() -> Vec<Vec<u8>> {
    let header = FrameHeader::data(
        7,
        3,
        1,
        64,
        Fingerprint::new(CollectiveKind::AllReduce, DataType::F32, 16).with_op(ReduceOp::Sum),
    );
    let notice = AbortNotice {
        failed_rank: 2,
        reason: "gone".into(),
    };
    let key = |op: u8, k: &[u8]| {
        let mut v = vec![op];
        v.extend_from_slice(&(k.len() as u32).to_be_bytes());
        v.extend_from_slice(k);
        v
    };
    let mut set = key(1, b"key");
    set.extend_from_slice(&5u32.to_be_bytes());
    set.extend_from_slice(b"value");
    let mut wait = vec![3];
    wait.extend_from_slice(&1_000_000u64.to_be_bytes());
    wait.extend_from_slice(&2u32.to_be_bytes());
    wait.extend_from_slice(&key(0, b"a")[1..]);
    wait.extend_from_slice(&key(0, b"bc")[1..]);
    let mut add = key(4, b"n");
    add.extend_from_slice(&(-3i64).to_be_bytes());
    let mut cas = key(5, b"k");
    cas.push(1);
    cas.extend_from_slice(&1u32.to_be_bytes());
    cas.push(b'x');
    cas.extend_from_slice(&1u32.to_be_bytes());
    cas.push(b'y');
    vec![
        header.encode().to_vec(),
        notice.encode(),
        notice.header(7).encode().to_vec(),
        Challenge {
            required: true,
            nonce: [1; auth::NONCE_LEN],
        }
        .encode()
        .to_vec(),
        Response {
            mac: [2; auth::MAC_LEN],
            nonce: [3; auth::NONCE_LEN],
        }
        .encode()
        .to_vec(),
        Proof {
            accepted: true,
            mac: [4; auth::MAC_LEN],
        }
        .encode()
        .to_vec(),
        set,
        key(2, b"key"),
        wait,
        add,
        cas,
        key(6, b"gone"),
        // Replies (first byte: the request they answer).
        vec![1, 0],
        [&[2u8, 0][..], &3u32.to_be_bytes(), b"abc"].concat(),
        [
            &[3u8, 2][..],
            &1u32.to_be_bytes(),
            &1u32.to_be_bytes(),
            b"k",
        ]
        .concat(),
        [&[4u8, 0][..], &9i64.to_be_bytes()].concat(),
        [&[5u8, 0][..], &0u32.to_be_bytes()].concat(),
        vec![6, 0, 1],
    ]
}

/// Runs every decoder on `bytes`, plus both sides of the authentication.
fn feed_all(bytes: &[u8]) {
    for (_, decode) in DECODERS {
        let _ = decode(bytes);
    }
    let secret = JobSecret::new("fuzz").unwrap();
    for s in [None, Some(&secret)] {
        if let Ok(a) = Acceptor::new(s, b"ctx") {
            let _ = a.check(bytes);
        }
        if let Ok(Answer::Respond { pending, .. }) = auth::answer(s, b"ctx", bytes) {
            let _ = pending.verify(bytes);
        }
    }
    let _ = tcp_fuzz::request(bytes);
}

/// A mutation of a seed: flip, overwrite, truncate, extend.
fn mutated() -> impl Strategy<Value = Vec<u8>> {
    let seeds = seeds();
    (
        0..seeds.len(),
        proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6),
        proptest::option::of(any::<usize>()),
        proptest::collection::vec(any::<u8>(), 0..8),
    )
        .prop_map(move |(i, edits, cut, tail)| {
            let mut b = seeds[i].clone();
            for (at, x) in edits {
                if !b.is_empty() {
                    let n = b.len();
                    b[at % n] ^= x;
                }
            }
            if let Some(c) = cut {
                b.truncate(c % (b.len() + 1));
            }
            b.extend_from_slice(&tail);
            b
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        feed_all(&bytes);
    }

    #[test]
    fn mutated_encodings_never_panic(bytes in mutated()) {
        feed_all(&bytes);
    }

    /// Lengths near the limits, in the positions where store messages hold them.
    #[test]
    fn huge_lengths_are_bounded(op in 1u8..=6, len in prop_oneof![Just(u32::MAX), Just(u32::MAX / 2), (64u32 << 20)..=(64u32 << 20) + 2, any::<u32>()], tail in proptest::collection::vec(any::<u8>(), 0..16)) {
        let mut b = vec![op];
        b.extend_from_slice(&len.to_be_bytes());
        b.extend_from_slice(&tail);
        // Key-first requests: a key of `len` bytes needs `len` bytes.
        if op != 3 {
            prop_assert!(tcp_fuzz::request(&b).is_err() || tail.len() >= len as usize);
        } else {
            let _ = tcp_fuzz::request(&b);
        }
        let mut reply = vec![op, if op == 3 { 2 } else { 0 }];
        reply.extend_from_slice(&len.to_be_bytes());
        reply.extend_from_slice(&tail);
        let _ = tcp_fuzz::reply(&reply);
    }
}

fn corpus_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz-corpus")
}

/// Replays `tests/fuzz-corpus/<decoder>/{ok,err}-*.bin`.
#[test]
fn corpus_replays() {
    let mut replayed = 0;
    for (name, decode) in DECODERS {
        let dir = corpus_dir().join(name);
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let mut here = 0;
        for entry in entries {
            let path = entry.unwrap().path();
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            let bytes = std::fs::read(&path).unwrap();
            let got = decode(&bytes);
            if file.starts_with("ok-") {
                assert!(got.is_ok(), "{name}/{file}: {got:?}");
            } else if file.starts_with("err-") {
                assert!(got.is_err(), "{name}/{file} decoded");
            } else {
                panic!("{name}/{file}: corpus files are named ok-* or err-*");
            }
            feed_all(&bytes);
            here += 1;
        }
        assert!(here > 0, "no corpus for {name}");
        replayed += here;
    }
    eprintln!("replayed {replayed} corpus inputs");
}
