//! A space's spare chunks: those held unmapped, and those parked, still
//! mapped where a fresh start took them out of use (Note [Starting
//! afresh] in docs/DESIGN.md), with their counts by size, which growth
//! plans with.

use std::ops::Range;
use std::sync::Arc;

use vmm::memory::{Chunk, Mapping};
use vmm::Backend;

use super::{Piece, Space};
use crate::va::Va;
use crate::Result;

impl<B: Backend> Space<B> {
    /// The spare chunks, unmapped then parked: (handle, size).
    pub(crate) fn spare_chunks(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let unmapped = self.spares.iter().map(|c| c.as_ref());
        unmapped
            .chain(self.parked.values().map(|m| m.chunk().as_ref()))
            .map(|c| (c.handle().0, c.size() as u64))
    }

    /// How many spare chunks, unmapped or parked, the space holds of each
    /// size, smallest first: what growth may map without creating memory.
    pub(crate) fn spare_counts(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        self.spare_counts.iter().map(|(&size, &n)| (size, n))
    }

    /// One more spare chunk of `size` bytes.
    fn spare_in(&mut self, size: u64) {
        *self.spare_counts.entry(size).or_default() += 1;
    }

    /// One spare chunk of `size` bytes fewer: mapped as a unit, or
    /// released.
    fn spare_out(&mut self, size: u64) {
        let n = self
            .spare_counts
            .get_mut(&size)
            .expect("a spare of that size");
        *n -= 1;
        if *n == 0 {
            self.spare_counts.remove(&size);
        }
    }

    pub(crate) fn spare_bytes(&self) -> u64 {
        self.spare_counts().map(|(size, n)| size * n as u64).sum()
    }

    /// Takes the unit at `va` out of the units and parks it there, still
    /// mapped: a spare chunk that growth may map again in place.
    pub(crate) fn park(&mut self, va: Va) {
        let mapping = self.remove_unit(va);
        self.spare_in(mapping.size() as u64);
        self.parked.insert(va, mapping);
    }

    /// Takes out the chunk parked at `va` if it is of `size` bytes, still
    /// mapped there.
    pub(crate) fn take_parked_at(&mut self, va: Va, size: u64) -> Option<Mapping<B>> {
        if self.parked.get(&va)?.size() as u64 != size {
            return None;
        }
        self.spare_out(size);
        self.parked.remove(&va)
    }

    /// Parks again a unit [`Space::take_parked_at`] took out and growth
    /// did not use.
    pub(crate) fn repark(&mut self, mapping: Mapping<B>) {
        self.spare_in(mapping.size() as u64);
        self.parked.insert(Va(mapping.va().0), mapping);
    }

    /// Unmaps the parked chunks that overlap `range`, keeping them spare,
    /// so that the range can be mapped. Fails on the first that will not
    /// unmap (it stays parked).
    pub(crate) fn clear_parked(&mut self, range: Range<Va>) -> Result<()> {
        let first = self
            .parked
            .range(..range.start)
            .next_back()
            .filter(|(&va, m)| va + m.size() as u64 > range.start)
            .map_or(range.start, |(&va, _)| va);
        let overlapping: Vec<Va> = self
            .parked
            .range(first..range.end)
            .map(|(&va, _)| va)
            .collect();
        for va in overlapping {
            self.unpark(va)?;
        }
        Ok(())
    }

    /// Takes a spare chunk of exactly `size` bytes: an unmapped one, else
    /// a parked one, unmapped now. The highest first: growth lays out from
    /// the bottom of an arena, so the chunks parked high are the last it
    /// would reach in place (half the maps of taking the lowest first:
    /// docs/RESULTS.md, "Fresh starts that keep their chunks mapped").
    pub(crate) fn take_spare(&mut self, size: u64) -> Result<Option<Arc<Chunk<B>>>> {
        if let Some(i) = self.spares.iter().position(|c| c.size() as u64 == size) {
            self.spare_out(size);
            return Ok(Some(self.spares.swap_remove(i)));
        }
        let Some(va) = self
            .parked
            .iter()
            .rev()
            .find(|(_, m)| m.size() as u64 == size)
            .map(|(&va, _)| va)
        else {
            return Ok(None);
        };
        self.take_unparked(va).map(Some)
    }

    /// Unmaps the chunk parked at `va` into the spares.
    fn unpark(&mut self, va: Va) -> Result<()> {
        let mapping = self.parked.remove(&va).expect("a chunk is parked there");
        match self.unmap(mapping) {
            Ok(chunk) => {
                self.spares.push(chunk);
                Ok(())
            }
            Err((err, mapping)) => {
                self.parked.insert(va, mapping);
                Err(err)
            }
        }
    }

    /// Unmaps the chunk parked at `va` and takes it out of the spares.
    fn take_unparked(&mut self, va: Va) -> Result<Arc<Chunk<B>>> {
        self.unpark(va)?;
        let chunk = self.spares.pop().expect("unparked just now");
        self.spare_out(chunk.size() as u64);
        Ok(chunk)
    }

    /// Keeps an unused chunk for later, unless an alias still maps it: then
    /// the alias hands it over when it goes.
    pub(crate) fn keep_spare(&mut self, chunk: Arc<Chunk<B>>) {
        if Arc::strong_count(&chunk) == 1 {
            self.spare_in(chunk.size() as u64);
            self.spares.push(chunk);
        }
    }

    /// Keeps a piece growth gathered and did not map: spare, or parked
    /// again.
    pub(crate) fn put_back(&mut self, piece: Piece<B>) {
        match piece {
            Piece::Chunk(chunk) => self.keep_spare(chunk),
            Piece::InPlace(mapping) => self.repark(mapping),
        }
    }

    /// Releases every spare chunk, parked ones unmapped first (one that
    /// will not unmap stays parked).
    pub(crate) fn release_spares(&mut self) {
        self.unmap_passed_aliases();
        let parked: Vec<Va> = self.parked.keys().copied().collect();
        for va in parked {
            self.release_parked(va);
        }
        for chunk in std::mem::take(&mut self.spares) {
            self.spare_out(chunk.size() as u64);
            self.release(chunk);
        }
    }

    /// Unmaps and releases the chunk parked at `va`; one that will not
    /// unmap stays parked, for a later trim.
    fn release_parked(&mut self, va: Va) {
        match self.take_unparked(va) {
            Ok(chunk) => self.release(chunk),
            Err(err) => {
                tracing::warn!(%err, va = format_args!("{va:#x}"), "could not unmap a parked chunk; it stays")
            }
        }
    }

    /// Releases the `count` largest spare chunks, parked ones included
    /// (unmapped first; one that will not unmap stays parked).
    pub(crate) fn release_largest_spares(&mut self, count: usize) {
        let mut sizes: Vec<(u64, Option<Va>)> = self
            .spares
            .iter()
            .map(|c| (c.size() as u64, None))
            .chain(
                self.parked
                    .iter()
                    .map(|(&va, m)| (m.size() as u64, Some(va))),
            )
            .collect();
        sizes.sort_by_key(|&(size, _)| std::cmp::Reverse(size));
        let mut unmapped = 0;
        for (_, parked) in sizes.into_iter().take(count) {
            match parked {
                Some(va) => self.release_parked(va),
                None => unmapped += 1,
            }
        }
        self.spares.sort_by_key(|c| std::cmp::Reverse(c.size()));
        let going: Vec<Arc<Chunk<B>>> = self.spares.drain(..unmapped).collect();
        for chunk in going {
            self.spare_out(chunk.size() as u64);
            self.release(chunk);
        }
    }
}
