"""The backend's optional methods, looked up as the trainer uses them.

ART's trainers call some backend methods only where the backend has them: leases on a step's
weights (`adapter_lease`, `exact_adapter_lease`, ART 0.5.20+'s `adapter_retention_lease`),
`prune_model_adapters`, and ART 0.5.20+'s Megatron-path hooks (`prepare_pipeline_batch`,
`discard_pipeline_batch`, `finalize_training_session`). A backend has one if its class
defines it or if it was set on the instance (a wrapper, a test double patched in place).
ART 0.5.23 looks some of them up on the class only and so ignores one set on the instance;
art_trio takes both. Attributes a `unittest.mock.Mock` makes up on first access are neither,
so a MagicMock backend (as in ART's own tests) has none of them.
"""

from __future__ import annotations

from typing import Any


def backend_hook(backend: object, name: str) -> Any | None:
    """`backend.<name>` if its class defines it or it was set on the instance, else None."""
    if getattr(type(backend), name, None) is not None:
        return getattr(backend, name)
    value = getattr(backend, "__dict__", {}).get(name)
    return value if value is not None else None


__all__ = ["backend_hook"]
