//! Each rank's share of a data set: [`DistributedSampler`] (torch's
//! `DistributedSampler`) gives the indices, [`DistributedData`] the items.

use ccl_core::{Error, Result};

use crate::Communicator;

/// The indices of a data set of `len` items that one rank of `world_size`
/// takes in an epoch, as torch's `DistributedSampler` chooses them.
///
/// Every rank takes the same number of indices. The data set's order (`0..len`,
/// or with [`DistributedSampler::shuffle`] a permutation drawn from the seed
/// and the epoch, the same on every rank) is cut so that the ranks share it
/// evenly: by default it is padded by repeating its first indices until its
/// length divides by `world_size`; with [`DistributedSampler::drop_last`] its
/// tail is dropped instead. Rank `r` then takes positions `r`, `r + n`,
/// `r + 2n`, ... of it. So, in each epoch, every index is taken by exactly one
/// rank, except the few repeated or dropped ones.
///
/// The permutation comes from a generator of ccl's own (SplitMix64), so it
/// is the same on every rank and platform, but not the one torch draws.
///
/// ```
/// use ccl::train::DistributedSampler;
/// let rank_1 = DistributedSampler::new(10, 3, 1)?;
/// assert_eq!(rank_1.indices(), [1, 4, 7, 0]); // 10 items padded to 12
/// let mut shuffled = DistributedSampler::new(10, 3, 1)?.shuffle(42).drop_last(true);
/// shuffled.set_epoch(2); // a new order each epoch
/// assert_eq!(shuffled.len(), 3);
/// # Ok::<(), ccl::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistributedSampler {
    dataset_len: usize,
    world_size: usize,
    rank: usize,
    seed: Option<u64>,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// The share of rank `rank` of `world_size` in a data set of `len`
    /// items, in order, padded. Fails unless `rank < world_size`.
    pub fn new(len: usize, world_size: usize, rank: usize) -> Result<DistributedSampler> {
        if rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "DistributedSampler: rank {rank} is not below world size {world_size}"
            )));
        }
        Ok(DistributedSampler {
            dataset_len: len,
            world_size,
            rank,
            seed: None,
            drop_last: false,
            epoch: 0,
        })
    }

    /// The share of `comm`'s rank in a data set of `len` items.
    pub fn for_communicator(comm: &Communicator, len: usize) -> DistributedSampler {
        DistributedSampler {
            dataset_len: len,
            world_size: comm.world_size(),
            rank: comm.rank(),
            seed: None,
            drop_last: false,
            epoch: 0,
        }
    }

    /// Shuffles the data set each epoch, from `seed` and the epoch: every
    /// rank must pass the same seed.
    pub fn shuffle(mut self, seed: u64) -> DistributedSampler {
        self.seed = Some(seed);
        self
    }

    /// Drops the tail of the data set that does not divide evenly among
    /// the ranks (`true`) instead of padding it with its first indices.
    pub fn drop_last(mut self, drop: bool) -> DistributedSampler {
        self.drop_last = drop;
        self
    }

    /// Sets the epoch, which picks the permutation when shuffling (torch's
    /// `set_epoch`): call it with the same value on every rank before each
    /// epoch, or every epoch sees the same order.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The epoch set last (0 at first).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Number of items in the whole data set.
    pub fn dataset_len(&self) -> usize {
        self.dataset_len
    }

    /// Number of indices this rank takes per epoch, the same on every rank.
    pub fn len(&self) -> usize {
        if self.drop_last {
            self.dataset_len / self.world_size
        } else {
            self.dataset_len.div_ceil(self.world_size)
        }
    }

    /// True when this rank takes no index.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// This rank's indices for the current epoch, in the order to visit them.
    pub fn indices(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.dataset_len).collect();
        if let Some(seed) = self.seed {
            let mut rng = SplitMix64(SplitMix64(seed).next() ^ self.epoch);
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
        }
        // Position p of the padded order is order[p % len]: padding repeats it from its start.
        (0..self.len())
            .map(|i| order[(self.rank + i * self.world_size) % self.dataset_len])
            .collect()
    }
}

impl IntoIterator for &DistributedSampler {
    type Item = usize;
    type IntoIter = std::vec::IntoIter<usize>;

    /// This rank's indices for the current epoch.
    fn into_iter(self) -> Self::IntoIter {
        self.indices().into_iter()
    }
}

