"""Merge a LoRA adapter into its base model's weights and save a full model directory
(`weight_sync_method="disk"`). Run as `python -m art_sglang.orchestration.merge BASE ADAPTER OUT` in a subprocess on
CPU, so the user's process never imports torch and the GPUs stay with the server and the trainer.

The model is written to `OUT.tmp-<pid>` and renamed to OUT, so a crash never leaves a half model that
the server could be pointed at.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from pathlib import Path

from ..errors import TrainerError


def merge(base_model: str, adapter: Path, out: Path) -> None:
    """Load `base_model` on CPU in its own dtype, apply `adapter`, merge, save to `out` (atomically)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_model, dtype="auto")
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(base_model).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


async def merge_in_subprocess(base_model: str, adapter: Path, out: Path, log_path: Path) -> None:
    """Run `merge` in a CPU-only subprocess; `TrainerError` with the log tail if it fails."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    with log_path.open("ab") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "art_sglang.orchestration.merge", base_model, str(adapter), str(out),
            stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env=env,
        )  # fmt: skip
        try:
            code = await proc.wait()
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise TrainerError(
            f"merging {adapter} into {base_model} failed (exit {code}); log {log_path}:\n{tail}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_model")
    parser.add_argument("adapter", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    merge(args.base_model, args.adapter, args.out)


if __name__ == "__main__":
    main()
