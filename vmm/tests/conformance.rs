//! The conformance suite: one set of cases written against `TestBackend` (the
//! `Backend` and the work the cases queue), run on the host backend always and
//! on the CUDA backend with `--features gpu-tests` (which fails, not skips,
//! when no CUDA device can be opened).
//!
//! Cases that would poison a CUDA context (a kernel touching memory without
//! access is a sticky illegal-address error) are host-only, at the bottom.

// The package is `vmpool-driver`; the workspace knows it as `vmm`.
extern crate vmpool_driver as vmm;

use std::sync::Arc;
use std::time::{Duration, Instant};

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use vmm::memory::{Chunk, Mapping, Reservation};

use vmm::testing::TestBackend;
use vmm::{Access, AccessDesc, Backend, DeviceId, ErrorKind, EventStatus, Result};

const DEV: DeviceId = DeviceId(0);
/// Long enough that work queued behind it is still pending when checked.
const DELAY: Duration = Duration::from_millis(300);

fn granularity<B: TestBackend>(b: &Arc<B>) -> usize {
    b.granularity(DEV).expect("granularity")
}

fn read_u32s<B: TestBackend>(b: &B, s: &B::Stream, at: vmm::DevicePtr, n: usize) -> Vec<u32> {
    let mut bytes = vec![0u8; n * 4];
    b.copy_to_host(s, at, &mut bytes).expect("copy_to_host");
    bytes
        .chunks_exact(4)
        .map(|w| u32::from_ne_bytes(w.try_into().unwrap()))
        .collect()
}

/// A reservation of `granules` granules with one chunk mapped read-write at
/// its start.
struct Fixture<B: TestBackend> {
    reservation: Arc<Reservation<B>>,
    chunk: Arc<Chunk<B>>,
    mapping: Mapping<B>,
}

fn fixture<B: TestBackend>(b: &Arc<B>, granules: usize) -> Fixture<B> {
    let g = granularity(b);
    let reservation = Reservation::new(b, granules * g, 0).expect("reserve");
    let chunk = Chunk::new(b, DEV, g).expect("create chunk");
    let mapping = Mapping::new(&reservation, 0, &chunk).expect("map");
    mapping
        .set_access(&[AccessDesc::read_write(DEV)])
        .expect("set access");
    Fixture {
        reservation,
        chunk,
        mapping,
    }
}

/// A pipelined copy's callback for batch `i` that fails at batch `stop`.
fn stop_at(stop: usize, i: usize) -> Result<()> {
    if i == stop {
        Err(vmm::Error::Rejected {
            call: "test",
            kind: ErrorKind::Other,
            reason: "stop".into(),
        })
    } else {
        Ok(())
    }
}

fn assert_kind<T: std::fmt::Debug>(result: Result<T>, kind: ErrorKind) {
    match result {
        Err(e) => assert_eq!(e.kind(), kind, "wrong kind of error: {e}"),
        Ok(v) => panic!("expected a {kind} error, got Ok({v:?})"),
    }
}

// ---- devices ---------------------------------------------------------------

pub fn devices_and_granularity<B: TestBackend>(b: &Arc<B>) {
    assert!(b.device_count().unwrap() >= 1);
    let g = granularity(b);
    assert!(g.is_power_of_two() && g >= 4096, "granularity {g}");
    let info = b.mem_info(DEV).unwrap();
    assert!(info.total > 0 && info.free <= info.total, "{info:?}");
    let missing = DeviceId(b.device_count().unwrap());
    assert_kind(b.granularity(missing), ErrorKind::InvalidDevice);
    assert_kind(b.create_chunk(missing, g), ErrorKind::InvalidDevice);
    assert_kind(b.create_stream(missing).map(drop), ErrorKind::InvalidDevice);
    // Every device has a UUID of its own, the same on every call.
    let uuids: Vec<[u8; 16]> = (0..b.device_count().unwrap())
        .map(|d| b.device_uuid(DeviceId(d)).unwrap())
        .collect();
    assert_eq!(b.device_uuid(DEV).unwrap(), uuids[0]);
    assert_ne!(uuids[0], [0; 16]);
    let distinct: std::collections::HashSet<_> = uuids.iter().collect();
    assert_eq!(distinct.len(), uuids.len(), "{uuids:x?}");
    assert_kind(b.device_uuid(missing), ErrorKind::InvalidDevice);
}

// ---- address space ---------------------------------------------------------

pub fn reserve_alignment<B: TestBackend>(b: &Arc<B>) {
    let g = granularity(b);
    let r = Reservation::new(b, 8 * g, 0).unwrap();
    assert!(r.base().is_aligned(g), "{:?} not aligned to {g}", r.base());
    let big = 512 * g; // 1 GiB with 2 MiB granules
    let r = Reservation::new(b, g, big).unwrap();
    assert!(
        r.base().is_aligned(big),
        "{:?} not aligned to {big}",
        r.base()
    );
    assert_kind(b.reserve(0, 0), ErrorKind::InvalidArgument);
    assert_kind(b.reserve(g + 4096, 0), ErrorKind::InvalidArgument);
}

pub fn free_reservation_errors<B: TestBackend>(b: &Arc<B>) {
    let g = granularity(b);
    let base = b.reserve(4 * g, 0).unwrap();
    assert_kind(b.free_reservation(base, 2 * g), ErrorKind::InvalidArgument);
    b.free_reservation(base, 4 * g).unwrap();
    assert_kind(b.free_reservation(base, 4 * g), ErrorKind::InvalidArgument);
}

// ---- chunks ----------------------------------------------------------------

