"""The triton LoRA backend's prefill CUDA graphs launched for the 16-row segments a batch has, not for 32
requests of the whole bucket each: the `triton-prefill-grid` entry of `art_sglang_backports` (a fix no SGLang
release before 0.5.23 has: 0.5.23's `TritonLoRABackend` cuts prefill-graph batches into 16-token chunks too).

SGLang 0.5.17 captures LoRA prefill in its breakable prefill graphs, one graph per token bucket (up to the
chunked-prefill size, 8,192), from a capture batch of ONE request of `bucket` tokens. `TritonLoRABackend` gives
that graph one segment per request with the segment count pinned at 32 (`PREFILL_CUDA_GRAPH_LORA_SEGMENTS`) and
`max_len` = the longest request, so every LoRA kernel captured for the 8,192 bucket launches 32 x 512 row
blocks per output tile (170 M CTAs per forward of the 1.5B shape), of which a chunk of ~9 requests uses ~3 %:
the rest load their segment, find it empty and exit. That halves triton's prefill rate against csgmv's.

The hook cuts each request's tokens into runs of at most 16 rows (the kernels' BLOCK_S), in token order, with
`max_len` 16 and `bs` = the most such segments a batch of that many tokens in at most 32 requests can make:
the captured grid covers every batch that replays the bucket, and ~95 % of its CTAs work. The kernels are
SGLang's own and take any segment list (each CTA reads its segment's start, length and adapter slot); a
request of l tokens makes ceil(l / 16) <= (l + 15) / 16 segments, so a batch of t tokens in n <= min(32, t)
requests makes at most (t + 15 * n) // 16 (`max_prefill_segments`; reached when every request has one token
more than a multiple of 16).

This module imports nothing at import time (art_sglang's tests read it without SGLang or torch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

ROWS = 16  # BLOCK_S of 0.5.17's sgemm_lora_a/b, qkv_lora_b and gate_up_lora_b kernels


def max_prefill_segments(tokens: int, max_requests: int) -> int:
    """The most segments of at most 16 rows a batch of `tokens` tokens in at most `max_requests` requests (each
    of one token at least) is cut into."""
    return (tokens + (ROWS - 1) * min(max_requests, tokens)) // ROWS


def row_segments(seq_lens: Sequence[int], weight_indices: Sequence[int]) -> tuple[list[int], list[int]]:
    """Each request's tokens cut into runs of at most 16, in token order: (run lengths, adapter slot of each)."""
    lens: list[int] = []
    slots: list[int] = []
    for length, slot in zip(seq_lens, weight_indices, strict=True):
        for start in range(0, length, ROWS):
            lens.append(min(ROWS, length - start))
            slots.append(slot)
    return lens, slots


def widen_prefill_segments(original: Callable[..., Any], backend: Any, max_num_tokens: int) -> None:
    """AROUND hook of `TritonLoRABackend.init_prefill_cuda_graph_batch_info`: room for the row segments of the
    largest bucket (SGLang's request cap, `prefill_cuda_graph_max_bs`, stays 32)."""
    import torch

    original(backend, max_num_tokens=max_num_tokens)
    info = backend.prefill_cuda_graph_batch_info
    slots = max_prefill_segments(max_num_tokens, backend.prefill_cuda_graph_max_bs)
    device = info.seg_lens.device
    info.seg_lens = torch.zeros(slots, dtype=torch.int32, device=device)
    info.seg_indptr = torch.zeros(slots + 1, dtype=torch.int32, device=device)
    info.weight_indices = torch.zeros(slots, dtype=torch.int32, device=device)
    info.bs = info.num_segments = slots


def cut_prefill_rows(
    original: Callable[..., Any],
    backend: Any,
    forward_batch: Any,
    weight_indices: list[int],
    lora_ranks: list[int],
    scalings: list[float],
    use_cuda_graph: bool,
    use_prefill_cuda_graph: bool = False,
) -> None:
    """AROUND hook of `TritonLoRABackend.prepare_lora_batch`: a batch that may replay a prefill graph gets the
    static batch info refilled in row segments (the same values whether the graph replays or runs eagerly)."""
    original(
        backend, forward_batch, weight_indices, lora_ranks, scalings, use_cuda_graph, use_prefill_cuda_graph
    )
    if use_cuda_graph or not use_prefill_cuda_graph:
        return
    import torch

    info = backend.prefill_cuda_graph_batch_info
    seq_lens = list(forward_batch.extend_seq_lens_cpu)
    lens, slots = row_segments(seq_lens, weight_indices)
    # Padded to the buffers' width: the unused tail empty. A batch with more segments than the buffers hold
    # (none can have: max_prefill_segments) would fail the copies loudly instead of computing wrong values.
    padding = [0] * (info.seg_lens.shape[0] - len(lens))
    pin = torch.cuda.is_available()  # pinned like SGLang's own host tensors, so the copies do not sync

    def host(values: list[int]) -> Any:
        return torch.tensor(values, dtype=torch.int32, pin_memory=pin)

    # On the stream after SGLang's own copies into the same buffers, so these win.
    info.seg_lens.copy_(host(lens + padding), non_blocking=True)
    info.weight_indices.copy_(host(slots + padding), non_blocking=True)
    info.seg_indptr.copy_(host([0, *accumulate(lens + padding)]), non_blocking=True)
    info.num_segments = len(lens)
    info.max_len = ROWS
    info.bs = max_prefill_segments(sum(seq_lens), backend.prefill_cuda_graph_max_bs)
