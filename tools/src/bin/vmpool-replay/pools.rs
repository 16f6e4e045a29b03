//! The allocators a trace replays on: a vmpool pool, CUDA's
//! stream-ordered pool, and plain cuMemAlloc.

use std::sync::Arc;

use anyhow::Result;
use vmpool::trace::Trace;
use vmpool::vmm::testing::lag::{Lagging, StreamLag};
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::{self, Backend, DeviceId};
use vmpool::{Context, PoolAttribute, PoolProps};

use crate::replay::{replay, MappingOp, Replayed, Report, Schedule};

/// How a trace replays on a vmpool pool.
pub(crate) struct VmpoolRun<'a> {
    pub(crate) props: &'a PoolProps,
    /// Through `allocate_async` / `free_async` on one stream, not
    /// `allocate` / `free`.
    pub(crate) stream_ordered: bool,
    /// Read where the slack lies each time the reserved bytes reach a new
    /// high (`--slack`): a snapshot, outside the timed calls.
    pub(crate) slack: bool,
    /// List the allocations that mapped chunks (`--mapping-ops`), from the
    /// pool's statistics after each, outside the timed calls.
    pub(crate) mapping_ops: bool,
    /// Keep the stream behind the calls (`--stream-lag`; stream-ordered
    /// only).
    pub(crate) stream_lag: Option<StreamLag>,
}

/// The allocations that mapped chunks so far, and the chunks mapped as
/// of the last allocation.
struct MappingLog {
    maps: u64,
    ops: Vec<MappingOp>,
}

/// The slack at the highest reserved bytes seen so far (`None` before
/// the pool reserves any).
struct SlackAtPeak(Option<vmpool::Slack>);

/// A vmpool pool, synchronous or stream-ordered on one stream.
struct VmpoolReplay<B: TestBackend> {
    pool: vmpool::Pool<B>,
    /// `Some`: stream-ordered on this stream.
    stream: Option<vmpool::Stream<B>>,
    /// `Some` with `--stream-lag`.
    lag: Option<Lagging<B>>,
    /// `Some` with `--slack`.
    slack: Option<SlackAtPeak>,
    /// `Some` with `--mapping-ops`.
    mapping: Option<MappingLog>,
}

impl<B: TestBackend> Replayed for VmpoolReplay<B> {
    type Allocation = vmpool::Allocation;
    fn alloc(&mut self, size: u64) -> Result<vmpool::Allocation> {
        Ok(match &self.stream {
            Some(s) => {
                let a = self.pool.allocate_async(size, s)?;
                if let Some(lag) = &mut self.lag {
                    lag.allocated(s.raw())?;
                }
                a
            }
            None => self.pool.allocate(size)?,
        })
    }
    fn free(&mut self, a: vmpool::Allocation) -> Result<()> {
        match &self.stream {
            Some(s) => {
                self.pool.free_async(a, s)?;
                if let Some(lag) = &mut self.lag {
                    lag.freed(s.raw())?;
                }
            }
            None => self.pool.free(a)?,
        }
        Ok(())
    }
    fn samples(&self) -> bool {
        self.slack.is_some() || self.mapping.is_some()
    }
    fn sample(&mut self, op: Option<u64>, size: u64) -> Result<()> {
        if let Some(log) = &mut self.mapping {
            let maps = self.pool.stats().maps;
            if maps > log.maps {
                log.ops.push(MappingOp {
                    op,
                    size,
                    maps: maps - log.maps,
                });
                log.maps = maps;
            }
        }
        if let Some(peak) = &mut self.slack {
            let reserved = self.pool.attribute(PoolAttribute::ReservedMemCurrent);
            if reserved > peak.0.map_or(0, |s| s.reserved) {
                peak.0 = Some(self.pool.snapshot().slack());
            }
        }
        Ok(())
    }
    fn check(&mut self) -> Result<()> {
        self.pool.audit().map_err(anyhow::Error::msg)
    }
    fn reserved_high(&mut self) -> Result<u64> {
        Ok(self.pool.attribute(PoolAttribute::ReservedMemHigh))
    }
    fn maps(&mut self) -> u64 {
        self.pool.stats().maps
    }
    fn mark_step(&mut self) -> Result<()> {
        Ok(self.pool.mark_step()?)
    }
    fn between_passes(&mut self) {
        self.pool.await_step_plan();
    }
}

