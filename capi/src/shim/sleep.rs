//! Sleep and wake for the C layer: every device's pool gives its memory
//! back and brings it back at the same addresses (`Pool::sleep`, Note
//! [Sleep and wake] in docs/DESIGN.md). Graph pools stay awake: their
//! memory is what captured graphs replay into, and PyTorch keeps it.

use vmpool::vmm::Backend;
use vmpool::{Pool, Retention, SleepLevel, Stream};

use super::{CallError, Device, Shim};

impl<B: Backend> Shim<B> {
    /// What sleeping at level 1 does with each device pool's bytes: kept
    /// in host memory (`keep`) or dropped. The pools are made if need be.
    pub fn set_retention(&self, keep: bool) -> Result<(), CallError> {
        let retention = if keep {
            Retention::Keep
        } else {
            Retention::Discard
        };
        for dev in &self.devices {
            self.pool(dev)?.set_retention(retention);
        }
        Ok(())
    }

    /// Puts every device's pool to sleep: level 1 keeps the bytes of the
    /// pools whose retention keeps them, level 2 keeps nothing. Waits for
    /// every stream vmpool has seen first. Refused while a graph capture
    /// is under way; a device whose sleep fails leaves the ones before it
    /// asleep, and the error says which.
    pub fn sleep(&self, level: i64) -> Result<(), CallError> {
        let level = match level {
            1 => SleepLevel::KeepTagged,
            2 => SleepLevel::DiscardAll,
            _ => return Err(CallError::SleepLevel(level)),
        };
        self.each_pool_quiet(|dev, pool, stream| {
            let report = pool.sleep(level, stream)?;
            tracing::info!(
                device = dev.id.0,
                kept = report.kept_bytes,
                released = report.released_bytes,
                pinned = report.pinned_bytes,
                "vmpool: asleep"
            );
            Ok(())
        })
    }

    /// Gets every device's pool ready to sleep at the copy's speed
    /// (`Pool::prepare_sleep`: a sleep that keeps every live byte, then a
    /// wake, after which an allocation's memory is few chunks). Waits for
    /// every stream vmpool has seen first. Refused while a graph capture
    /// is under way; a device whose pool lacks the memory to wake stays
    /// asleep, its bytes on the host, and `wake` brings it back.
    pub fn prepare_sleep(&self) -> Result<(), CallError> {
        self.each_pool_quiet(|dev, pool, stream| {
            let report = pool.prepare_sleep(stream)?;
            tracing::info!(
                device = dev.id.0,
                kept = report.sleep.kept_bytes,
                pinned = report.sleep.pinned_bytes,
                chunks_before = report.chunks_before,
                chunks_after = report.chunks_after,
                "vmpool: ready to sleep"
            );
            Ok(())
        })
    }

    /// Runs `f` on each device's pool, device by device, with a new stream
    /// of the device, once every stream vmpool has seen there has been
    /// waited for (and forgotten). Refused while a graph capture is under
    /// way on the device; the devices before it stay as `f` left them.
    fn each_pool_quiet(
        &self,
        mut f: impl FnMut(&Device<B>, &Pool<B>, &Stream<B>) -> Result<(), CallError>,
    ) -> Result<(), CallError> {
        for dev in &self.devices {
            let Some(pool) = dev.pool.get() else {
                continue;
            };
            if dev.graphs.any_open() {
                return Err(CallError::Vmpool(vmpool::Error::SleepDuringCapture));
            }
            self.wait_and_forget_streams(dev)?;
            let stream = self.context.create_stream(dev.id)?;
            f(dev, pool, &stream)?;
        }
        Ok(())
    }

    /// Wakes every device's pool that sleeps; one that lacks memory stays
    /// asleep, its bytes on the host, and the error says how much.
    pub fn wake(&self) -> Result<(), CallError> {
        for dev in &self.devices {
            let Some(pool) = dev.pool.get().filter(|p| p.is_asleep()) else {
                continue;
            };
            let stream = self.context.create_stream(dev.id)?;
            let report = pool.wake(&stream)?;
            tracing::info!(
                device = dev.id.0,
                restored = report.restored_bytes,
                mapped = report.mapped_bytes,
                "vmpool: awake"
            );
        }
        Ok(())
    }

    /// Makes `device`'s pool hold at least `bytes` of page-locked host
    /// memory for its next sleep, so that the sleep does not pin it
    /// (`Pool::reserve_host`). The pool is made if need be.
    pub fn reserve_host(&self, device: i64, bytes: u64) -> Result<(), CallError> {
        let dev = self.device(device)?;
        self.pool(dev)?.reserve_host(bytes)?;
        Ok(())
    }

    /// Frees the page-locked host memory `device`'s pool keeps between
    /// sleeps (`Pool::release_host`); returns its size in bytes.
    pub fn release_host(&self, device: i64) -> Result<u64, CallError> {
        let dev = self.device(device)?;
        match dev.pool.get() {
            Some(pool) => Ok(pool.release_host()?),
            None => Ok(0),
        }
    }
}
