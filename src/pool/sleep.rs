//! Sleep and wake: a pool gives all its device memory back and brings it
//! back later at the same addresses, the bytes it was asked to keep
//! restored (Note [Sleep and wake] in docs/DESIGN.md).
//!
//! ```text
//!   sleep:  wait for the streams -> copy kept bytes to host memory
//!           -> unmap and release every chunk (the reservation and the heap stay)
//!   wake:   create chunks -> map them where they were, same access
//!           -> copy the kept bytes back
//! ```

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use vmm::{Backend, ErrorKind, HostBuffer, HostCopy};

use super::batches::{batch_starts, batch_units, cut_copies, host_size, split_copies, wake_chunks};
use super::inner::Inner;
use super::Pool;
use crate::arena::ArenaId;
use crate::ordering::{Stream, StreamShared};
use crate::space::{Piece, Space};
use crate::va::Va;
use crate::{Error, Result};

/// What happens to a pool's bytes when it sleeps at
/// [`SleepLevel::KeepTagged`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Retention {
    /// Dropped: after waking, the pool's allocations hold whatever the new
    /// memory holds (a cache, such as a model's key-value cache).
    #[default]
    Discard,
    /// Copied to host memory at sleep and back at wake (a model's weights).
    Keep,
}

/// How deeply a pool sleeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SleepLevel {
    /// Pools whose retention is [`Retention::Keep`] keep their live bytes;
    /// the others drop theirs (vLLM's level 1).
    KeepTagged,
    /// Every pool drops its bytes (vLLM's level 2).
    DiscardAll,
}

/// What a [`crate::Pool::sleep`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct SleepReport {
    /// Live bytes copied to host memory.
    pub kept_bytes: u64,
    /// Device memory given back.
    pub released_bytes: u64,
    /// Page-locked host memory this sleep allocated: 0 when the buffer the
    /// pool held already (from an earlier sleep, or [`Pool::reserve_host`])
    /// was large enough.
    pub pinned_bytes: u64,
    /// Batches the copy and the release went in (Note [Sleep and wake]).
    pub batches: u64,
}

/// What a [`crate::Pool::prepare_sleep`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PrepareReport {
    /// The sleep that gave the pool's chunks back, every live byte kept.
    pub sleep: SleepReport,
    /// The wake that brought them back, a live allocation's in whole
    /// chunks.
    pub wake: WakeReport,
    /// Chunks the pool had mapped before.
    pub chunks_before: u64,
    /// Chunks mapped after: what the next sleep releases.
    pub chunks_after: u64,
}

/// What a [`crate::Pool::wake`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct WakeReport {
    /// Bytes copied back from host memory.
    pub restored_bytes: u64,
    /// Device memory mapped again.
    pub mapped_bytes: u64,
    /// Batches the mapping and the copy went in.
    pub batches: u64,
}

impl<B: Backend> Pool<B> {
    /// What [`Pool::sleep`] does with the pool's bytes at
    /// [`SleepLevel::KeepTagged`]; [`Retention::Discard`] until set.
    pub fn set_retention(&self, retention: Retention) {
        self.lock().retention = retention;
    }

    /// What [`Pool::sleep`] does with the pool's bytes ([`Pool::set_retention`]).
    pub fn retention(&self) -> Retention {
        self.lock().retention
    }

