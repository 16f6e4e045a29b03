//! Guards: free heap ranges that a stream-ordered free returned before its
//! stream had passed it (Note [Guards and aliases] in docs/DESIGN.md).

use std::collections::BTreeMap;

/// A position on a stream: the stream's id and how far along it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StreamPos {
    pub(crate) stream: u64,
    pub(crate) seq: u64,
}

/// A free heap range `[start, end)` (its start is its key in [`Guards`])
/// that the stream at `by` freed and may not have passed yet. That stream
/// may reuse it at once; another stream only once ordered after `by`, or
/// made to wait for it; a synchronous allocation only once the free is
/// known complete; and its chunk does not move or go until then.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Guard {
    pub(crate) end: u64,
    pub(crate) by: StreamPos,
}

/// A pool's guards by start address. They cover free heap space only and
/// never overlap: an allocation removes the guards in its range, once it
/// may take it.
#[derive(Default)]
pub(crate) struct Guards(BTreeMap<u64, Guard>);

impl Guards {
    pub(crate) fn insert(&mut self, start: u64, guard: Guard) {
        self.0.insert(start, guard);
    }

    /// The guards overlapping `[start, end)`, from the highest address down.
    pub(crate) fn in_range(&self, start: u64, end: u64) -> impl Iterator<Item = (u64, Guard)> + '_ {
        self.0
            .range(..end)
            .rev()
            .take_while(move |(_, g)| g.end > start)
            .map(|(&a, &g)| (a, g))
    }

    /// Removes the coverage of `[start, end)` by the guards `found` there
    /// ([`Guards::in_range`]), keeping what lies outside it.
    pub(crate) fn remove_found(&mut self, start: u64, end: u64, found: &[(u64, Guard)]) {
        for &(at, g) in found {
            self.0.remove(&at);
            if at < start {
                self.0.insert(at, Guard { end: start, ..g });
            }
            if g.end > end {
                self.0.insert(end, g);
            }
        }
    }

    /// Removes the guards' coverage of `[start, end)`, keeping what lies
    /// outside; returns the guards that covered part of it, lowest first.
    pub(crate) fn take(&mut self, start: u64, end: u64) -> Vec<Guard> {
        let found: Vec<(u64, Guard)> = self.in_range(start, end).collect();
        self.remove_found(start, end, &found);
        found.into_iter().rev().map(|(_, g)| g).collect()
    }

    /// Drops the guards of `stream` up to position `upto`: it has passed
    /// those frees.
    pub(crate) fn release(&mut self, stream: u64, upto: u64) {
        self.0
            .retain(|_, g| g.by.stream != stream || g.by.seq > upto);
    }

    pub(crate) fn any_of(&self, stream: u64) -> bool {
        self.0.values().any(|g| g.by.stream == stream)
    }

    /// Bytes under guards.
    pub(crate) fn bytes(&self) -> u64 {
        self.0.iter().map(|(&a, g)| g.end - a).sum()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, Guard)> + '_ {
        self.0.iter().map(|(&a, &g)| (a, g))
    }
}
