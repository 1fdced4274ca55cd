"""Instructions per bridged call, for callgrind: `Bridge.callback` on a no-op asyncio callback.

    valgrind --tool=callgrind python benchmarks/bridge_callgrind.py CALLS s|c [BRIDGE]

Loads the bridge alone (by path, so another revision's can be compared): the package
directory `src/art_trio/plumbing/bridge/` (the default; `git archive REV
src/art_trio/plumbing/bridge` for another revision), or a single `bridge.py` of a revision
before it became a package (`git show REV:src/art_trio/bridge.py > old.py`). It makes CALLS
calls under trio, one at a time (`s`) or from 64 concurrent trio tasks (`c`). Instructions
per call are the difference between two runs (1,920 and 640 calls in benchmarks/README.md)
divided by the difference in calls, which cancels start-up. Callgrind counts instructions, so
machine load does not move the figure.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import trio

DEFAULT_BRIDGE = Path(__file__).resolve().parents[1] / "src" / "art_trio" / "plumbing" / "bridge"


def load_bridge(path: Path) -> object:
    if path.is_dir():  # the package: its modules import each other relatively
        spec = importlib.util.spec_from_file_location(
            "bridge_under_test", path / "__init__.py", submodule_search_locations=[str(path)]
        )
    else:
        spec = importlib.util.spec_from_file_location("bridge_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def noop() -> int:
    return 1


async def main(bridge_module: object, calls: int, concurrent: bool) -> None:
    async with bridge_module.open_bridge() as bridge:  # type: ignore[attr-defined]
        if not concurrent:
            for _ in range(calls):
                await bridge.callback(noop)
            return

        async def caller(n: int) -> None:
            for _ in range(n):
                await bridge.callback(noop)

        async with trio.open_nursery() as nursery:
            for _ in range(64):
                nursery.start_soon(caller, calls // 64)


if __name__ == "__main__":
    calls, mode = int(sys.argv[1]), sys.argv[2]
    path = Path(sys.argv[3]) if len(sys.argv) > 3 else DEFAULT_BRIDGE
    trio.run(main, load_bridge(path), calls, mode == "c")
