"""What a rollout executor sends elsewhere: an inference-only view of the model, and the
scenario's id for error messages."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Fields set after construction, as `model.register()` sets them on the trainer's side.
_INFERENCE_FIELDS = ("inference_api_key", "inference_base_url", "inference_model_name")

#: Private serving state `model.openai_client()` reads on the lines that have it (0.5.20+ adds
#: the binary routes and serving capabilities); copied when the model has it, else skipped.
_SERVING_PRIVATE = (
    "_internal_config",
    "_art_binary_routes_base_url",
    "_serving_capabilities",
    "_inference_connection_errors_are_fatal",
)


@dataclass(frozen=True)
class ModelView:
    """An inference-only, picklable view of an ART model, rebuilt as the same class elsewhere.

    Holds the model's public fields (so `name`, `project`, `base_model`, `run_name` on 0.5.20+
    and so on), its `config`, the serving state `openai_client()` needs, and the inference name
    the trainer's backend gives the current step (`get_inference_name()`), since the rebuilt
    model has no backend to ask. Not carried: the backend, W&B run, metrics builder, and any
    client already made. `get_inference_name(step=k)` on the rebuilt model therefore answers
    `f"{current_name}@{k}"`, as ART's own `RolloutModelSpec` does.

    Works on both ART lines: it asks the model's class for its fields instead of knowing them.
    """

    model_class: type
    fields: Mapping[str, Any]
    config: Any
    private: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, model: Any) -> ModelView:
        model_class = type(model)
        # A pydantic model keeps its fields in __dict__ and its private attributes in
        # __pydantic_private__: read there, not through its (slow) __getattr__.
        values = vars(model)
        fields = {
            name: values[name]
            for name in model_class.model_fields
            if name != "config" and name in values
        }
        fields["inference_model_name"] = model.get_inference_name()
        private_values = getattr(model, "__pydantic_private__", None) or {}
        private = {
            name: private_values[name]
            for name in _SERVING_PRIVATE
            if private_values.get(name) is not None
        }
        return cls(model_class, fields, values.get("config"), private)

    def fingerprint(self) -> str:
        """Equal for views that build equal models (`config` compared by identity)."""
        return repr(
            (
                f"{self.model_class.__module__}.{self.model_class.__qualname__}",
                sorted(self.fields.items()),
                id(self.config),
                sorted((k, repr(v)) for k, v in self.private.items()),
            )
        )

    def build(self) -> Any:
        """A new model of the same class, ready for `openai_client()` (no backend)."""
        init = {k: v for k, v in self.fields.items() if k not in _INFERENCE_FIELDS}
        init.pop("trainable", None)
        model = self.model_class(**init, config=self.config)
        for name in _INFERENCE_FIELDS:
            if name in self.fields:
                setattr(model, name, self.fields[name])
        for name, value in self.private.items():
            object.__setattr__(model, name, value)
        return model


def scenario_id(scenario: Any) -> Any | None:
    """The scenario's id for an error message: `metadata.scenario_id`, else `id`, else None."""
    metadata = _get(scenario, "metadata")
    found = _get(metadata, "scenario_id") if metadata is not None else None
    return found if found is not None else _get(scenario, "id")


def _get(obj: Any, key: str) -> Any | None:
    if isinstance(obj, Mapping):
        return obj.get(key)
    try:
        return getattr(obj, key, None)
    except Exception:
        return None
