//! Step marks for the C layer (Note [Step layouts] in docs/DESIGN.md): a
//! device with no pool yet has nothing to lay out, so a mark there does
//! nothing.

use vmpool::vmm::Backend;

use super::{CallError, Shim};

impl<B: Backend> Shim<B> {
    /// Marks the end of a step on `device`'s pool (`Pool::mark_step`).
    pub fn mark_step(&self, device: i64) -> Result<(), CallError> {
        let dev = self.device(device)?;
        if let Some(pool) = dev.pool.get() {
            pool.mark_step()?;
        }
        Ok(())
    }

    /// Marks the end of a step on `device`'s pool at its next allocation
    /// (`Pool::mark_step_at_next_allocation`).
    pub fn mark_step_at_next_alloc(&self, device: i64) -> Result<(), CallError> {
        let dev = self.device(device)?;
        if let Some(pool) = dev.pool.get() {
            pool.mark_step_at_next_allocation();
        }
        Ok(())
    }
}
