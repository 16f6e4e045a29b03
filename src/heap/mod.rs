//! The free-space heap: a two-level segregated fit (TLSF) over the pool's
//! mapped address ranges.
//!
//! ```text
//!   address order:  [used ][free     ][used][free][used    ]   [free   ][used]
//!                    \______ one mapped region _____________/   \_ another _/
//!   bins:  fl = log2(size), sl = next 4 bits  ->  free lists, found by bitmap
//! ```
//!
//! Blocks live in a `Vec` and link to their neighbours by index (physical
//! neighbours in address order, and the free list of their bin), as in
//! offset-allocator. Allocation and free are O(1): a bitmap search, a split,
//! a merge with free neighbours. Unlike a fixed-size TLSF, regions come and
//! go: the pool adds newly mapped ranges ([`Heap::insert_free`]) and takes
//! free ranges out when it unmaps them ([`Heap::take`]); a range added next
//! to an existing one joins it, so free space coalesces across mappings.
//!
//! Every size and address is a multiple of [`QUANTUM`] (the pool's minimum
//! alignment), checked at the boundary.

use std::collections::HashMap;

/// Minimum alignment and size unit of every block: 256 bytes, as CUDA's.
pub const QUANTUM: u64 = 256;

const SL_BITS: u32 = 4;
const SL_COUNT: usize = 1 << SL_BITS;
const FL_COUNT: usize = 64 - SL_BITS as usize;
const NONE: u32 = u32::MAX;

/// Index of a block; stays valid while the block is allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockId(u32);

impl BlockId {
    /// The block of an allocation served from a step layout, which no
    /// heap holds (Note [Step layouts] in docs/DESIGN.md): a heap given it
    /// panics.
    pub(crate) const PLANNED: BlockId = BlockId(NONE);
}

#[derive(Debug, Clone)]
struct Block {
    addr: u64,
    size: u64,
    free: bool,
    /// Physical neighbours in address order (NONE at a region edge).
    prev_phys: u32,
    next_phys: u32,
    /// Free-list links within the block's bin (meaningful while free).
    prev_free: u32,
    next_free: u32,
}

/// Bin of a size in quanta: (first level, second level).
fn bin_of(quanta: u64) -> (usize, usize) {
    let log = 63 - quanta.leading_zeros();
    if log < SL_BITS {
        (0, quanta as usize)
    } else {
        let fl = (log - SL_BITS + 1) as usize;
        let sl = ((quanta >> (log - SL_BITS)) as usize) ^ SL_COUNT;
        (fl, sl)
    }
}

/// The smallest bin all of whose blocks are at least `quanta` long.
fn bin_at_least(quanta: u64) -> Option<(usize, usize)> {
    let log = 63 - quanta.leading_zeros();
    let rounded = if log < SL_BITS {
        quanta
    } else {
        quanta.checked_add((1 << (log - SL_BITS)) - 1)?
    };
    Some(bin_of(rounded))
}

pub struct Heap {
    blocks: Vec<Block>,
    unused_slots: Vec<u32>,
    fl_bitmap: u64,
    sl_bitmaps: [u32; FL_COUNT],
    heads: Vec<[u32; SL_COUNT]>,
    /// Blocks at the start / end of a region, by their start / end address,
    /// so that a range inserted next to a region can join it.
    region_starts: HashMap<u64, u32>,
    region_ends: HashMap<u64, u32>,
    free_bytes: u64,
}

impl Heap {
    pub fn new() -> Self {
        Self {
            blocks: Vec::new(),
            unused_slots: Vec::new(),
            fl_bitmap: 0,
            sl_bitmaps: [0; FL_COUNT],
            heads: vec![[NONE; SL_COUNT]; FL_COUNT],
            region_starts: HashMap::new(),
            region_ends: HashMap::new(),
            free_bytes: 0,
        }
    }

    /// Bytes in free blocks.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Adds [addr, addr + size) as free space, joining any region that ends
    /// at `addr` or starts at `addr + size`. Returns the free block that now
    /// holds the range (merged with free neighbours).
    pub fn insert_free(&mut self, addr: u64, size: u64) -> BlockId {
        assert!(
            size > 0 && addr % QUANTUM == 0 && size % QUANTUM == 0,
            "unaligned range"
        );
        let end = addr + size;
        let prev = self.region_ends.remove(&addr).unwrap_or(NONE);
        let next = self.region_starts.remove(&end).unwrap_or(NONE);
        let id = self.new_block(Block {
            addr,
            size,
            free: false,
            prev_phys: prev,
            next_phys: next,
            prev_free: NONE,
            next_free: NONE,
        });
        match prev {
            NONE => {
                self.region_starts.insert(addr, id);
            }
            p => self.blocks[p as usize].next_phys = id,
        }
        match next {
            NONE => {
                self.region_ends.insert(end, id);
            }
            n => self.blocks[n as usize].prev_phys = id,
        }
        BlockId(self.release(id))
    }

