"""The trainer subprocess: `python -m art_sglang.training.worker`.

JSON lines over stdin/stdout. Each request `{"id": n, "cmd": ...}` is answered by zero or more
`{"id": n, "event": "progress", "data": {...}}` lines and then exactly one `{"id": n, "event":
"result", "data": {...}}` or `{"id": n, "event": "error", "error_type": ..., "message": ...}`.
Commands: `init` (base_model, checkpoint_dir, config → step, resume notes), `train` (groups, options →
outcome), `sft` (batches of trajectories with learning rates → one progress event per batch, outcome),
`offload`, `reload`, `join_update_group` (master_address, master_port, world_size, group_name, backend,
timeout_s: rank 0 joins the servers' weight-update group as its rank 0, leaving any earlier one),
`push_merged` (max_bytes, load_format, group_name → one progress event per bucket of merged weights,
`{"payload", "last", "step"}`, or with group_name `{"names", "dtypes", "shapes", "last", "step"}` followed
by the bucket's broadcast over that group; each answered by the parent's `{"id": n, "cmd": "ack", "ok":
bool}` once the servers loaded it; then `{"step", "buckets"}`), `shutdown`. stdout carries protocol lines only:
everything else (library prints, warnings, C-level output) is redirected to stderr, which the parent
writes to logs/trainer.log.
Heavy imports happen inside `main` so that the parent can import the protocol names cheaply.
Under torch's launcher (several training devices) every rank runs this module: rank 0 speaks the
protocol and passes each request on to the others (ranks.py).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from typing import IO, Any

from .protocol import ERROR, INPUT_ERROR, MAIN_RANK_COMMANDS, PROGRESS, RESULT, STEP_ERROR, TRAINER_ERROR


class _Channel:
    """The protocol stream: a private copy of the original stdout."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def send(self, request_id: Any, event: str, **fields: Any) -> None:
        self.stream.write(json.dumps({"id": request_id, "event": event, **fields}, default=str) + "\n")
        self.stream.flush()


def _claim_stdout() -> _Channel:
    """Keep fd 1 for the protocol and point fd 1 / sys.stdout at stderr for everyone else."""
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return _Channel(protocol)


def main() -> None:
    channel = _claim_stdout()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "WORLD_SIZE" in os.environ:
        # torch's launcher starts each rank in a session of its own: without this, a launcher killed
        # with SIGKILL would leave its ranks running.
        from ..process_tree import die_with_parent

        die_with_parent()
    # Imported after the redirect: Unsloth and transformers print banners on import.
    from .ranks import Ranks

    ranks = Ranks.from_environment()
    try:
        _serve(channel if ranks.is_main else None, ranks)
    finally:
        ranks.close()


