"""The in-worker `Trainer` on the tiny model, in this process: micro-batching gives the same step as one
batch (ART's mean over the packed row), rows as optimizer steps, the KL-shifted advantages, groups
without signal, context-only trajectories, over-long sequences, and offload on CPU."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from training_helpers import make_choice, trajectory

from art_sglang.config import TrainerConfig
from art_sglang.errors import TrainerError
from art_sglang.tiny_model import build_tiny_model
from art_sglang.training.options import TrainOptions
from art_sglang.training.packing import plan_micro_batches
from art_sglang.training.ranks import Ranks
from art_sglang.training.tokenize import TokenizedSequence
from art_sglang.training.trainer import Trainer
from art_sglang.training.validation import groups_to_wire
from art_sglang.trajectories import Trajectory, TrajectoryGroup

ANSWERS = [("1 2 3 4 5 6 7 8", 1.0), ("a", 0.0), ("9 x", 0.5), ("the cat sat on the mat", 0.0)]


def batch(tokenizer: Any) -> list[dict[str, Any]]:
    # Different lengths and token counts per trajectory, so a mean of micro-batch means would differ.
    groups = [
        TrajectoryGroup(
            [trajectory(f"prompt {g}", make_choice(tokenizer, a, [-7.5] * 20), r) for a, r in ANSWERS]
        )
        for g in range(2)
    ]
    return groups_to_wire(groups)


def lora_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_plan_micro_batches_respects_budget() -> None:
    seqs = [TokenizedSequence([0] * n, [0] * n, [0.0] * n, 0, i) for i, n in enumerate([5, 30, 12, 12, 8])]
    plan = plan_micro_batches(seqs, 24)
    assert [[len(s.input_ids) for s in b] for b in plan] == [[30], [12, 12], [8, 5]]


@pytest.mark.parametrize("world", [2, 3])
def test_the_ranks_split_a_row_so_the_slowest_rank_forwards_the_least(world: int) -> None:
    """The GPU bench's row (24 sequences of ~1k tokens, a budget of 8 per micro-batch): each rank gets its
    equal share and micro-batches it, 2 ranks 8+4 each (4 micro-batches in all where one rank runs 3).
    Dealing out the one-rank plan's micro-batches instead keeps the count at 3 but gives one rank 8+8:
    the step waits for the slowest rank, so fewer micro-batches in all would be slower."""
    row = [TokenizedSequence([1] * 1020, [0] + [1] * 1019, [0.0] * 1020, 0, i) for i in range(24)]
    shares = [Ranks(rank, world).share(row, lambda s: len(s.input_ids)) for rank in range(world)]
    plans = [[len(b) for b in plan_micro_batches(share, 8192)] for share in shares]
    assert sorted(s.trajectory for share in shares for s in share) == list(range(24))
    assert plans == {2: [[8, 4], [8, 4]], 3: [[8], [8], [8]]}[world]
    # No split does better for the slowest rank: it needs ceil(24 / world / 8) micro-batches at least, and
    # holds at least 24 / world sequences.
    assert (
        max(len(p) for p in plans) == math.ceil(24 / world / 8) and max(sum(p) for p in plans) == 24 // world
    )


def test_micro_batches_accumulate_to_the_full_batch_step(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any
) -> None:
    options = TrainOptions(learning_rate=1e-3, kl_penalty_coef=0.1)
    results = []
    for budget in (4096, 16):  # one micro-batch vs one sequence per micro-batch
        trainer = Trainer(
            str(tiny_model_path), tmp_path / str(budget), TrainerConfig(micro_batch_tokens=budget)
        )
        trainer.resume_or_init()
        outcome = trainer.train(batch(tokenizer), options, lambda _: None)
        results.append((outcome, lora_weights(trainer)))
    (one, w_one), (many, w_many) = results
    assert one.metrics["micro_batches"] == 1 and many.metrics["micro_batches"] == 8
    # The smallest micro-batch (a batch of one is a new compiled shape on a GPU); peft on CPU compiles nothing.
    assert (one.metrics["micro_batch_sequences_min"], many.metrics["micro_batch_sequences_min"]) == (8, 1)
    assert one.metrics["compiled_graphs"] == many.metrics["compiled_graphs"] == 0
    # Only the sampled answers and their end-of-turn tokens are trained (2 groups of the same answers).
    sampled = 2 * sum(len(tokenizer.encode(a, add_special_tokens=False)) + 1 for a, _ in ANSWERS)
    assert one.metrics["num_tokens"] == sampled
    for key in ("loss", "kl", "grad_norm", "clip_fraction", "ratio_mean", "num_tokens"):
        assert many.metrics[key] == pytest.approx(one.metrics[key], rel=1e-5, abs=1e-7), key
    # Adam divides by the gradient's own scale, so float noise in near-zero gradients shows up to ~1e-4 of
    # the learning rate; a wrong reduction (a mean of micro-batch means) moves weights by ~the learning rate.
    for name, value in w_one.items():
        torch.testing.assert_close(w_many[name], value, rtol=1e-5, atol=1e-6)


def test_kl_is_zero_for_the_fresh_adapter_and_grows(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any
) -> None:
    trainer = Trainer(str(tiny_model_path), tmp_path, TrainerConfig())
    trainer.resume_or_init()
    options = TrainOptions(learning_rate=5e-2, kl_penalty_coef=1.0)
    first = trainer.train(batch(tokenizer), options, lambda _: None)
    # Step 0's adapter has B = 0: the policy equals the base model, so the mean KL (new − ref) is 0.
    assert first.metrics["kl"] == pytest.approx(0.0, abs=1e-9)
    second = trainer.train(batch(tokenizer), options, lambda _: None)
    assert abs(second.metrics["kl"]) > 1e-6
    # The same step against step 1's adapter as the reference: not the base model's KL.
    against_one = trainer.train(
        batch(tokenizer), options.model_copy(update={"kl_penalty_reference_step": 1}), lambda _: None
    )
    assert against_one.metrics["kl"] != pytest.approx(second.metrics["kl"])
    # Without the penalty, no reference pass and no KL is reported.
    last = trainer.train(batch(tokenizer), TrainOptions(learning_rate=5e-2), lambda _: None)
    assert last.metrics["kl"] == 0.0 and last.step == 4


def test_rows_are_optimizer_steps(tiny_model_path: Path, tmp_path: Path, tokenizer: Any) -> None:
    trainer = Trainer(str(tiny_model_path), tmp_path, TrainerConfig())
    trainer.resume_or_init()
    outcome = trainer.train(batch(tokenizer), TrainOptions(packed_sequence_length=64), lambda _: None)
    trainer.settle()  # the optimizer state follows the step's answer
    state = torch.load(outcome.checkpoint_path / "optimizer.pt")["state"]
    steps = {float(s["step"]) for s in state.values()}
    assert outcome.metrics["gradient_steps"] > 1 and steps == {outcome.metrics["gradient_steps"]}
    assert outcome.step == 1


def test_the_checkpoint_phase_is_told_in_its_parts(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any
) -> None:
    """Rank 0's checkpoint phase split into waiting for the previous checkpoint's background work, the host
    copies, the adapter's file, the other published files and their rename (the GPU benchmarks read which
    part holds the step)."""
    trainer = Trainer(str(tiny_model_path), tmp_path, TrainerConfig())
    trainer.resume_or_init()
    metrics = trainer.train(batch(tokenizer), TrainOptions(), lambda _: None).metrics
    trainer.close()
    names = ("wait", "copy", "adapter", "other_files", "rename")
    parts = [metrics[f"time/checkpoint_{part}_s"] for part in names]
    assert min(parts) >= 0 and 0 < sum(parts) <= metrics["time/trainer_checkpoint_s"]


def test_groups_without_signal_advance_the_step(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any
) -> None:
    trainer = Trainer(str(tiny_model_path), tmp_path, TrainerConfig())
    trainer.resume_or_init()
    before = lora_weights(trainer)
    flat = groups_to_wire([TrajectoryGroup([trajectory("p", make_choice(tokenizer, "1"), 0.5)] * 3)] * 2)
    outcome = trainer.train(flat, TrainOptions(), lambda _: None)
    # As ART: no optimizer step, but a new step whose checkpoint equals the last one.
    assert not outcome.trained and outcome.step == 1 and outcome.checkpoint_path is not None
    assert "in each of the 2 groups every rollout got the same reward" in (outcome.reason or "")
    assert outcome.metrics["groups_skipped"] == 2 and outcome.metrics["gradient_steps"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000", "0001"]
    assert (tmp_path / "0001" / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "0000" / "adapter_model.safetensors"
    ).read_bytes()
    for name, value in before.items():
        assert torch.equal(lora_weights(trainer)[name], value)
    # One group with signal among flat ones: trained, the flat group counted as skipped.
    mixed = [*flat, *batch(tokenizer)[:1]]
    outcome = trainer.train(mixed, TrainOptions(), lambda _: None)
    assert outcome.trained and outcome.step == 2 and outcome.metrics["groups_skipped"] == 2
    trainer.offload()  # CPU: a no-op that still works
    trainer.reload()


def test_context_only_trajectories_and_over_long_sequences(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any
) -> None:
    trainer = Trainer(str(tiny_model_path), tmp_path, TrainerConfig(max_seq_length=64))
    trainer.resume_or_init()
    context = Trajectory(messages_and_choices=[{"role": "user", "content": "no answer"}], reward=0.0)
    long = trajectory("word " * 80, make_choice(tokenizer, "1"), 1.0)
    groups = [
        TrajectoryGroup([trajectory("p", make_choice(tokenizer, "1 2"), 1.0), context]),
        TrajectoryGroup([long, trajectory("q", make_choice(tokenizer, "a"), 0.0)]),
    ]
    outcome = trainer.train(groups_to_wire(groups), TrainOptions(), lambda _: None)
    # The context-only trajectory counts in its group's mean; the over-long one is dropped, not an error.
    assert outcome.trained and outcome.metrics["sequences_dropped_too_long"] == 1
    assert outcome.metrics["num_trajectories"] == 2


def test_a_checkpoint_of_another_base_model_is_refused_by_name(tiny_model_path: Path, tmp_path: Path) -> None:
    """Reusing a model directory with a base model of other shapes names both models, not torch's
    tensor-by-tensor size list."""
    Trainer(str(tiny_model_path), tmp_path / "checkpoints", TrainerConfig()).resume_or_init()
    wider = build_tiny_model(tmp_path / "wider", hidden=96)
    other = Trainer(str(wider), tmp_path / "checkpoints", TrainerConfig())
    with pytest.raises(TrainerError, match=r"does not fit base model .*wider.*it was trained on .*tiny"):
        other.resume_or_init()


def test_an_unreadable_optimizer_state_resumes_the_adapter_with_a_fresh_optimizer(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any
) -> None:
    """The adapter is what a checkpoint is for: a corrupt optimizer.pt costs the optimizer's moments, not
    the step (the checkpoint is not set aside)."""
    trainer = Trainer(str(tiny_model_path), tmp_path, TrainerConfig())
    trainer.resume_or_init()
    trainer.train(batch(tokenizer), TrainOptions(learning_rate=5e-2), lambda _: None)
    trainer.settle()
    optimizer = tmp_path / "0001" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:200])  # truncated
    resumed = Trainer(str(tiny_model_path), tmp_path, TrainerConfig())
    assert resumed.resume_or_init() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000", "0001"]
    for name, value in lora_weights(trainer).items():
        assert torch.equal(lora_weights(resumed)[name], value)
    assert not resumed.optimizer.state
    assert [n for n in resumed.notes if "optimizer.pt" in n and "fresh optimizer" in n], resumed.notes
    outcome = resumed.train(batch(tokenizer), TrainOptions(learning_rate=5e-2), lambda _: None)
    assert outcome.trained and outcome.step == 2


def test_the_step_answers_before_its_optimizer_state_is_written_and_an_incomplete_step_keeps_its_adapter(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer waits for the adapter (what the server loads), not for optimizer.pt, which a thread writes
    meanwhile; a step whose optimizer.pt never arrived (the trainer stopped first) was served under its name,
    so resume keeps it, its adapter with a fresh optimizer, and says so."""
    trainer = Trainer(str(tiny_model_path), tmp_path, TrainerConfig())
    trainer.resume_or_init()
    trainer.settle()
    release = threading.Event()
    save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f: (release.wait(30), save(obj, f)))
    outcome = trainer.train(batch(tokenizer), TrainOptions(learning_rate=5e-2), lambda _: None)
    folder = outcome.checkpoint_path
    assert (folder / "adapter_model.safetensors").is_file() and not (folder / "optimizer.pt").exists()
    release.set()
    trainer.settle()
    assert torch.load(folder / "optimizer.pt")["state"]
    assert [p.name for p in folder.iterdir() if ".tmp-" in p.name] == []

    (folder / "optimizer.pt").unlink()  # as a crash before the rename leaves it
    resumed = Trainer(str(tiny_model_path), tmp_path, TrainerConfig())
    assert resumed.resume_or_init() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000", "0001"]
    assert not resumed.optimizer.state
    assert [n for n in resumed.notes if "optimizer.pt: missing" in n and "fresh optimizer" in n], (
        resumed.notes
    )
    trained = dict(trainer.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        if param.requires_grad:
            assert torch.equal(param.detach().cpu(), trained[name].detach().cpu()), name


def test_a_learning_rate_too_large_is_named_when_the_step_overflows(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any
) -> None:
    trainer = Trainer(str(tiny_model_path), tmp_path / "ckpt", TrainerConfig())
    trainer.resume_or_init()
    options = TrainOptions(learning_rate=1e6)
    with pytest.raises(
        TrainerError, match=r"gradient norm is not finite .*\(learning rate 1000000\.0: a rate too large"
    ):
        for _ in range(3):  # the first step leaves huge but finite weights; the next one overflows
            trainer.train(batch(tokenizer), options, lambda _: None)
