"""The demo's training parts (``mixprec.apps.demo``): the learning rate of a run on a time budget."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.apps.demo import TrainingClock, time_cosine_schedule


def _schedule(budget: float | None, warmup_steps: int = 4):
    clock = TrainingClock(budget)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)  # the rate is the factor
    return clock, time_cosine_schedule(optimizer, clock, warmup_steps=warmup_steps)


def _rate_after(schedule, steps: int) -> float:
    for _ in range(steps):
        schedule.optimizer.step()
        schedule.step()
    return schedule.get_last_lr()[0]


def test_the_time_budgets_learning_rate_warms_up_in_steps_then_follows_a_cosine_over_the_seconds():
    clock, schedule = _schedule(budget=100.0)
    assert [schedule.get_last_lr()[0], _rate_after(schedule, 1), _rate_after(schedule, 2)] == [0.25, 0.5, 1.0]
    for seconds, factor in [(0.0, 1.0), (25.0, 0.5 * (1 + math.cos(math.pi / 4))), (50.0, 0.5), (75.0, None),
                            (100.0, 0.0), (130.0, 0.0)]:
        clock.clock = seconds
        expected = factor if factor is not None else 0.5 * (1 + math.cos(3 * math.pi / 4))
        assert _rate_after(schedule, 1) == pytest.approx(expected, abs=1e-12), seconds


def test_the_rate_depends_on_the_seconds_spent_not_on_the_steps_taken():
    """Two runs at the same second of their budget have the same rate, whatever steps each took;
    a run with more seconds spent, at the same step, has a lower one."""
    fast_clock, fast = _schedule(budget=60.0)
    slow_clock, slow = _schedule(budget=60.0)
    fast_clock.clock = slow_clock.clock = 20.0
    assert _rate_after(fast, 40) == pytest.approx(_rate_after(slow, 10)) == pytest.approx(0.75)
    slow_clock.clock = 40.0
    assert _rate_after(slow, 30) == pytest.approx(0.25) and _rate_after(fast, 0) == pytest.approx(0.75)


def test_without_a_budget_the_rate_stays_at_its_peak_after_the_warm_up():
    clock, schedule = _schedule(budget=None)
    clock.clock = 1e6
    assert _rate_after(schedule, 10) == 1.0
