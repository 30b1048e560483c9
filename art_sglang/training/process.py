"""`TrainerProcess`: the parent-side handle of the trainer worker subprocess (see worker.py for the
protocol). The worker gets `CUDA_VISIBLE_DEVICES` in its environment before it imports torch, runs in its
own session, writes stderr to the trainer log, and is killed with its whole tree by `stop()`, at
interpreter exit, when the handle is garbage collected, and (Linux) when the thread that started it dies.
With several GPUs (or `cpu_ranks` > 1) the worker is started through torch's elastic launcher, one
data-parallel rank per device (ranks.py); the launcher ends every rank when one of them dies.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from subprocess import Popen
from typing import IO, Any

from ..config import HANG_FACTOR, HANG_FLOOR_S, TrainerConfig
from ..errors import TrainerError, TrainingError, TrainingInputError
from ..process_tree import EXIT_GRACE_SECONDS, ManagedProcess
from ..trajectories import TrajectoryGroup
from .options import StepOutcome, TrainOptions
from .protocol import ERROR, INPUT_ERROR, MAIN_RANK_COMMANDS, PROGRESS, RESULT, STEP_ERROR
from .sft import SFTBatch
from .validation import CheckedGroups, WireGroup, check_groups, for_trainer

logger = logging.getLogger(__name__)

_SHUTDOWN_WAIT_SECONDS = 10.0
_LAUNCHER_VARIABLES = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
}  # fmt: skip

# After the servers failed a bucket pushed over a weight-update group, how long the worker may take to end the
# push: its broadcast may wait on servers that never receive (NCCL's connection setup has no timeout), so a
# worker still in it then is stopped (the next step restarts it from its newest checkpoint).
FAILED_PUSH_SETTLE_S = 30.0
# The requests that are steps: bounded by the silence HANG_FACTOR and HANG_FLOOR_S derive from the longest
# one so far (step_timeout stays the ceiling, and the only bound before one was measured).
_STEP_COMMANDS = ("train", "sft")

ProgressCallback = Callable[[dict[str, Any]], None]
BucketCallback = Callable[[dict[str, Any], bool, int], Awaitable[bool]]  # (bucket, last, step) -> go on
_ERRORS: dict[Any, type[TrainerError] | type[TrainingInputError]] = {
    INPUT_ERROR: TrainingInputError,
    STEP_ERROR: TrainingError,
}


class TrainerProcess(ManagedProcess):
    """One trainer worker: loads the base model once and serves many `train()` calls, one at a time (see
    `ManagedProcess` for when its tree is killed)."""

    def __init__(
        self,
        base_model: str,
        checkpoint_dir: Path,
        config: TrainerConfig,
        *,
        gpu_ids: Sequence[int | str] | None,
        log_path: Path,
        cpu_ranks: int = 1,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.base_model = base_model
        self.checkpoint_dir = Path(checkpoint_dir)
        self.config = config
        self.gpu_ids = gpu_ids
        self._extra_env = dict(env or {})
        # One rank per training GPU; on CPU (no gpu_ids, or none listed) as many as asked.
        self.ranks = len(gpu_ids) if gpu_ids else cpu_ranks
        label = (
            "trainer worker"
            if self.ranks == 1
            else f"trainer worker of {self.ranks} ranks (torch.distributed.run)"
        )
        super().__init__(label, log_path)
        self.info: dict[str, Any] = {}  # the worker's answer to init: step, resumed, backend, device
        self._lines: _Lines | None = None
        self.step: int | None = None  # the newest step the worker reported
        self.longest_step: float | None = None  # seconds, of the train and sft calls answered so far
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._stopped = False  # stop() was called since the worker started
        self.update_group: str | None = None  # the weight-update group this worker is rank 0 of

    def command(self) -> list[str]:
        python = self.config.trainer_python or sys.executable
        if self.ranks == 1:
            return [python, "-m", "art_sglang.training.worker"]
        # --standalone: a rendezvous of its own on a free local port; no restarts: a dead rank ends the
        # worker, and the next step starts a new one from the newest checkpoint. --log-dir: its folder beside
        # the trainer's log (left to itself it makes one in /tmp at every start and never removes it).
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.ranks}"]
        log_dir = f"--log-dir={self.log_path.parent / 'torchelastic'}"
        return [python, *launcher, log_dir, "--max-restarts=0", "-m", "art_sglang.training.worker"]

    def environment(self) -> dict[str, str]:
        # A backend that itself runs under torch's launcher must not hand its own rank and rendezvous to
        # the trainer: the trainer's launcher sets its ranks' own, and a single worker has none.
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES} | self._extra_env
        if self.gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in self.gpu_ids)
        # The worker must import this very package, even when it is not installed (a source checkout).
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    async def start(self) -> int:
        """Start the worker; it loads the base model, resumes the newest complete checkpoint or writes
        step 0. Returns the step. TrainerError (with the log tail) if it fails."""
        if self.is_alive() and self.step is not None:
            return self.step
        await self.stop()  # the remains of a worker that died
        self._stopped = False
        self.update_group = None
        # Popen on the event loop's thread on purpose: the parent-death signal follows the forking thread.
        popen = self._launch(self.command(), self.environment(), pipes=True, note=f" gpus={self.gpu_ids}")
        assert popen.stdout is not None
        self._lines = _Lines(popen.stdout)
        try:
            self.info = await self._request(
                "init",
                base_model=self.base_model,
                checkpoint_dir=str(self.checkpoint_dir),
                config=self.config.model_dump(mode="json"),
            )
        except BaseException:
            await self.stop()
            raise
        self.step = int(self.info["step"])
        logger.info(
            "trainer for %s: %s on %s, %s (pids %s)",
            self.checkpoint_dir.parent.name,
            self.info.get("backend"),
            "GPU " + ",".join(map(str, self.gpu_ids)) if self.gpu_ids else "CPU",
            "1 rank" if self.ranks == 1 else f"{self.ranks} data-parallel ranks (torch.distributed.run)",
            self.info.get("pids"),
        )
        for note in self.info.get("notes") or []:
            logger.warning("%s: %s", self.checkpoint_dir, note)
        return self.step

    async def train(
        self,
        groups: CheckedGroups | Sequence[TrajectoryGroup | WireGroup],
        options: TrainOptions,
        *,
        on_progress: ProgressCallback | None = None,
    ) -> StepOutcome:
        """One training step on `groups` (one step number; ART's optimizer steps, one per packed row).
        Input problems raise TrainingInputError before anything is trained or written; a refused step
        (non-finite values, a checkpoint that cannot be written) raises TrainingError with the trainer
        back at its last checkpoint; `trained=False` (with `reason`) when no group carries a learning
        signal: the step still advances, to a copy of the last checkpoint, as in ART.
        `on_progress` gets one event per micro-batch. Cancelling the call does not stop the worker: it
        finishes that step (and its checkpoint), and the next call's outcome carries the step reached."""
        # Checked here unless the caller did already (the backend, before the GPU handoff); the worker
        # trains on what passed.
        checked = (
            groups if isinstance(groups, CheckedGroups) else check_groups(groups, **options.input_rules())
        )
        data = await self._request(
            "train", on_progress=on_progress, groups=for_trainer(checked.wire), options=options.model_dump()
        )
        return self._outcome(data)

    def _outcome(self, data: dict[str, Any]) -> StepOutcome:
        path = data.get("checkpoint_path")
        self.step = int(data["step"])
        return StepOutcome(
            step=int(data["step"]),
            metrics={k: float(v) for k, v in data["metrics"].items()},
            checkpoint_path=Path(path) if path else None,
            trained=bool(data["trained"]),
            reason=data.get("reason"),
        )

    async def sft(
        self, batches: list[SFTBatch], *, on_progress: ProgressCallback | None = None
    ) -> StepOutcome:
        """One SFT call (see sft.py): one optimizer step per batch, one new step and checkpoint.
        `on_progress` gets each batch's metrics event."""
        wire = [{"trajectories": b.trajectories, "learning_rate": b.learning_rate} for b in batches]
        return self._outcome(await self._request("sft", on_progress=on_progress, batches=wire))

    async def offload(self, *, keep_weights: bool = False) -> float:
        """Free the GPU after a step (shared mode): cached blocks, and unless `keep_weights` the model and
        optimizer state (moved to host memory). Returns the device's free bytes after; no-op on CPU."""
        return float((await self._request("offload", keep_weights=keep_weights))["free_bytes"])

    async def reload(self, *, min_free_bytes: float = 0.0, timeout_s: float = 10.0) -> dict[str, float]:
        """Take the GPU for a step once `min_free_bytes` are free on it (see `Trainer.reload`)."""
        return await self._request("reload", min_free_bytes=min_free_bytes, timeout_s=timeout_s)

    async def join_update_group(
        self, master_address: str, master_port: int, world_size: int, group_name: str, backend: str,
        timeout_s: float,
    ) -> None:  # fmt: skip
        """Make rank 0 the sender of the servers' weight-update group `group_name` (weight_group.py), leaving
        any earlier one; returns once every member joined. TrainerError if it failed."""
        self.update_group = None
        await self._request(
            "join_update_group", master_address=master_address, master_port=master_port,
            world_size=world_size, group_name=group_name, backend=backend, timeout_s=timeout_s,
        )  # fmt: skip
        self.update_group = group_name

    async def push_merged(
        self,
        on_bucket: BucketCallback,
        *,
        max_bytes: int,
        load_format: str | None,
        group_name: str | None,
        settle_s: float = FAILED_PUSH_SETTLE_S,
    ) -> tuple[int, int]:
        """Hand the servers the trainer's merged weights (merged_weights.py), bucket by bucket:
        `on_bucket(bucket, last, step)` loads one of `step`'s weights on the servers and returns True to go
        on; the worker keeps the bucket alive until it returns. The bucket is `{"payload"}` (serialized
        tensors) or, with `group_name` (joined by `join_update_group`), `{"names", "dtypes", "shapes"}`
        while the worker broadcasts it over the group. Returns (the step those weights are, buckets sent):
        fewer than all when `on_bucket` returned False. An exception in `on_bucket` stops the push and is
        raised; after a failed push over a group the worker has left it, or it was stopped when it did not end
        the push within `settle_s` seconds."""
        try:
            data = await self._request(
                "push_merged", on_bucket=on_bucket, settle_s=settle_s if group_name is not None else None,
                max_bytes=max_bytes, load_format=load_format, group_name=group_name,
            )  # fmt: skip
        except BaseException:
            if group_name is not None:
                self.update_group = None
            raise
        return int(data["step"]), int(data["buckets"])

    async def stop(self) -> None:
        """Ask the worker to exit, then kill whatever is left of its tree. Idempotent. A request in flight
        then raises a `TrainerError` that says the trainer was stopped, not that it died."""
        self._stopped = True
        await self._kill(ask_first=not self._lock.locked())

    async def _kill(self, ask_first: bool = False) -> None:
        popen = self._popen
        if popen is None:
            return
        if ask_first and self.is_alive():
            with contextlib.suppress(OSError, ValueError):
                await asyncio.to_thread(_write, popen.stdin, {"id": 0, "cmd": "shutdown"})
            with contextlib.suppress(Exception):
                await asyncio.to_thread(popen.wait, _SHUTDOWN_WAIT_SECONDS)
        await self._terminate(EXIT_GRACE_SECONDS)
        for stream in (popen.stdin, popen.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()

    def _died(self, what: str) -> TrainerError:
        return TrainerError(self.describe_death(what))

    async def _request(
        self,
        cmd: str,
        *,
        on_progress: ProgressCallback | None = None,
        on_bucket: BucketCallback | None = None,
        settle_s: float | None = None,
        **fields: Any,
    ) -> dict:
        async with self._lock:
            popen, lines = self._popen, self._lines
            if popen is None or lines is None:
                raise TrainerError(f"the trainer is not running (not started, or stopped); cannot {cmd}")
            if not self.is_alive():
                raise self._died("is not running")
            rid = next(self._ids)
            try:
                await asyncio.to_thread(_write, popen.stdin, {"id": rid, "cmd": cmd, **fields})
            except (OSError, ValueError):
                raise self._died(f"closed its input while receiving {cmd!r}") from None
            # Loading the model at init may take long for reasons of its own (downloads); steps may not.
            timeout = None if cmd == "init" else self.config.step_timeout
            began = time.monotonic()
            deadline = began + (timeout or 0.0)
            silence = self._silence_limit(cmd)
            while True:
                left = None if timeout is None else max(deadline - time.monotonic(), 0.0)
                silent = silence is not None and (left is None or silence < left)
                try:
                    line = await asyncio.wait_for(lines.next(), silence if silent else left)
                except asyncio.TimeoutError:
                    await self._kill()
                    raise TrainerError(self._hang_message(cmd, silence if silent else None)) from None
                if line is None:
                    await asyncio.to_thread(_wait_quietly, popen)
                    if self._stopped:  # by the backend's close() (nothing else stops a busy trainer)
                        raise TrainerError(
                            f"the backend was closed while the trainer ran {cmd!r}: it was stopped before "
                            "the step finished"
                        )
                    raise self._died(f"died during {cmd!r}")
                message = json.loads(line)
                if message.get("id") != rid:
                    continue  # the tail of a request whose caller was cancelled
                event = message.get("event")
                if event == PROGRESS and on_bucket is not None:
                    try:
                        await self._answer_bucket(popen, rid, on_bucket, message.get("data") or {})
                    except Exception:
                        if settle_s is not None:
                            await self._settle(lines, rid, cmd, settle_s)
                        raise
                elif event == PROGRESS and on_progress is not None:
                    on_progress(message.get("data") or {})
                elif event == RESULT:
                    if cmd in _STEP_COMMANDS:
                        self.longest_step = max(self.longest_step or 0.0, time.monotonic() - began)
                    return message.get("data") or {}
                elif event == ERROR:
                    error = _ERRORS.get(message.get("error_type"), TrainerError)
                    text = message.get("message", "unknown trainer error")
                    if error is TrainerError and self.ranks > 1 and cmd not in MAIN_RANK_COMMANDS:
                        # Such an error ends a worker of several ranks (worker.py), often because another
                        # rank died: say how it ended, with the launcher's summary from the log.
                        await asyncio.to_thread(_wait_quietly, popen)
                        raise self._died(f"stopped after an error on rank 0 ({text})")
                    raise error(text)

    async def _answer_bucket(
        self, popen: Popen[bytes], rid: int, on_bucket: BucketCallback, data: dict[str, Any]
    ) -> None:
        """Hand a pushed bucket to `on_bucket` and ack it; a failure acks "stop" first, so the worker
        finishes the command (its result is then skipped as a cancelled request's)."""
        ok = False
        try:
            bucket = {key: value for key, value in data.items() if key not in ("last", "step")}
            ok = bool(await on_bucket(bucket, bool(data["last"]), int(data["step"])))
        finally:
            with contextlib.suppress(OSError, ValueError):
                await asyncio.to_thread(_write, popen.stdin, {"id": rid, "cmd": "ack", "ok": ok})

    async def _settle(self, lines: _Lines, rid: int, cmd: str, limit: float) -> None:
        """Wait up to `limit` seconds for the worker to end request `rid` (refused by the parent); stop it if
        it does not."""
        deadline = time.monotonic() + limit
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = await asyncio.wait_for(lines.next(), left)
            except asyncio.TimeoutError:
                break
            if line is None:
                return  # it died; the next request says so
            message = json.loads(line)
            if message.get("id") == rid and message.get("event") in (RESULT, ERROR):
                return
        logger.warning(
            "the trainer worker did not end %r within %g s of a failed bucket: stopping it", cmd, limit
        )
        await self._kill()

    def _silence_limit(self, cmd: str) -> float | None:
        """How long a step may go without a word from the worker, from its measured steps; None: no bound
        but step_timeout (not a step, or none measured yet)."""
        if cmd not in _STEP_COMMANDS or self.longest_step is None:
            return None
        return max(HANG_FACTOR * self.longest_step, HANG_FLOOR_S)

    def _hang_message(self, cmd: str, silence: float | None) -> str:
        if silence is None:
            what = (
                f"did not finish {cmd!r} within {self.config.step_timeout:g} s (TrainerConfig.step_timeout)"
            )
        else:
            what = (
                f"sent nothing for {silence:.0f} s during {cmd!r} ({HANG_FACTOR:g} times its longest step so "
                f"far, {self.longest_step:.1f} s, and at least {HANG_FLOOR_S:g} s; TrainerConfig.step_timeout "
                f"= {self.config.step_timeout:g} s is the ceiling)"
            )
        return (
            f"the trainer worker {what}; it was stopped (hung or stopped process?) and the next step restarts "
            f"it from its newest checkpoint.\nlog: {self.log_path}"
        )


def _write(stream: IO[bytes] | None, request: dict[str, Any]) -> None:
    """One request line. NaN/inf stay JSON literals (Python's json reads them back); other odd values
    become strings."""
    assert stream is not None
    stream.write(json.dumps(request, default=str).encode() + b"\n")
    stream.flush()


def _wait_quietly(popen: Popen[bytes]) -> None:
    with contextlib.suppress(Exception):
        popen.wait(EXIT_GRACE_SECONDS)


class _Lines:
    """The worker's stdout lines, read by a thread and awaited from whichever event loop is running (a
    handle started under one `asyncio.run` keeps working under the next). None marks the end."""

    def __init__(self, stdout: IO[bytes]) -> None:
        self._buffer: collections.deque[bytes] = collections.deque()
        self._ended = False
        self._guard = threading.Lock()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        threading.Thread(target=self._pump, args=(stdout,), daemon=True).start()

    def _pump(self, stdout: IO[bytes]) -> None:
        with contextlib.suppress(ValueError, OSError):  # the pipe was closed by stop()
            for line in stdout:
                self._push(line)
        self._push(None)

    def _push(self, line: bytes | None) -> None:
        with self._guard:
            if line is None:
                self._ended = True
            else:
                self._buffer.append(line)
            if self._waiter is not None:
                loop, event = self._waiter
                with contextlib.suppress(RuntimeError):  # that loop is closed; nobody waits there
                    loop.call_soon_threadsafe(event.set)

    async def next(self) -> bytes | None:
        while True:
            event = asyncio.Event()
            with self._guard:
                if self._buffer:
                    return self._buffer.popleft()
                if self._ended:
                    return None
                self._waiter = (asyncio.get_running_loop(), event)
            try:
                await event.wait()
            finally:
                with self._guard:
                    self._waiter = None
