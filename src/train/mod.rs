//! Training helpers in the shape of Lux.jl's `DistributedUtils`: who this
//! worker is ([`local_rank`], [`total_workers`]), parameters copied from a
//! root to every rank ([`synchronize`], Lux's `synchronize!!`), gradients
//! averaged before each update ([`DistributedOptimizer`] around an
//! [`Optimizer`] such as [`Sgd`]), and each rank's share of the data
//! ([`DistributedSampler`], torch's sampler of that name, and
//! [`DistributedData`], Lux's `DistributedDataContainer`).
//!
//! ```no_run
//! use ccl::train::{self, DistributedData, DistributedOptimizer, Optimizer, Sgd};
//! use ccl::Communicator;
//!
//! let comm = Communicator::from_env()?;
//! // y = 3x + 1 over the whole data set; each rank sees its share of it.
//! let samples: Vec<(f32, f32)> = (0..1000).map(|i| i as f32 / 1000.0).map(|x| (x, 3.0 * x + 1.0)).collect();
//! let mut data = DistributedData::new(&comm, &samples).shuffle(7);
//!
//! // Ranks start apart; synchronize gives them rank 0's parameters.
//! let (mut weight, mut bias) = (vec![comm.rank() as f32], vec![0.0f32]);
//! train::synchronize(&comm, &mut [&mut weight, &mut bias], 0)?;
//! let mut opt = DistributedOptimizer::new(&comm, Sgd::new(1.0).with_momentum(0.5));
//! for epoch in 0..50 {
//!     data.set_epoch(epoch);
//!     let (mut dw, mut db) = (0.0, 0.0);
//!     for &(x, y) in data.iter() {
//!         let err = weight[0] * x + bias[0] - y;
//!         dw += err * x / data.len() as f32;
//!         db += err / data.len() as f32;
//!     }
//!     // Averages the gradients over the ranks, then takes the same step on every rank.
//!     opt.step(&mut [&mut weight, &mut bias], &[&[dw], &[db]])?;
//! }
//! // w is 3.000 and b 1.000 now, on every rank.
//! if train::local_rank(&comm) == 0 {
//!     println!("w {} b {} on {} workers", weight[0], bias[0], train::total_workers(&comm));
//! }
//! # Ok::<(), ccl::Error>(())
//! ```

mod data;
mod optimizer;

pub use data::{DistributedData, DistributedSampler};
pub use optimizer::{DistributedOptimizer, Optimizer, Sgd};

use std::ops::Range;

use ccl_core::{Element, Error, Result};

use crate::{Communicator, DEFAULT_BUCKET_CAP_BYTES};

/// This worker's index in `0..total_workers(comm)`: Lux's `local_rank`,
/// which is the rank in the communicator ([`Communicator::rank`]), not the
/// index among the ranks of one host (torch's `LOCAL_RANK`; that is
/// [`Communicator::host_rank`]).
pub fn local_rank(comm: &Communicator) -> usize {
    comm.rank()
}

/// How many workers train together: Lux's `total_workers`, the
/// communicator's [`Communicator::world_size`].
pub fn total_workers(comm: &Communicator) -> usize {
    comm.world_size()
}

/// Copies `root`'s tensors into every rank's (Lux's `synchronize!!`): run it
/// once before training so that every rank starts from the same parameters,
/// and with [`Optimizer::state`] for the optimizer's state.
///
/// Every rank passes tensors of the same lengths in the same order. Small
/// tensors travel together: consecutive tensors are packed into one
/// broadcast of at most [`DEFAULT_BUCKET_CAP_BYTES`], and a tensor at
/// least that large is broadcast where it lies. For tensors of several
/// element types, call it once per type.
pub fn synchronize<T: Element>(
    comm: &Communicator,
    tensors: &mut [&mut [T]],
    root: usize,
) -> Result<()> {
    broadcast_fused(comm, tensors, root, DEFAULT_BUCKET_CAP_BYTES)
}

/// [`synchronize`] with broadcasts of at most `cap_bytes` (at least one element).
fn broadcast_fused<T: Element>(
    comm: &Communicator,
    tensors: &mut [&mut [T]],
    root: usize,
    cap_bytes: usize,
) -> Result<()> {
    if root >= comm.world_size() {
        return Err(Error::InvalidArgument(format!(
            "synchronize: root {root} is not below world size {}",
            comm.world_size()
        )));
    }
    let lens: Vec<usize> = tensors.iter().map(|t| t.len()).collect();
    let cap = (cap_bytes / T::DTYPE.size()).max(1);
    let mut packed: Vec<T> = Vec::new();
    for group in groups(&lens, cap) {
        let group = &mut tensors[group];
        match group {
            [] => {}
            [alone] => {
                if !alone.is_empty() {
                    comm.broadcast(alone, root)?;
                }
            }
            several => {
                packed.clear();
                if comm.rank() == root {
                    several.iter().for_each(|t| packed.extend_from_slice(t));
                } else {
                    packed.resize(several.iter().map(|t| t.len()).sum(), T::zeroed());
                }
                if packed.is_empty() {
                    continue;
                }
                comm.broadcast(&mut packed, root)?;
                if comm.rank() != root {
                    let mut from = 0;
                    for t in several.iter_mut() {
                        t.copy_from_slice(&packed[from..from + t.len()]);
                        from += t.len();
                    }
                }
            }
        }
    }
    Ok(())
}