pub fn chunk_errors<B: TestBackend>(b: &Arc<B>) {
    let g = granularity(b);
    assert_kind(b.create_chunk(DEV, 0), ErrorKind::InvalidArgument);
    assert_kind(b.create_chunk(DEV, g / 2), ErrorKind::InvalidArgument);
    let h = b.create_chunk(DEV, 2 * g).unwrap();
    b.release_chunk(h).unwrap();
    assert_kind(b.release_chunk(h), ErrorKind::InvalidArgument);
}

pub fn out_of_memory<B: TestBackend>(b: &Arc<B>) {
    let g = granularity(b);
    let total = b.mem_info(DEV).unwrap().total;
    let too_big = total.next_multiple_of(g) + g;
    assert_kind(b.create_chunk(DEV, too_big), ErrorKind::OutOfMemory);
    // Nothing was left behind: a normal chunk still works.
    drop(Chunk::new(b, DEV, g).unwrap());
}

// ---- mappings --------------------------------------------------------------

pub fn map_errors<B: TestBackend>(b: &Arc<B>) {
    let g = granularity(b);
    let f = fixture(b, 4);
    let base = f.reservation.base();
    let h = f.chunk.handle();
    // Misaligned address.
    assert_kind(
        b.map(base.byte_add(g + 4096), h),
        ErrorKind::InvalidArgument,
    );
    // Over an existing mapping.
    assert!(b.map(base, h).is_err());
    // Straddling the end of the reservation.
    let two = Chunk::new(b, DEV, 2 * g).unwrap();
    assert_kind(
        b.map(base.byte_add(3 * g), two.handle()),
        ErrorKind::InvalidArgument,
    );
    // Outside the reservation, through the owner.
    assert_kind(
        Mapping::new(&f.reservation, 4 * g, &f.chunk).map(drop),
        ErrorKind::InvalidArgument,
    );
    // A released handle.
    let gone = b.create_chunk(DEV, g).unwrap();
    b.release_chunk(gone).unwrap();
    assert_kind(b.map(base.byte_add(g), gone), ErrorKind::InvalidArgument);
    // A failed map leaves the range free: mapping it now works.
    let m = Mapping::new(&f.reservation, 2 * g, &two).unwrap();
    drop(m);
}

pub fn double_unmap<B: TestBackend>(b: &Arc<B>) {
    let g = granularity(b);
    let f = fixture(b, 2);
    let va = f.reservation.base().byte_add(g);
    b.map(va, f.chunk.handle()).unwrap();
    b.unmap(va, g).unwrap();
    assert!(b.unmap(va, g).is_err(), "second unmap succeeded");
    // A range that was never mapped.
    assert!(b.unmap(f.reservation.base().byte_add(g), g).is_err());
    drop(f);
}

/// One set-access call and one unmap call each take a run of adjacent
/// whole mappings (`Backend::unmap`'s contract); after the unmap the
/// chunks map again, with their data.
pub fn unmap_a_run_of_mappings<B: TestBackend>(b: &Arc<B>) {
    let g = granularity(b);
    let s = b.create_stream(DEV).unwrap();
    let r = Reservation::new(b, 8 * g, 0).unwrap();
    let base = r.base();
    let chunks: Vec<_> = [g, 2 * g, g]
        .into_iter()
        .map(|size| Chunk::new(b, DEV, size).unwrap())
        .collect();
    // The run [g, 5g): one granule, two, one.
    for (c, offset) in chunks.iter().zip([g, 2 * g, 4 * g]) {
        b.map(base.byte_add(offset), c.handle()).unwrap();
    }
    b.set_access(base.byte_add(g), 4 * g, &[AccessDesc::read_write(DEV)])
        .unwrap();
    b.fill_u32(&s, base.byte_add(2 * g), 2 * g / 4, 0x5EED)
        .unwrap();
    b.synchronize_stream(&s).unwrap();
    b.unmap(base.byte_add(g), 4 * g).unwrap();
    for offset in [g, 2 * g, 4 * g] {
        assert!(b.unmap(base.byte_add(offset), g).is_err(), "still mapped");
    }
    let moved = Mapping::new(&r, 5 * g, &chunks[1]).unwrap();
    moved.set_access(&[AccessDesc::read_write(DEV)]).unwrap();
    assert_eq!(
        read_u32s(&**b, &s, moved.va().byte_add(g), 16),
        vec![0x5EED; 16]
    );
}

pub fn set_access_errors<B: TestBackend>(b: &Arc<B>) {
    let g = granularity(b);
    let f = fixture(b, 2);
    // The second granule is reserved but not mapped.
    assert!(b
        .set_access(
            f.reservation.base().byte_add(g),
            g,
            &[AccessDesc::read_write(DEV)]
        )
        .is_err());
    assert_kind(
        f.mapping
            .set_access(&[AccessDesc::read_write(DeviceId(999))]),
        ErrorKind::InvalidDevice,
    );
}

pub fn remap_keeps_data<B: TestBackend>(b: &Arc<B>) {
    let g = granularity(b);
    let s = b.create_stream(DEV).unwrap();
    let f = fixture(b, 4);
    let words = g / 4;
    b.fill_u32(&s, f.mapping.va(), words, 0xC0FFEE01).unwrap();
    b.synchronize_stream(&s).unwrap();
    let chunk = f.mapping.unmap().map_err(|(e, _)| e).unwrap();
    // The same chunk, two granules further on.
    let moved = Mapping::new(&f.reservation, 2 * g, &chunk).unwrap();
    moved.set_access(&[AccessDesc::read_write(DEV)]).unwrap();
    let back = read_u32s(&**b, &s, moved.va(), words);
    assert!(back.iter().all(|&w| w == 0xC0FFEE01), "data lost in remap");
}

