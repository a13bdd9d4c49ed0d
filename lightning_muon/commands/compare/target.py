"""Steps to a target loss (``compare --target``): the target, the validation schedule that resolves the step at
which a run reaches it, and a side's steps over its seeds. Pure functions on plain data; the callback that follows
the schedule inside a fit is `lightning_muon.commands.compare.near_target.NearTargetValidation`.

A run's steps to the target are its first validation at or below it: an upper bound, with the validation before it
as the lower bound (`Crossing`). On the grid of validations alone (``--val_points``, 12 by default) that bracket
is a twelfth of the run wide, too coarse to tell recipes apart. So `TargetSchedule` keeps the grid and adds
validations near the target, steered by the straight line through the last two validations: while that line
reaches the target within two grid intervals and no validation has reached it yet, the next validation is halfway
to where the line reaches it, at most a quarter of a grid interval on, and at least ``resolution`` times the steps
done on (at least one step). The validations close in on the crossing, the last gaps ``resolution`` long.

A falling loss curve mostly flattens (it is convex), so the straight line through two of its points reaches the
target sooner than the curve does, and halfway to that early guess is earlier still: the validations stop short of
the crossing until the last gap, and the bracket of a crossing found that way is at most ``resolution`` of its
step wide (2% by default: reached at step 150 means after step 147). Looking two grid intervals ahead also catches
the steeper fall of an lr schedule's cooldown. A drop that no straight line foresaw (a plateau, then a sudden
fall) is bracketed by the grid, or by a quarter of a grid interval once near; each bracket is reported, so a wide
one shows. On the tests' model curves of 300 steps (`tests/commands/test_compare_target.py`): 12 and 5 validations
beyond a grid of 12 (an exponential approach, a power law with an lr cooldown), each crossing within 2%.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: The default ``--resolution``: validations near the target at most 2% of a run's steps apart.
RESOLUTION = 0.02
#: How far ahead, in grid intervals, the line through the last two validations must reach the target for a run to
#: be near it.
LOOKAHEAD = 2.0


def parse_target(text: str) -> float | str:
    """``--target``: a loss (a finite number) or a side's name (anything else)."""
    try:
        value = float(text)
    except ValueError:
        return text
    return value if math.isfinite(value) else text


def check_target(target: float | str, names: Sequence[str]) -> None:
    """A named target must be one of the sides (the configs' stems, the ``--from-logs`` directories' names)."""
    if isinstance(target, str) and target not in names:
        raise ValueError(f"--target {target!r}: give a loss (e.g. --target 1.75) or a side's name, one of "
                         + ", ".join(names))


def check_resolution(resolution: float) -> float:
    """``--resolution``: a fraction of a run's steps, above 0 and at most 0.5."""
    if not (math.isfinite(resolution) and 0 < resolution <= 0.5):
        raise ValueError(f"--resolution is the gap between the last validations before the target as a fraction "
                         f"of the steps done: above 0 and at most 0.5 (e.g. 0.02: 2%), got {resolution:g}")
    return resolution


@dataclass(frozen=True)
class Crossing:
    """Where a run reached the target: its first validation at or below it (``step``) and the validation before
    (``before``; 0 when there was none), so the run reached it after ``before`` and by ``step``."""

    step: int
    before: int

    @property
    def width(self) -> float:
        """The bracket as a fraction of ``step``: ``step`` is at most this much above the true crossing."""
        return (self.step - self.before) / self.step


def crossing(steps: Sequence[int], losses: Sequence[float], target: float) -> Crossing | None:
    """The first validation at or below ``target`` and the one before it; ``None`` if none is at or below."""
    before = 0
    for step, loss in zip(steps, losses, strict=True):
        if loss <= target:
            return Crossing(int(step), int(before))
        before = step
    return None