def _serve(channel: _Channel | None, ranks: Any) -> None:
    """Answer requests until `shutdown` or the end of stdin. Rank 0 reads them and passes each to the
    other ranks, which run it alongside and stay silent. In a step, the ranks raise TrainingInputError and
    TrainingError at the same point (from the same input, or after a collective), so those leave them in
    step; with several ranks any other error, or any error at init (where rank 0 alone reads and writes
    checkpoints), ends the worker (the backend restarts it at the next step)."""
    from ..config import TrainerConfig
    from ..errors import TrainingError, TrainingInputError
    from .options import TrainOptions
    from .sft import SFTBatch
    from .step_profile import StepProfiler
    from .trainer import Trainer

    def send(request_id: Any, event: str, **fields: Any) -> None:
        if channel is not None:
            channel.send(request_id, event, **fields)

    trainer: Trainer | None = None
    profiler = StepProfiler(ranks.rank, ranks.world)
    update_group = _UpdateGroup()
    long_lived = _LongLivedObjects()
    cmd = None
    try:
        while True:
            long_lived.freeze_after(cmd)  # the last command's answer is out: off the next step's path
            # The line as it came, parsed by every rank at once: a step's request (its rollouts with a logprob
            # entry per token) takes longer to parse, or to pickle for the others, than to pass on as text.
            line = ranks.from_main(_read_line() if ranks.is_main else None)
            if line is None:
                return
            try:
                request = _parse(line)
            except ValueError as exc:  # the same text fails on every rank: all skip it
                send(None, ERROR, error_type=TRAINER_ERROR, message=f"{type(exc).__name__}: {exc}")
                continue
            rid, cmd = request.get("id"), request.get("cmd")
            if cmd == "ack":
                continue  # for a bucket of a push that failed here before it read the ack
            try:
                if cmd == "shutdown":
                    send(rid, RESULT, data={})
                    return
                if cmd == "init":
                    config = TrainerConfig.model_validate(request["config"])
                    trainer = Trainer(request["base_model"], request["checkpoint_dir"], config, ranks)
                    step = trainer.resume_or_init()
                    data = {
                        "step": step,
                        "resumed": trainer.resumed,
                        "backend": trainer.loaded.backend,
                        "notes": trainer.notes,
                        "device": str(trainer.device),
                        "ranks": ranks.world,
                        "pids": ranks.gather(os.getpid()),
                    }
                    send(rid, RESULT, data=data)
                    continue
                if trainer is None:
                    raise RuntimeError(f"{cmd!r} before init")
                if cmd == "train":
                    options = TrainOptions.model_validate(request["options"])
                    with profiler.train_call():
                        outcome = trainer.train(
                            request["groups"], options, lambda data, rid=rid: send(rid, PROGRESS, data=data)
                        )
                    send(rid, RESULT, data=outcome.__dict__)
                elif cmd == "sft":
                    batches = [
                        SFTBatch(b["trajectories"], float(b["learning_rate"])) for b in request["batches"]
                    ]
                    outcome = trainer.train_sft(batches, lambda data, rid=rid: send(rid, PROGRESS, data=data))
                    send(rid, RESULT, data=outcome.__dict__)
                elif cmd == "offload":
                    send(rid, RESULT, data=trainer.offload(bool(request.get("keep_weights"))))
                elif cmd == "join_update_group":
                    send(rid, RESULT, data=update_group.join(request) if ranks.is_main else {})
                elif cmd == "push_merged":
                    send(
                        rid, RESULT, data=_push_merged(trainer, request, channel, update_group, ranks.is_main)
                    )
                elif cmd == "reload":
                    free = float(request.get("min_free_bytes") or 0.0)
                    send(rid, RESULT, data=trainer.reload(free, float(request.get("timeout_s", 10.0))))
                else:
                    raise RuntimeError(f"unknown command {cmd!r}")
            except TrainingInputError as exc:
                send(rid, ERROR, error_type=INPUT_ERROR, message=str(exc))
                if cmd == "init" and ranks.world > 1:
                    raise
            except TrainingError as exc:  # a refused step: the trainer is back at its last checkpoint
                traceback.print_exc()
                send(rid, ERROR, error_type=STEP_ERROR, message=str(exc))
                if cmd == "init" and ranks.world > 1:
                    raise
            except Exception as exc:
                traceback.print_exc()
                message = f"{type(exc).__name__}: {exc}"
                if ranks.world > 1 and cmd not in MAIN_RANK_COMMANDS:
                    message += (
                        f" (on rank 0 of {ranks.world}; the trainer stops and the next step restarts it; its log "
                        "names the rank that failed first)"
                    )
                send(rid, ERROR, error_type=TRAINER_ERROR, message=message)
                if ranks.world > 1 and cmd not in MAIN_RANK_COMMANDS:
                    raise  # the other ranks may wait in a collective this rank will never join
    finally:
        update_group.leave()
        if trainer is not None:
            trainer.close()  # the last checkpoint's optimizer state on disk before the exit


