"""The on-disk layout of one model's run: `<path>/<project>/models/<name>/`.

    model.json                 the model as registered
    checkpoints/<step:04d>/    adapter_config.json, adapter_model.safetensors, optimizer.pt, trainer_state.json
    logs/server.log  logs/trainer.log
    history.jsonl              one row per train() and log()
    trajectories/<split>/<step:04d>.jsonl   trajectory groups handed to log()

Checkpoints are written by the trainer (to a temporary dir, then renamed); this module only reads,
validates and deletes them, and writes model.json atomically.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..config import DEFAULT_LORA_RANK, SGLangConfig
from ..errors import AdapterLoadError
from .checkpoints import list_checkpoints

MODEL_JSON = "model.json"
HISTORY_FILE = "history.jsonl"
ADAPTER_CONFIG = "adapter_config.json"
MODEL_CONFIG = "config.json"  # what every Hugging Face model directory holds
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


class ModelStore:
    """Paths and file operations of one model's output directory."""

    def __init__(self, root: str | Path, project: str, name: str):
        self.root = Path(root)
        self.dir = self.root / project / "models" / name

    @property
    def model_json(self) -> Path:
        return self.dir / MODEL_JSON

    @property
    def checkpoints_dir(self) -> Path:
        return self.dir / "checkpoints"

    @property
    def logs_dir(self) -> Path:
        return self.dir / "logs"

    @property
    def server_log(self) -> Path:
        return self.logs_dir / "server.log"

    @property
    def trainer_log(self) -> Path:
        return self.logs_dir / "trainer.log"

    @property
    def history(self) -> Path:
        return self.dir / HISTORY_FILE

    def merged_dir(self, step: int) -> Path:
        """Where `weight_sync_method="disk"` writes the merged full model of `step`."""
        return self.dir / "merged" / f"{step:04d}"

    @property
    def chat_template_file(self) -> Path:
        """Where a chat template given as text in `_internal_config` is written for the server."""
        return self.dir / "chat_template.jinja"

    def trajectories_file(self, split: str, step: int) -> Path:
        return self.dir / "trajectories" / split / f"{step:04d}.jsonl"

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints_dir / f"{step:04d}"

    def create(self) -> None:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoints_dir.mkdir(parents=True, exist_ok=True)

    def write_model_json(self, data: dict[str, Any]) -> None:
        """Write model.json atomically: a crash leaves the old file or the new one, never half of one."""
        write_atomic(self.model_json, json.dumps(data, indent=2, default=str) + "\n")

    def checkpoint_steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending (in-progress and broken ones are ignored, as the
        trainer's resume does)."""
        return list_checkpoints(self.checkpoints_dir)

    def delete_checkpoints(self, steps: list[int]) -> list[int]:
        """Delete the checkpoints of `steps` (and their merged models); returns the steps deleted."""
        deleted = []
        for step in steps:
            for folder in (self.checkpoint_dir(step), self.merged_dir(step)):
                if folder.exists():
                    # Rename first so a crash mid-delete never leaves a half checkpoint under a step name.
                    doomed = folder.with_name(f"{folder.name}.deleting")
                    folder.rename(doomed)
                    shutil.rmtree(doomed)
            deleted.append(step)
        return deleted


def name_problem(value: str) -> str | None:
    """Why `value` cannot name a model or project, or None. Both become directory names, the model's
    adapters are served as `<name>@<step>`, and SGLang reads `<base>:<adapter>` in a request's model."""
    if not isinstance(value, str) or not value.strip() or value in {".", ".."}:
        return f"{value!r} cannot be used: give a non-empty name"
    bad = sorted({c for c in value if c in "/\\@:" or ord(c) < 32 or ord(c) == 127})
    if bad:
        return f"{value!r} cannot be used: it contains {', '.join(repr(c) for c in bad)} (no '/', '\\', '@', ':' or control characters)"
    return None


def base_model_problem(base_model: str) -> str | None:
    """Why `base_model` can be neither a local model directory nor a model-hub id, or None.

    Without this check a missing local path reaches the hub client, whose "Repo id must be in the form
    'repo_name' or 'namespace/repo_name'" hides that the directory does not exist, and a directory that
    is no model (say /etc) fails deep in the tokenizer's loader.
    """
    path = Path(base_model).expanduser()
    if path.exists():
        if not path.is_dir():
            return f"base model {base_model!r} is a file, not a model directory"
        if not (path / MODEL_CONFIG).is_file():
            return (
                f"base model {base_model!r} is not a model directory: it has no {MODEL_CONFIG} (a Hugging "
                f"Face model directory holds {MODEL_CONFIG}, the weights and the tokenizer's files)"
            )
        return None
    looks_local = base_model.startswith(("/", ".", "~")) or base_model.count("/") > 1
    if looks_local or not _HUB_ID.match(base_model):
        return (
            f"base model {base_model!r} does not exist (no such directory, and not a model-hub id 'org/name')"
        )
    return None


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def adapter_problem(path: Path) -> str | None:
    """Why `path` is not a loadable PEFT LoRA adapter directory, or None if it is."""
    if not path.is_dir():
        return f"{path} is not a directory"
    if not (path / ADAPTER_CONFIG).is_file():
        return f"{path} has no {ADAPTER_CONFIG}"
    if not any((path / weights).is_file() for weights in ADAPTER_WEIGHTS):
        return f"{path} has no {' or '.join(ADAPTER_WEIGHTS)}"
    try:
        json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"{path / ADAPTER_CONFIG} is unreadable: {exc}"
    return None


def check_adapter(path: Path, server: SGLangConfig) -> None:
    """Raise `AdapterLoadError` unless `path` is a local adapter a server of the settings `server` (as a plan
    settled them: max_lora_rank set) can load.

    SGLang treats a path it cannot open as a model-hub repo id and answers "Repo id must be in the form
    ...", which hides the real cause; checking here gives a message that names the directory.
    """
    problem = adapter_problem(path)
    if problem is not None:
        raise AdapterLoadError(f"cannot load adapter: {problem}")
    rank = int(json.loads((path / ADAPTER_CONFIG).read_text()).get("r", 0))
    max_lora_rank = server.max_lora_rank or DEFAULT_LORA_RANK  # unset: the rank server_args renders
    if rank > max_lora_rank:
        raise AdapterLoadError(
            f"adapter {path} has LoRA rank {rank}, above the server's max_lora_rank={max_lora_rank}: "
            f"raise SGLangConfig(max_lora_rank=...) to at least {rank}"
        )
    if server.experimental_lora_served and rank != max_lora_rank:
        # Its shrink writes `rank` columns of the pool, its expand reads `max_lora_rank` (39f section 5).
        raise AdapterLoadError(
            f"adapter {path} has LoRA rank {rank}, and the server runs SGLang 0.5.17's experimental LoRA path "
            f"(SGLangConfig.lora_experimental_path), which computes NaN for an adapter whose rank is not the "
            f"pool's max_lora_rank={max_lora_rank}: serve adapters of rank {max_lora_rank}, or set "
            "lora_experimental_path=False"
        )


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same directory and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _model_json(model: Any) -> dict[str, Any]:
    # ART's model_dump includes its private config; whatever is not JSON becomes its repr.
    return json.loads(json.dumps(model.model_dump(), default=str))


def write_model_files(store: ModelStore, model: Any, chat_template: str | None = None) -> None:
    """model.json, and `chat_template`, a template given as text, into the file the server reads."""
    store.create()
    store.write_model_json(_model_json(model))
    if chat_template is not None:
        store.chat_template_file.write_text(chat_template, encoding="utf-8")


def append_lines(path: Any, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write("".join(line + "\n" for line in lines))