    /// Allocates `size` bytes (a multiple of the quantum): the best block of
    /// the request's own bin when one fits, else any block of the first bin
    /// that surely fits, else any fitting block at all. `None` when no free block is large enough.
    pub fn alloc(&mut self, size: u64) -> Option<(u64, BlockId)> {
        debug_assert!(size > 0 && size % QUANTUM == 0);
        let id = self
            .fit_in_own_bin(size, 8)
            .or_else(|| self.first_fitting_bin(size))
            .or_else(|| self.fit_in_own_bin(size, usize::MAX))?;
        Some((self.blocks[id as usize].addr, BlockId(self.carve(id, size))))
    }

    /// Allocates `size` bytes at the start of the free block `id`, which
    /// must be free and large enough.
    pub fn alloc_from(&mut self, id: BlockId, size: u64) -> (u64, BlockId) {
        let b = &self.blocks[id.0 as usize];
        assert!(b.free && b.size >= size, "block cannot hold the request");
        (b.addr, BlockId(self.carve(id.0, size)))
    }

    /// Frees an allocated block, merging it with free neighbours; returns
    /// the free block that now holds it.
    pub fn free(&mut self, id: BlockId) -> BlockId {
        assert!(!self.blocks[id.0 as usize].free, "double free of a block");
        BlockId(self.release(id.0))
    }

    /// Splits the used block `id` at `addr`, inside it: `id` keeps the part
    /// before, the used block returned holds the rest. Each part is then
    /// freed on its own.
    pub fn split(&mut self, id: BlockId, addr: u64) -> BlockId {
        let b = self.blocks[id.0 as usize].clone();
        let end = b.addr + b.size;
        assert!(
            !b.free && addr > b.addr && addr < end && addr % QUANTUM == 0,
            "a used block splits inside itself, on the quantum"
        );
        let right = self.new_block(Block {
            addr,
            size: end - addr,
            free: false,
            prev_phys: id.0,
            next_phys: b.next_phys,
            prev_free: NONE,
            next_free: NONE,
        });
        let left = &mut self.blocks[id.0 as usize];
        left.size = addr - b.addr;
        left.next_phys = right;
        match b.next_phys {
            NONE => {
                self.region_ends.insert(end, right);
            }
            n => self.blocks[n as usize].prev_phys = right,
        }
        BlockId(right)
    }

    /// Removes [addr, addr + size) from the free block `id` (which must hold
    /// all of it): the range leaves the heap, splitting its region in two.
    pub fn take(&mut self, id: BlockId, addr: u64, size: u64) {
        let id = id.0;
        let b = self.blocks[id as usize].clone();
        let (b_end, end) = (b.addr + b.size, addr + size);
        assert!(
            b.free && size > 0 && addr >= b.addr && end <= b_end,
            "range is not inside the free block"
        );
        self.unlink_free(id);
        self.free_bytes -= b.size;
        // The free block's neighbours are used (free ones would have been
        // merged), so the remainders go back without merging.
        if addr > b.addr {
            let left = &mut self.blocks[id as usize];
            left.size = addr - b.addr;
            left.next_phys = NONE;
            self.region_ends.insert(addr, id);
            self.mark_free(id);
        } else {
            match b.prev_phys {
                NONE => {
                    self.region_starts.remove(&b.addr);
                }
                p => {
                    self.blocks[p as usize].next_phys = NONE;
                    self.region_ends.insert(addr, p);
                }
            }
            self.unused_slots.push(id);
        }
        if end < b_end {
            let right = self.new_block(Block {
                addr: end,
                size: b_end - end,
                free: false,
                prev_phys: NONE,
                next_phys: b.next_phys,
                prev_free: NONE,
                next_free: NONE,
            });
            self.region_starts.insert(end, right);
            match b.next_phys {
                NONE => {
                    self.region_ends.insert(b_end, right);
                }
                n => self.blocks[n as usize].prev_phys = right,
            }
            self.mark_free(right);
        } else {
            match b.next_phys {
                NONE => {
                    self.region_ends.remove(&b_end);
                }
                n => {
                    self.blocks[n as usize].prev_phys = NONE;
                    self.region_starts.insert(end, n);
                }
            }
        }
    }

