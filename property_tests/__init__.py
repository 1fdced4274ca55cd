"""Property tests: the scheduler's invariants, checked on the real trainer in virtual time."""
