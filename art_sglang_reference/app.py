"""The FastAPI app: SGLang's native routes (`native_api`) and OpenAI routes (`openai_api`), /metrics when
enabled, SGLang's error bodies, the API-key check and the request log."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from art_sglang.serving.sglang_api import ADMIN_ROUTES

from .cli import ServerArgs
from .engine import ReferenceEngine
from .http_common import error_response
from .metrics import render_metrics
from .native_api import router as native_router
from .openai_api import router as openai_router
from .weights_api import router as weights_router

logger = logging.getLogger("art_sglang_reference")

# /health* and /metrics stay open with --api-key, as in SGLang.
_OPEN_PATHS = ("/health", "/metrics")


def _refused(request: Request, args: ServerArgs) -> int | None:
    """401 if the request lacks the key its route needs, as SGLang decides: /health* and /metrics are
    open; admin routes need the admin key if one is set, else the API key if set; every other route the
    API key if set. A key comes as `Authorization: Bearer <key>` or `x-api-key: <key>`."""
    path = request.url.path
    if request.method == "OPTIONS" or path.startswith(_OPEN_PATHS):
        return None
    needed = (args.admin_api_key or args.api_key) if path in ADMIN_ROUTES else args.api_key
    if needed is None:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = [token] if scheme.lower() == "bearer" else []
    given += [request.headers["x-api-key"]] if "x-api-key" in request.headers else []
    return None if any(secrets.compare_digest(key, needed) for key in given) else 401


def create_app(args: ServerArgs, engine: ReferenceEngine) -> FastAPI:
    app = FastAPI(title="art_sglang reference engine", openapi_url=None)
    app.state.engine = engine
    app.state.args = args
    app.state.started = time.time()
    app.include_router(openai_router)
    app.include_router(native_router)
    app.include_router(weights_router)

    @app.middleware("http")
    async def log_and_authorize(request: Request, call_next: Any) -> Response:
        started = time.perf_counter()
        status = _refused(request, args)
        if status is not None:
            _log(request, status, started)
            return JSONResponse({"error": "Unauthorized"}, status_code=status)
        response = await call_next(request)
        body = response.body_iterator

        async def logged() -> AsyncIterator[bytes]:
            try:
                async for part in body:
                    yield part
            finally:
                _log(request, response.status_code, started)

        response.body_iterator = logged()
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # SGLang turns FastAPI's 422 into 400 with this message layout.
        errors = exc.errors()
        message = f"{len(errors)} validation error{'s' if len(errors) != 1 else ''}:\n" + "\n".join(
            f"  {e}" for e in errors
        )
        return error_response(
            f"{message}\n  {request.method} {request.url.path} {errors}", 400, "Bad Request"
        )

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code, str(exc.status_code))

    if args.enable_metrics:

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse(
                render_metrics(engine, args.model_name, app.state.started),
                media_type="text/plain; version=0.0.4; charset=utf-8",
            )

    return app


def _log(request: Request, status: int, started: float) -> None:
    fields = getattr(request.state, "log_fields", {})
    extra = " ".join(f"{k}={v}" for k, v in fields.items())
    elapsed = time.perf_counter() - started
    logger.info("%s %s %d %.3fs %s", request.method, request.url.path, status, elapsed, extra)
