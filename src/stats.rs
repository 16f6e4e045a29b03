//! What a pool says about itself: CUDA's attributes, vmpool's statistics,
//! and a snapshot of its address space with a readable listing.

/// Attributes readable and settable as with `cudaMemPoolGetAttribute`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PoolAttribute {
    /// Bytes the pool may keep cached across a synchronization.
    ReleaseThreshold,
    /// Whether another stream may reuse a free it is ordered after by an
    /// event (1, the default) or not (0).
    ReuseFollowEventDependencies,
    /// Whether another stream may reuse a free that has already completed
    /// (1, the default) or not (0).
    ReuseAllowOpportunistic,
    /// Whether the pool may make another stream wait for a free so as to
    /// reuse it (1, the default) or not (0).
    ReuseAllowInternalDependencies,
    /// Physical bytes held (read-only).
    ReservedMemCurrent,
    /// High-water mark of the above; setting it to 0 resets it to current.
    ReservedMemHigh,
    /// Bytes of live allocations (read-only).
    UsedMemCurrent,
    /// High-water mark of the above; setting it to 0 resets it to current.
    UsedMemHigh,
}

impl PoolAttribute {
    /// The three cross-stream reuse switches, in this order: follow event
    /// dependencies, opportunistic, internal dependencies (Note
    /// [Event-based reuse] in docs/DESIGN.md).
    pub const REUSE_SWITCHES: [PoolAttribute; 3] = [
        PoolAttribute::ReuseFollowEventDependencies,
        PoolAttribute::ReuseAllowOpportunistic,
        PoolAttribute::ReuseAllowInternalDependencies,
    ];
}

/// What the pool has done, beyond CUDA's attributes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Allocations served, synchronous and stream-ordered.
    pub allocations: u64,
    /// Frees, synchronous and stream-ordered.
    pub frees: u64,
    /// Allocations that needed new mapped space.
    pub grows: u64,
    /// Time spent growing (planning and driver calls), in nanoseconds.
    pub grow_nanos: u64,
    /// Units unmapped from one place and mapped at another.
    pub remaps: u64,
    /// Bytes of the units remapped.
    pub bytes_remapped: u64,
    /// Physical chunks created (`cuMemCreate`).
    pub chunks_created: u64,
    /// Physical chunks released (`cuMemRelease`).
    pub chunks_released: u64,
    /// Bytes of the chunks created.
    pub bytes_created: u64,
    /// Bytes of the chunks released.
    pub bytes_released: u64,
    /// Driver map and unmap calls.
    pub maps: u64,
    /// Driver unmap calls.
    pub unmaps: u64,
    /// Trims that released memory (explicit, or to the release threshold
    /// at a synchronization).
    pub trims: u64,
    /// Step marks at which the units of whole free regions were gathered
    /// into one range (Note [Growth and remapping], "Gathering at marks").
    pub gathers: u64,
    /// Step marks at which free units were joined into larger chunks
    /// (Note [Growth and remapping], "Joining where steps keep moving
    /// units").
    pub joins: u64,
    /// Stream-ordered allocations served by memory freed on the same stream.
    pub same_stream_reuses: u64,
    /// ... by memory freed on a stream they were ordered after by an event.
    pub dependency_reuses: u64,
    /// Stream-ordered frees moved back to the heap because their stream
    /// had passed them (their event completed, or a synchronization).
    pub frees_completed: u64,
    /// ... by memory freed on another stream, after making them wait for it.
    pub waits_inserted: u64,
    /// Stream-ordered frees merged back into the heap early, when their
    /// own stream missed: that stream reuses them at any size; others only
    /// as the reuse switches allow (see `Guard`).
    pub frees_merged: u64,
    /// Events recorded on streams to learn when their frees complete.
    pub events_recorded: u64,
    /// Physical bytes held now (mapped and spare chunks).
    pub reserved_bytes: u64,
    /// Bytes of live allocations now, each rounded up to 256 bytes as
    /// the pool places it.
    pub used_bytes: u64,
    /// Bytes of the units mapped in the pool's range now (parked spare
    /// chunks, mapped but out of use, count in `spare_bytes`).
    pub mapped_bytes: u64,
    /// Bytes of spare chunks, held unused for the next growth: unmapped,
    /// or parked where a fresh start left them mapped.
    pub spare_bytes: u64,
    /// Chunks mapped as units now.
    pub units: u64,
    /// The largest free block of mapped space, in bytes.
    pub largest_free_range: u64,
    /// Freed in stream order, waiting for their stream to pass the free.
    pub pending_bytes: u64,
    /// Old places of units moved while their stream could still use them:
    /// mapped (to the same memory as the new place) until it passes them,
    /// then until the pool's next growth or trim unmaps them with its own
    /// driver calls.
    pub aliased_bytes: u64,
    /// The pool is asleep (`Pool::sleep`): its units are released.
    pub asleep: bool,
    /// While asleep: live bytes waiting in host memory for `Pool::wake`.
    pub kept_on_host_bytes: u64,
    /// Page-locked host memory the pool holds for sleeping: the kept bytes
    /// while asleep, and awake the buffer the next sleep reuses
    /// (`Pool::reserve_host`, `Pool::release_host`).
    pub host_bytes: u64,
}

/// A picture of a pool's address space: for a debug dump (its `Display`
/// is a readable listing) and for drawing.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PoolSnapshot {
    /// The first address of the pool's reservation.
    pub base: u64,
    /// The reservation's size in bytes.
    pub va_size: u64,
    /// The arenas' ranges: small allocations, then large ones.
    pub arenas: Vec<(u64, u64)>,
    /// Mapped units in address order.
    pub units: Vec<UnitView>,
    /// Free mapped ranges (start, length), in address order.
    pub free: Vec<(u64, u64)>,
    /// Spare chunks, held unused (unmapped, or parked where a fresh start
    /// left them mapped): (chunk handle, size).
    pub spares: Vec<(u64, u64)>,
    /// The pool's statistics at the same moment.
    pub stats: PoolStats,
}

