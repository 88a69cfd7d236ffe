//! Paged KV blocks with refcounts. A block is free (on the free list), leased (refcount > 0) or cached
//! (refcount 0 but holding published prefix content, owned by the context cache until evicted).

#[derive(Debug, Clone)]
pub struct KvBlockPool {
    block_size: usize,
    refcount: Vec<u32>,
    cached: Vec<bool>,
    free: Vec<u32>,
}

impl KvBlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            block_size,
            refcount: vec![0; num_blocks],
            cached: vec![false; num_blocks],
            free: (0..num_blocks as u32).rev().collect(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn total(&self) -> usize {
        self.refcount.len()
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn leased_count(&self) -> usize {
        self.refcount.iter().filter(|&&r| r > 0).count()
    }

    pub fn cached_unreferenced_count(&self) -> usize {
        self.refcount.iter().zip(&self.cached).filter(|(&r, &c)| r == 0 && c).count()
    }

    pub fn refcount(&self, block: u32) -> u32 {
        self.refcount[block as usize]
    }

    pub fn is_cached(&self, block: u32) -> bool {
        self.cached[block as usize]
    }

    /// Take a free block and lease it once.
    pub fn take_free(&mut self) -> Option<u32> {
        let b = self.free.pop()?;
        self.refcount[b as usize] = 1;
        Some(b)
    }

    pub fn incref(&mut self, block: u32) {
        self.refcount[block as usize] += 1;
    }

    /// Drop one lease; returns the remaining count. An unreferenced uncached block goes back to the free list.
    pub fn decref(&mut self, block: u32) -> u32 {
        let rc = &mut self.refcount[block as usize];
        assert!(*rc > 0, "KV block {block} released more often than leased");
        *rc -= 1;
        let left = *rc;
        if left == 0 && !self.cached[block as usize] {
            self.free.push(block);
        }
        left
    }

    pub fn mark_cached(&mut self, block: u32) {
        self.cached[block as usize] = true;
    }

    /// The cache gave up an unreferenced block: it becomes free.
    pub fn uncache_to_free(&mut self, block: u32) {
        let i = block as usize;
        assert!(self.cached[i] && self.refcount[i] == 0, "only unreferenced cached blocks can be evicted");
        self.cached[i] = false;
        self.free.push(block);
    }

    /// The cache dropped its record of a block that a sequence still leases: it becomes a private block.
    pub fn uncache_leased(&mut self, block: u32) {
        self.cached[block as usize] = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_and_release_round_trip() {
        let mut p = KvBlockPool::new(3, 16);
        let a = p.take_free().unwrap();
        p.incref(a);
        assert_eq!(p.leased_count(), 1);
        assert_eq!(p.decref(a), 1);
        assert_eq!(p.decref(a), 0);
        assert_eq!(p.free_count(), 3);
    }

    #[test]
    fn cached_blocks_do_not_return_to_free_list() {
        let mut p = KvBlockPool::new(2, 16);
        let a = p.take_free().unwrap();
        p.mark_cached(a);
        p.decref(a);
        assert_eq!(p.free_count(), 1);
        assert_eq!(p.cached_unreferenced_count(), 1);
        p.uncache_to_free(a);
        assert_eq!(p.free_count(), 2);
    }
}