/// Replays on a vmpool pool of the given backend.
pub(crate) fn replay_vmpool<B: TestBackend>(
    backend: Arc<B>,
    trace: &Trace,
    run: &VmpoolRun,
    schedule: &Schedule,
) -> Result<Report> {
    let ctx = Context::new(Arc::clone(&backend))?;
    let pool = ctx.create_pool(run.props)?;
    pool.set_attribute(PoolAttribute::ReleaseThreshold, u64::MAX)?;
    let stream = ctx.create_stream(DeviceId(0))?;
    let mut replayed = VmpoolReplay {
        pool,
        stream: run.stream_ordered.then(|| stream.clone()),
        lag: run.stream_lag.map(|lag| Lagging::new(backend, lag)),
        slack: run.slack.then_some(SlackAtPeak(None)),
        // A new pool has mapped nothing.
        mapping: run.mapping_ops.then(|| MappingLog {
            maps: 0,
            ops: Vec::new(),
        }),
    };
    let mut measured = replay(&mut replayed, trace, schedule)?;
    let pool = &replayed.pool;
    let stats = pool.stats();
    ctx.synchronize_stream(&stream)?;
    Ok(Report {
        step_maps: std::mem::take(&mut measured.step_maps),
        remaps: stats.remaps,
        bytes_remapped: stats.bytes_remapped,
        chunks_created: stats.chunks_created,
        chunks_released: stats.chunks_released,
        grows: stats.grows,
        gathers: stats.gathers,
        joins: stats.joins,
        grow_nanos: stats.grow_nanos,
        maps: stats.maps,
        unmaps: stats.unmaps,
        steps: pool.step_counters(),
        slack_at_peak: replayed.slack.and_then(|peak| peak.0),
        mapping_ops: replayed.mapping.map(|log| log.ops),
        ..Report::measured(
            pool.attribute(PoolAttribute::ReservedMemHigh),
            measured,
            trace,
            schedule,
        )
    })
}

/// CUDA's stream-ordered pool on one stream.
struct CudaAsyncReplay {
    pool: vmm::cuda::peers::CudaAsyncPool,
    stream: vmm::cuda::CudaStream,
}

impl Replayed for CudaAsyncReplay {
    type Allocation = vmm::cuda::peers::PeerAllocation;
    fn alloc(&mut self, size: u64) -> Result<Self::Allocation> {
        Ok(self.pool.alloc(size as usize, &self.stream)?)
    }
    fn free(&mut self, a: Self::Allocation) -> Result<()> {
        Ok(self.pool.free(a, &self.stream)?)
    }
    fn reserved_high(&mut self) -> Result<u64> {
        Ok(self.pool.reserved_high()?)
    }
}

/// Replays on CUDA's stream-ordered pool, release threshold max, one stream.
pub(crate) fn replay_cuda_async(
    cuda: &Arc<vmm::cuda::Cuda>,
    trace: &Trace,
    schedule: &Schedule,
) -> Result<Report> {
    let mut replayed = CudaAsyncReplay {
        pool: vmm::cuda::peers::CudaAsyncPool::new(cuda, DeviceId(0))?,
        stream: cuda.create_stream(DeviceId(0))?,
    };
    let measured = replay(&mut replayed, trace, schedule)?;
    cuda.synchronize_stream(&replayed.stream)?;
    Ok(Report::measured(
        replayed.pool.reserved_high()?,
        measured,
        trace,
        schedule,
    ))
}

/// Plain cuMemAlloc / cuMemFree; its footprint is the device's used
/// memory, sampled after each allocation, over what it was before.
struct CudaMallocReplay {
    malloc: vmm::cuda::peers::CudaMalloc,
    cuda: Arc<vmm::cuda::Cuda>,
    baseline: u64,
    peak: u64,
}

impl CudaMallocReplay {
    fn used(&self) -> Result<u64> {
        let m = self.cuda.mem_info(DeviceId(0))?;
        Ok((m.total - m.free) as u64)
    }
}

impl Replayed for CudaMallocReplay {
    type Allocation = vmm::cuda::peers::PeerAllocation;
    fn samples(&self) -> bool {
        true
    }
    fn alloc(&mut self, size: u64) -> Result<Self::Allocation> {
        Ok(self.malloc.alloc(size as usize)?)
    }
    fn free(&mut self, a: Self::Allocation) -> Result<()> {
        Ok(self.malloc.free(a)?)
    }
    fn sample(&mut self, _op: Option<u64>, _size: u64) -> Result<()> {
        self.peak = self.peak.max(self.used()?);
        Ok(())
    }
    fn reserved_high(&mut self) -> Result<u64> {
        Ok(self.peak - self.baseline)
    }
}

/// Replays on plain cuMemAlloc / cuMemFree.
pub(crate) fn replay_cuda_malloc(
    cuda: &Arc<vmm::cuda::Cuda>,
    trace: &Trace,
    schedule: &Schedule,
) -> Result<Report> {
    let mut replayed = CudaMallocReplay {
        malloc: vmm::cuda::peers::CudaMalloc::new(cuda, DeviceId(0))?,
        cuda: Arc::clone(cuda),
        baseline: 0,
        peak: 0,
    };
    replayed.baseline = replayed.used()?;
    replayed.peak = replayed.baseline;
    let measured = replay(&mut replayed, trace, schedule)?;
    Ok(Report::measured(
        replayed.reserved_high()?,
        measured,
        trace,
        schedule,
    ))
}
