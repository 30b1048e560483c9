"""The training state inside the worker: model with LoRA, AdamW, step counter, and one `train()` call =
validate → tokenize → advantages → micro-batched forward/backward → one optimizer step → checkpoint."""

from __future__ import annotations

import base64
import copy
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import TrainerConfig
from ..errors import TrainerError
from . import checkpoints as ckpt
from .advantages import group_advantages
from .loss import batch_loss_sum, grpo_token_loss, sampled_token_logprobs
from .model_loading import LoadedModel, load_model
from .options import StepOutcome, TrainOptions
from .sft import SFTBatch, run_sft
from .tokenize import ChatTokenizer, TokenizedSequence, tokenize_groups
from .validation import WireGroup, validate_groups

Progress = Callable[[dict[str, Any]], None]


def plan_micro_batches(
    sequences: list[TokenizedSequence], token_budget: int
) -> list[list[TokenizedSequence]]:
    """Group sequences (longest first) so that rows × padded length stays within the token budget; a
    sequence longer than the budget gets a micro-batch of its own."""
    batches: list[list[TokenizedSequence]] = []
    for seq in sorted(sequences, key=lambda s: len(s.input_ids), reverse=True):
        # Longest first: the first sequence of a batch fixes its padded length.
        if batches and (len(batches[-1]) + 1) * len(batches[-1][0].input_ids) <= token_budget:
            batches[-1].append(seq)
        else:
            batches.append([seq])
    return batches


@dataclass
class _Sums:
    policy: float = 0.0
    kl: float = 0.0
    ratio: float = 0.0
    clipped: float = 0.0
    tokens_forwarded: int = 0


