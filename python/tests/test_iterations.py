"""`install()`'s choice of the optimizer steps that end an iteration."""

from __future__ import annotations

from vmpool._iterations import Iterations, period


def marks(order: str) -> str:
    """The steps of `order` (one letter an optimizer) that end an
    iteration, as `|` after them."""
    optimizers = {name: object() for name in set(order)}
    iterations = Iterations()
    return "".join(name + ("|" if iterations.ends_iteration(optimizers[name]) else "") for name in order)


def test_one_optimizer_ends_every_iteration():
    assert marks("A" * 6) == "A|" * 6


def test_two_optimizers_end_an_iteration_once_their_order_is_seen_twice():
    # Every step until the order repeats, then after every second.
    assert marks("DG" * 5) == "D|G|D|G|" + "DG|" * 3


def test_a_critic_stepping_five_times_is_not_taken_for_the_pattern():
    # Its first run looks like one optimizer; the generator's step breaks
    # that, and the order is learnt at the fifth critic step of the third
    # iteration, after which each iteration ends once, there.
    order = ("D" * 5 + "G") * 5
    learning = ("D|" * 5 + "G|") * 2 + "D|" * 5
    assert marks(order) == learning + "GDDDDD|" * 2 + "G"


def test_a_broken_pattern_is_learnt_again():
    # G skipped once: the next D breaks the order, and every step marks
    # until it has repeated twice again.
    got = marks("DG" * 4 + "D" + "DG" * 6)
    assert got == "D|G|D|G|" + "DG|" * 2 + "D" + "D|G|D|G|" + "DG|" * 4


def test_period_is_the_smallest_that_fits():
    assert period([1]) is None
    assert period([1, 1]) == 1
    assert period([1, 2, 1]) is None
    assert period([1, 2, 1, 2]) == 2
    # A run of one optimizer within a longer pattern does not count once
    # the window holds the rest.
    history = [1, 1, 1, 1, 1, 2] * 3
    assert period(history) == 6
    assert period(history + [1, 1]) == 6
