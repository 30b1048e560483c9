"""LoRA adapters loaded at run time with peft, several at once, chosen per request.

Each adapter gets an internal peft name (`lora_<n>`), so served names may hold any character and a name
loaded again gets a fresh key (the prefix cache never mixes the old and new weights). Not thread-safe:
the engine calls it under its model lock.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel

BASE_KEY = "base"

# SGLang serves fused projections; a target list naming the fused module covers its parts.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class AdapterError(ValueError):
    """Loading or unloading an adapter failed; the message is the one returned to the client."""


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    path: str
    key: str
    rank: int


def _read_adapter_config(path: str) -> dict:
    config_file = Path(path) / "adapter_config.json"
    if not Path(path).is_dir():
        raise AdapterError(
            f"LoRA adapter path {path!r} does not exist or is not a directory "
            "(the reference engine loads adapters from local directories only)."
        )
    if not config_file.is_file():
        raise AdapterError(f"LoRA adapter path {path!r} has no adapter_config.json.")
    try:
        return json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"LoRA adapter config {str(config_file)!r} is unreadable: {exc}") from exc


class AdapterUses:
    """SGLang 0.5.17's count of the requests using each adapter (its LoRA registry's counters).

    A request takes one count per choice when it is admitted, before the context-length checks; each
    sub-request that finishes gives one back, and with `n > 1` the prefill-only copy SGLang sends first is
    one more. An unload waits until the count is zero, holding the lock every load takes too. So a request
    refused for its length keeps its counts, and `n > 1` gives back one more than it took: the count never
    returns to zero, that adapter's unload waits forever and every later load waits behind it. The
    reference engine keeps the same books so the backend's guard is tested against the same behaviour.
    """

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._changed = threading.Condition()
        self.update_lock = threading.Lock()  # SGLang's lora_update_lock: loads and unloads, one at a time

    def take(self, names: list[str | None]) -> None:
        """Count one use of each adapter named (None: the base model) as requests are admitted."""
        with self._changed:
            self._counts.update(name for name in names if name)

    def give_back(self, names: list[str | None], prefill_copy: bool) -> None:
        """One count back per sub-request that ended; with `prefill_copy` (n > 1) one more, for the
        prefill-only copy."""
        used = [name for name in names if name]
        with self._changed:
            self._counts.subtract(used + used[:1] if prefill_copy else used)
            self._changed.notify_all()

    def wait_unused(self, name: str, stop: Callable[[], bool]) -> None:
        """Wait until no request counts on `name` (or `stop()` says the server is exiting)."""
        with self._changed:
            while self._counts[name] != 0 and not stop():
                self._changed.wait(0.5)
            self._counts.pop(name, None)


def adapter_rank(path: str) -> int:
    """The LoRA rank `r` of the adapter at `path`."""
    return int(_read_adapter_config(path).get("r", 0))


class AdapterRegistry:
    """The adapters loaded on one base model, by served name (insertion order kept)."""

    def __init__(
        self,
        base: torch.nn.Module,
        *,
        enabled: bool,
        max_rank: int | None,
        target_modules: list[str] | None,
        max_loaded: int | None,
    ) -> None:
        self.base = base
        self.enabled = enabled
        self.max_rank = max_rank
        self.targets = self._expand_targets(target_modules)
        self.max_loaded = max_loaded
        self._peft: PeftModel | None = None
        self._adapters: dict[str, LoadedAdapter] = {}
        # Every name ever loaded -> its path: SGLang reloads an unloaded adapter a request names.
        self._known: dict[str, str] = {}
        self._keys = itertools.count()

    @staticmethod
    def _expand_targets(names: list[str] | None) -> set[str] | None:
        """None means any module ('all' or unset)."""
        if not names or "all" in names:
            return None
        expanded: set[str] = set()
        for name in names:
            expanded.update(_FUSED.get(name, (name,)))
        return expanded

    @property
    def loaded(self) -> dict[str, str]:
        """Served name -> path, as SGLang's `loaded_adapters`."""
        return {a.name: a.path for a in self._adapters.values()}

    def adapters(self) -> list[LoadedAdapter]:
        return list(self._adapters.values())

    def resolve(self, name: str | None) -> LoadedAdapter | None:
        """The adapter called `name`; None (no name) means the base model.

        As SGLang 0.5.17 does, a name that was loaded once and unloaded since is loaded again from its
        path; a name never loaded is an error, with SGLang's message.
        """
        if not name:
            return None
        if not self.enabled:
            raise AdapterError(
                f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server "
                "with --enable-lora flag or specify adapters with --lora-paths."
            )
        adapter = self._adapters.get(name)
        if adapter is not None:
            return adapter
        if name not in self._known:
            raise AdapterError(
                f"Got LoRA adapter that has never been loaded: {name}\n"
                f"All loaded adapters: dict_keys({list(self._known)!r})."
            )
        try:
            return self.load(name, self._known[name])
        except AdapterError as exc:
            raise AdapterError(f"Failed to implicitly load LoRA adapter {name}: {exc}") from exc

    def _incompatible(self, name: str, rank: int) -> AdapterError:
        return AdapterError(
            f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool "
            "configuration. Please ensure that the LoRA adapter's rank is within the configured "
            "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
        )

    def load(self, name: str, path: str) -> LoadedAdapter:
        if not self.enabled:
            raise AdapterError("LoRA is not enabled. Please set `--enable-lora` to True.")
        if name in self._adapters:
            raise AdapterError(f"Failed to load LoRA adapter {name} because it is already loaded")
        if self.max_loaded is not None and len(self._adapters) >= self.max_loaded:
            raise AdapterError(
                f"Failed to load LoRA adapter {name}: {self.max_loaded} adapters are loaded, the "
                "maximum set by `--max-loaded-loras`. Unload one first."
            )
        config = _read_adapter_config(path)
        if config.get("peft_type", "LORA") != "LORA":
            raise AdapterError(f"Adapter at {path!r} is {config.get('peft_type')}, not a LoRA adapter.")
        rank = int(config.get("r", 0))
        targets = config.get("target_modules") or []
        if self.max_rank is not None and rank > self.max_rank:
            raise self._incompatible(name, rank)
        if self.targets is not None and (isinstance(targets, str) or not set(targets) <= self.targets):
            raise self._incompatible(name, rank)
        adapter = LoadedAdapter(name=name, path=path, key=f"lora_{next(self._keys)}", rank=rank)
        try:
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(self.base, path, adapter_name=adapter.key)
            else:
                self._peft.load_adapter(path, adapter_name=adapter.key)
        except Exception as exc:  # peft raises many types for a broken adapter; all mean "cannot load"
            raise AdapterError(f"Failed to load LoRA adapter {name} from {path!r}: {exc}") from exc
        self._peft.eval()
        self._adapters[name] = adapter
        self._known[name] = path
        return adapter

    def unload(self, name: str) -> LoadedAdapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            # SGLang's message, repr included, so clients matching on it behave the same.
            raise AdapterError(
                f"LoRA with name {name} does not exist. Loaded LoRAs: odict_keys({list(self._adapters)!r})"
            )
        assert self._peft is not None
        if len(self._adapters) == 1:
            # peft cannot run with zero adapters registered; unwrap back to the plain base model.
            self.base = self._peft.unload()
            self._peft = None
        else:
            self._peft.delete_adapter(adapter.key)
        del self._adapters[name]
        return adapter

    @contextmanager
    def activate(self, adapter: LoadedAdapter | None) -> Iterator[torch.nn.Module]:
        """The module to run for `adapter` (None: the base model with all adapters off)."""
        if self._peft is None:
            yield self.base
        elif adapter is None:
            # disable_adapter() consults the active adapter's config, so make sure one is active.
            self._peft.set_adapter(next(iter(self._adapters.values())).key)
            with self._peft.disable_adapter():
                yield self._peft
        else:
            self._peft.set_adapter(adapter.key)
            yield self._peft
