//! The shared library's soname: `libcclrs.so.<major>`, so that programs
//! linked against one major version load only that one.

fn main() {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcclrs.so.{major}");
}
