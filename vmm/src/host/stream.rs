//! Streams as worker threads, events as completion points.
//!
//! Each stream owns a thread that runs its operations in order. Recording an
//! event queues a fresh [`Point`] that the worker completes when it reaches
//! it; the event remembers its latest point, so a query or a wait sees
//! exactly the work captured by the last record, as in CUDA. A stream that
//! waits on an event queues a wait on the point current at that moment.
//! On a stream with nothing queued, a record completes its point at once,
//! as a GPU completes an event on an idle stream within microseconds: what
//! a caller sees then does not depend on when the worker thread runs.
//!
//! A failed operation (an access to unmapped memory, say) makes its stream
//! faulted: later operations are skipped and every later point completes
//! with the error, which the next synchronize or query reports.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::thread;
#[cfg(feature = "testing")]
use std::time::Duration;

#[cfg(feature = "testing")]
use super::testing::Work;
use super::Memory;
#[cfg(feature = "testing")]
use crate::DevicePtr;
use crate::{DeviceId, Error, ErrorKind, EventStatus, Result};

/// Recovers a lock poisoned by a panic elsewhere: the tables it guards are
/// updated in single steps, so they are never left half-changed.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

enum PointState {
    Pending,
    Done,
    Failed(Error),
}

/// One position in one stream.
pub(super) struct Point {
    state: Mutex<PointState>,
    done: Condvar,
}

impl Point {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(PointState::Pending),
            done: Condvar::new(),
        })
    }

    fn complete(&self, fault: &Option<Error>) {
        *lock(&self.state) = match fault {
            None => PointState::Done,
            Some(err) => PointState::Failed(err.clone()),
        };
        self.done.notify_all();
    }

    fn status(&self) -> Result<EventStatus> {
        match &*lock(&self.state) {
            PointState::Pending => Ok(EventStatus::Pending),
            PointState::Done => Ok(EventStatus::Complete),
            PointState::Failed(err) => Err(err.clone()),
        }
    }

    fn wait(&self) -> Result<()> {
        let mut state = lock(&self.state);
        loop {
            match &*state {
                PointState::Pending => {
                    state = self.done.wait(state).unwrap_or_else(|p| p.into_inner())
                }
                PointState::Done => return Ok(()),
                PointState::Failed(err) => return Err(err.clone()),
            }
        }
    }
}

enum Op {
    Signal(Arc<Point>),
    Wait(Arc<Point>),
    #[cfg(feature = "testing")]
    Work(Work),
}

/// What a stream's worker shares with the stream's callers.
#[derive(Default)]
struct Progress {
    /// Operations sent and not yet finished.
    queued: AtomicUsize,
    /// The error that faulted the stream, if one did.
    fault: Mutex<Option<Error>>,
}

/// A host-backend stream. Dropping it lets queued work finish, then the
/// worker thread exits.
pub struct HostStream {
    device: DeviceId,
    ops: mpsc::Sender<Op>,
    progress: Arc<Progress>,
    /// Acting as if a CUDA graph capture were under way (see
    /// [`HostStream::set_capturing`]).
    capture: Arc<Capture>,
    memory: Arc<Memory>,
}

/// A stream's capture state, listed in [`Memory::captures`] while on.
#[derive(Default)]
pub(crate) struct Capture {
    on: AtomicBool,
    /// A refused call spoiled it: ending it is an error.
    invalidated: AtomicBool,
}

impl Capture {
    pub(crate) fn spoil(&self) {
        self.invalidated.store(true, Ordering::Release);
    }
}

impl HostStream {
    pub(super) fn spawn(device: DeviceId, memory: Arc<Memory>) -> Result<Self> {
        let (ops, queue) = mpsc::channel();
        let progress = Arc::new(Progress::default());
        let shared = Arc::clone(&progress);
        thread::Builder::new()
            .name(format!("vmm-host-stream-{}", device.0))
            .spawn({
                let memory = Arc::clone(&memory);
                move || run(device, &memory, queue, &shared)
            })
            .map_err(|e| Error::rejected("create_stream", ErrorKind::Other, e.to_string()))?;
        Ok(Self {
            device,
            ops,
            progress,
            capture: Arc::default(),
            memory,
        })
    }

    pub(super) fn memory(&self) -> &Memory {
        &self.memory
    }