@dataclass
class TargetSchedule:
    """When a run validates on its way to ``target``: every ``every`` steps (the grid) and, while the line through
    its last two validations reaches the target within ``lookahead`` grid intervals (and none has reached it),
    halfway to where that line reaches it, at most a quarter of a grid interval on and at least ``resolution`` of
    the steps done on (see the module docstring).

    `due` answers after each update; `record` takes each validation's loss. Steps are optimizer updates.
    """

    target: float
    every: int
    resolution: float = RESOLUTION
    lookahead: float = LOOKAHEAD
    last: tuple[int, float] | None = None
    near: bool = False
    reached: bool = False
    next_step: int | None = None

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be a number of steps >= 1, got {self.every}")
        check_resolution(self.resolution)

    def record(self, step: int, loss: float) -> None:
        """A validation after ``step`` updates gave ``loss``."""
        ahead = None  # steps until the line through the last two validations reaches the target
        if self.last is not None and step > self.last[0]:
            rate = (self.last[1] - loss) / (step - self.last[0])  # loss fallen per step
            if rate > 0:
                ahead = (loss - self.target) / rate
        self.last = (step, loss)
        if loss <= self.target:
            self.reached = True
        self.near = not self.reached and ahead is not None and ahead <= self.lookahead * self.every
        if self.near:
            assert ahead is not None
            self.next_step = step + max(self.interval(), min(math.floor(ahead / 2), self.every // 4))
        else:
            self.next_step = None

    def interval(self) -> int:
        """The gap between validations as they close in on the target: ``resolution`` of the steps at the last
        one, at least 1."""
        return max(1, math.floor(self.resolution * (self.last[0] if self.last else 0)))

    def due(self, step: int) -> bool:
        """Whether to validate after update ``step``."""
        return step % self.every == 0 or (self.next_step is not None and step >= self.next_step)


@dataclass(frozen=True)
class StepsTo:
    """A side's steps to the target over its seeds: each seed's `Crossing` (``None``: not reached) and its train
    time there (``None``: not reached, or not timed)."""

    crossings: tuple[Crossing | None, ...]
    times: tuple[float | None, ...]

    @property
    def reached(self) -> list[Crossing]:
        return [c for c in self.crossings if c is not None]

    @property
    def all_reached(self) -> bool:
        return bool(self.crossings) and len(self.reached) == len(self.crossings)

    @property
    def mean(self) -> float | None:
        """The mean steps over the seeds that reached it (``None``: none did)."""
        return float(np.mean([c.step for c in self.reached])) if self.reached else None

    @property
    def mean_time(self) -> float | None:
        """The mean train time to it over the seeds that reached it and were timed (``None``: none)."""
        times = [t for c, t in zip(self.crossings, self.times, strict=True) if c is not None and t is not None]
        return float(np.mean(times)) if times else None

    @property
    def width(self) -> float | None:
        """The widest bracket of a seed that reached it, as a fraction of its step."""
        return max(c.width for c in self.reached) if self.reached else None

    def count(self) -> str:
        """``2 of 3 seeds``."""
        return f"{len(self.reached)} of {len(self.crossings)} seed{'s' if len(self.crossings) > 1 else ''}"

    def text(self) -> str:
        """The seeds' steps: ``127 ± 4 (123–130)`` (std with ddof=1), one seed's as it is, ``not reached``."""
        steps = np.array([c.step for c in self.reached], dtype=float)
        if not len(steps):
            return "not reached"
        if len(steps) == 1:
            return f"{steps[0]:.0f}"
        return f"{steps.mean():.0f} ± {steps.std(ddof=1):.0f} ({steps.min():.0f}–{steps.max():.0f})"


def steps_to(runs_steps: Sequence[Sequence[int]], runs_losses: Sequence[Sequence[float]],
             runs_times: Sequence[Sequence[float] | None], target: float) -> StepsTo:
    """Each run's crossing of ``target`` and its train time there (runs given as their validation steps, losses
    and train times, ``None`` for a run that was not timed)."""
    crossings = tuple(crossing(s, loss, target) for s, loss in zip(runs_steps, runs_losses, strict=True))
    times = tuple(None if c is None or t is None else float(t[list(s).index(c.step)])
                  for c, s, t in zip(crossings, runs_steps, runs_times, strict=True))
    return StepsTo(crossings, times)
