//! Fuzzing the API across threads (issue 8): proptest generates, for each
//! of 3 threads and each of up to 3 rounds, a sequence of calls: stream-
//! ordered and synchronous allocations of edge and random sizes from two
//! pools, frees on the allocation's stream or on another one behind an
//! event, allocations handed to another thread and freed there, delays,
//! orderings, every kind of synchronization, trims, attribute changes and
//! refused calls. The threads run each round at once on one context, two
//! pools and 4 shared streams of the host backend.
//!
//! The order in which the threads interleave is not chosen, so the model
//! checks what must hold under any interleaving:
//! - no two live allocations overlap (checked when each is handed out,
//!   against a table of every live allocation of every thread);
//! - every allocation keeps its own pattern: it is filled on its stream and
//!   checked before some of its frees, at check steps, and after each round;
//!   memory handed out while a late fill of its previous owner is queued
//!   shows up as a broken pattern;
//! - misuse is refused with the right error;
//! - between rounds (no thread running): each pool's accounting matches a
//!   recount of its tables (`Pool::audit`), and its used bytes lie between
//!   the sum of the live sizes rounded to 256 and 1/8 more (a block may be
//!   reused for a request up to 1/8 smaller);
//! - at the end, with everything freed, synchronized and trimmed to 0: no
//!   byte used, pending or held, and the backend holds no chunk, mapping or
//!   reservation.
//!
//! `cargo test --test fuzz` runs 128 cases (some 10 s), after the seeds
//! in `fuzz.proptest-regressions`. `PROPTEST_CASES=n` sets the cases per
//! run; `VMPOOL_FUZZ_SECS=s` repeats runs until `s` seconds have passed.
//! `--nocapture` shows how much was done.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{contextualize_config, Config, TestRunner};
use vmpool::vmm::host::{Census, Host, HostConfig};
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::DeviceId;
use vmpool::{
    Allocation, Context, Error, Event, Pool, PoolAttribute, PoolProps, Stream, SMALL_LIMIT,
};

const DEV: DeviceId = DeviceId(0);
const FAR: DeviceId = DeviceId(1);
const THREADS: usize = 3;
const STREAMS: usize = 4;
const MIB: u64 = 1 << 20;
const CHUNK: u64 = 8 * MIB;
const VA: u64 = 4 << 30;
/// Per thread; with the mailbox, at most 22 allocations of at most 24 MiB
/// are live, and a round frees at most 60: the 2 GiB device never runs out.
const MAX_LIVE: usize = 6;
const MAILBOX: usize = 4;

#[derive(Debug, Clone)]
enum How {
    /// `Context::alloc_async`: the current pool, which is pool 0.
    Current,
    FromPool(usize),
    /// `Pool::allocate`: no stream order; freed with `Pool::free`.
    Sync(usize),
}

#[derive(Debug, Clone)]
enum Op {
    /// Allocate on stream `s` and fill there, `late` ms after the call.
    Alloc {
        how: How,
        s: usize,
        size: u64,
        late: u64,
    },
    /// Free live allocation `i` on stream `on`, ordered after its stream by
    /// an event; `check` synchronizes the device and reads it first.
    Free {
        i: usize,
        on: usize,
        check: bool,
        via_pool: bool,
    },
    /// Hand live allocation `i` to whichever thread takes it.
    Hand {
        i: usize,
    },
    /// Take a handed allocation, order `on` after its event, free it there.
    Take {
        on: usize,
        check: bool,
    },
    Delay {
        s: usize,
        ms: u64,
    },
    Order {
        a: usize,
        b: usize,
    },
    SyncStream {
        s: usize,
    },
    SyncEvent {
        s: usize,
    },
    SyncDevice,
    /// Synchronize the device, then check this thread's live allocations.
    Check,
    Trim {
        pool: usize,
        keep: u64,
    },
    Set {
        pool: usize,
        attribute: PoolAttribute,
        value: u64,
    },
    Refused(Misuse),
}

