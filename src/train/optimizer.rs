//! [`Optimizer`], the ready-made [`Sgd`], and [`DistributedOptimizer`],
//! which averages the gradients over the ranks before the inner step.

use ccl_core::{Element, Error, Result};

use crate::{Bucketer, Communicator, ReduceOp, TensorId};

/// Updates parameter tensors from their gradients. Parameters are a list of
/// tensors (slices, in a fixed order); `grads[i]` is the gradient of
/// `params[i]`, of the same length.
pub trait Optimizer<T: Element = f32> {
    /// Takes one step: updates every `params[i]` from `grads[i]`. Fails
    /// with [`Error::InvalidArgument`] when the lists or the tensors' lengths
    /// differ, or differ from earlier steps where the optimizer keeps state.
    fn step(&mut self, params: &mut [&mut [T]], grads: &[&[T]]) -> Result<()>;

    /// The optimizer's state (momentum and the like), tensor by tensor in a
    /// fixed order, for [`synchronize`](super::synchronize) to copy from a
    /// root. None by default.
    fn state(&mut self) -> Vec<&mut [T]> {
        Vec::new()
    }
}

/// Checks that `grads` pairs with `params`, tensor by tensor.
fn check_pairs<T>(who: &str, params: &[&mut [T]], grads: &[&[T]]) -> Result<()> {
    if params.len() != grads.len() {
        return Err(Error::InvalidArgument(format!(
            "{who}: {} parameter tensors but {} gradients",
            params.len(),
            grads.len()
        )));
    }
    match params
        .iter()
        .zip(grads)
        .position(|(p, g)| p.len() != g.len())
    {
        Some(i) => Err(Error::InvalidArgument(format!(
            "{who}: parameter tensor {i} has {} elements but its gradient {}",
            params[i].len(),
            grads[i].len()
        ))),
        None => Ok(()),
    }
}

/// Stochastic gradient descent with optional momentum, as torch's `SGD`
/// (no dampening): `v = momentum * v + g; p -= learning_rate * v`, with
/// `v` starting at zero; without momentum, `p -= learning_rate * g`.
/// For `f32` and `f64` tensors; its state is the momentum buffers, made
/// at the first step.
#[derive(Clone, Debug, PartialEq)]
pub struct Sgd<T = f32> {
    learning_rate: f64,
    momentum: f64,
    /// One buffer per tensor once a step with momentum ran.
    velocity: Vec<Vec<T>>,
}

impl<T> Sgd<T> {
    /// Plain SGD with this learning rate.
    pub fn new(learning_rate: f64) -> Sgd<T> {
        Sgd {
            learning_rate,
            momentum: 0.0,
            velocity: Vec::new(),
        }
    }

    /// With momentum (0.9 is usual; 0 turns it off).
    pub fn with_momentum(mut self, momentum: f64) -> Sgd<T> {
        self.momentum = momentum;
        self
    }

    /// The learning rate.
    pub fn learning_rate(&self) -> f64 {
        self.learning_rate
    }

    /// Changes the learning rate for later steps (a schedule).
    pub fn set_learning_rate(&mut self, learning_rate: f64) {
        self.learning_rate = learning_rate;
    }

    /// The momentum.
    pub fn momentum(&self) -> f64 {
        self.momentum
    }
}

macro_rules! sgd_for {
    ($($t:ty),*) => {$(
        impl Optimizer<$t> for Sgd<$t> {
            fn step(&mut self, params: &mut [&mut [$t]], grads: &[&[$t]]) -> Result<()> {
                check_pairs("Sgd", params, grads)?;
                let lr = self.learning_rate as $t;
                if self.momentum == 0.0 {
                    for (p, g) in params.iter_mut().zip(grads) {
                        p.iter_mut().zip(*g).for_each(|(p, g)| *p -= lr * g);
                    }
                    return Ok(());
                }
                if self.velocity.is_empty() {
                    self.velocity = grads.iter().map(|g| vec![0.0; g.len()]).collect();
                }
                let same = self.velocity.len() == grads.len()
                    && self.velocity.iter().zip(grads).all(|(v, g)| v.len() == g.len());
                if !same {
                    return Err(Error::InvalidArgument(
                        "Sgd: the tensors differ from those of earlier steps".into(),
                    ));
                }
                let mu = self.momentum as $t;
                for ((p, g), v) in params.iter_mut().zip(grads).zip(&mut self.velocity) {
                    for ((p, g), v) in p.iter_mut().zip(*g).zip(v) {
                        *v = mu * *v + g;
                        *p -= lr * *v;
                    }
                }
                Ok(())
            }

            fn state(&mut self) -> Vec<&mut [$t]> {
                self.velocity.iter_mut().map(Vec::as_mut_slice).collect()
            }
        }
    )*};
}

