//! Generate-budget reservation: a request is seated only when its whole prompt + max new tokens fit, so a
//! running sequence can never run out of KV blocks. Blocks for the whole budget are leased up front; cached
//! prefix blocks are leased as hits and set where prefill starts.

use super::context_cache::{block_hash, ContextCache, ContextCacheConfig};
use super::kv_pool::KvBlockPool;
use super::PoolCounts;

/// Blocks leased for one sequence: its full block table and where prefill starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    pub blocks: Vec<u32>,
    pub cached_tokens: usize,
    /// Chained hashes of the leading full blocks known so far (hits, then published blocks).
    pub hashes: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Reservation {
    Granted(Lease),
    NoCapacity(String),
    Rejected(String),
}

#[derive(Debug, Clone)]
pub struct BlockBudget {
    pub pool: KvBlockPool,
    pub cache: ContextCache,
}

impl BlockBudget {
    pub fn new(num_blocks: usize, block_size: usize, cache: ContextCacheConfig) -> Self {
        Self { pool: KvBlockPool::new(num_blocks, block_size), cache: ContextCache::new(cache) }
    }

    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    pub fn capacity_tokens(&self) -> usize {
        self.pool.total() * self.pool.block_size()
    }

    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size())
    }

    /// Cached blocks matching the prompt's leading full blocks. At least one prompt token is always left to
    /// compute, because the first generated token needs the last prompt position's logits.
    pub fn find_prefix(&self, prompt: &[u32], extra: u64) -> Vec<(u32, u64)> {
        let bs = self.block_size();
        let mut hits = Vec::new();
        let mut parent = 0u64;
        for chunk in prompt[..prompt.len().saturating_sub(1)].chunks_exact(bs) {
            let h = block_hash(parent, chunk, extra);
            match self.cache.find(h, parent, chunk) {
                Some(block) => hits.push((block, h)),
                None => break,
            }
            parent = h;
        }
        hits
    }

    /// Why a request can never be seated (more blocks than the cache holds beside its pinned blocks), if so.
    /// `reuse_cached`: whether the request may start from cached blocks of its prompt (a request that needs every
    /// prompt position's logits computes them all).
    pub fn never_fits(&self, prompt: &[u32], max_new_tokens: usize, extra: u64, reuse_cached: bool) -> Option<String> {
        let needed = self.blocks_for(prompt.len().saturating_add(max_new_tokens));
        self.rejection(prompt, max_new_tokens, needed, &self.usable_prefix(prompt, extra, reuse_cached))
    }

    /// The cached blocks a request may start from: [`find_prefix`](Self::find_prefix)'s, or none.
    fn usable_prefix(&self, prompt: &[u32], extra: u64, reuse_cached: bool) -> Vec<(u32, u64)> {
        if reuse_cached {
            self.find_prefix(prompt, extra)
        } else {
            Vec::new()
        }
    }

    fn rejection(&self, prompt: &[u32], max_new_tokens: usize, needed: usize, hits: &[(u32, u64)]) -> Option<String> {
        let what = format!(
            "prompt ({} tokens) + max_tokens ({max_new_tokens}) needs {needed} KV blocks of {} tokens",
            prompt.len(),
            self.block_size()
        );
        let advice = "lower max_tokens, shorten the prompt or raise kv_cache_tokens";
        if needed > self.pool.total() {
            return Some(format!(
                "{what}, but the KV cache holds only {} blocks ({} tokens); {advice}",
                self.pool.total(),
                self.capacity_tokens()
            ));
        }
        // Pinned blocks are never freed, so a request that cannot fit beside them never will (its own pinned
        // prefix hits apart, which it shares).
        let pinned = self.cache.pinned_count();
        let pinned_hits = hits.iter().filter(|(b, _)| self.cache.is_pinned(*b)).count();
        (needed - pinned_hits > self.pool.total() - pinned).then(|| {
            format!(
                "{what}, but {pinned} of the KV cache's {} blocks are pinned by saved system prompts, leaving {}; {advice}",
                self.pool.total(),
                self.pool.total() - pinned + pinned_hits
            )
        })
    }

    /// Reserve the whole generate budget, or change nothing; `reuse_cached` as in [`never_fits`](Self::never_fits).
    pub fn reserve(&mut self, prompt: &[u32], max_new_tokens: usize, extra: u64, reuse_cached: bool) -> Reservation {
        let needed = self.blocks_for(prompt.len().saturating_add(max_new_tokens));
        let hits = self.usable_prefix(prompt, extra, reuse_cached);
        if let Some(why) = self.rejection(prompt, max_new_tokens, needed, &hits) {
            return Reservation::Rejected(why);
        }
        let hits_evictable = hits.iter().filter(|(b, _)| self.cache.is_evictable(*b)).count();
        let available = self.pool.free_count() + self.cache.evictable_count() - hits_evictable;
        let fresh = needed - hits.len();
        if fresh > available {
            return Reservation::NoCapacity(format!(
                "needs {fresh} free KV blocks, {available} available now; retry when running requests finish"
            ));
        }
        let mut blocks: Vec<u32> = Vec::with_capacity(needed);
        for &(b, _) in &hits {
            self.cache.lease_hit(&mut self.pool, b);
            blocks.push(b);
        }
        for _ in 0..fresh {
            blocks.push(self.take_block().expect("availability was checked above"));
        }
        let cached_tokens = hits.len() * self.block_size();
        Reservation::Granted(Lease { blocks, cached_tokens, hashes: hits.into_iter().map(|(_, h)| h).collect() })
    }

    fn take_block(&mut self) -> Option<u32> {
        if let Some(b) = self.pool.take_free() {
            return Some(b);
        }
        self.cache.evict_lru(&mut self.pool);
        self.pool.take_free()
    }

    /// Drop a sequence's leases; cached blocks it released become evictable.
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks {
            if self.pool.decref(b) == 0 && self.pool.is_cached(b) {
                self.cache.on_unreferenced(b);
            }
        }
    }

    /// Publish every full block of the sequence `prompt ++ output` whose KV is computed (`computed` tokens)
    /// and not yet hashed. Returns whether any block was newly published. The sequence comes in two parts so
    /// that a decode step need not copy its whole token list; with no new full block this is O(1).
    pub fn publish_computed(
        &mut self,
        prompt: &[u32],
        output: &[u32],
        lease: &mut Lease,
        computed: usize,
        extra: u64,
        pinned: bool,
    ) -> bool {
        let bs = self.block_size();
        let mut published = false;
        let mut straddling = Vec::new();
        while (lease.hashes.len() + 1) * bs <= computed.min(prompt.len() + output.len()) {
            let i = lease.hashes.len();
            let parent = if i == 0 { 0 } else { lease.hashes[i - 1] };
            let chunk = tokens_in(prompt, output, i * bs..(i + 1) * bs, &mut straddling);
            let h = block_hash(parent, chunk, extra);
            published |= self.cache.publish(&mut self.pool, lease.blocks[i], h, parent, chunk, pinned);
            if pinned {
                self.cache.pin_existing(h);
            }
            lease.hashes.push(h);
        }
        published
    }

    /// Tokens of the lease's leading full blocks that are pinned in the context cache now.
    pub fn pinned_prefix_tokens(&self, lease: &Lease) -> usize {
        lease.hashes.iter().take_while(|h| self.cache.is_pinned_hash(**h)).count() * self.block_size()
    }

    pub fn counts(&self) -> PoolCounts {
        PoolCounts {
            total_blocks: self.pool.total(),
            free_blocks: self.pool.free_count(),
            leased_blocks: self.pool.leased_count(),
            cached_blocks: self.pool.cached_unreferenced_count(),
            pinned_blocks: self.cache.pinned_count(),
            ..PoolCounts::default()
        }
    }
}

