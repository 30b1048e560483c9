"""The training state inside the worker: model with LoRA, AdamW, step counter, and one `train()` call =
validate → tokenize → advantages and weights → rows (one optimizer step each, as ART 0.5.18) of
micro-batched forward/backward → checkpoint. A call is applied, saved and counted together or not at all:
on a non-finite loss, gradient norm or weight, or a checkpoint that cannot be written, the weights,
optimizer state, RNG and step are restored to what they were before the call (`TrainingError`)."""

from __future__ import annotations

import base64
import contextlib
import copy
import errno
import logging
import math
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import TrainerConfig
from ..errors import TrainerError, TrainingError, TrainingInputError
from . import checkpoints as ckpt
from .advantages import balance, batch_scale, group_advantages, trajectory_weight
from .loss import ROW_MEAN_EPS, TokenInputs, sampled_token_logprobs, token_loss
from .model_loading import LoadedModel, load_model
from .options import StepOutcome, TrainOptions
from .packing import plan_micro_batches, plan_rows, row_length
from .sft import SFTBatch, run_sft
from .tokenize import ChatTokenizer, TokenizedSequence, tokenize_groups
from .validation import WireGroup, validate_groups

Progress = Callable[[dict[str, Any]], None]
logger = logging.getLogger(__name__)


@dataclass
class _Sums:
    loss: float = 0.0  # sum over rows of the row's loss
    kl: float = 0.0  # sum over rows of the row's mean KL
    grad_norm: float = 0.0  # sum over rows
    ratio: float = 0.0  # sum over tokens
    clipped: float = 0.0  # count over tokens
    tokens: int = 0
    tokens_forwarded: int = 0
    micro_batches: int = 0


@dataclass
class _Snapshot:
    step: int
    params: list[torch.Tensor]
    optimizer: dict[str, Any]
    rng: torch.Tensor