pub fn two_mappings_share_data<B: TestBackend>(b: &Arc<B>) {
    let g = granularity(b);
    let s = b.create_stream(DEV).unwrap();
    let f = fixture(b, 4);
    let second = Mapping::new(&f.reservation, 3 * g, &f.chunk).unwrap();
    second.set_access(&[AccessDesc::read_write(DEV)]).unwrap();
    b.fill_u32(&s, f.mapping.va().byte_add(4096), 16, 0xAB)
        .unwrap();
    b.fill_u32(&s, second.va().byte_add(8192), 16, 0xCD)
        .unwrap();
    assert_eq!(
        read_u32s(&**b, &s, second.va().byte_add(4096), 16),
        vec![0xAB; 16]
    );
    assert_eq!(
        read_u32s(&**b, &s, f.mapping.va().byte_add(8192), 16),
        vec![0xCD; 16]
    );
}

pub fn multi_granule_chunk<B: TestBackend>(b: &Arc<B>) {
    let g = granularity(b);
    let s = b.create_stream(DEV).unwrap();
    let r = Reservation::new(b, 8 * g, 0).unwrap();
    let chunk = Chunk::new(b, DEV, 3 * g).unwrap();
    let low = Mapping::new(&r, 0, &chunk).unwrap();
    let high = Mapping::new(&r, 4 * g, &chunk).unwrap();
    for m in [&low, &high] {
        m.set_access(&[AccessDesc::read_write(DEV)]).unwrap();
    }
    // Across a granule boundary, written through one, read through the other.
    let at = 2 * g - 64;
    b.fill_u32(&s, high.va().byte_add(at), 32, 0x5EC0D).unwrap();
    assert_eq!(
        read_u32s(&**b, &s, low.va().byte_add(at), 32),
        vec![0x5EC0D; 32]
    );
    // Unmapping a part of a mapping is refused.
    assert!(b.unmap(low.va(), g).is_err());
}

pub fn owners_keep_teardown_order<B: TestBackend>(b: &Arc<B>) {
    let g = granularity(b);
    let s = b.create_stream(DEV).unwrap();
    let Fixture {
        reservation,
        chunk,
        mapping,
    } = fixture(b, 1);
    // The mapping alone now keeps the chunk and the range alive.
    drop(reservation);
    drop(chunk);
    b.fill_u32(&s, mapping.va(), 8, 7).unwrap();
    assert_eq!(read_u32s(&**b, &s, mapping.va(), 8), vec![7; 8]);
    assert_eq!(mapping.size(), g);
    drop(mapping);
}

// ---- streams and events ----------------------------------------------------

pub fn stream_order<B: TestBackend>(b: &Arc<B>) {
    let s = b.create_stream(DEV).unwrap();
    let f = fixture(b, 1);
    let va = f.mapping.va();
    b.delay(&s, DELAY).unwrap();
    for value in 1..=50u32 {
        b.fill_u32(&s, va, 1024, value).unwrap();
    }
    assert_eq!(read_u32s(&**b, &s, va, 1024), vec![50; 1024]);
}

pub fn delay_holds_stream<B: TestBackend>(b: &Arc<B>) {
    let s = b.create_stream(DEV).unwrap();
    // The CUDA backend loads (JIT-compiles) its delay kernel on first use,
    // about 0.1 s; keep that out of what is measured.
    b.delay(&s, Duration::ZERO).unwrap();
    b.synchronize_stream(&s).unwrap();
    let start = Instant::now();
    b.delay(&s, DELAY).unwrap();
    let queued = start.elapsed();
    b.synchronize_stream(&s).unwrap();
    let total = start.elapsed();
    assert!(
        queued < DELAY / 3,
        "delay blocked the caller for {queued:?}"
    );
    assert!(total >= DELAY, "stream was busy only {total:?}");
}

pub fn event_query<B: TestBackend>(b: &Arc<B>) {
    let s = b.create_stream(DEV).unwrap();
    let e = b.create_event(DEV).unwrap();
    assert_eq!(
        b.query_event(&e).unwrap(),
        EventStatus::Complete,
        "never recorded"
    );
    b.delay(&s, DELAY).unwrap();
    b.record_event(&e, &s).unwrap();
    assert_eq!(b.query_event(&e).unwrap(), EventStatus::Pending);
    b.synchronize_event(&e).unwrap();
    assert_eq!(b.query_event(&e).unwrap(), EventStatus::Complete);
    // Re-recording captures only the new work.
    b.record_event(&e, &s).unwrap();
    b.synchronize_stream(&s).unwrap();
    assert_eq!(b.query_event(&e).unwrap(), EventStatus::Complete);
}

pub fn wait_across_streams<B: TestBackend>(b: &Arc<B>) {
    let (s1, s2) = (b.create_stream(DEV).unwrap(), b.create_stream(DEV).unwrap());
    let f = fixture(b, 1);
    let va = f.mapping.va();
    b.fill_u32(&s1, va, 256, 1).unwrap();
    b.synchronize_stream(&s1).unwrap();
    let e = b.create_event(DEV).unwrap();
    b.delay(&s1, DELAY).unwrap();
    b.fill_u32(&s1, va, 256, 2).unwrap();
    b.record_event(&e, &s1).unwrap();
    b.stream_wait_event(&s2, &e).unwrap();
    let after = b.create_event(DEV).unwrap();
    b.record_event(&after, &s2).unwrap();
    assert_eq!(
        b.query_event(&after).unwrap(),
        EventStatus::Pending,
        "s2 did not wait"
    );
    // s2 reads only after s1's late write.
    assert_eq!(read_u32s(&**b, &s2, va, 256), vec![2; 256]);
}