    /// The device the stream belongs to.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// Makes the stream act as if a graph capture began (`true`) or ended
    /// (`false`) on it, in the driver's global mode. Nothing is captured;
    /// what the driver refuses during a capture is refused: work on the
    /// stream; from any stream, a synchronisation or an event query (the
    /// calls global mode forbids, which spoil every capture under way); a
    /// wait on the capturing stream for an event recorded outside the
    /// capture; and any query of, synchronisation with or (from outside
    /// the capture) wait for an event last recorded on it while capturing,
    /// until that event is recorded again. Ending a spoiled capture is an
    /// error.
    pub(super) fn set_capturing(&self, call: &'static str, on: bool) -> Result<()> {
        if self.capture.on.swap(on, Ordering::AcqRel) == on {
            return Err(Error::invalid(
                call,
                if on {
                    "the stream is capturing already"
                } else {
                    "the stream is not capturing"
                },
            ));
        }
        let mut captures = lock(&self.memory.captures);
        if on {
            captures.push(Arc::clone(&self.capture));
            return Ok(());
        }
        captures.retain(|c| !Arc::ptr_eq(c, &self.capture));
        if self.capture.invalidated.swap(false, Ordering::AcqRel) {
            return Err(Error::rejected(
                call,
                ErrorKind::Other,
                "a refused call invalidated the capture (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)",
            ));
        }
        Ok(())
    }

    pub(super) fn capturing(&self) -> bool {
        self.capture.on.load(Ordering::Acquire)
    }

    /// A refusal of `call` that spoils this stream's capture.
    fn invalidate(&self, call: &'static str, why: &str) -> Error {
        self.capture.spoil();
        Error::rejected(call, ErrorKind::Other, why)
    }

    fn send(&self, op: Op) -> Result<()> {
        // The worker only exits once this sender is gone, so a send cannot
        // fail while `self` exists, short of the worker panicking.
        self.progress.queued.fetch_add(1, Ordering::AcqRel);
        self.ops.send(op).map_err(|_| {
            self.progress.queued.fetch_sub(1, Ordering::AcqRel);
            Error::rejected("stream", ErrorKind::Other, "stream worker has died")
        })
    }

    /// Queues `point`, or completes it at once when nothing is queued
    /// before it (with the stream's fault, if it has one).
    fn signal(&self, point: &Arc<Point>) -> Result<()> {
        if self.progress.queued.load(Ordering::Acquire) == 0 {
            // The worker finished everything sent so far, faults included.
            point.complete(&lock(&self.progress.fault));
            return Ok(());
        }
        self.send(Op::Signal(Arc::clone(point)))
    }

    pub(super) fn synchronize(&self) -> Result<()> {
        self.memory.not_in_capture("synchronize_stream")?;
        let point = Point::new();
        self.signal(&point)?;
        point.wait()
    }
}

/// Test work (the `testing` feature), run in order with the stream's other
/// operations.
#[cfg(feature = "testing")]
impl HostStream {
    fn not_capturing(&self, call: &'static str) -> Result<()> {
        if self.capturing() {
            return Err(self.invalidate(
                call,
                "the stream is capturing a graph; the host backend captures no work",
            ));
        }
        Ok(())
    }

    pub(super) fn fill(&self, dst: DevicePtr, count: usize, value: u32) -> Result<()> {
        self.not_capturing("fill_u32")?;
        self.send(Op::Work(Work::Fill { dst, count, value }))
    }

    pub(super) fn copy(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        self.memory.not_in_capture("copy_to_host")?;
        let (reply, answer) = mpsc::channel();
        self.send(Op::Work(Work::Copy {
            src,
            len: dst.len(),
            reply,
        }))?;
        let bytes = answer
            .recv()
            .map_err(|_| Error::rejected("copy_to_host", ErrorKind::Other, "worker has died"))??;
        dst.copy_from_slice(&bytes);
        Ok(())
    }

    pub(super) fn delay(&self, duration: Duration) -> Result<()> {
        self.not_capturing("delay")?;
        self.send(Op::Work(Work::Delay(duration)))
    }
}

