"""Data parallelism over training ranks, with the real launcher (torch.distributed.run) and gloo on CPU: a
2-rank step gives the 1-rank step's adapter, and a dead rank ends the trainer with an error and leaves no
process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from safetensors.torch import load_file
from training_helpers import make_choice, trajectory

from art_sglang.config import TrainerConfig
from art_sglang.errors import TrainerError
from art_sglang.training.options import TrainOptions
from art_sglang.training.process import TrainerProcess
from art_sglang.training.sft import sft_batches
from art_sglang.trajectories import TrajectoryGroup

OPTIONS = TrainOptions(learning_rate=5e-2, kl_penalty_coef=0.1, precalculate_logprobs=True)


def batch(tokenizer: Any) -> list[TrajectoryGroup]:
    """Two groups of answers of different lengths: 6 sequences with a learning signal, for 2 ranks."""
    answers = [("1 2 3 4 5 6", 1.0), ("a b", 0.0), ("x y z", 0.25), ("q", 0.75)]
    return [
        TrajectoryGroup([trajectory(f"task {g}", make_choice(tokenizer, a), r) for a, r in answers])
        for g in range(2)
    ]


def trainer(model: Path, folder: Path, cpu_ranks: int) -> TrainerProcess:
    return TrainerProcess(
        str(model),
        folder / "checkpoints",
        TrainerConfig(),
        gpu_ids=None,
        log_path=folder / "trainer.log",
        cpu_ranks=cpu_ranks,
    )


def adapter(path: Path | None) -> dict[str, torch.Tensor]:
    assert path is not None
    return load_file(path / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def two_ranks(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainerProcess]:
    """One 2-rank trainer for the module's tests, in file order (the last one kills a rank)."""
    proc = trainer(tiny_model_path, tmp_path_factory.mktemp("two"), 2)
    try:
        asyncio.run(proc.start())
        yield proc
    finally:
        asyncio.run(proc.stop())


