"""Which optimizer steps end a training iteration, for `install()`'s step
marks. A loop with one optimizer ends an iteration at each of its steps.
A loop with several (a GAN's discriminator and generator, a critic that
steps five times for each step of its actor) ends one only after the
last of them: marked at every optimizer step, its steps would alternate
between unlike halves, and a pool lays out a step only when it repeats
the one before (Note [Step layouts] in docs/DESIGN.md).

The optimizers' order of stepping is learnt: once the latest steps
repeat with some period (the smallest that fits two periods, and at
least `SHORTEST_WINDOW` steps once that many are known, so that a run of
one optimizer's steps is not taken for the whole pattern), every
period-th step ends an iteration. Until then, and again after the
pattern breaks (an optimizer added, a step skipped), every step does.
"""

from __future__ import annotations

# Steps remembered: periods up to half of it are found.
WINDOW = 64
# The fewest latest steps a period must fit, once that many are known.
SHORTEST_WINDOW = 16


def period(history: list[int]) -> int | None:
    """The smallest period `p` with which the latest
    `max(2p, SHORTEST_WINDOW)` entries of `history` (all of them, if
    fewer) repeat; `None` if none fits two periods."""
    n = len(history)
    for p in range(1, n // 2 + 1):
        span = min(n, max(2 * p, SHORTEST_WINDOW))
        if all(history[i] == history[i - p] for i in range(n - span + p, n)):
            return p
    return None


class Iterations:
    """The optimizers' steps of one process, in order."""

    def __init__(self) -> None:
        self._history: list[int] = []
        self._period: int | None = None
        self._since_end = 0

    def ends_iteration(self, optimizer: object) -> bool:
        """Whether the step `optimizer` just took ends an iteration."""
        key = id(optimizer)
        if self._period is not None and key != self._history[-self._period]:
            # The pattern broke: learn it again from here.
            self._history.clear()
            self._period = None
        self._history.append(key)
        del self._history[:-WINDOW]
        if self._period is None:
            self._period = period(self._history)
            self._since_end = 0
            return True
        self._since_end += 1
        if self._since_end < self._period:
            return False
        self._since_end = 0
        return True
