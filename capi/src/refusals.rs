//! Refused frees, counted per device. The first [`IN_FULL`] are logged in
//! full; after them only a count, when the total reaches a power of ten
//! (100, 1,000, ...), so that a program that frees the same pointers over
//! and over does not flood its log. `vmpool_stats_t.refused_frees` has the
//! exact number.

use std::sync::atomic::{AtomicU64, Ordering};

/// Refusals logged one by one.
pub(crate) const IN_FULL: u64 = 10;

/// What to log for one refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Say {
    /// The refusal itself; `last`: the last one logged in full.
    InFull { last: bool },
    /// A count: `more` refusals since the last line logged, `total` in all.
    Count { more: u64, total: u64 },
    /// Nothing: counted, and said in a later count.
    Nothing,
}

#[derive(Debug, Default)]
pub(crate) struct Refusals(AtomicU64);

impl Refusals {
    /// Counts one refusal; says what to log for it.
    pub(crate) fn count(&self) -> Say {
        let total = self.0.fetch_add(1, Ordering::Relaxed) + 1;
        if total <= IN_FULL {
            Say::InFull {
                last: total == IN_FULL,
            }
        } else if is_power_of_ten(total) {
            Say::Count {
                more: total - total / 10,
                total,
            }
        } else {
            Say::Nothing
        }
    }

    /// Refusals so far.
    pub(crate) fn total(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

fn is_power_of_ten(mut n: u64) -> bool {
    while n != 0 && n % 10 == 0 {
        n /= 10;
    }
    n == 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ten_in_full_then_a_count_at_each_power_of_ten() {
        let r = Refusals::default();
        let said: Vec<(u64, Say)> = (1..=20_000)
            .map(|n| (n, r.count()))
            .filter(|(_, s)| *s != Say::Nothing)
            .collect();
        assert_eq!(r.total(), 20_000);
        assert_eq!(said.len(), 10 + 3);
        assert!(said[..9]
            .iter()
            .all(|(_, s)| *s == Say::InFull { last: false }));
        assert_eq!(said[9], (10, Say::InFull { last: true }));
        assert_eq!(
            said[10..],
            [
                (
                    100,
                    Say::Count {
                        more: 90,
                        total: 100
                    }
                ),
                (
                    1_000,
                    Say::Count {
                        more: 900,
                        total: 1_000
                    }
                ),
                (
                    10_000,
                    Say::Count {
                        more: 9_000,
                        total: 10_000
                    }
                ),
            ]
        );
    }
}
