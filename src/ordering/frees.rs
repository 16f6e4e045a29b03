//! The frees a stream has made in a pool and not yet handed back: the
//! same-stream hot path's state (Note [Stream-ordered frees] in
//! docs/DESIGN.md).

use crate::arena::ArenaId;
use crate::heap::BlockId;

/// A block freed on a stream, not yet known to be free for every stream.
#[derive(Clone, Copy)]
pub(crate) struct Pending {
    pub(crate) arena: ArenaId,
    pub(crate) block: BlockId,
    pub(crate) ptr: u64,
    pub(crate) size: u64,
    /// The stream's position at the free.
    pub(crate) seq: u64,
}

impl Pending {
    /// Whether it is a small-arena block: those a stream keeps pending for
    /// its same-size fast path, at a miss and when events complete alike.
    pub(crate) fn is_small(&self) -> bool {
        self.arena == ArenaId::Small
    }
}

/// How far back before the latest pending free the hot path looks for one
/// of the size asked for. Past that the allocation takes the pool's lock,
/// which merges the stream's pending frees into the heap (all but its
/// latest few small ones); so a stream that frees thousands of blocks
/// before allocating again pays for one merge, not for thousands of long
/// searches. Deep enough that every recorded trace replays to the
/// footprint of an unbounded search (docs/RESULTS.md).
const HOT_SEARCH: usize = 128;

/// The pending frees one stream has made in one pool.
#[derive(Default)]
pub(crate) struct PoolFrees {
    /// The latest free still pending, kept apart so that a free followed
    /// by an allocation of the same size (the hot path) touches no list.
    latest: Option<Pending>,
    /// The others, in the order they were made, so positions increase
    /// along it. Every stream-ordered allocation that misses the hot path
    /// empties it into the heap (but for a few small blocks), so it stays
    /// short: a list searched from
    /// the end beats a map by size, which would be built and torn down at
    /// every miss.
    older: Vec<Pending>,
    /// Position of the latest free.
    pub(crate) last_free: u64,
    pub(crate) bytes: u64,
    /// Bytes freed here that the pool's `used` still counts: the hot path
    /// does not take the pool's lock, so the pool settles them when it
    /// next counts an allocation (Note [Usage credit] in docs/DESIGN.md).
    pub(crate) credit: u64,
    /// The most `credit` has been since the pool last settled it: the most
    /// bytes this stream had freed, net of its hot-path reuses, at any one
    /// moment in between (Note [Starting afresh] in docs/DESIGN.md).
    pub(crate) credit_high: u64,
    /// Hot-path counts, summed into the pool's statistics.
    pub(crate) frees: u64,
    pub(crate) reuses: u64,
}

/// Who counts a pending free's bytes out of the pool's used bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counted {
    /// The pool, when it next settles the stream's credit: a free on the
    /// hot path, which takes no pool lock (Note [Usage credit]).
    Later,
    /// The pool's lock, already: a free it makes itself (a step layout's
    /// region given up), whose bytes were never the program's, so that
    /// the hot path must not spend them as the program's frees.
    Already,
}