    /// Gives all the pool's device memory back while every pointer into it
    /// stays valid: waits for the work queued on `stream` so far and on
    /// every stream with frees pending here, copies the live bytes to host
    /// memory when the pool's retention is [`Retention::Keep`] and `level`
    /// is [`SleepLevel::KeepTagged`], then unmaps and releases every chunk.
    /// The address range stays reserved. Until [`Pool::wake`], allocating
    /// fails with [`Error::Asleep`] and work on the pool's memory faults;
    /// a free is taken as when awake, and its bytes are not copied back
    /// (a tensor dropped while its pool sleeps is neither lost nor
    /// restored). Not during a graph capture, nor while another process
    /// holds imports of the pool's memory.
    ///
    /// The host memory is page-locked and stays with the pool after the
    /// wake, for the next sleep to reuse ([`PoolStats::host_bytes`](crate::PoolStats::host_bytes);
    /// [`Pool::release_host`] gives it back, [`Pool::reserve_host`] takes it
    /// ahead of time). A sleep that needs more frees the old buffer and
    /// allocates a larger one. The copy goes in batches, each batch's
    /// chunks released as soon as its bytes are on the host. Releasing
    /// costs the driver some 30-60 us a chunk while the copy runs, so a
    /// pool of many small chunks (a pool under 4 GiB, or in its first
    /// steps, grows by 2 MiB ones by default) sleeps slower than its copy
    /// the first time; one grown by whole chunks
    /// ([`PoolProps::chunk_divisor`](crate::PoolProps::chunk_divisor)
    /// `None`) does not, and a wake brings the memory back in fewer chunks
    /// either way (Note [Sleep and wake] in docs/DESIGN.md).
    ///
    /// A failure leaves the pool awake with its bytes: before the release
    /// (no host memory, a failed copy) as it was; during it, the batches
    /// released so far are mapped and copied back. Should that fail too,
    /// the pool is left asleep ([`Pool::is_asleep`]) with those batches'
    /// bytes on the host, and [`Pool::wake`] brings them back.
    pub fn sleep(&self, level: SleepLevel, stream: &Stream<B>) -> Result<SleepReport> {
        self.may_sleep(stream)?;
        let mut inner = self.lock();
        let retention = match level {
            SleepLevel::KeepTagged => inner.retention,
            SleepLevel::DiscardAll => Retention::Discard,
        };
        self.sleep_locked(&mut inner, retention, stream)
    }

    /// Refuses a sleep on another device's stream, or of a pool shared
    /// with another process.
    fn may_sleep(&self, stream: &Stream<B>) -> Result<()> {
        self.same_device(stream)?;
        if self.0.exports.leases() > 0 {
            return Err(Error::SleepState("shared with another process"));
        }
        Ok(())
    }

    /// The sleep itself, under the pool's lock.
    fn sleep_locked(
        &self,
        inner: &mut Inner<B>,
        retention: Retention,
        stream: &Stream<B>,
    ) -> Result<SleepReport> {
        let report = inner.sleep(&self.0.backend, retention, &stream.0);
        // Asleep also after a failed release that could not be undone.
        if inner.slumber.is_some() {
            self.0.asleep.store(true, Ordering::Release);
        }
        report
    }

    /// Brings a sleeping pool's memory back: new chunks mapped where the old
    /// ones were, with the same access (peers included), and the kept bytes
    /// copied back, in `stream`'s order; returns once they are. The chunks
    /// are mapped in batches, each batch's copy running while the next is
    /// mapped. The host buffer stays with the pool ([`Pool::sleep`]). Too
    /// little device memory is [`Error::WakeOutOfMemory`], and the pool
    /// stays asleep with its bytes on the host, to be woken again later.
    pub fn wake(&self, stream: &Stream<B>) -> Result<WakeReport> {
        self.same_device(stream)?;
        let report = self.lock().wake(&self.0.backend, &stream.0)?;
        self.0.asleep.store(false, Ordering::Release);
        Ok(report)
    }

    /// Gets the pool ready to sleep at the copy's speed: a sleep that keeps
    /// every live byte (whatever the pool's retention), then a wake, on
    /// `stream`, so that the memory of each live allocation comes back in
    /// chunks of up to the growth chunk size. The next sleep then releases
    /// those few chunks instead of the many small ones growth made (a pool
    /// under 4 GiB, or in its first steps, grows by 2 MiB ones), whose
    /// release the driver serialises at some 40 us each, longer than
    /// copying their bytes
    /// (Note [Sleep and wake] in docs/DESIGN.md). The pinning, the copies
    /// both ways and the releases are paid here, at a time the program
    /// chooses, as [`Pool::reserve_host`] pays the pinning.
    ///
    /// As for [`Pool::sleep`], no work may use the pool's memory meanwhile.
    /// A failure leaves every byte where [`Pool::sleep`] and [`Pool::wake`]
    /// leave it: awake and intact, or, should the wake lack device memory,
    /// asleep with the bytes on the host, to be woken later.
    pub fn prepare_sleep(&self, stream: &Stream<B>) -> Result<PrepareReport> {
        self.may_sleep(stream)?;
        let mut inner = self.lock();
        let chunks_before = inner.space.units().len() as u64;
        let sleep = self.sleep_locked(&mut inner, Retention::Keep, stream)?;
        let wake = inner.wake(&self.0.backend, &stream.0)?;
        self.0.asleep.store(false, Ordering::Release);
        Ok(PrepareReport {
            sleep,
            wake,
            chunks_before,
            chunks_after: inner.space.units().len() as u64,
        })
    }

