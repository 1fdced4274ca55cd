"""CPUBackend's training, checkpoints and registration under attack (issue 32, items 4, 5, 16).

On a real, tiny transformers model (``tests/tiny_llm.py``): the code paths are CPUBackend's
own, the model is small enough that each test takes about a second. Skipped without the llm
extra; not marked ``llm``.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import copy
import errno
import math
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import art
import pytest

from art_trio.plumbing.compat import trainable_model
from tests.tiny_llm import TINY_MARKS, tiny_model_dir

pytestmark = TINY_MARKS

PROMPT: list[dict[str, Any]] = [{"role": "user", "content": "respond with yes, no, maybe"}]
ANSWERS = ("yes", "no", "maybe", "no")


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from art_trio.cpu import CPUBackend

    backend = CPUBackend(tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model"))
    backend._load()
    yield backend


def _model(base: Path, name: str, project: str = "p") -> art.TrainableModel:
    return trainable_model(name=name, project=project, base_model="tiny", base_path=str(base))


def _group(rewards: list[float]) -> art.TrajectoryGroup:
    return art.TrajectoryGroup(
        art.Trajectory(
            messages_and_choices=[*PROMPT, {"role": "assistant", "content": answer}],
            reward=reward,
        )
        for answer, reward in zip(ANSWERS, rewards, strict=False)
    )


def _train(backend: Any, model: art.TrainableModel, rewards: list[float], **kw: Any) -> Any:
    async def run() -> Any:
        await backend.register(model)  # the protocol's call; the server is not needed here
        return await backend.train(
            model, [_group(rewards)], allow_training_without_logprobs=True, **kw
        )

    return anyio.run(run)


def _finite(weights: dict[str, Any]) -> bool:
    return all(bool(value.isfinite().all()) for value in weights.values())


def _same(a: Any, b: Any, *, close: bool = False) -> bool:
    """Equal nested optimizer states / weight dicts: tensors exactly, or to float rounding
    with ``close`` (ART's tokenizer shuffles a group, so sums run in another order)."""
    import torch

    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            return False
        return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-7)) if close else torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], close=close) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y, close=close) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _live(backend: Any) -> dict[str, Any]:
    return backend._adapter_weights(backend._train_model)


# ------------------------------------------------------------------ 32.4: poisoned weights


def test_advantages_are_arts_and_finite_for_any_finite_rewards() -> None:
    from art_trio.cpu.training import NonFiniteTrainingError, group_advantages

    rewards = [1.0, 0.0, 0.5, 0.25]
    mean = sum(rewards) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 4)
    assert group_advantages(rewards, scale=True) == pytest.approx(
        [(r - mean) / (std + 1e-6) for r in rewards], rel=1e-12
    )
    assert group_advantages(rewards, scale=False) == pytest.approx([r - mean for r in rewards])
    assert group_advantages([1.7e308, 1.7e308, 0.0, 0.0], scale=True) == pytest.approx(
        [1.0, 1.0, -1.0, -1.0]
    )
    assert group_advantages([-1.7e308, 1.7e308], scale=True) == pytest.approx([-1.0, 1.0])
    assert group_advantages([1e300] * 3, scale=True) == [0.0, 0.0, 0.0]
    with pytest.raises(NonFiniteTrainingError, match="normalize advantages"):
        group_advantages([-1.7e308, 1.7e308, 1.7e308], scale=False)


