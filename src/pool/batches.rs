//! How a sleep or a wake cuts its work into batches, and which chunks a
//! wake creates: pure functions of the units and the copies, no driver
//! (Note [Sleep and wake] in docs/DESIGN.md).

use std::ops::Range;

use vmm::HostCopy;

use crate::va::Va;

/// About how many batches a sleep or a wake splits its units into: the
/// driver work on one batch (releasing, or creating and mapping) overlaps
/// the copy of another, so what does not overlap (the first batch mapped,
/// the last released) is about a 32nd of it.
const BATCHES: u64 = 32;

/// The largest batch, in bytes.
const MAX_BATCH: u64 = 1 << 30;

/// A host buffer for `bytes`, in whole granules (so that a sleep a little
/// larger than the last may still fit).
pub(super) fn host_size(bytes: u64, granule: u64) -> u64 {
    bytes.next_multiple_of(granule.max(1))
}

/// `units` (address order) in batches of about `total / BATCHES` bytes, at
/// least a granule and at most [`MAX_BATCH`]: index ranges into `units`.
pub(super) fn batch_units(units: &[(Va, u64)], granule: u64) -> Vec<Range<usize>> {
    let total: u64 = units.iter().map(|&(_, len)| len).sum();
    let target = (total / BATCHES).clamp(granule.max(1), MAX_BATCH);
    let mut batches = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, &(_, len)) in units.iter().enumerate() {
        bytes += len;
        if bytes >= target {
            batches.push(start..i + 1);
            (start, bytes) = (i + 1, 0);
        }
    }
    if start < units.len() {
        batches.push(start..units.len());
    }
    batches
}

/// `copies` split into one list per batch: batch `i` spans the addresses
/// from `starts[i]` to `starts[i + 1]` (the first from 0, the last to the
/// end of the address space), and a copy crossing a boundary is cut there.
pub(super) fn split_copies(copies: &[HostCopy], starts: &[u64]) -> Vec<Vec<HostCopy>> {
    let bounds = starts.get(1..).unwrap_or_default();
    let mut batches = vec![Vec::new(); starts.len().max(1)];
    for c in copies {
        let (mut at, mut host, mut left) = (c.device.0, c.host_offset, c.len as u64);
        let mut b = bounds.partition_point(|&s| s <= at);
        while left > 0 {
            let end = bounds.get(b).copied().unwrap_or(u64::MAX);
            let len = left.min(end - at);
            batches[b].push(HostCopy {
                device: vmm::DevicePtr(at),
                host_offset: host,
                len: len as usize,
            });
            (at, host, left) = (at + len, host + len as usize, left - len);
            b += 1;
        }
    }
    batches
}

/// The address each batch of `units` starts at.
pub(super) fn batch_starts(units: &[(Va, u64)], batches: &[Range<usize>]) -> Vec<u64> {
    batches.iter().map(|b| units[b.start].0 .0).collect()
}

/// The chunks a wake creates for `units` (address order), as (address,
/// size): one per unit, except that adjacent units lying wholly inside one
/// allocated block of `blocks` (address order) are created as one chunk,
/// of at most `cap` bytes (the pool's growth chunk size) unless a single
/// unit is larger. Such units hold live bytes only, all of one
/// allocation: they are freed together, so a larger chunk strands no free
/// memory, and each chunk not created saves its driver calls (create, map,
/// set access, and at the next sleep unmap and release: about 100 us
/// together on the H200, against 38 us to copy 2 MiB).
pub(super) fn wake_chunks(units: &[(Va, u64)], blocks: &[(u64, u64)], cap: u64) -> Vec<(Va, u64)> {
    let mut chunks: Vec<(Va, u64)> = Vec::with_capacity(units.len());
    // The block the last chunk lies wholly inside, if it does.
    let mut last_inside: Option<usize> = None;
    let mut b = 0;
    for &(va, len) in units {
        while b < blocks.len() && blocks[b].0 + blocks[b].1 <= va.0 {
            b += 1;
        }
        let inside = blocks
            .get(b)
            .filter(|&&(start, size)| start <= va.0 && va.0 + len <= start + size)
            .map(|_| b);
        match chunks.last_mut() {
            Some((at, size))
                if inside.is_some()
                    && last_inside == inside
                    && *at + *size == va
                    && *size + len <= cap =>
            {
                *size += len;
            }
            _ => chunks.push((va, len)),
        }
        last_inside = inside;
    }
    chunks
}

