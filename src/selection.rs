//! Selection: which algorithm a call runs with (the tuner's choice) and
//! the plan the engine runs, with schedules kept for repeated calls.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use ccl_algorithms::{Choice, Layout, Schedule, Tuner};
use ccl_core::{Collective, CollectiveKind, Error, LinkClass, Result};

use crate::engine::Plan;

/// Schedules kept per communicator for repeated calls.
const SCHEDULE_CACHE: usize = 64;

/// What a cached schedule depends on besides the communicator: kind,
/// algorithm, count, root, whether the op finalizes, and the buffers' layout.
type ScheduleKey = (CollectiveKind, Choice, usize, usize, bool, Layout);

/// A communicator's algorithm selection.
pub(crate) struct Selection {
    rank: usize,
    world_size: usize,
    tuner: Tuner,
    /// Largest piece a schedule moves at once, unless the choice says.
    piece_bytes: usize,
    /// The ranks listed by locality (`bootstrap::locality_order`).
    order: Vec<usize>,
    schedules: Mutex<Schedules>,
}

/// Schedules kept for repeated calls, and the last one used apart: a loop
/// repeats one call, whose key is compared rather than hashed.
#[derive(Default)]
struct Schedules {
    last: Option<(ScheduleKey, Arc<Schedule>)>,
    all: HashMap<ScheduleKey, Arc<Schedule>>,
}

impl Selection {
    /// Selection for rank `rank` of `world_size` over links of `class`,
    /// with the ranks listed by locality in `order`.
    pub(crate) fn new(
        rank: usize,
        world_size: usize,
        tuner: Tuner,
        class: LinkClass,
        order: Vec<usize>,
    ) -> Selection {
        Selection {
            rank,
            world_size,
            tuner,
            piece_bytes: class.piece_bytes,
            order,
            schedules: Mutex::default(),
        }
    }

    /// The tuner's choice for `coll`.
    #[inline]
    pub(crate) fn choice(&self, coll: &Collective) -> Choice {
        self.tuner.choose(coll)
    }

    /// Whether the communicator has group memory.
    pub(crate) fn has_group_memory(&self) -> bool {
        self.tuner.has_group_memory()
    }

    /// The plan of `coll` with `choice` on buffers of `layout`: a group
    /// algorithm, or a schedule.
    pub(crate) fn plan(&self, coll: &Collective, choice: Choice, layout: Layout) -> Result<Plan> {
        if choice.algorithm.on_group_memory() {
            return Ok(Plan::Group(choice.algorithm));
        }
        let key = (
            coll.kind,
            choice,
            coll.count,
            coll.root,
            coll.finalizes(),
            layout,
        );
        let mut cache = self.schedules.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, s)) = cache.last.as_ref().filter(|(k, _)| *k == key) {
            return Ok(Plan::Schedule(s.clone()));
        }
        let schedule = match cache.all.get(&key) {
            Some(s) => s.clone(),
            None => {
                let piece = choice.piece_bytes.unwrap_or(self.piece_bytes) / coll.dtype.size();
                let schedule = choice
                    .algorithm
                    .schedule_in_order(
                        coll,
                        self.rank,
                        self.world_size,
                        piece.max(1),
                        layout,
                        &self.order,
                    )
                    .map_err(Error::Internal)?;
                let schedule = Arc::new(schedule);
                if cache.all.len() >= SCHEDULE_CACHE {
                    cache.all.clear();
                }
                cache.all.insert(key, schedule.clone());
                schedule
            }
        };
        cache.last = Some((key, schedule.clone()));
        Ok(Plan::Schedule(schedule))
    }
}
