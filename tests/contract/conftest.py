"""Fixtures of the contract tests: which engine and model (`--engine`, `--model-path`), LoRA adapters made
with peft, and one server per test module started through `ServerProcess`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from contract_helpers import contract_config, make_adapter, make_perturbed_model, running_server
from weight_push import Pusher

from art_sglang.constraints import grammars_available
from art_sglang.serving.servers.process import ServerProcess

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="session")
def engine(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--engine")


@pytest.fixture(scope="session")
def grammars(engine: str) -> None:
    """Skips a test of constrained sampling on the reference engine when xgrammar is missing; SGLang brings
    its own grammar library, so on SGLang the test always runs."""
    if engine == "reference" and not grammars_available():
        pytest.skip("the reference engine samples grammars with xgrammar")


@pytest.fixture(scope="session")
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    explicit = request.config.getoption("--model-path")
    if explicit:
        return explicit
    return str(request.getfixturevalue("tiny_model_path"))


@pytest.fixture(scope="session")
def model_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def adapters(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two strong rank-8 adapters on all linear layers, and one of rank 32 (above the server's 16)."""
    root = tmp_path_factory.mktemp("adapters")
    made = {
        "a": make_adapter(model_path, root / "lora_a", rank=8, targets=ALL_LINEAR, seed=1, scale=20.0),
        "b": make_adapter(model_path, root / "lora_b", rank=8, targets=ALL_LINEAR, seed=2, scale=20.0),
        "rank32": make_adapter(
            model_path, root / "lora_rank32", rank=32, targets=["q_proj", "v_proj"], seed=3
        ),
    }
    return {name: str(path) for name, path in made.items()}


@pytest.fixture(scope="module")
def server(engine: str, model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    with running_server(contract_config(engine), model_path, engine, log) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120.0, trust_env=False) as http:
        yield http


@pytest.fixture(scope="module")
def perturbed(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A copy of the model with noise on every weight: other weights to push."""
    return str(make_perturbed_model(model_path, tmp_path_factory.mktemp("perturbed") / "model", seed=5))


@pytest.fixture(scope="module")
def pusher(server: ServerProcess) -> Iterator[Pusher]:
    """A pushing process of its own for the module's server (tests/contract/pusher.py)."""
    pusher = Pusher(server.base_url)
    yield pusher
    pusher.close()
