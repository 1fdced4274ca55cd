"""The online autotuner: the cheapest worker count that keeps the trainer fed.

`policy.py` decides (pure: statistics in, decisions out; its docstring explains the search),
`window.py` measures what it decides from, `profile.py` reads ART's `autotune=` config and
saves and loads the tuned settings. `stages/autotune.py` runs the policy in a live `train()`.
"""
