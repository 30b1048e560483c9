"""SGLang 0.5.17's routes for replacing weights while serving, as a router: pushed tensors, a weight-update
group and its broadcasts, pausing and continuing generation, and the reported weight version. Bodies and
answers are SGLang's (http_server.py, io_struct.py); /update_weights_from_disk is with the native routes."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from .engine import ReferenceEngine
from .http_common import note
from .schemas import (
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
)
from .update_groups import GroupTransfer
from .weights import WeightsLoadError

router = APIRouter()
T = TypeVar("T")
# These routes run on threads of their own: requests a pause holds each wait in a thread of the default
# pool, and with as many held as it has threads a pool-run update or continue would never start (SGLang's
# tokenizer manager holds them without a thread each, so it answers these routes however many wait).
_CONTROL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="weights-control")


async def _off_loop(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(
        _CONTROL, functools.partial(call, *args, **kwargs)
    )


def _engine(request: Request) -> ReferenceEngine:
    return request.app.state.engine


Engine = Annotated[ReferenceEngine, Depends(_engine)]


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(
    body: UpdateWeightsFromTensorRequest, request: Request, engine: Engine
) -> JSONResponse:
    note(request, load_format=body.load_format, version=body.weight_version)
    if body.abort_all_requests:
        engine.gate.abort_all()
    try:
        await _off_loop(
            engine.updates.from_tensor,
            body.serialized_named_tensors[0],  # this server's only tensor-parallel rank
            body.load_format,
            body.weight_version,
            flush_cache=body.flush_cache,
        )
    except WeightsLoadError as exc:
        return _result(False, str(exc))
    return _result(True, _with_version("Success", body.weight_version))


@router.post("/init_weights_update_group")
async def init_weights_update_group(
    body: InitWeightsUpdateGroupRequest, request: Request, engine: Engine
) -> JSONResponse:
    note(request, group=body.group_name, rank=body.rank_offset, world=body.world_size)
    try:
        await _off_loop(
            engine.updates.groups.join,
            body.master_address,
            body.master_port,
            body.rank_offset,
            body.world_size,
            body.group_name,
            body.backend,
        )
    except Exception as exc:  # torch's rendezvous and backends raise many types; SGLang answers with any
        return _result(False, f"Failed to initialize custom process group: {exc}.")
    return _result(True, "Succeeded to initialize custom process group.")


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(
    body: DestroyWeightsUpdateGroupRequest, engine: Engine
) -> JSONResponse:
    if not await _off_loop(engine.updates.groups.leave, body.group_name):
        return _result(False, "The group to be destroyed does not exist.")
    return _result(True, "Succeeded to destroy custom process group.")


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(
    body: UpdateWeightsFromDistributedRequest, request: Request, engine: Engine
) -> JSONResponse:
    note(request, group=body.group_name, tensors=len(body.names), version=body.weight_version)
    if body.abort_all_requests:
        engine.gate.abort_all()
    transfer = GroupTransfer(body.group_name, body.names, body.dtypes, body.shapes, body.load_format)
    try:
        await _off_loop(
            engine.updates.from_group, transfer, body.weight_version, flush_cache=body.flush_cache
        )
    except WeightsLoadError as exc:
        return _result(False, str(exc))
    return _result(True, _with_version("Succeeded to update parameter online.", body.weight_version))


@router.post("/pause_generation")
async def pause_generation(body: PauseGenerationRequest, request: Request, engine: Engine) -> JSONResponse:
    note(request, mode=body.mode)
    await _off_loop(engine.gate.pause, body.mode)
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
async def continue_generation(body: ContinueGenerationRequest, engine: Engine) -> JSONResponse:
    await _off_loop(engine.gate.resume)
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


@router.post("/update_weight_version")
async def update_weight_version(body: UpdateWeightVersionRequest, engine: Engine) -> JSONResponse:
    if body.abort_all_requests:
        engine.gate.abort_all()
    engine.updates.set_version(body.new_version)
    content = {
        "success": True,
        "message": f"Weight version updated to {body.new_version}",
        "new_version": body.new_version,
    }
    return JSONResponse(content)


def _with_version(message: str, version: str | None) -> str:
    return message if version is None else f"{message} Weight version updated to {version}."


def _result(success: bool, message: str) -> JSONResponse:
    return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)
