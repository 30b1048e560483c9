"""The trainer's logprobs of constrained rollouts, on its own code path, to compare with SGLang's.

Resumes the checkpoint like recompute_logprobs.py, tokenizes each trajectory with the trainer's
`ChatTokenizer` (the Choices carry `token_ids`, `art_constraint` and SGLang's logprobs) and scores its
sampled tokens twice: under their constraints (`sampled_constraints`, as train() does) and without. Per
kind of rollout (the JSON's keys), the differences of both from SGLang's reported logprobs. Runs in its own
process (Unsloth must be imported before transformers):

    python tests/gpu/recompute_constrained.py CHECKPOINTS_DIR ROLLOUTS.json   -> JSON on stdout

ROLLOUTS.json: {"<kind>": [<wire trajectory>, ...], ...}
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from art_sglang.config import TrainerConfig
from art_sglang.storage.checkpoints import list_checkpoints, read_trainer_state
from art_sglang.training import model_loading  # noqa: F401  (first: Unsloth patches transformers)
from art_sglang.training.loss import sampled_token_logprobs
from art_sglang.training.tokenize import TokenizeStats, sampled_constraints
from art_sglang.training.trainer import Trainer


def _stats(diffs: list[float]) -> dict[str, float]:
    absolute = [abs(d) for d in diffs]
    return {
        "tokens": len(diffs),
        "mean_abs": sum(absolute) / len(absolute),
        "max_abs": max(absolute),
        "mean_signed": sum(diffs) / len(diffs),
    }


def main() -> None:
    import torch

    checkpoints, rollouts_file = Path(sys.argv[1]), Path(sys.argv[2])
    step = max(list_checkpoints(checkpoints))
    state = read_trainer_state(checkpoints / f"{step:04d}")
    trainer = Trainer(state["base_model"], checkpoints, TrainerConfig(**state["config"]))
    assert trainer.resume_or_init() == step
    trainer.model.eval()
    report: dict[str, object] = {"step": step, "trainer_backend": trainer.loaded.backend}
    for kind, trajectories in json.loads(rollouts_file.read_text()).items():
        constrained: list[float] = []
        unconstrained: list[float] = []
        stats = TokenizeStats()
        for index, trajectory in enumerate(trajectories):
            for sequence in trainer.chat.tokenize_trajectory(trajectory, group=0, index=index, stats=stats):
                ids = torch.tensor([sequence.input_ids], device=trainer.device)
                mask = torch.tensor([sequence.sampled_mask], device=trainer.device)
                old = [
                    lp
                    for lp, m in zip(sequence.old_logprobs[1:], sequence.sampled_mask[1:], strict=True)
                    if m
                ]
                with torch.no_grad():
                    logits = trainer.model(input_ids=ids).logits
                    under = sampled_token_logprobs(
                        logits, ids, mask, sampled_constraints([sequence])
                    ).tolist()
                    plain = sampled_token_logprobs(logits, ids, mask).tolist()
                for o, c, p in zip(old, under, plain, strict=True):
                    if not math.isnan(o):
                        constrained.append(c - o)
                        unconstrained.append(p - o)
        report[kind] = {
            "constrained_choices": stats.constrained,
            "trainer_constrained_vs_sglang": _stats(constrained),
            "trainer_unconstrained_vs_sglang": _stats(unconstrained),
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