// Only test work uses the device and the memory.
#[cfg_attr(not(feature = "testing"), allow(unused_variables))]
fn run(device: DeviceId, memory: &Memory, queue: mpsc::Receiver<Op>, progress: &Progress) {
    let mut fault: Option<Error> = None;
    for op in queue {
        let faulted = fault.is_some();
        match op {
            Op::Signal(point) => point.complete(&fault),
            Op::Wait(point) => {
                if let Err(err) = point.wait() {
                    fault.get_or_insert(err);
                }
            }
            #[cfg(feature = "testing")]
            Op::Work(work) => work.run(device, memory, &mut fault),
        }
        if !faulted && fault.is_some() {
            *lock(&progress.fault) = fault.clone();
        }
        progress.queued.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A host-backend event: the point captured by its last record, if any.
pub struct HostEvent {
    device: DeviceId,
    latest: Mutex<Option<Arc<Point>>>,
    /// Last recorded on a stream that was capturing.
    captured: AtomicBool,
    /// Counts this event in the backend's census while it lives.
    memory: Arc<Memory>,
}

impl HostEvent {
    pub(super) fn new(device: DeviceId, memory: Arc<Memory>) -> Self {
        memory.events.fetch_add(1, Ordering::Relaxed);
        Self {
            device,
            latest: Mutex::new(None),
            captured: AtomicBool::new(false),
            memory,
        }
    }

    /// The device the event belongs to.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    fn latest(&self) -> Option<Arc<Point>> {
        lock(&self.latest).clone()
    }

    pub(super) fn record(&self, stream: &HostStream) -> Result<()> {
        same_device("record_event", self.device, stream.device)?;
        // Hold the event's lock across the send so that two records racing
        // on one event leave it pointing at the later of the two.
        let mut latest = lock(&self.latest);
        if stream.capturing() {
            // Becomes a node of the graph: nothing to wait for outside it.
            self.captured.store(true, Ordering::Release);
            *latest = None;
            return Ok(());
        }
        let point = Point::new();
        stream.signal(&point)?;
        self.captured.store(false, Ordering::Release);
        *latest = Some(point);
        Ok(())
    }

    /// Refuses, as the driver does, an event last recorded while capturing.
    fn not_captured(&self, call: &'static str) -> Result<()> {
        if self.captured.load(Ordering::Acquire) {
            return Err(Error::rejected(
                call,
                ErrorKind::Other,
                "the event was last recorded in a capturing stream (CUDA_ERROR_CAPTURED_EVENT)",
            ));
        }
        Ok(())
    }

    pub(super) fn query(&self) -> Result<EventStatus> {
        self.memory.not_in_capture("query_event")?;
        self.not_captured("query_event")?;
        self.latest()
            .map_or(Ok(EventStatus::Complete), |p| p.status())
    }

    pub(super) fn synchronize(&self) -> Result<()> {
        self.memory.not_in_capture("synchronize_event")?;
        self.not_captured("synchronize_event")?;
        self.latest().map_or(Ok(()), |p| p.wait())
    }

    pub(super) fn make_wait(&self, stream: &HostStream) -> Result<()> {
        if stream.capturing() && self.captured.load(Ordering::Acquire) {
            // A join inside the capture: ordering the host does not model.
            return Ok(());
        }
        self.not_captured("stream_wait_event")?;
        if stream.capturing() {
            return Err(stream.invalidate(
                "stream_wait_event",
                "a capturing stream cannot wait for an event recorded outside its capture \
                 (CUDA_ERROR_STREAM_CAPTURE_ISOLATION)",
            ));
        }
        match self.latest() {
            Some(point) => stream.send(Op::Wait(point)),
            None => Ok(()),
        }
    }
}

fn same_device(call: &'static str, a: DeviceId, b: DeviceId) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(Error::invalid(
            call,
            format!("event of {a} used with a stream of {b}"),
        ))
    }
}

impl Drop for HostStream {
    /// A stream that goes while capturing ends its capture (as destroying
    /// a CUDA stream does), so that the backend does not refuse calls for a
    /// capture that no one can end.
    fn drop(&mut self) {
        if self.capturing() {
            // Whether the capture was spoiled no longer matters.
            let _ = self.set_capturing("drop", false);
        }
    }
}

impl Drop for HostEvent {
    fn drop(&mut self) {
        self.memory.events.fetch_sub(1, Ordering::Relaxed);
    }
}
