//! The Linux calls behind the host backend, one function each.
//!
//! Address ranges here are raw `usize`s: the backend's tables (in `mod.rs`)
//! decide which ranges are ours to change, these functions only change them.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, MprotectFlags, ProtFlags};

use crate::{Access, Error, ErrorKind, Result};

fn os_error(call: &'static str, err: rustix::io::Errno) -> Error {
    let kind = if err == rustix::io::Errno::NOMEM {
        ErrorKind::OutOfMemory
    } else {
        ErrorKind::Other
    };
    Error::rejected(call, kind, format!("{call}: {err}"))
}

/// Reserves `size` bytes of address space, aligned to `alignment` (a power of
/// two), with no access and no memory committed behind it.
pub(super) fn reserve(size: usize, alignment: usize) -> Result<usize> {
    let padded = size
        .checked_add(alignment)
        .ok_or_else(|| Error::invalid("reserve", "size + alignment overflows"))?;
    // SAFETY: a fresh anonymous mapping chosen by the kernel (null hint, no
    // MAP_FIXED) cannot overlap anything that exists.
    let raw = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            padded,
            ProtFlags::empty(),
            MapFlags::PRIVATE | MapFlags::NORESERVE,
        )
    }
    .map_err(|e| os_error("mmap", e))? as usize;
    let start = raw.next_multiple_of(alignment);
    let head = start - raw;
    let tail = padded - head - size;
    // SAFETY: [raw, start) and [start + size, raw + padded) lie inside the
    // mapping made above, which nothing else knows of yet.
    unsafe {
        if head > 0 {
            rustix::mm::munmap(raw as *mut _, head).map_err(|e| os_error("munmap", e))?;
        }
        if tail > 0 {
            rustix::mm::munmap((start + size) as *mut _, tail)
                .map_err(|e| os_error("munmap", e))?;
        }
    }
    Ok(start)
}

/// Returns a reservation's address space to the kernel.
pub(super) fn release_range(start: usize, size: usize) -> Result<()> {
    // SAFETY: the caller's tables say [start, start + size) is a reservation
    // of ours with nothing mapped in it; no Rust reference points into it.
    unsafe { rustix::mm::munmap(start as *mut _, size) }.map_err(|e| os_error("munmap", e))
}

