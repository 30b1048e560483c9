"""Sampling constraints on the server itself (both engines; on SGLang with the `contract` suite): logit_bias
is honoured, a regex too, and the logprobs a constrained request reports are taken after the constraint:
the allowed tokens' probabilities add up to 1. This is what the trainer reproduces (docs/guide.md,
"Constrained rollouts")."""

from __future__ import annotations

import math
import re
from typing import Any

import httpx
import pytest
from contract_helpers import chat


@pytest.fixture(scope="module")
def digits(model_path: str) -> list[int]:
    """Token ids of the digits 1-3 (one token each in the test models' tokenizer)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = [tokenizer.encode(str(d), add_special_tokens=False) for d in (1, 2, 3)]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


def _first(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_logit_bias_moves_the_greedy_choice(client: httpx.Client, digits: list[int]) -> None:
    plain = _first(chat(client, max_tokens=1, logprobs=True, return_token_ids=True))["token_ids"][0]
    away = _first(chat(client, max_tokens=1, return_token_ids=True, logit_bias={str(plain): -100}))
    assert away["token_ids"][0] != plain
    towards = _first(chat(client, max_tokens=1, return_token_ids=True, logit_bias={str(digits[1]): 100}))
    assert towards["token_ids"] == [digits[1]]


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_reported_logprobs_are_taken_after_the_bias(
    client: httpx.Client, digits: list[int], temperature: float
) -> None:
    # What the gateway forwards for allowed_token_ids: +100 on each allowed id.
    bias = {str(t): 100 for t in digits}
    choice = _first(
        chat(
            client,
            max_tokens=1,
            temperature=temperature,
            seed=1,
            logprobs=True,
            top_logprobs=3,
            return_token_ids=True,
            logit_bias=bias,
        )
    )
    assert choice["token_ids"][0] in digits
    top = choice["logprobs"]["content"][0]["top_logprobs"]
    # Under the constraint the three allowed tokens hold all the probability; before it, almost none.
    assert sum(math.exp(entry["logprob"]) for entry in top) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.usefixtures("grammars")
def test_a_regex_is_honoured_and_its_logprobs_are_taken_under_it(client: httpx.Client) -> None:
    choice = _first(
        chat(
            client,
            max_tokens=8,
            temperature=1.0,
            seed=2,
            logprobs=True,
            top_logprobs=3,
            regex="[1-3]( [1-3])?",
        )
    )
    assert re.fullmatch("[1-3]( [1-3])?", choice["message"]["content"])
    top = choice["logprobs"]["content"][0]["top_logprobs"]
    assert sum(math.exp(entry["logprob"]) for entry in top) == pytest.approx(1.0, abs=1e-3)
