//! A bounded record of what the allocator did, for PyTorch's memory
//! snapshots (`vmpool.torch.record_history` and `dump_snapshot`, read by
//! `torch.cuda._memory_viz` and the memory_viz page): allocations, frees,
//! refusals for want of memory, and the mapping and unmapping of the
//! pool's units (PyTorch's segments) that they, a trim or a defragmenting
//! remap caused. Off by default; while off, a call pays one relaxed load.
//!
//! The units are compared only when the pool's map and unmap counts moved,
//! so recording costs little beyond the entries themselves. Allocations
//! made before recording started show in a dump as used bytes of no known
//! allocation.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use vmpool::vmm::Backend;

use crate::shim::Shim;

/// What an entry records: PyTorch's trace actions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Alloc,
    FreeRequested,
    FreeCompleted,
    SegmentMap,
    SegmentUnmap,
    Oom,
}

impl Action {
    /// The name PyTorch's snapshots give it.
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
        }
    }
}

/// One recorded event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub action: Action,
    pub device: i64,
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    pub time_us: u64,
}

/// What recording knows of one device: its pool's map and unmap count and
/// mapped units when last looked at, and the allocations made since
/// recording started and not freed (address to size and stream).
#[derive(Debug, Default)]
struct Seen {
    map_calls: u64,
    units: BTreeSet<(u64, u64)>,
    live: BTreeMap<u64, (u64, u64)>,
}

#[derive(Debug)]
struct Inner {
    max_entries: usize,
    entries: VecDeque<Entry>,
    devices: BTreeMap<i64, Seen>,
}

/// The record: a ring of at most `max_entries` entries.
#[derive(Debug)]
pub struct History {
    on: AtomicBool,
    inner: Mutex<Inner>,
}

impl Default for History {
    fn default() -> Self {
        Self::new()
    }
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

impl History {
    pub const fn new() -> Self {
        Self {
            on: AtomicBool::new(false),
            inner: Mutex::new(Inner {
                max_entries: 0,
                entries: VecDeque::new(),
                devices: BTreeMap::new(),
            }),
        }
    }

    /// Whether calls are being recorded.
    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts recording afresh, keeping the last `max_entries` entries;
    /// the units of devices `0..devices` as they are now are the start.
    pub fn start<B: Backend>(&self, shim: &Shim<B>, max_entries: usize, devices: i64) {
        let mut inner = self.lock();
        inner.max_entries = max_entries.max(1);
        inner.entries.clear();
        inner.devices.clear();
        for device in 0..devices {
            let mut seen = Seen::default();
            look(&mut seen, shim, device, &mut Vec::new());
            inner.devices.insert(device, seen);
        }
        self.on.store(true, Ordering::Relaxed);
    }

    /// Stops recording; what was recorded stays for [`History::to_json`].
    pub fn stop(&self) {
        self.on.store(false, Ordering::Relaxed);
    }

    /// Records an allocation (`addr` 0 for a refusal of `size` > 0 bytes),
    /// after the units it mapped.
    pub fn allocated<B: Backend>(
        &self,
        shim: &Shim<B>,
        device: i64,
        addr: u64,
        size: u64,
        stream: u64,
    ) {
        let action = match (addr, size) {
            (_, 0) => return,
            (0, _) => Action::Oom,
            _ => Action::Alloc,
        };
        self.record(shim, device, |seen, at| {
            if action == Action::Alloc {
                seen.live.insert(addr, (size, stream));
            }
            vec![entry(action, device, addr, size, stream, at)]
        });
    }

    /// Records a free: requested and, as vmpool's stream-ordered frees
    /// complete in stream order with no further call, completed.
    pub fn freed<B: Backend>(
        &self,
        shim: &Shim<B>,
        device: i64,
        addr: u64,
        size: i64,
        stream: u64,
    ) {
        if addr == 0 {
            return;
        }
        self.record(shim, device, |seen, at| {
            let known = seen.live.remove(&addr).map(|(size, _)| size);
            let size = known.or(u64::try_from(size).ok()).unwrap_or(0);
            [Action::FreeRequested, Action::FreeCompleted]
                .map(|action| entry(action, device, addr, size, stream, at))
                .to_vec()
        });
    }

