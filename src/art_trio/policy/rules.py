"""How a setting's value is checked: range rules and number tests, each error naming the
setting and what it accepts (the reference's text where the reference has the check).

Knows no setting by name: art_trio.config.settings attaches these to its declarations.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Rule:
    """A range check: `test(value)` must hold, else "<name> must be <text>".

    None passes whenever the setting's type allows None (the reference's own rule).
    """

    test: Callable[[Any], bool]
    text: str

    def problem(self, name: str, value: object) -> str | None:
        if self.test(value):
            return None
        return f"{name} must be {self.text}"


def above(low: float, note: str = "") -> Rule:
    return Rule(lambda v: v > low, f"> {low:g}{note}")


def at_least(low: float, note: str = "") -> Rule:
    return Rule(lambda v: v >= low, f">= {low:g}{note}")


def one_of(choices: tuple[str, ...]) -> Rule:
    text = f"one of {', '.join(map(repr, choices))}"

    def test(value: object) -> bool:
        return value in choices

    return _Shown(test, text)


@dataclass(frozen=True, slots=True)
class _Shown(Rule):
    """A rule whose message also shows the value given (a choice among names)."""

    def problem(self, name: str, value: object) -> str | None:
        if self.test(value):
            return None
        return f"{name} must be {self.text}, got {value!r}"


def count_error(name: str, value: object, *, optional: bool) -> str | None:
    """Why `value` cannot be the count `name`, else None."""
    if value is None and optional:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return None
    what = "a whole number (an int)" + (" or None" if optional else "")
    return f"{name} must be {what}, got {value!r}"


def not_a_number(name: str, value: object, optional: bool) -> str | None:
    """Checked before the range checks, which would fail with a bare TypeError comparing a
    string (or None) to a number."""
    if value is None and optional:
        return None
    if isinstance(value, numbers.Real):
        return None
    what = "a number" + (" or None" if optional else "")
    return f"{name} must be {what}, got {value!r} ({type(value).__name__})"


def not_finite(name: str, value: object) -> str | None:
    # ART 0.5.23 accepts inf and then fails sizing its queue (math.ceil(inf)); None is the
    # one spelling of "no mean-age bound" on every line.
    if value is None or (not isinstance(value, bool) and math.isfinite(value)):  # type: ignore[arg-type]
        return None
    return (
        f"{name} must be a finite number of steps, got {value!r}; pass None for no mean "
        "policy-age bound"
    )