/// This rank's share of a data set (Lux's `DistributedDataContainer`): the
/// items of `data` at the indices a [`DistributedSampler`] gives, so every
/// rank sees as many items and, over the ranks, the whole data set once per
/// epoch (but for padding or dropping). Unlike Lux, which gives each rank
/// a contiguous block, ranks take every `world_size`-th item, as torch does.
///
/// ```
/// use ccl::train::{DistributedData, DistributedSampler};
/// let data: Vec<char> = "abcdefg".chars().collect();
/// let share = DistributedData::with_sampler(&data, DistributedSampler::new(7, 2, 1)?)?;
/// assert_eq!(share.iter().collect::<String>(), "bdfa"); // 7 items padded to 8
/// # Ok::<(), ccl::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct DistributedData<'a, T> {
    data: &'a [T],
    sampler: DistributedSampler,
    /// The sampler's indices for its current epoch.
    indices: Vec<usize>,
}

impl<'a, T> DistributedData<'a, T> {
    /// The share of `comm`'s rank of `data`, in order, padded (see
    /// [`DistributedSampler`]).
    pub fn new(comm: &Communicator, data: &'a [T]) -> DistributedData<'a, T> {
        let sampler = DistributedSampler::for_communicator(comm, data.len());
        DistributedData {
            indices: sampler.indices(),
            data,
            sampler,
        }
    }

    /// The items of `data` that `sampler` picks. Fails unless the sampler
    /// was made for `data.len()` items.
    pub fn with_sampler(
        data: &'a [T],
        sampler: DistributedSampler,
    ) -> Result<DistributedData<'a, T>> {
        if sampler.dataset_len() != data.len() {
            return Err(Error::InvalidArgument(format!(
                "DistributedData: the sampler is for {} items but the data has {}",
                sampler.dataset_len(),
                data.len()
            )));
        }
        Ok(DistributedData {
            indices: sampler.indices(),
            data,
            sampler,
        })
    }

    /// Shuffles each epoch, from `seed` ([`DistributedSampler::shuffle`]).
    pub fn shuffle(self, seed: u64) -> DistributedData<'a, T> {
        self.resample(|s| s.shuffle(seed))
    }

    /// Drops the uneven tail instead of padding ([`DistributedSampler::drop_last`]).
    pub fn drop_last(self, drop: bool) -> DistributedData<'a, T> {
        self.resample(|s| s.drop_last(drop))
    }

    fn resample(
        mut self,
        change: impl FnOnce(DistributedSampler) -> DistributedSampler,
    ) -> DistributedData<'a, T> {
        self.sampler = change(self.sampler);
        self.indices = self.sampler.indices();
        self
    }

    /// Sets the epoch ([`DistributedSampler::set_epoch`]), with the same
    /// value on every rank.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.sampler.set_epoch(epoch);
        self.indices = self.sampler.indices();
    }

    /// The sampler that picks the items.
    pub fn sampler(&self) -> &DistributedSampler {
        &self.sampler
    }

    /// Number of items this rank sees per epoch.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// True when this rank sees no item.
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// This rank's `i`-th item in the current epoch.
    pub fn get(&self, i: usize) -> Option<&'a T> {
        self.data.get(*self.indices.get(i)?)
    }

    /// This rank's items in the current epoch, in order.
    pub fn iter(&self) -> impl Iterator<Item = &'a T> + '_ {
        let data = self.data;
        self.indices.iter().map(move |&i| &data[i])
    }
}

