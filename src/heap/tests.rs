//! The heap's tests: each operation checked against a recount of the
//! blocks, and random sequences against a per-quantum model.

use super::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, HashSet};

impl Heap {
    /// Recounts everything from the blocks and compares.
    fn check(&self) {
        let unused: HashSet<u32> = self.unused_slots.iter().copied().collect();
        let mut free_sum = 0;
        let mut listed = HashSet::new();
        self.for_each_free(|_, size, id| {
            free_sum += size;
            assert!(listed.insert(id.0), "block listed twice");
        });
        assert_eq!(free_sum, self.free_bytes, "free bytes");
        for (i, b) in self.blocks.iter().enumerate() {
            let i = i as u32;
            if unused.contains(&i) {
                continue;
            }
            assert_eq!(b.free, listed.contains(&i), "free flag vs free lists");
            let (fl, sl) = bin_of(b.size / QUANTUM);
            if b.free {
                assert!(self.fl_bitmap & (1 << fl) != 0 && self.sl_bitmaps[fl] & (1 << sl) != 0);
            }
            match b.next_phys {
                NONE => assert_eq!(self.region_ends.get(&(b.addr + b.size)), Some(&i)),
                n => {
                    let n = &self.blocks[n as usize];
                    assert_eq!(n.prev_phys, i);
                    assert_eq!(n.addr, b.addr + b.size, "neighbours not adjacent");
                    assert!(!(b.free && n.free), "two free neighbours not merged");
                }
            }
            if b.prev_phys == NONE {
                assert_eq!(self.region_starts.get(&b.addr), Some(&i));
            }
        }
        for (&end, &id) in &self.region_ends {
            let b = &self.blocks[id as usize];
            assert!(!unused.contains(&id) && b.addr + b.size == end && b.next_phys == NONE);
        }
        for (&start, &id) in &self.region_starts {
            let b = &self.blocks[id as usize];
            assert!(!unused.contains(&id) && b.addr == start && b.prev_phys == NONE);
        }
    }
}

#[test]
fn bins_are_ordered_and_bounded() {
    let mut last = (0, 0);
    for q in 1..100_000u64 {
        let bin = bin_of(q);
        assert!(bin >= last, "bins must grow with size");
        last = bin;
        let (fl, sl) = bin_at_least(q).unwrap();
        // Every size in that bin is >= q: its smallest member is.
        let smallest = if fl == 0 {
            sl as u64
        } else {
            ((SL_COUNT + sl) as u64) << (fl - 1)
        };
        assert!(smallest >= q, "q {q}: bin ({fl},{sl}) starts at {smallest}");
    }
}

#[test]
fn a_used_block_splits_and_its_parts_free_on_their_own() {
    let q = QUANTUM;
    let mut h = Heap::new();
    h.insert_free(0, 64 * q);
    let (at, whole) = h.alloc(48 * q).unwrap();
    assert_eq!(at, 0);
    let middle = h.split(whole, 16 * q);
    let right = h.split(middle, 32 * q);
    h.check();
    // The outer parts go back: they join the free tail, not the middle.
    h.free(whole);
    h.free(right);
    h.check();
    assert_eq!(h.free_bytes(), 48 * q);
    assert_eq!(h.largest_free(), 32 * q);
    h.free(middle);
    h.check();
    assert_eq!(h.largest_free(), 64 * q);
}

#[test]
fn adjacent_ranges_join_and_split() {
    let q = QUANTUM;
    let mut h = Heap::new();
    h.insert_free(0, 4 * q);
    h.insert_free(8 * q, 4 * q);
    h.insert_free(4 * q, 4 * q); // fills the gap: one region of 12
    h.check();
    assert_eq!(h.largest_free(), 12 * q);
    let (_, id) = h.alloc(12 * q).unwrap();
    assert!(h.alloc(q).is_none());
    let free = h.free(id);
    h.take(free, 4 * q, 2 * q);
    h.check();
    assert_eq!(h.free_bytes(), 10 * q);
    assert_eq!(h.largest_free(), 6 * q);
}

