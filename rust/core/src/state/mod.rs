//! Resident state: slots, paged KV blocks, the context cache, and generate-budget reservation.

pub mod budget;
pub mod context_cache;
pub mod kv_pool;
pub mod slot_pool;

/// Counts that the invariants are stated over; cheap to take after every operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolCounts {
    pub slot_capacity: usize,
    pub free_slots: usize,
    pub live_slots: usize,
    pub total_blocks: usize,
    pub free_blocks: usize,
    pub leased_blocks: usize,
    pub cached_blocks: usize,
    pub pinned_blocks: usize,
}
