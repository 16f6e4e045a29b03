//! A pool's address space and the physical memory in it: one reservation,
//! the chunks mapped into it (units), the chunks held unmapped (spares),
//! and the mappings that stay until a stream passes them (aliases). Every
//! driver call that creates, maps, unmaps or releases a chunk is made here.
//!
//! ```text
//!  reservation  [base ................................................. base+va_size)
//!  units        [unit A ][unit B      ]      [unit C]      (each one whole chunk)
//!  aliases                     [old place of a moved unit] (mapped until its stream passes,
//!                                                          then until the next driver work)
//!  spares       chunks not mapped anywhere, kept for reuse
//!  parked       spare chunks a fresh start left mapped where they were
//!  quarantine   mappings the driver would neither unmap nor give access to
//!  unreleased   chunks the driver would not release, tried again at the next trim
//! ```
//!
//! What lies inside the units (allocations, free blocks) is the heap's
//! business, not this object's. See Note [Address space layout], Note
//! [Physical lifecycle] and Note [Peer access] in docs/DESIGN.md.

mod spares;

use std::collections::{BTreeMap, HashMap};
use std::ops::{Range, RangeBounds};
use std::sync::Arc;

use rustc_hash::FxHashMap;
use vmm::memory::{Chunk, Mapping, Reservation};
use vmm::{Access, AccessDesc, Backend, ChunkHandle, DeviceId, DevicePtr};

use crate::ordering::StreamPos;
use crate::stats::UnitView;
use crate::va::Va;
use crate::{Error, Result};

/// The old place of a unit moved while its stream could still use it: its
/// chunk is mapped at the new place as well, and this mapping stays
/// until the stream passes it, then until the space's next driver work
/// (Note [Guards and aliases] in docs/DESIGN.md).
struct Alias<B: Backend> {
    mapping: Mapping<B>,
    until: AliasUntil,
}

/// What an alias waits for before it is unmapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AliasUntil {
    /// Its stream passing this position: until then the stream's queued
    /// work may use the old place.
    StreamPasses(StreamPos),
    /// The space's next driver work (a map, a trim, a release), whose step
    /// its unmap joins: nothing uses it any more.
    NextDriverWork,
}

/// A run of adjacent units: its address range and its mappings in order.
pub(crate) struct UnitRun<'a, B: Backend> {
    pub(crate) range: Range<Va>,
    pub(crate) mappings: Vec<&'a Mapping<B>>,
}

/// A chunk for [`Space::map_at`]: one to map, or a parked unit already
/// mapped at its place.
pub(crate) enum Piece<B: Backend> {
    Chunk(Arc<Chunk<B>>),
    InPlace(Mapping<B>),
}

impl<B: Backend> Piece<B> {
    pub(crate) fn size(&self) -> u64 {
        match self {
            Piece::Chunk(c) => c.size() as u64,
            Piece::InPlace(m) => m.size() as u64,
        }
    }
}

/// What the space has done, for [`crate::PoolStats`].
#[derive(Debug, Clone, Default)]
pub(crate) struct SpaceCounters {
    pub(crate) chunks_created: u64,
    pub(crate) chunks_released: u64,
    pub(crate) bytes_created: u64,
    pub(crate) bytes_released: u64,
    pub(crate) maps: u64,
    pub(crate) unmaps: u64,
}

/// How a [`Space`] is made.
pub(crate) struct SpaceProps {
    pub(crate) device: DeviceId,
    pub(crate) va_size: u64,
    pub(crate) granule: u64,
    /// Chunks are created exportable.
    pub(crate) shareable: bool,
    /// Most physical bytes the space may hold.
    pub(crate) max_size: u64,
}