pub fn chain_of_three_streams<B: TestBackend>(b: &Arc<B>) {
    let s: Vec<_> = (0..3).map(|_| b.create_stream(DEV).unwrap()).collect();
    let e: Vec<_> = (0..2).map(|_| b.create_event(DEV).unwrap()).collect();
    let f = fixture(b, 1);
    let va = f.mapping.va();
    b.delay(&s[0], DELAY).unwrap();
    b.fill_u32(&s[0], va, 64, 0xA).unwrap();
    b.record_event(&e[0], &s[0]).unwrap();
    b.stream_wait_event(&s[1], &e[0]).unwrap();
    b.fill_u32(&s[1], va.byte_add(256), 64, 0xB).unwrap();
    b.record_event(&e[1], &s[1]).unwrap();
    b.stream_wait_event(&s[2], &e[1]).unwrap();
    let last = b.create_event(DEV).unwrap();
    b.record_event(&last, &s[2]).unwrap();
    assert_eq!(b.query_event(&last).unwrap(), EventStatus::Pending);
    let words = read_u32s(&**b, &s[2], va, 128);
    assert_eq!(&words[..64], &[0xA; 64][..]);
    assert_eq!(&words[64..], &[0xB; 64][..]);
}

pub fn wait_captures_record_at_call_time<B: TestBackend>(b: &Arc<B>) {
    let (s1, s2) = (b.create_stream(DEV).unwrap(), b.create_stream(DEV).unwrap());
    let e = b.create_event(DEV).unwrap();
    b.record_event(&e, &s1).unwrap();
    b.synchronize_stream(&s1).unwrap();
    // The wait takes the (complete) record; a later record does not hold s2.
    b.stream_wait_event(&s2, &e).unwrap();
    b.delay(&s1, DELAY).unwrap();
    b.record_event(&e, &s1).unwrap();
    let start = Instant::now();
    b.synchronize_stream(&s2).unwrap();
    assert!(start.elapsed() < DELAY / 2, "s2 waited for a later record");
    b.synchronize_event(&e).unwrap();
}

// ---- access query and shareable chunks ---------------------------------------

pub fn get_access_reports_the_driver_state<B: TestBackend>(b: &Arc<B>) {
    let g = granularity(b);
    let r = Reservation::new(b, 2 * g, 0).unwrap();
    let c = Chunk::new(b, DEV, g).unwrap();
    let m = Mapping::new(&r, 0, &c).unwrap();
    assert_eq!(b.get_access(m.va(), DEV).unwrap(), Access::None);
    m.set_access(&[AccessDesc::read_write(DEV)]).unwrap();
    assert_eq!(b.get_access(m.va(), DEV).unwrap(), Access::ReadWrite);
    assert_eq!(
        b.get_access(m.va().byte_add(g - 4), DEV).unwrap(),
        Access::ReadWrite
    );
    // Not mapped, and no such device.
    assert_kind(
        b.get_access(r.base().byte_add(g), DEV),
        ErrorKind::InvalidArgument,
    );
    let missing = DeviceId(b.device_count().unwrap());
    assert_kind(b.get_access(m.va(), missing), ErrorKind::InvalidDevice);
}

pub fn only_shareable_chunks_export<B: TestBackend>(b: &Arc<B>) {
    let g = granularity(b);
    let shareable = Chunk::new_shareable(b, DEV, g).unwrap();
    let fd = shareable.export().unwrap();
    let again = shareable.export().unwrap();
    assert_ne!(
        fd.as_raw_fd(),
        again.as_raw_fd(),
        "each export is a new descriptor"
    );
    let plain = Chunk::new(b, DEV, g).unwrap();
    assert_kind(plain.export(), ErrorKind::InvalidArgument);
    // A shareable chunk maps and holds data like any other.
    let r = Reservation::new(b, g, 0).unwrap();
    let m = Mapping::new(&r, 0, &shareable).unwrap();
    m.set_access(&[AccessDesc::read_write(DEV)]).unwrap();
    let s = b.create_stream(DEV).unwrap();
    b.fill_u32(&s, m.va(), 16, 0x5a5a).unwrap();
    assert_eq!(read_u32s(&**b, &s, m.va(), 16), vec![0x5a5a; 16]);
}

/// Copies through host memory: several ranges out in one call, back in at
/// other places, bytes intact; a range outside the buffer or not mapped is
/// an error.
pub fn copies_through_host_memory<B: TestBackend>(b: &Arc<B>) {
    let g = granularity(b);
    let s = b.create_stream(DEV).unwrap();
    let f = fixture(b, 4);
    let second = Chunk::new(b, DEV, g).unwrap();
    let m2 = Mapping::new(&f.reservation, 2 * g, &second).unwrap();
    m2.set_access(&[AccessDesc::read_write(DEV)]).unwrap();
    b.fill_u32(&s, f.mapping.va(), 1024, 0x1111_2222).unwrap();
    b.fill_u32(&s, f.mapping.va().byte_add(4096), 512, 0x3333_4444)
        .unwrap();
    let mut host = b.alloc_host(8192).unwrap();
    assert_eq!(vmm::HostBuffer::len(&host), 8192);
    let out = [
        vmm::HostCopy {
            device: f.mapping.va(),
            host_offset: 0,
            len: 4096,
        },
        vmm::HostCopy {
            device: f.mapping.va().byte_add(4096),
            host_offset: 4096,
            len: 2048,
        },
    ];
    // Queued after the fills: the copy sees them.
    b.copy_device_to_host(&s, &out, &mut host).unwrap();
    let words = |bytes: &[u8]| -> Vec<u32> {
        bytes
            .chunks_exact(4)
            .map(|w| u32::from_ne_bytes(w.try_into().unwrap()))
            .collect()
    };
    let bytes = vmm::HostBuffer::as_slice(&host);
    assert!(words(&bytes[..4096]).iter().all(|&w| w == 0x1111_2222));
    assert!(words(&bytes[4096..6144]).iter().all(|&w| w == 0x3333_4444));
    let back = [vmm::HostCopy {
        device: m2.va(),
        host_offset: 0,
        len: 6144,
    }];
    b.copy_host_to_device(&s, &host, &back).unwrap();
    assert_eq!(read_u32s(&**b, &s, m2.va(), 4), vec![0x1111_2222; 4]);
    assert_eq!(
        read_u32s(&**b, &s, m2.va().byte_add(4096), 4),
        vec![0x3333_4444; 4]
    );
    let too_far = [vmm::HostCopy {
        device: m2.va(),
        host_offset: 8000,
        len: 400,
    }];
    assert_kind(
        b.copy_device_to_host(&s, &too_far, &mut host),
        ErrorKind::InvalidArgument,
    );
    let unmapped = [vmm::HostCopy {
        device: f.reservation.base().byte_add(3 * g),
        host_offset: 0,
        len: 64,
    }];
    assert!(b.copy_device_to_host(&s, &unmapped, &mut host).is_err());
}

