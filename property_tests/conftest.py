"""Hypothesis profiles for the property suite.

- `ci` (default): few examples per property, derandomized (every run explores the same
  examples, so CI is reproducible), no shrinking (a failure is reported at once, with its
  reproduction blob), no deadline (a run's wall time is not what we test), no example
  database (mutation tests must not seed the real properties' examples).
- `thorough`: many more random examples; print the seed and reproduction blob on failure.
- `dev`: the CI budget, but random, to look around a little on every local run.

Select with HYPOTHESIS_PROFILE=thorough (or pytest's --hypothesis-profile=thorough).
"""

from __future__ import annotations

import os

# ART fetches a price table when imported unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from hypothesis import HealthCheck, Phase, settings  # noqa: E402

_COMMON = settings(
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# CI does not shrink: a failure reports its raw example and reproduction blob at once
# instead of spending minutes minimizing it (rerun with `thorough` or `dev` to minimize).
settings.register_profile(
    "ci",
    _COMMON,
    max_examples=40,
    derandomize=True,
    phases=(Phase.explicit, Phase.generate, Phase.target),
)
settings.register_profile("dev", _COMMON, max_examples=40)
settings.register_profile("thorough", _COMMON, max_examples=400)
if "HYPOTHESIS_PROFILE" in os.environ:
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])
elif settings.get_current_profile_name() == "default":
    # Not chosen on the command line (--hypothesis-profile is applied before this file).
    settings.load_profile("ci")
