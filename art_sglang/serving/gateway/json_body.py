"""The JSON of an answer the gateway reads whole and writes back (its choices annotated for training): a
1,024-token answer with logprobs is ~140 kB, and in merged mode every answer is read and written so. The
standard library took 5.5 ms for the pair, orjson 1.5 ms (2026-11-28, this project's CPU), on the gateway's
thread, which shares the GIL with the user's rollouts."""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(body: bytes) -> Any:
    """`body` parsed; ValueError where it is not JSON. NaN and ±Infinity, which orjson refuses and Python
    servers may write, are read by the standard library."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body)


def dumps(value: Any) -> bytes:
    """`value` as compact JSON (a float NaN or ±Infinity becomes null, as SGLang writes them)."""
    return orjson.dumps(value)
