"""The reference engine's model: a transformers causal LM on CPU (float32) with peft adapters, a prefix
cache, and the weight operations SGLang exposes (release/resume memory, update weights from disk, from
pushed tensors or from a weight-update group, pause and continue generation).

All public methods block; the HTTP layer runs them in worker threads. One lock serialises every use of
the model, so requests run one at a time while the event loop keeps answering (e.g. /health).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from art_sglang.chat_format import template_messages, template_tools
from art_sglang.cpu_threads import limit_threads_for_small_model
from art_sglang.serving.sglang_api import KV_CACHE_TAG
from art_sglang.token_bounds import longest_token_bytes, min_tokens

from .adapters import BASE_KEY, AdapterRegistry, AdapterUses, LoadedAdapter, adapter_rank
from .cli import ServerArgs
from .constrained import biased
from .generation import FinishReason, GenerationRequest, GenerationResult, TextTracker, TokenLogprob
from .pausing import GenerationGate
from .prefix_cache import PrefixCache
from .sampling import choose_token, logprobs_of, reported_logprobs
from .update_groups import UpdateGroups
from .weight_updates import WeightUpdates, scheduler_failure
from .weights import BaseWeights, memory_tags

logger = logging.getLogger(__name__)


class EngineReleasedError(RuntimeError):
    """Generation was asked for while the weights are released (POST /resume_memory_occupation first)."""


class PromptError(ValueError):
    """The messages could not be rendered with the model's chat template."""


class RequestTooLongError(ValueError):
    """Prompt plus requested completion do not fit the context length (SGLang's message)."""


@dataclass
class EngineStats:
    """Counters behind /metrics."""

    num_requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    e2e_seconds: float = 0.0
    running: int = 0


