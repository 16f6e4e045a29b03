//! Allocation traces in the shared format (gzip'd or plain text):
//!
//! ```text
//! # comment; the first line may end with `peak_live N`
//! a <id> <bytes> <stream>     allocate
//! f <id> <stream>             free
//! s                           a step ends (`Pool::mark_step`)
//! ```
//!
//! Ids are renumbered into dense slots so that a replay indexes a `Vec`.
//! Pools write this format when they record (`record.rs`).

pub(crate) mod record;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};

/// One operation of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TraceOp {
    /// An allocation.
    Alloc {
        /// The allocation's slot: its id, renumbered densely from 0.
        slot: usize,
        /// Bytes asked for.
        size: u64,
        /// The stream it was made on, as the trace numbers streams.
        stream: u64,
    },
    /// The free of the allocation in `slot`.
    Free {
        /// The slot of the allocation freed.
        slot: usize,
        /// The stream it was freed on.
        stream: u64,
    },
    /// The program marked the end of a step ([`crate::Pool::mark_step`]).
    Step,
}

/// A parsed allocation trace.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    /// The operations, in the order recorded.
    pub ops: Vec<TraceOp>,
    /// Number of slots (distinct allocations).
    pub slots: usize,
    /// Highest total of live bytes, computed from the ops.
    pub peak_live: u64,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// Reading (or decompressing) the input failed.
    #[error("reading the trace: {0}")]
    Io(#[from] std::io::Error),
    /// A line is not a valid operation, or frees an id that is not live.
    #[error("line {line}: {reason}")]
    Parse {
        /// The line's number, from 1.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
}

impl Trace {
    /// Parses a trace, gzip'd (detected by its magic bytes) or plain.
    pub fn read(input: impl Read) -> Result<Self, TraceError> {
        let mut input = BufReader::new(input);
        let gzip = input.fill_buf()?.starts_with(&[0x1f, 0x8b]);
        if gzip {
            Self::parse(BufReader::new(flate2::read::MultiGzDecoder::new(input)))
        } else {
            Self::parse(input)
        }
    }

    fn parse(input: impl BufRead) -> Result<Self, TraceError> {
        let mut trace = Trace::default();
        let mut live_ids: HashMap<u64, (usize, u64)> = HashMap::new();
        let mut live = 0u64;
        for (i, line) in input.lines().enumerate() {
            let line = line?;
            let fail = |reason: String| TraceError::Parse {
                line: i + 1,
                reason,
            };
            let fields: Vec<&str> = line.split_whitespace().collect();
            let num = |k: usize, what: &str| -> Result<u64, TraceError> {
                fields
                    .get(k)
                    .ok_or_else(|| fail(format!("missing {what}")))?
                    .parse()
                    .map_err(|e| fail(format!("bad {what}: {e}")))
            };
            match fields.first() {
                None => {}
                Some(f) if f.starts_with('#') => {}
                Some(&"a") => {
                    let (id, size, stream) = (num(1, "id")?, num(2, "size")?, num(3, "stream")?);
                    let slot = trace.slots;
                    if live_ids.insert(id, (slot, size)).is_some() {
                        return Err(fail(format!("id {id} allocated twice")));
                    }
                    trace.slots += 1;
                    live += size;
                    trace.peak_live = trace.peak_live.max(live);
                    trace.ops.push(TraceOp::Alloc { slot, size, stream });
                }
                Some(&"f") => {
                    let (id, stream) = (num(1, "id")?, num(2, "stream")?);
                    let (slot, size) = live_ids
                        .remove(&id)
                        .ok_or_else(|| fail(format!("free of id {id}, which is not live")))?;
                    live -= size;
                    trace.ops.push(TraceOp::Free { slot, stream });
                }
                Some(&"s") => trace.ops.push(TraceOp::Step),
                Some(other) => return Err(fail(format!("unknown op {other:?}"))),
            }
        }
        Ok(trace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_gzip() {
        let text = "# x peak_live 30\na 1 10 0\na 2 20 7\nf 1 0\ns\na 3 5 0\nf 2 7\n";
        let plain = Trace::read(text.as_bytes()).unwrap();
        assert_eq!(plain.peak_live, 30);
        assert_eq!(plain.slots, 3);
        assert_eq!(plain.ops[3], TraceOp::Step);
        assert_eq!(
            plain.ops[4],
            TraceOp::Alloc {
                slot: 2,
                size: 5,
                stream: 0
            }
        );
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, text.as_bytes()).unwrap();
        let zipped = Trace::read(&gz.finish().unwrap()[..]).unwrap();
        assert_eq!(zipped.ops, plain.ops);
    }

    #[test]
    fn rejects_bad_lines() {
        for bad in ["a 1 x 0", "f 9 0", "a 1 1 0\na 1 1 0", "z 1"] {
            assert!(Trace::read(bad.as_bytes()).is_err(), "{bad:?} accepted");
        }
    }
}
