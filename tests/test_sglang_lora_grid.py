"""The `csgmv-decode-grid` plugin entry without SGLang: the segment bound against the worst batch, and the
hook on buffers shaped like SGLang's, run the way the server runs it (the plugin folder on its path). The
check against SGLang 0.5.17's own classes needs its venv: /work/notes/tools/csgmv_decode_grid_check_39e.py."""

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
from art_sglang.serving.servers.sglang_site.art_sglang_lora_grid import max_decode_segments


def most_segments(max_bs: int, tokens_per_req: int, slots: int) -> int:
    """The most segments csgmv cuts any batch of <= max_bs requests over <= slots adapters into: each adapter
    group of k requests is k * tokens_per_req tokens in chunks of 16 (the smallest chunk csgmv uses)."""

    @functools.cache
    def best(groups: int, requests: int) -> int:
        if groups == 0 or requests == 0:
            return 0
        return max(
            best(groups, requests - 1),  # fewer requests in the batch
            *(best(groups - 1, requests - k) + -(-k * tokens_per_req // 16) for k in range(1, requests + 1)),
        )

    return best(slots, max_bs)


@pytest.mark.parametrize("tokens_per_req", [1, 2, 3, 4, 8, 16, 17])
def test_no_batch_has_more_segments_than_the_bound(tokens_per_req: int) -> None:
    for max_bs in (1, 2, 3, 5, 15, 16, 17, 33, 48):
        for slots in (1, 2, 3, 4):
            worst = most_segments(max_bs, tokens_per_req, slots)
            bound = max_decode_segments(max_bs, tokens_per_req, slots)
            assert worst <= bound, (max_bs, slots)
            if tokens_per_req == 1:
                assert worst == bound, (max_bs, slots)  # tight: one slot fewer would overflow


HOOK_ON_SGLANG_SHAPES = textwrap.dedent(
    """
    import json, sys
    from types import SimpleNamespace
    import numpy as np
    import art_sglang_backports  # as SGLang's plugin loader imports it: top level, from the plugin folder
    [(target, hook)] = art_sglang_backports.BACKPORTS["csgmv-decode-grid"].hooks
    max_bs, tokens_per_req, slots = map(int, sys.argv[1:])
    def original(backend, max_bs_in_cuda_graph, num_tokens_per_req):  # 0.5.17's allocation
        n = -(-num_tokens_per_req // 16) * max_bs_in_cuda_graph
        backend.cuda_graph_batch_info = SimpleNamespace(
            weight_indices=np.zeros(n), seg_indptr=np.zeros(n + 1), seg_lens=np.zeros(n),
            permutation=np.zeros(max_bs_in_cuda_graph * num_tokens_per_req))
        backend.allocated = backend.cuda_graph_batch_info.__dict__.copy()
    backend = SimpleNamespace(max_loras_per_batch=slots)
    hook(original, backend, max_bs_in_cuda_graph=max_bs, num_tokens_per_req=tokens_per_req)
    info = backend.cuda_graph_batch_info
    print(json.dumps({
        "target": target,
        "shapes": {k: v.shape[0] for k, v in vars(info).items()},
        "same_buffers": all(np.shares_memory(v, backend.allocated[k]) for k, v in vars(info).items()),
    }))
    """
)


@pytest.mark.parametrize(
    ("max_bs", "tokens_per_req", "slots", "segments"),
    [(256, 1, 4, 19), (256, 1, 1, 16), (256, 4, 4, 67), (17, 1, 2, 2), (2, 1, 4, 2), (8, 17, 2, 10)],
)
def test_the_hook_cuts_sglangs_decode_segment_buffers_on_the_servers_path(
    tmp_path: Path, max_bs: int, tokens_per_req: int, slots: int, segments: int
) -> None:
    env = ServerProcess(SGLangConfig(), "m", engine="sglang", log_path=tmp_path / "s.log").environment()
    ran = subprocess.run(
        [sys.executable, "-c", HOOK_ON_SGLANG_SHAPES, str(max_bs), str(tokens_per_req), str(slots)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(ran.stdout)
    assert result["target"].endswith("chunked_backend.ChunkedSgmvLoRABackend.init_cuda_graph_batch_info")
    assert result["shapes"] == {
        "weight_indices": segments,
        "seg_indptr": segments + 1,
        "seg_lens": segments,
        "permutation": max_bs * tokens_per_req,
    }
    assert result["same_buffers"]  # views of the static buffers SGLang allocated, never new ones