class Trainer:
    """Loads the base model once and trains it call after call (one step number per `train()`)."""

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
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # The learning rate is set per row; AdamW's moments persist across calls and checkpoints.
        self.optimizer = torch.optim.AdamW(self.params, **self._hyperparameters(5e-6))
        self.step = 0
        self.resumed = False
        self._reference_adapters: dict[str, dict[str, torch.Tensor]] = {}
        self.notes: list[str] = []  # what resume did differently (set aside, fresh optimizer), for the log
        self.last_mode: str | None = None  # "rl" or "sft": switching clears AdamW's moments, as ART does

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    def _hyperparameters(self, learning_rate: float) -> dict[str, Any]:
        return {
            "lr": learning_rate,
            "betas": (self.config.adam_beta1, self.config.adam_beta2),
            "eps": self.config.adam_epsilon,
            "weight_decay": self.config.weight_decay,
        }

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
        self._save({})
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

    def _save(self, metrics: dict[str, float]) -> Path:
        """save_checkpoint, with a write failure turned into a TrainingError that says what went wrong
        (torch reports a full disk as 'enforce fail at inline_container.cc')."""
        try:
            return self.save_checkpoint(metrics)
        except Exception as exc:
            raise TrainingError(
                f"checkpoint {self.step} could not be written to {self.checkpoint_dir}: "
                f"{_write_failure(exc, self.checkpoint_dir)}"
            ) from exc

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
        return StepOutcome(self.step, metrics, self._save(metrics), trained=True)

    def train(self, groups: list[WireGroup], options: TrainOptions, progress: Progress) -> StepOutcome:
        started = time.perf_counter()
        self.enter_mode("rl")
        validate_groups(groups, allow_training_without_logprobs=options.allow_training_without_logprobs)
        reference = self._reference_path(options)
        tokenized, stats = tokenize_groups(self.chat, groups, max_seq_length=self.config.max_seq_length)
        self._check_token_ids(tokenized)
        rewards = [[float(t["reward"]) for t in g["trajectories"]] for g in groups]
        advantages = group_advantages(rewards, scale_rewards=options.scales_rewards)
        flat_rewards = [r for g in rewards for r in g]
        mean = math.fsum(flat_rewards) / len(flat_rewards)
        metrics: dict[str, float] = {
            **stats.metrics(),
            "reward": mean,
            "reward_std": math.sqrt(math.fsum((r - mean) ** 2 for r in flat_rewards) / len(flat_rewards)),
            "num_groups": float(len(groups)),
            "groups_skipped": float(advantages.groups_skipped),
            "learning_rate": options.learning_rate,
        }
        per_group = _weighted_sequences(tokenized, advantages.per_group)
        selected = [s for g in per_group for s in g]
        length = row_length(
            selected or [TokenizedSequence([0], [0], [0.0], 0, 0)],
            packed=options.packed_sequence_length,
            max_seq_length=self.config.max_seq_length,
        )
        too_long = [s for s in selected if len(s.input_ids) > length]
        if too_long:
            logger.warning(
                "dropping %d sequences longer than the row length %d (longest %d tokens)",
                len(too_long), length, max(len(s.input_ids) for s in too_long),
            )  # fmt: skip
            per_group = [[s for s in g if len(s.input_ids) <= length] for g in per_group]
            selected = [s for g in per_group for s in g]
        metrics["sequences_dropped_too_long"] = float(len(too_long))
        metrics["num_trajectories"] = float(len({(s.group, s.trajectory) for s in selected}))
        scale = None
        if selected:
            items = [(s.num_sampled, s.advantage, s.weight) for s in selected]
            scale = batch_scale(items, advantage_balance=options.advantage_balance)
        if scale is None or scale.advantage_scale is None:
            return self._advance_untrained(
                groups, advantages.groups_trained, bool(too_long), metrics, started
            )
        for s in selected:
            s.weight *= scale.weight_scale
            s.advantage = balance(s.advantage, options.advantage_balance) * scale.advantage_scale
        snapshot = self._snapshot()
        try:
            rows = plan_rows(per_group, length)
            metrics.update(self._optimize(rows, selected, options, reference, progress))
            self.step += 1
            metrics["seconds"] = time.perf_counter() - started
            path = self._save(metrics)
        except BaseException:
            self._restore(snapshot)
            raise
        return StepOutcome(self.step, metrics, path, trained=True)

    def _advance_untrained(
        self,
        groups: list[WireGroup],
        trained_groups: int,
        dropped: bool,
        metrics: dict[str, float],
        started: float,
    ) -> StepOutcome:
        """As ART: no optimizer step, but the step advances with a copy of the current checkpoint."""
        if trained_groups == 0:
            reason = f"all {len(groups)} groups have equal rewards (no learning signal)"
        elif dropped:
            reason = "every sequence with a non-zero advantage is longer than the row length"
        else:
            reason = "no trajectory with a non-zero advantage has sampled tokens"
        metrics["gradient_steps"] = 0.0
        self.step += 1
        metrics["seconds"] = time.perf_counter() - started
        try:
            path = self._save(metrics)
        except BaseException:
            self.step -= 1
            raise
        return StepOutcome(self.step, metrics, path, trained=False, reason=f"no optimizer step: {reason}")

    def _check_token_ids(self, tokenized: list[list[list[TokenizedSequence]]]) -> None:
        for group in tokenized:
            for sequences in group:
                for s in sequences:
                    bad = next((i for i in s.input_ids if not 0 <= i < self.vocab_size), None)
                    if bad is not None:
                        raise TrainingInputError(
                            f"group {s.group}, trajectory {s.trajectory}: token id {bad} is outside the "
                            f"model's vocabulary (0..{self.vocab_size - 1}); were these token_ids sampled "
                            "from another model?"
                        )

    def _reference_path(self, options: TrainOptions) -> Path | None:
        """The KL reference adapter's folder, None for the base model."""
        if options.kl_ref_adapter_path is not None:
            path = Path(options.kl_ref_adapter_path)
        elif options.kl_penalty_reference_step is not None:
            path = ckpt.checkpoint_path(self.checkpoint_dir, options.kl_penalty_reference_step)
        else:
            return None
        if not (path / ckpt.ADAPTER_WEIGHTS).is_file():
            raise TrainingInputError(
                f"the KL reference adapter {path} has no {ckpt.ADAPTER_WEIGHTS}: name a saved checkpoint step "
                "(kl_penalty_reference_step) or an adapter folder (kl_ref_adapter_path)"
            )
        return path

    # --- the optimizer steps -------------------------------------------------------------------------
    def _optimize(
        self,
        rows: list[list[TokenizedSequence]],
        selected: list[TokenizedSequence],
        options: TrainOptions,
        reference: Path | None,
        progress: Progress,
    ) -> dict[str, float]:
        started = time.perf_counter()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        self.model.train()
        if options.precalculate_logprobs:
            self._precalculate(selected)
        max_norm = options.max_grad_norm or self.config.max_grad_norm or math.inf
        sums = _Sums()
        total = sum(len(plan_micro_batches(row, self.config.micro_batch_tokens)) for row in rows)
        for row_index, row in enumerate(rows):
            batches = plan_micro_batches(row, self.config.micro_batch_tokens)
            row_tokens = sum(s.num_sampled for s in row)
            kl = self._row_kl(batches, reference) if options.kl_penalty_coef > 0 else None
            row_kl = float(sum(k.sum() for k in kl)) / (row_tokens + ROW_MEAN_EPS) if kl else 0.0
            self.optimizer.zero_grad(set_to_none=True)
            row_loss = 0.0
            for index, batch in enumerate(batches):
                row_loss += self._micro_batch(
                    batch, row_tokens, options, kl[index] if kl else None, row_kl, sums
                )
                sums.micro_batches += 1
                progress({"phase": "train", "micro_batch": sums.micro_batches, "micro_batches": total})
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
            where = f"row {row_index + 1} of {len(rows)}"
            if not math.isfinite(row_loss):
                raise TrainingError(
                    f"the loss is not finite ({row_loss}) in {where}; the step was not applied"
                )
            if not math.isfinite(grad_norm):
                raise TrainingError(
                    f"the gradient norm is not finite ({grad_norm}) in {where}; the step was not applied"
                )
            multiplier = len(row) ** options.num_trajectories_learning_rate_multiplier_power
            for group in self.optimizer.param_groups:
                group.update(self._hyperparameters(options.learning_rate * multiplier))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if not all(bool(torch.isfinite(p).all()) for p in self.params):
                raise TrainingError(
                    f"the updated weights are not finite after {where} (learning rate "
                    f"{options.learning_rate * multiplier}); the step was not applied"
                )
            sums.loss += row_loss
            sums.kl += row_kl
            sums.grad_norm += grad_norm
        seconds = time.perf_counter() - started
        memory = {"gpu_peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30} if cuda else {}
        return {
            **memory,
            "loss": sums.loss / len(rows),
            "kl": sums.kl / len(rows),
            "grad_norm": sums.grad_norm / len(rows),
            "clip_fraction": sums.clipped / sums.tokens,
            "ratio_mean": sums.ratio / sums.tokens,
            "num_tokens": float(sums.tokens),
            "num_sequences": float(len(selected)),
            "gradient_steps": float(len(rows)),
            "row_length": float(max(len(s.input_ids) for row in rows for s in row)),
            "micro_batches": float(sums.micro_batches),
            "tokens_per_second": sums.tokens_forwarded / seconds if seconds > 0 else 0.0,
        }

    def _micro_batch(
        self,
        batch: list[TokenizedSequence],
        row_tokens: int,
        options: TrainOptions,
        kl: torch.Tensor | None,
        row_kl: float,
        sums: _Sums,
    ) -> float:
        """Forward and backward one micro-batch; returns its share of the row's loss."""
        tensors = self._tensors(batch)
        mask = tensors["mask"]
        sampled = mask[:, 1:].bool()

        def flat(values: list[list[float]], fill: float) -> torch.Tensor:
            return self._padded(values, fill, torch.float32, tensors["width"])[:, 1:][sampled]

        new = self._logprobs(tensors)
        inputs = TokenInputs(
            new=new,
            old=flat([s.old_logprobs for s in batch], math.nan),
            advantages=flat([[s.advantage] * len(s.input_ids) for s in batch], 0.0),
            weights=flat([[s.weight] * len(s.input_ids) for s in batch], 0.0),
            sequence=torch.arange(len(batch), device=self.device)[:, None].expand_as(sampled)[sampled],
            kl=kl,
            row_kl=row_kl,
            original=(
                flat([s.sampler_logprobs or [] for s in batch], math.nan)
                if options.precalculate_logprobs
                else None
            ),
        )
        terms = token_loss(inputs, options)
        share = terms.loss.sum() / (row_tokens + ROW_MEAN_EPS)
        share.backward()
        sums.ratio += float(terms.ratio.sum())
        sums.clipped += float(terms.clipped.sum())
        sums.tokens += int(new.numel())
        sums.tokens_forwarded += sum(len(s.input_ids) for s in batch)
        return float(share.detach())

    def _tensors(self, batch: list[TokenizedSequence]) -> dict[str, Any]:
        width = max(len(s.input_ids) for s in batch)
        pad = self.loaded.tokenizer.pad_token_id
        return {
            "width": width,
            "input_ids": self._padded(
                [s.input_ids for s in batch], pad if pad is not None else 0, torch.long, width
            ),
            "attention": self._padded([[1] * len(s.input_ids) for s in batch], 0, torch.long, width),
            "mask": self._padded([s.sampled_mask for s in batch], 0, torch.long, width),
        }

    def _padded(self, rows: list[list[Any]], fill: Any, dtype: torch.dtype, width: int) -> torch.Tensor:
        return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=dtype, device=self.device)

    def _logprobs(self, tensors: dict[str, Any]) -> torch.Tensor:
        logits = self.model(
            input_ids=tensors["input_ids"], attention_mask=tensors["attention"], use_cache=False
        ).logits
        return sampled_token_logprobs(logits, tensors["input_ids"], tensors["mask"])

    @torch.no_grad()
    def _row_kl(self, batches: list[list[TokenizedSequence]], reference: Path | None) -> list[torch.Tensor]:
        """Per micro-batch, new − reference logprob of each sampled token (before the row's update)."""
        out = []
        for batch in batches:
            tensors = self._tensors(batch)
            new = self._logprobs(tensors)
            with self._reference(reference):
                out.append(new - self._logprobs(tensors))
        return out

    @contextlib.contextmanager
    def _reference(self, path: Path | None) -> Iterator[None]:
        """The KL reference in place of the policy: the base model (adapter disabled) or another adapter's
        weights swapped in (and the policy's swapped back)."""
        if path is None:
            with self.model.disable_adapter():
                yield
            return
        from peft import get_peft_model_state_dict, set_peft_model_state_dict
        from safetensors.torch import load_file

        key = str(path.resolve())
        if key not in self._reference_adapters:
            self._reference_adapters[key] = load_file(
                str(path / ckpt.ADAPTER_WEIGHTS), device=str(self.device)
            )
        policy = {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model).items()}
        set_peft_model_state_dict(self.model, self._reference_adapters[key])
        try:
            yield
        finally:
            set_peft_model_state_dict(self.model, policy)

    @torch.no_grad()
    def _precalculate(self, sequences: list[TokenizedSequence]) -> None:
        """precalculate_logprobs: the policy's own logprobs before the step become the old logprobs; the
        sampler's are kept for truncated importance sampling."""
        for batch in plan_micro_batches(sequences, self.config.micro_batch_tokens):
            values = iter(self._logprobs(self._tensors(batch)).tolist())
            for s in batch:
                s.sampler_logprobs = list(s.old_logprobs)
                s.old_logprobs = [
                    next(values) if m and t > 0 else math.nan for t, m in enumerate(s.sampled_mask)
                ]

    # --- all or nothing ------------------------------------------------------------------------------
    def _snapshot(self) -> _Snapshot:
        return _Snapshot(
            step=self.step,
            params=[p.detach().clone() for p in self.params],
            optimizer=copy.deepcopy(self.optimizer.state_dict()),
            rng=torch.get_rng_state(),
        )

    def _restore(self, snapshot: _Snapshot) -> None:
        """Back to the state before the call: weights, optimizer moments, RNG, step; no gradients left."""
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for param, saved in zip(self.params, snapshot.params, strict=True):
                param.copy_(saved)
        self.optimizer.load_state_dict(snapshot.optimizer)
        torch.set_rng_state(snapshot.rng)
        self.step = snapshot.step
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # --- shared mode ---------------------------------------------------------------------------------
    def offload(self, keep_weights: bool = False) -> dict[str, float]:
        """Give the GPU back to the server after a step: the allocator's cached blocks (the step's
        activations) always; with `keep_weights=False` the model and optimizer state move to host memory
        too. Returns the device's free bytes afterwards (0 on CPU, where this is a no-op)."""
        if self.device.type != "cuda":
            return {"free_bytes": 0.0}
        if not keep_weights:
            self._move(torch.device("cpu"))
        torch.cuda.empty_cache()
        return {"free_bytes": float(torch.cuda.mem_get_info(self.device)[0])}

    def reload(self, min_free_bytes: float = 0.0, timeout_s: float = 10.0) -> dict[str, float]:
        """Take the GPU for a step: wait until `min_free_bytes` are free on the device — the server's
        release can show in the driver after its HTTP answer, and allocating before would OOM — then move
        back whatever `offload` moved. Returns the free bytes seen and the seconds waited."""
        if self.device.type != "cuda":
            return {"free_bytes": 0.0, "waited_s": 0.0}
        started = time.perf_counter()
        free = torch.cuda.mem_get_info(self.device)[0]
        while free < min_free_bytes and time.perf_counter() - started < timeout_s:
            time.sleep(0.005)
            free = torch.cuda.mem_get_info(self.device)[0]
        waited = time.perf_counter() - started
        if free < min_free_bytes:
            print(
                f"reload: {free / 2**30:.1f} GiB free after {waited:.1f} s, expected "
                f"{min_free_bytes / 2**30:.1f} GiB; going on",
                file=sys.stderr,
            )
        if next(self.model.parameters()).device.type != "cuda":
            self._move(self.device)
        return {"free_bytes": float(free), "waited_s": waited}

    def _move(self, device: torch.device) -> None:
        self.model.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.to(device)