/// One mapped chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct UnitView {
    /// The address it is mapped at.
    pub va: u64,
    /// Its size in bytes.
    pub size: u64,
    /// The backend's chunk handle: the same chunk keeps it when remapped.
    pub chunk: u64,
}

impl PoolSnapshot {
    /// Free bytes inside [start, start + len).
    pub fn free_in(&self, start: u64, len: u64) -> u64 {
        let end = start + len;
        self.free
            .iter()
            .map(|&(s, l)| (s.max(start), (s + l).min(end)))
            .filter(|(s, e)| e > s)
            .map(|(s, e)| e - s)
            .sum()
    }
}

/// Where a pool's reserved bytes that hold no live allocation lie, as a
/// snapshot shows them ([`PoolSnapshot::slack`]): what a footprint over
/// 1.0 is made of.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Slack {
    /// Physical bytes held ([`PoolStats::reserved_bytes`]).
    pub reserved: u64,
    /// Bytes of live allocations ([`PoolStats::used_bytes`]).
    pub used: u64,
    /// Free bytes in units with nothing else in them: growth may move
    /// these where they are needed (Note [Growth and remapping] in
    /// docs/DESIGN.md).
    pub free_whole_units: u64,
    /// Free bytes in units that hold something else too (live bytes, or
    /// a step region): no remap reaches them until the unit empties.
    pub free_in_shared_units: u64,
    /// How many units those are.
    pub shared_units: u64,
    /// Of `free_in_shared_units`, the bytes of free ranges that reach the
    /// start or the end of their mapped region (a run of adjacent units):
    /// a region's ragged ends (a range rounded up to whole granules, or
    /// units moved out beside it), rather than holes between live
    /// allocations.
    pub free_at_region_ends: u64,
    /// Mapped regions: runs of adjacent units.
    pub regions: u64,
    /// Spare chunks ([`PoolStats::spare_bytes`]).
    pub spare: u64,
    /// Freed in stream order and not yet passed by the stream
    /// ([`PoolStats::pending_bytes`]).
    pub pending: u64,
    /// The rest: the idle slots of step regions.
    pub other: u64,
}

impl PoolSnapshot {
    /// The pool's reserved bytes apart from its live ones, by where they
    /// lie.
    pub fn slack(&self) -> Slack {
        let mut slack = Slack {
            reserved: self.stats.reserved_bytes,
            used: self.stats.used_bytes,
            spare: self.stats.spare_bytes,
            pending: self.stats.pending_bytes,
            ..Slack::default()
        };
        // Units and free ranges are both in address order: one sweep.
        let mut first = 0;
        for (i, u) in self.units.iter().enumerate() {
            let end = u.va + u.size;
            let starts_region = i == 0 || {
                let prev = &self.units[i - 1];
                prev.va + prev.size != u.va
            };
            let ends_region = self.units.get(i + 1).is_none_or(|next| next.va != end);
            slack.regions += u64::from(starts_region);
            while self.free.get(first).is_some_and(|&(s, l)| s + l <= u.va) {
                first += 1;
            }
            let ranges = self.free[first..].iter().take_while(|&&(s, _)| s < end);
            let (mut free, mut at_ends) = (0, 0);
            for &(s, l) in ranges {
                let here = (s + l).min(end) - s.max(u.va);
                free += here;
                if (starts_region && s <= u.va) || (ends_region && s + l >= end) {
                    at_ends += here;
                }
            }
            if free == u.size {
                slack.free_whole_units += free;
            } else if free > 0 {
                slack.free_in_shared_units += free;
                slack.free_at_region_ends += at_ends;
                slack.shared_units += 1;
            }
        }
        slack.other = slack.reserved.saturating_sub(
            slack.used
                + slack.free_whole_units
                + slack.free_in_shared_units
                + slack.spare
                + slack.pending,
        );
        slack
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

impl std::fmt::Display for PoolSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = &self.stats;
        writeln!(
            f,
            "pool at {:#x} (+{}): reserved {} in {} chunks, used {}, pending {}, spare {}, largest free range {}",
            self.base,
            mib(self.va_size),
            mib(st.reserved_bytes),
            self.units.len() + self.spares.len(),
            mib(st.used_bytes),
            mib(st.pending_bytes),
            mib(st.spare_bytes),
            mib(st.largest_free_range),
        )?;
        writeln!(
            f,
            "  history: {} grows, {} remaps ({}), {} chunks created, {} released, {} trims, {} gathers, {} joins",
            st.grows,
            st.remaps,
            mib(st.bytes_remapped),
            st.chunks_created,
            st.chunks_released,
            st.trims,
            st.gathers,
            st.joins
        )?;
        for (i, &(start, end)) in self.arenas.iter().enumerate() {
            writeln!(
                f,
                "  arena {} [{start:#x}, {end:#x}):",
                ["small", "large"][i]
            )?;
            for u in self.units.iter().filter(|u| u.va >= start && u.va < end) {
                let free = self.free_in(u.va, u.size);
                writeln!(
                    f,
                    "    {:#x} {:>10}  chunk {:<6} live {:>10}  free {:>10}",
                    u.va,
                    mib(u.size),
                    u.chunk,
                    mib(u.size - free),
                    mib(free)
                )?;
            }
        }
        for &(chunk, size) in &self.spares {
            writeln!(f, "  spare chunk {chunk} ({})", mib(size))?;
        }
        Ok(())
    }
}