    /// Calls `f(addr, size, id)` for every free block, in no particular order.
    pub fn for_each_free(&self, mut f: impl FnMut(u64, u64, BlockId)) {
        let mut fl_bits = self.fl_bitmap;
        while fl_bits != 0 {
            let fl = fl_bits.trailing_zeros() as usize;
            fl_bits &= fl_bits - 1;
            let mut sl_bits = self.sl_bitmaps[fl];
            while sl_bits != 0 {
                let sl = sl_bits.trailing_zeros() as usize;
                sl_bits &= sl_bits - 1;
                let mut at = self.heads[fl][sl];
                while at != NONE {
                    let b = &self.blocks[at as usize];
                    f(b.addr, b.size, BlockId(at));
                    at = b.next_free;
                }
            }
        }
    }

    /// The allocated ranges, adjacent blocks joined, as (start, length) in
    /// address order.
    pub fn used_ranges(&self) -> Vec<(u64, u64)> {
        let mut used: Vec<(u64, u64)> = Vec::new();
        for (addr, size) in self.used_blocks() {
            match used.last_mut() {
                Some((start, len)) if *start + *len == addr => *len += size,
                _ => used.push((addr, size)),
            }
        }
        used
    }

    /// The allocated blocks, one by one, as (start, length) in address
    /// order.
    pub fn used_blocks(&self) -> Vec<(u64, u64)> {
        let mut starts: Vec<u32> = self.region_starts.values().copied().collect();
        starts.sort_unstable_by_key(|&id| self.blocks[id as usize].addr);
        let mut used = Vec::new();
        for first in starts {
            let mut at = first;
            while at != NONE {
                let b = &self.blocks[at as usize];
                if !b.free {
                    used.push((b.addr, b.size));
                }
                at = b.next_phys;
            }
        }
        used
    }

    /// The largest free block's size (0 when there is none).
    pub fn largest_free(&self) -> u64 {
        if self.fl_bitmap == 0 {
            return 0;
        }
        let fl = 63 - self.fl_bitmap.leading_zeros() as usize;
        let sl = 31 - self.sl_bitmaps[fl].leading_zeros() as usize;
        let mut best = 0;
        let mut at = self.heads[fl][sl];
        while at != NONE {
            best = best.max(self.blocks[at as usize].size);
            at = self.blocks[at as usize].next_free;
        }
        best
    }

    /// The regions, the contiguous ranges added by [`Heap::insert_free`] and
    /// not taken out since, as (start, length) in address order.
    pub fn regions(&self) -> Vec<(u64, u64)> {
        let mut starts: Vec<u64> = self.region_starts.keys().copied().collect();
        let mut ends: Vec<u64> = self.region_ends.keys().copied().collect();
        starts.sort_unstable();
        ends.sort_unstable();
        // Regions do not overlap, so the n-th start goes with the n-th end.
        debug_assert_eq!(starts.len(), ends.len());
        starts
            .into_iter()
            .zip(ends)
            .map(|(start, end)| (start, end - start))
            .collect()
    }

    /// Every region whose first block is free: its start and that block's
    /// size.
    pub fn free_region_heads(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.region_starts.values().filter_map(|&id| {
            let b = &self.blocks[id as usize];
            b.free.then_some((b.addr, b.size))
        })
    }

