//! `--stream-lag`: the replay's stream kept behind its calls
//! ([`vmpool::vmm::testing::lag`]). Where stream-ordered frees come back
//! to the heap, and which freed units growth may move, follow that timing;
//! a replay that queues no work shows one point of the spread
//! (docs/RESULTS.md, "The suites on CUDA, the GQA decoder and generation
//! at 0cb5488").

use std::num::NonZeroU64;
use std::time::Duration;

use vmpool::vmm::testing::lag::StreamLag;

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
    let number = |what: &str, v: &str| -> Result<NonZeroU64, String> {
        v.trim()
            .parse::<NonZeroU64>()
            .map_err(|_| format!("`{s}`: {what} must be a whole number above 0, not `{v}`"))
    };
    Ok(StreamLag {
        delay: Duration::from_micros(number("MICROS", micros)?.get()),
        every: number("EVERY", every)?,
        wait_every: number("WAIT", wait_every)?,
    })
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
                every: NonZeroU64::new(20).unwrap(),
                wait_every: NonZeroU64::new(200).unwrap(),
            })
        );
        for bad in ["100,20", "100,20,200,1", "100,0,200", "x,20,200", ""] {
            assert!(parse_stream_lag(bad).is_err(), "{bad}");
        }
    }
}
