//! Resident slots with epochs: releasing a slot bumps its epoch so stale refs are refused.

use crate::error::{Error, Result};
use crate::ids::ResidentRef;

#[derive(Debug, Clone)]
pub struct SlotPool {
    epochs: Vec<u32>,
    live: Vec<bool>,
    /// Free slots, lowest slot on top so allocation order is predictable.
    free: Vec<u32>,
}

impl SlotPool {
    pub fn new(capacity: usize) -> Self {
        Self { epochs: vec![0; capacity], live: vec![false; capacity], free: (0..capacity as u32).rev().collect() }
    }

    pub fn capacity(&self) -> usize {
        self.epochs.len()
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn live_count(&self) -> usize {
        self.capacity() - self.free.len()
    }

    pub fn acquire(&mut self) -> Option<ResidentRef> {
        let slot = self.free.pop()?;
        self.live[slot as usize] = true;
        Some(ResidentRef { slot, epoch: self.epochs[slot as usize] })
    }

    pub fn release(&mut self, r: ResidentRef) -> Result<()> {
        self.validate(r)?;
        let i = r.slot as usize;
        self.live[i] = false;
        self.epochs[i] = self.epochs[i].wrapping_add(1);
        self.free.push(r.slot);
        Ok(())
    }

    pub fn is_live(&self, r: ResidentRef) -> bool {
        let i = r.slot as usize;
        i < self.epochs.len() && self.live[i] && self.epochs[i] == r.epoch
    }

    pub fn validate(&self, r: ResidentRef) -> Result<()> {
        let i = r.slot as usize;
        let why = if i >= self.epochs.len() {
            format!("slot does not exist (capacity {})", self.epochs.len())
        } else if self.epochs[i] != r.epoch {
            format!("the slot was released; its current epoch is {}", self.epochs[i])
        } else if !self.live[i] {
            "the slot is not live".to_string()
        } else {
            return Ok(());
        };
        Err(Error::StaleRef { slot: r.slot, epoch: r.epoch, why })
    }

    /// Live refs in slot order.
    pub fn live_refs(&self) -> Vec<ResidentRef> {
        (0..self.epochs.len())
            .filter(|&i| self.live[i])
            .map(|i| ResidentRef { slot: i as u32, epoch: self.epochs[i] })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_bumps_epoch_and_refuses_stale_refs() {
        let mut pool = SlotPool::new(2);
        let a = pool.acquire().unwrap();
        assert_eq!(a, ResidentRef { slot: 0, epoch: 0 });
        pool.release(a).unwrap();
        assert!(pool.release(a).is_err());
        let b = pool.acquire().unwrap();
        assert_eq!(b, ResidentRef { slot: 0, epoch: 1 });
        assert!(pool.validate(a).is_err());
        assert!(pool.validate(ResidentRef { slot: 7, epoch: 0 }).is_err());
    }

    #[test]
    fn capacity_is_respected() {
        let mut pool = SlotPool::new(1);
        assert!(pool.acquire().is_some());
        assert!(pool.acquire().is_none());
        assert_eq!(pool.free_count() + pool.live_count(), 1);
    }
}
