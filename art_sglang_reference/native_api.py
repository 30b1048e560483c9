"""SGLang's native routes of the reference engine (health, info, /generate, adapters, cache, memory,
weights) as a router, beside the OpenAI routes of `openai_api`."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from art_sglang.serving.choice_count import generate_choice_count

from .adapters import AdapterError
from .cli import ServerArgs
from .engine import ReferenceEngine
from .generation import GenerationRequest, GenerationResult, TokenLogprob
from .http_common import (
    Delta,
    engine_error_body,
    engine_error_response,
    error_response,
    note,
    note_results,
    run_generations,
    sse,
    stream_generations,
)
from .sampling import SamplingOptions, StopRegexError
from .schemas import (
    GenerateRequest,
    LoadLoRARequest,
    MemoryOccupationRequest,
    UnloadLoRARequest,
    UpdateWeightsFromDiskRequest,
    string_list,
)
from .weights import WeightsLoadError

logger = logging.getLogger("art_sglang_reference")

SGLANG_VERSION = "0.5.17"  # the release whose HTTP API this engine speaks
FLUSH_MESSAGE = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)

router = APIRouter()


def _engine(request: Request) -> ReferenceEngine:
    return request.app.state.engine


def _args(request: Request) -> ServerArgs:
    return request.app.state.args


Engine = Annotated[ReferenceEngine, Depends(_engine)]
Args = Annotated[ServerArgs, Depends(_args)]


# --- health and info ---------------------------------------------------------------------------
@router.get("/health")
async def health(engine: Engine) -> Response:
    """SGLang 0.5.17's /health is its /health_generate (a one-token generation, so a running
    request). While memory is released this answers 200 without generating; SGLang's answer there is
    not recorded."""
    if engine.released:
        return Response(status_code=200)
    return await health_generate(engine)


@router.get("/health_generate")
async def health_generate(engine: Engine) -> Response:
    """Generate one token unless requests are already running (then they prove health)."""
    if engine.released:
        return Response(status_code=503)
    if engine.busy:
        return Response(status_code=200)
    probe = GenerationRequest([0], SamplingOptions(max_new_tokens=1, temperature=0.0))
    try:
        await asyncio.to_thread(engine.generate, probe)
    except Exception:
        logger.exception("health_generate failed")
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(engine: Engine, args: Args) -> dict[str, Any]:
    return {
        "model_path": args.model_path,
        "tokenizer_path": args.tokenizer_path or args.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(engine.hf_config, "model_type", None),
        "architectures": getattr(engine.hf_config, "architectures", None),
    }


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(engine: Engine, args: Args) -> dict[str, Any]:
    flags = args.model_dump(exclude={"ignored_args"})
    # SGLang shows both keys as they are; the reference engine only says whether they are set.
    for key in ("api_key", "admin_api_key"):
        flags[key] = None if flags[key] is None else "<set>"
    flags["tokenizer_path"] = args.tokenizer_path or args.model_path
    flags["served_model_name"] = args.model_name
    flags["lora_paths"] = [f"{name}={path}" for name, path in args.lora_paths.items()]
    state = {
        "engine": "reference",
        "weights_path": engine.weights_path,
        "memory_released": engine.released,
        "loaded_adapters": engine.adapters.loaded,
        "prefix_cache_tokens": engine.prefix_cache.cached_tokens,
        "running_requests": engine.stats.running,
    }
    return {
        **flags,
        "max_total_num_tokens": engine.prefix_cache.max_tokens,
        "max_req_input_len": engine.context_length - 1,
        "status": "ready",
        "weight_version": engine.weight_version,
        "internal_states": [state],
        "version": SGLANG_VERSION,
    }


@router.get("/get_weight_version")
@router.get("/weight_version")
async def weight_version() -> JSONResponse:
    return error_response(
        "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use '/model_info' instead.",
        404,
        "404",
    )


# --- generation --------------------------------------------------------------------------------
@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(body: GenerateRequest, request: Request, engine: Engine) -> Any:
    note(request, model=body.lora_path or "base")
    start = body.logprob_start_len if body.return_logprob and body.logprob_start_len >= 0 else None
    try:
        prompts, batch = _generate_prompts(engine, body)
        n = generate_choice_count(body.sampling_params)
        samplings = _prompt_sampling(body.sampling_params, len(prompts))
        for sampling in samplings:
            sampling.verify()
        await asyncio.to_thread(engine.resolve_adapter, body.lora_path)
        requests = []
        for prompt_ids, sampling in zip(prompts, samplings, strict=True):
            for i in range(n):
                options = SamplingOptions(**{**vars(sampling), "stop": list(sampling.stop)})
                if sampling.seed is not None:
                    options.seed = sampling.seed + i
                requests.append(
                    GenerationRequest(
                        prompt_ids,
                        options,
                        adapter_name=body.lora_path,
                        top_logprobs=body.top_logprobs_num,
                        input_logprob_start=start,
                        parallel=n > 1,
                    )
                )
        engine.admit(requests)
    except (TypeError, ValueError) as exc:
        return error_response(str(exc))
    except StopRegexError:
        # SGLang 0.5.17 lets this exception escape its /generate route: the web server answers a plain-text
        # 500 and closes the connection (seen on an H200, 2026-11-27: the client's next request on that
        # kept-alive connection was reset). Raising it here does the same (its stream has already said
        # 200 on SGLang and then breaks off).
        raise
    rids = [body.rid or uuid.uuid4().hex for _ in requests]
    if body.stream:
        return StreamingResponse(
            _generate_stream(engine, body, requests, rids, request), media_type="text/event-stream"
        )
    try:
        results = await run_generations(engine, requests)
    except Exception as exc:
        return engine_error_response(exc)
    note_results(request, results)
    outputs = [_generate_output(engine, body, r, rid) for r, rid in zip(results, rids, strict=True)]
    return JSONResponse(outputs if batch or n > 1 else outputs[0])


async def _generate_stream(
    engine: ReferenceEngine,
    body: GenerateRequest,
    requests: list[GenerationRequest],
    rids: list[str],
    request: Request,
) -> AsyncIterator[str]:
    """SGLang's native stream: each event carries the whole output so far."""
    texts = [""] * len(requests)
    ids: list[list[int]] = [[] for _ in requests]
    results = []
    try:
        async for item in stream_generations(engine, requests):
            i = item.index
            if isinstance(item, Delta):
                texts[i] += item.text
                entry: TokenLogprob | None = item.logprob
                if entry is not None:
                    ids[i].append(entry.token_id)
                if not item.text:
                    continue
                meta = {"id": rids[i], "finish_reason": None, "completion_tokens": len(ids[i])}
                yield sse({"text": texts[i], "output_ids": list(ids[i]), "meta_info": meta, "index": i})
                continue
            results.append(item.result)
            yield sse({**_generate_output(engine, body, item.result, rids[i]), "index": i})
    except Exception as exc:
        yield sse({"error": {"message": engine_error_body(exc)["message"]}})
    note_results(request, results)
    yield "data: [DONE]\n\n"


