//! Recurrent-state slots of hybrid models (Qwen3.5's linear-attention layers): one live slot
//! per running sequence, and a bounded set of snapshot slots — a sequence's state at a block
//! boundary, keyed by that block's chain hash (the prefix cache's key) — from which a later
//! request sharing the prefix resumes. The model's [`ferrum_models::KvCache`] holds the
//! states; this module only decides which slot is whose.
//!
//! Snapshots are evicted least recently used first, and a snapshot whose block the prefix
//! cache no longer holds goes before any other (it can serve no one): their number never
//! exceeds the slots set aside, however many requests come and go.

use std::collections::HashMap;

/// Counters of the snapshot cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateStats {
    /// Snapshots taken.
    pub stored: u64,
    /// Requests that resumed from a snapshot.
    pub hits: u64,
    /// Prompt tokens those requests did not compute.
    pub tokens_saved: u64,
    /// Snapshots dropped to make room.
    pub evictions: u64,
    /// Snapshots held now.
    pub held: usize,
}

pub struct StatePool {
    live_free: Vec<usize>,
    snap_free: Vec<usize>,
    /// Chain hash → (slot, last use).
    snaps: HashMap<u64, (usize, u64)>,
    clock: u64,
    stats: StateStats,
}

impl StatePool {
    /// Slots `0..live` for running sequences, `live..live + snapshots` for snapshots.
    pub fn new(live: usize, snapshots: usize) -> StatePool {
        StatePool {
            live_free: (0..live).rev().collect(),
            snap_free: (live..live + snapshots).rev().collect(),
            snaps: HashMap::new(),
            clock: 0,
            stats: StateStats::default(),
        }
    }

    pub fn take_live(&mut self) -> Option<usize> {
        self.live_free.pop()
    }

    pub fn give_live(&mut self, slot: usize) {
        debug_assert!(!self.live_free.contains(&slot));
        self.live_free.push(slot);
    }

    /// The snapshot after the block of chain hash `hash`, if one is kept.
    pub fn find(&mut self, hash: u64) -> Option<usize> {
        self.clock += 1;
        let now = self.clock;
        self.snaps.get_mut(&hash).map(|(slot, used)| {
            *used = now;
            *slot
        })
    }

    /// Whether a snapshot after `hash` is kept (not counted as a use).
    pub fn has(&self, hash: u64) -> bool {
        self.snaps.contains_key(&hash)
    }

    /// A slot to store the snapshot after `hash` in, registered under it (`None` when
    /// there are no snapshot slots, or one is kept already). Makes room by dropping a
    /// snapshot `alive` says can serve no one, else the least recently used.
    pub fn store(&mut self, hash: u64, alive: impl Fn(u64) -> bool) -> Option<usize> {
        if self.snaps.contains_key(&hash) {
            return None;
        }
        if self.snap_free.is_empty() {
            let victim = self
                .snaps
                .iter()
                .min_by_key(|(h, (_, used))| (alive(**h), *used))
                .map(|(h, _)| *h)?;
            if let Some((slot, _)) = self.snaps.remove(&victim) {
                self.snap_free.push(slot);
                self.stats.evictions += 1;
            }
        }
        let slot = self.snap_free.pop()?;
        self.clock += 1;
        self.snaps.insert(hash, (slot, self.clock));
        self.stats.stored += 1;
        Some(slot)
    }

    pub fn record_hit(&mut self, tokens: usize) {
        self.stats.hits += 1;
        self.stats.tokens_saved += tokens as u64;
    }

    pub fn stats(&self) -> StateStats {
        StateStats {
            held: self.snaps.len(),
            ..self.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_stay_bounded_and_dead_ones_go_first() {
        let mut p = StatePool::new(2, 3);
        assert_eq!(
            (p.take_live(), p.take_live(), p.take_live()),
            (Some(0), Some(1), None)
        );
        p.give_live(1);
        assert_eq!(p.take_live(), Some(1));
        for h in 0..1000u64 {
            let s = p.store(h, |_| true).unwrap();
            assert!((2..5).contains(&s));
            assert!(p.stats().held <= 3);
        }
        assert_eq!(p.stats().evictions, 997);
        // 997..1000 are held; 998 is used, so 997 would go next — but 999 is dead.
        assert!(p.find(998).is_some());
        p.store(5000, |h| h != 999).unwrap();
        assert!(p.has(997) && p.has(998) && !p.has(999));
        assert!(p.store(5000, |_| true).is_none(), "stored twice");
    }
}