/// A chunk of "physical" memory: a memfd of `size` bytes, sealed at that
/// size so that a process that imports it can trust its size (a file that
/// shrank under a mapping would fault on access).
pub(super) fn create_memory(size: usize) -> Result<OwnedFd> {
    let fd = rustix::fs::memfd_create("vmm-chunk", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(|e| match e {
            // Each chunk holds a descriptor open while it lives: a large
            // allocation of small chunks runs out of descriptors before memory.
            rustix::io::Errno::MFILE | rustix::io::Errno::NFILE => Error::rejected(
                "memfd_create",
                ErrorKind::Other,
                format!(
                    "{e}: the host backend holds one file descriptor per chunk, and the \
                     allocation needs more chunks than the process's descriptor limit \
                     allows (raise `ulimit -n`, or use larger chunks)"
                ),
            ),
            e => os_error("memfd_create", e),
        })?;
    rustix::fs::ftruncate(&fd, size as u64).map_err(|e| os_error("ftruncate", e))?;
    rustix::fs::fcntl_add_seals(&fd, CHUNK_SEALS).map_err(|e| os_error("fcntl", e))?;
    Ok(fd)
}

const CHUNK_SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// Checks that `fd` is a chunk made by [`create_memory`] (in any process)
/// of `size` bytes: a memfd sealed at its size.
pub(super) fn check_chunk_fd(fd: BorrowedFd<'_>, size: usize) -> Result<()> {
    let foreign = |why: String| Error::invalid("import_chunk", why);
    let seals = rustix::fs::fcntl_get_seals(fd)
        .map_err(|e| foreign(format!("the descriptor is not a chunk ({e})")))?;
    if !seals.contains(CHUNK_SEALS) {
        return Err(foreign(format!(
            "the descriptor is not a sealed chunk (seals {seals:?})"
        )));
    }
    let actual = rustix::fs::fstat(fd)
        .map_err(|e| os_error("fstat", e))?
        .st_size;
    if actual != size as i64 {
        return Err(foreign(format!(
            "the chunk has {actual} bytes, not the {size} announced"
        )));
    }
    Ok(())
}

/// Maps the `size`-byte file `fd` at `start`, with no access yet.
pub(super) fn map_shared(start: usize, size: usize, fd: impl AsFd) -> Result<()> {
    // SAFETY: the caller's tables say [start, start + size) lies inside a
    // reservation of ours and holds no mapping, so MAP_FIXED replaces only
    // our own PROT_NONE placeholder; nothing references that memory.
    unsafe {
        rustix::mm::mmap(
            start as *mut _,
            size,
            ProtFlags::empty(),
            MapFlags::SHARED | MapFlags::FIXED,
            fd,
            0,
        )
    }
    .map(drop)
    .map_err(|e| os_error("mmap", e))
}

/// Puts a PROT_NONE placeholder back over [start, start + size), dropping
/// whatever chunks were mapped there but keeping the address space ours.
pub(super) fn unmap_to_placeholder(start: usize, size: usize) -> Result<()> {
    // SAFETY: the caller's tables say the range is ours and that no stream
    // is accessing it (they hold the memory table's write lock).
    unsafe {
        rustix::mm::mmap_anonymous(
            start as *mut _,
            size,
            ProtFlags::empty(),
            MapFlags::PRIVATE | MapFlags::FIXED | MapFlags::NORESERVE,
        )
    }
    .map(drop)
    .map_err(|e| os_error("mmap", e))
}

pub(super) fn protect(start: usize, size: usize, access: Access) -> Result<()> {
    let flags = match access {
        Access::None => MprotectFlags::empty(),
        Access::Read => MprotectFlags::READ,
        Access::ReadWrite => MprotectFlags::READ | MprotectFlags::WRITE,
    };
    // SAFETY: the caller's tables say the range is fully mapped by us and
    // hold the write lock, so no stream is accessing it while it changes.
    unsafe { rustix::mm::mprotect(start as *mut _, size, flags) }
        .map_err(|e| os_error("mprotect", e))
}

/// Writes `count` copies of `value` at `start`.
///
/// # Safety
/// 1. [start, start + 4 * count) is mapped readable and writable, and stays so
///    for the duration of the call (the caller holds the read lock that
///    unmap and set-access need for writing).
/// 2. `start` is 4-byte aligned.
#[cfg(feature = "testing")]
pub(super) unsafe fn fill_u32(start: usize, count: usize, value: u32) {
    use std::sync::atomic::{AtomicU32, Ordering};
    // Device memory may be written by several streams at once when the
    // program forgets to order them (a bug on a GPU, undefined behaviour in
    // Rust): atomic accesses keep that a bug and not UB here.
    for i in 0..count {
        // SAFETY: by 1 and 2 the word is mapped, writable and aligned, and it
        // is only ever accessed atomically.
        let word = unsafe { AtomicU32::from_ptr((start as *mut u32).add(i)) };
        word.store(value, Ordering::Relaxed);
    }
}

/// Reads `dst.len()` bytes from `start`, a 4-byte word at a time.
///
/// # Safety
/// 1. [start, start + dst.len()) is mapped readable and stays so for the
///    duration of the call.
/// 2. `start` is 4-byte aligned.
pub(super) unsafe fn read(start: usize, dst: &mut [u8]) {
    use std::sync::atomic::{AtomicU32, Ordering};
    let words = dst.len().div_ceil(4);
    for (i, out) in dst.chunks_mut(4).enumerate().take(words) {
        // SAFETY: by 1 and 2 the word is mapped, readable and aligned; a
        // partial last word is still inside the mapping because mappings are
        // whole pages and `start` is word aligned.
        let word = unsafe { AtomicU32::from_ptr((start as *mut u32).add(i)) };
        out.copy_from_slice(&word.load(Ordering::Relaxed).to_ne_bytes()[..out.len()]);
    }
}

/// Writes `src` at `start`, a 4-byte word at a time.
///
/// # Safety
/// 1. [start, start + src.len()) is mapped readable and writable and stays
///    so for the duration of the call.
/// 2. `start` is 4-byte aligned.
pub(super) unsafe fn write(start: usize, src: &[u8]) {
    use std::sync::atomic::{AtomicU32, Ordering};
    for (i, bytes) in src.chunks(4).enumerate() {
        // SAFETY: by 1 and 2 the word is mapped, writable and aligned; a
        // partial last word is still inside the mapping because mappings are
        // whole pages and `start` is word aligned. Atomic, as in `read`.
        let word = unsafe { AtomicU32::from_ptr((start as *mut u32).add(i)) };
        if bytes.len() == 4 {
            word.store(
                u32::from_ne_bytes(bytes.try_into().expect("4 bytes")),
                Ordering::Relaxed,
            );
        } else {
            let mut now = word.load(Ordering::Relaxed).to_ne_bytes();
            now[..bytes.len()].copy_from_slice(bytes);
            word.store(u32::from_ne_bytes(now), Ordering::Relaxed);
        }
    }
}

/// Lets the process hold one file descriptor per chunk: a pool of 2 MiB
/// chunks over a few GiB needs thousands.
pub(super) fn raise_fd_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        let raised = rustix::process::Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        if let Err(err) = setrlimit(Resource::Nofile, raised) {
            tracing::warn!(%err, "could not raise the open-file limit");
        }
    }
}