# --- adapters ----------------------------------------------------------------------------------
@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRARequest, request: Request, engine: Engine) -> JSONResponse:
    note(request, lora=body.lora_name, path=body.lora_path)
    try:
        await asyncio.to_thread(engine.load_adapter, body.lora_name, body.lora_path)
    except AdapterError as exc:
        return _lora_result(False, str(exc), engine.adapters.loaded)
    return _lora_result(True, "", engine.adapters.loaded)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRARequest, request: Request, engine: Engine) -> JSONResponse:
    note(request, lora=body.lora_name)
    try:
        await asyncio.to_thread(engine.unload_adapter, body.lora_name)
    except AdapterError as exc:
        return _lora_result(False, str(exc), None)
    return _lora_result(True, "", engine.adapters.loaded)


# --- cache, memory, weights --------------------------------------------------------------------
@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(engine: Engine) -> Response:
    # SGLang answers 200 with this text whether or not it could flush (it refuses while busy).
    if not engine.flush_cache():
        logger.info("flush_cache not performed: requests are running")
    return Response(content=FLUSH_MESSAGE, status_code=200)


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(request: Request, engine: Engine) -> JSONResponse:
    return await _memory_call(request, engine.release_memory)


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(request: Request, engine: Engine) -> JSONResponse:
    return await _memory_call(request, engine.resume_memory)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(
    body: UpdateWeightsFromDiskRequest, request: Request, engine: Engine
) -> JSONResponse:
    note(request, path=body.model_path)
    try:
        await asyncio.to_thread(
            engine.updates.from_disk, body.model_path, body.weight_version, flush_cache=body.flush_cache
        )
    except WeightsLoadError as exc:
        content = {"success": False, "message": str(exc), "num_paused_requests": 0}
        return JSONResponse(content, status_code=400)
    message = "Succeeded to update model weights."
    if body.weight_version is not None:
        message += f" Weight version updated to {body.weight_version}."
    return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})


