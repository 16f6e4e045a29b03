//! Address ranges that never overlap, each with a value: the reservation and
//! mapping tables of both backends.
//!
//! ```text
//!   start ->  [start, start + size)  value
//!   0x1000    [0x1000, 0x3000)       a
//!   0x3000    [0x3000, 0x4000)       b      <- a run: each starts where
//!   0x4000    [0x4000, 0x6000)       c         the one before ends
//! ```
//!
//! A backend checks every call against its tables before the kernel or the
//! driver sees it; these are the questions it asks of them. Callers pass
//! ranges that do not wrap around the address space (the CUDA backend
//! checks; the host backend's come from its own `mmap`).

use std::collections::BTreeMap;

/// One range of a [`Ranges`] table.
#[derive(Debug)]
pub(crate) struct Range<V> {
    pub(crate) size: usize,
    pub(crate) value: V,
}

impl<V> Range<V> {
    fn end(&self, start: u64) -> u64 {
        start + self.size as u64
    }
}

/// Non-overlapping ranges by start address. The caller keeps them from
/// overlapping ([`Ranges::overlaps`] before [`Ranges::insert`]).
#[derive(Debug)]
pub(crate) struct Ranges<V> {
    by_start: BTreeMap<u64, Range<V>>,
}

impl<V> Default for Ranges<V> {
    fn default() -> Self {
        Self {
            by_start: BTreeMap::new(),
        }
    }
}

impl<V> Ranges<V> {
    pub(crate) fn len(&self) -> usize {
        self.by_start.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.by_start.is_empty()
    }

    pub(crate) fn insert(&mut self, start: u64, size: usize, value: V) {
        self.by_start.insert(start, Range { size, value });
    }

    pub(crate) fn remove(&mut self, start: u64) -> Option<Range<V>> {
        self.by_start.remove(&start)
    }

    /// The range that starts at `start`.
    pub(crate) fn get(&self, start: u64) -> Option<&Range<V>> {
        self.by_start.get(&start)
    }

    pub(crate) fn get_mut(&mut self, start: u64) -> Option<&mut Range<V>> {
        self.by_start.get_mut(&start)
    }

    /// The range holding all of `[start, start + size)`, as its start and
    /// size, if one does.
    pub(crate) fn containing(&self, start: u64, size: usize) -> Option<(u64, usize)> {
        let (&base, range) = self.by_start.range(..=start).next_back()?;
        (start + size as u64 <= range.end(base)).then_some((base, range.size))
    }

    /// Whether any byte of `[start, start + size)` lies in a range.
    pub(crate) fn overlaps(&self, start: u64, size: usize) -> bool {
        self.by_start
            .range(..start + size as u64)
            .next_back()
            .is_some_and(|(&base, range)| range.end(base) > start)
    }

    /// The run of ranges that together hold `[start, start + size)`, first
    /// to last, as their starts and ranges; `None` when a byte of it lies in
    /// none. The first may begin before `start`, the last end after it.
    pub(crate) fn covering(&self, start: u64, size: usize) -> Option<Vec<(u64, &Range<V>)>> {
        let end = start + size as u64;
        let (&first, first_range) = self.by_start.range(..=start).next_back()?;
        let mut run = Vec::new();
        let mut at = first;
        for (&base, range) in self.by_start.range(first..) {
            if base != at || at >= end {
                break;
            }
            run.push((base, range));
            at = range.end(base);
        }
        (at >= end && first_range.end(first) > start).then_some(run)
    }

    /// The starts of the ranges that make up exactly `[start, start +
    /// size)`, first to last; `None` unless it is a run of whole ranges.
    pub(crate) fn whole_run(&self, start: u64, size: usize) -> Option<Vec<u64>> {
        let run = self.covering(start, size)?;
        let (&(first, _), &(last, last_range)) = (run.first()?, run.last()?);
        (first == start && last_range.end(last) == start + size as u64)
            .then(|| run.iter().map(|&(base, _)| base).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [0x10, 0x30) [0x30, 0x40) [0x40, 0x60), then a gap, then [0x80, 0x90).
    fn table() -> Ranges<char> {
        let mut t = Ranges::default();
        t.insert(0x10, 0x20, 'a');
        t.insert(0x30, 0x10, 'b');
        t.insert(0x40, 0x20, 'c');
        t.insert(0x80, 0x10, 'd');
        t
    }

    fn starts(run: Option<Vec<(u64, &Range<char>)>>) -> Option<Vec<u64>> {
        run.map(|run| run.iter().map(|&(start, _)| start).collect())
    }

    #[test]
    fn containing_needs_one_range_to_hold_it_all() {
        let t = table();
        assert_eq!(t.containing(0x10, 0x20), Some((0x10, 0x20)));
        assert_eq!(t.containing(0x18, 0x8), Some((0x10, 0x20)));
        assert_eq!(t.containing(0x28, 0x10), None, "spans two ranges");
        assert_eq!(t.containing(0x8, 0x4), None, "before every range");
        assert_eq!(t.containing(0x60, 0x4), None, "in the gap");
    }

    #[test]
    fn overlaps_any_byte() {
        let t = table();
        assert!(t.overlaps(0x5f, 1));
        assert!(t.overlaps(0x0, 0x11));
        assert!(t.overlaps(0x60, 0x21));
        assert!(!t.overlaps(0x0, 0x10));
        assert!(!t.overlaps(0x60, 0x20));
        assert!(!t.overlaps(0x90, 0x100));
    }

    #[test]
    fn covering_is_the_contiguous_run() {
        let t = table();
        assert_eq!(starts(t.covering(0x10, 0x50)), Some(vec![0x10, 0x30, 0x40]));
        assert_eq!(starts(t.covering(0x20, 0x28)), Some(vec![0x10, 0x30, 0x40]));
        assert_eq!(starts(t.covering(0x20, 0x18)), Some(vec![0x10, 0x30]));
        assert_eq!(starts(t.covering(0x44, 1)), Some(vec![0x40]));
        assert_eq!(starts(t.covering(0x50, 0x20)), None, "runs into the gap");
        assert_eq!(starts(t.covering(0x60, 1)), None, "in the gap");
        assert_eq!(starts(t.covering(0x0, 0x20)), None, "starts before");
        assert_eq!(starts(t.covering(0x60, 0)), None, "empty, after a range");
    }

    #[test]
    fn whole_run_starts_and_ends_on_range_bounds() {
        let t = table();
        assert_eq!(t.whole_run(0x10, 0x50), Some(vec![0x10, 0x30, 0x40]));
        assert_eq!(t.whole_run(0x30, 0x10), Some(vec![0x30]));
        assert_eq!(t.whole_run(0x30, 0x18), None, "ends inside a range");
        assert_eq!(t.whole_run(0x20, 0x10), None, "starts inside a range");
        assert_eq!(t.whole_run(0x40, 0x50), None, "runs into the gap");
    }

    #[test]
    fn insert_get_remove() {
        let mut t = table();
        assert_eq!(t.len(), 4);
        assert_eq!(t.get(0x30).map(|r| (r.size, r.value)), Some((0x10, 'b')));
        assert!(t.get(0x38).is_none());
        t.get_mut(0x30).unwrap().value = 'B';
        assert_eq!(t.remove(0x30).map(|r| r.value), Some('B'));
        assert!(!t.overlaps(0x30, 0x10));
        assert_eq!(t.whole_run(0x10, 0x50), None);
        for start in [0x10, 0x40, 0x80] {
            t.remove(start);
        }
        assert!(t.is_empty());
    }
}