/// Pipelined copies through host memory: batches out in order after the
/// stream's earlier work, each batch's `done` free to unmap its memory
/// while later batches copy; batches back in, each mapped by its `ready`
/// just before its copy; a failing callback stops the calls, with what
/// was queued before it done.
pub fn pipelined_copies_through_host_memory<B: TestBackend>(b: &Arc<B>) {
    let g = granularity(b);
    let n = 4;
    let s = b.create_stream(DEV).unwrap();
    let reservation = Reservation::new(b, n * g, 0).unwrap();
    let rw = [AccessDesc::read_write(DEV)];
    let map_all = || -> Vec<Option<Mapping<B>>> {
        (0..n)
            .map(|i| {
                let chunk = Chunk::new(b, DEV, g).unwrap();
                let m = Mapping::new(&reservation, i * g, &chunk).unwrap();
                m.set_access(&rw).unwrap();
                Some(m)
            })
            .collect()
    };
    let mut mappings = map_all();
    // Behind a delay: the copies must wait for the fills.
    b.delay(&s, Duration::from_millis(50)).unwrap();
    for (i, m) in mappings.iter().enumerate() {
        let m = m.as_ref().unwrap();
        b.fill_u32(&s, m.va(), g / 4, 0xB0_0000 + i as u32).unwrap();
    }
    let batches: Vec<Vec<vmm::HostCopy>> = (0..n)
        .map(|i| {
            // Two ranges a batch.
            let at = reservation.base().byte_add(i * g);
            vec![
                vmm::HostCopy {
                    device: at,
                    host_offset: i * g,
                    len: g / 2,
                },
                vmm::HostCopy {
                    device: at.byte_add(g / 2),
                    host_offset: i * g + g / 2,
                    len: g / 2,
                },
            ]
        })
        .collect();
    let mut host = b.alloc_host(n * g).unwrap();
    let mut order = Vec::new();
    b.copy_device_to_host_pipelined(&s, &batches, &mut host, &mut |i| {
        order.push(i);
        // Done with: unmapped while the later batches copy.
        drop(mappings[i].take());
        Ok(())
    })
    .unwrap();
    assert_eq!(order, (0..n).collect::<Vec<_>>());
    let words = |bytes: &[u8]| -> Vec<u32> {
        bytes
            .chunks_exact(4)
            .map(|w| u32::from_ne_bytes(w.try_into().unwrap()))
            .collect()
    };
    for i in 0..n {
        let bytes = &vmm::HostBuffer::as_slice(&host)[i * g..(i + 1) * g];
        assert!(
            words(bytes).iter().all(|&w| w == 0xB0_0000 + i as u32),
            "batch {i}"
        );
    }

    // Back in, each batch mapped just before its copy.
    let mut mapped: Vec<Option<Mapping<B>>> = (0..n).map(|_| None).collect();
    b.copy_host_to_device_pipelined(&s, &host, &batches, &mut |i| {
        let chunk = Chunk::new(b, DEV, g)?;
        let m = Mapping::new(&reservation, i * g, &chunk)?;
        m.set_access(&rw)?;
        mapped[i] = Some(m);
        Ok(())
    })
    .unwrap();
    for (i, m) in mapped.iter().enumerate() {
        let m = m.as_ref().unwrap();
        assert_eq!(
            read_u32s(&**b, &s, m.va(), 4),
            vec![0xB0_0000 + i as u32; 4]
        );
        assert_eq!(
            read_u32s(&**b, &s, m.va().byte_add(g - 16), 4),
            vec![0xB0_0000 + i as u32; 4]
        );
    }

    // A failing `done` stops the calls; so does a failing `ready`, after
    // the batches before it were copied.
    let mut calls = Vec::new();
    let stopped = b.copy_device_to_host_pipelined(&s, &batches, &mut host, &mut |i| {
        calls.push(i);
        stop_at(1, i)
    });
    assert_kind(stopped, ErrorKind::Other);
    assert_eq!(calls, vec![0, 1]);
    for m in mapped.iter().flatten() {
        b.fill_u32(&s, m.va(), g / 4, 0).unwrap();
    }
    let mut readied = Vec::new();
    let stopped = b.copy_host_to_device_pipelined(&s, &host, &batches, &mut |i| {
        readied.push(i);
        stop_at(2, i)
    });
    assert_kind(stopped, ErrorKind::Other);
    assert_eq!(readied, vec![0, 1, 2]);
    for (i, m) in mapped.iter().enumerate() {
        let expect = if i < 2 { 0xB0_0000 + i as u32 } else { 0 };
        assert_eq!(
            read_u32s(&**b, &s, m.as_ref().unwrap().va(), 4),
            vec![expect; 4]
        );
    }

    // A range outside the buffer: refused before any callback.
    let mut too_far = batches.clone();
    too_far[3][1].host_offset = n * g;
    let mut called = false;
    assert_kind(
        b.copy_device_to_host_pipelined(&s, &too_far, &mut host, &mut |_| {
            called = true;
            Ok(())
        }),
        ErrorKind::InvalidArgument,
    );
    assert_kind(
        b.copy_host_to_device_pipelined(&s, &host, &too_far, &mut |_| {
            called = true;
            Ok(())
        }),
        ErrorKind::InvalidArgument,
    );
    assert!(!called);
}

