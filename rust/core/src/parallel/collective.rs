//! An in-process collective among the rank threads of one tensor-parallel group: every rank deposits a
//! contribution, the last to arrive publishes all of them, and every rank derives the same result from the
//! same inputs in rank order (so an all-reduce is bit-identical on every rank).
//!
//! Failure never hangs: a rank that fails poisons the collective with its error, waking every waiter with
//! that same error; a rank that finishes its command while another still waits in an exchange (the ranks
//! diverged) poisons it too. The group resets it between commands, when every rank is idle.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::sampling::Sampled;

/// What one rank puts into an exchange.
#[derive(Debug, Clone)]
pub enum Payload {
    F32(Vec<f32>),
    Sampled(Vec<Sampled>),
    Nothing,
}

#[derive(Default)]
struct State {
    generation: u64,
    arrived: usize,
    deposits: Vec<Option<Payload>>,
    published: Option<Arc<Vec<Payload>>>,
    poisoned: Option<String>,
    departed: usize,
}

pub struct Collective {
    world: usize,
    state: Mutex<State>,
    wake: Condvar,
}

impl Collective {
    pub fn new(world: usize) -> Arc<Self> {
        let state = State { deposits: vec![None; world], ..State::default() };
        Arc::new(Self { world, state: Mutex::new(state), wake: Condvar::new() })
    }

