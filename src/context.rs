//! The per-process view of the devices: each device's pools, its default
//! pool and its current pool (as CUDA keeps them per device).

use std::sync::{Arc, Mutex, MutexGuard};

use vmm::{Backend, DeviceId};

use crate::pool::{Pool, PoolProps, Siblings};
use crate::{Error, Result};

struct DeviceSlot<B: Backend> {
    /// Every pool of the device, so that one running out of memory can ask
    /// the others to release what they hold unused.
    pools: Arc<Siblings<B>>,
    default: Mutex<Option<Pool<B>>>,
    current: Mutex<Option<Pool<B>>>,
}

pub struct Context<B: Backend> {
    backend: Arc<B>,
    devices: Vec<DeviceSlot<B>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<B: Backend> Context<B> {
    pub fn new(backend: Arc<B>) -> Result<Self> {
        let devices = (0..backend.device_count()?)
            .map(|_| DeviceSlot {
                pools: Arc::default(),
                default: Mutex::new(None),
                current: Mutex::new(None),
            })
            .collect();
        Ok(Self { backend, devices })
    }

    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    fn slot(&self, device: DeviceId) -> Result<&DeviceSlot<B>> {
        self.devices
            .get(device.0 as usize)
            .ok_or(Error::InvalidDevice(device))
    }

    /// Creates an explicit pool with its own properties.
    pub fn create_pool(&self, props: &PoolProps) -> Result<Pool<B>> {
        Pool::create(&self.backend, props, &self.slot(props.device)?.pools)
    }

    /// The device's default pool, created on first use.
    pub fn default_pool(&self, device: DeviceId) -> Result<Pool<B>> {
        let slot = self.slot(device)?;
        let mut default = lock(&slot.default);
        if let Some(pool) = &*default {
            return Ok(pool.clone());
        }
        let pool = Pool::create(&self.backend, &PoolProps::new(device), &slot.pools)?;
        *default = Some(pool.clone());
        Ok(pool)
    }

    /// The pool that allocations without an explicit pool use on `device`:
    /// the one last made current, else the default pool.
    pub fn current_pool(&self, device: DeviceId) -> Result<Pool<B>> {
        match &*lock(&self.slot(device)?.current) {
            Some(pool) => Ok(pool.clone()),
            None => self.default_pool(device),
        }
    }

    /// Makes `pool` the current pool of its device.
    pub fn set_current_pool(&self, pool: &Pool<B>) -> Result<()> {
        *lock(&self.slot(pool.device())?.current) = Some(pool.clone());
        Ok(())
    }
}
