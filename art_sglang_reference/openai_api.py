"""OpenAI-compatible routes (/v1/chat/completions, /v1/completions, /v1/models) with SGLang's response
shapes: `matched_stop`, `reasoning_content`, `usage.prompt_tokens_details` only with
--enable-cache-report and a cache hit, `metadata.weight_version`."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .constrained import constrain, constrain_tools
from .engine import ReferenceEngine
from .generation import GenerationRequest, GenerationResult
from .http_common import (
    engine_error_response,
    error_response,
    note,
    note_results,
    run_generations,
)
from .openai_format import chat_logprob, completion_logprobs, finish_fields, usage
from .openai_stream import chat_stream, completion_stream
from .sampling import SamplingOptions, StopRegexError
from .schemas import ChatCompletionRequest, CompletionRequest, string_list
from .tool_choice import tool_use

router = APIRouter()


async def require_json(request: Request) -> None:
    """SGLang accepts only application/json bodies on the OpenAI routes."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise RequestValidationError(
            [
                {
                    "loc": ["header", "content-type"],
                    "msg": "Unsupported Media Type: Only 'application/json' is allowed",
                    "type": "value_error",
                }
            ]
        )


def _engine(request: Request) -> ReferenceEngine:
    return request.app.state.engine


def _sampling(engine: ReferenceEngine, body: Any, max_new_tokens: int | None) -> SamplingOptions:
    defaults = engine.sampling_defaults()

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(body, name)
        return value if value is not None else defaults.get(name, fallback)

    return SamplingOptions(
        max_new_tokens=max_new_tokens,
        temperature=pick("temperature", 1.0),
        top_p=pick("top_p", 1.0),
        top_k=pick("top_k", -1),
        min_p=pick("min_p", 0.0),
        stop=string_list(body.stop),
        stop_regex=string_list(body.stop_regex),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        no_stop_trim=body.no_stop_trim,
        seed=body.seed,
    )


def requested_adapter(model: str, lora_path: str | None) -> str | None:
    """The adapter an OpenAI request names, as SGLang 0.5.17 reads it: the part after the first ':' of
    `model` (`"<base>:<adapter>"`), else the `lora_path` field. A bare `model` never selects an adapter,
    even one loaded under that very name: it is served by the base model and echoed back (the recorded
    SGLang answers show exactly this)."""
    _, sep, adapter = model.partition(":")
    if sep and adapter.strip():
        return adapter.strip()
    return lora_path or None


def _choices(
    engine: ReferenceEngine, prompt_ids: list[int], sampling: SamplingOptions, body: Any, top: int
) -> list[GenerationRequest]:
    """n requests for one prompt, under the body's sampling constraint; a seeded request gives choice i the
    seed `seed + i`. An adapter that is not loaded is reloaded or refused here, before anything streams."""
    adapter = requested_adapter(body.model, body.lora_path)
    engine.resolve_adapter(adapter)
    requests = []
    for i in range(body.n):
        options = SamplingOptions(**{**vars(sampling), "stop": list(sampling.stop)})
        if sampling.seed is not None:
            options.seed = sampling.seed + i
        requests.append(
            GenerationRequest(
                prompt_ids, options, adapter_name=adapter, top_logprobs=top, parallel=body.n > 1
            )
        )
    constrain(engine, body.model_extra or {}, requests)
    return requests


async def _run(
    engine: ReferenceEngine,
    request: Request,
    prepare: Callable[[], list[GenerationRequest]],
    stream: Callable[[list[GenerationRequest]], AsyncIterator[str]] | None,
) -> list[GenerationResult] | Response:
    """Prepare a request in a worker thread (it may wait for the model, to reload an adapter), then stream
    it (`stream` given) or run it to the end. A bad request becomes SGLang's 400 body (its 500 for a
    stop_regex that does not parse), an engine failure its error response."""
    try:
        prepared = await asyncio.to_thread(prepare)
    except ValueError as exc:
        return error_response(str(exc))
    except StopRegexError as exc:  # SGLang's routes turn an exception they do not expect into this 500
        return error_response(f"Internal server error: {exc}", 500, "InternalServerError")
    if stream is not None:
        return StreamingResponse(stream(prepared), media_type="text/event-stream")
    try:
        results = await run_generations(engine, prepared)
    except Exception as exc:
        return engine_error_response(exc)
    note_results(request, results)
    return results


