//! A multiset of chunk sizes, for the planner's picks among spares.

/// A multiset of chunk sizes, by size: few distinct sizes however many
/// chunks, so that a pick looks at the sizes, not at every chunk.
#[derive(Debug, Clone)]
pub struct Sizes(Vec<(u64, usize)>);

impl Sizes {
    /// From (size, how many of it) pairs, in any order, sizes repeated or
    /// not.
    pub fn of(counts: impl IntoIterator<Item = (u64, usize)>) -> Self {
        let mut counted: Vec<(u64, usize)> = counts.into_iter().filter(|&(_, n)| n > 0).collect();
        counted.sort_unstable();
        counted.dedup_by(|later, kept| {
            let same = later.0 == kept.0;
            if same {
                kept.1 += later.1;
            }
            same
        });
        Self(counted)
    }

    /// Takes one of `size` out, which must be held.
    fn take(&mut self, size: u64) -> u64 {
        let i = self.0.partition_point(|&(s, _)| s < size);
        let (s, n) = &mut self.0[i];
        debug_assert!(*s == size && *n > 0, "a size held");
        *n -= 1;
        if *n == 0 {
            self.0.remove(i);
        }
        size
    }

    /// As [`super::best_cover`]: the smallest size of at least `left`, else the
    /// largest.
    pub(super) fn take_best_cover(&mut self, left: u64) -> Option<u64> {
        let i = self.0.partition_point(|&(s, _)| s < left);
        let &(size, _) = self.0.get(i).or(self.0.last())?;
        Some(self.take(size))
    }

    /// The smallest size in `[lo, hi]`.
    pub(super) fn take_smallest_in(&mut self, lo: u64, hi: u64) -> Option<u64> {
        let i = self.0.partition_point(|&(s, _)| s < lo);
        let &(size, _) = self.0.get(i).filter(|&&(s, _)| s <= hi)?;
        Some(self.take(size))
    }

    /// The largest size of at most `left`.
    pub(super) fn take_largest_within(&mut self, left: u64) -> Option<u64> {
        let i = self.0.partition_point(|&(s, _)| s <= left);
        let &(size, _) = self.0.get(i.checked_sub(1)?)?;
        Some(self.take(size))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_by_size() {
        let mut s = Sizes::of([(4, 1), (2, 2), (8, 1), (2, 1), (16, 0)]);
        assert_eq!(s.take_smallest_in(3, 8), Some(4));
        assert_eq!(s.take_smallest_in(3, 7), None);
        assert_eq!(s.take_largest_within(7), Some(2));
        assert_eq!(s.take_best_cover(5), Some(8));
        // Nothing covers 5 now: the largest.
        assert_eq!(s.take_best_cover(5), Some(2));
        assert_eq!(s.take_largest_within(1), None);
        assert_eq!(s.take_best_cover(1), Some(2));
        assert_eq!(s.take_best_cover(1), None);
    }
}