/// Tokens `range` of `prompt ++ output`: a slice of one part, or copied into `buf` when the range straddles
/// both (at most one block per sequence does).
fn tokens_in<'a>(prompt: &'a [u32], output: &'a [u32], range: std::ops::Range<usize>, buf: &'a mut Vec<u32>) -> &'a [u32] {
    let p = prompt.len();
    if range.end <= p {
        &prompt[range]
    } else if range.start >= p {
        &output[range.start - p..range.end - p]
    } else {
        buf.clear();
        buf.extend_from_slice(&prompt[range.start..]);
        buf.extend_from_slice(&output[..range.end - p]);
        buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(blocks: usize) -> BlockBudget {
        BlockBudget::new(blocks, 4, ContextCacheConfig::default())
    }

    fn granted(r: Reservation) -> Lease {
        match r {
            Reservation::Granted(l) => l,
            other => panic!("expected a grant, got {other:?}"),
        }
    }

    #[test]
    fn never_fitting_request_is_rejected_and_transient_shortage_changes_nothing() {
        let mut b = budget(4);
        assert!(matches!(b.reserve(&[1; 10], 10, 0, true), Reservation::Rejected(_)));
        let _held = granted(b.reserve(&[1; 8], 4, 0, true));
        let before = b.counts();
        assert!(matches!(b.reserve(&[2; 8], 4, 0, true), Reservation::NoCapacity(_)));
        assert_eq!(b.counts(), before);
    }

    #[test]
    fn a_max_tokens_near_the_integer_limit_is_rejected_not_wrapped() {
        let mut b = budget(4);
        assert!(matches!(b.reserve(&[1; 5], usize::MAX, 0, true), Reservation::Rejected(_)));
        assert!(matches!(b.reserve(&[1; 20], usize::MAX - 16, 0, true), Reservation::Rejected(_)));
        assert_eq!(b.counts().free_blocks, 4);
    }

    #[test]
    fn pinned_blocks_count_against_what_can_ever_fit() {
        let mut b = budget(6);
        let system: Vec<u32> = (0..16).collect();
        let mut lease = granted(b.reserve(&system, 0, 0, true));
        b.publish_computed(&system, &[], &mut lease, 16, 0, true);
        b.release(&lease.blocks);
        assert_eq!(b.counts().pinned_blocks, 4);
        assert_eq!(b.pinned_prefix_tokens(&lease), 16);
        // Three blocks never fit beside four pinned ones of six: rejected, not asked to retry.
        let why = b.never_fits(&[9; 9], 3, 0, true).expect("cannot fit beside the pinned blocks");
        assert!(why.contains("4 of the KV cache's 6 blocks are pinned"), "{why}");
        assert!(matches!(b.reserve(&[9; 9], 3, 0, true), Reservation::Rejected(_)));
        // Extending the pinned prompt shares its four blocks: six in all fit.
        let extended: Vec<u32> = (0..20).collect();
        assert!(b.never_fits(&extended, 4, 0, true).is_none());
        let grant = granted(b.reserve(&extended, 4, 0, true));
        assert_eq!(grant.cached_tokens, 16);
    }

    #[test]
    fn published_prefix_is_hit_by_the_next_request() {
        let mut b = budget(8);
        let prompt: Vec<u32> = (0..9).collect();
        let mut first = granted(b.reserve(&prompt, 2, 0, true));
        assert_eq!(first.cached_tokens, 0);
        assert!(b.publish_computed(&prompt, &[], &mut first, 9, 0, false));
        b.release(&first.blocks);
        assert_eq!(b.counts().cached_blocks, 2);
        let second = granted(b.reserve(&prompt, 2, 0, true));
        assert_eq!(second.cached_tokens, 8);
        assert_eq!(&second.blocks[..2], &first.blocks[..2]);
        let salted = granted(b.reserve(&prompt, 2, 7, true));
        assert_eq!(salted.cached_tokens, 0);
    }

    #[test]
    fn a_sequence_split_anywhere_publishes_the_same_blocks() {
        let tokens: Vec<u32> = (0..14).collect();
        let whole = {
            let mut b = budget(8);
            let mut lease = granted(b.reserve(&tokens, 2, 0, true));
            b.publish_computed(&tokens, &[], &mut lease, 14, 0, false);
            lease.hashes
        };
        assert_eq!(whole.len(), 3);
        for split in 0..=tokens.len() {
            let mut b = budget(8);
            let mut lease = granted(b.reserve(&tokens, 2, 0, true));
            b.publish_computed(&tokens[..split], &tokens[split..], &mut lease, 14, 0, false);
            assert_eq!(lease.hashes, whole, "split at {split}");
        }
    }

    #[test]
    fn whole_prompt_hit_still_leaves_one_token_to_compute() {
        let mut b = budget(8);
        let prompt: Vec<u32> = (0..8).collect();
        let mut first = granted(b.reserve(&prompt, 1, 0, true));
        b.publish_computed(&prompt, &[], &mut first, 8, 0, false);
        b.release(&first.blocks);
        let second = granted(b.reserve(&prompt, 1, 0, true));
        assert_eq!(second.cached_tokens, 4);
    }
}
