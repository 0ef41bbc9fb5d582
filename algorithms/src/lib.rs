//! ccl-algorithms: collectives as schedules and as group algorithms, the
//! executor that runs schedules, and the tuner that picks an algorithm.
//!
//! An [`Algorithm`] turns one rank's part of a [`Collective`](ccl_core::Collective)
//! into a [`Schedule`] (plain data, no I/O, testable for every world size and
//! count), which [`execute`] runs over any [`ccl_core::Link`]s, or, for the
//! [`group`] algorithms, runs on [`GroupMemory`](ccl_core::GroupMemory)
//! directly. The [`Tuner`] picks one per call. Algorithms know no transport;
//! transports know no algorithm.

mod algorithm;
mod chain;
mod dbtree;
mod direct;
mod doubling;
mod executor;
pub mod group;
mod halving;
mod io;
mod ring;
pub mod schedule;
mod tree;
pub mod tuner;

#[cfg(test)]
mod tests;

pub use algorithm::{Algorithm, Choice};
pub use direct::transfer;
pub use executor::{execute, SEND_DRAIN};
pub use io::IoBuffers;
pub use schedule::{Action, BufId, Builder, Layout, Op, Region, Schedule};
pub use tuner::{Overrides, Table, Tuner};