    /// Whether the pool sleeps ([`Pool::sleep`] without a [`Pool::wake`]
    /// since).
    pub fn is_asleep(&self) -> bool {
        self.0.asleep.load(Ordering::Acquire)
    }

    /// Makes sure the pool holds at least `bytes` of page-locked host
    /// memory for its next [`Pool::sleep`], so that the sleep does not pay
    /// for pinning it (the kernel's work, at a few GB/s: most of a first
    /// sleep's time). The memory is pinned outside the pool's lock, so
    /// allocating from the pool goes on meanwhile; a smaller buffer held
    /// before is freed first. Refused ([`Error::SleepState`]) while the
    /// pool sleeps with bytes kept in it.
    pub fn reserve_host(&self, bytes: u64) -> Result<()> {
        let (size, old) = {
            let mut inner = self.lock();
            if inner.keeps_on_host() {
                return Err(Error::SleepState(ASLEEP_WITH_HOST));
            }
            if inner.host_bytes() >= bytes {
                return Ok(());
            }
            (host_size(bytes, inner.space.granule()), inner.host.take())
        };
        // Never both pinned at once.
        drop(old);
        let buffer = self.0.backend.alloc_host(size as usize)?;
        let mut inner = self.lock();
        if inner.keeps_on_host() {
            // A sleep came in between, with a buffer of its own.
            drop(inner);
            return Err(Error::SleepState(ASLEEP_WITH_HOST));
        }
        if inner.host_bytes() >= size {
            return Ok(());
        }
        let old = inner.host.replace(buffer);
        drop(inner);
        drop(old);
        tracing::debug!(pool = self.0.id, bytes = size, "host memory reserved");
        Ok(())
    }

    /// Frees the page-locked host memory the pool keeps between sleeps;
    /// returns its size in bytes (0 if it held none). The next sleep that
    /// keeps bytes allocates it again. Refused ([`Error::SleepState`])
    /// while the pool sleeps with bytes kept in it.
    pub fn release_host(&self) -> Result<u64> {
        let old = {
            let mut inner = self.lock();
            if inner.keeps_on_host() {
                return Err(Error::SleepState(ASLEEP_WITH_HOST));
            }
            inner.host.take()
        };
        // Freed outside the lock: unpinning takes a while.
        let bytes = old.as_ref().map_or(0, |h| h.len() as u64);
        drop(old);
        Ok(bytes)
    }
}

/// [`Error::SleepState`] for what the host buffer cannot do while asleep.
const ASLEEP_WITH_HOST: &str = "asleep: its host buffer holds the kept bytes";

/// A sleeping pool's state: where its kept bytes are in the pool's host
/// buffer and where its units were.
pub(super) struct Slumber {
    /// Where each kept range goes back, and where it is in the host
    /// buffer, in address order.
    copies: Vec<HostCopy>,
    kept: u64,
    /// The units released, in address order, to map at the same addresses.
    units: Vec<(Va, u64)>,
}

impl Slumber {
    pub(super) fn kept_bytes(&self) -> u64 {
        self.kept
    }

    /// Takes `[start, start + len)`, freed while asleep, out of the bytes
    /// to copy back; the host buffer keeps its layout.
    pub(super) fn forget(&mut self, start: u64, len: u64) {
        self.kept -= cut_copies(&mut self.copies, start, start + len);
    }

    /// Bytes of the units to map back.
    pub(super) fn unit_bytes(&self) -> u64 {
        self.units.iter().map(|&(_, len)| len).sum()
    }

