"""The training state inside the worker: model with LoRA, AdamW, step counter, and one `train()` call =
validate → tokenize → advantages and weights → rows (one optimizer step each, as ART 0.5.18) of
micro-batched forward/backward → checkpoint. A call is applied, saved and counted together or not at all:
on a non-finite loss, gradient norm or weight, or a checkpoint that cannot be written, the weights,
optimizer state, RNG and step are restored to what they were before the call (`TrainingError`).

The optimizer steps themselves are row_optimizer.py's; a checkpoint's files are checkpoint_io.py's. With
several data-parallel ranks (ranks.py) every rank holds this state and runs every call; rank 0 alone
touches the checkpoint folder, and the others follow its decisions (which checkpoint to resume, whether
the write succeeded)."""

from __future__ import annotations

import logging
import math
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import TrainerConfig
from ..errors import TrainerError, TrainingError, TrainingInputError
from ..storage import checkpoints as ckpt
from .advantages import balance, batch_scale, group_advantages, weighted_sequences
from .checkpoint_io import (
    CheckpointState,
    CheckpointUnreadable,
    adapter_of,
    read_checkpoint,
    rng_state,
    set_rng_state,
    write_failure,
)
from .checkpoint_writer import CheckpointWriter
from .model_loading import LoadedModel, load_model
from .options import StepOutcome, TrainOptions
from .packing import plan_rows, row_length
from .phase_times import PhaseTimes
from .ranks import Ranks
from .row_optimizer import Progress, RowOptimizer
from .sft import SFTBatch, run_sft
from .tokenize import ChatTokenizer, TokenizedSequence, tokenize_groups
from .train_state import TrainState, adamw_settings, clones, copy_optimizer_state
from .validation import WireGroup

logger = logging.getLogger(__name__)


@dataclass
class _Snapshot:
    step: int
    params: list[torch.Tensor]
    optimizer: dict[str, Any]
    rng: torch.Tensor


