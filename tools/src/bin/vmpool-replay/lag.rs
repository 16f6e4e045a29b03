//! `--stream-lag`: the replay's stream kept behind its calls, as a GPU
//! keeps a program's stream behind the allocations that queue its
//! kernels, and waited for now and then, as a program waits to read a
//! result. Where stream-ordered frees come back to the heap, and which
//! freed units growth may move, follow that timing; a replay that queues
//! no work shows one point of the spread (docs/RESULTS.md, "The suites on
//! CUDA, the GQA decoder and generation at 0cb5488").

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use vmpool::vmm::testing::TestBackend;

/// How far behind the stream is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StreamLag {
    /// Work queued on the stream after an allocation.
    pub(crate) delay: Duration,
    /// After every this many allocations.
    pub(crate) every: u64,
    /// The calls wait for the stream every this many operations.
    pub(crate) wait_every: u64,
}

/// `--stream-lag MICROS,EVERY,WAIT`: `100,20,200` queues 100 us of work
/// after every 20th allocation and waits for the stream every 200
/// operations.
pub(crate) fn parse_stream_lag(s: &str) -> Result<StreamLag, String> {
    let fields: Vec<&str> = s.split(',').collect();
    let [micros, every, wait_every] = fields[..] else {
        return Err(format!(
            "`{s}`: three numbers, MICROS,EVERY,WAIT (say 100,20,200)"
        ));
    };
    let number = |what: &str, v: &str| -> Result<u64, String> {
        match v.trim().parse::<u64>() {
            Ok(0) | Err(_) => Err(format!(
                "`{s}`: {what} must be a whole number above 0, not `{v}`"
            )),
            Ok(n) => Ok(n),
        }
    };
    Ok(StreamLag {
        delay: Duration::from_micros(number("MICROS", micros)?),
        every: number("EVERY", every)?,
        wait_every: number("WAIT", wait_every)?,
    })
}

/// A lagging replay's backend, to queue the delays on, and its counts.
pub(crate) struct Lagging<B: TestBackend> {
    backend: Arc<B>,
    lag: StreamLag,
    allocations: u64,
    ops: u64,
}

impl<B: TestBackend> Lagging<B> {
    pub(crate) fn new(backend: Arc<B>, lag: StreamLag) -> Self {
        Self {
            backend,
            lag,
            allocations: 0,
            ops: 0,
        }
    }

    /// After an allocation: queues the delay on its turn.
    pub(crate) fn allocated(&mut self, stream: &B::Stream) -> Result<()> {
        self.allocations += 1;
        if self.allocations % self.lag.every == 0 {
            self.backend.delay(stream, self.lag.delay)?;
        }
        self.done(stream)
    }

    /// After a free.
    pub(crate) fn freed(&mut self, stream: &B::Stream) -> Result<()> {
        self.done(stream)
    }

    /// After any operation: waits for the stream on its turn, as the
    /// program would (the driver's wait: the pool is not told).
    fn done(&mut self, stream: &B::Stream) -> Result<()> {
        self.ops += 1;
        if self.ops % self.lag.wait_every == 0 {
            self.backend.synchronize_stream(stream)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_numbers_above_zero() {
        assert_eq!(
            parse_stream_lag("100,20,200"),
            Ok(StreamLag {
                delay: Duration::from_micros(100),
                every: 20,
                wait_every: 200,
            })
        );
        for bad in ["100,20", "100,20,200,1", "100,0,200", "x,20,200", ""] {
            assert!(parse_stream_lag(bad).is_err(), "{bad}");
        }
    }
}
