//! ccl-algorithms: collectives as schedules, and one executor that runs them.
//!
//! A collective call becomes a [`Spec`]; an [`Algorithm`] turns it into a
//! [`Schedule`] (plain data, no I/O, testable for every world size and count);
//! [`execute`] runs a schedule over any [`ccl_core::Link`]s. Algorithms know
//! no transport; transports know no algorithm.

mod chain;
mod dbtree;
mod direct;
mod doubling;
mod executor;
mod halving;
mod ring;
pub mod schedule;
mod spec;
mod tree;
pub mod tuner;

#[cfg(test)]
mod tests;

pub use executor::{execute, execute_within, Call, IoBuffers};
pub use schedule::{Action, BufId, Builder, Op, Region, Schedule};
pub use spec::{Algorithm, Choice, Spec};
pub use tuner::{Links, Tuner};
