//! Marks deferred past the frees their step carries (Note [Step layouts]
//! in docs/DESIGN.md, "Marks deferred past carried frees"): a program's
//! mark that would place a layout's region beside allocations the step
//! carries into the next waits for their frees, and goes to the pool's
//! next allocation after them.

use rustc_hash::FxHashSet;

use super::region::Event;

/// Whether marks wait, and for what.
#[derive(Debug, Default)]
pub(super) struct Deferral {
    /// The allocations of the step a deferred mark waits for, by ordinal.
    awaited: Option<FxHashSet<u32>>,
    /// The awaited allocations are freed, or the step went another way
    /// than its layout: the mark goes to the next allocation.
    due: bool,
    /// The last mark deferred saw its step's carried allocations freed
    /// before the program's next mark: marks go on waiting, whether or
    /// not the step now frees the step before's (once deferred, it frees
    /// them before its mark).
    carries: bool,
}

impl Deferral {
    /// Whether the program's mark at the end of a step of `events` waits,
    /// for the allocations the step carries into the next: when the step
    /// freed an allocation the step before it made (`freed_carried`), or
    /// the last mark deferred saw its wait end, it waits for the
    /// allocations it made and has not freed. A mark that finds one
    /// waiting ends the wait, and is made: what it waited for outlived a
    /// whole step, and was not carried.
    pub(super) fn defer(&mut self, events: &[Event], freed_carried: bool) -> bool {
        if self.awaited.take().is_some() {
            self.carries = false;
            return false;
        }
        if !freed_carried && !self.carries {
            return false;
        }
        let mut live = FxHashSet::default();
        for event in events {
            match *event {
                Event::Alloc(o) => live.insert(o),
                Event::Free(o) => live.remove(&o),
            };
        }
        if live.is_empty() {
            return false;
        }
        self.awaited = Some(live);
        true
    }

    /// The step freed the allocation of ordinal `o`: the last awaited
    /// makes the mark due.
    pub(super) fn freed(&mut self, o: u32) {
        if let Some(awaited) = &mut self.awaited {
            if awaited.remove(&o) && awaited.is_empty() {
                self.awaited = None;
                self.due = true;
                self.carries = true;
            }
        }
    }

    /// The step went another way than its layout (a model torn down,
    /// say): not the step a deferred mark waits out, which goes to the
    /// next allocation.
    pub(super) fn diverged(&mut self) {
        if self.awaited.take().is_some() {
            self.due = true;
        }
    }

    /// A step was marked: nothing waits.
    pub(super) fn marked(&mut self) {
        self.awaited = None;
        self.due = false;
    }

    /// Whether a deferred mark is due, once.
    pub(super) fn take_due(&mut self) -> bool {
        std::mem::take(&mut self.due)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step of two allocations, the first freed within it.
    const STEP: [Event; 3] = [Event::Alloc(0), Event::Alloc(1), Event::Free(0)];

    #[test]
    fn a_step_that_freed_what_the_one_before_carried_waits_for_its_own() {
        let mut d = Deferral::default();
        assert!(!d.defer(&STEP, false), "nothing carried in: no wait");
        assert!(d.defer(&STEP, true));
        assert!(!d.take_due());
        d.freed(0);
        assert!(!d.take_due(), "ordinal 0 was not awaited");
        d.freed(1);
        assert!(d.take_due());
        assert!(!d.take_due(), "due once");
        // Once a wait has ended, marks go on waiting: the step now frees
        // what it carried before its mark.
        d.marked();
        assert!(d.defer(&STEP, false));
    }

    #[test]
    fn a_wait_the_next_mark_finds_ends_and_stops_waiting() {
        let mut d = Deferral::default();
        assert!(d.defer(&STEP, true));
        // Ordinal 1 outlived the step: not carried.
        assert!(!d.defer(&STEP, false));
        assert!(!d.take_due());
        d.marked();
        assert!(!d.defer(&STEP, false));
    }

    #[test]
    fn nothing_left_live_or_a_divergence_does_not_wait() {
        let mut d = Deferral::default();
        let freed_all = [Event::Alloc(0), Event::Free(0)];
        assert!(!d.defer(&freed_all, true));
        assert!(d.defer(&STEP, true));
        d.diverged();
        assert!(d.take_due(), "a step that went another way marks next");
        d.freed(1);
        assert!(!d.take_due(), "no longer waiting");
    }
}