    /// Records the units a trim, a synchronize or `empty_cache` unmapped
    /// on `device`.
    pub fn remapped<B: Backend>(&self, shim: &Shim<B>, device: i64) {
        self.record(shim, device, |_, _| Vec::new());
    }

    /// The devices recording has seen.
    pub fn devices(&self) -> Vec<i64> {
        self.lock().devices.keys().copied().collect()
    }

    fn record<B: Backend>(
        &self,
        shim: &Shim<B>,
        device: i64,
        event: impl FnOnce(&mut Seen, u64) -> Vec<Entry>,
    ) {
        if !self.is_on() {
            return;
        }
        let mut inner = self.lock();
        let mut new = Vec::new();
        let seen = inner.devices.entry(device).or_default();
        look(seen, shim, device, &mut new);
        new.extend(event(seen, now_us()));
        for e in new {
            if inner.entries.len() == inner.max_entries {
                inner.entries.pop_front();
            }
            inner.entries.push_back(e);
        }
    }

    /// The record and the devices' pools as JSON: `devices`, for each of
    /// `0..devices` with a pool, its `units` and `free` ranges
    /// (`[address, bytes]`) and the `live` allocations recording saw
    /// (`[address, bytes, stream]`); `entries`, oldest first, each
    /// `[action, device, address, bytes, stream, time_us]`.
    pub fn to_json<B: Backend>(&self, shim: &Shim<B>, devices: i64) -> String {
        let inner = self.lock();
        let mut out = String::from("{\"devices\": [");
        let mut first = true;
        for device in 0..devices {
            let Ok(Some(picture)) = shim.pool_snapshot(device) else {
                continue;
            };
            if !first {
                out.push_str(", ");
            }
            first = false;
            let pairs = |list: &mut dyn Iterator<Item = (u64, u64)>| {
                list.map(|(a, b)| format!("[{a}, {b}]"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let units = pairs(&mut picture.units.iter().map(|u| (u.va, u.size)));
            let free = pairs(&mut picture.free.iter().copied());
            let live = inner.devices.get(&device).map_or(String::new(), |seen| {
                let list = seen.live.iter();
                list.map(|(a, (s, st))| format!("[{a}, {s}, {st}]"))
                    .collect::<Vec<_>>()
                    .join(", ")
            });
            let _ = write!(
                out,
                "{{\"device\": {device}, \"units\": [{units}], \"free\": [{free}], \"live\": [{live}]}}"
            );
        }
        out.push_str("], \"entries\": [");
        for (i, e) in inner.entries.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            let _ = write!(
                out,
                "{sep}[\"{}\", {}, {}, {}, {}, {}]",
                e.action.name(),
                e.device,
                e.addr,
                e.size,
                e.stream,
                e.time_us
            );
        }
        out.push_str("]}");
        out
    }
}

fn entry(action: Action, device: i64, addr: u64, size: u64, stream: u64, time_us: u64) -> Entry {
    Entry {
        action,
        device,
        addr,
        size,
        stream,
        time_us,
    }
}

/// Compares `device`'s mapped units with what `seen` last saw, when its
/// pool has mapped or unmapped since, and adds the difference to `out`:
/// unmaps first, then maps (a remap is both).
fn look<B: Backend>(seen: &mut Seen, shim: &Shim<B>, device: i64, out: &mut Vec<Entry>) {
    let Ok(figures) = shim.figures(device) else {
        return;
    };
    let calls = figures.stats.maps + figures.stats.unmaps;
    if calls == seen.map_calls {
        return;
    }
    seen.map_calls = calls;
    let units: BTreeSet<(u64, u64)> = match shim.pool_snapshot(device) {
        Ok(Some(picture)) => picture.units.iter().map(|u| (u.va, u.size)).collect(),
        _ => BTreeSet::new(),
    };
    let at = now_us();
    for &(va, size) in seen.units.difference(&units) {
        out.push(entry(Action::SegmentUnmap, device, va, size, 0, at));
    }
    for &(va, size) in units.difference(&seen.units) {
        out.push(entry(Action::SegmentMap, device, va, size, 0, at));
    }
    seen.units = units;
}