sgd_for!(f32, f64);

/// Wraps an optimizer so that each step first averages the gradients over
/// the communicator's ranks (Lux's `DistributedOptimizer`), then takes the
/// inner optimizer's step with the average. Every rank then takes the same
/// step from the same parameters and stays in step with the others.
///
/// The gradients are averaged through a [`Bucketer`] with [`ReduceOp::Avg`]:
/// many small tensors go in few allreduces. The first step registers the
/// tensors; later steps must pass tensors of the same lengths, and every
/// rank the same ones in the same order. The step copies the gradients into
/// buffers of its own (kept from step to step), so the caller's stay as they
/// were. To overlap the averaging with a backward pass, drive a [`Bucketer`]
/// directly instead.
///
/// ```no_run
/// use ccl::train::{DistributedOptimizer, Optimizer, Sgd};
/// let comm = ccl::Communicator::from_env()?;
/// let mut opt = DistributedOptimizer::new(&comm, Sgd::new(0.1));
/// let (mut w, mut b) = (vec![0.0f32; 4], vec![0.0f32]);
/// let (gw, gb) = (vec![1.0f32; 4], vec![0.5f32]); // this rank's gradients
/// opt.step(&mut [&mut w, &mut b], &[&gw, &gb])?;
/// # Ok::<(), ccl::Error>(())
/// ```
pub struct DistributedOptimizer<O, T: Element = f32> {
    inner: O,
    bucketer: Bucketer,
    /// The tensors, registered at the first step.
    gradients: Option<Vec<Gradient<T>>>,
}

/// A tensor registered with the bucketer, and the buffer its gradient
/// travels in (kept from step to step).
struct Gradient<T> {
    id: TensorId,
    len: usize,
    buf: Vec<T>,
}

impl<O: std::fmt::Debug, T: Element> std::fmt::Debug for DistributedOptimizer<O, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedOptimizer")
            .field("inner", &self.inner)
            .field("bucketer", &self.bucketer)
            .finish()
    }
}

impl<O, T: Element> DistributedOptimizer<O, T> {
    /// Averages gradients over `comm`'s ranks (through a handle it keeps)
    /// before each step of `inner`.
    pub fn new(comm: &Communicator, inner: O) -> DistributedOptimizer<O, T> {
        DistributedOptimizer {
            inner,
            bucketer: Bucketer::new(comm, ReduceOp::Avg),
            gradients: None,
        }
    }

    /// Sets the largest allreduce in bytes (before the first step; see
    /// [`Bucketer::with_cap_bytes`]).
    pub fn with_cap_bytes(mut self, cap: usize) -> DistributedOptimizer<O, T> {
        self.bucketer = self.bucketer.with_cap_bytes(cap);
        self
    }

    /// The inner optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The inner optimizer, to change (its learning rate, say, on every rank alike).
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// Gives the inner optimizer back.
    pub fn into_inner(self) -> O {
        self.inner
    }
}

/// Registers a tensor per gradient of the first step.
fn register<T: Element>(bucketer: &mut Bucketer, grads: &[&[T]]) -> Result<Vec<Gradient<T>>> {
    grads
        .iter()
        .map(|g| {
            Ok(Gradient {
                id: bucketer.register::<T>(g.len())?,
                len: g.len(),
                buf: Vec::with_capacity(g.len()),
            })
        })
        .collect()
}

impl<O: Optimizer<T>, T: Element> Optimizer<T> for DistributedOptimizer<O, T> {
    /// Averages `grads` over the ranks, then takes the inner optimizer's step
    /// with the average.
    fn step(&mut self, params: &mut [&mut [T]], grads: &[&[T]]) -> Result<()> {
        check_pairs("DistributedOptimizer", params, grads)?;
        let DistributedOptimizer {
            inner,
            bucketer,
            gradients,
        } = self;
        let gradients = match gradients {
            Some(registered) => registered,
            None => gradients.insert(register(bucketer, grads)?),
        };
        // Checked before anything is handed over, so that a refused step
        // leaves the bucketer between steps.
        let same = gradients.len() == grads.len()
            && gradients.iter().zip(grads).all(|(r, g)| r.len == g.len());
        if !same {
            return Err(Error::InvalidArgument(format!(
                "DistributedOptimizer: the gradients' lengths {:?} differ from the first step's {:?}",
                grads.iter().map(|g| g.len()).collect::<Vec<_>>(),
                gradients.iter().map(|r| r.len).collect::<Vec<_>>()
            )));
        }
        for (r, g) in gradients.iter_mut().zip(grads) {
            r.buf.clear();
            r.buf.extend_from_slice(g);
            bucketer.ready(r.id, std::mem::take(&mut r.buf))?;
        }
        let mut averaged = bucketer.finish().wait()?;
        for r in gradients.iter_mut() {
            r.buf = averaged.take(r.id)?;
        }
        let averaged: Vec<&[T]> = gradients.iter().map(|r| r.buf.as_slice()).collect();
        inner.step(params, &averaged)
    }