# --- chat -----------------------------------------------------------------------------------------------
@router.post("/v1/chat/completions", dependencies=[Depends(require_json)])
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    engine = _engine(request)
    note(request, model=body.model)

    try:
        tools = tool_use(body.tools, body.tool_choice, body.parallel_tool_calls, engine.args.tool_call_parser)
    except ValueError as exc:
        return error_response(str(exc))

    def prepare() -> list[GenerationRequest]:
        messages, prefix = body.messages, None
        last = messages[-1] if messages else {}
        if (
            body.continue_final_message
            and last.get("role") == "assistant"
            and isinstance(last.get("content"), str)
        ):
            messages, prefix = messages[:-1], last["content"]  # SGLang: the turn goes on from its text
        prompt_ids = engine.encode_chat(messages, tools.template_tools, body.chat_template_kwargs)
        if prefix:
            prompt_ids += engine.encode_continuation(prefix)
        sampling = _sampling(engine, body, body.max_new_tokens)
        if tools.template_tools is not None:
            sampling.skip_special_tokens = False  # as SGLang: tool-call markup may be special tokens
        sampling.verify()
        top = (body.top_logprobs or 0) if body.logprobs else 0
        requests = _choices(engine, prompt_ids, sampling, body, top)
        constrain_tools(engine, tools.constraint, requests)
        engine.admit(requests)
        return requests

    parsing = tools.parsing
    stream = (lambda prepared: chat_stream(engine, body, prepared, request, parsing)) if body.stream else None
    results = await _run(engine, request, prepare, stream)
    if isinstance(results, Response):
        return results
    choices = []
    for index, result in enumerate(results):
        finish, matched = finish_fields(result)
        content, calls = result.text, None
        if parsing is not None:
            content, found = parsing.parse(result.text)
            if found:
                calls = [call.as_openai(i) for i, call in enumerate(found)]
                if finish == "stop":
                    finish, matched = "tool_calls", None
        choice: dict[str, Any] = {
            "index": index,
            "message": {
                "role": "assistant",
                "content": content,
                "reasoning_content": None,
                "tool_calls": calls,
            },
            "logprobs": {"content": [chat_logprob(engine, e) for e in result.output_logprobs]}
            if body.logprobs
            else None,
            "finish_reason": finish,
            "matched_stop": matched,
        }
        if body.return_token_ids:
            choice["prompt_token_ids"] = result.prompt_ids
            choice["token_ids"] = result.output_ids
        choices.append(choice)
    return _response("chat.completion", engine, body, choices, results)


def _response(
    kind: str,
    engine: ReferenceEngine,
    body: ChatCompletionRequest | CompletionRequest,
    choices: list[dict[str, Any]],
    results: list[GenerationResult],
) -> JSONResponse:
    """The non-streaming envelope SGLang puts around chat and text completion choices."""
    return JSONResponse(
        {
            "id": uuid.uuid4().hex,
            "object": kind,
            "created": int(time.time()),
            "model": body.model,
            "choices": choices,
            "usage": usage(results, body.n, engine.args.enable_cache_report),
            "metadata": {"weight_version": results[-1].weight_version},
        }
    )


# --- text completions -----------------------------------------------------------------------------------
def _prompts(
    engine: ReferenceEngine, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[list[int]]:
    if isinstance(prompt, str):
        return [engine.encode_text(prompt)]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [engine.encode_text(p) if isinstance(p, str) else list(p) for p in prompt]  # type: ignore[union-attr]


@router.post("/v1/completions", dependencies=[Depends(require_json)])
async def completions(body: CompletionRequest, request: Request) -> Any:
    engine = _engine(request)
    note(request, model=body.model)

    def prepare() -> list[GenerationRequest]:
        sampling = _sampling(engine, body, body.max_tokens)
        sampling.verify()
        requests = []
        for prompt_ids in _prompts(engine, body.prompt):
            requests.extend(_choices(engine, prompt_ids, sampling, body, body.logprobs or 0))
        engine.admit(requests)
        return requests

    stream = (lambda prepared: completion_stream(engine, body, prepared, request)) if body.stream else None
    results = await _run(engine, request, prepare, stream)
    if isinstance(results, Response):
        return results
    choices = []
    for index, result in enumerate(results):
        finish, matched = finish_fields(result)
        choices.append(
            {
                "index": index,
                "text": result.text,
                "logprobs": completion_logprobs(engine, result.output_logprobs)
                if body.logprobs is not None
                else None,
                "finish_reason": finish,
                "matched_stop": matched,
            }
        )
    return _response("text_completion", engine, body, choices, results)


# --- models -------------------------------------------------------------------------------------------
def _card(model_id: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sglang",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    """The base model (id = served name) and every loaded adapter (`parent` = the base model)."""
    engine = _engine(request)
    base = engine.args.model_name
    cards = [_card(base, base, None, engine.context_length)]
    cards += [_card(a.name, a.path, base, None) for a in engine.adapters.adapters()]
    return JSONResponse({"object": "list", "data": cards})


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> JSONResponse:
    engine = _engine(request)
    base = engine.args.model_name
    if model == base:
        return JSONResponse(_card(base, base, None, engine.context_length))
    for adapter in engine.adapters.adapters():
        if adapter.name == model:
            return JSONResponse(_card(adapter.name, adapter.path, base, None))
    error = {
        "message": f"The model '{model}' does not exist",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    return JSONResponse({"error": error}, status_code=404)