    /// The units to map back in `[start, end)`, with `mapped` (the units
    /// still mapped), as (start, length) runs of adjacent ones.
    pub(super) fn runs_in(&self, start: u64, end: u64, mapped: &[(Va, u64)]) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut units: Vec<(Va, u64)> = self.units.iter().chain(mapped).copied().collect();
        units.sort_unstable_by_key(|&(va, _)| va);
        let inside = units.iter().filter(|(va, _)| va.0 >= start && va.0 < end);
        for &(va, len) in inside {
            match runs.last_mut() {
                Some((start, run)) if *start + *run == va.0 => *run += len,
                _ => runs.push((va.0, len)),
            }
        }
        runs
    }
}

impl<B: Backend> Inner<B> {
    /// Page-locked host bytes held for sleeping.
    pub(super) fn host_bytes(&self) -> u64 {
        self.host.as_ref().map_or(0, |h| h.len() as u64)
    }

    /// Asleep with bytes in the host buffer, which must then stay as it is.
    fn keeps_on_host(&self) -> bool {
        self.slumber.as_ref().is_some_and(|s| s.kept > 0)
    }

    /// See [`crate::Pool::sleep`]; `retention` says whether the live bytes
    /// are kept. `stream`'s work so far may use the memory; so may the
    /// work of every stream with frees pending here, which is waited for
    /// too.
    fn sleep(
        &mut self,
        backend: &B,
        retention: Retention,
        stream: &StreamShared<B>,
    ) -> Result<SleepReport> {
        if self.slumber.is_some() {
            return Err(Error::SleepState("asleep already"));
        }
        if !self.wait_for_pending_frees() {
            return Err(Error::SleepDuringCapture);
        }
        backend.synchronize_stream(&stream.raw)?;
        let keep = retention == Retention::Keep;
        let mut ranges = Vec::new();
        if keep {
            for arena in [ArenaId::Small, ArenaId::Large] {
                ranges.extend(self.arenas[arena].heap.used_ranges());
            }
        }
        ranges.sort_unstable();
        let mut copies = Vec::with_capacity(ranges.len());
        let mut kept = 0;
        for (start, len) in ranges {
            copies.push(HostCopy {
                device: vmm::DevicePtr(start),
                host_offset: kept as usize,
                len: len as usize,
            });
            kept += len;
        }
        // Host memory first: a failure leaves the pool as it was.
        let mut pinned_bytes = 0;
        let pinning = Instant::now();
        if kept > 0 && self.host_bytes() < kept {
            // Never both pinned at once.
            self.host = None;
            let size = host_size(kept, self.space.granule());
            self.host = Some(backend.alloc_host(size as usize)?);
            pinned_bytes = size;
        }
        let pinning = pinning.elapsed();
        let before = self.space.reserved();
        self.space.retry_unreleased();
        let all: Vec<(Va, u64)> = self
            .space
            .units()
            .iter()
            .map(|(&va, m)| (va, m.size() as u64))
            .collect();
        let started = Instant::now();
        let (units, batches) = if kept > 0 {
            self.copy_out_and_release(backend, stream, &all, &copies)?
        } else {
            let units = self.space.release_units(all.iter().map(|&(va, _)| va));
            (units, 0)
        };
        self.space.release_spares();
        let released_bytes = before - self.space.reserved();
        tracing::debug!(
            kept,
            released_bytes,
            pinned_bytes,
            units = units.len(),
            batches,
            pinning = ?pinning,
            took = ?started.elapsed(),
            "pool asleep"
        );
        self.slumber = Some(Slumber {
            copies,
            kept,
            units,
        });
        Ok(SleepReport {
            kept_bytes: kept,
            released_bytes,
            pinned_bytes,
            batches: batches as u64,
        })
    }

