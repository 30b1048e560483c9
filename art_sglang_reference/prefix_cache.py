"""A small prefix cache: KV caches of recent sequences, per adapter, reused by longest common prefix.

It stands in for SGLang's radix cache so `cached_tokens` is truthful: a hit really skips recomputing
the shared prefix. Entries are evicted least-recently-used beyond a token budget.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass

from transformers import DynamicCache


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    kv: DynamicCache


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Recent KV caches keyed by (adapter key, token ids); `enabled=False` makes every lookup a miss."""

    def __init__(self, *, enabled: bool, max_tokens: int = 65536) -> None:
        self.enabled = enabled
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], _Entry] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def lookup(self, adapter_key: str, tokens: list[int], limit: int) -> tuple[int, DynamicCache | None]:
        """The longest cached prefix of `tokens` (at most `limit` tokens) and a private copy of its KV."""
        if not self.enabled or limit <= 0:
            return 0, None
        with self._lock:
            best_key, best_len = None, 0
            for key, entry in self._entries.items():
                if key[0] != adapter_key:
                    continue
                length = min(_common_prefix(entry.tokens, tokens), limit)
                if length > best_len:
                    best_key, best_len = key, length
            if best_key is None:
                return 0, None
            self._entries.move_to_end(best_key)
            entry = self._entries[best_key]
            kv = copy.deepcopy(entry.kv)
        kv.crop(best_len - kv.get_seq_length())
        return best_len, kv

    def insert(self, adapter_key: str, tokens: list[int], kv: DynamicCache) -> None:
        """Remember `kv`, which holds the keys/values of exactly `tokens`."""
        if not self.enabled or not tokens or kv.get_seq_length() != len(tokens):
            return
        key = (adapter_key, tuple(tokens))
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= len(old.tokens)
            self._entries[key] = _Entry(key[1], kv)
            self._tokens += len(tokens)
            while self._tokens > self.max_tokens and len(self._entries) > 1:
                _, evicted = self._entries.popitem(last=False)
                self._tokens -= len(evicted.tokens)

    def drop_adapter(self, adapter_key: str) -> None:
        with self._lock:
            for key in [k for k in self._entries if k[0] == adapter_key]:
                self._tokens -= len(self._entries.pop(key).tokens)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._tokens = 0

    @property
    def cached_tokens(self) -> int:
        return self._tokens
