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

use vmm::{Backend, ErrorKind, HostCopy};

use std::sync::atomic::Ordering;

use super::inner::Inner;
use super::Pool;
use crate::arena::ArenaId;
use crate::ordering::{Stream, StreamShared};
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
pub struct SleepReport {
    /// Live bytes copied to host memory.
    pub kept_bytes: u64,
    /// Device memory given back.
    pub released_bytes: u64,
}

/// What a [`crate::Pool::wake`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WakeReport {
    /// Bytes copied back from host memory.
    pub restored_bytes: u64,
    /// Device memory mapped again.
    pub mapped_bytes: u64,
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
    /// and freeing fail with [`Error::Asleep`]; work on the pool's memory
    /// faults. A failure before the release (no host memory, a failed copy)
    /// leaves the pool as it was. Not during a graph capture, nor while
    /// another process holds imports of the pool's memory.
    pub fn sleep(&self, level: SleepLevel, stream: &Stream<B>) -> Result<SleepReport> {
        self.same_device(stream)?;
        if self.0.exports.leases() > 0 {
            return Err(Error::SleepState("shared with another process"));
        }
        let report = self.lock().sleep(&self.0.backend, level, &stream.0)?;
        self.0.asleep.store(true, Ordering::Release);
        Ok(report)
    }

    /// Brings a sleeping pool's memory back: new chunks mapped where the old
    /// ones were, with the same access (peers included), and the kept bytes
    /// copied back, in `stream`'s order; returns once they are. Too little
    /// device memory is [`Error::WakeOutOfMemory`], and the pool stays
    /// asleep with its bytes on the host, to be woken again later.
    pub fn wake(&self, stream: &Stream<B>) -> Result<WakeReport> {
        self.same_device(stream)?;
        let report = self.lock().wake(&self.0.backend, &stream.0)?;
        self.0.asleep.store(false, Ordering::Release);
        Ok(report)
    }

    /// Whether the pool sleeps ([`Pool::sleep`] without a [`Pool::wake`]
    /// since).
    pub fn is_asleep(&self) -> bool {
        self.0.asleep.load(Ordering::Acquire)
    }
}

/// A sleeping pool's state: its kept bytes and where its units were.
pub(super) struct Slumber<B: Backend> {
    host: Option<B::HostBuffer>,
    /// Where each kept range goes back, and where it is in `host`.
    copies: Vec<HostCopy>,
    kept: u64,
    /// The units released, in address order, to map at the same addresses.
    units: Vec<(Va, u64)>,
}

impl<B: Backend> Slumber<B> {
    pub(super) fn kept_bytes(&self) -> u64 {
        self.kept
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
    /// See [`crate::Pool::sleep`]. `stream`'s work so far may use the
    /// memory; so may the work of every stream with frees pending here,
    /// which is waited for too.
    pub(super) fn sleep(
        &mut self,
        backend: &B,
        level: SleepLevel,
        stream: &StreamShared<B>,
    ) -> Result<SleepReport> {
        if self.slumber.is_some() {
            return Err(Error::SleepState("asleep already"));
        }
        if !self.wait_for_pending_frees() {
            return Err(Error::SleepDuringCapture);
        }
        backend.synchronize_stream(&stream.raw)?;
        let keep = level == SleepLevel::KeepTagged && self.retention == Retention::Keep;
        let mut copies = Vec::new();
        let mut kept = 0;
        if keep {
            for arena in [ArenaId::Small, ArenaId::Large] {
                for (start, len) in self.arenas[arena].heap.used_ranges() {
                    copies.push(HostCopy {
                        device: vmm::DevicePtr(start),
                        host_offset: kept as usize,
                        len: len as usize,
                    });
                    kept += len;
                }
            }
        }
        // Host memory first, and the copy: a failure of either leaves the
        // pool as it was.
        let host = if kept > 0 {
            let mut host = backend.alloc_host(kept as usize)?;
            backend.copy_device_to_host(&stream.raw, &copies, &mut host)?;
            Some(host)
        } else {
            None
        };
        let before = self.space.reserved();
        let all: Vec<Va> = self.space.units().keys().copied().collect();
        let units = self.space.release_units(all);
        let released_bytes = before - self.space.reserved();
        tracing::debug!(kept, released_bytes, units = units.len(), "pool asleep");
        self.slumber = Some(Slumber {
            host,
            copies,
            kept,
            units,
        });
        Ok(SleepReport {
            kept_bytes: kept,
            released_bytes,
        })
    }

    /// See [`crate::Pool::wake`]. On failure nothing has changed: the pool
    /// is still asleep, its bytes still on the host.
    pub(super) fn wake(&mut self, backend: &B, stream: &StreamShared<B>) -> Result<WakeReport> {
        let Some(slumber) = self.slumber.take() else {
            return Err(Error::SleepState("awake"));
        };
        match self.map_again(backend, stream, &slumber) {
            Ok(report) => {
                tracing::debug!(
                    restored = report.restored_bytes,
                    mapped = report.mapped_bytes,
                    "pool awake"
                );
                Ok(report)
            }
            Err(err) => {
                // Back to sleep: what this call mapped goes again.
                let vas = slumber.units.iter().map(|&(va, _)| va);
                self.space.release_units(vas);
                let needed = slumber.unit_bytes();
                let kept = slumber.kept;
                self.slumber = Some(slumber);
                match err {
                    Error::Driver(e) if e.kind() == ErrorKind::OutOfMemory => {
                        let device_free =
                            backend.mem_info(stream.device).map_or(0, |m| m.free as u64);
                        Err(Error::WakeOutOfMemory {
                            device: stream.device,
                            needed,
                            device_free,
                            kept,
                        })
                    }
                    err => Err(err),
                }
            }
        }
    }

    /// Creates the slumber's units where they were, then copies its kept
    /// bytes back.
    fn map_again(
        &mut self,
        backend: &B,
        stream: &StreamShared<B>,
        slumber: &Slumber<B>,
    ) -> Result<WakeReport> {
        let mut mapped = 0;
        let mut units = slumber.units.iter().peekable();
        while let Some(&(start, len)) = units.next() {
            let mut chunks = vec![self.space.create_chunk(len)?];
            let mut end = start + len;
            while let Some(&&(va, len)) = units.peek() {
                if va != end {
                    break;
                }
                units.next();
                // A chunk created but not yet mapped is spare: released if
                // this wake fails.
                match self.space.create_chunk(len) {
                    Ok(chunk) => chunks.push(chunk),
                    Err(err) => {
                        for chunk in chunks {
                            self.space.keep_spare(chunk);
                        }
                        return Err(err);
                    }
                }
                end += len;
            }
            self.space.map_at(start, chunks)?;
            mapped += end.0 - start.0;
        }
        if let Some(host) = &slumber.host {
            backend.copy_host_to_device(&stream.raw, host, &slumber.copies)?;
        }
        Ok(WakeReport {
            restored_bytes: slumber.kept,
            mapped_bytes: mapped,
        })
    }
}