    /// Every region's end address whose last block is free, with that block.
    pub fn free_region_tails(&self) -> impl Iterator<Item = (u64, u64, BlockId)> + '_ {
        self.region_ends.values().filter_map(|&id| {
            let b = &self.blocks[id as usize];
            b.free.then_some((b.addr, b.size, BlockId(id)))
        })
    }

    // ---- internals -------------------------------------------------------

    fn new_block(&mut self, block: Block) -> u32 {
        match self.unused_slots.pop() {
            Some(slot) => {
                self.blocks[slot as usize] = block;
                slot
            }
            None => {
                self.blocks.push(block);
                u32::try_from(self.blocks.len() - 1).expect("fewer than 2^32 blocks")
            }
        }
    }

    /// The tightest fit among the first `scan` blocks of the request's bin.
    fn fit_in_own_bin(&self, size: u64, scan: usize) -> Option<u32> {
        let (fl, sl) = bin_of(size / QUANTUM);
        let mut at = self.heads[fl][sl];
        let mut best: Option<(u64, u32)> = None;
        // Blocks of one bin differ by at most 1/16 of their size: a short
        // scan usually finds a tight fit, a full one only as a last resort
        // before the pool would grow.
        for _ in 0..scan {
            if at == NONE {
                break;
            }
            let b = &self.blocks[at as usize];
            if b.size >= size && best.is_none_or(|(s, _)| b.size < s) {
                best = Some((b.size, at));
                if b.size == size {
                    break;
                }
            }
            at = b.next_free;
        }
        best.map(|(_, id)| id)
    }

    fn first_fitting_bin(&self, size: u64) -> Option<u32> {
        let (fl, sl) = bin_at_least(size / QUANTUM)?;
        if fl >= FL_COUNT {
            return None;
        }
        let sl_here = self.sl_bitmaps[fl] & (!0u32).checked_shl(sl as u32).unwrap_or(0);
        let (fl, sl) = if sl_here != 0 {
            (fl, sl_here.trailing_zeros() as usize)
        } else {
            let fl_above = self.fl_bitmap & (!0u64).checked_shl(fl as u32 + 1).unwrap_or(0);
            if fl_above == 0 {
                return None;
            }
            let fl = fl_above.trailing_zeros() as usize;
            (fl, self.sl_bitmaps[fl].trailing_zeros() as usize)
        };
        Some(self.heads[fl][sl])
    }

    /// Marks free block `id` used for its first `size` bytes, returning the
    /// rest (if any) to the heap as a new free block.
    fn carve(&mut self, id: u32, size: u64) -> u32 {
        self.unlink_free(id);
        let b = &mut self.blocks[id as usize];
        b.free = false;
        self.free_bytes -= b.size;
        let rest = b.size - size;
        if rest > 0 {
            b.size = size;
            let (addr, next) = (b.addr + size, b.next_phys);
            let r = self.new_block(Block {
                addr,
                size: rest,
                free: false,
                prev_phys: id,
                next_phys: next,
                prev_free: NONE,
                next_free: NONE,
            });
            self.blocks[id as usize].next_phys = r;
            if next == NONE {
                self.region_ends.insert(addr + rest, r);
            } else {
                self.blocks[next as usize].prev_phys = r;
            }
            self.release(r);
        }
        id
    }

    /// Makes used block `id` free, merging it with free neighbours.
    fn release(&mut self, mut id: u32) -> u32 {
        self.free_bytes += self.blocks[id as usize].size;
        let prev = self.blocks[id as usize].prev_phys;
        if prev != NONE && self.blocks[prev as usize].free {
            self.unlink_free(prev);
            self.absorb_next(prev);
            id = prev;
        }
        let next = self.blocks[id as usize].next_phys;
        if next != NONE && self.blocks[next as usize].free {
            self.unlink_free(next);
            self.absorb_next(id);
        }
        self.blocks[id as usize].free = true;
        self.link_free(id);
        id
    }

    /// Merges the block after `id` into `id`.
    fn absorb_next(&mut self, id: u32) {
        let next = self.blocks[id as usize].next_phys;
        let n = self.blocks[next as usize].clone();
        let b = &mut self.blocks[id as usize];
        b.size += n.size;
        b.next_phys = n.next_phys;
        if n.next_phys == NONE {
            self.region_ends.insert(n.addr + n.size, id);
        } else {
            self.blocks[n.next_phys as usize].prev_phys = id;
        }
        self.unused_slots.push(next);
    }

    /// Makes a used block free without merging (its neighbours are used).
    fn mark_free(&mut self, id: u32) {
        self.free_bytes += self.blocks[id as usize].size;
        self.blocks[id as usize].free = true;
        self.link_free(id);
    }

    fn link_free(&mut self, id: u32) {
        let (fl, sl) = bin_of(self.blocks[id as usize].size / QUANTUM);
        let head = self.heads[fl][sl];
        {
            let b = &mut self.blocks[id as usize];
            b.prev_free = NONE;
            b.next_free = head;
        }
        if head != NONE {
            self.blocks[head as usize].prev_free = id;
        }
        self.heads[fl][sl] = id;
        self.fl_bitmap |= 1 << fl;
        self.sl_bitmaps[fl] |= 1 << sl;
    }

    fn unlink_free(&mut self, id: u32) {
        let b = &self.blocks[id as usize];
        let (prev, next) = (b.prev_free, b.next_free);
        let (fl, sl) = bin_of(b.size / QUANTUM);
        if prev != NONE {
            self.blocks[prev as usize].next_free = next;
        } else {
            self.heads[fl][sl] = next;
            if next == NONE {
                self.sl_bitmaps[fl] &= !(1 << sl);
                if self.sl_bitmaps[fl] == 0 {
                    self.fl_bitmap &= !(1 << fl);
                }
            }
        }
        if next != NONE {
            self.blocks[next as usize].prev_free = prev;
        }
        self.blocks[id as usize].free = false;
    }
}

#[cfg(test)]
mod tests;
