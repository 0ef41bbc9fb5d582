//! The registration cache: registering memory with a NIC pins its pages and
//! costs tens of microseconds or more, so a buffer that is sent or received
//! again (a training loop's gradients) reuses its registration.
//!
//! Entries are kept per NIC, looked up by address range (a registration that
//! covers the asked range is a hit), used by at most as many operations as
//! hold them, and evicted least recently used first when more than
//! `capacity` are kept. A buffer that is freed must not keep its
//! registration (its addresses may come back mapped to other pages): the
//! owner of memory that goes away calls [`RegCache::invalidate`] (the
//! links do for a receive cancelled after its buffer was advertised), and
//! the communicator's close drops them all ([`RegCache::clear`]). ccl
//! cannot see a user's `free`, so where a registration pins its pages (see
//! [`Verbs::follows_remaps`]) the cache keeps none unused (capacity 0): a
//! registration then lasts as long as the operations that hold it. GPU
//! memory (a `cudaFree` is as invisible) is never kept unused either.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::verbs::{Region, Verbs};

/// What a cache did, for tests and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub invalidations: u64,
}

struct Entry {
    region: Region,
    last_used: u64,
    in_use: usize,
    /// Invalidated while in use, or GPU memory: deregistered when the last
    /// user lets go.
    doomed: bool,
}

/// Registrations of one NIC (see the module docs).
pub struct RegCache {
    entries: Vec<Entry>,
    capacity: usize,
    tick: u64,
    stats: CacheStats,
}

/// Registrations made through every cache of this process, for tests.
pub static REGISTRATIONS: AtomicU64 = AtomicU64::new(0);

impl RegCache {
    /// An empty cache keeping at most `capacity` unused registrations (0:
    /// each goes once no operation holds it).
    pub fn new(capacity: usize) -> RegCache {
        RegCache {
            entries: Vec::new(),
            capacity,
            tick: 0,
            stats: CacheStats::default(),
        }
    }

    /// What the cache did so far.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Registrations kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it keeps none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// A registration covering `[addr, addr + len)`, of GPU memory where
    /// `device` says so, reused or new; the caller gives it back with
    /// [`RegCache::release`]. (GPU and host memory never share addresses:
    /// CUDA's unified addressing.)
    pub fn acquire<V: Verbs>(
        &mut self,
        verbs: &V,
        addr: u64,
        len: usize,
        device: bool,
    ) -> Result<Region, String> {
        self.tick += 1;
        let tick = self.tick;
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| !e.doomed && e.region.covers(addr, len))
        {
            e.last_used = tick;
            e.in_use += 1;
            self.stats.hits += 1;
            return Ok(e.region);
        }
        self.stats.misses += 1;
        let region = match device {
            true => verbs.register_device(addr, len.max(1))?,
            false => verbs.register(addr, len.max(1))?,
        };
        REGISTRATIONS.fetch_add(1, Ordering::Relaxed);
        self.entries.push(Entry {
            region,
            last_used: tick,
            in_use: 1,
            doomed: device,
        });
        self.evict(verbs);
        Ok(region)
    }

    /// Gives back a registration from [`RegCache::acquire`].
    pub fn release<V: Verbs>(&mut self, verbs: &V, region: &Region) {
        if let Some(i) = self.entries.iter().position(|e| e.region == *region) {
            let e = &mut self.entries[i];
            e.in_use = e.in_use.saturating_sub(1);
            if e.in_use == 0 && e.doomed {
                verbs.deregister(&self.entries.swap_remove(i).region);
            }
        }
        self.evict(verbs);
    }

    /// Drops every registration that overlaps `[addr, addr + len)`: that
    /// memory was freed (those in use go when released).
    pub fn invalidate<V: Verbs>(&mut self, verbs: &V, addr: u64, len: usize) {
        let end = addr.saturating_add(len as u64);
        let mut i = 0;
        while i < self.entries.len() {
            let r = self.entries[i].region;
            if r.addr < end && addr < r.addr + r.len as u64 && !self.entries[i].doomed {
                self.stats.invalidations += 1;
                if self.entries[i].in_use == 0 {
                    verbs.deregister(&self.entries.swap_remove(i).region);
                    continue;
                }
                self.entries[i].doomed = true;
            }
            i += 1;
        }
    }

    /// Drops every registration (the communicator closes).
    pub fn clear<V: Verbs>(&mut self, verbs: &V) {
        for e in self.entries.drain(..) {
            verbs.deregister(&e.region);
        }
    }

    /// Deregisters the least recently used unused entries beyond capacity.
    fn evict<V: Verbs>(&mut self, verbs: &V) {
        while self.entries.len() > self.capacity {
            let Some((i, _)) = self
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| e.in_use == 0)
                .min_by_key(|(_, e)| e.last_used)
            else {
                return;
            };
            verbs.deregister(&self.entries.swap_remove(i).region);
            self.stats.evictions += 1;
        }
    }
}
