"""csgmv's decode CUDA graph launched with as many segment slots as a graph batch can have, not one per
request: the `csgmv-decode-grid` entry of `art_sglang_backports` (a fix no SGLang release has).

SGLang 0.5.17's `ChunkedSgmvLoRABackend.init_cuda_graph_batch_info` gives the decode graph's batch info
ceil(tokens_per_req / 16) * max_bs segment slots (256 at max bs 256), and in graph mode the csgmv shrink,
expand and embedding kernels size their grid's segment axis by `weight_indices.shape[0]`: every LoRA kernel
of every decode step launches 256 segments' worth of CTAs, though a batch of 256 tokens of one adapter has
16 segments. The unused ones load `seg_indptr`, find an empty segment and exit (~94 % of the CTAs at bs 256).

A batch is cut per adapter group into chunks of at least 16 tokens: a group of g tokens makes
ceil(g / 16) <= (g + 15) / 16 segments, so a batch makes at most (tokens + 15 * groups) // 16
(`max_decode_segments`; reached by groups of one request beside one large group). The hook keeps prefix views of SGLang's own static
buffers of that length: `prepare_lora_batch` takes its slot count from `weight_indices.shape[0]` and
zero-fills / indptr-pads the unused tail of exactly these views, and a batch that somehow had more segments
would fail its `copy_` loudly instead of computing wrong values.

This module imports nothing at import time (art_sglang's tests read it without SGLang or torch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MIN_CHUNK_SIZE = 16  # chunked_backend.MIN_CHUNK_SIZE: csgmv never cuts a batch into shorter chunks


def max_decode_segments(max_bs: int, tokens_per_req: int, max_loras_per_batch: int) -> int:
    """The most segments csgmv cuts a graph batch of at most `max_bs` requests into: each of its adapter
    groups (one per adapter slot at most, and one request at least) of g tokens makes ceil(g / chunk) segments,
    chunk >= 16."""
    groups = min(max_loras_per_batch, max_bs)
    return (max_bs * tokens_per_req + groups * (MIN_CHUNK_SIZE - 1)) // MIN_CHUNK_SIZE


def right_size_decode_segments(
    original: Callable[..., Any], backend: Any, max_bs_in_cuda_graph: int, num_tokens_per_req: int
) -> None:
    """AROUND hook of `ChunkedSgmvLoRABackend.init_cuda_graph_batch_info` (SGLang 0.5.17's name)."""
    original(backend, max_bs_in_cuda_graph=max_bs_in_cuda_graph, num_tokens_per_req=num_tokens_per_req)
    info = backend.cuda_graph_batch_info
    slots = min(
        max_decode_segments(max_bs_in_cuda_graph, num_tokens_per_req, backend.max_loras_per_batch),
        info.weight_indices.shape[0],
    )
    info.weight_indices = info.weight_indices[:slots]
    info.seg_indptr = info.seg_indptr[: slots + 1]
    info.seg_lens = info.seg_lens[:slots]
