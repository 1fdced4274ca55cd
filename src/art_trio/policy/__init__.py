"""Layer 3, policy: pure decisions (which rollouts may start, which groups are fresh, what a
batch holds, which checkpoints stay, autotuning), knowing no run and no stage."""