/// Consecutive tensors of `lens` elements grouped into runs of at most
/// `cap` elements in all; a tensor of `cap` or more forms a run of its own.
fn groups(lens: &[usize], cap: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut sum) = (0, 0);
    for (i, &len) in lens.iter().enumerate() {
        if len >= cap {
            if start < i {
                out.push(start..i);
            }
            out.push(i..i + 1);
            (start, sum) = (i + 1, 0);
        } else if sum + len > cap {
            out.push(start..i);
            (start, sum) = (i, len);
        } else {
            sum += len;
        }
    }
    if start < lens.len() {
        out.push(start..lens.len());
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ccl_rendezvous::HashStore;

    use super::*;
    use crate::{Options, Store};

    /// Runs `f(comm)` on `n` ranks, threads of this process.
    pub(super) fn on_ranks<T: Send + 'static>(
        n: usize,
        f: impl Fn(Communicator) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let store: Arc<dyn Store> = Arc::new(HashStore::new());
        let f = Arc::new(f);
        let ranks: Vec<_> = (0..n)
            .map(|rank| {
                let (store, f) = (store.clone(), f.clone());
                std::thread::spawn(move || {
                    let options = Options {
                        timeout: std::time::Duration::from_secs(60),
                        ..Options::default()
                    };
                    f(Communicator::new(rank, n, store, options).expect("communicator"))
                })
            })
            .collect();
        ranks.into_iter().map(|t| t.join().expect("rank")).collect()
    }

    #[test]
    fn groups_stay_within_the_cap_and_large_tensors_go_alone() {
        assert_eq!(groups(&[], 10), Vec::<Range<usize>>::new());
        assert_eq!(groups(&[3, 3, 3], 10), vec![Range { start: 0, end: 3 }]);
        assert_eq!(groups(&[3, 3, 3, 3], 10), [0..3, 3..4]);
        assert_eq!(
            groups(&[4, 12, 2, 10, 0, 5, 5], 10),
            [0..1, 1..2, 2..3, 3..4, 4..7]
        );
        assert_eq!(groups(&[0, 0, 10], 10), [0..2, 2..3]);
        // Every tensor lies in exactly one group, in order.
        let lens = [1, 9, 1, 0, 30, 2, 8, 8];
        let covered: Vec<usize> = groups(&lens, 10).into_iter().flatten().collect();
        assert_eq!(covered, (0..lens.len()).collect::<Vec<_>>());
    }

    #[test]
    fn synchronize_copies_the_root_s_tensors_whatever_the_cap() {
        for n in [1, 2, 3] {
            let results = on_ranks(n, move |comm| {
                let lens = [5usize, 0, 17, 1, 40, 3];
                let mut out = Vec::new();
                for cap_bytes in [0, 16, 64, 1 << 20] {
                    let root = n - 1;
                    let mut tensors: Vec<Vec<f64>> = lens
                        .iter()
                        .enumerate()
                        .map(|(t, &len)| {
                            (0..len)
                                .map(|i| (comm.rank() * 1000 + t * 100 + i) as f64)
                                .collect()
                        })
                        .collect();
                    let mut views: Vec<&mut [f64]> =
                        tensors.iter_mut().map(Vec::as_mut_slice).collect();
                    broadcast_fused(&comm, &mut views, root, cap_bytes).unwrap();
                    for (t, v) in tensors.iter().enumerate() {
                        let want: Vec<f64> = (0..lens[t])
                            .map(|i| (root * 1000 + t * 100 + i) as f64)
                            .collect();
                        out.push(v == &want);
                    }
                }
                out
            });
            for r in results {
                assert!(r.iter().all(|&ok| ok), "{n} ranks: {r:?}");
            }
        }
    }

    #[test]
    fn synchronize_rejects_a_root_outside_the_communicator() {
        on_ranks(1, |comm| {
            let err = synchronize(&comm, &mut [&mut [1u8][..]], 1).unwrap_err();
            assert!(
                matches!(err, Error::InvalidArgument(ref m) if m.contains("root 1")),
                "{err}"
            );
        });
    }

    #[test]
    fn local_rank_and_total_workers_are_the_communicator_s() {
        let seen = on_ranks(3, |comm| {
            (
                local_rank(&comm),
                total_workers(&comm),
                comm.host_rank(),
                comm.host_size(),
            )
        });
        assert_eq!(seen, [(0, 3, 0, 3), (1, 3, 1, 3), (2, 3, 2, 3)]);
    }
}