pub(crate) struct Space<B: Backend> {
    device: DeviceId,
    reservation: Arc<Reservation<B>>,
    granule: u64,
    shareable: bool,
    /// Mapped units by address; every mapped byte is in the heap of its
    /// arena.
    units: BTreeMap<Va, Mapping<B>>,
    /// Chunks held but not mapped.
    spares: Vec<Arc<Chunk<B>>>,
    /// Spare chunks still mapped where they were units, by address: a fresh
    /// start leaves them there, out of the heap, so that growth laying a
    /// chunk of the same size at the same place takes one without a
    /// driver call (Note [Starting afresh] in docs/DESIGN.md).
    parked: BTreeMap<Va, Mapping<B>>,
    /// How many spare chunks, unmapped or parked, the space holds of each
    /// size: what growth plans with, kept as they come and go.
    spare_counts: BTreeMap<u64, usize>,
    /// Mappings that could be neither given access nor unmapped: out of
    /// service, kept so their chunks stay accounted for.
    quarantine: Vec<Mapping<B>>,
    /// Chunks the driver would not release: still held and counted as
    /// reserved, released again at the next trim (or when the pool goes).
    unreleased: Vec<Arc<Chunk<B>>>,
    /// Old mappings of moved units, by address.
    aliases: BTreeMap<Va, Alias<B>>,
    /// Physical bytes held: every chunk from its creation to its release.
    reserved: u64,
    reserved_high: u64,
    max_size: u64,
    /// What each device may do with the memory (`cudaMemPoolSetAccess`):
    /// the owner's read-write first, then peers. Every mapping made gets it.
    access: Vec<AccessDesc>,
    pub(crate) counters: SpaceCounters,
}

impl<B: Backend> Space<B> {
    /// Reserves the address range; no memory yet.
    pub(crate) fn new(backend: &Arc<B>, props: SpaceProps) -> Result<Self> {
        Ok(Self {
            device: props.device,
            // On a granule: NCCL registers only ranges whose chunks start
            // on one (Note [NCCL registration]), and a unit's place is the
            // base plus whole granules.
            reservation: Reservation::new(backend, props.va_size as usize, props.granule as usize)?,
            granule: props.granule,
            shareable: props.shareable,
            units: BTreeMap::new(),
            spares: Vec::new(),
            parked: BTreeMap::new(),
            spare_counts: BTreeMap::new(),
            quarantine: Vec::new(),
            unreleased: Vec::new(),
            aliases: BTreeMap::new(),
            reserved: 0,
            reserved_high: 0,
            max_size: props.max_size,
            access: vec![AccessDesc::read_write(props.device)],
            counters: SpaceCounters::default(),
        })
    }

    pub(crate) fn base(&self) -> Va {
        Va(self.reservation.base().0)
    }

    pub(crate) fn granule(&self) -> u64 {
        self.granule
    }

    fn backend(&self) -> &Arc<B> {
        self.reservation.backend()
    }

    pub(crate) fn units(&self) -> &BTreeMap<Va, Mapping<B>> {
        &self.units
    }

    pub(crate) fn reserved(&self) -> u64 {
        self.reserved
    }

    pub(crate) fn reserved_high(&self) -> u64 {
        self.reserved_high
    }

    pub(crate) fn reset_reserved_high(&mut self) {
        self.reserved_high = self.reserved;
    }

    pub(crate) fn set_max_size(&mut self, max_size: u64) {
        self.max_size = max_size;
    }

    pub(crate) fn mapped_bytes(&self) -> u64 {
        self.units.values().map(|m| m.size() as u64).sum()
    }

    pub(crate) fn unit_views(&self) -> Vec<UnitView> {
        self.units
            .iter()
            .map(|(&va, m)| UnitView {
                va: va.0,
                size: m.size() as u64,
                chunk: m.chunk().handle().0,
            })
            .collect()
    }

    /// The address of the first unit under `[ptr, ptr + size)` and the
    /// chunks of all of them, in address order. The range must be live, so
    /// that its units are mapped and stay put.
    pub(crate) fn units_under(&self, ptr: Va, size: u64) -> (Va, Vec<Arc<Chunk<B>>>) {
        let first = self
            .units
            .range(..=ptr)
            .next_back()
            .map_or(ptr, |(&va, _)| va);
        let chunks = self
            .units
            .range(first..ptr + size.max(1))
            .map(|(_, m)| Arc::clone(m.chunk()))
            .collect();
        (first, chunks)
    }