/// Takes `[start, end)` out of `copies` (address order, not overlapping),
/// cutting a copy that crosses either end; the parts left keep their
/// places in the host buffer. Returns the bytes taken out.
pub(super) fn cut_copies(copies: &mut Vec<HostCopy>, start: u64, end: u64) -> u64 {
    let first = copies.partition_point(|c| c.device.0 + c.len as u64 <= start);
    let last = first
        + copies[first..]
            .iter()
            .take_while(|c| c.device.0 < end)
            .count();
    let mut left = Vec::new();
    let mut taken = 0;
    for c in &copies[first..last] {
        let (from, to) = (c.device.0, c.device.0 + c.len as u64);
        if from < start {
            left.push(HostCopy {
                len: (start - from) as usize,
                ..*c
            });
        }
        if to > end {
            left.push(HostCopy {
                device: vmm::DevicePtr(end),
                host_offset: c.host_offset + (end - from) as usize,
                len: (to - end) as usize,
            });
        }
        taken += to.min(end) - from.max(start);
    }
    copies.splice(first..last, left);
    taken
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 2 << 20;

    fn copy(at: u64, host: usize, len: usize) -> HostCopy {
        HostCopy {
            device: vmm::DevicePtr(at),
            host_offset: host,
            len,
        }
    }

    #[test]
    fn units_go_in_batches_of_a_32nd() {
        let units: Vec<(Va, u64)> = (0..64).map(|i| (Va(i * G), G)).collect();
        let batches = batch_units(&units, G);
        assert_eq!(batches.len(), 32);
        assert!(batches.iter().all(|b| b.len() == 2));
        // Small: a granule a batch at least.
        assert_eq!(batch_units(&units[..3], G).len(), 3);
        assert!(batch_units(&[], G).is_empty());
        // Uneven units: every unit in one batch, in order.
        let units = [(Va(0), G), (Va(G), 5 * G), (Va(9 * G), G)];
        let batches = batch_units(&units, G);
        assert_eq!(batches, vec![0..1, 1..2, 2..3]);
    }

    #[test]
    fn copies_are_cut_at_batch_starts() {
        let copies = [
            copy(G / 2, 0, 3 * G as usize),
            copy(5 * G, 3 * G as usize, 8),
        ];
        let batches = split_copies(&copies, &[0, G, 2 * G, 4 * G]);
        let g = G as usize;
        assert_eq!(batches[0], vec![copy(G / 2, 0, g / 2)]);
        assert_eq!(batches[1], vec![copy(G, g / 2, g)]);
        assert_eq!(batches[2], vec![copy(2 * G, 3 * g / 2, 3 * g / 2)]);
        assert_eq!(batches[3], vec![copy(5 * G, 3 * g, 8)]);
        // Every byte once.
        let total: usize = batches.iter().flatten().map(|c| c.len).sum();
        assert_eq!(total, 3 * g + 8);
    }

    #[test]
    fn a_range_freed_asleep_is_cut_out_of_the_copies() {
        let copies = vec![
            copy(0, 0, 1000),
            copy(4096, 1000, 500),
            copy(8192, 1500, 300),
        ];
        // Inside one copy: two parts, the second where it was on the host.
        let mut c = copies.clone();
        assert_eq!(cut_copies(&mut c, 256, 512), 256);
        assert_eq!(c[..2], [copy(0, 0, 256), copy(512, 512, 488)]);
        assert_eq!(c[2..], copies[1..]);
        // Across copies and the gaps between them: the ends cut, the middle gone.
        let mut c = copies.clone();
        assert_eq!(cut_copies(&mut c, 768, 8292), 232 + 500 + 100);
        assert_eq!(c, [copy(0, 0, 768), copy(8292, 1600, 200)]);
        // Whole copies, and a range that holds none.
        let mut c = copies.clone();
        assert_eq!(cut_copies(&mut c, 4096, 4596), 500);
        assert_eq!(c, [copies[0], copies[2]]);
        assert_eq!(cut_copies(&mut c, 2000, 4000), 0);
        assert_eq!(c, [copies[0], copies[2]]);
    }

    #[test]
    fn units_inside_one_allocation_come_back_as_one_chunk() {
        let units: Vec<(Va, u64)> = (0..10).map(|i| (Va(i * G), G)).collect();
        // An allocation over units 1..=5 and part of 6, another over 7..=9.
        let blocks = [(G - 256, 5 * G + 512), (7 * G, 3 * G)];
        let chunks = wake_chunks(&units, &blocks, 3 * G);
        assert_eq!(
            chunks,
            vec![
                (Va(0), G),         // partly inside: alone
                (Va(G), 3 * G),     // units 1..=3, up to the cap
                (Va(4 * G), 2 * G), // units 4 and 5
                (Va(6 * G), G),     // partly inside
                (Va(7 * G), 3 * G), // the second allocation
            ]
        );
        // Two allocations side by side are not joined.
        let blocks = [(0, 2 * G), (2 * G, 2 * G)];
        assert_eq!(
            wake_chunks(&units[..4], &blocks, 8 * G),
            vec![(Va(0), 2 * G), (Va(2 * G), 2 * G)]
        );
        // Units that are not adjacent are not joined.
        let units = [(Va(0), G), (Va(3 * G), G)];
        assert_eq!(wake_chunks(&units, &[(0, 8 * G)], 8 * G), units.to_vec());
    }
}
