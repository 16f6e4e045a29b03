//! When growth works at a program's step mark: gathering free regions
//! after a step that created chunks, joining free units after steps that
//! kept moving them (Note [Growth and remapping], "Gathering at marks"
//! and "Joining where steps keep moving units", in docs/DESIGN.md).

/// Steps in a row, each moving units, after which the pool joins its free
/// units: a workload that re-forms the same space step after step (a
/// mixture of experts whose tensors drift in size) rather than one whose
/// new shapes move units now and then (random batches: 3-5 % of the
/// steps). On the MoE's 300-step host replay, stream-ordered, 4 and 8
/// settle it by step 111; 16 joins too late, and it maps to the end
/// (docs/RESULTS.md, "Joining where steps keep moving units").
const MOVING_STEPS: u32 = 8;

/// What a mark has growth do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct MarkWork {
    /// Gather the whole free regions into one range.
    pub(crate) gather: bool,
    /// Join free units into larger chunks.
    pub(crate) join: bool,
}

/// Growth's counts as they were at the last mark, and the moving steps
/// in a row since.
#[derive(Debug, Default)]
pub(crate) struct AtMarks {
    created: u64,
    moved: u64,
    moving_steps: u32,
}

/// Growth's counts at a mark.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Counts {
    /// Chunks created so far.
    pub(crate) created: u64,
    /// Units moved so far.
    pub(crate) moved: u64,
}

impl AtMarks {
    /// The work due at a mark, given growth's counts now: for a
    /// program's mark after the first steps (`later`), a gathering where
    /// the step created chunks, and a joining after [`MOVING_STEPS`] such
    /// marks in a row whose steps moved units. Other marks do nothing and
    /// end the run of moving steps.
    pub(crate) fn due(&mut self, later: bool, now: Counts) -> MarkWork {
        if !later {
            self.moving_steps = 0;
            return MarkWork::default();
        }
        self.moving_steps = if now.moved != self.moved {
            self.moving_steps + 1
        } else {
            0
        };
        let join = self.moving_steps >= MOVING_STEPS;
        if join {
            self.moving_steps = 0;
        }
        MarkWork {
            gather: now.created != self.created,
            join,
        }
    }

    /// Takes growth's counts after the mark's work, so that the chunks a
    /// gathering's bridge creates and the units it moves count for no
    /// step.
    pub(crate) fn counted(&mut self, now: Counts) {
        self.created = now.created;
        self.moved = now.moved;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(created: u64, moved: u64) -> Counts {
        Counts { created, moved }
    }

    #[test]
    fn joins_after_the_moving_steps_in_a_row_then_counts_afresh() {
        let mut marks = AtMarks::default();
        let mut joins = Vec::new();
        for step in 1..=2 * u64::from(MOVING_STEPS) {
            let work = marks.due(true, counts(0, step));
            assert!(!work.gather);
            joins.push(work.join);
            marks.counted(counts(0, step));
        }
        let at: Vec<usize> = (0..joins.len()).filter(|&i| joins[i]).collect();
        let n = MOVING_STEPS as usize;
        assert_eq!(at, [n - 1, 2 * n - 1]);
    }

    #[test]
    fn a_still_step_or_another_mark_ends_the_run() {
        let mut marks = AtMarks::default();
        let mut moved = 0;
        for _ in 1..MOVING_STEPS {
            moved += 1;
            assert!(!marks.due(true, counts(0, moved)).join);
            marks.counted(counts(0, moved));
        }
        // A step that moved nothing.
        assert!(!marks.due(true, counts(0, moved)).join);
        moved += 1;
        assert!(!marks.due(true, counts(0, moved)).join);
        // A mark where the program emptied the pool, or in the first steps.
        let mut marks = AtMarks::default();
        for m in 1..MOVING_STEPS {
            marks.due(true, counts(0, u64::from(m)));
            marks.counted(counts(0, u64::from(m)));
        }
        assert_eq!(marks.due(false, counts(0, 99)), MarkWork::default());
        assert!(!marks.due(true, counts(0, 100)).join);
    }

    #[test]
    fn gathers_after_a_step_that_created_chunks() {
        let mut marks = AtMarks::default();
        assert!(marks.due(true, counts(3, 0)).gather);
        marks.counted(counts(3, 0));
        assert!(!marks.due(true, counts(3, 0)).gather);
        assert!(!marks.due(false, counts(5, 0)).gather);
    }
}
