"""pytest plugin of art-trio: the ``art_trio_pipeline`` fixture, to property-test your pipeline.

Registered by art-trio's ``pytest11`` entry point, so installing art-trio makes it available
(without the install, ``pytest -p art_trio_pytest``). A package of its own, outside
``art_trio``: pytest imports every installed plugin on every run, and importing ``art_trio``
imports ART (seconds). This module imports only pytest; art_trio and Hypothesis load when a
test asks for the fixture, so runs that do not use it are unchanged.

    def test_my_pipeline(art_trio_pipeline):
        art_trio_pipeline.check(settings=MY_SETTINGS, rollout_latency="lognormal:30:1.5")
        art_trio_pipeline.explore(settings=MY_SETTINGS, rollout_latency="lognormal:30:1.5")

``@pytest.mark.art_trio_pipeline(max_examples=200, max_policy_age=1)`` sets defaults for
the fixture's calls in one test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from art_trio.testing.pipeline import PipelineReport

MARKER = "art_trio_pipeline"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(**defaults): defaults for the art_trio_pipeline fixture's check() and "
        "explore() in this test (e.g. max_examples=200, max_policy_age=1)",
    )


class PipelineChecker:
    """What the fixture gives: `check` (one case) and `explore` (Hypothesis) on your pipeline.

    Both take `art_trio.testing.pipeline.check_pipeline`'s keyword arguments (explore also
    strategies, `max_examples` and `derandomize`) over the marker's defaults.
    """

    def __init__(self, defaults: dict[str, Any]) -> None:
        self.defaults = defaults

    def _with_defaults(self, kwargs: dict[str, Any], allowed: set[str]) -> dict[str, Any]:
        return {k: v for k, v in self.defaults.items() if k in allowed} | kwargs

    def check(self, **kwargs: Any) -> PipelineReport:
        """`check_pipeline(**kwargs)`: one case, run to its end and stopped-and-resumed."""
        __tracebackhide__ = True
        import inspect

        from art_trio.testing.pipeline import check_pipeline

        allowed = set(inspect.signature(check_pipeline).parameters)
        return check_pipeline(**self._with_defaults(kwargs, allowed))

    def explore(self, **kwargs: Any) -> None:
        """`explore_pipeline(**kwargs)`: Hypothesis draws cases and shrinks a failure."""
        __tracebackhide__ = True
        import inspect

        from art_trio.testing.pipeline import explore_pipeline

        allowed = set(inspect.signature(explore_pipeline).parameters)
        explore_pipeline(**self._with_defaults(kwargs, allowed))


@pytest.fixture
def art_trio_pipeline(request: pytest.FixtureRequest) -> PipelineChecker:
    """Check your pipeline's configuration against every scheduler invariant, in virtual time."""
    defaults: dict[str, Any] = {}
    for marker in reversed(list(request.node.iter_markers(MARKER))):
        defaults |= marker.kwargs
    _refuse_unknown_keys(defaults)
    return PipelineChecker(defaults)


def _refuse_unknown_keys(defaults: dict[str, Any]) -> None:
    """A misspelt marker key would be dropped silently (each call takes only its own)."""
    import difflib
    import inspect

    from art_trio.testing.pipeline import check_pipeline, explore_pipeline

    known = set(inspect.signature(check_pipeline).parameters)
    known |= set(inspect.signature(explore_pipeline).parameters)
    for key in defaults:
        if key in known:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f", did you mean {close[0]!r}?" if close else ""
        raise pytest.UsageError(
            f"@pytest.mark.{MARKER}: unknown key {key!r}{hint} The keys are the arguments "
            f"of art_trio.testing's check_pipeline and explore_pipeline: {sorted(known)}"
        )