    /// The units in `range` in runs of adjacent ones, in address order.
    pub(crate) fn unit_runs(&self, range: impl RangeBounds<Va>) -> Vec<UnitRun<'_, B>> {
        runs_of(self.units.range(range))
    }

    /// A new chunk of `size` bytes, counted as reserved; refused past the
    /// size limit.
    pub(crate) fn create_chunk(&mut self, size: u64) -> Result<Arc<Chunk<B>>> {
        if self.reserved + size > self.max_size {
            return Err(Error::PoolLimit {
                requested: size,
                reserved: self.reserved,
                max_size: self.max_size,
            });
        }
        let chunk = if self.shareable {
            Chunk::new_shareable(self.backend(), self.device, size as usize)?
        } else {
            Chunk::new(self.backend(), self.device, size as usize)?
        };
        self.reserved += size;
        self.reserved_high = self.reserved_high.max(self.reserved);
        self.counters.chunks_created += 1;
        self.counters.bytes_created += size;
        tracing::trace!(handle = chunk.handle().0, size, "created chunk");
        Ok(chunk)
    }

    /// Maps `pieces` side by side from `start`, each as one unit (a parked
    /// one is there already), then gives the whole range the access list
    /// in one driver call, which costs about as much for many chunks as for
    /// one. On failure, what this call mapped is unmapped again and every
    /// chunk is spare.
    pub(crate) fn map_at(&mut self, start: Va, pieces: Vec<Piece<B>>) -> Result<()> {
        let mut at = start;
        let mut done: Vec<Va> = Vec::new();
        let mut pieces = pieces.into_iter();
        let mut failure = None;
        // Parked units have the access list already (Space::set_access).
        let mut mapped_any = false;
        while let Some(piece) = pieces.next() {
            let chunk = match piece {
                Piece::InPlace(mapping) => {
                    debug_assert_eq!(mapping.va().0, at.0, "parked where it goes");
                    let size = mapping.size() as u64;
                    self.units.insert(at, mapping);
                    done.push(at);
                    at += size;
                    continue;
                }
                Piece::Chunk(chunk) => chunk,
            };
            let size = chunk.size() as u64;
            match Mapping::new(&self.reservation, at.offset_from(self.base()), &chunk) {
                Ok(mapping) => {
                    self.counters.maps += 1;
                    tracing::trace!(
                        va = format_args!("{at:#x}"),
                        len = size,
                        handle = chunk.handle().0,
                        "mapped unit"
                    );
                    self.units.insert(at, mapping);
                    done.push(at);
                    at += size;
                    mapped_any = true;
                }
                Err(err) => {
                    self.keep_spare(chunk);
                    for piece in pieces.by_ref() {
                        self.put_back(piece);
                    }
                    failure = Some(err.into());
                }
            }
        }
        if failure.is_none() && mapped_any {
            let access = self.mapping_access();
            if let Err(err) =
                self.backend()
                    .set_access(DevicePtr::from(start), at.offset_from(start), &access)
            {
                failure = Some(err.into());
            }
        }
        match failure {
            None => Ok(()),
            Some(err) => {
                for va in done {
                    let mapping = self.units.remove(&va).expect("mapped above");
                    self.retire(mapping);
                }
                Err(err)
            }
        }
    }

    /// Takes the unit at `va` out of the units, still mapped.
    pub(crate) fn remove_unit(&mut self, va: Va) -> Mapping<B> {
        self.units.remove(&va).expect("a unit is mapped there")
    }

    /// Puts back a unit [`Space::remove_unit`] took out.
    pub(crate) fn restore_unit(&mut self, va: Va, mapping: Mapping<B>) {
        self.units.insert(va, mapping);
    }

    /// Unmaps a mapping taken out of the units; on failure it comes back.
    pub(crate) fn unmap(
        &mut self,
        mapping: Mapping<B>,
    ) -> std::result::Result<Arc<Chunk<B>>, (Error, Mapping<B>)> {
        match mapping.unmap() {
            Ok(chunk) => {
                self.counters.unmaps += 1;
                tracing::trace!(handle = chunk.handle().0, "unmapped unit");
                Ok(chunk)
            }
            Err((err, mapping)) => Err((err.into(), mapping)),
        }
    }

    /// Unmaps a mapping that is not (or no longer) a unit, keeping its
    /// chunk as spare; one that will not unmap is quarantined.
    pub(crate) fn retire(&mut self, mapping: Mapping<B>) {
        match self.unmap(mapping) {
            Ok(chunk) => self.keep_spare(chunk),
            Err((err, mapping)) => {
                tracing::warn!(%err, va = %mapping.va(), "could not unmap; mapping taken out of service");
                self.quarantine.push(mapping);
            }
        }
    }

    /// How many aliases map each chunk that has one, by its handle.
    pub(crate) fn alias_counts(&self) -> FxHashMap<ChunkHandle, usize> {
        let mut counts = FxHashMap::default();
        for alias in self.aliases.values() {
            *counts.entry(alias.mapping.chunk().handle()).or_default() += 1;
        }
        counts
    }

    /// Keeps the unit just taken out at `va` mapped as an alias until its
    /// stream passes `until`.
    pub(crate) fn add_alias(&mut self, va: Va, mapping: Mapping<B>, until: StreamPos) {
        let until = AliasUntil::StreamPasses(until);
        self.aliases.insert(va, Alias { mapping, until });
    }

    /// The aliases of `stream` up to position `upto` are no longer used:
    /// they wait, mapped, for the space's next driver work (Note [Guards
    /// and aliases], "Unmapped with other work").
    pub(crate) fn pass_aliases(&mut self, stream: u64, upto: u64) {
        for alias in self.aliases.values_mut() {
            if let AliasUntil::StreamPasses(pos) = alias.until {
                if pos.stream == stream && pos.seq <= upto {
                    alias.until = AliasUntil::NextDriverWork;
                }
            }
        }
    }

    /// Unmaps the aliases whose streams have passed them: at the start of
    /// every driver work, so that their unmaps fall in a step that calls
    /// the driver anyway.
    pub(crate) fn unmap_passed_aliases(&mut self) {
        let passed: Vec<Va> = self
            .aliases
            .iter()
            .filter(|(_, a)| a.until == AliasUntil::NextDriverWork)
            .map(|(&va, _)| va)
            .collect();
        for va in passed {
            let alias = self.aliases.remove(&va).expect("listed above");
            tracing::trace!(
                va = format_args!("{va:#x}"),
                "unmapping the old place of a moved unit"
            );
            self.retire(alias.mapping);
        }
    }

    /// The streams that aliases wait for to pass them, once per alias.
    pub(crate) fn alias_streams(&self) -> impl Iterator<Item = u64> + '_ {
        self.aliases.values().filter_map(|a| match a.until {
            AliasUntil::StreamPasses(pos) => Some(pos.stream),
            AliasUntil::NextDriverWork => None,
        })
    }

    /// The mappings in `range` that are not units: the old places of moved
    /// units that a stream may still use (aliases) and the mappings that
    /// would not unmap (quarantined), which growth must not map over:
    /// (address, size), in address order. Passed aliases are left out:
    /// growth unmaps them before it maps.
    pub(crate) fn mapped_apart_in(&self, range: Range<Va>) -> Vec<(u64, u64)> {
        let mut ranges: Vec<(u64, u64)> = self
            .aliases
            .range(range.clone())
            .filter(|(_, a)| a.until != AliasUntil::NextDriverWork)
            .map(|(&va, a)| (va.0, a.mapping.size() as u64))
            .collect();
        ranges.extend(
            self.quarantine
                .iter()
                .filter(|m| range.contains(&Va(m.va().0)))
                .map(|m| (m.va().0, m.size() as u64)),
        );
        ranges.sort_unstable();
        ranges
    }

    pub(crate) fn aliased_bytes(&self) -> u64 {
        self.aliases.values().map(|a| a.mapping.size() as u64).sum()
    }

    /// Drops a chunk the pool no longer wants; the driver frees it. A chunk
    /// the driver will not release stays held (and reserved), for the next
    /// trim to try again.
    pub(crate) fn release(&mut self, chunk: Arc<Chunk<B>>) {
        let size = chunk.size() as u64;
        debug_assert_eq!(
            Arc::strong_count(&chunk),
            1,
            "a released chunk has one owner"
        );
        match Chunk::release(chunk) {
            Ok(()) => {
                self.reserved -= size;
                self.counters.chunks_released += 1;
                self.counters.bytes_released += size;
                tracing::trace!(size, "released chunk");
            }
            Err((err, chunk)) => {
                tracing::warn!(%err, size, "could not release a chunk; kept for the next trim");
                self.unreleased.push(chunk);
            }
        }
    }

    /// Unmaps and releases the units at `vas`, keeping the reservation;
    /// returns the units released as (address, length), in address order.
    /// A unit that will not unmap stays a unit, mapped, its bytes where
    /// they were. Aliases must have been passed (their streams waited for).
    pub(crate) fn release_units(&mut self, vas: impl IntoIterator<Item = Va>) -> Vec<(Va, u64)> {
        self.unmap_passed_aliases();
        debug_assert!(self.aliases.is_empty(), "aliases outlive their streams");
        let mut released = Vec::new();
        for va in vas {
            let Some(mapping) = self.units.remove(&va) else {
                continue;
            };
            let len = mapping.size() as u64;
            match self.unmap(mapping) {
                Ok(chunk) => {
                    self.release(chunk);
                    released.push((va, len));
                }
                Err((err, mapping)) => {
                    tracing::warn!(%err, va = %mapping.va(), "could not unmap; the unit stays mapped");
                    self.units.insert(va, mapping);
                }
            }
        }
        released.sort_unstable_by_key(|&(va, _)| va);
        released
    }

    /// Tries again to release the chunks the driver would not release.
    pub(crate) fn retry_unreleased(&mut self) {
        for chunk in std::mem::take(&mut self.unreleased) {
            self.release(chunk);
        }
    }

    /// What `device` may do with the memory.
    pub(crate) fn access(&self, device: DeviceId) -> Access {
        self.access
            .iter()
            .find(|d| d.device == device)
            .map_or(Access::None, |d| d.access)
    }

    /// The access a new mapping gets: the list without its "none" entries
    /// (a mapping starts with no access for anyone).
    fn mapping_access(&self) -> Vec<AccessDesc> {
        self.access
            .iter()
            .copied()
            .filter(|d| d.access != Access::None)
            .collect()
    }

    /// Applies `desc` to every unit, one driver call per run of adjacent
    /// units, then records it for later mappings. On failure the runs
    /// already changed get the device's previous access back.
    pub(crate) fn set_access(&mut self, desc: AccessDesc) -> Result<()> {
        let previous = AccessDesc {
            device: desc.device,
            access: self.access(desc.device),
        };
        let mut runs = self.unit_runs(..);
        runs.extend(runs_of(&self.parked));
        for (i, run) in runs.iter().enumerate() {
            if let Err(err) = set_run_access(&run.mappings, desc) {
                for done in &runs[..i] {
                    if let Err(err) = set_run_access(&done.mappings, previous) {
                        tracing::warn!(%err, "could not restore a mapping's access");
                    }
                }
                return Err(err.into());
            }
        }
        match self.access.iter_mut().find(|d| d.device == desc.device) {
            Some(d) => d.access = desc.access,
            None => self.access.push(desc),
        }
        Ok(())
    }

    /// Leaves every unit's mapping in place for good: for a pool that goes
    /// while memory in it may still be used. Parked chunks, which hold
    /// nothing, go as usual.
    pub(crate) fn forget_mappings(&mut self) {
        std::mem::forget(std::mem::take(&mut self.units));
        std::mem::forget(std::mem::take(&mut self.quarantine));
    }

    /// Whether `[va, va + size)` overlaps a unit.
    fn overlaps_a_unit(&self, va: Va, size: u64) -> bool {
        self.units
            .range(..va + size)
            .next_back()
            .is_some_and(|(&u, m)| u + m.size() as u64 > va)
    }

    /// Checks the space's own tables: units that overlap, chunks held
    /// twice, aliases over units or of streams `registered` does not know,
    /// and the reserved count against the chunks held. Returns the bytes
    /// mapped as units and the number of chunks held.
    pub(crate) fn audit(
        &self,
        registered: impl Fn(u64) -> bool,
        problems: &mut Vec<String>,
    ) -> (u64, u64) {
        let mut chunks: HashMap<ChunkHandle, u64> = HashMap::new();
        let mut hold = |c: &Arc<Chunk<B>>, problems: &mut Vec<String>| {
            if chunks.insert(c.handle(), c.size() as u64).is_some() {
                problems.push(format!("{:?} is held twice", c.handle()));
            }
        };
        let mut mapped = 0;
        let mut prev_end = Va(0);
        for (&va, m) in &self.units {
            if va < prev_end {
                problems.push(format!("unit at {va:#x} overlaps the one before"));
            }
            prev_end = va + m.size() as u64;
            mapped += m.size() as u64;
            hold(m.chunk(), problems);
        }
        for c in &self.spares {
            hold(c, problems);
        }
        let mut spare_counts: BTreeMap<u64, usize> = BTreeMap::new();
        let sizes = self.spares.iter().map(|c| c.size() as u64);
        for size in sizes.chain(self.parked.values().map(|m| m.size() as u64)) {
            *spare_counts.entry(size).or_default() += 1;
        }
        if spare_counts != self.spare_counts {
            problems.push(format!(
                "spares by size {spare_counts:?} but counted {:?}",
                self.spare_counts
            ));
        }
        for (&va, m) in &self.parked {
            hold(m.chunk(), problems);
            if self.overlaps_a_unit(va, m.size() as u64) {
                problems.push(format!("parked chunk at {va:#x} overlaps a unit"));
            }
        }
        // A quarantined mapping may be a moved unit's old place (an alias
        // that would not unmap): its chunk is mapped at the new place too.
        for m in &self.quarantine {
            let c = m.chunk();
            let moved_here = self.units.values().any(|u| Arc::ptr_eq(u.chunk(), c));
            if !moved_here {
                hold(c, problems);
            }
        }
        for c in &self.unreleased {
            hold(c, problems);
        }
        // An alias's chunk is usually mapped at its new place too.
        for (&va, a) in &self.aliases {
            let c = a.mapping.chunk();
            chunks.entry(c.handle()).or_insert(c.size() as u64);
            if self.overlaps_a_unit(va, a.mapping.size() as u64) {
                problems.push(format!("alias at {va:#x} overlaps a unit"));
            }
            match a.until {
                AliasUntil::StreamPasses(pos) if !registered(pos.stream) => problems.push(format!(
                    "alias at {va:#x}: stream {} not registered",
                    pos.stream
                )),
                _ => {}
            }
        }
        let reserved: u64 = chunks.values().sum();
        if reserved != self.reserved {
            problems.push(format!(
                "reserved {} but chunks add up to {reserved}",
                self.reserved
            ));
        }
        (mapped, chunks.len() as u64)
    }
}

/// The mappings of `by_address` in runs of adjacent ones.
fn runs_of<'a, B: Backend + 'a>(
    by_address: impl IntoIterator<Item = (&'a Va, &'a Mapping<B>)>,
) -> Vec<UnitRun<'a, B>> {
    let mut runs: Vec<UnitRun<'a, B>> = Vec::new();
    for (&va, m) in by_address {
        match runs.last_mut() {
            Some(run) if run.range.end == va => {
                run.range.end = va + m.size() as u64;
                run.mappings.push(m);
            }
            _ => runs.push(UnitRun {
                range: va..va + m.size() as u64,
                mappings: vec![m],
            }),
        }
    }
    runs
}

/// Sets `desc` on a run of adjacent mappings with one driver call.
fn set_run_access<B: Backend>(run: &[&Mapping<B>], desc: AccessDesc) -> vmm::Result<()> {
    let first = run[0];
    let size = run.iter().map(|m| m.size()).sum();
    first
        .reservation()
        .backend()
        .set_access(first.va(), size, &[desc])
}