class Trainer:
    """Loads the base model once and trains it step after step (one optimizer step per `train()`)."""

    def __init__(self, base_model: str, checkpoint_dir: Path, config: TrainerConfig) -> None:
        self.base_model = base_model
        self.checkpoint_dir = Path(checkpoint_dir)
        self.config = config
        self.loaded: LoadedModel = load_model(base_model, config)
        self.model = self.loaded.model
        if config.chat_template is not None:
            self.loaded.tokenizer.chat_template = config.chat_template
        self.chat = ChatTokenizer.for_model(
            self.loaded.tokenizer, base_model, template_kwargs=config.chat_template_kwargs
        )
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # The learning rate is set per train() call; AdamW's moments persist across calls.
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=5e-6,
            weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_epsilon,
        )
        self.step = 0
        self.resumed = False
        self.notes: list[
            str
        ] = []  # what resume had to do differently (set aside, fresh optimizer), for the log
        self.last_mode: str | None = None  # "rl" or "sft": switching clears AdamW's moments, as ART does

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    # --- checkpoints ---------------------------------------------------------------------------------
    def resume_or_init(self) -> int:
        """Resume the newest checkpoint (adapter, and optimizer + rng when it has them), or write step 0 =
        the fresh adapter (LoRA B = 0, so it equals the base model). Returns the step.

        A newest folder that cannot be read (a truncated file, a folder without an adapter) is set aside
        under a `.broken-` name and the one before it is resumed; a checkpoint with the adapter only (as
        ART writes them) is resumed with a fresh optimizer. Both are noted in `self.notes`."""
        ckpt.remove_stale_temp_dirs(self.checkpoint_dir)
        for folder in ckpt.step_folders(self.checkpoint_dir):
            try:
                state = read_checkpoint(folder, self.device)
            except CheckpointUnreadable as exc:
                aside = ckpt.set_aside(folder)
                self._note(f"checkpoint {folder.name} cannot be resumed ({exc}); set aside as {aside.name}")
                continue
            self._apply_checkpoint(folder, state)
            self.step = int(folder.name)
            self.resumed = True
            return self.step
        self.step = 0
        self.save_checkpoint({})
        return 0

    def _note(self, text: str) -> None:
        print(f"resume: {text}", file=sys.stderr)
        self.notes.append(text)

    def save_checkpoint(self, metrics: dict[str, float]) -> Path:
        def write(tmp: Path) -> None:
            save_adapter(self.model, tmp, self.base_model)
            torch.save(self.optimizer.state_dict(), tmp / ckpt.OPTIMIZER)
            ckpt.write_json(
                tmp / ckpt.TRAINER_STATE,
                {
                    "step": self.step,
                    "base_model": self.base_model,
                    "backend": self.loaded.backend,
                    "config": self.config.model_dump(mode="json"),
                    "metrics": metrics,
                    "rng": _rng_state(),
                },
            )

        return ckpt.write_checkpoint(self.checkpoint_dir, self.step, write)

    def _apply_checkpoint(self, path: Path, state: CheckpointState) -> None:
        from peft import set_peft_model_state_dict

        self._check_lora_shape(path, state.adapter_config)
        result = set_peft_model_state_dict(self.model, state.weights)
        if result.unexpected_keys:
            raise TrainerError(
                f"checkpoint {path} has weights this model lacks: {result.unexpected_keys[:5]}"
            )
        if state.optimizer is None:
            self._note(
                f"checkpoint {path.name} has no {ckpt.OPTIMIZER} (ART writes none): the optimizer starts fresh"
            )
        else:
            self.optimizer.load_state_dict(state.optimizer)
        _set_rng_state((state.trainer_state or {}).get("rng") or {})

    def _check_lora_shape(self, path: Path, adapter_config: dict[str, Any]) -> None:
        """A checkpoint of another LoRA shape cannot continue this run's adapter: say which setting differs."""
        ours = {"r": self.config.lora_rank, "lora_alpha": self.config.lora_alpha}
        theirs = {key: adapter_config.get(key) for key in ours}
        if theirs != ours:
            raise TrainerError(
                f"checkpoint {path} is a LoRA with {theirs}, but this trainer is configured with {ours}: set "
                "TrainerConfig(lora_rank=..., lora_alpha=...) or _internal_config peft_args r/lora_alpha "
                "to the checkpoint's values"
            )

    # --- training ------------------------------------------------------------------------------------
    def enter_mode(self, mode: str) -> None:
        """As ART: switching between RL and SFT clears AdamW's moments; SFT runs without weight decay."""
        if self.last_mode is not None and self.last_mode != mode:
            self.optimizer.state.clear()
        self.last_mode = mode
        for group in self.optimizer.param_groups:
            group["weight_decay"] = 0.0 if mode == "sft" else self.config.weight_decay

    def train_sft(self, batches: list[SFTBatch], progress: Progress) -> StepOutcome:
        """One SFT call (training/sft.py): an optimizer step per batch, then one new checkpoint."""
        self.enter_mode("sft")
        try:
            metrics = run_sft(self, batches, progress)
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        self.step += 1
        return StepOutcome(self.step, metrics, self.save_checkpoint(metrics), trained=True)

    def train(self, groups: list[WireGroup], options: TrainOptions, progress: Progress) -> StepOutcome:
        started = time.perf_counter()
        self.enter_mode("rl")
        validate_groups(groups, allow_training_without_logprobs=options.allow_training_without_logprobs)
        tokenized, stats = tokenize_groups(self.chat, groups, max_seq_length=self.config.max_seq_length)
        rewards = [[float(t["reward"]) for t in g["trajectories"]] for g in groups]
        advantages = group_advantages(rewards, scale_rewards=options.scale_rewards)
        flat_rewards = [r for g in rewards for r in g]
        mean = sum(flat_rewards) / len(flat_rewards)
        metrics: dict[str, float] = {
            **stats.metrics(),
            "reward": mean,
            "reward_std": math.sqrt(sum((r - mean) ** 2 for r in flat_rewards) / len(flat_rewards)),
            "num_groups": float(len(groups)),
            "groups_skipped": float(advantages.groups_skipped),
            "learning_rate": options.learning_rate,
        }
        sequences: list[TokenizedSequence] = []
        trajectories = 0
        for per_trajectory, group_adv in zip(tokenized, advantages.per_group, strict=True):
            if group_adv is None:
                continue
            for seqs, advantage in zip(per_trajectory, group_adv, strict=True):
                kept = [s for s in seqs if s.num_sampled > 0]
                if advantage == 0.0 or not kept:
                    continue  # no gradient from the policy term; not worth a forward pass
                trajectories += 1
                for seq in kept:
                    seq.advantage = advantage
                sequences += kept
        metrics["num_trajectories"] = float(trajectories)
        if not sequences:
            reason = (
                f"nothing to train on: all {len(groups)} groups have equal rewards (no learning signal)"
                if advantages.groups_trained == 0
                else "nothing to train on: no trajectory with a non-zero advantage has sampled tokens"
            )
            metrics["seconds"] = time.perf_counter() - started
            return StepOutcome(self.step, metrics, None, trained=False, reason=reason)
        try:
            metrics.update(self._optimize(sequences, options, progress))
        except BaseException:
            # e.g. CUDA out of memory: drop the partial gradients so the next call starts clean.
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise
        self.step += 1
        metrics["seconds"] = time.perf_counter() - started
        path = self.save_checkpoint(metrics) if options.save_checkpoint else None
        return StepOutcome(self.step, metrics, path, trained=True)

    def _optimize(
        self, sequences: list[TokenizedSequence], options: TrainOptions, progress: Progress
    ) -> dict[str, float]:
        started = time.perf_counter()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_sampled = sum(s.num_sampled for s in sequences)
        batches = plan_micro_batches(sequences, self.config.micro_batch_tokens)
        sums = _Sums()
        for index, batch in enumerate(batches):
            self._micro_batch(batch, total_sampled, options, sums)
            progress({"phase": "train", "micro_batch": index + 1, "micro_batches": len(batches)})
        max_norm = options.max_grad_norm or self.config.max_grad_norm or math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        for group in self.optimizer.param_groups:
            group["lr"] = options.learning_rate
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - started
        policy = sums.policy / total_sampled
        kl = sums.kl / total_sampled
        memory = {"gpu_peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30} if cuda else {}
        return {
            **memory,
            "loss": policy + options.kl_penalty_coef * kl,
            "policy_loss": policy,
            "kl": kl,
            "grad_norm": grad_norm,
            "clip_fraction": sums.clipped / total_sampled,
            "ratio_mean": sums.ratio / total_sampled,
            "num_tokens": float(total_sampled),
            "num_sequences": float(len(sequences)),
            "micro_batches": float(len(batches)),
            "tokens_per_second": sums.tokens_forwarded / seconds if seconds > 0 else 0.0,
        }

    def _micro_batch(
        self, batch: list[TokenizedSequence], total_sampled: int, options: TrainOptions, sums: _Sums
    ) -> None:
        width = max(len(s.input_ids) for s in batch)
        pad = self.loaded.tokenizer.pad_token_id
        pad = pad if pad is not None else 0

        def padded(rows: list[list[Any]], fill: Any, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(
                [r + [fill] * (width - len(r)) for r in rows], dtype=dtype, device=self.device
            )

        input_ids = padded([s.input_ids for s in batch], pad, torch.long)
        attention = padded([[1] * len(s.input_ids) for s in batch], 0, torch.long)
        mask = padded([s.sampled_mask for s in batch], 0, torch.long)
        old = padded([s.old_logprobs for s in batch], float("nan"), torch.float32)[:, 1:][mask[:, 1:].bool()]
        adv = padded([[s.advantage] * len(s.input_ids) for s in batch], 0.0, torch.float32)
        adv = adv[:, 1:][mask[:, 1:].bool()]
        ref = None
        if options.kl_penalty_coef > 0:
            with torch.no_grad(), self.model.disable_adapter():
                logits = self.model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
                ref = sampled_token_logprobs(logits, input_ids, mask)
            del logits
        logits = self.model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
        new = sampled_token_logprobs(logits, input_ids, mask)
        terms = grpo_token_loss(
            new, old, adv, ref, epsilon=options.epsilon, epsilon_high=options.epsilon_high or options.epsilon
        )
        (batch_loss_sum(terms, options.kl_penalty_coef) / total_sampled).backward()
        sums.policy += float(terms.policy.detach().sum())
        sums.kl += float(terms.kl.detach().sum()) if terms.kl is not None else 0.0
        sums.ratio += float(terms.ratio.sum())
        sums.clipped += float(terms.clipped.sum())
        sums.tokens_forwarded += sum(len(s.input_ids) for s in batch)

    # --- shared mode ---------------------------------------------------------------------------------
    def offload(self) -> None:
        """Move model and optimizer state to CPU and return the GPU memory (no-op on a CPU trainer)."""
        if self.device.type == "cuda":
            self._move(torch.device("cpu"))
            torch.cuda.empty_cache()

    def reload(self) -> None:
        if self.device.type == "cuda":
            self._move(self.device)

    def _move(self, device: torch.device) -> None:
        self.model.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.to(device)


class CheckpointUnreadable(Exception):
    """A checkpoint file is missing, truncated or corrupt; the message names the file."""


@dataclass
class CheckpointState:
    """A checkpoint read into memory, every file checked before anything is applied to the model."""

    adapter_config: dict[str, Any]
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None  # None: the folder has none (ART's layout)
    trainer_state: dict[str, Any] | None


def read_checkpoint(path: Path, device: torch.device) -> CheckpointState:
    """Read a checkpoint folder; CheckpointUnreadable names the first file that cannot be used."""
    import json

    from safetensors.torch import load_file

    def unreadable(name: str, exc: BaseException | str) -> CheckpointUnreadable:
        return CheckpointUnreadable(f"{path / name}: {exc}")

    try:
        adapter_config = json.loads((path / ckpt.ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise unreadable(ckpt.ADAPTER_CONFIG, exc) from None
    try:
        weights = load_file(str(path / ckpt.ADAPTER_WEIGHTS), device=str(device))
    except Exception as exc:  # safetensors raises its own error types for a truncated file
        raise unreadable(ckpt.ADAPTER_WEIGHTS, exc) from None
    optimizer = None
    if (path / ckpt.OPTIMIZER).exists():
        try:
            optimizer = torch.load(path / ckpt.OPTIMIZER, map_location=device)
        except Exception as exc:  # torch.load raises pickle, zip and runtime errors alike
            raise unreadable(ckpt.OPTIMIZER, exc) from None
    trainer_state = None
    if (path / ckpt.TRAINER_STATE).exists():
        try:
            trainer_state = ckpt.read_trainer_state(path)
        except (OSError, ValueError) as exc:
            raise unreadable(ckpt.TRAINER_STATE, exc) from None
    elif optimizer is not None:
        raise unreadable(ckpt.TRAINER_STATE, "missing next to the optimizer state")
    return CheckpointState(adapter_config, weights, optimizer, trainer_state)


def save_adapter(model: Any, folder: Path, base_model: str) -> None:
    """Write the adapter in PEFT format with only LoRA A/B weights (what SGLang's loader accepts)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = get_peft_model_state_dict(model)
    lora = {
        k: v.detach().to("cpu").contiguous() for k, v in state.items() if ".lora_A." in k or ".lora_B." in k
    }
    save_file(lora, str(folder / ckpt.ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = copy.deepcopy(model.peft_config["default"])
    config.base_model_name_or_path = base_model
    config.inference_mode = True
    config.save_pretrained(str(folder))


def _rng_state() -> dict[str, Any]:
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()
        ]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    if "torch" in state:
        torch.set_rng_state(tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([tensor(s) for s in state["cuda"]])
