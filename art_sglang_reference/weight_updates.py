"""Weight updates while serving, as SGLang 0.5.17's scheduler runs them: from a checkpoint directory
(`/update_weights_from_disk`), from pushed tensors (`/update_weights_from_tensor`) and from a broadcast in a
weight-update group (`/update_weights_from_distributed`). Each runs with no decode step beside it (while
not paused, after the requests already admitted have finished), flushes the prefix cache unless told not
to, and only then sets the version the server reports.

What SGLang answers with an error leaves the server up; what raises inside its scheduler ends the server
(`scheduler_failure`): an unreadable payload or a tensor of the wrong shape pushed, a group never joined, a
cache flush while a pause holds requests.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Callable
from typing import NoReturn

from art_sglang import named_tensors
from art_sglang.named_tensors import LoadFormat

from .pausing import GenerationGate
from .prefix_cache import PrefixCache
from .update_groups import GroupTransfer, UpdateGroups
from .weights import BaseWeights, WeightShapeError, WeightsLoadError

logger = logging.getLogger(__name__)


def scheduler_failure(exc: BaseException) -> NoReturn:
    """End the server as an exception in SGLang 0.5.17's scheduler does (it logs the error and the whole
    server exits): the caller sees its connection dropped, as it would on SGLang."""
    logger.error("Scheduler hit an exception: %s: %s", type(exc).__name__, exc)
    os._exit(1)


class WeightUpdates:
    """The engine's weight-update commands over its model lock, base weights, pause gate and cache."""

    def __init__(
        self,
        model_lock: threading.Lock,
        weights: BaseWeights,
        gate: GenerationGate,
        prefix_cache: PrefixCache,
        groups: UpdateGroups,
    ) -> None:
        self._lock = model_lock
        self._weights = weights
        self._gate = gate
        self._prefix_cache = prefix_cache
        self.groups = groups

    def from_disk(self, path: str, weight_version: str | None, *, flush_cache: bool = True) -> None:
        """Replace every weight with the checkpoint at `path` (WeightsLoadError: nothing changed)."""
        self._update(lambda: self._weights.load_directory(path), weight_version, flush_cache)

    def from_tensor(
        self, payload: bytes, load_format: LoadFormat, weight_version: str | None, *, flush_cache: bool
    ) -> None:
        """Load one `serialized_named_tensors` entry; the tensors loaded before a bad one stay."""

        def load() -> None:
            try:
                self._weights.load_tensors(named_tensors.deserialize(payload, load_format))
            except (named_tensors.PayloadError, WeightShapeError) as exc:
                scheduler_failure(exc)

        self._update(load, weight_version, flush_cache)

    def from_group(self, transfer: GroupTransfer, weight_version: str | None, *, flush_cache: bool) -> None:
        """Receive `transfer`'s tensors from rank 0 of its group and load them. A failure raises
        WeightsLoadError with SGLang's words (the weights may be partly updated)."""

        def load() -> None:
            if transfer.group_name not in self.groups:
                scheduler_failure(
                    AssertionError(
                        f"Group {transfer.group_name} not in {self.groups.names()}. "
                        "Please call `init_weights_update_group` first."
                    )
                )
            try:
                self._weights.load_tensors(self.groups.receive(transfer))
            except Exception as exc:  # SGLang catches everything here and answers with it
                raise WeightsLoadError(
                    f"Failed to update parameter online: {exc}. The full weights of the ModelRunner are "
                    "partially updated. Please discard the whole weights."
                ) from exc

        self._update(load, weight_version, flush_cache)

    def set_version(self, version: str) -> None:
        """SGLang's /update_weight_version: only the reported version changes."""
        self._weights.version = version

    def _update(self, load: Callable[[], None], weight_version: str | None, flush_cache: bool) -> None:
        # Unpaused, the update waits for the requests admitted before it (SGLang's writer lock); paused,
        # held requests have given the model lock up.
        with self._gate.exclusive(), self._lock:
            load()
            if flush_cache:
                if self._gate.held:
                    scheduler_failure(AssertionError("Cache flush failed after updating weights"))
                self._prefix_cache.clear()
            if weight_version is not None:
                self._weights.version = weight_version
            gc.collect()
