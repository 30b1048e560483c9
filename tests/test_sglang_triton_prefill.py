"""The `triton-prefill-grid` plugin entry without SGLang: the segment bound against the worst batch, and both
hooks run the way the server runs them (the plugin folder on its path) on stand-ins of SGLang 0.5.17's
triton-backend buffers, with the captured grid's coverage replayed in Python. The check against SGLang's own
classes and Triton kernels needs its venv: /work/notes/tools/triton_prefill_grid_check_39f.py."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from art_sglang.config import SGLangConfig
from art_sglang.serving.servers.process import ServerProcess
from art_sglang.serving.servers.sglang_site.art_sglang_triton_prefill import (
    max_prefill_segments,
    row_segments,
)


def most_segments(tokens: int, max_requests: int) -> int:
    """The most 16-row segments any batch of exactly `tokens` tokens in at most `max_requests` requests makes."""

    @functools.cache
    def best(left: int, requests: int) -> int:
        if left == 0:
            return 0
        if requests == 0:
            return -(10**9)  # tokens left over with no request to hold them: not a batch
        return max(best(left - k, requests - 1) + -(-k // 16) for k in range(1, left + 1))

    return best(tokens, max_requests)


@pytest.mark.parametrize("max_requests", [1, 2, 3, 5, 32])
def test_no_batch_has_more_segments_than_the_bound(max_requests: int) -> None:
    for tokens in range(1, 120):
        worst = most_segments(tokens, max_requests)
        assert worst == max_prefill_segments(tokens, max_requests), tokens  # never above, and tight


def test_requests_are_cut_into_runs_of_16_rows_in_token_order() -> None:
    assert row_segments([33, 1, 16], [1, 0, 2]) == ([16, 16, 1, 1, 16], [1, 1, 1, 0, 2])
    assert row_segments([], []) == ([], [])


HOOKS_ON_SGLANG_SHAPES = textwrap.dedent(
    """
    import json, random, sys
    from types import SimpleNamespace
    import torch
    import art_sglang_backports  # as SGLang's plugin loader imports it: top level, from the plugin folder
    (init_target, widen), (prepare_target, cut) = art_sglang_backports.BACKPORTS["triton-prefill-grid"].hooks
    buckets = [4, 8, 16, 32, 48, 64, 96, 128, 192, 256]

    def original_init(backend, max_num_tokens):  # 0.5.17: 32 request slots, one segment per request
        backend.prefill_cuda_graph_batch_info = SimpleNamespace(
            bs=32, num_segments=32, max_len=0, seg_lens=torch.zeros(32, dtype=torch.int32),
            seg_indptr=torch.zeros(33, dtype=torch.int32), weight_indices=torch.zeros(32, dtype=torch.int32))
        backend.prefill_cuda_graph_max_bs = 32
        backend.prefill_cuda_graph_max_tokens = max_num_tokens

    def original_prepare(backend, forward_batch, weight_indices, lora_ranks, scalings, use_cuda_graph,
                         use_prefill_cuda_graph=False):
        lens = forward_batch.extend_seq_lens_cpu
        if use_prefill_cuda_graph:  # 0.5.17: the static buffers, bs pinned, max_len the longest request
            info = backend.prefill_cuda_graph_batch_info
            info.num_segments, info.max_len = len(lens), max(lens)
            info.seg_lens.zero_()
            info.seg_lens[: len(lens)] = torch.tensor(lens)
            info.seg_indptr[1:] = torch.cumsum(info.seg_lens, 0)
            info.weight_indices[: len(lens)] = torch.tensor(weight_indices)
        else:
            info = SimpleNamespace(bs=len(lens), max_len=max(lens), num_segments=len(lens))
        backend.batch_info = info

    def prepare(backend, lens, slots, graph=True, decode=False):
        batch = SimpleNamespace(extend_seq_lens_cpu=lens)
        cut(original_prepare, backend, forward_batch=batch, weight_indices=slots, lora_ranks=[16] * 4,
            scalings=[1.0] * 4, use_cuda_graph=decode, use_prefill_cuda_graph=graph)
        return backend.batch_info

    def covered_rows(info, bs, max_len):  # what the captured launches compute: blocks of 16 rows per segment
        rows = {}
        for seg in range(bs):
            start, length, slot = (int(info.seg_indptr[seg]), int(info.seg_lens[seg]), int(info.weight_indices[seg]))
            for row in range(start, start + min(length, -(-max_len // 16) * 16)):
                rows.setdefault(row, []).append(slot)
        return rows

    backend = SimpleNamespace()
    widen(original_init, backend, max_num_tokens=buckets[-1])
    width = backend.prefill_cuda_graph_batch_info.seg_lens.shape[0]
    captured = {b: (prepare(backend, [b], [0]).bs, prepare(backend, [b], [0]).max_len) for b in buckets}
    rng, wrong, most = random.Random(int(sys.argv[1])), [], 0
    for trial in range(300):
        n = rng.randint(1, 32)
        lens = [17 if trial % 2 else rng.randint(1, 40) for _ in range(n)]
        while sum(lens) > buckets[-1]:
            lens.pop()
        slots = [rng.randrange(4) for _ in lens]
        bucket = next(b for b in buckets if b >= sum(lens))
        info = prepare(backend, lens, slots)
        most = max(most, info.num_segments)
        expected = {row: [slot] for row, slot in enumerate(s for l, s in zip(lens, slots) for _ in range(l))}
        if covered_rows(info, *captured[bucket]) != expected:
            wrong.append([lens, slots])
    eager = prepare(backend, [5, 40], [1, 2], graph=False)
    decode = prepare(backend, [1, 1], [1, 2], graph=False, decode=True)
    print(json.dumps({"targets": [init_target, prepare_target], "width": width, "captured": captured,
                      "wrong": wrong[:3], "most": most, "eager": [eager.bs, eager.max_len],
                      "decode": [decode.bs, decode.max_len], "request_cap": backend.prefill_cuda_graph_max_bs}))
    """
)


def test_the_hooks_cut_prefill_batches_into_rows_the_captured_grid_covers(tmp_path: Path) -> None:
    env = ServerProcess(SGLangConfig(), "m", engine="sglang", log_path=tmp_path / "s.log").environment()
    ran = subprocess.run(
        [sys.executable, "-c", HOOKS_ON_SGLANG_SHAPES, "7"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(ran.stdout)
    assert result["targets"] == [
        "sglang.srt.lora.backend.triton_backend.TritonLoRABackend.init_prefill_cuda_graph_batch_info",
        "sglang.srt.lora.backend.triton_backend.TritonLoRABackend.prepare_lora_batch",
    ]
    assert result["width"] == (256 + 15 * 32) // 16  # room for the largest bucket's worst batch
    # each bucket's capture (one request of `bucket` tokens) freezes the grid of its worst batch, 16 rows each
    assert result["captured"] == {
        str(b): [max_prefill_segments(b, 32), 16] for b in (4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
    }
    assert result["wrong"] == []  # every token of every replayed batch computed once, with its own adapter
    assert result["most"] > 16  # the 17-token batches reached far past one segment per request
    assert result["request_cap"] == 32  # SGLang's request cap for prefill graphs unchanged
    assert result["eager"] == [2, 40]  # batches without a prefill graph keep SGLang's own batch info
    assert result["decode"] == [2, 1]