impl PoolFrees {
    /// A free: its block pending at its position, its bytes the stream's
    /// credit unless the pool has counted them already.
    #[inline]
    pub(crate) fn push(&mut self, p: Pending, counted: Counted) {
        self.last_free = p.seq;
        self.bytes += p.size;
        if counted == Counted::Later {
            self.credit += p.size;
            self.credit_high = self.credit_high.max(self.credit);
        }
        self.frees += 1;
        if let Some(older) = self.latest.replace(p) {
            self.older.push(older);
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.latest.is_none() && self.older.is_empty()
    }

    /// The hot path's allocation: the most recent pending block of exactly
    /// `size` among the latest and the [`HOT_SEARCH`] before it, if the
    /// stream has freed at least `size` bytes since the pool last settled
    /// its credit. Otherwise the allocation takes the pool's lock, which
    /// keeps `used` and its high-water mark exact. None either once the
    /// stream has freed, at some moment since, the `held` bytes the pool
    /// counted the program to hold: it may have emptied the pool, and the
    /// lock marks a step there (Note [Steps at emptying] in docs/DESIGN.md).
    #[inline(always)]
    pub(crate) fn reuse(&mut self, size: u64, held: u64) -> Option<Pending> {
        if self.credit < size || self.credit_high >= held {
            return None;
        }
        let p = match self.latest.take_if(|l| l.size == size) {
            Some(p) => p,
            None => self.older_of_size(size, u64::MAX, HOT_SEARCH)?,
        };
        self.bytes -= p.size;
        self.credit -= p.size;
        self.reuses += 1;
        Some(p)
    }

    /// The most recent pending block of exactly `size` freed at or before
    /// position `upto`.
    pub(crate) fn take(&mut self, size: u64, upto: u64) -> Option<Pending> {
        let p = match &self.latest {
            Some(l) if l.size == size && l.seq <= upto => self.latest.take(),
            _ => self.older_of_size(size, upto, usize::MAX),
        }?;
        self.bytes -= p.size;
        Some(p)
    }

    /// Takes the most recent of the last `within` blocks of `older` that
    /// is of `size` and freed at or before `upto`.
    #[inline(never)]
    fn older_of_size(&mut self, size: u64, upto: u64, within: usize) -> Option<Pending> {
        let from = self.older.len().saturating_sub(within);
        let i = self.older[from..]
            .iter()
            .rposition(|p| p.size == size && p.seq <= upto)?;
        Some(self.older.remove(from + i))
    }

    /// The smallest size present, between `size` and 1/8 more, with a block
    /// freed at or before `upto`.
    pub(crate) fn near_size(&self, size: u64, upto: u64) -> Option<u64> {
        self.older
            .iter()
            .chain(&self.latest)
            .filter(|p| p.size >= size && p.size <= size + size / 8 && p.seq <= upto)
            .map(|p| p.size)
            .min()
    }

    /// Removes every block freed at or before `upto` but the latest `keep`
    /// pending blocks that satisfy `which`, and appends them to `out` in
    /// the order they were freed; those kept stay pending as they were.
    pub(crate) fn drain_upto(
        &mut self,
        upto: u64,
        keep: usize,
        which: impl Fn(&Pending) -> bool,
        out: &mut Vec<Pending>,
    ) {
        let latest_kept = keep > 0 && self.latest.as_ref().is_some_and(&which);
        let mut kept = usize::from(latest_kept);
        // Blocks from this index on that satisfy `which` stay.
        let mut keep_from = self.older.len();
        while keep_from > 0 && kept < keep {
            keep_from -= 1;
            kept += usize::from(which(&self.older[keep_from]));
        }
        let start = out.len();
        let mut i = 0;
        self.older.retain(|p| {
            let stays = p.seq > upto || (i >= keep_from && which(p));
            i += 1;
            if !stays {
                out.push(*p);
            }
            stays
        });
        // The latest free of all comes last.
        if !latest_kept && self.latest.as_ref().is_some_and(|l| l.seq <= upto) {
            out.extend(self.latest.take());
            self.latest = self.older.pop();
        }
        self.bytes -= out[start..].iter().map(|p| p.size).sum::<u64>();
    }

    /// Removes every pending block but the latest `keep` that satisfy
    /// `which`, and appends them to `out` in the order they were freed;
    /// those kept stay pending as they were. Returns whether any stayed.
    pub(crate) fn drain_all_but(
        &mut self,
        keep: usize,
        which: impl Fn(&Pending) -> bool,
        out: &mut Vec<Pending>,
    ) -> bool {
        self.drain_upto(u64::MAX, keep, which, out);
        !self.is_empty()
    }
}

/// A stream's pending frees, per pool: a short list searched in order, not
/// a hash map, because a stream is registered with one pool or a few and
/// the hot path looks its pool up on every call.
#[derive(Default)]
pub(crate) struct ByPool(Vec<(u64, PoolFrees)>);

impl ByPool {
    pub(crate) fn get(&self, pool: &u64) -> Option<&PoolFrees> {
        self.0.iter().find(|(p, _)| p == pool).map(|(_, f)| f)
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, pool: &u64) -> Option<&mut PoolFrees> {
        self.0.iter_mut().find(|(p, _)| p == pool).map(|(_, f)| f)
    }

    /// The entry of `pool`, made empty if there is none.
    pub(crate) fn entry(&mut self, pool: u64) -> &mut PoolFrees {
        match self.0.iter().position(|(p, _)| *p == pool) {
            Some(i) => &mut self.0[i].1,
            None => {
                self.0.push((pool, PoolFrees::default()));
                &mut self.0.last_mut().expect("just pushed").1
            }
        }
    }