#[derive(Debug, Clone)]
enum Misuse {
    Size { how: How, size: u64 },
    OtherDevice { pool: usize },
}

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        // Whole chunks: the heap has no leftover to offer, so reuse of
        // pending frees (of this size) is what serves them.
        3 => prop::sample::select(vec![CHUNK, 2 * CHUNK, 3 * CHUNK]),
        2 => prop::sample::select(vec![
            1,
            4,
            255,
            256,
            257,
            SMALL_LIMIT - 1,
            SMALL_LIMIT,
            SMALL_LIMIT + 1,
            2 * MIB,
            CHUNK - 256,
            CHUNK,
            CHUNK + 1,
        ]),
        2 => 1..SMALL_LIMIT,
        1 => SMALL_LIMIT..3 * CHUNK,
    ]
}

fn how() -> impl Strategy<Value = How> {
    prop_oneof![
        2 => Just(How::Current),
        2 => (0..2usize).prop_map(How::FromPool),
        1 => (0..2usize).prop_map(How::Sync),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let s = || 0..STREAMS;
    let attribute = prop::sample::select(PoolAttribute::REUSE_SWITCHES.to_vec());
    prop_oneof![
        8 => (how(), s(), size(), prop_oneof![2 => Just(0u64), 1 => 1..4u64])
            .prop_map(|(how, s, size, late)| Op::Alloc { how, s, size, late }),
        6 => (any::<usize>(), s(), any::<bool>(), any::<bool>())
            .prop_map(|(i, on, check, via_pool)| Op::Free { i, on, check, via_pool }),
        2 => any::<usize>().prop_map(|i| Op::Hand { i }),
        2 => (s(), any::<bool>()).prop_map(|(on, check)| Op::Take { on, check }),
        3 => (s(), 1..4u64).prop_map(|(s, ms)| Op::Delay { s, ms }),
        1 => (s(), s()).prop_map(|(a, b)| Op::Order { a, b }),
        1 => s().prop_map(|s| Op::SyncStream { s }),
        1 => s().prop_map(|s| Op::SyncEvent { s }),
        1 => Just(Op::SyncDevice),
        2 => Just(Op::Check),
        1 => (0..2usize, prop::sample::select(vec![0, CHUNK, u64::MAX]))
            .prop_map(|(pool, keep)| Op::Trim { pool, keep }),
        1 => (0..2usize, attribute, 0..2u64)
            .prop_map(|(pool, attribute, value)| Op::Set { pool, attribute, value }),
        1 => (0..2usize, prop::sample::select(vec![0, 32 * MIB, u64::MAX]))
            .prop_map(|(pool, value)| Op::Set { pool, attribute: PoolAttribute::ReleaseThreshold, value }),
        1 => (how(), prop::sample::select(vec![0, VA + 1, u64::MAX]))
            .prop_map(|(how, size)| Op::Refused(Misuse::Size { how, size })),
        1 => (0..2usize).prop_map(|pool| Op::Refused(Misuse::OtherDevice { pool })),
    ]
}

/// Rounds, each a sequence of calls per thread.
type Case = Vec<Vec<Vec<Op>>>;

fn case() -> impl Strategy<Value = Case> {
    let thread = prop::collection::vec(op(), 0..20);
    let round = prop::collection::vec(thread, THREADS);
    prop::collection::vec(round, 1..4)
}

/// What was done, over every case run (shrinking included).
struct Counts {
    cases: AtomicU64,
    calls: AtomicU64,
    allocations: AtomicU64,
    bytes_allocated: AtomicU64,
    words_checked: AtomicU64,
    cross_stream_frees: AtomicU64,
    cross_thread_frees: AtomicU64,
    refused: AtomicU64,
}

static COUNTS: Counts = Counts {
    cases: AtomicU64::new(0),
    calls: AtomicU64::new(0),
    allocations: AtomicU64::new(0),
    bytes_allocated: AtomicU64::new(0),
    words_checked: AtomicU64::new(0),
    cross_stream_frees: AtomicU64::new(0),
    cross_thread_frees: AtomicU64::new(0),
    refused: AtomicU64::new(0),
};

struct Live {
    a: Allocation,
    pool: usize,
    stream: usize,
    sync: bool,
    value: u32,
}

/// What the threads share.
struct World {
    ctx: Context<Host>,
    pools: [Pool<Host>; 2],
    streams: Vec<Stream<Host>>,
    far: Stream<Host>,
    /// Every live allocation of every thread: start -> end.
    table: Mutex<BTreeMap<u64, u64>>,
    mailbox: Mutex<Vec<(Live, Event<Host>)>>,
    next_value: AtomicU32,
}

type Checked = Result<(), TestCaseError>;

impl World {
    fn new(host: &Arc<Host>) -> Self {
        let ctx = Context::new(Arc::clone(host)).unwrap();
        let props = PoolProps {
            chunk_size: Some(CHUNK),
            va_size: Some(VA),
            ..PoolProps::new(DEV)
        };
        // One pool grows by whole chunks, the other by chunks scaled to it
        // (by the divisor alone, from the first growth).
        let pools = [
            ctx.create_pool(&PoolProps {
                chunk_divisor: None,
                ..props.clone()
            })
            .unwrap(),
            ctx.create_pool(&PoolProps {
                chunk_divisor: Some(64),
                granule_growth_below: 0,
                ..props
            })
            .unwrap(),
        ];
        ctx.set_current_pool(&pools[0]).unwrap();
        let streams = (0..STREAMS)
            .map(|_| ctx.create_stream(DEV).unwrap())
            .collect();
        let far = ctx.create_stream(FAR).unwrap();
        Self {
            ctx,
            pools,
            streams,
            far,
            table: Mutex::default(),
            mailbox: Mutex::default(),
            next_value: AtomicU32::new(1),
        }
    }

    fn b(&self) -> &Host {
        self.ctx.backend()
    }

    /// Makes stream `b` wait for stream `a`'s work so far.
    fn order(&self, a: usize, b: usize) {
        if a != b {
            let e = self.ctx.create_event(DEV).unwrap();
            self.ctx.record_event(&e, &self.streams[a]).unwrap();
            self.ctx.stream_wait_event(&self.streams[b], &e).unwrap();
        }
    }

    fn alloc(&self, how: &How, s: usize, size: u64) -> (vmpool::Result<Allocation>, usize) {
        let stream = &self.streams[s];
        match *how {
            How::Current => (self.ctx.alloc_async(size, stream), 0),
            How::FromPool(p) => (
                self.ctx.alloc_from_pool_async(size, &self.pools[p], stream),
                p,
            ),
            How::Sync(p) => (self.pools[p].allocate(size), p),
        }
    }

    /// Enters a new allocation in the table of live ones.
    fn enter(&self, a: &Allocation) -> Checked {
        let (start, end) = (a.ptr().0, a.ptr().0 + a.size());
        let mut table = self.table.lock().unwrap();
        if let Some((&s, &e)) = table.range(..end).next_back() {
            prop_assert!(
                e <= start,
                "{:#x}+{} overlaps live {:#x}..{:#x}",
                start,
                a.size(),
                s,
                e
            );
        }
        table.insert(start, end);
        Ok(())
    }

    fn leave(&self, a: &Allocation) {
        self.table.lock().unwrap().remove(&a.ptr().0);
    }

    /// Reads its first, middle, last and one more word on stream `s`.
    fn check(&self, l: &Live, s: usize) -> Checked {
        let words = (l.a.size() / 4) as usize;
        if words == 0 {
            return Ok(());
        }
        for word in [0, words / 2, words - 1, l.value as usize % words] {
            let mut bytes = [0u8; 4];
            self.b()
                .copy_to_host(
                    self.streams[s].raw(),
                    l.a.ptr().byte_add(word * 4),
                    &mut bytes,
                )
                .unwrap();
            prop_assert_eq!(
                u32::from_ne_bytes(bytes),
                l.value,
                "word {} of {} ({} bytes)",
                word,
                l.a.ptr(),
                l.a.size()
            );
        }
        COUNTS.words_checked.fetch_add(4, Relaxed);
        Ok(())
    }

    fn free(&self, l: Live, on: usize, via_pool: bool) {
        self.leave(&l.a);
        if l.sync {
            // Its fill is done: a check, or a synchronization, came after.
            self.pools[l.pool].free(l.a).unwrap();
            return;
        }
        if l.stream != on {
            COUNTS.cross_stream_frees.fetch_add(1, Relaxed);
        }
        if via_pool {
            self.pools[l.pool].free_async(l.a, &self.streams[on])
        } else {
            self.ctx.free_async(l.a, &self.streams[on])
        }
        .unwrap();
    }

    fn refused(&self, misuse: &Misuse) -> Checked {
        COUNTS.refused.fetch_add(1, Relaxed);
        match misuse {
            Misuse::Size { how, size } => {
                let (r, _) = self.alloc(how, 0, *size);
                prop_assert!(
                    matches!(r, Err(Error::InvalidSize { requested, .. }) if requested == *size),
                    "size {}: {:?}",
                    size,
                    r
                );
            }
            Misuse::OtherDevice { pool } => {
                let r = self.pools[*pool].allocate_async(MIB, &self.far);
                prop_assert!(
                    matches!(r, Err(Error::WrongDevice { .. })),
                    "a stream of another device: {:?}",
                    r
                );
            }
        }
        Ok(())
    }

    /// One thread's calls of one round.
    fn run(&self, ops: &[Op], live: &mut Vec<Live>) -> Checked {
        for op in ops {
            COUNTS.calls.fetch_add(1, Relaxed);
            match *op {
                Op::Alloc {
                    ref how,
                    s,
                    size,
                    late,
                } if live.len() < MAX_LIVE => {
                    let (a, pool) = self.alloc(how, s, size);
                    let a = a.unwrap();
                    self.enter(&a)?;
                    let value = self.next_value.fetch_add(1, Relaxed);
                    let words = (a.size() / 4) as usize;
                    let stream = self.streams[s].raw();
                    if late > 0 {
                        self.b().delay(stream, Duration::from_millis(late)).unwrap();
                    }
                    if words > 0 {
                        self.b().fill_u32(stream, a.ptr(), words, value).unwrap();
                    }
                    COUNTS.allocations.fetch_add(1, Relaxed);
                    COUNTS.bytes_allocated.fetch_add(size, Relaxed);
                    let sync = matches!(how, How::Sync(_));
                    live.push(Live {
                        a,
                        pool,
                        stream: s,
                        sync,
                        value,
                    });
                }
                Op::Alloc { .. } => {}
                Op::Free {
                    i,
                    on,
                    check,
                    via_pool,
                } if !live.is_empty() => {
                    let l = live.swap_remove(i % live.len());
                    if check {
                        // Every queued write has landed, a late one of a
                        // previous owner included.
                        self.ctx.synchronize_device(DEV).unwrap();
                    }
                    if check || l.sync {
                        self.check(&l, l.stream)?;
                    }
                    self.order(l.stream, on);
                    self.free(l, on, via_pool);
                }
                Op::Free { .. } => {}
                Op::Hand { i } => {
                    let mut mailbox = self.mailbox.lock().unwrap();
                    let Some(pick) = (0..live.len())
                        .map(|k| (i + k) % live.len())
                        .find(|&k| !live[k].sync)
                    else {
                        continue;
                    };
                    if mailbox.len() < MAILBOX {
                        let l = live.swap_remove(pick);
                        let e = self.ctx.create_event(DEV).unwrap();
                        self.ctx.record_event(&e, &self.streams[l.stream]).unwrap();
                        mailbox.push((l, e));
                    }
                }
                Op::Take { on, check } => {
                    let taken = self.mailbox.lock().unwrap().pop();
                    if let Some((l, e)) = taken {
                        self.ctx.stream_wait_event(&self.streams[on], &e).unwrap();
                        if check {
                            self.check(&l, on)?;
                        }
                        COUNTS.cross_thread_frees.fetch_add(1, Relaxed);
                        self.free(l, on, false);
                    }
                }
                Op::Delay { s, ms } => self
                    .b()
                    .delay(self.streams[s].raw(), Duration::from_millis(ms))
                    .unwrap(),
                Op::Order { a, b } => self.order(a, b),
                Op::SyncStream { s } => self.ctx.synchronize_stream(&self.streams[s]).unwrap(),
                Op::SyncEvent { s } => {
                    let e = self.ctx.create_event(DEV).unwrap();
                    self.ctx.record_event(&e, &self.streams[s]).unwrap();
                    self.ctx.synchronize_event(&e).unwrap();
                }
                Op::SyncDevice => self.ctx.synchronize_device(DEV).unwrap(),
                Op::Check => {
                    self.ctx.synchronize_device(DEV).unwrap();
                    for l in live.iter() {
                        self.check(l, l.stream)?;
                    }
                }
                Op::Trim { pool, keep } => self.pools[pool].trim_to(keep).unwrap(),
                Op::Set {
                    pool,
                    attribute,
                    value,
                } => self.pools[pool].set_attribute(attribute, value).unwrap(),
                Op::Refused(ref misuse) => self.refused(misuse)?,
            }
        }
        Ok(())
    }

    /// Between rounds, with no thread running.
    fn quiet_checks(&self, lives: &[Vec<Live>]) -> Checked {
        self.ctx.synchronize_device(DEV).unwrap();
        let mailbox = self.mailbox.lock().unwrap();
        let all: Vec<&Live> = lives
            .iter()
            .flatten()
            .chain(mailbox.iter().map(|(l, _)| l))
            .collect();
        let mut rounded = [0u64; 2];
        for l in &all {
            self.check(l, l.stream)?;
            rounded[l.pool] += l.a.size().next_multiple_of(256);
        }
        prop_assert_eq!(self.table.lock().unwrap().len(), all.len());
        for (pool, rounded) in self.pools.iter().zip(rounded) {
            pool.audit()
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let used = pool.attribute(PoolAttribute::UsedMemCurrent);
            prop_assert!(
                rounded <= used && used <= rounded + rounded / 8,
                "{} bytes used for {} live (rounded)",
                used,
                rounded
            );
            prop_assert!(pool.attribute(PoolAttribute::UsedMemHigh) >= used);
        }
        Ok(())
    }
}

fn run_case(case: Case) -> Checked {
    COUNTS.cases.fetch_add(1, Relaxed);
    let host = Host::new(HostConfig {
        devices: 2,
        first_device: 0,
        memory_per_device: 2 << 30,
        granularity: 2 << 20,
    })
    .unwrap();
    {
        let world = World::new(&host);
        let mut lives: Vec<Vec<Live>> = (0..THREADS).map(|_| Vec::new()).collect();
        for round in &case {
            let results: Vec<Checked> = std::thread::scope(|scope| {
                let handles: Vec<_> = round
                    .iter()
                    .zip(lives.iter_mut())
                    .map(|(ops, live)| {
                        let world = &world;
                        scope.spawn(move || world.run(ops, live))
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            results.into_iter().collect::<Checked>()?;
            world.quiet_checks(&lives)?;
        }
        let handed = std::mem::take(&mut *world.mailbox.lock().unwrap());
        for l in lives
            .into_iter()
            .flatten()
            .chain(handed.into_iter().map(|(l, _)| l))
        {
            let on = l.stream;
            world.free(l, on, false);
        }
        world.ctx.synchronize_device(DEV).unwrap();
        for pool in &world.pools {
            pool.trim_to(0).unwrap();
            let st = pool.stats();
            prop_assert_eq!(
                (st.used_bytes, st.pending_bytes, st.reserved_bytes),
                (0, 0, 0)
            );
        }
    }
    prop_assert_eq!(host.census(), Census::default());
    Ok(())
}

#[test]
fn threads_and_streams_against_a_model() {
    let config = contextualize_config(Config {
        cases: 128,
        max_shrink_iters: 256,
        source_file: Some(file!()),
        ..Config::default()
    });
    let deadline = std::env::var("VMPOOL_FUZZ_SECS").ok().map(|s| {
        Instant::now() + Duration::from_secs(s.parse().expect("VMPOOL_FUZZ_SECS: seconds"))
    });
    let started = Instant::now();
    loop {
        let mut runner = TestRunner::new(config.clone());
        if let Err(e) = runner.run(&case(), run_case) {
            panic!("{e}");
        }
        if deadline.is_none_or(|d| Instant::now() >= d) {
            break;
        }
    }
    let c = &COUNTS;
    eprintln!(
        "{} cases in {:.1} s: {} calls, {} allocations ({} bytes), {} words checked, \
         {} cross-stream and {} cross-thread frees, {} refused calls",
        c.cases.load(Relaxed),
        started.elapsed().as_secs_f64(),
        c.calls.load(Relaxed),
        c.allocations.load(Relaxed),
        c.bytes_allocated.load(Relaxed),
        c.words_checked.load(Relaxed),
        c.cross_stream_frees.load(Relaxed),
        c.cross_thread_frees.load(Relaxed),
        c.refused.load(Relaxed),
    );
}