    /// Copies `copies` into the host buffer batch by batch, releasing each
    /// batch of `units` once its bytes are there; returns the units
    /// released and the number of batches. On failure, what was released
    /// is mapped and copied back; if that fails too, the pool is left
    /// asleep with it (`self.slumber`).
    fn copy_out_and_release(
        &mut self,
        backend: &B,
        stream: &StreamShared<B>,
        units: &[(Va, u64)],
        copies: &[HostCopy],
    ) -> Result<(Vec<(Va, u64)>, usize)> {
        let groups = batch_units(units, self.space.granule());
        let batches = split_copies(copies, &batch_starts(units, &groups));
        let mut released = Vec::new();
        let mut done = 0;
        let host = self.host.as_mut().expect("allocated above");
        let space = &mut self.space;
        let started = Instant::now();
        let mut releasing = Duration::ZERO;
        let copied = if groups.is_empty() {
            // No unit: nothing to release; the bytes stay where they are.
            Ok(())
        } else {
            backend.copy_device_to_host_pipelined(&stream.raw, &batches, host, &mut |i| {
                let t = Instant::now();
                let vas = units[groups[i].clone()].iter().map(|&(va, _)| va);
                released.extend(space.release_units(vas));
                releasing += t.elapsed();
                done = i + 1;
                Ok(())
            })
        };
        tracing::debug!(
            batches = groups.len(),
            took = ?started.elapsed(),
            releasing = ?releasing,
            "copied out and released"
        );
        let Err(err) = copied.map_err(Error::from) else {
            return Ok((released, groups.len()));
        };
        if released.is_empty() {
            return Err(err);
        }
        // The batches done are on the host and their units released; the
        // others are as they were. Back to awake.
        let partial: Vec<HostCopy> = batches[..done].concat();
        let partial = Slumber {
            kept: partial.iter().map(|c| c.len as u64).sum(),
            copies: partial,
            units: released,
        };
        match self.restore(backend, stream, &partial) {
            Ok(_) => {
                tracing::warn!(%err, "sleep failed; the memory it released is back");
            }
            Err(again) => {
                tracing::error!(
                    %err,
                    %again,
                    kept = partial.kept,
                    "sleep failed and its release could not be undone: \
                     the pool stays asleep, its released bytes on the host; wake it"
                );
                self.slumber = Some(partial);
            }
        }
        Err(err)
    }

    /// See [`crate::Pool::wake`]. On failure nothing has changed: the pool
    /// is still asleep, its bytes still on the host.
    fn wake(&mut self, backend: &B, stream: &StreamShared<B>) -> Result<WakeReport> {
        let Some(slumber) = self.slumber.take() else {
            return Err(Error::SleepState("awake"));
        };
        let started = Instant::now();
        match self.restore(backend, stream, &slumber) {
            Ok(report) => {
                tracing::debug!(
                    restored = report.restored_bytes,
                    mapped = report.mapped_bytes,
                    batches = report.batches,
                    took = ?started.elapsed(),
                    "pool awake"
                );
                Ok(report)
            }
            Err(err) => {
                self.slumber = Some(slumber);
                Err(err)
            }
        }
    }

    /// Maps `slumber`'s units again and copies its bytes back. On failure,
    /// what this call mapped goes again, so that `slumber` describes the
    /// pool still; too little device memory is [`Error::WakeOutOfMemory`].
    fn restore(
        &mut self,
        backend: &B,
        stream: &StreamShared<B>,
        slumber: &Slumber,
    ) -> Result<WakeReport> {
        match self.map_again(backend, stream, slumber) {
            Ok(report) => Ok(report),
            Err(err) => match err {
                Error::Driver(e) if e.kind() == ErrorKind::OutOfMemory => {
                    let device_free = backend.mem_info(stream.device).map_or(0, |m| m.free as u64);
                    Err(Error::WakeOutOfMemory {
                        device: stream.device,
                        needed: slumber.unit_bytes(),
                        device_free,
                        kept: slumber.kept,
                    })
                }
                err => Err(err),
            },
        }
    }

