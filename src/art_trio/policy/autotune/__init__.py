"""The online autotuner: the cheapest worker count that keeps the trainer fed.

`policy.py` decides (pure: statistics in, decisions out; its docstring explains the search),
`window.py` measures what it decides from, `profile.py` reads ART's `autotune=` config and
saves and loads the tuned settings. `stages/autotune.py` runs the policy in a live `train()`.
"""

from __future__ import annotations

from ...messages.errors import ProfileError
from .policy import DEFAULT_TARGET_UTILIZATION, AutotunePolicy
from .profile import (
    HONOURED_FIELDS,
    AutotuneConfig,
    config_field,
    initial_runtime,
    load_profile_settings,
    policy_for,
    profile_document,
    profile_path,
    save_profile,
)
from .window import Decision, InferenceLoad, Window, measure, parse_vllm_metrics

__all__ = [
    "DEFAULT_TARGET_UTILIZATION",
    "HONOURED_FIELDS",
    "config_field",
    "initial_runtime",
    "load_profile_settings",
    "policy_for",
    "profile_document",
    "profile_path",
    "save_profile",
    "AutotuneConfig",
    "AutotunePolicy",
    "Decision",
    "InferenceLoad",
    "ProfileError",
    "Window",
    "measure",
    "parse_vllm_metrics",
]
