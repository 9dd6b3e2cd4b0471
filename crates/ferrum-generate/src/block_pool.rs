//! The one owner of KV memory: a pool of fixed-size blocks with reference counts, and the
//! prefix cache over them.
//!
//! A block is either referenced (by one or more sequences' block tables), free, or cached:
//! unreferenced but still holding the keys and values of a full block of tokens, findable by
//! the hash chained over (parent block's hash, this block's tokens). A new sequence takes the
//! longest run of cached blocks that matches its prompt and computes only the rest. Cached
//! blocks are reclaimed least-recently-released first when the free list runs dry.
//!
//! A model whose layers have different attention windows (Gemma 3) holds its KV in groups of
//! layers ([`ferrum_models::KvGroups`]), each with a block table per sequence, all drawing
//! from this one pool; a cached block is keyed by its group as well. A windowed group needs
//! only the blocks inside its window behind a prefix, so a prefix is reused when the full
//! groups hold all of it and each windowed group holds its last window.
//!
//! The pool holds only accounts; the memory itself is the model's [`ferrum_models::KvCache`],
//! indexed by the block ids handed out here.

use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};

use ferrum_models::NO_BLOCK;

/// Prefix-cache counters, since the pool was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Full prompt blocks looked up.
    pub queries: u64,
    /// Of which found in the cache.
    pub hits: u64,
    /// Prompt tokens not computed thanks to hits.
    pub tokens_saved: u64,
    /// Prompt tokens looked up (vLLM counts its prefix-cache queries in tokens).
    pub tokens_queried: u64,
    /// Cached blocks reclaimed for new data.
    pub evictions: u64,
}

/// A change to what the prefix cache can serve, for routers that index replicas' caches
/// (llm-d's KV-cache indexer reads vLLM's events of the same names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// A full block became findable: its chain hash, its parent's (`None` for a first
    /// block) and its tokens. A parent is always announced before its children.
    BlockStored {
        hash: u64,
        parent: Option<u64>,
        tokens: Vec<u32>,
    },
    /// No KV group can serve this hash any more (evicted).
    BlockRemoved { hash: u64 },
    /// Forget every block of this replica (sent when the events start: the cache is empty).
    AllBlocksCleared,
}

#[derive(Debug, Clone, Default)]
struct Block {
    refs: u32,
    /// Set while the block is findable in the prefix cache.
    key: Option<BlockKey>,
}

/// What a cached block holds: checked on every hit, so a hash collision is a miss, never
/// wrong keys and values.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BlockKey {
    group: usize,
    hash: u64,
    parent: u64,
    /// Where its chain starts (0, or a LoRA adapter's salt): a block whose parent is its
    /// root is a chain's first.
    root: u64,
    tokens: Vec<u32>,
}

pub struct BlockPool {
    block_size: usize,
    blocks: Vec<Block>,
    /// Unreferenced blocks holding nothing worth keeping.
    free: Vec<u32>,
    /// Unreferenced cached blocks, oldest release first.
    evictable: BTreeSet<(u64, u32)>,
    /// Release tick of each evictable block (its key in `evictable`).
    released_at: Vec<u64>,
    /// Times each block was handed out by [`BlockPool::allocate`].
    allocations: Vec<u64>,
    cached: HashMap<(usize, u64), u32>,
    tick: u64,
    prefix_caching: bool,
    stats: PrefixStats,
    /// Events since the last [`BlockPool::take_events`], when they are on.
    events: Option<Vec<KvEvent>>,
    /// For each cached hash, how many KV groups hold it (an event fires on 0 ↔ 1).
    held: HashMap<u64, u32>,
}

