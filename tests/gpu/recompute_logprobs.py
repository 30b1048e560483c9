"""The trainer's own recomputation of sampled tokens' logprobs, to compare with the ones SGLang returned.

Runs the trainer's code path on one checkpoint: `Trainer` (Unsloth or peft, as the checkpoint was trained)
resumes it and `sampled_token_logprobs` gives its logprobs of exactly the token ids SGLang sampled (from
`/generate`, so no re-tokenization stands between the two). Also with the adapter disabled, which shows how
far the adapter moved the model, so agreement means SGLang applied it. Runs in its own process (Unsloth
must be imported before transformers; the GPU memory is returned on exit):

    python tests/gpu/recompute_logprobs.py CHECKPOINTS_DIR SAMPLES.json [unsloth|peft]   -> JSON on stdout

SAMPLES.json: [{"input_ids": prompt + sampled ids, "prompt_len": n, "sampler_logprobs": [...]}, ...]
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
from art_sglang.training.trainer import Trainer


def _stats(diffs: list[float]) -> dict[str, float]:
    absolute = [abs(d) for d in diffs]
    return {
        "mean_abs": sum(absolute) / len(absolute),
        "max_abs": max(absolute),
        "mean_signed": sum(diffs) / len(diffs),
        "ratio_mean": sum(math.exp(d) for d in diffs) / len(diffs),
    }


def main() -> None:
    import torch

    checkpoints, samples_file = Path(sys.argv[1]), Path(sys.argv[2])
    step = list_checkpoints(checkpoints)[-1]
    state = read_trainer_state(checkpoints / f"{step:04d}")
    config = TrainerConfig(**state["config"])
    if len(sys.argv) > 3:
        config = config.model_copy(update={"use_unsloth": sys.argv[3] == "unsloth"})
    trainer = Trainer(state["base_model"], checkpoints, config)
    assert trainer.resume_or_init() == step
    samples = json.loads(samples_file.read_text())
    model = trainer.model
    model.eval()
    with_adapter: list[float] = []
    without_adapter: list[float] = []
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor([sample["input_ids"]], device=trainer.device)
            mask = torch.zeros_like(ids)
            mask[0, sample["prompt_len"] :] = 1
            old = torch.tensor(sample["sampler_logprobs"], device=trainer.device)
            new = sampled_token_logprobs(model(input_ids=ids).logits, ids, mask)
            with model.disable_adapter():
                base = sampled_token_logprobs(model(input_ids=ids).logits, ids, mask)
            with_adapter += (new - old).tolist()
            without_adapter += (base - old).tolist()
    print(
        json.dumps(
            {
                "step": step,
                "trainer_backend": trainer.loaded.backend,
                "dtype": str(trainer.loaded.dtype),
                "sequences": len(samples),
                "tokens_compared": len(with_adapter),
                "trainer_vs_sglang": _stats(with_adapter),
                "trainer_without_adapter_vs_sglang": _stats(without_adapter),
            }
        )
    )


if __name__ == "__main__":
    main()
