"""A tuned comparison against a given target (``compare --target``): the table of each side's steps to it over its
seeds, the verdict, and the notes on resolution and cost. Pure functions on `Outcome`s.

A side's steps are the mean and spread of its seeds' own steps to the target (each its first validation at or
below it, `lightning_muon.commands.compare.target.crossing`), with how many seeds reached it. A ratio to the
baseline is given where every seed of the side reached the target and the baseline's steps are known: its
seeds' mean when every one of them reached it too, else, when the target is the baseline's own final loss, its
last step (as without ``--target``).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_muon.commands.compare.aggregate import Outcome, Side, spread


def target_label(target: float, target_side: str | None, sides: Sequence[Side] = ()) -> str:
    """What the target is, in words: ``1.7500``, or ``the tuned gpt_adamw's final val loss 2.2561``."""
    if target_side is None:
        return f"{target:.4f}"
    tuned = "tuned " if any(s.name == target_side and len(s.grid) > 1 for s in sides) else ""
    return f"the {tuned}{target_side}'s final val loss {target:.4f}"


def basis(results: Sequence[Outcome], target_side: str | None) -> tuple[float, float | None, str] | None:
    """The baseline's steps and train time to the target that ratios are taken to, and how to say them; ``None``
    when not known (some of its seeds did not reach the target, and it is not the baseline's own final loss)."""
    base = next(o for o in results if o.baseline)
    if base.steps.all_reached:
        return base.steps.mean or 0.0, base.steps.mean_time, f"{base.steps.text()} ({base.steps.count()})"
    if target_side == base.side:
        return float(base.last_step), base.last_time, f"{base.last_step} (its last step)"
    return None


def _ratio(value: float | None, of: float | None) -> str:
    return f" ({value / of:.2f}x)" if value is not None and of else ""


def target_table(target: float, results: Sequence[Outcome], target_side: str | None = None) -> str:
    """Markdown: each side at its best lr, its seeds' steps and train time to the target (ratios to the
    baseline's), how many seeds reached it, the widest bracket of a seed's crossing, and its validations."""
    to = f"{target:.4f}"
    lines = [
        f"| side | lr | seeds | final val loss (mean ± std, min–max) | steps to {to} (mean ± std, min–max) | "
        f"seeds reaching {to} | train time to {to} (s) | resolution | validations per fit (share of wall time) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    known = basis(results, target_side)
    for o in results:
        steps = o.steps.text()
        time = "n/a" if o.steps.mean_time is None else f"{o.steps.mean_time:.1f}"
        if not o.baseline and known is not None and o.steps.all_reached:
            steps += _ratio(o.steps.mean, known[0])
            time += _ratio(o.steps.mean_time, known[1])
        width = "n/a" if o.steps.width is None else f"≤ {o.steps.width:.1%}"
        share = "" if o.validation_share is None else f" ({o.validation_share:.0%})"
        lines.append(f"| {o.side}{' (baseline)' if o.baseline else ''} | {o.lr:g} | {len(o.curve.final)} | "
                     f"{spread(o.curve.final)} | {steps} | {o.steps.count()} | {time} | {width} | "
                     f"{o.validations:.0f}{share} |")
    return "\n".join(lines)


def target_verdict(target: float, results: Sequence[Outcome], target_side: str | None = None,
                   sides: Sequence[Side] = ()) -> list[str]:
    """One line per side but the baseline: does it reach the target, in how many steps over its seeds, and in
    what fraction of the baseline's; the final losses."""
    base = next(o for o in results if o.baseline)
    known = basis(results, target_side)
    goal = target_label(target, target_side, sides)
    lines = []
    for o in results:
        if o.baseline:
            continue
        finals = f"final val loss {o.curve.final.mean():.4f} against {base.side}'s {base.curve.final.mean():.4f}"
        who = f"{o.side} (lr {o.lr:g})"
        if not o.steps.reached:
            lines.append(f"Verdict: {who} does not reach {goal} in {o.last_step} steps ({o.steps.count()} reach "
                         f"it): {finals}.")
            continue
        ratio = ""
        if known is not None and o.steps.all_reached and o.steps.mean is not None:
            ratio = f", {o.steps.mean / known[0]:.2f}x the {base.side}'s {known[2]}"
        lines.append(f"Verdict: {who} reaches {goal} in {o.steps.text()} steps ({o.steps.count()}){ratio}; "
                     f"{finals}.")
    return lines


def target_notes(resolution: float, results: Sequence[Outcome], target_side: str | None = None) -> list[str]:
    """What the steps mean, how finely they were resolved, and what the extra validations cost."""
    notes = [
        "Steps to the target are each seed's first validation at or below it. Fitted with --target, a fit "
        "validates on its grid and, while the line through its last two validations reaches the target within "
        "two grid intervals, closes in on the crossing, the last validations "
        f"{resolution:.0%} of its steps apart; \"resolution\" is the widest bracket of a seed's crossing "
        "(between its validation before and its first at or below the target), as a fraction of its step (wider "
        "where a run passed the target before the schedule saw it coming).",
    ]
    if target_side is not None:
        notes.append(f"{target_side}'s own fits were made before its final loss was known, on the grid alone.")
    costs = ", ".join(f"{o.side} {o.validations:.0f}"
                      + ("" if o.validation_share is None else f" ({o.validation_share:.0%} of its wall time)")
                      for o in results)
    notes.append(f"Cost: validations per fit, the grid's and those near the target: {costs}.")
    return notes
