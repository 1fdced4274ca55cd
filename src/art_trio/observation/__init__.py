"""Layer 4, observation: how a run is watched (the counters folded from its events, the fates,
the status line)."""