#[derive(Debug, Clone)]
enum Op {
    Insert(u64),
    Alloc(u64),
    Free(usize),
    Take(usize, u64, u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1..64u64).prop_map(Op::Insert),
        (1..48u64).prop_map(Op::Alloc),
        any::<usize>().prop_map(Op::Free),
        (any::<usize>(), 0..32u64, 1..16u64).prop_map(|(i, a, b)| Op::Take(i, a, b)),
    ]
}

proptest! {
    /// Against a model: a map of every quantum's state.
    #[test]
    fn matches_a_model(ops in proptest::collection::vec(op(), 1..200), gaps in proptest::collection::vec(0..3u64, 200)) {
        let q = QUANTUM;
        let mut h = Heap::new();
        // quantum index -> Some(true) used, Some(false) free; absent: not in heap.
        let mut model: BTreeMap<u64, bool> = BTreeMap::new();
        let mut live: Vec<(u64, u64, BlockId)> = Vec::new();
        let mut next = 0u64;
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                Op::Insert(n) => {
                    // Sometimes adjacent to the previous range, sometimes not.
                    next += gaps[i % gaps.len()] * 7;
                    h.insert_free(next * q, n * q);
                    for k in next..next + n { model.insert(k, false); }
                    next += n;
                }
                Op::Alloc(n) => {
                    let largest_free_run = {
                        let (mut best, mut run, mut prev) = (0, 0, None);
                        for (&k, &used) in &model {
                            run = if !used && prev == Some(k.wrapping_sub(1)) { run + 1 } else if !used { 1 } else { 0 };
                            best = best.max(run);
                            prev = if used { None } else { Some(k) };
                        }
                        best
                    };
                    prop_assert_eq!(h.largest_free(), largest_free_run * q);
                    match h.alloc(n * q) {
                        Some((addr, id)) => {
                            for k in addr / q..addr / q + n {
                                prop_assert_eq!(model.insert(k, true), Some(false), "allocated a non-free quantum");
                            }
                            live.push((addr, n, id));
                        }
                        None => prop_assert!(largest_free_run < n, "refused {} with a free run of {}", n, largest_free_run),
                    }
                }
                Op::Free(i) if !live.is_empty() => {
                    let (addr, n, id) = live.swap_remove(i % live.len());
                    h.free(id);
                    for k in addr / q..addr / q + n { model.insert(k, false); }
                }
                Op::Take(i, off, len) => {
                    let mut blocks = Vec::new();
                    h.for_each_free(|a, s, id| blocks.push((a, s, id)));
                    if blocks.is_empty() { continue; }
                    blocks.sort_by_key(|b| b.0);
                    let (a, s, id) = blocks[i % blocks.len()];
                    let off = off.min(s / q - 1);
                    let len = len.min(s / q - off);
                    h.take(id, a + off * q, len * q);
                    for k in a / q + off..a / q + off + len { prop_assert_eq!(model.remove(&k), Some(false)); }
                }
                Op::Free(_) => {}
            }
            h.check();
            let free = model.values().filter(|u| !**u).count() as u64;
            prop_assert_eq!(h.free_bytes(), free * q);
            // The regions are the runs of quanta in the heap.
            let mut runs: Vec<(u64, u64)> = Vec::new();
            for &k in model.keys() {
                match runs.last_mut() {
                    Some((start, len)) if *start + *len == k * q => *len += q,
                    _ => runs.push((k * q, q)),
                }
            }
            prop_assert_eq!(h.regions(), runs);
            // The used ranges are the runs of used quanta.
            let mut used: Vec<(u64, u64)> = Vec::new();
            for (&k, _) in model.iter().filter(|(_, u)| **u) {
                match used.last_mut() {
                    Some((start, len)) if *start + *len == k * q => *len += q,
                    _ => used.push((k * q, q)),
                }
            }
            prop_assert_eq!(h.used_ranges(), used);
        }
    }
}