def _prompt_sampling(
    params: dict[str, Any] | list[dict[str, Any]] | None, prompts: int
) -> list[SamplingOptions]:
    """The sampling options of each prompt: one `sampling_params` dict for all, or a list with one each."""
    if not isinstance(params, list):
        return [_native_sampling(params or {}) for _ in range(prompts)]
    if len(params) != prompts:
        raise ValueError(f"sampling_params has {len(params)} entries for a batch of {prompts} prompts")
    return [_native_sampling(p) for p in params]


def _native_sampling(params: dict[str, Any]) -> SamplingOptions:
    """SGLang's `sampling_params` dict -> options (its `n` is read by `generate_choice_count`). Keys this
    engine does not implement are ignored."""
    fields = {
        "max_new_tokens": params.get("max_new_tokens", 128),
        "temperature": float(params.get("temperature", 1.0)),
        "top_p": float(params.get("top_p", 1.0)),
        "top_k": int(params.get("top_k", -1)),
        "min_p": float(params.get("min_p", 0.0)),
        "stop": string_list(params.get("stop")),
        "stop_regex": string_list(params.get("stop_regex")),
        "stop_token_ids": list(params.get("stop_token_ids") or []),
        "ignore_eos": bool(params.get("ignore_eos", False)),
        "skip_special_tokens": bool(params.get("skip_special_tokens", True)),
        "no_stop_trim": bool(params.get("no_stop_trim", False)),
        "seed": params.get("sampling_seed", params.get("seed")),
    }
    if fields["max_new_tokens"] is not None:
        fields["max_new_tokens"] = int(fields["max_new_tokens"])
    return SamplingOptions(**fields)


def _generate_prompts(engine: ReferenceEngine, body: GenerateRequest) -> tuple[list[list[int]], bool]:
    """(token ids of each prompt, whether the request was a batch)."""
    if body.input_ids is not None:
        if body.input_ids and isinstance(body.input_ids[0], list):
            return [list(p) for p in body.input_ids], True  # type: ignore[arg-type]
        return [list(body.input_ids)], False  # type: ignore[arg-type]
    if body.text is not None:
        if isinstance(body.text, list):
            return [engine.encode_text(t) for t in body.text], True
        return [engine.encode_text(body.text)], False
    raise ValueError("Either text, input_ids or input_embeds should be provided.")


def _logprob_triples(engine: ReferenceEngine, entries: list[Any], with_text: bool) -> list[list[Any]]:
    def text(token_id: int) -> str | None:
        return engine.token_text(token_id) if with_text else None

    return [[e[0], e[1], text(e[1])] for e in entries]


def _generate_output(
    engine: ReferenceEngine, body: GenerateRequest, result: GenerationResult, rid: str
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": result.finish.as_sglang(),
        "prompt_tokens": len(result.prompt_ids),
        "weight_version": result.weight_version,
        "num_retractions": 0,
    }
    if body.return_logprob:
        start = max(body.logprob_start_len, 0)
        inputs = [
            (e.logprob if e is not None else None, result.prompt_ids[start + i])
            for i, e in enumerate(result.input_logprobs)
        ]
        outputs = [(e.logprob, e.token_id) for e in result.output_logprobs]
        meta["input_token_logprobs"] = _logprob_triples(engine, inputs, body.return_text_in_logprobs)
        meta["output_token_logprobs"] = _logprob_triples(engine, outputs, body.return_text_in_logprobs)
        meta["output_token_logprobs_length"] = len(outputs)
        if body.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [
                _logprob_triples(engine, [(lp, i) for i, lp in e.top], body.return_text_in_logprobs)
                for e in result.output_logprobs
            ]
    cached = result.cached_tokens
    meta.update(
        {
            "reasoning_tokens": 0,
            "completion_tokens": len(result.output_ids),
            "cached_tokens": cached,
            "cached_tokens_details": {"device": cached, "host": 0} if cached else None,
            "e2e_latency": result.finished - result.started,
        }
    )
    return {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}


async def _memory_call(request: Request, call: Callable[[list[str] | None], None]) -> JSONResponse:
    """Release/resume with the request's optional `tags` (a GET or an empty body means all memory)."""
    raw = await request.body()
    try:
        tags = MemoryOccupationRequest.model_validate_json(raw).tags if raw.strip() else None
        await asyncio.to_thread(call, tags)
    except Exception as exc:
        return engine_error_response(exc)
    return JSONResponse(None)


def _lora_result(success: bool, message: str, loaded: dict[str, str] | None) -> JSONResponse:
    content = {
        "rid": None,
        "http_worker_ipc": None,
        "success": success,
        "error_message": message,
        "loaded_adapters": loaded,
    }
    return JSONResponse(content, status_code=200 if success else 400)
