"""A real two-node Ray cluster on 127.0.0.1 for the tests: `ray start --head` plus one more node.

Each `ray start` runs in its own session, with its own temp dir, so the teardown stops exactly
the processes this cluster started (by session id, then by anything still naming the temp dir)
and never another Ray on the machine, which `ray stop --force` would also kill.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
REPO = str(Path(__file__).resolve().parents[1])
#: A cluster on 127.0.0.1 for one test module: no token auth (the `ray start` default), said
#: explicitly so a token some other Ray left in ~/.ray cannot half-enable it.
AUTH_ENV = {"RAY_AUTH_MODE": "disabled"}


class RayCluster:
    def __init__(
        self,
        *,
        nodes: int = 2,
        cpus_per_node: int = 2,
        timeout: float = 120.0,
        head_resources: dict[str, float] | None = None,
    ):
        self.nodes = nodes
        #: Custom resources only the head holds (an actor asking for them fits there only).
        self.head_resources = head_resources
        self.cpus_per_node = cpus_per_node
        self.timeout = timeout
        self.temp_dir = tempfile.mkdtemp(prefix="rt18-", dir="/tmp")  # short: unix sockets
        self.address = ""
        self._sessions: list[int] = []

    def _ray_start(self, *args: str) -> str:
        env = dict(os.environ)
        # Workers import the test's rollout functions (tests.ray_rollouts) by name.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
        env.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        env.update(AUTH_ENV)
        command = [
            RAY, "start", *args,
            f"--num-cpus={self.cpus_per_node}",
            "--object-store-memory=200000000",
            "--disable-usage-stats",
            f"--temp-dir={self.temp_dir}",
        ]  # fmt: skip
        process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._sessions.append(process.pid)
        try:
            out, _ = process.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
            raise RuntimeError(f"`ray start` timed out:\n{out}") from None
        if process.returncode != 0:
            raise RuntimeError(f"`ray start` failed ({process.returncode}):\n{out}")
        return out

    def start(self) -> RayCluster:
        try:
            out = self._ray_start(
                "--head", "--port=0", "--node-ip-address=127.0.0.1",
                "--include-dashboard=false", f"--ray-client-server-port={_free_port()}",
                *([f"--resources={json.dumps(self.head_resources)}"]
                  if self.head_resources else []),
            )  # fmt: skip
            found = re.search(r"ray start --address='([^']+)'", out)
            if found is None:
                raise RuntimeError(f"no address in `ray start --head` output:\n{out}")
            self.address = found.group(1)
            for _ in range(self.nodes - 1):
                self._ray_start(f"--address={self.address}", "--node-ip-address=127.0.0.1")
        except BaseException:
            self.stop()
            raise
        return self

    def env(self) -> dict[str, str]:
        """The environment a driver process needs to join this cluster with plain ray.init()."""
        return {"RAY_ADDRESS": self.address, "PYTHONPATH": REPO, **AUTH_ENV}

    def pids(self) -> set[int]:
        """This cluster's live processes: in its sessions or naming its temp dir (no zombies)."""
        pids: set[int] = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                if os.getsid(pid) in self._sessions:
                    pids.add(pid)
                    continue
                cmdline = (entry / "cmdline").read_bytes()
            except (OSError, ProcessLookupError):
                continue
            if self.temp_dir.encode() in cmdline and pid != os.getpid():
                pids.add(pid)
        return {pid for pid in pids if not _is_zombie(pid)}

    def stop(self) -> None:
        """Stop every process of this cluster: SIGTERM, then SIGKILL what is left."""
        deadline = time.monotonic() + 3
        sig = signal.SIGTERM
        while pids := self.pids():
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
            if time.monotonic() > deadline:
                if sig == signal.SIGKILL:
                    break
                sig, deadline = signal.SIGKILL, time.monotonic() + 5
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def session_pids(self, node: int) -> set[int]:
        """The live processes `ray start` started for node `node` (0 is the head)."""
        return {pid for pid in self.pids() if _sid(pid) == self._sessions[node]}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")
