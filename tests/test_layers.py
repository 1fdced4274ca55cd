"""The layers hold, and the contracts that say so can fail.

pyproject.toml's `[tool.importlinter]` contracts (run by `.ci/run` as `lint-imports`) are
checked here against a copy of the package with one bad import planted: an upward import, a
circle, a tool reaching into the core. Each must break the contract that forbids it, naming
the import, while the untouched copy keeps every contract. The benchmark scripts are not a
package import-linter can read, so their imports are checked directly.

The errors: every exception class art_trio defines derives from `ArtTrioError` (or is one of
the few that deliberately do not), every public one is exported and documented.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import art_trio
from art_trio.messages.errors import ArtTrioError

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
BENCHMARKS = ROOT / "benchmarks"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"],
        cwd=tree, env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the package and the contracts, to plant bad imports in."""
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} is missing: pip install -e '.[test]' (import-linter)")
    copy = tmp_path_factory.mktemp("layers")
    for package in ("art_trio", "art_trio_pytest"):
        shutil.copytree(
            SRC / package, copy / "src" / package,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    return copy


# (what is planted, module it goes into, the line, the contract it must break, what it names)
PLANTED = [
    pytest.param(
        "policy/gate.py", "from art_trio.facade import trainer as _upward  # noqa\n",
        "Layers", "art_trio.policy.gate -> art_trio.facade.trainer",
        id="upward import: policy -> facade",
    ),
    pytest.param(
        "messages/events.py", "from art_trio import run as _upward  # noqa\n",
        "Layers", "art_trio.messages.events -> art_trio.run", id="upward import: messages -> run",
    ),
    pytest.param(
        "observation/status.py", "from art_trio.config import settings as _beside  # noqa\n",
        "Layers", "art_trio.observation.status -> art_trio.config.settings",
        id="settings and observation are independent",
    ),
    pytest.param(
        "policy/retention.py", "from art_trio.policy import batching as _circle  # noqa\n",
        "No circles", "retention", id="circle within a layer",
    ),
    pytest.param(
        "sim/report.py", "from art_trio.policy.gate import PolicyGate as _inside  # noqa\n",
        "Tools use the public API", "art_trio.sim.report -> art_trio.policy.gate",
        id="a tool importing the core's internals",
    ),
    pytest.param(
        "testing/doubles.py", "from art_trio.run import PipelineRun as _inside  # noqa\n",
        "art_trio.testing reaches inside only", "art_trio.testing.doubles -> art_trio.run",
        id="the testing tool reaching beyond what it checks",
    ),
    pytest.param(
        "stages/training.py", "from art_trio.watchdog import stage as _extension  # noqa\n",
        "Layers", "art_trio.stages.training -> art_trio.watchdog.stage",
        id="the kernel naming an extension",
    ),
    pytest.param(
        "watchdog/stage.py", "from art_trio.resume import lock as _other  # noqa\n",
        "Layers", "art_trio.watchdog.stage -> art_trio.resume.lock",
        id="one extension importing another",
    ),
    pytest.param(
        "stages/control.py", "from art_trio.stages import training as _sibling  # noqa\n",
        "The stages do not import each other", "art_trio.stages.control -> "
        "art_trio.stages.training", id="one stage importing another",
    ),
]


def _kernel_size() -> Any:
    """benchmarks/kernel_size.py, loaded as a module (the benchmarks are no package)."""
    spec = importlib.util.spec_from_file_location("kernel_size", BENCHMARKS / "kernel_size.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


KERNEL_SIZE = _kernel_size()
#: The extension packages: what ART's trainer has no counterpart for (docs/architecture.md).
EXTENSIONS: tuple[str, ...] = KERNEL_SIZE.EXTENSIONS


def test_the_facade_imports_an_extension_only_where_it_is_used() -> None:
    """facade/compose.py, the one kernel module naming extensions, imports each inside the
    function that needs it: importing the kernel loads none."""
    tree = ast.parse((SRC / "art_trio" / "facade" / "compose.py").read_text())
    top_level = [
        node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
    ]
    named = {
        (node.module or "").lstrip(".").split(".")[0] for node in top_level
        if isinstance(node, ast.ImportFrom)
    }
    assert not named & set(EXTENSIONS), named
    inside = {
        (node.module or "").lstrip(".").split(".")[0]
        for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node not in top_level
    }
    assert {"admission", "autotune", "resume", "watchdog"} <= inside, inside


@pytest.fixture(scope="module")
def plain_run() -> tuple[Any, list[Path]]:
    """benchmarks/kernel_size.py, and the art_trio files its plain run loaded (ART's pipeline
    with every art_trio-only capability off, run in a child process)."""
    return KERNEL_SIZE, KERNEL_SIZE.loaded_modules()


def test_a_plain_run_loads_no_extension(plain_run: tuple[Any, list[Path]]) -> None:
    _, files = plain_run
    loaded = [f.parts[f.parts.index("art_trio") + 1] for f in files]
    assert not set(loaded) & set(EXTENSIONS), sorted(set(loaded) & set(EXTENSIONS))



def test_importing_art_trio_loads_neither_art_nor_the_scheduler() -> None:
    """`import art_trio` (what `art-trio --help` does first) stays cheap; each public name
    loads its module when first used, and is the object its home module defines."""
    code = (
        "import sys, art_trio\n"
        "loaded = sorted(m for m in sys.modules if m == 'art' or m.startswith('art_trio.'))\n"
        "assert not loaded, loaded\n"
        "from art_trio import PipelineTrainer\n"
        "assert 'art' in sys.modules and 'art_trio.facade.trainer' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_every_name_the_stub_lists_is_the_one_its_home_defines() -> None:
    tree = ast.parse((SRC / "art_trio" / "__init__.pyi").read_text())
    homes = {
        alias.name: f"art_trio.{node.module}" for node in tree.body
        if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    assert set(art_trio.__all__) == set(homes) - {"RayRolloutExecutor"}
    for name, home in homes.items():
        if name != "RayRolloutExecutor":  # needs the ray extra: tests/test_ray_executor.py
            assert getattr(art_trio, name) is getattr(importlib.import_module(home), name)

def test_the_kernel_size_in_the_docs_is_the_measured_one(plain_run: tuple[Any, list[Path]]) -> None:
    """docs/architecture.md states the kernel's size as `benchmarks/kernel_size.py` measures
    it: a change that grows or shrinks the kernel updates the figure with it."""
    kernel_size, files = plain_run
    measured = sum(kernel_size.kernel_modules(files).values())
    text = (ROOT / "docs" / "architecture.md").read_text()
    stated = re.search(r"it is \*\*([\d,]+)\*\* now", text)
    assert stated is not None, "docs/architecture.md lost its kernel figure"
    assert int(stated.group(1).replace(",", "")) == measured, (
        f"docs/architecture.md says {stated.group(1)} kernel code lines; "
        f"python benchmarks/kernel_size.py measures {measured:,}"
    )


def test_each_extensions_size_in_the_docs_is_the_measured_one(
    plain_run: tuple[Any, list[Path]],
) -> None:
    """docs/architecture.md's extension table gives each extension's code lines as
    `benchmarks/kernel_size.py` measures them, for the same five extensions."""
    kernel_size, _ = plain_run
    text = (ROOT / "docs" / "architecture.md").read_text()
    stated = {
        name: int(lines.replace(",", ""))
        for name, lines in re.findall(r"^\| `(\w+)/` \|.*\| ([\d,]+) \|$", text, re.MULTILINE)
    }
    assert stated == kernel_size.extension_sizes(), (
        "docs/architecture.md's extension sizes differ from python benchmarks/kernel_size.py's"
    )


def test_the_contracts_hold_on_this_tree(tree: Path) -> None:
    result = lint_imports(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout


@pytest.mark.parametrize(("module", "line", "contract", "names"), PLANTED)
def test_a_planted_bad_import_breaks_its_contract(
    tree: Path, module: str, line: str, contract: str, names: str
) -> None:
    if module == "policy/retention.py":  # the other half of the circle
        other_half = "from art_trio.policy import retention as _c  # noqa\n"
        planted = {module: line, "policy/batching.py": other_half}
    else:
        planted = {module: line}
    saved = {}
    try:
        for name, text in planted.items():
            path = tree / "src" / "art_trio" / name
            saved[path] = path.read_text()
            path.write_text(saved[path] + text)
        result = lint_imports(tree)
    finally:
        for path, text in saved.items():
            path.write_text(text)
    out = result.stdout
    assert result.returncode != 0, out
    broken = out[out.index("Broken contracts"):]
    assert contract in broken, out
    assert names in re.sub(r"\s+", " ", broken), out


# --- the benchmark scripts: a tool's imports, read directly ---------------------------------

#: What a tool may import from art_trio: the package itself and the tools.
TOOLS = (
    "art_trio.testing", "art_trio.sim", "art_trio.bench", "art_trio.demo", "art_trio.cpu",
    "art_trio.local_backend", "art_trio.otel", "art_trio.timeline",
)

#: Micro-benchmarks of one internal module, which they exist to time: allowed that module.
INTERNAL_MICROBENCHMARKS = {
    "bridge_overhead.py": {"art_trio.plumbing.bridge"},  # the per-call cost of the asyncio bridge
    "journal_size.py": {"art_trio.resume"},  # the resume journal's record and file sizes
    # the groups queue against anyio's stream
    "group_queue_bench.py": {"art_trio.plumbing.group_queue"},
}


def art_trio_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "art_trio" or node.module.startswith("art_trio."):
                # `from art_trio.plumbing import ledger` imports a module, not a name in one.
                folder = SRC.joinpath(*node.module.split("."))
                found |= {
                    f"{node.module}.{a.name}" for a in node.names
                    if (folder / f"{a.name}.py").exists() or (folder / a.name).is_dir()
                } or {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("art_trio")}
    return found


def is_public(module: str) -> bool:
    return module == "art_trio" or any(
        module == tool or module.startswith(tool + ".") for tool in TOOLS
    )


@pytest.mark.parametrize(
    "script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
)
def test_benchmarks_use_the_public_api(script: str) -> None:
    allowed = INTERNAL_MICROBENCHMARKS.get(script, set())
    inside = {
        m for m in art_trio_imports(ROOT / "benchmarks" / script)
        if not is_public(m) and not any(m == a or m.startswith(a + ".") for a in allowed)
    }
    assert not inside, f"benchmarks/{script} imports art_trio internals {sorted(inside)}"


def test_the_benchmark_check_sees_internal_imports(tmp_path: Path) -> None:
    script = tmp_path / "bench.py"
    script.write_text(
        "from art_trio import PipelineTrainer, plumbing\n"
        "from art_trio.policy.gate import PolicyGate\nimport art_trio.sim.workloads\n"
    )
    found = art_trio_imports(script)
    assert found == {"art_trio.plumbing", "art_trio.policy.gate", "art_trio.sim.workloads"}
    inside = [m for m in sorted(found) if not is_public(m)]
    assert inside == ["art_trio.plumbing", "art_trio.policy.gate"]


# --- the errors -----------------------------------------------------------------------------

#: Exception classes that deliberately do not derive from ArtTrioError, and why.
NOT_ART_TRIO_ERRORS = {
    # Signals between art_trio's own modules, never raised to a caller (private names).
    "art_trio.messages.errors._GateClosed",
    "art_trio.messages.errors._BaseExceptionEscaped",
    "art_trio.messages.errors._LoopClosed",
    # The doubles' planned failures stand for a user's rollout raising.
    "art_trio.sim.doubles.RolloutFailed",
    "art_trio.testing.harness.PlannedRolloutError",
    # The benchmark's note to itself that a trainer lacks a knob (caught in bench/child.py).
    "art_trio.bench.trainers.UnsupportedKnob",
    # The demo server's HTTP plumbing: an error response, and a model it does not serve.
    "art_trio.local_backend.server.OpenAIError",
    "art_trio.local_backend.server.UnknownModelError",
    # The demo CLI's note to itself that a signal stopped the model load (caught in its main).
    "art_trio.demo.interrupt.Interrupted",
}


def exception_classes() -> dict[str, list[str]]:
    """Every class in src/art_trio whose bases name an exception, with those bases' names."""
    found = {}
    for path in (SRC / "art_trio").rglob("*.py"):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [ast.unparse(b) for b in node.bases]
            if any(re.search(r"(Error|Exception)$", b) for b in bases):
                found[f"{module}.{node.name}"] = bases
    return found


def test_every_exception_is_an_art_trio_error_or_says_why_not() -> None:
    classes = exception_classes()
    assert "art_trio.messages.errors.RunLockedError" in classes  # the scan finds them
    stray = []
    for qualname, bases in classes.items():
        module, name = qualname.rsplit(".", 1)
        if qualname in NOT_ART_TRIO_ERRORS:
            continue
        cls = getattr(__import__(module, fromlist=[name]), name, None) if not module.startswith(
            "art_trio.cpu"
        ) else None
        if cls is None:  # the llm extra: read the bases instead of importing torch
            if "ArtTrioError" not in bases:
                stray.append(qualname)
        elif not issubclass(cls, ArtTrioError):
            stray.append(qualname)
    assert not stray, f"not ArtTrioError and not listed as deliberate: {stray}"
    assert NOT_ART_TRIO_ERRORS <= set(classes), NOT_ART_TRIO_ERRORS - set(classes)


def test_the_kernel_defines_exceptions_only_in_errors_py() -> None:
    """The tools' errors live with the tool, an extension's may live with it (the watchdog's
    `PipelineStalled`); every kernel error is in messages/errors.py."""
    tools = ("art_trio.sim.", "art_trio.bench.", "art_trio.demo.", "art_trio.cpu.",
             "art_trio.testing.", "art_trio.local_backend.", "art_trio.timeline.",
             "art_trio.otel.")
    extensions = tuple(f"art_trio.{name}." for name in EXTENSIONS)
    elsewhere = [q for q in exception_classes()
                 if not q.startswith(("art_trio.messages.errors.", *tools, *extensions))]
    assert not elsewhere, f"define these in art_trio/messages/errors.py: {elsewhere}"


def test_every_public_error_is_exported_and_documented() -> None:
    import art_trio.messages.errors as errors

    api = (ROOT / "docs" / "api.md").read_text()
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, ArtTrioError), name
        assert getattr(art_trio, name) is cls, f"art_trio.{name} is not exported"
        assert f"::: art_trio.{name}\n" in api, f"docs/api.md lacks art_trio.{name}"
    private = [n for n in vars(errors) if isinstance(getattr(errors, n), type)
               and issubclass(getattr(errors, n), BaseException) and n not in errors.__all__]
    assert all(n.startswith("_") for n in private), f"internal errors must be private: {private}"


def _all_of(package: str) -> set[str]:
    """`art_trio.<package>.__all__`, read from the source (the llm extra need not be
    installed to check art_trio.cpu)."""
    tree = ast.parse((SRC / "art_trio" / package / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"art_trio/{package}/__init__.py has no __all__")


#: Errors a tool raises to its callers that another package defines.
RAISED_THROUGH = {"cpu": {"OpenAIError", "UnknownModelError"}}


@pytest.mark.parametrize("package", ["cpu", "testing"])
def test_a_tool_package_exports_every_error_a_caller_can_catch(package: str) -> None:
    """A user catches an error by the name its package exports: each public exception class
    a tool's modules define (and those it raises from a package it builds on) is in the
    package's `__all__`."""
    defined = {
        qualname.rsplit(".", 1)[1]
        for qualname in exception_classes()
        if qualname.startswith(f"art_trio.{package}.")
    }
    public = {name for name in defined if not name.startswith("_")}
    missing = (public | RAISED_THROUGH.get(package, set())) - _all_of(package)
    assert not missing, f"art_trio.{package} does not export {sorted(missing)}"


def test_the_exported_errors_are_the_classes_raised() -> None:
    import art_trio.testing
    from art_trio.testing.harness import PlannedRolloutError

    assert art_trio.testing.PlannedRolloutError is PlannedRolloutError
    if importlib.util.find_spec("torch") is None:
        return  # art_trio.cpu needs the llm extra to import; its __all__ is checked above
    import art_trio.cpu
    from art_trio.cpu import engine
    from art_trio.local_backend import server

    assert art_trio.cpu.EngineClosed is engine.EngineClosed
    assert art_trio.cpu.RequestTooLarge is engine.RequestTooLarge
    assert art_trio.cpu.OpenAIError is server.OpenAIError
    assert art_trio.cpu.UnknownModelError is server.UnknownModelError


def test_public_errors_keep_the_builtin_bases_callers_catch() -> None:
    from art_trio import (
        CallbackNotAwaitable,
        LoopUnresponsive,
        ModelDirectoryLostError,
        ProfileError,
        RunLockedError,
        StateFileError,
    )
    from art_trio.testing.pipeline import PipelineCheckFailed

    assert issubclass(StateFileError, ValueError) and issubclass(RunLockedError, RuntimeError)
    assert issubclass(LoopUnresponsive, TimeoutError)
    assert issubclass(ModelDirectoryLostError, OSError)
    assert issubclass(CallbackNotAwaitable, TypeError) and issubclass(ProfileError, ValueError)
    assert issubclass(PipelineCheckFailed, AssertionError)
    assert issubclass(PipelineCheckFailed, ArtTrioError)


def test_no_function_is_more_complex_than_radon_grade_c() -> None:
    """Cyclomatic complexity at most 20 (radon's grade C) everywhere in the package."""
    from radon.complexity import cc_rank, cc_visit

    too_complex = [
        f"{path.relative_to(SRC)}:{block.lineno} {block.name} ({cc_rank(block.complexity)})"
        for path in sorted((SRC / "art_trio").rglob("*.py"))
        for block in cc_visit(path.read_text())
        if cc_rank(block.complexity) > "C"
    ]
    assert not too_complex, too_complex