class ReferenceEngine:
    """Model, tokenizer, adapters and caches behind the reference server."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        started = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        if args.chat_template is not None:
            self.tokenizer.chat_template = Path(args.chat_template).read_text(encoding="utf-8")
        self.hf_config = AutoConfig.from_pretrained(args.model_path)
        model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).eval()
        limit_threads_for_small_model(model)
        self.context_length = args.context_length or int(
            getattr(self.hf_config, "max_position_embeddings", 0) or 4096
        )
        self.eos_ids = self._eos_ids(model)
        self._longest_token = longest_token_bytes(self.tokenizer)
        generation = model.generation_config
        self._sampling_defaults = {
            key: getattr(generation, key)
            for key in ("temperature", "top_p", "top_k", "min_p")
            if getattr(generation, key, None) is not None and key in generation.to_diff_dict()
        }
        max_rank = args.max_lora_rank
        if max_rank is None and args.lora_paths:
            # SGLang infers the pool's rank from the adapters given at launch.
            max_rank = max(adapter_rank(p) for p in args.lora_paths.values())
        self.adapters = AdapterRegistry(
            model,
            enabled=args.enable_lora or bool(args.lora_paths),
            max_rank=max_rank,
            target_modules=args.lora_target_modules,
            max_loaded=args.max_loaded_loras,
        )
        self.adapter_uses = AdapterUses()
        self.prefix_cache = PrefixCache(
            enabled=not args.disable_radix_cache, max_tokens=args.max_total_tokens
        )
        self.stats = EngineStats()
        self.weights = BaseWeights(
            self.adapters.base, args.model_path, cpu_backup=args.enable_weights_cpu_backup
        )
        self.load_seconds = time.perf_counter() - started
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        # Fast tokenizers are not safe to use from two threads at once ("Already borrowed").
        self._tokenizer_lock = threading.Lock()
        # A plain flag, not a threading.Event: shutdown() runs in a signal handler, and Event.set() takes a
        # lock that a second signal arriving inside the first handler would wait on forever.
        self._shutting_down = False
        self.gate = GenerationGate(self._lock, lambda: self._shutting_down)
        self.updates = WeightUpdates(self._lock, self.weights, self.gate, self.prefix_cache, UpdateGroups())
        for name, path in args.lora_paths.items():
            self.adapters.load(name, path)

    def _eos_ids(self, model: torch.nn.Module) -> set[int]:
        ids: set[int] = set()
        for source in (model.generation_config.eos_token_id, self.hf_config.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # --- state -------------------------------------------------------------------------------------
    @property
    def released(self) -> bool:
        return bool(self.weights.released)

    @property
    def weight_version(self) -> str:
        return self.weights.version

    @property
    def weights_path(self) -> str:
        return self.weights.path

    @property
    def busy(self) -> bool:
        return self.stats.running > 0

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        with self._stats_lock:
            self.stats.running += 1
        try:
            yield
        finally:
            with self._stats_lock:
                self.stats.running -= 1

    # --- prompts -----------------------------------------------------------------------------------
    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any] | None,
    ) -> list[int]:
        """Token ids of the chat template applied to `messages`, ending with the assistant's turn. Text
        that cannot fit the context whatever its tokens is refused before it is tokenized."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise PromptError("The model has no chat template; use /v1/completions or /generate.")
        self._check_text_fits(messages)
        try:
            with self._tokenizer_lock:
                # SGLang renders its own dumps of the request's tools and tool calls (chat_format.py).
                ids = self.tokenizer.apply_chat_template(
                    template_messages(messages), tools=template_tools(tools), add_generation_prompt=True,
                    tokenize=True, return_dict=False, **(kwargs or {}),
                )  # fmt: skip
        except Exception as exc:  # jinja and tokenizer errors alike mean "these messages do not render"
            raise PromptError(f"Failed to apply the chat template: {exc}") from exc
        return list(ids)

    def _check_text_fits(self, messages: list[Any]) -> None:
        at_least = min_tokens(messages, self._longest_token)
        if at_least >= self.context_length:
            raise RequestTooLongError(
                f"The input (at least {at_least} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )

    def encode_text(self, text: str) -> list[int]:
        self._check_text_fits([text])
        with self._tokenizer_lock:
            return list(self.tokenizer(text).input_ids)

    def encode_continuation(self, text: str) -> list[int]:
        """Ids of an assistant turn's text that the model goes on from (`continue_final_message`), as SGLang
        encodes it: the tokenizer's encoding less a leading BOS."""
        with self._tokenizer_lock:
            ids = list(self.tokenizer.encode(text))
        return ids[1:] if ids and ids[0] == self.tokenizer.bos_token_id else ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def count_tokens(self, text: str) -> int:
        """Tokens of `text` alone (no special tokens added), as SGLang measures a stop string."""
        with self._tokenizer_lock:
            return len(self.tokenizer.encode(text, add_special_tokens=False))

    def sampling_defaults(self) -> dict[str, Any]:
        """Defaults from the model's generation_config.json (SGLang's `--sampling-defaults model`)."""
        return dict(self._sampling_defaults)

    # --- generation --------------------------------------------------------------------------------
    def check_length(self, prompt_len: int, max_new_tokens: int | None) -> None:
        """SGLang's context-length checks, raised before any work is done."""
        if prompt_len >= self.context_length:
            raise RequestTooLongError(
                f"The input ({prompt_len} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )
        if max_new_tokens is not None and prompt_len + max_new_tokens >= self.context_length:
            raise RequestTooLongError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_length} tokens. You requested a total of {prompt_len + max_new_tokens} "
                f"tokens: {prompt_len} tokens from the input messages and {max_new_tokens} tokens for the "
                "completion. Please reduce the number of tokens in the input messages or the completion "
                "to fit within the limit."
            )

    def admit(self, requests: list[GenerationRequest]) -> None:
        """SGLang's admission: the adapter counts of the choices first, then the length checks, so a
        request they refuse keeps its counts (`AdapterUses`)."""
        self.adapter_uses.take([r.adapter_name for r in requests])
        for request in requests:
            self.check_length(len(request.prompt_ids), request.sampling.max_new_tokens)

    def generate(self, request: GenerationRequest) -> GenerationResult:
        if not request.prompt_ids:
            raise ValueError("The input is empty: give at least one token or a non-empty text.")
        request.sampling.verify()
        self.check_length(len(request.prompt_ids), request.sampling.max_new_tokens)
        with self._running(), self.gate.admitted(request), self._lock:
            self.gate.wait_open(request)  # arriving while paused: waits, as in SGLang's tokenizer manager
            if self.weights.released:
                raise EngineReleasedError(
                    "The engine's memory is released; POST /resume_memory_occupation before generating."
                )
            started = time.time()
            result = self._generate_locked(request, started)
        with self._stats_lock:
            self.stats.num_requests += 1
            self.stats.prompt_tokens += len(result.prompt_ids)
            self.stats.generation_tokens += len(result.output_ids)
            self.stats.cached_tokens += result.cached_tokens
            self.stats.e2e_seconds += result.finished - result.started
        return result

    def _logprob_entry(self, logprobs: torch.Tensor, token_id: int, top: int) -> TokenLogprob:
        entry = TokenLogprob(token_id, float(logprobs[token_id]))
        if top > 0:
            values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
            entry.top = [(int(i), float(v)) for v, i in zip(values, ids, strict=True)]
        return entry

    @torch.inference_mode()
    def _generate_locked(self, request: GenerationRequest, started: float) -> GenerationResult:
        prompt = request.prompt_ids
        options = request.sampling
        adapter = self.adapters.resolve(request.adapter_name)
        cache_key = adapter.key if adapter else BASE_KEY
        # At least the last prompt token is recomputed (its logits start generation); prompt logprobs
        # from position s need the logits of position s-1.
        limit = len(prompt) - 1
        if request.input_logprob_start is not None:
            limit = min(limit, max(request.input_logprob_start - 1, 0))
        cached, kv = self.prefix_cache.lookup(cache_key, prompt, limit)
        if kv is None:
            kv = DynamicCache(config=self.hf_config)
        max_new = options.max_new_tokens
        if max_new is None:
            max_new = self.context_length - len(prompt)
        generator = None
        if options.seed is not None and not options.greedy:
            generator = torch.Generator().manual_seed(options.seed)
        # SGLang's ignore_eos turns off stop_token_ids too (schedule_batch.py `_check_token_based_finish`).
        stop_ids = set() if options.ignore_eos else set(options.stop_token_ids) | self.eos_ids
        tracker = TextTracker(self, options, stop_ids)
        output_ids: list[int] = []
        output_logprobs: list[TokenLogprob] = []
        input_logprobs: list[TokenLogprob | None] = []

        with self.adapters.activate(adapter) as model:
            logits = self._forward_one_by_one(model, prompt[cached:], kv)
            if request.input_logprob_start is not None:
                start = max(request.input_logprob_start, 0)
                prompt_lp = logprobs_of(logits, options)
                for pos in range(start, len(prompt)):
                    row = pos - 1 - cached
                    input_logprobs.append(
                        None if pos == 0 else self._logprob_entry(prompt_lp[row], prompt[pos], 0)
                    )
            next_logits = logits[-1]
            finish = FinishReason("length", length=0)
            while len(output_ids) < max_new:
                if self._shutting_down or (request.abort is not None and request.abort.is_set()):
                    finish = FinishReason("abort")
                    break
                if options.logit_bias:
                    next_logits = biased(next_logits, options.logit_bias)
                if request.grammar is not None:
                    # Masked before the logprobs, as SGLang applies a grammar's mask to the logits.
                    allowed = request.grammar.mask(stop_ids)
                    if not allowed.any():  # complete, and no end-of-sequence token may end it
                        finish = FinishReason("stop", matched=None)
                        break
                    next_logits = next_logits.masked_fill(~allowed[: next_logits.shape[-1]], float("-inf"))
                sampled = logprobs_of(next_logits, options)
                token = choose_token(sampled, options, generator)
                if request.grammar is not None:
                    request.grammar.advance(token)
                logprobs = reported_logprobs(next_logits, sampled, options)
                entry = self._logprob_entry(logprobs, token, request.top_logprobs)
                output_ids.append(token)
                output_logprobs.append(entry)
                delta, ended = tracker.push(token, at_limit=len(output_ids) >= max_new)
                self._emit(request, delta, entry)
                if ended is not None:
                    finish = ended
                    break
                if self.gate.hold(request) == "retract":  # recomputed by the weights loaded now
                    kv = DynamicCache(config=self.hf_config)
                    next_logits = self._forward_one_by_one(model, prompt + output_ids, kv)[-1]
                    continue
                next_logits = model(
                    input_ids=torch.tensor([[token]]), past_key_values=kv, use_cache=True
                ).logits[0, -1]

        rest, text = tracker.finish()
        if rest:
            self._emit(request, rest, None)
        sequence = prompt + output_ids
        self.prefix_cache.insert(cache_key, sequence[: kv.get_seq_length()], kv)
        return GenerationResult(
            prompt_ids=list(prompt),
            output_ids=output_ids,
            text=text,
            finish=finish,
            output_logprobs=output_logprobs,
            input_logprobs=input_logprobs,
            cached_tokens=cached,
            adapter=adapter,
            started=started,
            finished=time.time(),
            weight_version=self.weights.version,
        )

    @staticmethod
    def _forward_one_by_one(model: torch.nn.Module, tokens: list[int], kv: DynamicCache) -> torch.Tensor:
        """The logits of `tokens` after `kv`, computed one token at a time, as decoding does. A forward over
        several tokens rounds differently from one token at a time, and how much of a prompt the cache
        holds depends on which requests finished first: computed alike at every position, a request's
        output does not depend on request timing, so runs with the same seeds are identical."""
        rows = [
            model(input_ids=torch.tensor([[t]]), past_key_values=kv, use_cache=True).logits[0] for t in tokens
        ]
        return torch.cat(rows)

    @staticmethod
    def _emit(request: GenerationRequest, delta: str, entry: TokenLogprob | None) -> None:
        if request.on_delta is not None:
            request.on_delta(delta, entry)

    def token_text(self, token_id: int) -> str:
        """A token's text as SGLang shows it in logprobs (partial UTF-8 decodes to U+FFFD)."""
        return self.decode([token_id], skip_special_tokens=False)

    def shutdown(self) -> None:
        """Make generations in flight stop at their next token (the server is exiting). Signal-safe."""
        self._shutting_down = True

    # --- adapters ----------------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str) -> LoadedAdapter:
        with self.adapter_uses.update_lock, self._lock:
            return self.adapters.load(name, path)

    def resolve_adapter(self, name: str | None) -> LoadedAdapter | None:
        """The adapter a request names, reloaded if it was unloaded (see `AdapterRegistry.resolve`)."""
        with self._lock:
            return self.adapters.resolve(name)

    def unload_adapter(self, name: str) -> None:
        """As SGLang: a name not loaded is refused at once; else wait until no request counts on it
        (`AdapterUses`), loads waiting meanwhile, then unload."""
        with self.adapter_uses.update_lock:
            if name in self.adapters.loaded:
                self.adapter_uses.wait_unused(name, lambda: self._shutting_down)
            with self._lock:
                adapter = self.adapters.unload(name)
                self.prefix_cache.drop_adapter(adapter.key)

    # --- caches and weights ------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        """Clear the prefix cache; like SGLang, refuse (False) while requests are running."""
        if self.busy:
            return False
        self.prefix_cache.clear()
        return True

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Release what `tags` names, as SGLang does ("kv_cache", "weights"; none = both). Without
        --enable-memory-saver this does nothing (as SGLang). "kv_cache" clears the prefix cache; "weights"
        drops the base weights — with --enable-weights-cpu-backup they are kept in RAM for resume (on CPU
        the backup is the weights themselves), without it they are re-read from disk on resume.
        Generation while anything is released is refused (503). Called while a request runs, the engine
        exits, as SGLang's does."""
        wanted = memory_tags(tags)
        if self.busy:
            # SGLang 0.5.17's scheduler asserts it is idle here and dies with the whole server, so the
            # caller sees the connection dropped; a backend that releases under load must fail here too.
            scheduler_failure(
                AssertionError("release_memory_occupation should be called only when server is idle.")
            )
        with self._lock:
            if not self.args.enable_memory_saver:
                logger.info("release_memory_occupation: nothing to release without --enable-memory-saver")
                return
            if KV_CACHE_TAG in self.weights.release(wanted):
                self.prefix_cache.clear()
            gc.collect()

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take back what `tags` names (none = everything): weights from the backup, else from disk."""
        wanted = memory_tags(tags)
        with self._lock:
            self.weights.resume(wanted)

    def model_bytes(self) -> int:
        return self.weights.nbytes()
