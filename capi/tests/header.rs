//! `include/ccl.h` is what cbindgen makes of this crate: a header that no
//! longer matches the code fails here (and so in CI). `CCL_BLESS=1 cargo
//! test -p ccl-capi --test header` writes the fresh header.

use std::path::Path;

#[test]
fn the_committed_header_matches_the_code() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut fresh = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen reads the crate")
        .write(&mut fresh);
    let path = dir.join("include/ccl.h");
    if std::env::var_os("CCL_BLESS").is_some() {
        std::fs::write(&path, &fresh).expect("writing include/ccl.h");
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == fresh,
        "capi/include/ccl.h is stale: regenerate it with \
         `CCL_BLESS=1 cargo test -p ccl-capi --test header` and commit it"
    );
}
