"""The trainer subprocess: `python -m art_sglang.training.worker`.

JSON lines over stdin/stdout. Each request `{"id": n, "cmd": ...}` is answered by zero or more
`{"id": n, "event": "progress", "data": {...}}` lines and then exactly one `{"id": n, "event":
"result", "data": {...}}` or `{"id": n, "event": "error", "error_type": ..., "message": ...}`.
Commands: `init` (base_model, checkpoint_dir, config → step, resume notes), `train` (groups, options →
outcome), `sft` (batches of trajectories with learning rates → one progress event per batch, outcome),
`offload`, `reload`, `shutdown`. stdout carries protocol lines only: everything else (library prints,
warnings, C-level output) is redirected to stderr, which the parent writes to logs/trainer.log.
Heavy imports happen inside `main` so that the parent can import the protocol names cheaply.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import IO, Any

from .protocol import ERROR, INPUT_ERROR, PROGRESS, RESULT, STEP_ERROR, TRAINER_ERROR


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
    # Imported after the redirect: Unsloth and transformers print banners on import.
    from ..config import TrainerConfig
    from ..errors import TrainingError, TrainingInputError
    from .options import TrainOptions
    from .sft import SFTBatch
    from .trainer import Trainer

    trainer: Trainer | None = None
    for line in sys.stdin:
        if not line.strip():
            continue
        request: dict[str, Any] = {}
        try:
            request = json.loads(line)
            rid, cmd = request.get("id"), request.get("cmd")
            if cmd == "shutdown":
                channel.send(rid, RESULT, data={})
                return
            if cmd == "init":
                config = TrainerConfig.model_validate(request["config"])
                trainer = Trainer(request["base_model"], request["checkpoint_dir"], config)
                step = trainer.resume_or_init()
                data = {
                    "step": step,
                    "resumed": trainer.resumed,
                    "backend": trainer.loaded.backend,
                    "notes": trainer.notes,
                }
                channel.send(rid, RESULT, data={**data, "device": str(trainer.device)})
                continue
            if trainer is None:
                raise RuntimeError(f"{cmd!r} before init")
            if cmd == "train":
                options = TrainOptions.model_validate(request["options"])
                outcome = trainer.train(
                    request["groups"], options, lambda data, rid=rid: channel.send(rid, PROGRESS, data=data)
                )
                channel.send(rid, RESULT, data=outcome.__dict__)
            elif cmd == "sft":
                batches = [SFTBatch(b["trajectories"], float(b["learning_rate"])) for b in request["batches"]]
                outcome = trainer.train_sft(
                    batches, lambda data, rid=rid: channel.send(rid, PROGRESS, data=data)
                )
                channel.send(rid, RESULT, data=outcome.__dict__)
            elif cmd == "offload":
                channel.send(rid, RESULT, data=trainer.offload(bool(request.get("keep_weights"))))
            elif cmd == "reload":
                free = float(request.get("min_free_bytes") or 0.0)
                channel.send(rid, RESULT, data=trainer.reload(free, float(request.get("timeout_s", 10.0))))
            else:
                raise RuntimeError(f"unknown command {cmd!r}")
        except TrainingInputError as exc:
            channel.send(request.get("id"), ERROR, error_type=INPUT_ERROR, message=str(exc))
        except TrainingError as exc:  # a refused step: the trainer is back at its last checkpoint
            traceback.print_exc()
            channel.send(request.get("id"), ERROR, error_type=STEP_ERROR, message=str(exc))
        except Exception as exc:
            traceback.print_exc()
            message = f"{type(exc).__name__}: {exc}"
            channel.send(request.get("id"), ERROR, error_type=TRAINER_ERROR, message=message)


if __name__ == "__main__":
    main()
