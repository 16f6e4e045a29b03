//! The one way vmpool takes a standard mutex.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, ignoring poisoning: every update under vmpool's locks
/// completes before the lock is released (driver failures are handled, not
/// unwound), so a poisoned lock still guards consistent state.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
