//! Content-addressed cache of full KV blocks. A block is addressed by a chained hash (parent hash + the
//! block's tokens + extra keys such as LoRA name and cache salt); a hit is confirmed by comparing tokens and
//! parent, so a hash collision can never serve wrong KV. Unreferenced records are evicted LRU-first, except
//! pinned records (system prompts saved by `gen_and_save_system_prompt_kv_cache`).

use std::collections::{BTreeMap, HashMap};

use super::kv_pool::KvBlockPool;

/// Whether admission looks up cached prefixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LookupPolicy {
    Use,
    Bypass,
}

/// Which computed blocks are published into the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitPolicy {
    PrefillOnly,
    IncludingGenerated,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ContextCacheConfig {
    pub enabled: bool,
    pub lookup: LookupPolicy,
    pub commit: CommitPolicy,
    /// Most cached block records kept; 0 means as many as the KV pool holds.
    pub max_records: usize,
}

impl Default for ContextCacheConfig {
    fn default() -> Self {
        Self { enabled: true, lookup: LookupPolicy::Use, commit: CommitPolicy::PrefillOnly, max_records: 0 }
    }
}

/// The chained hash of one full block. FNV-1a over 64-bit words: stable across runs and builds.
pub fn block_hash(parent: u64, tokens: &[u32], extra_key: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut mix = |w: u64| {
        for byte in w.to_le_bytes() {
            h ^= byte as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    mix(parent);
    mix(extra_key);
    mix(tokens.len() as u64);
    tokens.iter().for_each(|&t| mix(t as u64));
    h
}

/// Hash of the extra keys that separate otherwise-identical prefixes.
pub fn extra_key(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    let mut words: Vec<u32> = Vec::new();
    for part in [lora_name.unwrap_or(""), "\u{1}", cache_salt.unwrap_or("")] {
        words.extend(part.bytes().map(u32::from));
    }
    block_hash(0, &words, 0)
}

#[derive(Debug, Clone)]
struct Record {
    hash: u64,
    parent: u64,
    tokens: Vec<u32>,
    pinned: bool,
}

#[derive(Debug, Clone)]
pub struct ContextCache {
    config: ContextCacheConfig,
    by_hash: HashMap<u64, u32>,
    records: HashMap<u32, Record>,
    lru: BTreeMap<u64, u32>,
    lru_tick_of: HashMap<u32, u64>,
    tick: u64,
    /// Pinned records (never evicted or dropped), counted so that every admission can ask cheaply.
    pinned: usize,
}

impl ContextCache {
    pub fn new(config: ContextCacheConfig) -> Self {
        Self {
            config,
            by_hash: HashMap::new(),
            records: HashMap::new(),
            lru: BTreeMap::new(),
            lru_tick_of: HashMap::new(),
            tick: 0,
            pinned: 0,
        }
    }

    pub fn config(&self) -> &ContextCacheConfig {
        &self.config
    }

    pub fn record_count(&self) -> usize {
        self.records.len()
    }

    pub fn pinned_count(&self) -> usize {
        self.pinned
    }

    pub fn is_pinned(&self, block: u32) -> bool {
        self.records.get(&block).is_some_and(|r| r.pinned)
    }

    pub fn is_pinned_hash(&self, hash: u64) -> bool {
        self.by_hash.get(&hash).is_some_and(|b| self.is_pinned(*b))
    }

    pub fn evictable_count(&self) -> usize {
        self.lru.len()
    }

    pub fn is_evictable(&self, block: u32) -> bool {
        self.lru_tick_of.contains_key(&block)
    }

    /// The cached block holding exactly these tokens after this parent, if any. Read-only.
    pub fn find(&self, hash: u64, parent: u64, tokens: &[u32]) -> Option<u32> {
        if !self.config.enabled || self.config.lookup == LookupPolicy::Bypass {
            return None;
        }
        let block = *self.by_hash.get(&hash)?;
        let rec = &self.records[&block];
        (rec.parent == parent && rec.tokens == tokens).then_some(block)
    }

    /// Lease a hit block for a sequence.
    pub fn lease_hit(&mut self, pool: &mut KvBlockPool, block: u32) {
        if let Some(t) = self.lru_tick_of.remove(&block) {
            self.lru.remove(&t);
        }
        pool.incref(block);
    }

    /// Publish a computed full block; false when its content is already cached or no record can be made.
    pub fn publish(&mut self, pool: &mut KvBlockPool, block: u32, hash: u64, parent: u64, tokens: &[u32], pinned: bool) -> bool {
        if !self.config.enabled || self.by_hash.contains_key(&hash) || pool.is_cached(block) {
            return false;
        }
        let limit = if self.config.max_records == 0 { pool.total() } else { self.config.max_records };
        while self.records.len() >= limit {
            if !self.evict_lru(pool) {
                return false;
            }
        }
        self.by_hash.insert(hash, block);
        self.records.insert(block, Record { hash, parent, tokens: tokens.to_vec(), pinned });
        self.pinned += pinned as usize;
        pool.mark_cached(block);
        if pool.refcount(block) == 0 {
            self.on_unreferenced(block);
        }
        true
    }

    /// Pin an already cached record so it is never evicted; false when the hash is not cached.
    pub fn pin_existing(&mut self, hash: u64) -> bool {
        let Some(&block) = self.by_hash.get(&hash) else { return false };
        if let Some(t) = self.lru_tick_of.remove(&block) {
            self.lru.remove(&t);
        }
        let record = self.records.get_mut(&block).expect("hash map and records agree");
        self.pinned += !record.pinned as usize;
        record.pinned = true;
        true
    }

    /// A cached block lost its last lease: it becomes evictable unless pinned.
    pub fn on_unreferenced(&mut self, block: u32) {
        if self.records.get(&block).is_some_and(|r| !r.pinned) {
            self.tick += 1;
            self.lru.insert(self.tick, block);
            self.lru_tick_of.insert(block, self.tick);
        }
    }

    /// Evict the least recently released unreferenced record; false when none can be evicted.
    pub fn evict_lru(&mut self, pool: &mut KvBlockPool) -> bool {
        let Some((&tick, &block)) = self.lru.iter().next() else { return false };
        self.lru.remove(&tick);
        self.lru_tick_of.remove(&block);
        let rec = self.records.remove(&block).expect("LRU entries have records");
        self.by_hash.remove(&rec.hash);
        pool.uncache_to_free(block);
        true
    }

    /// Drop every unpinned record: unreferenced blocks become free, leased ones private.
    pub fn clear_unpinned(&mut self, pool: &mut KvBlockPool) {
        while self.evict_lru(pool) {}
        let leased: Vec<u32> = self.records.iter().filter(|(_, r)| !r.pinned).map(|(&b, _)| b).collect();
        for b in leased {
            let rec = self.records.remove(&b).expect("listed above");
            self.by_hash.remove(&rec.hash);
            pool.uncache_leased(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (KvBlockPool, ContextCache) {
        (KvBlockPool::new(4, 2), ContextCache::new(ContextCacheConfig::default()))
    }

    #[test]
    fn hit_requires_equal_tokens_and_parent() {
        let (mut pool, mut cache) = setup();
        let b = pool.take_free().unwrap();
        let h = block_hash(0, &[1, 2], 0);
        assert!(cache.publish(&mut pool, b, h, 0, &[1, 2], false));
        assert_eq!(cache.find(h, 0, &[1, 2]), Some(b));
        assert_eq!(cache.find(h, 0, &[1, 3]), None);
        assert_eq!(cache.find(h, 9, &[1, 2]), None);
    }

    #[test]
    fn unreferenced_records_evict_lru_first_but_pinned_stay() {
        let (mut pool, mut cache) = setup();
        let a = pool.take_free().unwrap();
        let b = pool.take_free().unwrap();
        cache.publish(&mut pool, a, 1, 0, &[1, 1], false);
        cache.publish(&mut pool, b, 2, 0, &[2, 2], true);
        pool.decref(a);
        cache.on_unreferenced(a);
        pool.decref(b);
        cache.on_unreferenced(b);
        assert_eq!(cache.evictable_count(), 1);
        assert!(cache.evict_lru(&mut pool));
        assert!(!cache.evict_lru(&mut pool));
        assert_eq!(cache.record_count(), 1);
        assert_eq!(pool.free_count(), 3);
    }

    #[test]
    fn salt_changes_the_hash() {
        assert_ne!(extra_key(None, Some("a")), extra_key(None, Some("b")));
        assert_ne!(extra_key(Some("x"), None), extra_key(None, Some("x")));
    }
}