class Trainer:
    """Loads the base model once and trains it call after call (one step number per `train()`)."""

    def __init__(
        self, base_model: str, checkpoint_dir: Path, config: TrainerConfig, ranks: Ranks | None = None
    ) -> None:
        self.base_model = base_model
        self.checkpoint_dir = Path(checkpoint_dir)
        self.config = config
        self.ranks = ranks or Ranks()
        self.loaded: LoadedModel = load_model(base_model, config)
        self.model = self.loaded.model
        if config.chat_template is not None:
            self.loaded.tokenizer.chat_template = config.chat_template
        self.chat = ChatTokenizer.for_model(
            self.loaded.tokenizer, base_model, template_kwargs=config.chat_template_kwargs
        )
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # The learning rate is set per row; AdamW's moments persist across calls and checkpoints. Fused on a
        # GPU: one kernel per step where the default launches one per parameter group chunk and operation
        # (~14 ms of the host's time a row at 1.5B, while the GPU waits).
        self.optimizer = torch.optim.AdamW(
            self.params, **adamw_settings(config, 5e-6), fused=self.device.type == "cuda"
        )
        self.step = 0
        self.resumed = False
        pad = self.loaded.tokenizer.pad_token_id
        self.state = TrainState(
            self.model, self.params, self.optimizer, self.ranks, config, self.device, pad or 0
        )
        self._rows = RowOptimizer(self.state)
        self._writer = CheckpointWriter()  # rank 0's
        self.notes: list[str] = []  # what resume did differently (set aside, fresh optimizer), for the log
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
        ART writes them) or with an optimizer state that cannot be read is resumed with a fresh optimizer.
        Each is noted in `self.notes`.

        Rank 0 chooses (and writes step 0); the other ranks load the checkpoint it resumed, and take its
        weights in either case (the LoRA initialisation is seeded, but equal weights on every rank is what
        the summed gradients rely on)."""
        if self.ranks.is_main:
            self._resume_or_init()
        self.step, self.resumed = self.ranks.from_main((self.step, self.resumed))
        if self.resumed and not self.ranks.is_main:
            folder = ckpt.checkpoint_path(self.checkpoint_dir, self.step)
            self._apply_checkpoint(folder, read_checkpoint(folder, self.device))
        self.ranks.copy_from_main(self.params)
        return self.step

    def _resume_or_init(self) -> int:
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
        _, failure = self._write({})
        if failure is None:
            failure = self._settled()  # start-up answers with a complete step 0
        if failure is not None:
            raise TrainingError(failure)
        return 0

    def _note(self, text: str) -> None:
        print(f"resume: {text}", file=sys.stderr)
        self.notes.append(text)

    def save_checkpoint(self, metrics: dict[str, float]) -> Path:
        """Publish this step's checkpoint; its optimizer state follows in the background
        (checkpoint_writer.py)."""
        trainer_state = {
            "step": self.step,
            "base_model": self.base_model,
            "backend": self.loaded.backend,
            "config": self.config.model_dump(mode="json"),
            "metrics": metrics,
            "rng": rng_state(),
        }
        adapter = adapter_of(self.model, self.base_model)
        state = self.optimizer.state_dict()
        return self._writer.write(self.checkpoint_dir, self.step, adapter, state, trainer_state)

    def settle(self) -> None:
        """Wait until the last checkpoint is complete (its optimizer state on disk); raises if it cannot be."""
        self._writer.settle()

    def close(self) -> None:
        self._writer.close()

    def _save(self, metrics: dict[str, float]) -> Path:
        """save_checkpoint on rank 0; a write failure is a TrainingError on every rank."""
        path, failure = self._write(metrics) if self.ranks.is_main else (None, None)
        failure = self.ranks.from_main(failure)
        if failure is not None:
            raise TrainingError(failure)
        return path or ckpt.checkpoint_path(self.checkpoint_dir, self.step)

    def _write(self, metrics: dict[str, float]) -> tuple[Path | None, str | None]:
        """save_checkpoint, or what went wrong in words (torch reports a full disk as 'enforce fail at
        inline_container.cc'), its traceback in the log."""
        failure = self._settled(before_write=True)
        if failure is not None:
            return None, f"{failure} (so step {self.step} was not saved either)"
        try:
            return self.save_checkpoint(metrics), None
        except Exception as exc:
            return None, self._write_failure(f"checkpoint {self.step}", exc)

    def _settled(self, *, before_write: bool = False) -> str | None:
        """Settle the last checkpoint (`before_write`: the next one's, its wait told as that one's part); what
        went wrong in words, if it could not be completed."""
        unsettled = self._writer.unsettled_step
        try:
            self._writer.settle(before_write=before_write)
        except Exception as exc:
            return self._write_failure(f"checkpoint {unsettled} (its fsyncs or optimizer state)", exc)
        return None

    def _write_failure(self, what: str, exc: Exception) -> str:
        """`what` could not be written, in words (its traceback in the log)."""
        traceback.print_exc()
        return (
            f"{what} could not be written to {self.checkpoint_dir}: {write_failure(exc, self.checkpoint_dir)}"
        )

    def _apply_checkpoint(self, path: Path, state: CheckpointState) -> None:
        from peft import set_peft_model_state_dict

        self._check_lora_shape(path, state.adapter_config)
        try:
            result = set_peft_model_state_dict(self.model, state.weights)
        except RuntimeError as exc:  # torch's "size mismatch for ..." list, one line per tensor
            trained_on = state.adapter_config.get("base_model_name_or_path")
            raise TrainerError(
                f"checkpoint {path} does not fit base model {self.base_model!r}: its tensors have other shapes "
                f"(it was trained on {trained_on!r}). A model directory belongs to one base model: use "
                f"another model name or path for this one. First difference: {str(exc).splitlines()[1:2]}"
            ) from None
        if result.unexpected_keys:
            raise TrainerError(
                f"checkpoint {path} has weights this model lacks: {result.unexpected_keys[:5]}"
            )
        if state.optimizer_problem is not None:
            self._note(
                f"{state.optimizer_problem}; the adapter of {path.name} resumes with a fresh optimizer"
            )
        elif state.optimizer is None:
            self._note(
                f"checkpoint {path.name} has no {ckpt.OPTIMIZER} (ART writes none): the optimizer starts fresh"
            )
        else:
            self.optimizer.load_state_dict(state.optimizer)
        set_rng_state((state.trainer_state or {}).get("rng") or {})

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
        self.ranks.align_rng()
        try:
            metrics = run_sft(self.state, self.chat, batches, progress)
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        self.step += 1
        return StepOutcome(self.step, metrics, self._save(metrics), trained=True)

    def train(self, groups: list[WireGroup], options: TrainOptions, progress: Progress) -> StepOutcome:
        started = time.perf_counter()
        times = PhaseTimes(self.device)
        self.enter_mode("rl")
        self.ranks.align_rng()
        reference = self._reference_path(options)
        with times.phase("tokenize"):
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
        per_group = weighted_sequences(tokenized, advantages.per_group)
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
        with times.phase("snapshot"):
            snapshot = self._snapshot()
        try:
            rows = plan_rows(per_group, length)
            metrics.update(self._rows.optimize(rows, selected, options, reference, progress, times))
            self.step += 1
            metrics["seconds"] = time.perf_counter() - started
            with times.phase("checkpoint"):
                path = self._save(metrics)
        except BaseException:
            self._restore(snapshot)
            raise
        # Rank 0's checkpoint in parts (not phases of their own: they are the checkpoint phase's).
        parts = {f"time/checkpoint_{part}_s": s for part, s in self._writer.seconds.items()}
        return StepOutcome(self.step, {**metrics, **times.metrics(), **parts}, path, trained=True)

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
            reason = (
                f"in each of the {len(groups)} groups every rollout got the same reward, so there is "
                "nothing to learn from (no learning signal)"
            )
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
    # --- all or nothing ------------------------------------------------------------------------------
    def _snapshot(self) -> _Snapshot:
        # Batched copies, not a deepcopy: its Python per tensor (~800 at 1.5B) was most of this phase's ~0.1 s.
        return _Snapshot(
            step=self.step,
            params=clones(self.params),
            optimizer=copy_optimizer_state(self.optimizer.state_dict(), clones),
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
        # Each rank frees its own GPU; the least free of them is what the server can count on.
        (free,) = self.ranks.reduce([torch.cuda.mem_get_info(self.device)[0]], "min")
        return {"free_bytes": free}

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
        (least_free,) = self.ranks.reduce([free], "min")
        (longest_wait,) = self.ranks.reduce([waited], "max")
        return {"free_bytes": least_free, "waited_s": longest_wait}

    def _move(self, device: torch.device) -> None:
        self.model.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.to(device)