    /// Creates the slumber's units where they were, batch by batch, each
    /// batch's kept bytes copied back while the next is mapped; adjacent
    /// units inside one live allocation come back as one chunk
    /// ([`wake_chunks`]). On failure, what this call mapped goes again.
    fn map_again(
        &mut self,
        backend: &B,
        stream: &StreamShared<B>,
        slumber: &Slumber,
    ) -> Result<WakeReport> {
        let mut blocks = Vec::new();
        for arena in [ArenaId::Small, ArenaId::Large] {
            blocks.extend(self.arenas[arena].heap.used_blocks());
        }
        blocks.sort_unstable();
        let cap = self.arenas[ArenaId::Large].policy.chunk_size;
        let chunks = wake_chunks(&slumber.units, &blocks, cap);
        let mapped = self.map_chunks(backend, stream, slumber, &chunks);
        if mapped.is_err() {
            self.space.release_units(chunks.iter().map(|&(va, _)| va));
            self.space.release_spares();
        }
        Ok(WakeReport {
            restored_bytes: slumber.kept,
            mapped_bytes: slumber.unit_bytes(),
            batches: mapped?,
        })
    }

    /// Creates and maps `chunks` (address order) in batches, copying the
    /// slumber's kept bytes of each batch back while the next is mapped;
    /// returns the number of batches.
    fn map_chunks(
        &mut self,
        backend: &B,
        stream: &StreamShared<B>,
        slumber: &Slumber,
        chunks: &[(Va, u64)],
    ) -> Result<u64> {
        let groups = batch_units(chunks, self.space.granule());
        let space = &mut self.space;
        match &self.host {
            Some(host) if slumber.kept > 0 && !groups.is_empty() => {
                let batches = split_copies(&slumber.copies, &batch_starts(chunks, &groups));
                let mut failure = None;
                let started = Instant::now();
                let mut mapping = Duration::ZERO;
                let copied =
                    backend.copy_host_to_device_pipelined(&stream.raw, host, &batches, &mut |i| {
                        let t = Instant::now();
                        let mapped = map_units(space, &chunks[groups[i].clone()]);
                        mapping += t.elapsed();
                        carry(&mut failure, mapped)
                    });
                tracing::debug!(
                    batches = groups.len(),
                    chunks = chunks.len(),
                    took = ?started.elapsed(),
                    mapping = ?mapping,
                    "mapped and copied back"
                );
                outcome(copied, failure)?;
            }
            _ => {
                for group in &groups {
                    map_units(space, &chunks[group.clone()])?;
                }
            }
        }
        Ok(groups.len() as u64)
    }
}

/// Creates chunks for `units` (address order) and maps each run of adjacent
/// ones where it was, one set-access call a run. A chunk created but not
/// mapped is left spare (released if the wake fails).
fn map_units<B: Backend>(space: &mut Space<B>, units: &[(Va, u64)]) -> Result<()> {
    let mut units = units.iter().peekable();
    while let Some(&(start, len)) = units.next() {
        let mut chunks = vec![space.create_chunk(len)?];
        let mut end = start + len;
        while let Some(&&(va, len)) = units.peek() {
            if va != end {
                break;
            }
            units.next();
            match space.create_chunk(len) {
                Ok(chunk) => chunks.push(chunk),
                Err(err) => {
                    for chunk in chunks {
                        space.keep_spare(chunk);
                    }
                    return Err(err);
                }
            }
            end += len;
        }
        space.map_at(start, chunks.into_iter().map(Piece::Chunk).collect())?;
    }
    Ok(())
}

/// A pool step inside a driver layer's callback: its error is kept in
/// `failure`, and the driver layer gets a stand-in that stops the calls.
fn carry(failure: &mut Option<Error>, step: Result<()>) -> vmm::Result<()> {
    step.map_err(|err| {
        let stand_in = vmm::Error::Rejected {
            call: "wake",
            kind: match &err {
                Error::Driver(e) => e.kind(),
                _ => ErrorKind::Other,
            },
            reason: err.to_string(),
        };
        *failure = Some(err);
        stand_in
    })
}

/// The error of a call whose callback went through [`carry`]: the pool's
/// own, if the callback failed.
fn outcome(result: vmm::Result<()>, failure: Option<Error>) -> Result<()> {
    match (result, failure) {
        (Ok(()), _) => Ok(()),
        (Err(_), Some(err)) => Err(err),
        (Err(err), None) => Err(err.into()),
    }
}
