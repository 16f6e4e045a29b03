//! Joining a pool's free units into larger chunks where its steps keep
//! moving them (Note [Growth and remapping], "Joining where steps keep
//! moving units", in docs/DESIGN.md).

use std::time::Instant;

use rustc_hash::FxHashSet;
use vmm::Backend;

use super::{FreeUnit, Growth};
use crate::arena::ArenaId;
use crate::plan::Source;
use crate::props::Defragment;
use crate::space::Piece;
use crate::va::Va;
use crate::Result;

/// Adjacent free units of one free block, to be replaced by one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    start: u64,
    len: u64,
    /// The units' indices in the list they came from, `first..end`.
    first: usize,
    end: usize,
}

impl<B: Backend> Growth<'_, B> {
    /// Replaces each run of two or more adjacent free units of the large
    /// arena, smaller than its largest growth chunk, by one new chunk of
    /// up to that size mapped at the same addresses: the units are
    /// unmapped and released first, so the pool holds no more memory than
    /// before. Later growths then move a few large chunks where they moved
    /// many small ones. Units under any stream's queued work, or held
    /// elsewhere, stay. Returns the bytes joined. On failure the tables
    /// are consistent and every chunk accounted for: a run not mapped
    /// again is unmapped room, its units' memory released as a trim would
    /// release it, and a chunk already created for one is spare or
    /// released.
    #[cold]
    pub(crate) fn join_free_units(&mut self) -> Result<u64> {
        let arena = ArenaId::Large;
        let (start, end, join) = {
            let large = &self.arenas[arena];
            (large.start, large.end, large.policy.chunk_size)
        };
        let mut free: Vec<FreeUnit> = self
            .free_units(None, Defragment::Units)
            .into_iter()
            .filter(|u| (start..end).contains(&u.va.0))
            .collect();
        free.sort_unstable_by_key(|u| u.va);
        let runs = runs_to_join(&free, join);
        if runs.is_empty() {
            return Ok(0);
        }
        let started = Instant::now();
        let sources: Vec<Source> = runs.iter().map(|r| Source::New { size: r.len }).collect();
        let targets: Vec<u64> = runs.iter().map(|r| r.start).collect();
        let release: FxHashSet<u64> = runs
            .iter()
            .flat_map(|r| free[r.first..r.end].iter().map(|u| u.va.0))
            .collect();
        self.space.unmap_passed_aliases();
        let gathered = self.gather(&sources, &targets, &free, &release)?;
        let mut pieces = gathered.pieces.into_iter();
        for run in &runs {
            let piece: Piece<B> = pieces.next().expect("one chunk a run");
            if let Err(err) = self.space.map_at(Va(run.start), vec![piece]) {
                for piece in pieces {
                    self.space.put_back(piece);
                }
                return Err(err);
            }
            self.arenas[arena].heap.insert_free(run.start, run.len);
        }
        let bytes = runs.iter().map(|r| r.len).sum();
        self.counters.joins += 1;
        tracing::debug!(
            pool = self.pool,
            units = release.len(),
            chunks = runs.len(),
            bytes,
            took = ?started.elapsed(),
            "joined free units"
        );
        Ok(bytes)
    }
}

/// The runs of `free` (in address order) to join: adjacent units of one
/// free block, each smaller than `join` bytes, taken from the left in
/// runs of at most `join` bytes; a run of one unit is left as it is.
fn runs_to_join(free: &[FreeUnit], join: u64) -> Vec<Run> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < free.len() {
        let first = free[i];
        let mut run = Run {
            start: first.va.0,
            len: first.len,
            first: i,
            end: i + 1,
        };
        if first.len < join {
            while let Some(next) = free.get(run.end) {
                let adjacent = next.va.0 == run.start + run.len && next.block == first.block;
                if !adjacent || next.len >= join || run.len + next.len > join {
                    break;
                }
                run.len += next.len;
                run.end += 1;
            }
        }
        if run.end - run.first >= 2 {
            runs.push(run);
        }
        i = run.end;
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heap::{BlockId, Heap};

    const MIB: u64 = 1 << 20;

    /// Two distinct block ids.
    fn blocks() -> [BlockId; 2] {
        let mut heap = Heap::new();
        [heap.insert_free(0, MIB), heap.insert_free(4 * MIB, MIB)]
    }

    fn unit(at_mib: u64, len_mib: u64, block: BlockId) -> FreeUnit {
        FreeUnit {
            va: Va(at_mib * MIB),
            len: len_mib * MIB,
            block,
            aliased: false,
        }
    }

    #[test]
    fn adjacent_units_of_one_block_join_up_to_the_chunk_size() {
        let [a, b] = blocks();
        // 2 MiB units at 0..10 MiB in block a, 10..12 in block b, and a
        // 32 MiB unit at 12 MiB; joined in runs of at most 6 MiB.
        let free = [
            unit(0, 2, a),
            unit(2, 2, a),
            unit(4, 2, a),
            unit(6, 2, a),
            unit(8, 2, a),
            unit(10, 2, b),
            unit(12, 32, b),
        ];
        let runs = runs_to_join(&free, 6 * MIB);
        let spans: Vec<(u64, u64)> = runs.iter().map(|r| (r.start / MIB, r.len / MIB)).collect();
        assert_eq!(spans, [(0, 6), (6, 4)]);
        assert_eq!((runs[0].first, runs[0].end), (0, 3));
        assert_eq!((runs[1].first, runs[1].end), (3, 5));
    }

    #[test]
    fn units_apart_or_alone_stay() {
        let [a, b] = blocks();
        // A gap between the first two; the third alone in its block.
        let free = [unit(0, 2, a), unit(4, 2, a), unit(6, 2, b)];
        assert!(runs_to_join(&free, 32 * MIB).is_empty());
    }
}
