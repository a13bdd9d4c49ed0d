"""The update rules a param group can select, by the group key that selects each.

`lightning_muon.optim.rules` fills it: its own rules when it is imported, a user's through
`lightning_muon.optim.rules.register_rule`. It sits below `lightning_muon.optim.groups`, so that
`groups.update_rule` can word a group's rules without importing the rules' maths.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol


class Rule(Protocol):
    """What the registry reads of a rule (`lightning_muon.optim.rules.UpdateRule` has it)."""

    #: The param-group key that selects the rule and holds its setting.
    key: ClassVar[str]
    #: Whether the rule's words replace ``"Muon"`` (a Muon variant such as NorMuon) rather than follow it.
    names_the_rule: ClassVar[bool]

    def selects(self, group: dict[str, Any]) -> bool: ...

    def describe(self, value: Any) -> str: ...


#: Every registered rule by its group key, in registration order (the order a group's rules run in).
RULES: dict[str, Rule] = {}


def selected(group: dict[str, Any]) -> list[Rule]:
    """The registered rules a param group selects, in registration order."""
    return [rule for rule in RULES.values() if rule.selects(group)]


def words(group: dict[str, Any]) -> str:
    """A param group's update rule in words: ``"Muon"``, or a variant's name in its place, then the other rules."""
    rules = selected(group)
    phrases = [rule.describe(group[rule.key]) for rule in rules]
    if not (rules and rules[0].names_the_rule):
        phrases.insert(0, "Muon")
    return ", ".join(phrases)
