"""Constrained rollouts end to end on the reference engine behind the gateway: each constraint kind is
honoured by the samples and travels on the Choice (`art_constraint`), malformed ones are a 400, and the
trainer's logprobs of the sampled tokens under the constraint equal the engine's, while the unconstrained
computation is off by the bias the constraint introduced."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
import torch
from backend_helpers import server_with_adapter
from openai import AsyncOpenAI
from openai.types.chat.chat_completion import Choice

from art_sglang.constraints import CONSTRAINT_FIELD, grammars_available
from art_sglang.serving.gateway.app import AdapterGateway
from art_sglang.serving.servers.process import ServerProcess
from art_sglang.tool_choice import TEMPLATE_TOOLS_FIELD
from art_sglang.training.loss import sampled_token_logprobs
from art_sglang.training.tokenize import ChatTokenizer, TokenizeStats, sampled_constraints
from art_sglang.training.validation import groups_to_wire
from art_sglang.trajectories import Trajectory, TrajectoryGroup

pytestmark = pytest.mark.asyncio(loop_scope="module")
MESSAGES = [{"role": "user", "content": "pick a move"}]
TOLERANCE = 1e-4  # float32 one token at a time (engine) against one forward over the sequence (trainer)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("constrained")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(folder: Path, tiny_model_path: Path):
    async with server_with_adapter(tiny_model_path, folder) as process:
        yield process


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(server: ServerProcess):
    gateway = AdapterGateway(server.base_url)
    gateway.start()
    gateway.set_served(["agent@1"], [server.model_path])
    yield AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0)
    gateway.close()


@pytest.fixture(scope="module")
def policy(server: ServerProcess, folder: Path) -> Any:
    """The served adapter (server_with_adapter wrote it to folder/adapter) on the base model, as the
    trainer scores it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(server.model_path, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(folder / "adapter")).eval()


@pytest.fixture(scope="module")
def chat_tokenizer(server: ServerProcess, tokenizer: Any) -> ChatTokenizer:
    return ChatTokenizer.for_model(tokenizer, server.model_path)


async def sample(client: AsyncOpenAI, **extra: Any) -> list[Choice]:
    reply = await client.chat.completions.create(
        model="agent@1",
        messages=MESSAGES,  # type: ignore[arg-type]
        logprobs=True,
        temperature=1.0,
        seed=3,
        **extra,
    )
    return reply.choices


@torch.no_grad()
def trainer_logprobs(
    policy: Any, chat: ChatTokenizer, choice: Choice, *, constrained: bool = True
) -> tuple[list[float], list[float]]:
    """(the trainer's logprobs of the choice's sampled tokens, the engine's), in token order."""
    trajectory = Trajectory(messages_and_choices=[*MESSAGES, choice], reward=0.0)
    wire = groups_to_wire([TrajectoryGroup([trajectory])])[0]["trajectories"][0]
    [sequence] = chat.tokenize_trajectory(wire, group=0, index=0, stats=TokenizeStats())
    ids = torch.tensor([sequence.input_ids])
    mask = torch.tensor([sequence.sampled_mask])
    constraints = sampled_constraints([sequence]) if constrained else None
    got = sampled_token_logprobs(policy(input_ids=ids).logits, ids, mask, constraints)
    engine = [lp for lp, m in zip(sequence.old_logprobs[1:], sequence.sampled_mask[1:], strict=True) if m]
    return got.tolist(), engine


async def test_an_action_mask_is_honoured_and_trained_under(
    client, policy, chat_tokenizer, tokenizer
) -> None:
    allowed = [tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(1, 10)]
    allowed.append(tokenizer.eos_token_id)
    choices = await sample(client, max_tokens=3, n=1, extra_body={"allowed_token_ids": allowed})
    for choice in choices:
        assert choice.token_ids and set(choice.token_ids) <= set(allowed)  # type: ignore[attr-defined]
        carried = getattr(choice, CONSTRAINT_FIELD)
        assert carried["allowed_token_ids"] == sorted(allowed) and carried["logit_bias"] == []
        got, engine = trainer_logprobs(policy, chat_tokenizer, choice)
        assert got == pytest.approx(engine, abs=TOLERANCE)
        unconstrained, _ = trainer_logprobs(policy, chat_tokenizer, choice, constrained=False)
        # Under the full vocabulary every sampled token is less likely: the bias the mask removes.
        assert all(u < e - 0.1 for u, e in zip(unconstrained, engine, strict=True))


async def test_a_logit_bias_is_honoured_and_trained_under(client, policy, chat_tokenizer, tokenizer) -> None:
    favoured = tokenizer.encode("7", add_special_tokens=False)[0]
    choices = await sample(client, max_tokens=4, logit_bias={str(favoured): 12.0, "5": -100})
    [choice] = choices
    assert favoured in choice.token_ids and 5 not in choice.token_ids  # type: ignore[attr-defined]
    assert getattr(choice, CONSTRAINT_FIELD)["logit_bias"] == [[5, -100.0], [favoured, 12.0]]
    got, engine = trainer_logprobs(policy, chat_tokenizer, choice)
    assert got == pytest.approx(engine, abs=TOLERANCE)
    unconstrained, _ = trainer_logprobs(policy, chat_tokenizer, choice, constrained=False)
    favoured_at = [i for i, t in enumerate(choice.token_ids) if t == favoured]  # type: ignore[attr-defined]
    assert all(unconstrained[i] < engine[i] - 1.0 for i in favoured_at)


