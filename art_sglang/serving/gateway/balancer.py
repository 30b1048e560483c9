"""`ReplicaChoice`: which server replica the gateway sends a request to.

Why the gateway chooses and SGLang's router does not: sglang-router 0.3.2 re-encodes chat and `/generate`
requests into its own types and leaves out the fields those lack, `return_token_ids` among them (the ids
the trainer trains on exactly), `stop_regex` and `logit_bias` too. So the gateway sends requests to the
replicas itself. The router stays in front of them for clients without the gateway, and as the health
authority: a replica is added to it only once it holds every served adapter and taken out before it
stops (`set_routed` follows that), and the replicas its health checks find failing are passed over
(`set_healthy`) within a second or two of their failure.

What the choice keeps of the router's cache-aware policy:
- requests of one prompt that arrive together (a GRPO group, with its prefill-only request) go where the
  first went, whatever the load: the prompt is computed there once (`PROMPT_MEMORY_S`);
- a conversation stays on its replica: requests with the same `affinity_key` (the model and the messages
  up to the first user message, which the next turn repeats) go where the last one went, unless that
  replica has more than `LOAD_BOUND` times its share of the requests in flight;
- anything else goes to the replica with the fewest requests in flight.
"""

from __future__ import annotations

import json
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from math import ceil

from .prefill_sharing import PROMPT_MEMORY_S
from .rules import Forward

# A conversation moves off its replica only when that one has more than this times its share of the
# requests in flight: moving costs computing its whole prefix again on the other replica.
LOAD_BOUND = 1.5
# Conversations remembered (least recently used forgotten first): a few bytes each.
MAX_AFFINITIES = 65_536
# A text prompt's affinity is its start (its turns cannot be told apart): these many characters or ids.
AFFINITY_PREFIX = 2048
# A replica whose connection was refused is passed over this long (the health checks take it out too).
UNREACHABLE_S = 2.0


class ReplicaChoice:
    """Picks a replica among the routed ones that are healthy; counts the requests in flight on each.
    Runs on the gateway's event loop; `set_routed`/`set_healthy` may be called from any thread (each
    replaces one immutable value)."""

    def __init__(self, routed: Sequence[str] = (), *, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._routed: tuple[str, ...] = tuple(routed)
        self._healthy: frozenset[str] | None = None  # None: not known, every routed replica counts
        self._unreachable: dict[str, float] = {}  # replica -> until when it is passed over
        self._load: Counter[str] = Counter()
        self._groups: OrderedDict[str, tuple[str, float]] = OrderedDict()  # prompt -> (replica, last use)
        self._affinities: OrderedDict[str, str] = OrderedDict()  # conversation -> replica
        self._turn = 0  # rotates ties between equally loaded replicas

    @property
    def routed(self) -> tuple[str, ...]:
        return self._routed

    def set_routed(self, urls: Iterable[str]) -> None:
        """The replicas requests may go to from now on (a replica about to stop is left out first)."""
        self._routed = tuple(urls)

    def set_healthy(self, urls: Iterable[str] | None) -> None:
        """The routed replicas whose health checks pass (None: not known)."""
        self._healthy = None if urls is None else frozenset(urls)

    def unreachable(self, url: str) -> None:
        """A connection to `url` was refused: pass it over for a while."""
        self._unreachable[url] = self._clock() + UNREACHABLE_S

    def load(self, url: str) -> int:
        """Requests in flight on `url`."""
        return self._load[url]

    def pick(self, group: str | None, affinity: str | None, avoid: Collection[str] = ()) -> str | None:
        """The replica for a request of prompt `group` and conversation `affinity` (either None: not
        known), never one in `avoid`; None when no replica is left. The request counts in flight on it
        until `done`."""
        candidates = [url for url in self._candidates() if url not in avoid]
        if not candidates:
            return None
        now = self._clock()
        self._forget_groups_before(now - PROMPT_MEMORY_S)
        chosen = None
        if group is not None and group in self._groups:
            replica, _ = self._groups[group]
            chosen = replica if replica in candidates else None
        if chosen is None and affinity is not None:
            replica = self._affinities.get(affinity)
            if replica in candidates and self._load[replica] + 1 <= self._bound(candidates):
                chosen = replica
        if chosen is None:
            self._turn += 1
            start = self._turn % len(candidates)
            rotated = candidates[start:] + candidates[:start]
            chosen = min(rotated, key=lambda url: self._load[url])
        if group is not None:
            self._groups.pop(group, None)
            self._groups[group] = (chosen, now)
        if affinity is not None:
            self._affinities.pop(affinity, None)
            self._affinities[affinity] = chosen
            if len(self._affinities) > MAX_AFFINITIES:
                self._affinities.popitem(last=False)
        self._load[chosen] += 1
        return chosen

    def done(self, url: str) -> None:
        """A request `pick` sent to `url` is over."""
        self._load[url] -= 1
        if self._load[url] <= 0:
            del self._load[url]

    def _candidates(self) -> list[str]:
        routed, healthy = self._routed, self._healthy
        now = self._clock()
        live = [url for url in routed if healthy is None or url in healthy] or list(routed)
        reachable = [url for url in live if self._unreachable.get(url, 0.0) <= now]
        # Every one refused lately: try them anyway (one may be back; the caller paces its tries).
        return reachable or live

    def _bound(self, candidates: Sequence[str]) -> float:
        in_flight = sum(self._load[url] for url in candidates)
        return ceil(LOAD_BOUND * (in_flight + 1) / len(candidates))

    def _forget_groups_before(self, horizon: float) -> None:
        while self._groups:
            _, (_, used) = next(iter(self._groups.items()))
            if used >= horizon:
                return
            self._groups.popitem(last=False)


def affinity_key(decision: Forward) -> str | None:
    """What the turns of one conversation share: the model (and adapter) with the chat messages up to the
    first user message, or the first `AFFINITY_PREFIX` characters (ids) of a text (token) prompt. None
    for a request without one (a read, a batch of prompts)."""
    payload = decision.payload
    if decision.read or payload is None:
        return None
    start: object
    messages = payload.get("messages")
    if isinstance(messages, list):
        first_user = next(
            (n for n, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), 0
        )
        start = messages[: first_user + 1]
    else:
        prompt = payload.get("prompt", payload.get("text", payload.get("input_ids")))
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not _ids(prompt)):
            return None
        start = prompt[:AFFINITY_PREFIX]
    named = [payload.get("model"), payload.get("lora_path")]
    return json.dumps([named, start], sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _ids(prompt: list) -> bool:
    return all(type(item) is int for item in prompt)
