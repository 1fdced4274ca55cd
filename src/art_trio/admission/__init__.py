"""Staleness-aware and load-aware admission (`admission="staleness_aware"`, the default).

`policy.py` decides (`StalenessAwareAdmission`: the window's free slots, the race at
`max_steps_off_policy=0`, the straggler slack and the shared server's load cap);
`snapshot.py` is what it decides from and the estimates read from it (`MeasuredSnapshot`);
`gate.py` measures it (`MeasuringGate`, the kernel's gate with the load model, cohorts and the
slow tail of latency). The kernel's `AdmissionPolicy` protocol is how it plugs in.
"""

from __future__ import annotations

from .gate import MeasuringGate
from .policy import StalenessAwareAdmission
from .snapshot import MeasuredSnapshot

__all__ = ["MeasuredSnapshot", "MeasuringGate", "StalenessAwareAdmission"]