    pub(crate) fn remove(&mut self, pool: &u64) -> Option<PoolFrees> {
        let i = self.0.iter().position(|(p, _)| p == pool)?;
        Some(self.0.swap_remove(i).1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::Heap;

    /// Pending blocks of the given (size, seq), in free order.
    fn frees(blocks: &[(u64, u64)]) -> PoolFrees {
        let mut heap = Heap::new();
        let mut f = PoolFrees::default();
        for (i, &(size, seq)) in blocks.iter().enumerate() {
            let block = heap.insert_free(i as u64 * 1024, 512);
            f.push(
                Pending {
                    arena: ArenaId::Small,
                    block,
                    ptr: i as u64 * 1024,
                    size,
                    seq,
                },
                Counted::Later,
            );
        }
        f
    }

    #[test]
    fn take_prefers_the_most_recent_of_a_size() {
        let mut f = frees(&[(256, 1), (512, 2), (256, 3), (512, 4)]);
        assert_eq!(f.bytes, 1536);
        assert_eq!(f.last_free, 4);
        assert_eq!(f.take(256, u64::MAX).map(|p| p.seq), Some(3));
        assert_eq!(f.take(256, u64::MAX).map(|p| p.seq), Some(1));
        assert!(f.take(256, u64::MAX).is_none());
        // Only blocks freed at or before `upto`.
        assert_eq!(f.take(512, 3).map(|p| p.seq), Some(2));
        assert!(f.take(512, 3).is_none());
        assert!(!f.is_empty());
        assert_eq!(f.take(512, 4).map(|p| p.seq), Some(4));
        assert!(f.is_empty());
        assert_eq!(f.bytes, 0);
    }

    #[test]
    fn the_hot_path_reuses_only_against_its_credit() {
        let mut f = frees(&[(256, 1), (512, 2)]);
        assert_eq!(f.credit, 768);
        assert_eq!(f.reuse(512, u64::MAX).map(|p| p.seq), Some(2));
        assert_eq!((f.credit, f.reuses), (256, 1));
        // Settled by the pool: the block is still pending, but the hot path
        // may not take it; the pool's slow path will.
        f.credit = 0;
        assert!(f.reuse(256, u64::MAX).is_none());
        assert_eq!(f.take(256, u64::MAX).map(|p| p.seq), Some(1));
    }

    #[test]
    fn the_credit_keeps_its_high_until_settled() {
        // Frees of 256 and 512, a reuse of 512, a free of 128: the stream
        // had freed 768 bytes net at most, though 384 now.
        let mut f = frees(&[(256, 1), (512, 2)]);
        let reused = f.reuse(512, u64::MAX).expect("pending");
        f.push(
            Pending {
                size: 128,
                seq: 3,
                ..reused
            },
            Counted::Later,
        );
        assert_eq!((f.credit, f.credit_high), (384, 768));
    }

    #[test]
    fn a_free_the_pool_counted_gives_no_credit() {
        let mut f = frees(&[(256, 1)]);
        let pending = f.take(256, u64::MAX).expect("pending");
        f.push(pending, Counted::Already);
        assert_eq!((f.credit, f.credit_high, f.bytes), (256, 256, 256));
        // The hot path spends the program's 256 bytes freed, once.
        assert!(f.reuse(256, u64::MAX).is_some());
        assert_eq!(f.credit, 0);
        f.push(pending, Counted::Already);
        assert!(f.reuse(256, u64::MAX).is_none());
        assert_eq!(f.take(256, u64::MAX).map(|p| p.seq), Some(pending.seq));
    }

    #[test]
    fn the_hot_path_looks_back_a_bounded_way() {
        let mut sizes: Vec<(u64, u64)> = vec![(256, 1)];
        let last = HOT_SEARCH as u64 + 2;
        sizes.extend((2..=last).map(|seq| (512, seq)));
        let mut f = frees(&sizes);
        // The 256-byte block is one further back than the hot path looks.
        assert!(f.reuse(256, u64::MAX).is_none());
        assert_eq!(f.reuse(512, u64::MAX).map(|p| p.seq), Some(last));
        assert!(f.reuse(256, u64::MAX).is_none());
        // One more taken off the end brings it within reach.
        assert_eq!(f.reuse(512, u64::MAX).map(|p| p.seq), Some(last - 1));
        assert_eq!(f.reuse(256, u64::MAX).map(|p| p.seq), Some(1));
    }

    #[test]
    fn drain_keeps_free_order_on_both_sides() {
        let mut f = frees(&[(256, 1), (512, 2), (256, 3), (1024, 4), (512, 5)]);
        // Taken from the middle: what is left stays in order.
        assert_eq!(f.take(256, u64::MAX).map(|p| p.seq), Some(3));
        let mut out = Vec::new();
        f.drain_upto(4, 0, |_| true, &mut out);
        assert_eq!(out.iter().map(|p| p.seq).collect::<Vec<_>>(), [1, 2, 4]);
        assert_eq!(f.bytes, 512);
        f.drain_upto(u64::MAX, 0, |_| true, &mut out);
        assert_eq!(out.iter().map(|p| p.seq).collect::<Vec<_>>(), [1, 2, 4, 5]);
        assert!(f.is_empty());
        assert_eq!(f.bytes, 0);
    }

    fn small(p: &Pending) -> bool {
        p.size < 1000
    }

    fn seqs(v: &[Pending]) -> Vec<u64> {
        v.iter().map(|p| p.seq).collect()
    }

    /// Small and large frees in turn, the latest large.
    fn small_and_large() -> PoolFrees {
        frees(&[
            (256, 1),
            (4096, 2),
            (512, 3),
            (4096, 4),
            (256, 5),
            (4096, 6),
        ])
    }

    #[test]
    fn drain_all_but_keeps_the_latest_that_qualify() {
        // The latest is large: the two latest small ones stay, the latest of
        // them becomes the list's latest, and the rest go out in free order.
        let mut f = small_and_large();
        let mut out = Vec::new();
        assert!(f.drain_all_but(2, small, &mut out));
        assert_eq!(seqs(&out), [1, 2, 4, 6]);
        assert_eq!(f.bytes, 512 + 256);
        assert_eq!(f.reuse(256, u64::MAX).map(|p| p.seq), Some(5));
        assert_eq!(f.take(512, u64::MAX).map(|p| p.seq), Some(3));
        assert!(f.is_empty());
        // The latest qualifies and stays; keep 0 drains everything.
        let mut f = frees(&[(4096, 1), (256, 2), (512, 3)]);
        out.clear();
        assert!(f.drain_all_but(1, small, &mut out));
        assert_eq!(seqs(&out), [1, 2]);
        assert_eq!(f.bytes, 512);
        out.clear();
        assert!(!f.drain_all_but(0, small, &mut out));
        assert_eq!(seqs(&out), [3]);
        assert!(f.is_empty() && f.bytes == 0);
        // Nothing qualifies: all go.
        let mut f = frees(&[(4096, 1), (2048, 2)]);
        out.clear();
        assert!(!f.drain_all_but(8, small, &mut out));
        assert_eq!(seqs(&out), [1, 2]);
        assert!(f.is_empty());
    }

    #[test]
    fn drain_upto_keeps_the_latest_that_qualify() {
        let mut f = small_and_large();
        // Up to 5: the two latest small ones (3 and 5) stay, 6 was not
        // passed; the rest go out in free order.
        let mut out = Vec::new();
        f.drain_upto(5, 2, small, &mut out);
        assert_eq!(seqs(&out), [1, 2, 4]);
        assert_eq!(f.bytes, 512 + 256 + 4096);
        // Everything passed, two kept: 6 goes, the latest becomes 5.
        out.clear();
        f.drain_upto(u64::MAX, 2, small, &mut out);
        assert_eq!(seqs(&out), [6]);
        assert_eq!(f.reuse(256, u64::MAX).map(|p| p.seq), Some(5));
        assert_eq!(f.take(512, u64::MAX).map(|p| p.seq), Some(3));
        assert!(f.is_empty());
    }

    #[test]
    fn near_size_and_drain_see_every_block() {
        let mut f = frees(&[(1024, 1), (1100, 2), (4096, 3)]);
        assert_eq!(f.near_size(1000, u64::MAX), Some(1024));
        assert_eq!(f.near_size(1050, u64::MAX), Some(1100));
        assert_eq!(f.near_size(1050, 1), None);
        assert_eq!(f.near_size(4000, u64::MAX), Some(4096));
        let mut out = Vec::new();
        f.drain_upto(2, 0, |_| true, &mut out);
        let drained: Vec<u64> = out.iter().map(|p| p.seq).collect();
        assert_eq!(drained, [1, 2]);
        assert_eq!(f.bytes, 4096);
        // What was kept is still found, by `take` as by `near_size`.
        assert_eq!(f.near_size(4096, u64::MAX), Some(4096));
        assert_eq!(f.take(4096, u64::MAX).map(|p| p.seq), Some(3));
        assert!(f.is_empty());
    }
}
