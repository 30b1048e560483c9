"""The publish probe: a short greedy chat completion with logprobs (what rollouts ask) on a served name, at
each address a client may reach it by, that must answer 200 with finite logprobs."""

from __future__ import annotations

import math

import httpx

from ...errors import ServerRequestError

PROBE_TIMEOUT_S = 120.0
PROBE_TOKENS = 4  # a few: an adapter that cannot serve may answer its first token and fail at the next
# (OpenAI base URL, model field, extra body fields selecting the adapter, key, where: " on the ...")
ProbeTarget = tuple[str, str, dict, str | None, str]


async def probe_chat(name: str, targets: list[ProbeTarget]) -> None:
    """Probe `name` at each target; raises `ServerRequestError` unless each answers 200 with finite
    logprobs."""
    async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, trust_env=False) as http:
        for url, model, adapter, key, where in targets:
            body = {"model": model, "messages": [{"role": "user", "content": "ping"}],
                    "max_tokens": PROBE_TOKENS, "temperature": 0.0, "logprobs": True, **adapter}  # fmt: skip
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            response = await http.post(f"{url}/chat/completions", json=body, headers=headers)
            if response.status_code != 200:
                raise ServerRequestError(
                    f"probe request on {name!r}{where} failed with HTTP {response.status_code}: "
                    f"{response.text[:500]}",
                    status=response.status_code,
                    server_message=response.text,
                )
            if not _finite_logprobs(response.json()):
                raise ServerRequestError(
                    f"probe request on {name!r}{where} answered logprobs that are not finite numbers: "
                    f"{response.text[:500]}",
                    status=response.status_code,
                    server_message=response.text,
                )


def _finite_logprobs(completion: dict) -> bool:
    """Whether every token of a chat completion has a finite logprob (JSON has no NaN or infinity; a
    server writes them as literals, which Python reads, or as null)."""
    content = [
        t for choice in completion["choices"] for t in (choice.get("logprobs") or {}).get("content") or []
    ]
    return all(isinstance(t.get("logprob"), (int, float)) and math.isfinite(t["logprob"]) for t in content)
