"""Launch a whole training script the way users do (``torchrun`` or ``mpiexec``), with a timeout.

Usage::

    from tests.helpers.scripts import run_script

    out = run_script("torchrun", "examples/train_gpt.py", ["--steps", "3"], nproc=2)
    assert "loss" in out

The job runs from the repository root (or ``cwd``) in its own process group with
``OMP_NUM_THREADS=1`` and without the spawn helper's rank variables; torchrun gets a free port, so
two launches never collide. A job that exits non-zero fails the test with the tail of its output;
one still running after ``timeout`` seconds is killed with every rank, and the test fails naming
the timeout. The combined stdout and stderr come back.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence

__all__ = ["ROOT", "run_script"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "SMP_RENDEZVOUS_FILE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_script(launcher: str, script: str, args: Sequence[str] = (), *, nproc: int = 2, timeout: float = 300.0,
               env: Mapping[str, str] | None = None, cwd: str | None = None) -> str:
    """Run ``script`` under ``launcher`` ("torchrun" or "mpiexec") on ``nproc`` local ranks; its output."""
    bin_dir = os.path.dirname(sys.executable)
    script = script if os.path.isabs(script) else os.path.join(ROOT, script)
    if launcher == "torchrun":
        cmd = [os.path.join(bin_dir, "torchrun"), "--nproc-per-node", str(nproc), "--master-port",
               str(_free_port()), script, *args]
    elif launcher == "mpiexec":
        cmd = [os.path.join(bin_dir, "mpiexec"), "-n", str(nproc), sys.executable, script, *args]
    else:
        raise ValueError(f"launcher={launcher!r}: use 'torchrun' or 'mpiexec'")
    child_env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
    child_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})})
    proc = subprocess.Popen(cmd, cwd=cwd or ROOT, env=child_env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{launcher} {os.path.relpath(script, ROOT)} still running after {timeout:.0f} s "
                             f"(killed); output tail:\n{out[-4000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{launcher} {os.path.relpath(script, ROOT)} {' '.join(args)} exited with "
                             f"{proc.returncode}; output tail:\n{out[-4000:]}")
    return out