    fn state(&mut self) -> Vec<&mut [T]> {
        self.inner.state()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::tests::on_ranks;

    fn invalid<T: std::fmt::Debug>(r: Result<T>) -> String {
        match r {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("expected an invalid-argument error, got {other:?}"),
        }
    }

    #[test]
    fn sgd_steps_as_torch_s() {
        let mut plain = Sgd::<f64>::new(0.5);
        let mut p = vec![1.0, 2.0];
        plain.step(&mut [&mut p], &[&[0.5, -1.0]]).unwrap();
        assert_eq!(p, [0.75, 2.5]);
        assert!(plain.state().is_empty());

        let mut heavy = Sgd::<f64>::new(0.5).with_momentum(0.5);
        let (mut a, mut b) = (vec![1.0], vec![0.0, 0.0]);
        heavy
            .step(&mut [&mut a, &mut b], &[&[1.0], &[2.0, -2.0]])
            .unwrap();
        // v = g, p -= 0.5 v
        assert_eq!((a.clone(), b.clone()), (vec![0.5], vec![-1.0, 1.0]));
        heavy
            .step(&mut [&mut a, &mut b], &[&[1.0], &[0.0, 0.0]])
            .unwrap();
        // v = 0.5 v + g
        assert_eq!((a, b), (vec![-0.25], vec![-1.5, 1.5]));
        assert_eq!(heavy.state(), [&mut [1.5][..], &mut [1.0, -1.0][..]]);
    }

    #[test]
    fn sgd_refuses_tensors_that_do_not_pair() {
        let mut sgd = Sgd::<f32>::new(0.1).with_momentum(0.9);
        let mut p = vec![0.0f32; 2];
        assert!(invalid(sgd.step(&mut [&mut p], &[])).contains("1 parameter tensors but 0"));
        assert!(invalid(sgd.step(&mut [&mut p], &[&[1.0]])).contains("tensor 0 has 2 elements"));
        sgd.step(&mut [&mut p], &[&[1.0, 1.0]]).unwrap();
        let mut q = vec![0.0f32; 3];
        assert!(invalid(sgd.step(&mut [&mut q], &[&[1.0; 3]])).contains("earlier steps"));
    }

    #[test]
    fn distributed_steps_use_the_average_gradient() {
        let results = on_ranks(3, |comm| {
            let r = comm.rank() as f32;
            let mut opt = DistributedOptimizer::new(&comm, Sgd::new(1.0)).with_cap_bytes(8);
            let (mut w, mut b) = (vec![0.0f32; 3], vec![10.0f32]);
            // Gradients r and 2r: averages 1 and 2.
            let (gw, gb) = (vec![r; 3], vec![2.0 * r]);
            opt.step(&mut [&mut w, &mut b], &[&gw, &gb]).unwrap();
            let first = (w.clone(), b.clone());
            // A refused step changes nothing and leaves the next one working.
            let refused = invalid(opt.step(&mut [&mut w, &mut b], &[&gb, &gw]));
            opt.step(&mut [&mut w, &mut b], &[&gw, &gb]).unwrap();
            assert_eq!(gw, vec![r; 3], "the caller's gradients stay");
            (first, refused, w, b)
        });
        for (first, refused, w, b) in results {
            assert_eq!(first, (vec![-1.0; 3], vec![8.0]));
            assert!(
                refused.contains("parameter tensor 0 has 3 elements"),
                "{refused}"
            );
            assert_eq!((w, b), (vec![-2.0; 3], vec![6.0]));
        }
    }

    #[test]
    fn distributed_steps_refuse_other_tensors_than_the_first_step_s() {
        on_ranks(2, |comm| {
            let mut opt = DistributedOptimizer::new(&comm, Sgd::<f64>::new(0.1));
            let mut w = vec![0.0f64; 2];
            opt.step(&mut [&mut w], &[&[1.0, 1.0]]).unwrap();
            let mut v = vec![0.0f64; 3];
            let msg = invalid(opt.step(&mut [&mut v], &[&[1.0; 3]]));
            assert!(msg.contains("differ from the first step's [2]"), "{msg}");
            opt.step(&mut [&mut w], &[&[1.0, 1.0]]).unwrap();
            assert_eq!(w, [-0.2, -0.2]);
        });
    }
}
