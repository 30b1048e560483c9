"""The `logprob-json` backport (art_sglang_backports.py): a non-streamed chat answer's logprobs rendered into its
JSON body in one pass.

SGLang 0.5.17's `_build_chat_response` makes one validated `ChatCompletionTokenLogprob` per output token, and
serialising the response then materialises every one of them again as Python dicts (the wrap serializers of
`ChatCompletionResponseChoice` and `ChatCompletionResponse` hand pydantic-core Python data): ~4.4 ms of CPU per
1,024-token answer on the HTTP process's one event loop, for each of a wave's answers in turn, and the ~5k objects
each answer keeps alive meanwhile start full garbage collections of that process (4-5 per wave of 128 such
answers, ~0.5 s each over its ~740k objects, on CPU). Here the response is built
without its token entries, serialised (fast: no entries), and the entries' JSON, written by pydantic-core from
plain dicts with the entry model's own field order and types, is put where `"content":[]` stood: the bytes
`model_dump_json(by_alias=True)` of SGLang's response would have been (what `json-response` and 0.5.23 send).

Anything outside the plain case takes SGLang's path: top logprobs, meta_info in the answer, an entry that is not
(float, id, str), a release whose entries are built otherwise (0.5.23 takes `bytes` from the token id), an
entry model with other fields, a body where the empty logprobs do not appear once per choice.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache
from typing import Any

from typing_extensions import TypedDict  # pydantic reads typing's only from Python 3.12

EMPTY = b'"logprobs":{"content":[]}'
FIELDS = ["token", "bytes", "logprob", "top_logprobs"]


class TokenEntry(TypedDict):
    """One `ChatCompletionTokenLogprob` of 0.5.17 (protocol.py), fields in its order, as plain data."""

    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[Any]


@cache
def _entries_json() -> Callable[[list[TokenEntry]], bytes] | None:
    """pydantic-core's writer of a list of token entries, or None where SGLang's entry model is not 0.5.17's."""
    from pydantic import TypeAdapter

    entry = importlib.import_module("sglang.srt.entrypoints.openai.protocol").ChatCompletionTokenLogprob
    chat = importlib.import_module("sglang.srt.entrypoints.openai.serving_chat").OpenAIServingChat
    if list(entry.model_fields) != FIELDS:
        return None
    if hasattr(chat, "_build_token_logprobs_from_raw"):  # 0.5.23+: bytes from the token id
        return None
    return TypeAdapter(list[TokenEntry]).dump_json


def entries(triples: list[Any]) -> list[TokenEntry] | None:
    """The token entries SGLang would make of an answer's (logprob, token id, text) triples, or None where one
    is not the plain kind (a float, an id, a str), which SGLang's path then takes."""
    made: list[TokenEntry] = []
    for triple in triples:
        if not isinstance(triple, tuple | list) or len(triple) != 3:
            return None
        logprob, _, text = triple
        if type(logprob) is not float or type(text) is not str:
            return None
        made.append(
            {"token": text, "bytes": list(text.encode("utf-8")), "logprob": logprob, "top_logprobs": []}
        )
    return made


def _plain(request: Any, ret: list[Any]) -> bool:
    if not request.logprobs or getattr(request, "return_meta_info", False):
        return False
    for item in ret:
        meta = item.get("meta_info") if isinstance(item, dict) else None
        if not isinstance(meta, dict) or meta.get("output_top_logprobs"):
            return False
        if not isinstance(meta.get("output_token_logprobs"), list):
            return False
    return True


def build_in_one_pass(
    original: Callable[..., Any], chat: Any, request: Any, ret: list[Any], created: int
) -> Any:
    """AROUND `OpenAIServingChat._build_chat_response(request, ret, created)`: the JSON body of SGLang's
    response as a starlette Response (that method returns a Response already for errors), built as above."""
    write = _entries_json()
    if write is None or not ret or not _plain(request, ret):
        return original(chat, request, ret, created)
    made = [entries(item["meta_info"]["output_token_logprobs"]) for item in ret]
    if any(answer is None for answer in made):
        return original(chat, request, ret, created)
    bare = [{**item, "meta_info": {**item["meta_info"], "output_token_logprobs": []}} for item in ret]
    response = original(chat, request, bare, created)
    from pydantic import BaseModel

    if not isinstance(response, BaseModel):  # an error response: SGLang's own, whatever the logprobs
        return response
    parts = response.model_dump_json(by_alias=True).encode().split(EMPTY)
    if len(parts) != len(ret) + 1:
        return original(chat, request, ret, created)
    from fastapi.responses import Response

    body = [parts[0]]
    for answer, after in zip(made, parts[1:], strict=True):
        body += [b'"logprobs":{"content":', write(answer), b"}", after]
    return Response(content=b"".join(body), media_type="application/json")