@pytest.mark.skipif(not grammars_available(), reason="needs xgrammar (the grammars extra)")
@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        ({"extra_body": {"regex": "(yes|no) [0-9]{1,2}"}}, r"(yes|no) [0-9]{1,2}"),
        ({"extra_body": {"ebnf": 'root ::= "cell " [1-9]'}}, r"cell [1-9]"),
    ],
)
async def test_a_grammar_is_honoured_and_replayed_by_the_trainer(
    client, policy, chat_tokenizer, extra: dict, pattern: str
) -> None:
    [choice] = await sample(client, max_tokens=40, **extra)
    assert choice.finish_reason == "stop" and re.fullmatch(pattern, choice.message.content or "")
    got, engine = trainer_logprobs(policy, chat_tokenizer, choice)
    assert got == pytest.approx(engine, abs=TOLERANCE)
    unconstrained, _ = trainer_logprobs(policy, chat_tokenizer, choice, constrained=False)
    assert sum(engine) - sum(unconstrained) > 1.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"logit_bias": {"7": 101}}, "from -100 to 100"),
        ({"extra_body": {"allowed_token_ids": []}}, "non-empty list"),
        ({"extra_body": {"allowed_token_ids": [5], "custom_logit_processor": "{}"}}, "arbitrary Python"),
        ({"extra_body": {"regex": "[0-9", "ebnf": 'root ::= "a"'}}, "only one of"),
        ({"response_format": {"type": "xml"}}, "response_format type"),
    ],
)
async def test_a_malformed_constraint_is_a_400(client, extra: dict, message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=message):
        await sample(client, max_tokens=2, **extra)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"regex": "[0-9"}, "does not compile" if grammars_available() else "needs xgrammar"),
        ({"logit_bias": {"99999": 1.0}}, "outside the vocabulary"),
    ],
)
async def test_the_engine_refuses_what_it_cannot_sample_under(server, extra: dict, message: str) -> None:
    import httpx

    body = {"model": "default", "messages": MESSAGES, "max_tokens": 2, **extra}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60, trust_env=False) as http:
        response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and message in response.text


def _tool(name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": {}}},
    }


TOOLS = [_tool("add"), _tool("mul")]


def tool_sequence(chat: ChatTokenizer, choice: Choice) -> Any:
    trajectory = Trajectory(messages_and_choices=[*MESSAGES, choice], tools=TOOLS, reward=0.0)
    wire = groups_to_wire([TrajectoryGroup([trajectory])])[0]["trajectories"][0]
    [sequence] = chat.tokenize_trajectory(wire, group=0, index=0, stats=TokenizeStats())
    return sequence


@torch.no_grad()
def tool_logprobs(policy: Any, chat: ChatTokenizer, choice: Choice, *, constrained: bool) -> list[float]:
    sequence = tool_sequence(chat, choice)
    ids, mask = torch.tensor([sequence.input_ids]), torch.tensor([sequence.sampled_mask])
    constraints = sampled_constraints([sequence]) if constrained else None
    return sampled_token_logprobs(policy(input_ids=ids).logits, ids, mask, constraints).tolist()


@pytest.mark.skipif(not grammars_available(), reason="needs xgrammar (the grammars extra)")
async def test_a_forced_tool_call_carries_its_structural_tag_and_is_trained_under_it(
    client, policy, chat_tokenizer
) -> None:
    [choice] = await sample(client, max_tokens=24, tools=TOOLS, tool_choice="required")
    grammar = getattr(choice, CONSTRAINT_FIELD)["grammar"]
    assert grammar["kind"] == "structural_tag" and json.loads(grammar["source"])["at_least_one"] is True
    text = chat_tokenizer.tokenizer.decode(choice.token_ids)  # type: ignore[attr-defined]
    assert text.startswith('<tool_call>{"name":"')
    sequence = tool_sequence(chat_tokenizer, choice)
    engine = [lp for lp, m in zip(sequence.old_logprobs[1:], sequence.sampled_mask[1:], strict=True) if m]
    assert tool_logprobs(policy, chat_tokenizer, choice, constrained=True) == pytest.approx(
        engine, abs=TOLERANCE
    )
    # The forced markup has logprob ~0 from the engine; scored without the tag it is far less likely.
    unconstrained = tool_logprobs(policy, chat_tokenizer, choice, constrained=False)
    assert sum(engine) - sum(unconstrained) > 5.0


@pytest.mark.parametrize("tool_choice", ["none", {"type": "function", "function": {"name": "mul"}}])
async def test_the_trainer_renders_the_prompt_with_the_tools_the_engine_rendered(
    client, chat_tokenizer, tool_choice: Any
) -> None:
    [choice] = await sample(client, max_tokens=4, tools=TOOLS, tool_choice=tool_choice)
    shown = getattr(choice, TEMPLATE_TOOLS_FIELD)
    assert shown == ([] if tool_choice == "none" else TOOLS[1:])
    sequence = tool_sequence(chat_tokenizer, choice)
    prompt = sequence.input_ids[: sequence.sampled_mask.index(1)]
    assert prompt == choice.prompt_token_ids  # type: ignore[attr-defined]
    # Rendered with the trajectory's tools, as before, it was another prompt than the one sampled with.
    unshown = choice.model_copy(update={TEMPLATE_TOOLS_FIELD: None})
    assert tool_sequence(chat_tokenizer, unshown).input_ids[: len(prompt)] != prompt