def _weighted_sequences(
    tokenized: list[list[list[TokenizedSequence]]], advantages: list[list[float] | None]
) -> list[list[TokenizedSequence]]:
    """Per group, the sequences to train with their trajectory's advantage and weight: trajectories of
    skipped groups, with a zero advantage, or without sampled tokens (context only) are left out."""
    out: list[list[TokenizedSequence]] = []
    for per_trajectory, group_advantages_ in zip(tokenized, advantages, strict=True):
        kept: list[TokenizedSequence] = []
        for sequences, advantage in zip(per_trajectory, group_advantages_ or [], strict=False):
            trained = [s for s in sequences if s.num_sampled > 0]
            if advantage == 0.0 or not trained:
                continue
            weight = trajectory_weight(sum(s.num_sampled for s in trained))
            for s in trained:
                s.advantage, s.weight = advantage, weight
            kept += trained
        out.append(kept)
    return out


def _write_failure(exc: BaseException, folder: Path) -> str:
    """A plain reason for a failed checkpoint write."""
    text = f"{type(exc).__name__}: {exc}"
    code = exc.errno if isinstance(exc, OSError) else None
    torch_write = isinstance(exc, RuntimeError) and ("inline_container" in text or "write failed" in text)
    if code in (errno.ENOSPC, errno.EDQUOT) or torch_write:
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            free = None
        if code in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < 64 * 2**20):
            where = f" ({free / 2**20:.1f} MiB free)" if free is not None else ""
            return f"no space left on the device{where}: free some space and train again ({text.splitlines()[0]})"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"the folder is not writable: fix its permissions and train again ({text})"
    if code == errno.EFBIG:
        return f"a file exceeds the allowed file size (ulimit -f): raise the limit and train again ({text})"
    return text.splitlines()[0]


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