/// What a graph capture (as PyTorch's `torch.cuda.graph` makes) refuses,
/// which the pool must never ask for on a capturing stream.
pub fn capture_refuses_what_crosses_it<B: TestBackend>(b: &Arc<B>) {
    let s = b.create_stream(DEV).unwrap();
    let other = b.create_stream(DEV).unwrap();
    let outside = b.create_event(DEV).unwrap();
    b.record_event(&outside, &other).unwrap();
    let inside = b.create_event(DEV).unwrap();
    assert!(!b.stream_capturing(&s).unwrap());
    // A clean capture: an event recorded in it is part of the graph.
    b.begin_capture(&s).unwrap();
    assert!(b.stream_capturing(&s).unwrap());
    assert!(!b.stream_capturing(&other).unwrap());
    b.record_event(&inside, &s).unwrap();
    b.end_capture(&s).unwrap();
    assert!(!b.stream_capturing(&s).unwrap());
    // It stays the graph's: not to be queried or waited for, even after
    // the capture, until recorded again.
    assert!(b.query_event(&inside).is_err(), "query of a captured event");
    assert!(
        b.stream_wait_event(&other, &inside).is_err(),
        "wait for a captured event"
    );
    b.record_event(&inside, &other).unwrap();
    b.synchronize_event(&inside).unwrap();
    assert_eq!(b.query_event(&inside).unwrap(), EventStatus::Complete);
    // A capturing stream cannot wait for an event recorded outside the
    // capture, and that spoils the capture.
    b.begin_capture(&s).unwrap();
    assert!(
        b.stream_wait_event(&s, &outside).is_err(),
        "a capturing stream waits for an outside event"
    );
    assert!(
        b.end_capture(&s).is_err(),
        "the capture survived the refusal"
    );
    assert!(!b.stream_capturing(&s).unwrap());
    // The stream works as before.
    b.synchronize_stream(&s).unwrap();
}

/// Which calls a capture in global mode allows from outside its stream:
/// each call once in a capture of its own, then whether the capture
/// survived. Growing and moving memory must be allowed (a pool grows while
/// a graph is captured); a synchronising call is refused and spoils it.
pub fn capture_allows_growth_not_synchronisation<B: TestBackend>(b: &Arc<B>) {
    let g = granularity(b);
    let s = b.create_stream(DEV).unwrap();
    let other = b.create_stream(DEV).unwrap();
    let event = b.create_event(DEV).unwrap();
    b.record_event(&event, &other).unwrap();
    let r = Reservation::new(b, 4 * g, 0).unwrap();
    let held = Chunk::new(b, DEV, g).unwrap();
    let mut held_map = Some(Mapping::new(&r, 0, &held).unwrap());
    let spare = Chunk::new(b, DEV, g).unwrap();
    let mut loose = Some(Chunk::new(b, DEV, g).unwrap());
    let mut new_map = None;
    let rw = [AccessDesc::read_write(DEV)];
    let mut outcomes: Vec<(&str, bool, bool)> = Vec::new();
    let mut try_in_capture = |what: &'static str, f: &mut dyn FnMut() -> bool| {
        b.begin_capture(&s).unwrap();
        let call_ok = f();
        let capture_ok = b.end_capture(&s).is_ok();
        outcomes.push((what, call_ok, capture_ok));
    };
    try_in_capture("create a chunk", &mut || Chunk::new(b, DEV, g).is_ok());
    try_in_capture("map", &mut || {
        new_map = Mapping::new(&r, g, &spare).ok();
        new_map.is_some()
    });
    try_in_capture("set access", &mut || {
        new_map.as_ref().unwrap().set_access(&rw).is_ok()
    });
    try_in_capture("unmap", &mut || held_map.take().unwrap().unmap().is_ok());
    try_in_capture("release a chunk", &mut || {
        Chunk::release(loose.take().unwrap()).is_ok()
    });
    try_in_capture("record an event on another stream", &mut || {
        b.record_event(&event, &other).is_ok()
    });
    try_in_capture("another stream waits for it", &mut || {
        b.stream_wait_event(&other, &event).is_ok()
    });
    try_in_capture("query an event", &mut || b.query_event(&event).is_ok());
    try_in_capture("synchronize another stream", &mut || {
        b.synchronize_stream(&other).is_ok()
    });
    let expected = [
        ("create a chunk", true, true),
        ("map", true, true),
        ("set access", true, true),
        ("unmap", true, true),
        ("release a chunk", true, true),
        ("record an event on another stream", true, true),
        ("another stream waits for it", true, true),
        ("query an event", false, false),
        ("synchronize another stream", false, false),
    ];
    assert_eq!(
        outcomes, expected,
        "(call, call succeeded, capture survived) for each call"
    );
    drop(new_map);
    b.synchronize_stream(&other).unwrap();
}

macro_rules! cases {
    ($m:ident, $backend:ident) => {
        $m!(
            $backend,
            [
                devices_and_granularity,
                reserve_alignment,
                free_reservation_errors,
                chunk_errors,
                out_of_memory,
                map_errors,
                double_unmap,
                unmap_a_run_of_mappings,
                set_access_errors,
                remap_keeps_data,
                copies_through_host_memory,
                pipelined_copies_through_host_memory,
                two_mappings_share_data,
                multi_granule_chunk,
                owners_keep_teardown_order,
                stream_order,
                delay_holds_stream,
                event_query,
                wait_across_streams,
                chain_of_three_streams,
                wait_captures_record_at_call_time,
                get_access_reports_the_driver_state,
                only_shareable_chunks_export,
                capture_refuses_what_crosses_it,
                capture_allows_growth_not_synchronisation
            ]
        );
    };
}

