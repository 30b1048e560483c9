"""Adapters SGLang can no longer unload, as the gateway sees them.

SGLang 0.5.17 counts a request against its adapter before checking the request's length, and gives the
count back only when a request finishes generating. A request it refuses for its length (`LENGTH_REFUSALS`:
a multi-turn conversation that outgrew the context, or prompt + `max_tokens` over it) therefore keeps the
adapter in use for good: `/unload_lora_adapter` of that adapter then waits forever while holding the lock
every later `/load_lora_adapter` takes, so the next training step could never be served. The gateway
notes each such refusal here; the adapter side leaves a stranded adapter loaded (unrouted) instead of
unloading it, and restarts a server that would have to unload one (after a weights release).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from ..sglang_api import LENGTH_REFUSALS


def strands_adapter(status: int, body: bytes) -> bool:
    """Whether an answer from SGLang is a length refusal, which strands the adapter the request named."""
    return status == 400 and any(refusal in body for refusal in LENGTH_REFUSALS)


class StrandedAdapters:
    """The names a length-refused request asked for (written by the gateway's thread, read by the backend's)."""

    def __init__(self) -> None:
        self._names: set[str] = set()
        self._lock = threading.Lock()

    def note(self, names: Iterable[str], status: int, body: bytes) -> None:
        """Record `names` if the server's answer (`status`, `body`) to a request for them strands them."""
        if strands_adapter(status, body):
            with self._lock:
                self._names.update(names)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._names

    def clear(self) -> None:
        """No server holds a stranded adapter any more (the only server was restarted)."""
        with self._lock:
            self._names.clear()
