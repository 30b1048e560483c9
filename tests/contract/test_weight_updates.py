"""Weights replaced while serving (merged-weight rollouts, issue 40): pushed as tensors
(`/update_weights_from_tensor`, in buckets, both of SGLang's formats) by a process of its own, as the
trainer will, or broadcast in a weight-update group (`/init_weights_update_group` +
`/update_weights_from_distributed`); the version every answer reports; what a refused or partial push
leaves. Pushed weights must serve exactly what the same weights loaded from disk serve. On SGLang 0.5.17
nothing rolls a partial push back: the server then holds a mix, and a full push of a known version is
what restores it (the backend's recovery)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from contract_helpers import contract_config, running_server, wait_until_dead
from weight_push import Pusher, assert_same, broadcast_all, from_disk, greedy, state_tensors, update_group

from art_sglang.orchestration.merge import merge


def test_pushed_weights_serve_what_the_same_weights_from_disk_serve(
    client: httpx.Client, pusher: Pusher, model_path: str, perturbed: str
) -> None:
    before = greedy(client)
    total = sum(t.numel() * t.element_size() for _, t in state_tensors(perturbed))
    assert pusher.push_ok(model=perturbed, max_bytes=total // 3, version="step-1") >= 2
    pushed = greedy(client)
    assert pushed.output_ids != before.output_ids
    assert pushed.weight_version == "step-1"
    assert client.get("/model_info").json()["weight_version"] == "step-1"
    chat = client.post(
        "/v1/chat/completions",
        json={"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert chat.json()["metadata"]["weight_version"] == "step-1"

    from_disk(client, perturbed, "disk")
    assert_same(greedy(client), pushed, version="disk")

    # Back to the base weights as one flattened bucket (SGLang's other format).
    [answer] = pusher.push(model=model_path, load_format="flattened_bucket", version="base")
    assert answer["status"] == 200
    assert json.loads(answer["body"]) == {
        "success": True,
        "message": "Success Weight version updated to base.",
    }
    assert_same(greedy(client), before, version="base")


def test_the_trainers_merged_weights_serve_what_the_merged_checkpoint_serves(
    client: httpx.Client, pusher: Pusher, model_path: str, adapters: dict[str, str], tmp_path: Path
) -> None:
    """Only the modules LoRA wraps are pushed (the rest equal the base the server started with), merged out
    of place by the trainer's code; `weight_sync_method="disk"` merges with peft into a checkpoint."""
    pusher.push_ok(model=model_path, version="v0")
    before = greedy(client)
    pusher.push_ok(model=model_path, adapter=adapters["a"], version="m@1")
    pushed = greedy(client)
    assert pushed.output_ids != before.output_ids
    merged_dir = tmp_path / "merged"
    merge(model_path, Path(adapters["a"]), merged_dir)
    from_disk(client, str(merged_dir), "disk")
    assert_same(greedy(client), pushed, version="disk")
    from_disk(client, model_path, "v0")


def test_a_partial_push_keeps_the_version_and_a_full_push_restores(
    client: httpx.Client, pusher: Pusher, model_path: str, perturbed: str
) -> None:
    pusher.push_ok(model=model_path, version="v0")
    before = greedy(client)
    # The first bucket only, as when the trainer dies mid-push: the rest never comes.
    pusher.push_ok(model=perturbed, max_bytes=1 << 16, first_only=True, flush=False)
    half = greedy(client)
    assert half.weight_version == "v0"  # the version names the last full push...
    assert half.output_ids != before.output_ids  # ...but the server holds a mix: nothing rolled back
    pusher.push_ok(model=model_path, version="v0")
    assert_same(greedy(client), before)


def test_a_refused_push_changes_nothing(client: httpx.Client, pusher: Pusher, model_path: str) -> None:
    pusher.push_ok(model=model_path, version="v0")
    before = greedy(client)
    not_base64 = client.post(
        "/update_weights_from_tensor",
        json={"serialized_named_tensors": ["not base64!"], "weight_version": "bad"},
    )
    assert not_base64.status_code == 400
    assert_same(greedy(client), before)

    # Names the model does not have are skipped (SGLang logs a warning and answers success): a push with
    # wrong names changes nothing, so the pusher has to get the names right.
    pusher.push_ok(ones=[["model.layers.0.no_such.weight", [4]]])
    assert_same(greedy(client), before)


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_weights_broadcast_in_an_update_group(
    client: httpx.Client, pusher: Pusher, model_path: str, perturbed: str, load_format: str | None
) -> None:
    pusher.push_ok(model=model_path, version="v0")
    before = greedy(client)
    with update_group(client, "weight_update_group") as group:
        response = broadcast_all(
            client, group, "weight_update_group", state_tensors(perturbed), load_format=load_format,
            weight_version="step-2",
        )  # fmt: skip
        assert response.status_code == 200, response.text
        assert response.json() == {
            "success": True,
            "message": "Succeeded to update parameter online. Weight version updated to step-2.",
        }
    received = greedy(client)
    assert received.weight_version == "step-2" and received.output_ids != before.output_ids
    from_disk(client, perturbed, "disk")
    assert_same(greedy(client), received, version="disk")
    from_disk(client, model_path, "v0")
    assert_same(greedy(client), before)


def test_destroying_a_group_never_joined_is_refused(client: httpx.Client) -> None:
    response = client.post("/destroy_weights_update_group", json={"group_name": "nobody"})
    assert response.status_code == 400
    assert response.json() == {"success": False, "message": "The group to be destroyed does not exist."}


def test_a_tensor_of_the_wrong_shape_ends_the_server(engine: str, model_path: str, tmp_path: Path) -> None:
    """SGLang's loader asserts the shape inside its scheduler, which takes the server down: a backend must
    never push a tensor it has not checked against the served model."""
    with running_server(contract_config(engine), model_path, engine, tmp_path / "server.log") as proc:
        pusher = Pusher(proc.base_url)
        try:
            [answer] = pusher.push(ones=[["model.norm.weight", [3]]])
        finally:
            pusher.close()
        assert answer["status"] is None  # the connection dropped
        wait_until_dead(proc)
        assert "Scheduler hit an exception" in proc.log_tail(400)