macro_rules! suite {
    ($backend:ident, [$($case:ident),*]) => {
        mod $backend {
            $(
                #[test]
                fn $case() {
                    super::$case(&super::open::$backend());
                }
            )*
        }
    };
}

mod open {
    use std::sync::Arc;

    /// A fresh small machine per test, so out-of-memory is deterministic.
    pub fn host() -> Arc<vmm::host::Host> {
        vmm::host::Host::new(vmm::host::HostConfig {
            devices: 2,
            first_device: 0,
            memory_per_device: 256 << 20,
            granularity: 2 << 20,
        })
        .expect("host backend")
    }

    #[cfg(feature = "gpu-tests")]
    pub fn cuda() -> Arc<vmm::cuda::Cuda> {
        use std::sync::OnceLock;
        static CUDA: OnceLock<Arc<vmm::cuda::Cuda>> = OnceLock::new();
        Arc::clone(CUDA.get_or_init(|| {
            vmm::cuda::Cuda::new().unwrap_or_else(|e| {
                panic!("the gpu-tests feature is on, but no CUDA device could be opened: {e}")
            })
        }))
    }
}

cases!(suite, host);
#[cfg(feature = "gpu-tests")]
cases!(suite, cuda);

// ---- host only: timing the GPU gives no guarantee of -------------------------

/// A host backend that sees the machine from its device 1 on (as
/// `CUDA_VISIBLE_DEVICES=1,...` would) gives its device 0 the UUID that a
/// backend seeing every device gives its device 1.
#[test]
fn host_uuids_follow_the_machine_not_the_ordinal() {
    let config = |first_device| vmm::host::HostConfig {
        devices: 2,
        first_device,
        memory_per_device: 256 << 20,
        granularity: 2 << 20,
    };
    let all = vmm::host::Host::new(config(0)).unwrap();
    let later = vmm::host::Host::new(config(1)).unwrap();
    assert_eq!(
        later.device_uuid(DeviceId(0)).unwrap(),
        all.device_uuid(DeviceId(1)).unwrap()
    );
    assert!(vmm::host::Host::new(config(u32::MAX)).is_err());
}

/// A host stream dropped while capturing ends its capture, as destroying a
/// CUDA stream does: the backend refuses no more calls for it.
#[test]
fn host_a_stream_dropped_while_capturing_ends_its_capture() {
    let b = open::host();
    let s = b.create_stream(DEV).unwrap();
    let other = b.create_stream(DEV).unwrap();
    b.begin_capture(&s).unwrap();
    assert!(b.synchronize_stream(&other).is_err());
    drop(s);
    b.synchronize_stream(&other).unwrap();
}

/// On an idle stream the host completes a recorded event at once (a GPU
/// does within microseconds), so that replays that record events behave the
/// same on every run.
#[test]
fn host_record_on_an_idle_stream_completes_at_once() {
    let b = open::host();
    let s = b.create_stream(DEV).unwrap();
    let e = b.create_event(DEV).unwrap();
    for _ in 0..100 {
        b.record_event(&e, &s).unwrap();
        assert_eq!(b.query_event(&e).unwrap(), EventStatus::Complete);
    }
    // Behind queued work it waits for the work, as `event_query` checks.
    b.delay(&s, DELAY).unwrap();
    b.record_event(&e, &s).unwrap();
    assert_eq!(b.query_event(&e).unwrap(), EventStatus::Pending);
    b.synchronize_event(&e).unwrap();
}

// ---- host only: faults that would poison a CUDA context ---------------------

mod host_faults {
    use super::*;

    /// The census counts live events, so that tests can tell a pool that
    /// leaks them.
    #[test]
    fn census_counts_events() {
        let b = open::host();
        let events: Vec<_> = (0..3).map(|_| b.create_event(DEV).unwrap()).collect();
        assert_eq!(b.census().events, 3);
        drop(events);
        assert_eq!(b.census(), vmm::host::Census::default());
    }

    #[test]
    fn access_without_permission_faults_the_stream() {
        let b = open::host();
        let g = granularity(&b);
        let r = Reservation::new(&b, g, 0).unwrap();
        let c = Chunk::new(&b, DEV, g).unwrap();
        let m = Mapping::new(&r, 0, &c).unwrap();
        let s = b.create_stream(DEV).unwrap();
        b.fill_u32(&s, m.va(), 4, 1).unwrap();
        assert_kind(b.synchronize_stream(&s), ErrorKind::StreamFault);
        // Sticky: later work on the stream fails too, and events report it.
        let e = b.create_event(DEV).unwrap();
        b.record_event(&e, &s).unwrap();
        assert_kind(b.synchronize_event(&e), ErrorKind::StreamFault);
        assert_kind(b.query_event(&e), ErrorKind::StreamFault);
    }

    #[test]
    fn access_is_per_device() {
        let b = open::host();
        let g = granularity(&b);
        let f = fixture(&b, 1);
        let other = b.create_stream(DeviceId(1)).unwrap();
        let mut word = [0u8; 4];
        assert_kind(
            b.copy_to_host(&other, f.mapping.va(), &mut word),
            ErrorKind::StreamFault,
        );
        let peer = b.create_stream(DeviceId(1)).unwrap();
        f.mapping
            .set_access(&[vmm::AccessDesc {
                device: DeviceId(1),
                access: vmm::Access::Read,
            }])
            .unwrap();
        b.copy_to_host(&peer, f.mapping.va(), &mut word).unwrap();
        b.fill_u32(&peer, f.mapping.va(), 1, 9).unwrap();
        assert_kind(b.synchronize_stream(&peer), ErrorKind::StreamFault);
        assert_eq!(g, f.mapping.size());
    }

