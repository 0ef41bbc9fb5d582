//! The TCP hello decoder fed arbitrary and mutated bytes (never a panic), and
//! the regression corpus in `tests/fuzz-corpus/hello/` replayed: `ok-*` files
//! must decode, `err-*` files must be rejected. `PROPTEST_CASES` sets the
//! number of cases (default 2048).

use std::path::Path;

use ccl_transport_tcp::fuzz_decode_handshake as decode;
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2048)
}

fn valid() -> Vec<u8> {
    let mut h = Vec::from(*b"CCLH");
    h.extend_from_slice(&1u32.to_le_bytes());
    h.extend_from_slice(&0xfeedu64.to_le_bytes());
    h.extend_from_slice(&2u32.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&0u16.to_le_bytes());
    h.extend_from_slice(&1u16.to_le_bytes());
    h
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        let _ = decode(&bytes);
    }

    #[test]
    fn mutated_hellos_never_panic(edits in proptest::collection::vec((0usize..28, any::<u8>()), 0..6), cut in 0usize..40) {
        let mut b = valid();
        for (at, x) in edits {
            b[at] ^= x;
        }
        b.truncate(cut);
        let r = decode(&b);
        prop_assert!(cut >= 28 || r.is_err());
    }
}

#[test]
fn corpus_replays() {
    assert!(decode(&valid()).is_ok());
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz-corpus/hello");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let got = decode(&std::fs::read(&path).unwrap());
        if file.starts_with("ok-") {
            assert!(got.is_ok(), "{file}: {got:?}");
        } else {
            assert!(
                file.starts_with("err-"),
                "{file}: corpus files are named ok-* or err-*"
            );
            assert!(got.is_err(), "{file} decoded");
        }
        n += 1;
    }
    assert!(n > 0);
}