def test_huge_finite_rewards_train_finite_weights(backend: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = _model(tmp_path, "huge")
    result = _train(backend, model, [1.7e308, 1.7e308, 0.0, 0.0])
    assert math.isfinite(result.metrics["loss"]) and result.step == 1
    state = backend._models["huge"]
    assert _finite(state.versions[1])
    assert not _same(state.versions[1], state.versions[0]), "the step changed nothing"
    assert _finite(load_file(str(Path(result.checkpoint_path) / "adapter_model.safetensors")))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_reward_is_refused_naming_its_trajectory(
    backend: Any, tmp_path: Path, bad: float
) -> None:
    from art_trio.cpu.training import NonFiniteTrainingError

    model = _model(tmp_path, f"nan-{bad}")
    with pytest.raises(NonFiniteTrainingError, match="trajectory 2 of trajectory group 0"):
        _train(backend, model, [1.0, 0.0, bad, 0.5])
    assert backend._models[model.name].latest == 0
    assert sorted(
        p.name for p in (tmp_path / "p/models" / model.name / "checkpoints").iterdir()
    ) == ["0000"]


def test_a_non_finite_loss_is_never_applied_nor_saved(backend: Any, tmp_path: Path) -> None:
    """Unnormalized advantages of +-1e300 are finite floats but infinite in float32: the loss
    is not finite, the step is refused and nothing moves; the next good step trains."""
    from art_trio.cpu.training import NonFiniteTrainingError

    model = _model(tmp_path, "inf-loss")
    _train(backend, model, [1.0, 0.0, 0.5, 0.0])
    state = backend._models["inf-loss"]
    optimizer_before = copy.deepcopy(state.optimizer_state)
    with pytest.raises(NonFiniteTrainingError, match="loss"):
        _train(backend, model, [1e300, -1e300, 0.0, 0.0], normalize_advantages=False)
    assert state.latest == 1
    assert _same(state.optimizer_state, optimizer_before)
    assert _same(_live(backend), state.versions[1])
    root = tmp_path / "p/models/inf-loss/checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["0000", "0001"]
    result = _train(backend, model, [1.0, 0.0, 0.5, 0.0])
    assert result.step == 2 and _finite(state.versions[2])


def test_an_optimizer_that_fails_mid_step_leaves_the_weights_as_they_were(
    backend: Any, tmp_path: Path
) -> None:
    """torch refuses a step size beyond float32 after weight decay has already scaled some
    weights in place: the training copy is put back to the saved step."""
    model = _model(tmp_path, "huge-lr")
    with pytest.raises(RuntimeError, match="overflow"):
        _train(
            backend,
            model,
            [1.0, 0.0, 0.5, 0.0],
            learning_rate=1e39,
            adam_params={"weight_decay": 0.5},
        )
    state = backend._models["huge-lr"]
    assert state.latest == 0 and state.optimizer_state is None
    assert _same(_live(backend), state.versions[0])
    assert _train(backend, model, [1.0, 0.0, 0.5, 0.0]).step == 1


# ------------------------------------------------------------------ 32.5: a full disk


@pytest.fixture(params=["os.write", "tmpfs"])
def full_disk(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Path, Any]]:
    """``(base_path, fill)``: ``fill()`` makes every later write under ``base_path`` fail with
    ENOSPC until the returned ``free()`` is called. ``os.write``: the write system call fails
    for files there; ``tmpfs``: a real 1 MB tmpfs is filled up (root only)."""
    if request.param == "os.write":
        real_write = os.write
        full = False

        def write(fd: int, data: Any) -> int:
            if full and os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(fd, data)

        def fill() -> Any:
            nonlocal full
            full = True

            def free() -> None:
                nonlocal full
                full = False

            return free

        monkeypatch.setattr(os, "write", write)
        yield tmp_path, fill
        return
    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
        ).returncode
    ):
        pytest.skip("mounting a tmpfs needs root")

    def fill_tmpfs() -> Any:
        filler = mount / "filler"
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        return filler.unlink

    try:
        yield mount, fill_tmpfs
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_failed_checkpoint_write_takes_no_step(backend: Any, full_disk: tuple[Path, Any]) -> None:
    """Disk full while step 2's checkpoint is written: a clear error naming the file and
    ENOSPC, no temporary left, weights and optimizer as after step 1 (not one Adam step
    ahead); the retried step 2 then equals a step 2 that never failed."""
    from art_trio.cpu import CheckpointWriteError

    base, fill = full_disk
    name = f"disk-full-{base.name}"  # one CPUBackend for the module: one name per model
    model = _model(base, name)
    _train(backend, model, [1.0, 0.0, 0.5, 0.0])
    state = backend._models[name]
    optimizer_before = copy.deepcopy(state.optimizer_state)
    free = fill()
    with pytest.raises(CheckpointWriteError) as caught:
        _train(backend, model, [0.0, 1.0, 0.5, 0.0])
    message = str(caught.value)
    root = base / "p/models" / name / "checkpoints"
    assert str(root / ".tmp-0002") in message and "disk full" in message and "ENOSPC" in message
    assert caught.value.errno == errno.ENOSPC
    assert sorted(p.name for p in root.iterdir()) == ["0000", "0001"]
    assert state.latest == 1 and 2 not in state.versions
    assert _same(state.optimizer_state, optimizer_before)
    assert _same(_live(backend), state.versions[1])
    free()
    retried = _train(backend, model, [0.0, 1.0, 0.5, 0.0])
    assert retried.step == 2
    # The same two steps on a disk that never filled give the same weights.
    control = _model(base, f"control-{base.name}")
    _train(backend, control, [1.0, 0.0, 0.5, 0.0])
    _train(backend, control, [0.0, 1.0, 0.5, 0.0])
    twin = backend._models[control.name]
    assert _same(twin.versions[2], state.versions[2], close=True)
    assert _same(twin.optimizer_state, state.optimizer_state, close=True)


# ------------------------------------------------------------------ 32.16: one name, two projects


def test_one_name_in_two_projects_is_refused_naming_both(backend: Any, tmp_path: Path) -> None:
    """Served names are ``name@step`` on one server: a second project's model of the same
    name would share the first's weights and checkpoints. Refused at register, get_step and
    train; the first model is untouched."""
    from art_trio.cpu import ModelNameConflictError

    first, second = _model(tmp_path, "shared", "alpha"), _model(tmp_path, "shared", "beta")
    _train(backend, first, [1.0, 0.0, 0.5, 0.0])

    async def attempt(call: str) -> Any:
        if call == "register":
            return await backend.register(second)
        if call == "get_step":
            return await backend._get_step(second)
        return await backend.train(
            second, [_group([0.0, 1.0])], allow_training_without_logprobs=True
        )

    for call in ("register", "get_step", "train"):
        with pytest.raises(ModelNameConflictError, match="'alpha'.*'beta'.*another name"):
            anyio.run(attempt, call)
    assert backend._models["shared"].latest == 1
    assert not (tmp_path / "beta").exists()
    assert sorted(p.name for p in (tmp_path / "alpha/models/shared/checkpoints").iterdir()) == [
        "0000",
        "0001",
    ]


# -- the completion-token settings (issue 51, item 6) --------------------------------------


def test_a_default_above_the_limit_is_refused_before_the_model_is_looked_for() -> None:
    from art_trio.cpu import CPUBackend

    with pytest.raises(ValueError, match="default_max_tokens=200 is above max_tokens_limit=16"):
        CPUBackend("/nonexistent/model", default_max_tokens=200, max_tokens_limit=16)


def test_a_request_without_max_tokens_decodes_at_most_the_limit(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The limit holds every request: one that names no max_tokens too, even after the default
    was raised past it on a built backend."""
    from art_trio.cpu import CPUBackend

    backend = CPUBackend(
        tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model"), max_tokens_limit=16
    )
    assert backend._max_tokens(10, None) == 16
    backend.default_max_tokens = 200
    assert backend._max_tokens(10, None) == 16