    #[test]
    fn unmapped_memory_faults_instead_of_crashing() {
        let b = open::host();
        let f = fixture(&b, 2);
        let s = b.create_stream(DEV).unwrap();
        let beyond = f.mapping.va().byte_add(f.mapping.size());
        let mut buf = [0u8; 8];
        assert_kind(b.copy_to_host(&s, beyond, &mut buf), ErrorKind::StreamFault);
    }

    #[test]
    fn out_of_memory_at_the_configured_size() {
        let b = open::host();
        let g = granularity(&b);
        let fits = (256 << 20) / g;
        let chunks: Vec<_> = (0..fits).map(|_| Chunk::new(&b, DEV, g).unwrap()).collect();
        assert_eq!(b.mem_info(DEV).unwrap().free, 0);
        assert_kind(b.create_chunk(DEV, g), ErrorKind::OutOfMemory);
        // The other device is untouched.
        assert_eq!(b.mem_info(DeviceId(1)).unwrap().free, 256 << 20);
        drop(chunks);
        assert_eq!(b.mem_info(DEV).unwrap().free, 256 << 20);
    }

    #[test]
    fn released_chunk_lives_until_unmapped() {
        let b = open::host();
        let g = granularity(&b);
        let r = Reservation::new(&b, g, 0).unwrap();
        let h = b.create_chunk(DEV, g).unwrap();
        b.map(r.base(), h).unwrap();
        b.release_chunk(h).unwrap();
        assert_eq!(b.mem_info(DEV).unwrap().free, (256 << 20) - g);
        b.unmap(r.base(), g).unwrap();
        assert_eq!(b.mem_info(DEV).unwrap().free, 256 << 20);
    }
}

// ---- host only: importing chunks into a second backend ("another process") --

mod host_sharing {
    use super::*;

    /// The exporter's chunk, exported, and a second backend that imports it
    /// as another process would (it has tables of its own).
    fn exported(g: usize) -> (Arc<vmm::host::Host>, Arc<Chunk<vmm::host::Host>>, OwnedFd) {
        let b = open::host();
        let c = Chunk::new_shareable(&b, DEV, g).unwrap();
        let fd = c.export().unwrap();
        (b, c, fd)
    }

    #[test]
    fn an_imported_chunk_is_the_same_memory() {
        let g = 2 << 20;
        let (a, chunk, fd) = exported(g);
        let b = open::host();
        let imported = Chunk::import(&b, fd.as_fd(), DEV, g).unwrap();
        drop(fd);
        // Imported memory is the exporter's: it does not count here.
        assert_eq!(b.mem_info(DEV).unwrap().free, 256 << 20);
        let (ra, rb) = (
            Reservation::new(&a, g, 0).unwrap(),
            Reservation::new(&b, g, 0).unwrap(),
        );
        let ma = Mapping::new(&ra, 0, &chunk).unwrap();
        let mb = Mapping::new(&rb, 0, &imported).unwrap();
        ma.set_access(&[AccessDesc::read_write(DEV)]).unwrap();
        mb.set_access(&[AccessDesc::read_write(DEV)]).unwrap();
        let (sa, sb) = (a.create_stream(DEV).unwrap(), b.create_stream(DEV).unwrap());
        a.fill_u32(&sa, ma.va(), 8, 0xE0).unwrap();
        a.synchronize_stream(&sa).unwrap();
        assert_eq!(read_u32s(&*b, &sb, mb.va(), 8), vec![0xE0; 8]);
        b.fill_u32(&sb, mb.va().byte_add(g - 32), 8, 0x1B).unwrap();
        b.synchronize_stream(&sb).unwrap();
        assert_eq!(
            read_u32s(&*a, &sa, ma.va().byte_add(g - 32), 8),
            vec![0x1B; 8]
        );
        // The exporter lets go first; the importer's mapping keeps the memory.
        drop((ma, chunk, ra));
        assert_eq!(a.census(), vmm::host::Census::default());
        assert_eq!(read_u32s(&*b, &sb, mb.va(), 8), vec![0xE0; 8]);
        drop((mb, imported, rb));
        assert_eq!(b.census(), vmm::host::Census::default());
    }

    #[test]
    fn foreign_descriptors_are_refused() {
        let g = 2 << 20;
        let b = open::host();
        let not_memory: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        assert_kind(
            b.import_chunk(not_memory.as_fd(), DEV, g),
            ErrorKind::InvalidArgument,
        );
        // A memfd, but not one sealed at its size: it could shrink under a
        // mapping.
        let loose = rustix::fs::memfd_create("loose", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&loose, g as u64).unwrap();
        assert_kind(
            b.import_chunk(loose.as_fd(), DEV, g),
            ErrorKind::InvalidArgument,
        );
        // A real chunk announced with the wrong size, or for no such device.
        let (_a, _chunk, fd) = exported(g);
        assert_kind(
            b.import_chunk(fd.as_fd(), DEV, 2 * g),
            ErrorKind::InvalidArgument,
        );
        assert_kind(
            b.import_chunk(fd.as_fd(), DeviceId(7), g),
            ErrorKind::InvalidDevice,
        );
        assert_eq!(b.census(), vmm::host::Census::default());
        // The refusals did not consume the descriptor.
        let ok = b.import_chunk(fd.as_fd(), DEV, g).unwrap();
        b.release_chunk(ok).unwrap();
        assert_eq!(b.census(), vmm::host::Census::default());
    }
}
