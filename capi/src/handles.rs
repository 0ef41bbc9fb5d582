//! Handles: what C holds is a slot number and a generation, never a
//! pointer into Rust memory, so a destroyed, stale or made-up handle is
//! found out by a lookup instead of being dereferenced.

use std::sync::{Arc, RwLock};

/// Live objects of one kind, by handle.
pub(crate) struct Table<T> {
    slots: RwLock<Vec<Slot<T>>>,
}

struct Slot<T> {
    /// Bumped each time the slot is filled: an old handle to it no longer matches.
    generation: u32,
    value: Option<Arc<T>>,
}

impl<T> Table<T> {
    pub(crate) const fn new() -> Table<T> {
        Table {
            slots: RwLock::new(Vec::new()),
        }
    }

    /// Stores `value` and returns its handle (never 0).
    pub(crate) fn insert(&self, value: T) -> usize {
        let mut slots = self.slots.write().unwrap_or_else(|p| p.into_inner());
        let index = match slots.iter().position(|s| s.value.is_none()) {
            Some(i) => i,
            None => {
                slots.push(Slot {
                    generation: 0,
                    value: None,
                });
                slots.len() - 1
            }
        };
        let slot = &mut slots[index];
        slot.generation = slot.generation % 0xff_ffff + 1;
        slot.value = Some(Arc::new(value));
        handle(index, slot.generation)
    }

    /// The object behind `handle`, if it is live.
    pub(crate) fn get(&self, handle: usize) -> Option<Arc<T>> {
        let (index, generation) = parts(handle)?;
        let slots = self.slots.read().unwrap_or_else(|p| p.into_inner());
        let slot = slots.get(index)?;
        (slot.generation == generation)
            .then(|| slot.value.clone())
            .flatten()
    }

    /// Takes the object behind `handle` out of the table (its handle dies).
    pub(crate) fn remove(&self, handle: usize) -> Option<Arc<T>> {
        let (index, generation) = parts(handle)?;
        let mut slots = self.slots.write().unwrap_or_else(|p| p.into_inner());
        let slot = slots.get_mut(index)?;
        if slot.generation != generation {
            return None;
        }
        slot.value.take()
    }
}

/// Slot index and generation in one pointer-sized value: the low 24 bits
/// hold the index plus one, the rest the generation.
fn handle(index: usize, generation: u32) -> usize {
    ((generation as usize & 0xff_ffff) << 24) | (index + 1)
}

fn parts(handle: usize) -> Option<(usize, u32)> {
    let index = (handle & 0xff_ffff).checked_sub(1)?;
    Some((index, ((handle >> 24) & 0xff_ffff) as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_and_made_up_handles_find_nothing() {
        let t = Table::new();
        let a = t.insert("a");
        assert_eq!(t.get(a).as_deref(), Some(&"a"));
        assert_eq!(t.remove(a).as_deref(), Some(&"a"));
        assert!(t.get(a).is_none() && t.remove(a).is_none());
        let b = t.insert("b");
        assert_ne!(a, b, "a reused slot has a new generation");
        assert!(t.get(a).is_none());
        for junk in [0, 1, usize::MAX, 0xdead_beef, b + 1] {
            assert!(t.get(junk).is_none(), "{junk:#x}");
        }
        assert_eq!(t.get(b).as_deref(), Some(&"b"));
    }
}
