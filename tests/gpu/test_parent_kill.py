"""The user's script SIGKILLed (no atexit, no finally) while its backend holds the GPU, on real SGLang:
every process it started exits and nothing holds GPU memory for it afterwards (nvidia-smi). Run before
tests/gpu/test_faults.py so that no other backend of this process is on the GPU.

The script is killed as soon as its server holds GPU memory and its trainer runs, i.e. during register():
the same process tree as after it, for less than a full SGLang start (CPU tests kill a script after
register()).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from gpu_helpers import compute_apps, record, role_of

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
USER_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    import art_sglang as art
    from gpu_helpers import sglang_test_config

    async def main(path, base, mode):
        backend = art.SGLangBackend(
            engine="sglang", inference_device=0, training_devices=[1] if mode == "split" else [0],
            sglang_config=sglang_test_config(), path=path)
        model = art.TrainableModel(name="agent", project="gpu-parent-kill", base_model=base)
        await model.register(backend)
        print("registered", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main(*sys.argv[1:]))
    """
)
HOLD_TIMEOUT_S = 400.0  # a cold SGLang start took up to 197 s on an H100
EXIT_TIMEOUT_S = 60.0


def _gpu_roles(pids: set[int]) -> dict[str, int]:
    """Role ('server'/'trainer') -> MiB held on the GPU by the processes among `pids`."""
    held: dict[str, int] = {}
    for pid, _, used in compute_apps():
        if pid in pids:
            try:
                role = role_of(psutil.Process(pid))
            except psutil.Error:
                continue
            if role is not None:
                held[role] = held.get(role, 0) + used
    return held


def _with_role(pids: set[int], role: str) -> bool:
    for pid in pids:
        try:
            if role_of(psutil.Process(pid)) == role:
                return True
        except psutil.Error:
            pass
    return False


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.parametrize("mode", ["split", "shared"])
def test_a_killed_user_script_leaves_no_process_and_no_gpu_memory(
    mode: str, gpu_model: str, gpu_count: int, tmp_path: Path
) -> None:
    if mode == "split" and gpu_count < 2:
        pytest.skip(f"split mode needs 2 GPUs, {gpu_count} visible")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(Path(__file__).parent)])}
    command = [sys.executable, "-c", USER_SCRIPT, str(tmp_path / ".art"), gpu_model, mode]
    user = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = time.monotonic()
    try:
        descendants: set[int] = set()
        held: dict[str, int] = {}
        while "server" not in held or not _with_role(descendants, "trainer"):
            assert user.poll() is None, f"the script exited ({user.returncode}): {user.stderr.read()[-3000:]}"
            assert time.monotonic() - started < HOLD_TIMEOUT_S, (
                f"GPU memory held after {HOLD_TIMEOUT_S} s: {held}"
            )
            time.sleep(0.5)
            descendants |= {p.pid for p in psutil.Process(user.pid).children(recursive=True)}
            held = _gpu_roles(descendants)
        descendants |= {p.pid for p in psutil.Process(user.pid).children(recursive=True)}
        held = _gpu_roles(descendants)
        killed = time.monotonic()
        user.kill()
        assert user.wait(timeout=30) == -9
        while _alive(descendants) and time.monotonic() - killed < EXIT_TIMEOUT_S:
            time.sleep(0.2)
        gone_after = time.monotonic() - killed
        assert not _alive(descendants), [
            " ".join(psutil.Process(p).cmdline())[:160] for p in _alive(descendants)
        ]
        # The driver lists a process's memory until it is freed; none of the script's may be left.
        while {
            pid for pid, _, _ in compute_apps()
        } & descendants and time.monotonic() - killed < EXIT_TIMEOUT_S:
            time.sleep(0.2)
        still_listed = {pid for pid, _, _ in compute_apps()} & descendants
        assert not still_listed, still_listed
        record(
            f"faults-{mode}/parent-sigkill",
            seconds_to_hold_gpu=killed - started,
            gpu_mib_at_kill=held,
            processes=len(descendants),
            all_gone_after_s=gone_after,
            gpu_free_after_s=time.monotonic() - killed,
        )
    finally:
        if user.poll() is None:
            user.kill()
        user.wait()