class _LongLivedObjects:
    """Exempts what the model's load and the first step leave (the model, Unsloth's patches, compiled code
    and its caches: ~0.7 million objects with the tiny model on CPU, more on a GPU) from later garbage
    collections. A full collection walks every tracked object (0.5 s on a CPU test host); one that comes
    inside a step stalls that rank, and with several ranks every rank at the next collective.
    Done twice in a process's life, after `init` and after the first `train` or `sft`, never later: an
    object frozen and later made cyclic garbage is never reclaimed, so what later steps leave stays
    collectable."""

    def __init__(self) -> None:
        self._pending = [{"init"}, {"train", "sft"}]

    def freeze_after(self, cmd: str | None) -> None:
        """Collect and freeze if `cmd` (the command just answered) is one of those moments, the first time."""
        moment = next((m for m in self._pending if cmd in m), None)
        if moment is None:
            return
        self._pending.remove(moment)
        started = time.perf_counter()
        gc.collect()
        gc.freeze()
        print(
            f"garbage collector: {gc.get_freeze_count()} objects frozen after the first {cmd} "
            f"({time.perf_counter() - started:.2f} s)",
            file=sys.stderr,
        )


class _UpdateGroup:
    """The weight-update group rank 0 is the sender of (weight_group.py): one at a time."""

    def __init__(self) -> None:
        self.name: str | None = None
        self._group: Any = None

    def join(self, request: dict[str, Any]) -> dict[str, Any]:
        from .. import weight_group

        self.leave()
        self._group = weight_group.join(
            str(request["master_address"]), int(request["master_port"]), 0, int(request["world_size"]),
            str(request["group_name"]), backend=str(request["backend"]), timeout_s=float(request["timeout_s"]),
        )  # fmt: skip
        self.name = str(request["group_name"])
        return {"group_name": self.name}

    def group(self, name: str) -> Any:
        if name != self.name:
            raise RuntimeError(
                f"push_merged over weight-update group {name!r}, but this trainer is in {self.name!r}"
            )
        return self._group

    def leave(self) -> None:
        """Leave the group, if any (the servers may have left it first, or died)."""
        from .. import weight_group

        group, self._group, self.name = self._group, None, None
        if group is not None:
            try:
                weight_group.leave(group)
            except Exception:  # torch raises what its backend raises; the group is gone anyway
                traceback.print_exc()


def _push_merged(
    trainer: Any, request: dict[str, Any], channel: _Channel | None, update_group: _UpdateGroup, main: bool
) -> dict:
    """The `push_merged` command. Every rank holds the same weights, so rank 0 alone pushes; it reads the
    parent's acks itself (they are not passed on: the other ranks wait for the next command meanwhile). A
    push over a group that fails leaves the group (it is in no known state; the parent makes a new one)."""
    from .merged_weights import push_merged

    rid = request.get("id")

    def send_bucket(bucket: dict[str, Any], last: bool, transfer: Any) -> bool:
        assert channel is not None
        channel.send(rid, PROGRESS, data={**bucket, "last": last, "step": trainer.step})
        if transfer is not None:
            transfer()
        line = _read_line()
        ack = _parse(line) if line is not None else {}
        if ack.get("id") != rid or ack.get("cmd") != "ack":
            raise RuntimeError(f"push_merged: expected the parent's ack of a bucket, got {line!r}")
        return bool(ack.get("ok"))

    if not main:
        return {"step": trainer.step, "buckets": 0}
    name = request.get("group_name")
    group = update_group.group(name) if name is not None else None
    try:
        sent = push_merged(
            trainer.model, int(request["max_bytes"]), send_bucket,
            load_format=request.get("load_format"), group=group,
        )  # fmt: skip
    except Exception:
        if group is not None:
            update_group.leave()
        raise
    return {"step": trainer.step, "buckets": sent}


def _read_line() -> str | None:
    """The next non-empty line of stdin; None at its end."""
    for line in sys.stdin:
        if line.strip():
            return line
    return None


def _parse(line: str) -> dict[str, Any]:
    """A request line as its JSON object; ValueError for anything else."""
    request = json.loads(line)
    if not isinstance(request, dict):
        raise ValueError(f"a request is a JSON object, got {line.strip()[:80]!r}")
    return request


if __name__ == "__main__":
    main()
