"""The RL optimizer steps of one `train()` call over its planned rows (as ART 0.5.18: one AdamW step per
row): micro-batched forward/backward of the token loss, the KL penalty against a reference (the base
model or another adapter), and precalculated logprobs. A non-finite loss, gradient norm or weight raises
`TrainingError`; rolling the step back is the trainer's.

With several ranks (ranks.py) each rank forwards its share of every row's sequences; the losses are
already divided by the whole row's token count, so the ranks' summed gradients are the row's gradient, and
every decision (clipping, the finite checks, the step) is taken on summed values, the same on every rank."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import TrainingError
from ..storage import checkpoints as ckpt
from .loss import ROW_MEAN_EPS, TokenInputs, sampled_token_logprobs, token_loss
from .options import TrainOptions
from .packing import plan_micro_batches
from .phase_times import CompileWatch, PhaseTimes
from .tokenize import TokenizedSequence, sampled_constraints
from .train_state import TrainState, all_finite

Progress = Callable[[dict[str, Any]], None]

# The phases reported for the slowest and the fastest rank too. all_reduce's are the rows' collectives (not
# the end-of-call reduce that carries these numbers): the fastest rank's is about the transfer alone (the
# last rank to arrive waits for no one), the rest of another rank's is waiting for the slowest.
_SPREAD = ("forward_backward", "tokenize", "all_reduce")


@dataclass
class _Sums:
    loss: float = 0.0  # sum over rows of the row's loss
    kl: float = 0.0  # sum over rows of the row's mean KL
    grad_norm: float = 0.0  # sum over rows
    # Sums kept on the device until the step's end: reading them per micro-batch waited for its backward
    # before the next micro-batch could be queued.
    ratio: float | torch.Tensor = 0.0  # sum over tokens
    clipped: int | torch.Tensor = 0  # count over tokens
    tokens: int = 0
    tokens_forwarded: int = 0  # the sequences' own tokens
    tokens_padded: int = 0  # the micro-batch tensors' size (each padded to its longest sequence)
    micro_batches: int = 0


class RowOptimizer:
    """Runs the optimizer steps on the trainer's model and AdamW (`state`); keeps the KL reference
    adapters' weights (read once per folder)."""

    def __init__(self, state: TrainState) -> None:
        self._state = state
        self._reference_adapters: dict[str, dict[str, torch.Tensor]] = {}

    def optimize(
        self,
        rows: list[list[TokenizedSequence]],
        selected: list[TokenizedSequence],
        options: TrainOptions,
        reference: Path | None,
        progress: Progress,
        times: PhaseTimes,
    ) -> dict[str, float]:
        started = time.perf_counter()
        compiles = CompileWatch()
        cuda = self._state.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        self._state.model.train()
        ranks = self._state.ranks
        budget = self._state.config.micro_batch_tokens
        shares = [ranks.share(row, lambda s: len(s.input_ids)) for row in rows]
        if options.precalculate_logprobs:
            with times.phase("precalculate"):
                self._precalculate([s for share in shares for s in share])
        max_norm = options.max_grad_norm or self._state.config.max_grad_norm or math.inf
        sums = _Sums()
        planned = [plan_micro_batches(share, budget) for share in shares]  # this rank's
        total = sum(map(len, planned))
        # A rank without micro-batches counts as the whole batch (it compiles nothing).
        smallest = min((len(b) for batches in planned for b in batches), default=len(selected))
        for row_index, (row, batches) in enumerate(zip(rows, planned, strict=True)):
            row_tokens = sum(s.num_sampled for s in row)
            row_kl = 0.0
            kl = None
            if options.kl_penalty_coef > 0:
                with times.phase("kl"):
                    kl = self._row_kl(batches, reference)
                with times.phase("all_reduce"):
                    (kl_sum,) = ranks.reduce([float(sum(k.sum() for k in kl))])
                row_kl = kl_sum / (row_tokens + ROW_MEAN_EPS)
            self._state.optimizer.zero_grad(set_to_none=True)
            shares_of_loss: list[torch.Tensor] = []
            with times.phase("forward_backward"):
                for index, batch in enumerate(batches):
                    shares_of_loss.append(
                        self._micro_batch(
                            batch, row_tokens, options, kl[index] if kl is not None else None, row_kl, sums
                        )
                    )
                    sums.micro_batches += 1
                    progress({"phase": "train", "micro_batch": sums.micro_batches, "micro_batches": total})
                # One wait for the row's last backward (a rank with no share of the row has none).
                row_loss = (
                    float(torch.stack(shares_of_loss).sum(dtype=torch.float64)) if shares_of_loss else 0.0
                )
            with times.phase("all_reduce"):
                (row_loss,) = ranks.sum_gradients(self._state.params, [row_loss])
            with times.phase("optimizer"):
                grad_norm = self._step(row_index, len(rows), row_loss, max_norm, options, len(row))
            sums.loss += row_loss
            sums.kl += row_kl
            sums.grad_norm += grad_norm
        own = [times.seconds[name] for name in _SPREAD]
        with times.phase("all_reduce"):
            ratio, clipped, tokens, forwarded, padded, micro_batches = ranks.reduce(
                [
                    float(sums.ratio),
                    float(sums.clipped),
                    sums.tokens,
                    sums.tokens_forwarded,
                    sums.tokens_padded,
                    sums.micro_batches,
                ]
            )
            # The slowest and the fastest rank's forward/backward (the step waits for the slowest),
            # tokenize (every rank tokenizes the whole batch) and the rows' all-reduces, the fullest
            # rank's memory, the most any rank compiled and the smallest micro-batch, in one collective.
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
            own_graphs, own_compile_s = compiles.since()
            *extremes, peak, graphs, compile_s, least = ranks.reduce(
                [*own, *(-s for s in own), peak, own_graphs, own_compile_s, -smallest], "max"
            )
            slowest, fastest = extremes[: len(own)], [-s for s in extremes[len(own) :]]
        seconds = time.perf_counter() - started
        return {
            **({"gpu_peak_memory_gb": peak} if cuda else {}),
            "loss": sums.loss / len(rows),
            "kl": sums.kl / len(rows),
            "grad_norm": sums.grad_norm / len(rows),
            "clip_fraction": clipped / tokens,
            "ratio_mean": ratio / tokens,
            "num_tokens": tokens,
            "num_sequences": float(len(selected)),
            "gradient_steps": float(len(rows)),
            "row_length": float(max(len(s.input_ids) for row in rows for s in row)),
            "micro_batches": micro_batches,
            "num_tokens_forwarded": forwarded,
            "num_tokens_padded": padded,
            "micro_batch_sequences_min": -least,
            "compiled_graphs": graphs,
            "time/trainer_compile_slowest_rank_s": compile_s,
            "tokens_per_second": forwarded / seconds if seconds > 0 else 0.0,
            **{f"time/trainer_{name}_slowest_rank_s": s for name, s in zip(_SPREAD, slowest, strict=True)},
            **{f"time/trainer_{name}_fastest_rank_s": s for name, s in zip(_SPREAD, fastest, strict=True)},
        }

    def _step(
        self, row_index: int, rows: int, row_loss: float, max_norm: float, options: TrainOptions, size: int
    ) -> float:
        """Clip, check and apply one row's summed gradients; returns the gradient norm."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._state.params, max_norm))
        where = f"row {row_index + 1} of {rows}"
        learning_rate = options.learning_rate * size**options.num_trajectories_learning_rate_multiplier_power
        rate = f"learning rate {learning_rate}"
        if not math.isfinite(row_loss):
            raise TrainingError(
                f"the loss is not finite ({row_loss}) in {where} ({rate}); the step was not applied"
            )
        if not math.isfinite(grad_norm):
            raise TrainingError(
                f"the gradient norm is not finite ({grad_norm}) in {where} ({rate}: a rate too large for "
                "the model, in this step or an earlier one, overflows the weights and then the "
                "gradients); the step was not applied"
            )
        for group in self._state.optimizer.param_groups:
            group.update(self._state.hyperparameters(learning_rate))
        self._state.optimizer.step()
        self._state.optimizer.zero_grad(set_to_none=True)
        if not all_finite(self._state.params):
            raise TrainingError(
                f"the updated weights are not finite after {where} ({rate}); the step was not applied"
            )
        return grad_norm

    def _micro_batch(
        self,
        batch: list[TokenizedSequence],
        row_tokens: int,
        options: TrainOptions,
        kl: torch.Tensor | None,
        row_kl: float,
        sums: _Sums,
    ) -> torch.Tensor:
        """Forward and backward one micro-batch; returns its share of the row's loss (on the device)."""
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
            sequence=torch.arange(len(batch), device=self._state.device)[:, None].expand_as(sampled)[sampled],
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
        sums.ratio += terms.ratio.sum(dtype=torch.float64)
        sums.clipped += terms.clipped.sum()
        sums.tokens += int(new.numel())
        sums.tokens_forwarded += sum(len(s.input_ids) for s in batch)
        sums.tokens_padded += len(batch) * tensors["width"]
        return share.detach()

    def _tensors(self, batch: list[TokenizedSequence]) -> dict[str, Any]:
        width = max(len(s.input_ids) for s in batch)
        return {
            "width": width,
            "input_ids": self._padded(
                [s.input_ids for s in batch], self._state.pad_token_id, torch.long, width
            ),
            "attention": self._padded([[1] * len(s.input_ids) for s in batch], 0, torch.long, width),
            "mask": self._padded([s.sampled_mask for s in batch], 0, torch.long, width),
            "constraints": sampled_constraints(batch),
        }

    def _padded(self, rows: list[list[Any]], fill: Any, dtype: torch.dtype, width: int) -> torch.Tensor:
        return torch.tensor(
            [r + [fill] * (width - len(r)) for r in rows], dtype=dtype, device=self._state.device
        )

    def _logprobs(self, tensors: dict[str, Any]) -> torch.Tensor:
        logits = self._state.model(
            input_ids=tensors["input_ids"], attention_mask=tensors["attention"], use_cache=False
        ).logits
        return sampled_token_logprobs(logits, tensors["input_ids"], tensors["mask"], tensors["constraints"])

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
            with self._state.model.disable_adapter():
                yield
            return
        from peft import get_peft_model_state_dict, set_peft_model_state_dict
        from safetensors.torch import load_file

        key = str(path.resolve())
        if key not in self._reference_adapters:
            self._reference_adapters[key] = load_file(
                str(path / ckpt.ADAPTER_WEIGHTS), device=str(self._state.device)
            )
        policy = {k: v.detach().clone() for k, v in get_peft_model_state_dict(self._state.model).items()}
        set_peft_model_state_dict(self._state.model, self._reference_adapters[key])
        try:
            yield
        finally:
            set_peft_model_state_dict(self._state.model, policy)

    @torch.no_grad()
    def _precalculate(self, sequences: list[TokenizedSequence]) -> None:
        """precalculate_logprobs: the policy's own logprobs before the step become the old logprobs; the
        sampler's are kept for truncated importance sampling. Each rank needs them for its own share only."""
        for batch in plan_micro_batches(sequences, self._state.config.micro_batch_tokens):
            values = iter(self._logprobs(self._tensors(batch)).tolist())
            for s in batch:
                s.sampler_logprobs = list(s.old_logprobs)
                s.old_logprobs = [
                    next(values) if m and t > 0 else math.nan for t, m in enumerate(s.sampled_mask)
                ]
