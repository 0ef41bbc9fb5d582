//! One rank of the MPI reference harness; run it under `mpirun` (see the
//! crate's README, or `cargo test -p ccl-mpi-reference`, which does).
//!
//! Environment: `CCL_REF_SEED` (one seed) or `CCL_REF_SEEDS` (a list; default
//! 1,2,3), `CCL_REF_LARGE=0` (leave out the ≥ 16 Mi element calls),
//! `CCL_REF_CORRUPT=K` (self-check: rank 0 corrupts one result at call K or
//! later, which must then be reported), plus
//! what ccl reads (`MASTER_ADDR`, `MASTER_PORT`, `CCL_TIMEOUT`, `CCL_ALGO`, ...).
//! Exit status: 0 when every call matched on every rank, 1 when any did not,
//! 2 when built without MPI, 3 on a harness or MPI error.

#[cfg(not(ccl_no_mpi))]
mod harness;
#[cfg(not(ccl_no_mpi))]
mod mpi;

#[cfg(not(ccl_no_mpi))]
fn main() {
    std::process::exit(harness::main())
}

#[cfg(ccl_no_mpi)]
fn main() {
    eprintln!(
        "ccl-mpi-reference was built without MPI (no working mpicc at build time): \
         install openmpi-bin and libopenmpi-dev and rebuild"
    );
    std::process::exit(2)
}
