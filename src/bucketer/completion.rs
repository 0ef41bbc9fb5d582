//! The bucketer's completion thread: waits for each launched bucket in
//! launch order, unpacks it into its tensors, and completes each step's
//! [`Work`] with [`Reduced`].

use std::{
    fmt,
    sync::{mpsc, Arc, Mutex},
};

use ccl_core::{Completer, Element, Error, Result};

use super::{
    erased::{Boxed, Ops, Pending},
    invalid, Tensor, TensorId,
};

/// What the completion thread is told.
pub(super) enum Msg {
    /// Bucket `bucket` was launched; `tensors` are (id, buffer, offset) to
    /// fill from its result; a direct bucket's result is tensor `direct`;
    /// a bucket reduced where its tensors lie gives back tensors `in_place`,
    /// in that order.
    Launched {
        bucket: usize,
        pending: Result<Box<dyn Pending>>,
        ops: &'static Ops,
        tensors: Vec<(usize, Boxed, usize)>,
        direct: Option<usize>,
        in_place: Vec<usize>,
    },
    /// Every bucket of the step was launched: complete the step's `Work`.
    Finish(Completer<Reduced>),
}

/// Waits for each launched bucket in launch order, unpacks it into its
/// tensors, and completes each step's `Work`.
pub(super) fn complete_steps(
    rx: mpsc::Receiver<Msg>,
    pool: Arc<Mutex<Vec<Option<Boxed>>>>,
    n: usize,
) {
    let mut slots: Vec<Option<Boxed>> = (0..n).map(|_| None).collect();
    let mut first_error: Option<Error> = None;
    while let Ok(msg) = rx.recv() {
        match msg {
            Msg::Launched {
                bucket,
                pending,
                ops,
                tensors,
                direct,
                in_place,
            } => {
                let result = pending.and_then(|p| p.wait());
                match (result, direct) {
                    (Ok(buf), Some(id)) => slots[id] = Some(buf),
                    (Ok(all), None) if !in_place.is_empty() => match (ops.split)(all) {
                        Ok(grads) => {
                            for (id, g) in in_place.into_iter().zip(grads) {
                                slots[id] = Some(g);
                            }
                        }
                        Err(e) => {
                            first_error.get_or_insert(e);
                        }
                    },
                    (Ok(buf), None) => {
                        for (id, mut g, off) in tensors {
                            if let Err(e) = (ops.unpack)(&buf, &mut g, off) {
                                first_error.get_or_insert(e);
                            }
                            slots[id] = Some(g);
                        }
                        if let Some(s) = pool
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_mut(bucket)
                        {
                            *s = Some(buf);
                        }
                    }
                    (Err(e), _) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
            Msg::Finish(completer) => {
                let taken = std::mem::replace(&mut slots, (0..n).map(|_| None).collect());
                match first_error.take() {
                    Some(e) => completer.complete(Err(e)),
                    None => completer.complete(Ok(Reduced { slots: taken })),
                }
            }
        }
    }
}

/// The tensors of one step, reduced: take each back by its [`TensorId`].
pub struct Reduced {
    pub(super) slots: Vec<Option<Boxed>>,
}

impl fmt::Debug for Reduced {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let left = self.slots.iter().filter(|s| s.is_some()).count();
        write!(f, "Reduced({left} of {} tensors left)", self.slots.len())
    }
}

impl Reduced {
    pub(super) fn new(tensors: &[Tensor]) -> Reduced {
        Reduced {
            slots: tensors.iter().map(|_| None).collect(),
        }
    }

    /// Number of tensors of the step (taken or not).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when the step had no tensors.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Takes tensor `id` back: the `Vec` handed to [`Bucketer::ready`](super::Bucketer::ready),
    /// holding the reduced values.
    pub fn take<T: Element>(&mut self, id: TensorId) -> Result<Vec<T>> {
        let n = self.slots.len();
        let slot = self
            .slots
            .get_mut(id.0)
            .ok_or_else(|| invalid(format!("unknown {id} (the step had {n} tensors)")))?;
        let b = slot.take().ok_or_else(|| {
            invalid(format!(
                "{id} has no Vec here: already taken, or marked ready in place \
                     (read it with Bucketer::view)"
            ))
        })?;
        match b.downcast::<Vec<T>>() {
            Ok(v) => Ok(*v),
            Err(b) => {
                *slot = Some(b);
                Err(invalid(format!("{id} is not a tensor of {}", T::DTYPE)))
            }
        }
    }

    /// Takes every tensor back, in registration order, when they all have
    /// element type `T`.
    pub fn into_vecs<T: Element>(mut self) -> Result<Vec<Vec<T>>> {
        (0..self.slots.len())
            .map(|i| self.take(TensorId(i)))
            .collect()
    }
}
