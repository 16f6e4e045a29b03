//! The replay loop, and what it asks of an allocator ([`Replayed`]).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use vmpool::trace::{Trace, TraceOp};

#[derive(Default)]
pub(crate) struct Report {
    pub(crate) peak_reserved: u64,
    /// Peak reserved bytes as each pass ended.
    pub(crate) pass_peaks: Vec<u64>,
    /// Chunks mapped in each pass (vmpool only).
    pub(crate) pass_maps: Vec<u64>,
    /// Chunks mapped in each marked step (vmpool only).
    pub(crate) step_maps: Vec<u64>,
    pub(crate) ops: u64,
    pub(crate) nanos: u128,
    pub(crate) remaps: u64,
    pub(crate) bytes_remapped: u64,
    pub(crate) chunks_created: u64,
    pub(crate) chunks_released: u64,
    pub(crate) grows: u64,
    /// Marks at which whole free regions were gathered (vmpool only).
    pub(crate) gathers: u64,
    /// Marks at which free units were joined into larger chunks (vmpool
    /// only).
    pub(crate) joins: u64,
    pub(crate) grow_nanos: u64,
    pub(crate) maps: u64,
    pub(crate) unmaps: u64,
    /// vmpool's step layouts (`--mark-passes`, or the trace's marks).
    pub(crate) steps: vmpool::StepCounters,
    /// vmpool with `--slack`: where the reserved bytes not live lay when
    /// the pool's reserved bytes first reached their peak.
    pub(crate) slack_at_peak: Option<vmpool::Slack>,
    /// vmpool with `--mapping-ops`: the allocations that mapped chunks.
    pub(crate) mapping_ops: Option<Vec<MappingOp>>,
}

/// An allocation during which the pool mapped chunks (`--mapping-ops`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct MappingOp {
    /// The trace operation, counted from 0 over every pass; `None` for
    /// the allocation `--hold` makes before the first pass.
    pub(crate) op: Option<u64>,
    /// The bytes it asked for.
    pub(crate) size: u64,
    /// Chunks mapped since the allocation before it: by its own growth,
    /// and by a step layout made at a mark between the two.
    pub(crate) maps: u64,
}

impl Report {
    /// What every allocator's replay reports: its peak reserved bytes,
    /// and what the replay of `trace` as `schedule` measured (the steps'
    /// maps aside: only vmpool's are reported).
    pub(crate) fn measured(
        peak_reserved: u64,
        measured: Passes,
        trace: &Trace,
        schedule: &Schedule,
    ) -> Self {
        Report {
            peak_reserved,
            pass_peaks: measured.peaks,
            pass_maps: measured.maps,
            ops: (trace.ops.len() * schedule.passes) as u64,
            nanos: measured.nanos,
            ..Report::default()
        }
    }

    /// Estimated driver time of the replay's growth and remapping on the
    /// H200, in microseconds, from `driver_tour`'s costs (docs/RESULTS.md,
    /// "What a chunk costs"): each chunk created costs about 9 us to create
    /// and 1 to map, and each chunk mapped (new or moved) about 20 us of
    /// set access; each growth's set-access call about 20 us more; each
    /// unmap about 15 us and each release 15 us.
    pub(crate) fn est_driver_us(&self) -> u64 {
        20 * self.grows
            + 9 * self.chunks_created
            + 21 * self.maps
            + 15 * self.unmaps
            + 15 * self.chunks_released
    }
}

pub(crate) fn progress(ops: usize) -> ProgressBar {
    if std::io::stderr().is_terminal() {
        ProgressBar::new(ops as u64).with_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} ops {elapsed}")
                .expect("valid template"),
        )
    } else {
        ProgressBar::hidden()
    }
}