def assert_same_adapter(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Equal within float32 noise. Two ranks add the batch's gradients in another order; Adam divides each
    update by the root of its squared gradient, so where a gradient is near zero that noise becomes an
    update difference of a few 1e-6 (5.4e-6 seen with transformers 5.24), while a rank's data missing from
    the all-reduce changes updates by about the learning rate (1e-2 and more here)."""
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5)


async def test_two_ranks_train_the_one_rank_adapter(
    two_ranks: TrainerProcess, tiny_model_path: Path, tmp_path: Path, tokenizer: Any
) -> None:
    one, two = trainer(tiny_model_path, tmp_path / "one", 1), two_ranks
    # The launcher keeps its folder (a subfolder per start) beside the trainer's log, not in /tmp.
    assert len(list((two.log_path.parent / "torchelastic").iterdir())) == 1
    sft = sft_batches(
        [t.model_dump(mode="json") for g in batch(tokenizer) for t in g.trajectories], 1e-2, batch_size=4
    )
    try:
        await one.start()
        assert (one.info["ranks"], two.info["ranks"]) == (1, 2)
        assert len(set(two.info["pids"])) == 2
        expected = await one.train(batch(tokenizer), OPTIONS)
        got = await two.train(batch(tokenizer), OPTIONS)
        assert got.step == expected.step == 1
        # Each rank forwarded its share; the metrics count the whole batch.
        for key in ("num_tokens", "num_tokens_forwarded", "num_sequences", "gradient_steps"):
            assert got.metrics[key] == expected.metrics[key], key
        # A rank pads its micro-batches to their own longest sequence: never more than one rank does.
        assert got.metrics["num_tokens_forwarded"] <= got.metrics["num_tokens_padded"]
        assert got.metrics["num_tokens_padded"] <= expected.metrics["num_tokens_padded"]
        for key in ("loss", "kl", "grad_norm", "ratio_mean"):
            assert got.metrics[key] == pytest.approx(expected.metrics[key], rel=1e-4, abs=1e-7), key
        # Where rank 0's phases sit among the ranks': every rank tokenizes and forwards its share.
        for phase in ("tokenize", "forward_backward"):
            spread = [
                got.metrics[f"time/trainer_{phase}{rank}_s"]
                for rank in ("_slowest_rank", "", "_fastest_rank")
            ]
            assert spread == sorted(spread, reverse=True) and spread[-1] > 0, phase
        # The rows' all-reduces: the fastest rank's is the transfer, the others' add their wait.
        slowest, fastest = (
            got.metrics[f"time/trainer_all_reduce_{e}_rank_s"] for e in ("slowest", "fastest")
        )
        assert slowest >= fastest > 0
        a, b = adapter(expected.checkpoint_path), adapter(got.checkpoint_path)
        assert_same_adapter(b, a)
        initial = adapter(tmp_path / "one/checkpoints/0000")
        # The step changed the adapter: equal results are not equal non-results.
        assert max(float((a[name] - initial[name]).abs().max()) for name in a) > 1e-3
        # SFT shares its batches too.
        sft_expected, sft_got = await one.sft(sft), await two.sft(sft)
        assert sft_got.metrics["loss/train"] == pytest.approx(sft_expected.metrics["loss/train"], rel=1e-4)
        a, b = adapter(sft_expected.checkpoint_path), adapter(sft_got.checkpoint_path)
        assert_same_adapter(b, a)
        # Only rank 0 writes: one checkpoint per step, as with one rank.
        assert sorted(p.name for p in two.checkpoint_dir.iterdir()) == ["0000", "0001", "0002"]
    finally:
        await one.stop()


def curve_batch(tokenizer: Any, step: int) -> list[TrajectoryGroup]:
    """Step `step`'s batch: two groups of five answers of 1 to 9 words, rewards shuffled per step."""
    answers = ["1 2 3 4 5 6 7 8 9", "a b", "x y z", "q", "m n o p"]
    rewards = [((i * 2 + step) % 5) / 4 for i in range(len(answers))]
    return [
        TrajectoryGroup(
            [
                trajectory(f"task {g}.{step}", make_choice(tokenizer, a), r)
                for a, r in zip(answers, rewards, strict=True)
            ]
        )
        for g in range(2)
    ]


async def test_three_ranks_follow_the_one_rank_loss_curve(
    tiny_model_path: Path, tmp_path: Path, tokenizer: Any
) -> None:
    """ART's loss normalisation across ranks: each token's loss is divided by its whole row's sampled
    tokens, not by its rank's share, and the ranks' gradients are summed (on CPU a rerun repeats a curve
    exactly; what varies is the order of float sums, as with other micro-batch splits on one rank). Rows of 1-3 sequences of
    different lengths over 3 ranks give shares of unequal token counts (some rank with none), where a
    per-rank mean or averaged gradients would give another curve from the first step on."""
    # At 1e-2 rounding stays rounding over the curve; at 5e-2 a later step's near-zero gradients, which
    # Adam scales up to the learning rate, carry the summation order's noise into the loss (10 % seen, as
    # between one rank's runs with other micro-batch splits).
    options = OPTIONS.model_copy(update={"packed_sequence_length": 40, "learning_rate": 1e-2})
    one, three = (
        trainer(tiny_model_path, tmp_path / "one", 1),
        trainer(tiny_model_path, tmp_path / "three", 3),
    )
    curves: dict[int, list[dict[str, float]]] = {}
    try:
        await asyncio.gather(one.start(), three.start())
        assert three.info["ranks"] == 3
        for proc in (one, three):
            curves[proc.ranks] = [
                (await proc.train(curve_batch(tokenizer, step), options)).metrics for step in range(4)
            ]
    finally:
        await asyncio.gather(one.stop(), three.stop())
    expected, got = curves[1], curves[3]
    assert all(m["gradient_steps"] >= 2 for m in expected)  # several rows, so several shares, per step
    for key in ("num_tokens", "num_tokens_forwarded", "gradient_steps"):
        assert [m[key] for m in got] == [m[key] for m in expected], key
    for ours, theirs in zip(got, expected, strict=True):
        assert ours["num_tokens_forwarded"] <= ours["num_tokens_padded"] <= theirs["num_tokens_padded"]
    for key in ("loss", "kl", "grad_norm"):
        assert [m[key] for m in got] == pytest.approx([m[key] for m in expected], rel=1e-4, abs=1e-7), key
    assert_same_adapter(adapter(three.checkpoint_dir / "0004"), adapter(one.checkpoint_dir / "0004"))
    # A curve that moved: later steps train on weights the earlier ones changed.
    assert max(m["kl"] for m in expected) > 1e-4


async def test_rank_zero_alone_broadcasts_the_merged_weights_and_its_errors_end_no_rank(
    two_ranks: TrainerProcess, tiny_model_path: Path
) -> None:
    """Merged weights over a weight-update group from a 2-rank trainer (split mode with several training
    GPUs): rank 0 broadcasts each bucket to this process (the group's rank 1, as a server is); a push over a
    group it is not in fails alone, and the ranks go on."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from art_sglang import named_tensors, weight_group
    from art_sglang.training.merged_weights import merged_weights

    async def never(bucket: dict[str, Any], last: bool, step: int) -> bool:
        raise AssertionError("no bucket is sent over a group the trainer is not in")

    with pytest.raises(TrainerError, match="weight-update group 'nowhere'"):
        await two_ranks.push_merged(never, max_bytes=1 << 16, load_format=None, group_name="nowhere")
    assert two_ranks.is_alive()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _, group = await asyncio.gather(
        two_ranks.join_update_group("127.0.0.1", port, 2, "merged", "gloo", 60.0),
        asyncio.to_thread(weight_group.join, "127.0.0.1", port, 1, 2, "merged", backend="gloo"),
    )
    received: list[tuple[str, torch.Tensor]] = []

    async def receive(bucket: dict[str, Any], last: bool, step: int) -> bool:
        empty = [
            (name, torch.empty(shape, dtype=getattr(torch, dtype)))
            for name, dtype, shape in zip(bucket["names"], bucket["dtypes"], bucket["shapes"], strict=True)
        ]
        flat = named_tensors.flatten(empty)
        await asyncio.to_thread(weight_group.broadcast, group, flat["flattened_tensor"])
        received.extend(named_tensors.unflatten(flat))
        return True

    try:
        step, sent = await two_ranks.push_merged(
            receive, max_bytes=1 << 16, load_format=None, group_name="merged"
        )
    finally:
        weight_group.leave(group)
    assert sent >= 2 and step == two_ranks.step
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(two_ranks.checkpoint_dir / f"{step:04d}"))
    expected = list(merged_weights(peft_model))
    assert [name for name, _ in received] == [name for name, _ in expected]
    for (name, got), (_, want) in zip(received, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


async def test_a_dead_rank_ends_the_trainer_and_leaves_no_process(
    two_ranks: TrainerProcess, tokenizer: Any
) -> None:
    proc = two_ranks
    assert proc.pid is not None
    tree = [psutil.Process(proc.pid), *(psutil.Process(pid) for pid in proc.info["pids"])]
    os.kill(proc.info["pids"][1], signal.SIGKILL)
    with pytest.raises(
        TrainerError, match=r"(?s)trainer worker of 2 ranks .*trainer\.log.*rank *: 1 .*SIGKILL"
    ):
        await proc.train(batch(tokenizer), OPTIONS)
    # The launcher ended rank 0 and itself; nothing is left to stop.
    _, alive = psutil.wait_procs(tree, timeout=60)
    assert alive == []


def test_a_backend_under_torchrun_gives_the_trainer_no_rank_of_its_own(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "LOCAL_RANK": "3"}.items():
        monkeypatch.setenv(name, value)
    env = trainer(tiny_model_path, tmp_path, 1).environment()
    assert not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK"} & env.keys()
    assert trainer(tiny_model_path, tmp_path, 2).command()[1:6] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        f"--log-dir={tmp_path / 'torchelastic'}",
    ]