/// SplitMix64 (Steele, Lea and Flood, 2014): its numbers depend on the seed
/// alone, so every rank draws the same ones.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform number in `0..n` (`n > 0`): Lemire's multiply-and-shift,
    /// redrawing the few values that would favour some results.
    fn below(&mut self, n: u64) -> u64 {
        let threshold = n.wrapping_neg() % n;
        loop {
            let m = u128::from(self.next()) * u128::from(n);
            if m as u64 >= threshold {
                return (m >> 64) as u64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn sampler(len: usize, n: usize, r: usize) -> DistributedSampler {
        DistributedSampler::new(len, n, r).unwrap()
    }

    /// Every rank's indices for one epoch.
    fn shares(len: usize, n: usize, seed: Option<u64>, drop: bool, epoch: u64) -> Vec<Vec<usize>> {
        (0..n)
            .map(|r| {
                let mut s = sampler(len, n, r).drop_last(drop);
                if let Some(seed) = seed {
                    s = s.shuffle(seed);
                }
                s.set_epoch(epoch);
                s.indices()
            })
            .collect()
    }

    #[test]
    fn ranks_take_every_n_th_index_of_the_padded_order() {
        let all = shares(10, 3, None, false, 0);
        assert_eq!(all, [vec![0, 3, 6, 9], vec![1, 4, 7, 0], vec![2, 5, 8, 1]]);
        let dropped = shares(10, 3, None, true, 0);
        assert_eq!(dropped, [vec![0, 3, 6], vec![1, 4, 7], vec![2, 5, 8]]);
        // More ranks than items: padding repeats the items over and over.
        assert_eq!(shares(2, 5, None, false, 0), [[0], [1], [0], [1], [0]]);
        assert_eq!(shares(2, 5, None, true, 0), vec![Vec::<usize>::new(); 5]);
        assert!(shares(0, 3, Some(1), false, 0).iter().all(Vec::is_empty));
    }

    /// Over the ranks, each epoch covers every index once, plus the first
    /// indices of the epoch's order repeated (padding) or minus its last
    /// ones (drop_last); every rank takes as many.
    #[test]
    fn ranks_share_each_epoch_exactly() {
        for len in [0, 1, 2, 7, 12, 13, 100] {
            for n in [1, 2, 3, 4, 5, 16] {
                for drop in [false, true] {
                    for epoch in [0, 1, 5] {
                        let what = format!("len {len}, {n} ranks, drop_last {drop}, epoch {epoch}");
                        let order = shares(len, 1, Some(9), false, epoch).remove(0);
                        let mut sorted = order.clone();
                        sorted.sort_unstable();
                        assert_eq!(sorted, (0..len).collect::<Vec<_>>(), "{what}");
                        let all = shares(len, n, Some(9), drop, epoch);
                        let per_rank = all[0].len();
                        assert!(all.iter().all(|s| s.len() == per_rank), "{what}");
                        let mut counts: HashMap<usize, usize> = HashMap::new();
                        for &i in all.iter().flatten() {
                            *counts.entry(i).or_default() += 1;
                        }
                        let total = per_rank * n;
                        if drop {
                            assert!(total <= len && len - total < n, "{what}");
                            for (p, i) in order.iter().enumerate() {
                                let want = usize::from(p < total);
                                assert_eq!(counts.get(i).copied().unwrap_or(0), want, "{what}");
                            }
                        } else {
                            assert!(total >= len && total - len < n.max(1), "{what}");
                            for (p, i) in order.iter().enumerate() {
                                // Padding adds whole rounds of the order, then its start.
                                let want = (total - p).div_ceil(len);
                                assert_eq!(counts[i], want, "{what}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_order_changes_with_the_epoch_and_the_seed_only() {
        assert_eq!(SplitMix64(0).next(), 0xe220_a839_7b1d_cdaf);
        let at = |seed, epoch| shares(100, 4, Some(seed), false, epoch);
        assert_eq!(at(3, 1), at(3, 1));
        assert_ne!(at(3, 0), at(3, 1));
        assert_ne!(at(3, 1), at(4, 1));
        // Without shuffling the epoch changes nothing.
        assert_eq!(
            shares(100, 4, None, false, 0),
            shares(100, 4, None, false, 7)
        );
        // Pinned (SplitMix64 from seed 0 first gives 0xe220a8397b1dcdaf, as its
        // reference does), so that a change of the generator shows: ranks
        // running different versions of ccl must still draw the same order.
        assert_eq!(
            shares(10, 1, Some(42), false, 0)[0],
            [1, 7, 2, 5, 6, 4, 0, 9, 8, 3]
        );
    }

    #[test]
    fn shuffles_are_uniform() {
        // 6000 shuffles of 3 items: each of the 6 orders about 1000 times.
        let mut seen: HashMap<Vec<usize>, usize> = HashMap::new();
        for epoch in 0..6000 {
            *seen
                .entry(shares(3, 1, Some(5), false, epoch).remove(0))
                .or_default() += 1;
        }
        assert_eq!(seen.len(), 6);
        assert!(seen.values().all(|&c| (850..1150).contains(&c)), "{seen:?}");
    }

    #[test]
    fn a_rank_outside_the_world_is_an_error() {
        assert!(matches!(
            DistributedSampler::new(5, 2, 2),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            DistributedSampler::new(5, 0, 0),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn data_follows_its_sampler() {
        let data: Vec<u32> = (100..110).collect();
        let sampler = sampler(10, 3, 2).shuffle(1);
        let mut share = DistributedData::with_sampler(&data, sampler.clone()).unwrap();
        let items =
            |s: &DistributedData<u32>| s.iter().map(|&x| x as usize - 100).collect::<Vec<_>>();
        assert_eq!(items(&share), sampler.indices());
        assert_eq!(share.len(), 4);
        assert_eq!(
            share.get(0).map(|&x| x as usize - 100),
            Some(sampler.indices()[0])
        );
        assert_eq!(share.get(4), None);
        share.set_epoch(3);
        let mut later = sampler.clone();
        later.set_epoch(3);
        assert_eq!(items(&share), later.indices());
        let share = share.drop_last(true);
        assert_eq!(share.len(), 3);
        assert_eq!(share.sampler().epoch(), 3);
        assert!(matches!(
            DistributedData::with_sampler(&data[..9], sampler),
            Err(Error::InvalidArgument(_))
        ));
    }
}
