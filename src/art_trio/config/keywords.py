"""ART's constructor keywords, resolved to one `PipelineSettings`.

`PipelineTrainer(...)` takes every keyword ART's trainer takes on either line, and resolves
the aliases between them here: the runtime sizes as keyword arguments (ART 0.5.18's only
spelling, deprecated on 0.5.20+) or as `pipeline=PipelineRuntimeConfig(...)` or from an
`autotune=` config; `eval_step_0` (0.5.18) beside `eval_at_start`; `max_batch_size`
defaulting to 10 x `min_batch_size`; a rollout executor's capacity. art_trio's grouped form
(`sizes=Sizes(...)`, `shutdown=Shutdown(...)`, ...) is accepted beside the flat names.

`trainer_signature` spells the flat keywords out for `inspect` (ART-parity tests, docs,
IDEs), each typed and defaulted as art_trio.config.settings declares it. Statically the flat
keywords are `Any`; the grouped form (`sizes=Sizes(...)`) is what mypy checks.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any, cast, get_type_hints

import art

from ..plumbing.bridge.calls import is_native
from ..plumbing.compat import RUNTIME_FIELDS, PipelineAutotuneConfig, PipelineRuntimeConfig
from ..plumbing.compat import deprecate_direct_runtime as _deprecate_direct_runtime
from ..plumbing.executor import RolloutExecutor
from ..policy.rules import count_error
from . import settings as settings_module
from .settings import (
    DECLARATIONS,
    FIELDS,
    GROUP_TYPES,
    GROUPS,
    PipelineSettings,
    Sizes,
    default_max_batch_size,
)

#: Keywords whose default is None, meaning "as another keyword says": the runtime sizes (as
#: `pipeline=` says, else ART's defaults below) and `eval_at_start` (as `eval_step_0` says).
RESOLVED_LATER: tuple[str, ...] = (*RUNTIME_FIELDS, "eval_at_start")

#: The runtime settings' defaults when neither `pipeline=` nor a keyword sets them (ART's,
#: as `Sizes` declares them; max_batch_size None: 10 x min_batch_size).
RUNTIME_DEFAULTS: dict[str, int | None] = {n: DECLARATIONS[n].default for n in RUNTIME_FIELDS}


def keyword_default(name: str) -> Any:
    """The default of the constructor keyword `name` (a setting or a group)."""
    if name in GROUPS or name in RESOLVED_LATER:
        return None
    return DECLARATIONS[name].default


def keyword_type(name: str) -> Any:
    """The type of the constructor keyword `name`: its declaration's (None also where
    another keyword decides, `RESOLVED_LATER`), or its group class or None."""
    if name in GROUPS:
        return GROUP_TYPES[name] | None
    declared = get_type_hints(GROUP_TYPES[FIELDS[name]], vars(settings_module))[name]
    return declared | None if name in RESOLVED_LATER else declared


def trainer_signature(init: Callable[..., None]) -> inspect.Signature:
    """`init`'s signature with `**settings` spelt out, keyword by keyword, as ART's is."""
    signature = inspect.signature(init)
    parameters = [
        p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    for name in (*FIELDS, *GROUPS):
        parameters.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY,
                default=keyword_default(name), annotation=keyword_type(name),
            )
        )
    return signature.replace(parameters=parameters)


def spell_out_settings(init: Callable[..., None]) -> None:
    """Give `init` (the trainer's constructor) its `trainer_signature` for `inspect`."""
    init.__signature__ = trainer_signature(init)  # type: ignore[attr-defined]


def refuse_unknown(keywords: Mapping[str, Any], owner: str) -> None:
    """Python's TypeError for a keyword no parameter has, with the nearest name."""
    for name in keywords:
        if name in FIELDS or name in GROUPS:
            continue
        close = difflib.get_close_matches(name, [*FIELDS, *GROUPS], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}{hint}")


def _set_in(group: object) -> dict[str, Any]:
    """The fields a group given whole sets: those not at their default (`max_batch_size`
    at 10 x `min_batch_size`, its derived default, counts as unset)."""
    values = {f.name: getattr(group, f.name) for f in fields(cast(Any, group))}
    defaults = {name: DECLARATIONS[name].default for name in values}
    if isinstance(group, Sizes):
        defaults["max_batch_size"] = default_max_batch_size(group.min_batch_size)
    return {name: v for name, v in values.items() if not _same(v, defaults[name])}


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001  (an odd object's __eq__: then they differ)
        return a is b


def _flat(keywords: Mapping[str, Any]) -> tuple[dict[str, Any], Sizes | None]:
    """The settings given, by flat name (groups spelt out), and a `sizes=` group if any.

    One rule for a group given whole beside flat keywords of the same group: the flat
    keyword sets its field, the group the fields it sets (see `_set_in`), the defaults the
    rest; only one field set both ways to two different values is refused.
    """
    flat = {name: value for name, value in keywords.items() if name in FIELDS}
    sizes: Sizes | None = None
    for group in GROUPS:
        value: Any = keywords.get(group)
        if value is None:
            continue
        if not isinstance(value, GROUP_TYPES[group]):
            raise TypeError(
                f"{group} must be an art_trio.{GROUP_TYPES[group].__name__}, got "
                f"{type(value).__name__}"
            )
        given = _set_in(value)
        for name in sorted(set(given) & set(flat)):
            if not _same(given[name], flat[name]):
                raise TypeError(
                    f"{name} is given twice with different values: {flat[name]!r} as a "
                    f"keyword and {given[name]!r} in {group}={type(value).__name__}(...); "
                    "pass it once"
                )
        if isinstance(value, Sizes):
            # One Sizes of both, resolved with pipeline= and autotune= (see resolve_runtime);
            # an unset max_batch_size is derived from the resulting min_batch_size.
            mine = {name: flat.pop(name) for name in list(flat) if FIELDS[name] == group}
            sizes = Sizes(**{**given, **mine})
        else:
            flat.update({name: v for name, v in given.items() if name not in flat})
    return flat, sizes


def resolve_settings(
    keywords: Mapping[str, Any],
    *,
    pipeline: PipelineRuntimeConfig | None,
    autotune: PipelineAutotuneConfig | None,
    rollout_executor: RolloutExecutor | None,
    eval_step_0: bool,
    tuned_start: Callable[[], dict[str, int | None]] | None = None,
    owner: str = "PipelineTrainer.__init__",
) -> PipelineSettings:
    """The constructor's settings keywords, their aliases resolved, validated (ValueError
    with ART's text; TypeError for a keyword no parameter has). With autotuning on,
    `tuned_start` gives the sizes the autotuner starts from (`art_trio.autotune`)."""
    refuse_unknown(keywords, owner)
    flat, sizes = _flat(keywords)
    if sizes is not None and pipeline is not None:
        raise ValueError("Use either sizes=Sizes(...) or pipeline=PipelineRuntimeConfig(...)")
    direct = {name: flat.pop(name, None) for name in RUNTIME_FIELDS}
    runtime = resolve_runtime(pipeline if sizes is None else sizes, autotune, direct, tuned_start)
    # After resolve_runtime's ValueErrors, as ART orders them; ART 0.5.20+ only. The frames
    # above the warning: this function, the constructor, then the user's call.
    _deprecate_direct_runtime({k: v for k, v in direct.items() if v is not None}, stacklevel=3)
    explicit_workers = direct["num_rollout_workers"] is not None or (
        "num_rollout_workers" in getattr(pipeline, "model_fields_set", ())
    )
    runtime["num_rollout_workers"] = fit_executor(  # (always set: a default or a config's)
        rollout_executor, cast(int, runtime["num_rollout_workers"]), explicit=explicit_workers
    )
    if runtime["max_batch_size"] is None:  # (a given one is checked as given, as ART does)
        runtime["max_batch_size"] = default_max_batch_size(runtime["min_batch_size"])
    eval_at_start = flat.pop("eval_at_start", None)
    settings = PipelineSettings.from_flat({
        **flat, **runtime, "eval_at_start": eval_step_0 if eval_at_start is None else eval_at_start
    })
    # `eval_step_0` keeps its reference default (True), so only an explicit False can be told
    # apart from the default: that, against eval_at_start=True, is a contradiction.
    if eval_at_start is not None and not eval_step_0 and eval_at_start:
        raise ValueError(
            "eval_at_start and eval_step_0 disagree (eval_at_start is the newer name of "
            "eval_step_0): pass only one of them"
        )
    return settings


def resolve_runtime(
    pipeline: Any | None,
    autotune: Any | None,
    direct: dict[str, int | None],
    tuned_start: Callable[[], dict[str, int | None]] | None = None,
) -> dict[str, int | None]:
    """The four runtime settings, from `pipeline=PipelineRuntimeConfig(...)` or the direct kwargs.

    ART 0.5.20 moved them into a config object and kept the keyword arguments as aliases;
    both spellings work here on every ART line (the trainer warns about the aliases as the
    installed ART does, see compat.deprecate_direct_runtime), and giving both is ART's
    ValueError.
    """
    given = {name: value for name, value in direct.items() if value is not None}
    mode = getattr(autotune, "mode", "off")
    if mode != "off":
        if pipeline is not None or given:
            raise ValueError(
                "Pipeline runtime config cannot be provided when pipeline autotuning is "
                "enabled. The autotuner owns the initial and online pipeline settings."
            )
        if tuned_start is None:
            raise ValueError("autotuning needs the autotune extension's starting sizes")
        # The autotuner's starting point (a saved profile, if asked for).
        return tuned_start()
    if pipeline is not None and given:
        raise ValueError(
            "Use either pipeline=PipelineRuntimeConfig(...) or deprecated direct pipeline "
            "settings, not both."
        )
    if pipeline is not None:
        return {name: getattr(pipeline, name) for name in direct}
    return {**RUNTIME_DEFAULTS, **given}


def fit_executor(executor: object | None, workers: int, *, explicit: bool) -> int:
    """The worker count an executor can host: ART's error if asked for more, else clamped."""
    if executor is None:
        return workers
    if not isinstance(executor, RolloutExecutor):
        raise TypeError(
            "rollout_executor must implement ART's RolloutExecutor protocol (max_workers, "
            f"set_target, set_workers, async run), got {type(executor).__name__}"
        )
    capacity = executor.max_workers
    if capacity is None:
        return workers
    if capacity < 1:
        raise ValueError("rollout executor capacity must be >= 1")
    if workers > capacity:
        if explicit:
            raise ValueError(
                f"num_rollout_workers={workers} exceeds rollout executor capacity {capacity}"
            )
        return capacity
    return workers


def score_references(
    pipeline: PipelineRuntimeConfig | None,
    groups_per_step: float | None,
    rollouts_per_group: float | None,
) -> tuple[float | None, float | None]:
    """ART 0.5.20's objective-score references, as ART resolves them for `objective/score`:
    given > `pipeline=` > its defaults."""
    config = pipeline if pipeline is not None else PipelineRuntimeConfig()
    groups = config.score_reference_groups_per_step if groups_per_step is None else groups_per_step
    rollouts = (
        config.score_reference_rollouts_per_group
        if rollouts_per_group is None
        else rollouts_per_group
    )
    return groups, rollouts


def resize_settings(
    settings: PipelineSettings,
    executor: RolloutExecutor | None,
    *,
    running: bool,
    **sizes: int | None,
) -> PipelineSettings:
    """`resize()`'s new settings: each size given (None: as it is) checked as the constructor
    checks it (ValueError), the workers fitted to the executor. A running channel has a
    capacity now, which stays unless a new one is given."""
    for name, value in sizes.items():
        # Before anything compares or counts with it (inf workers started workers forever).
        problem = count_error(name, value, optional=True)
        if problem is not None:
            raise ValueError(f"resize: {problem}; nothing was changed")
    current = settings.flat()
    if running:
        current["queue_maxsize"] = settings.groups_capacity
    given = {name: value for name, value in sizes.items() if value is not None}
    new = {name: given.get(name, current[name]) for name in sizes}
    new["num_rollout_workers"] = fit_executor(
        executor, new["num_rollout_workers"], explicit="num_rollout_workers" in given
    )
    return settings.replace(**new)


def _takes_three(fn: Callable[..., Any]) -> bool:
    """Whether `fn` can be called with three positional arguments (True when its signature
    cannot be read)."""
    try:
        inspect.signature(fn).bind(None, None, None)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def check_arguments(
    model: object,
    backend: object,
    rollout_fn: object,
    eval_fn: object,
    scenarios: object,
    executor: object,
    extensions: Sequence[object],
    progress_keeper: object,
) -> None:
    """Catch the usual slips at construction, not as a failure per rollout (or run) later.

    A plain `def` callback is fine if it returns an awaitable (ART's own tests pass lambdas
    around coroutines); one that does not is caught at its first call."""
    if not isinstance(model, art.TrainableModel):
        raise TypeError(
            "model must be an art.TrainableModel (the model trained and served, registered "
            f"with the backend), got {type(model).__name__}"
        )
    if not callable(getattr(backend, "train", None)):
        raise TypeError(
            "backend must be an ART backend, with a `train(model, groups, ...)` method "
            f"(art.LocalBackend, art.ServerlessBackend, ...), got {type(backend).__name__}"
        )
    for name, fn, arguments in (
        ("rollout_fn", rollout_fn, "(model, scenario, config)"),
        ("eval_fn", eval_fn, "(model, step, config)"),
    ):
        if fn is None and name == "eval_fn":
            continue
        if not callable(fn):
            raise TypeError(
                f"{name} must be callable and return an awaitable (an async function), got "
                f"{type(fn).__name__}"
            )
        if not _takes_three(fn):
            raise TypeError(
                f"{name} is called as {name}{arguments}, as ART calls it; "
                f"{getattr(fn, '__qualname__', type(fn).__name__)}"
                f"{inspect.signature(fn)} cannot take that"
            )
    if not isinstance(scenarios, (Iterable, AsyncIterator)) or isinstance(scenarios, (str, bytes)):
        raise TypeError(
            "scenarios must be an iterable (a list, a generator) or an async iterator of "
            f"scenarios, got {type(scenarios).__name__}"
        )
    for extension in extensions:
        if not callable(getattr(extension, "stage", None)):
            raise TypeError(
                "each of extensions must be a StageExtension (a `stage(run)` method returning "
                f"a stage or None), got {type(extension).__name__}"
            )
    if progress_keeper is not None and not callable(progress_keeper):
        raise TypeError(
            "progress_keeper must be a function of the model returning a ProgressKeeper, got "
            f"{type(progress_keeper).__name__}"
        )
    if executor is not None and is_native(rollout_fn):
        raise TypeError(
            "a trio_native rollout_fn cannot run through a rollout_executor (executors "
            "run rollouts as asyncio code, as ART's do); drop one of the two"
        )