/// An allocator as the replay drives it.
pub(crate) trait Replayed {
    type Allocation;
    fn alloc(&mut self, size: u64) -> Result<Self::Allocation>;
    fn free(&mut self, a: Self::Allocation) -> Result<()>;
    /// Whether [`Replayed::sample`] runs after every allocation.
    fn samples(&self) -> bool {
        false
    }
    /// Reads what the allocator holds, outside the timed calls, after
    /// the allocation of `size` bytes at trace operation `op` (counted
    /// from 0 over every pass; `None`: the held allocation).
    fn sample(&mut self, _op: Option<u64>, _size: u64) -> Result<()> {
        Ok(())
    }
    /// Checks at the end of each pass, before what is left live is freed.
    fn check(&mut self) -> Result<()> {
        Ok(())
    }
    /// Peak reserved bytes so far.
    fn reserved_high(&mut self) -> Result<u64>;
    /// Chunks mapped so far, where the allocator says.
    fn maps(&mut self) -> u64 {
        0
    }
    /// Where the trace marks the end of a step (`s`); only vmpool lays
    /// steps out.
    fn mark_step(&mut self) -> Result<()> {
        Ok(())
    }
    /// Between passes, outside the clock.
    fn between_passes(&mut self) {}
}

/// Where a replay marks steps (`Pool::mark_step`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Marks {
    /// Where the trace does (`s` lines).
    Trace,
    /// There, and as each pass begins (`--mark-passes`).
    EachPass,
}

/// How a trace is replayed: how many times, where steps are marked, and
/// what is kept live throughout.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Schedule {
    pub(crate) passes: usize,
    pub(crate) marks: Marks,
    /// Bytes of the allocation held across every pass (`--hold`); 0: none.
    pub(crate) hold: u64,
}

/// What a replay measured, pass by pass.
pub(crate) struct Passes {
    pub(crate) nanos: u128,
    /// Peak reserved bytes as each pass ended.
    pub(crate) peaks: Vec<u64>,
    /// Chunks mapped during each pass.
    pub(crate) maps: Vec<u64>,
    /// Chunks mapped during each marked step (from one mark to the next).
    pub(crate) step_maps: Vec<u64>,
}

/// Replays `trace` on `a` as `schedule` says, freeing what is left live
/// after each pass.
pub(crate) fn replay<A: Replayed>(a: &mut A, trace: &Trace, schedule: &Schedule) -> Result<Passes> {
    let Schedule {
        passes,
        marks,
        hold,
    } = *schedule;
    let bar = progress(trace.ops.len() * passes);
    let mut measured = Passes {
        nanos: 0,
        peaks: Vec::with_capacity(passes),
        maps: Vec::with_capacity(passes),
        step_maps: Vec::new(),
    };
    // Chunks mapped as of the last mark.
    let mut at_mark = None;
    let mut mark = |a: &mut A, step_maps: &mut Vec<u64>| -> Result<()> {
        a.mark_step()?;
        let maps = a.maps();
        if let Some(before) = at_mark.replace(maps) {
            step_maps.push(maps - before);
        }
        Ok(())
    };
    let held = (hold > 0).then(|| a.alloc(hold)).transpose()?;
    if held.is_some() && a.samples() {
        a.sample(None, hold)?;
    }
    for pass in 0..passes {
        if marks == Marks::EachPass {
            mark(a, &mut measured.step_maps)?;
        }
        let maps_before = a.maps();
        let mut live: Vec<Option<A::Allocation>> = Vec::with_capacity(trace.slots);
        live.resize_with(trace.slots, || None);
        let mut sampling = Duration::ZERO;
        let start = Instant::now();
        for (i, op) in trace.ops.iter().enumerate() {
            match *op {
                TraceOp::Alloc { slot, size, .. } => {
                    live[slot] = Some(a.alloc(size)?);
                    if a.samples() {
                        let sampled = Instant::now();
                        a.sample(Some((pass * trace.ops.len() + i) as u64), size)?;
                        sampling += sampled.elapsed();
                    }
                }
                TraceOp::Free { slot, .. } => {
                    a.free(live[slot].take().expect("trace frees a live id"))?
                }
                TraceOp::Step => mark(a, &mut measured.step_maps)?,
                _ => anyhow::bail!("trace operation {i} is of a kind this replay does not know"),
            }
            if i % 4096 == 0 {
                bar.set_position((pass * trace.ops.len() + i) as u64);
            }
        }
        measured.nanos += (start.elapsed() - sampling).as_nanos();
        a.check()?;
        for x in live.into_iter().flatten() {
            a.free(x)?;
        }
        measured.peaks.push(a.reserved_high()?);
        measured.maps.push(a.maps() - maps_before);
        a.between_passes();
    }
    if let Some(held) = held {
        a.free(held)?;
    }
    bar.finish_and_clear();
    Ok(measured)
}