    pub fn world_size(&self) -> usize {
        self.world
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn failure(s: &State) -> Option<Error> {
        s.poisoned.as_ref().map(|m| Error::Device(m.clone()))
    }

    /// Deposit `payload` and wait for every rank's; returns all deposits in rank order.
    pub fn exchange(&self, rank: usize, payload: Payload) -> Result<Arc<Vec<Payload>>> {
        let mut s = self.lock();
        if let Some(e) = Self::failure(&s) {
            return Err(e);
        }
        if s.departed > 0 {
            return Err(self.poison_locked(&mut s, format!("tensor-parallel rank {rank} entered a collective that another rank had already left (ranks diverged)")));
        }
        let my_generation = s.generation;
        s.deposits[rank] = Some(payload);
        s.arrived += 1;
        if s.arrived == self.world {
            let all: Vec<Payload> = s.deposits.iter_mut().map(|d| d.take().unwrap_or(Payload::Nothing)).collect();
            let all = Arc::new(all);
            s.published = Some(Arc::clone(&all));
            s.arrived = 0;
            s.generation += 1;
            self.wake.notify_all();
            return Ok(all);
        }
        loop {
            s = self.wake.wait(s).unwrap_or_else(|p| p.into_inner());
            if s.generation != my_generation {
                return Ok(Arc::clone(s.published.as_ref().expect("published with the generation")));
            }
            if let Some(e) = Self::failure(&s) {
                return Err(e);
            }
            if s.departed > 0 {
                return Err(self.poison_locked(&mut s, format!("tensor-parallel rank {rank} waits in a collective that another rank has left (ranks diverged)")));
            }
        }
    }

    /// Sum of every rank's vector, elementwise in rank order; the same bits on every rank.
    pub fn all_reduce_sum(&self, rank: usize, data: &mut [f32]) -> Result<()> {
        let all = self.exchange(rank, Payload::F32(data.to_vec()))?;
        data.fill(0.0);
        for p in all.iter() {
            let Payload::F32(v) = p else { return Err(Error::Internal("all_reduce: a rank contributed no vector".into())) };
            if v.len() != data.len() {
                return Err(Error::Internal(format!("all_reduce: lengths differ across ranks ({} vs {})", v.len(), data.len())));
            }
            for (d, x) in data.iter_mut().zip(v) {
                *d += x;
            }
        }
        Ok(())
    }

    /// Row-major `[rows, cols_r]` pieces from every rank joined column-wise into `[rows, sum cols_r]`.
    pub fn all_gather_columns(&self, rank: usize, piece: Vec<f32>, rows: usize) -> Result<Vec<f32>> {
        let all = self.exchange(rank, Payload::F32(piece))?;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let mut pieces = Vec::with_capacity(all.len());
        for p in all.iter() {
            let Payload::F32(v) = p else { return Err(Error::Internal("all_gather: a rank contributed no piece".into())) };
            if !v.len().is_multiple_of(rows) {
                return Err(Error::Internal(format!("all_gather: a piece of {} values is not {rows} rows", v.len())));
            }
            pieces.push((v, v.len() / rows));
        }
        let width: usize = pieces.iter().map(|(_, c)| c).sum();
        let mut out = Vec::with_capacity(rows * width);
        for r in 0..rows {
            for (v, c) in &pieces {
                out.extend_from_slice(&v[r * c..(r + 1) * c]);
            }
        }
        Ok(out)
    }

    /// Rank 0's sampled tokens, on every rank.
    pub fn broadcast_sampled(&self, rank: usize, sampled: Option<Vec<Sampled>>) -> Result<Vec<Sampled>> {
        let all = self.exchange(rank, sampled.map_or(Payload::Nothing, Payload::Sampled))?;
        match &all[0] {
            Payload::Sampled(v) => Ok(v.clone()),
            _ => Err(Error::Internal("broadcast: rank 0 sent no tokens".into())),
        }
    }

    /// The current command's failure, if a rank has failed it (for ranks that wait on a device, not in an exchange).
    pub fn failure_now(&self) -> Option<Error> {
        Self::failure(&self.lock())
    }

    /// Fail the current command on every rank with `message`; the first message wins.
    pub fn poison(&self, message: impl Into<String>) -> Error {
        let mut s = self.lock();
        self.poison_locked(&mut s, message.into())
    }

    fn poison_locked(&self, s: &mut State, message: String) -> Error {
        let message = s.poisoned.get_or_insert(message).clone();
        self.wake.notify_all();
        Error::Device(message)
    }

    /// A rank finished its command: any rank still waiting in an exchange has diverged and fails.
    pub fn depart(&self) {
        let mut s = self.lock();
        s.departed += 1;
        self.wake.notify_all();
    }

    /// Forget a finished command's failure and departures. Only when every rank is idle.
    pub fn reset(&self) {
        let mut s = self.lock();
        s.poisoned = None;
        s.departed = 0;
        s.arrived = 0;
        s.deposits.iter_mut().for_each(|d| *d = None);
        s.published = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_reduce_and_gather_agree_on_every_rank() {
        let c = Collective::new(3);
        let handles: Vec<_> = (0..3)
            .map(|r| {
                let c = Arc::clone(&c);
                std::thread::spawn(move || {
                    let mut v = vec![r as f32, 1.0];
                    c.all_reduce_sum(r, &mut v).unwrap();
                    let g = c.all_gather_columns(r, vec![r as f32; 2], 2).unwrap();
                    (v, g)
                })
            })
            .collect();
        for h in handles {
            let (v, g) = h.join().unwrap();
            assert_eq!(v, vec![3.0, 3.0]);
            assert_eq!(g, vec![0.0, 1.0, 2.0, 0.0, 1.0, 2.0]);
        }
    }

    #[test]
    fn poison_and_departure_wake_waiters() {
        let c = Collective::new(2);
        let c2 = Arc::clone(&c);
        let waiter = std::thread::spawn(move || c2.all_reduce_sum(0, &mut [1.0]));
        std::thread::sleep(std::time::Duration::from_millis(20));
        c.poison("rank 1 failed");
        assert!(waiter.join().unwrap().unwrap_err().to_string().contains("rank 1 failed"));
        c.reset();
        let c2 = Arc::clone(&c);
        let waiter = std::thread::spawn(move || c2.all_reduce_sum(0, &mut [1.0]));
        std::thread::sleep(std::time::Duration::from_millis(20));
        c.depart();
        assert!(waiter.join().unwrap().is_err());
        c.reset();
    }
}