/// The hash of the block after `parent` holding `tokens`. The first block's parent is 0.
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    // SipHash with fixed keys: the same on every run, so the chain is reproducible.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl BlockPool {
    pub fn new(n_blocks: usize, block_size: usize, prefix_caching: bool) -> BlockPool {
        BlockPool {
            block_size,
            blocks: vec![Block::default(); n_blocks],
            // Popped from the end: hand out low ids first.
            free: (0..n_blocks as u32).rev().collect(),
            evictable: BTreeSet::new(),
            released_at: vec![0; n_blocks],
            allocations: vec![0; n_blocks],
            cached: HashMap::new(),
            tick: 0,
            prefix_caching,
            stats: PrefixStats::default(),
            events: None,
            held: HashMap::new(),
        }
    }

    /// Starts recording [`KvEvent`]s (first an `AllBlocksCleared`).
    pub fn enable_events(&mut self) {
        let mut ev = vec![KvEvent::AllBlocksCleared];
        // Whatever is cached already, announced in registration order is not known: by
        // chain position, parents first.
        let mut keys: Vec<&BlockKey> = self.blocks.iter().filter_map(|b| b.key.as_ref()).collect();
        keys.sort_by_key(|k| (k.parent != k.root, k.hash));
        let mut seen = std::collections::HashSet::new();
        for k in keys {
            if seen.insert(k.hash) {
                ev.push(KvEvent::BlockStored {
                    hash: k.hash,
                    parent: (k.parent != k.root).then_some(k.parent),
                    tokens: k.tokens.clone(),
                });
            }
        }
        self.events = Some(ev);
    }

    /// The events since the last call (none when they are off).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Distinct block hashes the prefix cache can serve now.
    pub fn cached_hashes(&self) -> usize {
        self.held.len()
    }

    fn held_up(&mut self, key: &BlockKey) {
        let n = self.held.entry(key.hash).or_insert(0);
        *n += 1;
        if *n == 1 {
            if let Some(ev) = self.events.as_mut() {
                ev.push(KvEvent::BlockStored {
                    hash: key.hash,
                    parent: (key.parent != key.root).then_some(key.parent),
                    tokens: key.tokens.clone(),
                });
            }
        }
    }

    fn held_down(&mut self, hash: u64) {
        if let Some(n) = self.held.get_mut(&hash) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&hash);
                if let Some(ev) = self.events.as_mut() {
                    ev.push(KvEvent::BlockRemoved { hash });
                }
            }
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn n_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be handed out now (free, or cached and unreferenced).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks referenced by some sequence.
    pub fn in_use(&self) -> usize {
        self.n_blocks() - self.available()
    }

    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// A block for one owner; `None` when every block is referenced.
    pub fn allocate(&mut self) -> Option<u32> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let &(t, id) = self.evictable.iter().next()?;
                self.evictable.remove(&(t, id));
                if let Some(key) = self.blocks[id as usize].key.take() {
                    self.cached.remove(&(key.group, key.hash));
                    self.held_down(key.hash);
                }
                self.stats.evictions += 1;
                id
            }
        };
        let b = &mut self.blocks[id as usize];
        debug_assert_eq!(b.refs, 0);
        b.refs = 1;
        self.allocations[id as usize] += 1;
        Some(id)
    }

    /// How many times block `id` has been handed out: what it holds is the same while this
    /// stays the same (a prefix-cache hit takes a block without handing it out anew).
    pub fn allocations(&self, id: u32) -> u64 {
        self.allocations.get(id as usize).copied().unwrap_or(0)
    }

    /// Drops one reference; an unreferenced block stays findable if it is cached.
    pub fn release(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        assert!(b.refs > 0, "block {id} released more often than taken");
        b.refs -= 1;
        if b.refs == 0 {
            if b.key.is_some() {
                self.tick += 1;
                self.released_at[id as usize] = self.tick;
                self.evictable.insert((self.tick, id));
            } else {
                self.free.push(id);
            }
        }
    }

    /// Makes a full block findable: `tokens` are its contents, `parent` the hash of the block
    /// before it (0 for the first). Returns this block's hash, the parent of the next.
    pub fn register(&mut self, id: u32, parent: u64, tokens: &[u32]) -> u64 {
        self.register_in(0, id, parent, 0, tokens)
    }

    /// [`register`](Self::register) for a block of KV group `group`, in a chain that starts
    /// from `root` (0; a LoRA adapter's salt for its sequences: the first block's `parent`).
    /// The hash chain is the tokens', the same for every group.
    pub fn register_in(
        &mut self,
        group: usize,
        id: u32,
        parent: u64,
        root: u64,
        tokens: &[u32],
    ) -> u64 {
        let hash = chain_hash(parent, tokens);
        if !self.prefix_caching || self.blocks[id as usize].key.is_some() {
            return hash;
        }
        // A second copy of the same contents stays private; the first one is found.
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry((group, hash)) {
            e.insert(id);
            let key = BlockKey {
                group,
                hash,
                parent,
                root,
                tokens: tokens.to_vec(),
            };
            self.held_up(&key);
            self.blocks[id as usize].key = Some(key);
        }
        hash
    }

    /// Takes a reference on each cached block that continues `tokens`' chain, at most
    /// `max_blocks` of them. Returns the blocks and the chain hashes of each.
    pub fn lookup(&mut self, tokens: &[u32], max_blocks: usize) -> (Vec<u32>, Vec<u64>) {
        let (mut tables, hashes) = self.lookup_groups(0, tokens, max_blocks, &[None]);
        (tables.pop().unwrap_or_default(), hashes)
    }

    /// The longest cached prefix of `tokens` (at most `max_blocks` blocks) that every KV
    /// group can serve: groups without a window (`windows[g] == None`) hold all of its
    /// blocks, windowed ones the blocks their window reaches back to from its end. Takes a
    /// reference on each; returns each group's table (windowed groups' earlier entries
    /// [`NO_BLOCK`]) and the chain hashes of the prefix's blocks. `root` is where the chain
    /// starts: 0 for the base model, a LoRA adapter's salt for its sequences.
    pub fn lookup_groups(
        &mut self,
        root: u64,
        tokens: &[u32],
        max_blocks: usize,
        windows: &[Option<usize>],
    ) -> (Vec<Vec<u32>>, Vec<u64>) {
        let mut tables = vec![Vec::new(); windows.len()];
        if !self.prefix_caching || windows.is_empty() {
            return (tables, Vec::new());
        }
        let bs = self.block_size;
        self.stats.tokens_queried += tokens.len() as u64;
        let mut hashes = Vec::new();
        let mut parent = root;
        for chunk in tokens.chunks_exact(bs).take(max_blocks) {
            parent = chain_hash(parent, chunk);
            hashes.push(parent);
        }
        let found = |pool: &Self, g: usize, k: usize| -> Option<u32> {
            let &id = pool.cached.get(&(g, hashes[k]))?;
            let parent = if k == 0 { root } else { hashes[k - 1] };
            match &pool.blocks[id as usize].key {
                Some(key) if key.parent == parent && key.tokens == tokens[k * bs..(k + 1) * bs] => {
                    Some(id)
                }
                _ => None,
            }
        };
        // The full groups bound the prefix; then it shrinks until every window is there.
        let mut len = hashes.len();
        let full: Vec<usize> = (0..windows.len())
            .filter(|&g| windows[g].is_none())
            .collect();
        if !full.is_empty() {
            len = (0..hashes.len())
                .find(|&k| full.iter().any(|&g| found(self, g, k).is_none()))
                .unwrap_or(hashes.len());
        }
        // Queries past the first miss were not made.
        self.stats.queries += (len + 1).min(hashes.len()) as u64;
        while len > 0 {
            let served = windows.iter().enumerate().all(|(g, w)| {
                let first = ferrum_models::KvGroups::first_needed(*w, len * bs, bs);
                (first..len).all(|k| found(self, g, k).is_some())
            });
            if served {
                break;
            }
            len -= 1;
        }
        for (g, w) in windows.iter().enumerate() {
            let first = ferrum_models::KvGroups::first_needed(*w, len * bs, bs);
            for k in 0..len {
                if k < first {
                    tables[g].push(NO_BLOCK);
                    continue;
                }
                let Some(id) = found(self, g, k) else {
                    // Checked just above; a table cut short is only a shorter prefix.
                    break;
                };
                let b = &mut self.blocks[id as usize];
                if b.refs == 0 {
                    self.evictable.remove(&(self.released_at[id as usize], id));
                }
                b.refs += 1;
                tables[g].push(id);
            }
        }
        self.stats.hits += len as u64;
        self.stats.tokens_saved += (len * bs) as u64;
        hashes.truncate(len);
        (tables, hashes)
    }

    /// Takes back `blocks` hits of the last lookup whose blocks the caller handed back
    /// unused (a hybrid model resumes only where a state snapshot is kept).
    pub fn unhit(&mut self, blocks: usize) {
        let n = (blocks as u64).min(self.stats.hits);
        self.stats.hits -= n;
        self.stats.tokens_saved = self
            .stats
            .tokens_saved
            .saturating_sub(n * self.block_size as u64);
    }

    /// Whether some KV group's cache can still serve the block of chain hash `hash`.
    pub fn holds(&self, hash: u64) -> bool {
        self.held.contains_key(&hash)
    }

    /// Every block back unreferenced (a test's leak check).
    pub fn all_released(&self) -> bool {
        self.blocks.iter().all(|b| b.refs == 0) && self.available() == self.n_blocks()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_release_and_exhaustion() {
        let mut p = BlockPool::new(3, 4, true);
        let a: Vec<u32> = (0..3).map(|_| p.allocate().unwrap()).collect();
        assert_eq!(a, [0, 1, 2]);
        assert_eq!(p.allocate(), None);
        p.release(1);
        assert_eq!(p.available(), 1);
        assert_eq!(p.allocate(), Some(1));
        for id in a {
            p.release(id);
        }
        assert!(p.all_released());
    }

    #[test]
    fn cached_prefix_is_found_shared_and_evicted_lru() {
        let mut p = BlockPool::new(4, 2, true);
        let toks = [1, 2, 3, 4, 5];
        let (b0, b1) = (p.allocate().unwrap(), p.allocate().unwrap());
        let h0 = p.register(b0, 0, &toks[..2]);
        p.register(b1, h0, &toks[2..4]);
        // Still referenced by the writer: a second sequence shares them.
        let (found, _) = p.lookup(&toks, 2);
        assert_eq!(found, [b0, b1]);
        // A different second block: only the first matches.
        let (found2, _) = p.lookup(&[1, 2, 9, 9], 2);
        assert_eq!(found2, [b0]);
        for id in [b0, b1, b0, b1, b0] {
            p.release(id);
        }
        assert!(p.all_released());
        let s = p.stats();
        assert_eq!((s.queries, s.hits, s.tokens_saved), (4, 3, 6));
        // Two free blocks go first, then the cached ones, oldest release (b1) first.
        let got: Vec<u32> = (0..3).map(|_| p.allocate().unwrap()).collect();
        assert_eq!(&got[2..], &[b1]);
        assert_eq!(p.stats().evictions, 1);
        let (found, _) = p.lookup(&toks, 2);
        assert_eq!(found, [b0], "b0 is still cached, b1's contents are gone");
    }

    #[test]
    fn disabled_cache_finds_nothing() {
        let mut p = BlockPool::new(2, 2, false);
        let b = p.allocate().unwrap();
        p.register(b, 0, &[1, 2]);
        p.release(b);
        assert_eq!(p.lookup(&[1, 2, 3], 1).0, Vec::<u32>::new());
        assert!(p.all_released());
    }

    /// Events: cleared first, a chain stored parent first, a hash held by two groups removed
    /// only when both have lost it, an eviction removed.
    /// A LoRA adapter's chain starts from its salt: found only from that root, and its first
    /// block announced without a parent, as a base model's is.
    #[test]
    fn an_adapter_chain_is_its_own() {
        let mut p = BlockPool::new(4, 2, true);
        p.enable_events();
        p.take_events();
        let salt = 0xfeed;
        let (a, b) = (p.allocate().unwrap(), p.allocate().unwrap());
        let h0 = p.register_in(0, a, salt, salt, &[1, 2]);
        let h1 = p.register_in(0, b, h0, salt, &[3, 4]);
        assert_ne!(h0, chain_hash(0, &[1, 2]));
        let parents: Vec<Option<u64>> = p
            .take_events()
            .into_iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored { parent, .. } => Some(parent),
                _ => None,
            })
            .collect();
        assert_eq!(parents, vec![None, Some(h0)]);
        p.release(a);
        p.release(b);
        let tokens = [1, 2, 3, 4, 5];
        let (t, hashes) = p.lookup_groups(0, &tokens, 2, &[None]);
        assert!(
            t[0].is_empty() && hashes.is_empty(),
            "the base model found an adapter's blocks"
        );
        let (t, hashes) = p.lookup_groups(salt, &tokens, 2, &[None]);
        assert_eq!((t[0].clone(), hashes), (vec![a, b], vec![h0, h1]));
    }

    #[test]
    fn events_follow_what_the_cache_can_serve() {
        let mut p = BlockPool::new(3, 2, true);
        p.enable_events();
        assert_eq!(p.take_events(), vec![KvEvent::AllBlocksCleared]);
        let (a, b, c) = (
            p.allocate().unwrap(),
            p.allocate().unwrap(),
            p.allocate().unwrap(),
        );
        let h0 = p.register(a, 0, &[1, 2]);
        let h1 = p.register(b, h0, &[3, 4]);
        // Group 1 holds the first block too: no second announcement.
        p.register_in(1, c, 0, 0, &[1, 2]);
        assert_eq!(
            p.take_events(),
            vec![
                KvEvent::BlockStored {
                    hash: h0,
                    parent: None,
                    tokens: vec![1, 2]
                },
                KvEvent::BlockStored {
                    hash: h1,
                    parent: Some(h0),
                    tokens: vec![3, 4]
                },
            ]
        );
        assert_eq!(p.cached_hashes(), 2);
        for id in [a, b, c] {
            p.release(id);
        }
        // Evicted oldest first: a (group 0's h0) then b (h1) then c (group 1's h0).
        p.allocate().unwrap();
        assert_eq!(p.take_events(), vec![], "group 1 still serves h0");
        p.allocate().unwrap();
        p.allocate().unwrap();
        assert_eq!(
            p.take_events(),
            vec![
                KvEvent::BlockRemoved { hash: h1 },
                KvEvent::BlockRemoved { hash: h0 }
            ]
        );
        assert_eq!(p.cached_hashes(), 0);
    }
}
