"""Trajectories → token sequences with a mask of the tokens the model sampled and the sampler's logprobs.

How a conversation becomes tokens (tools included, via the tokenizer's chat template):
- For each sampled Choice at position p, the prompt is the template rendering of items [:p] with
  `add_generation_prompt=True`, and the completion is what rendering items [:p+1] adds after it. The
  completion is split at the first end-of-turn token (tokenizer/generation-config EOS): the text before
  it is the sampled content, the end-of-turn token itself, then template trailer (e.g. a newline).
- Mask = 1 on the content tokens, and on the end-of-turn token when the model stopped by itself
  (finish_reason "stop" or "tool_calls"); 0 on everything else: system/user/tool messages, plain
  assistant message dicts (context, as in ART), template tokens, an end-of-turn token the model never
  sampled (finish_reason "length").
- The prompt and the sampled text are tokenized separately, as the server did when it sampled.
- A multi-turn conversation is one sequence while each prompt extends the previous rendering; a
  template that rewrites history (e.g. drops earlier reasoning) starts a new sequence at that choice.

Exact ids: a Choice that carries `token_ids` (the ids the server sampled; the gateway asks SGLang for
them with `return_token_ids`) is trained on exactly those ids, not on a re-tokenization of its text; the
template still renders the prompt, the end-of-turn token (appended by the rule above unless the ids
already end with one) and the trailer. Its logprob entries align 1:1 with the ids, a further entry being
the end-of-turn token's (validation.py has checked the count). Counted in `tokenize/exact_ids`. Choices
without ids (servers that do not return them) take the re-tokenization path below.

Constraints: a Choice carrying `art_constraint` (constraints.py; only with its ids, validation.py checks)
marks each of its sampled tokens with the constraint, which the trainer applies to their logits. A grammar
is replayed over the ids with xgrammar (grammars.py): each token gets the mask of its position. Without
xgrammar a grammar reaches here only when the user trains without it (`train_unconstrained`): dropped.
The grammar of a forced tool call (SGLang's structural tag of tool_choice "required"/named) is one of
them. A history's prompts are rendered with the tools its Choices were sampled with: their
`art_template_tools` where SGLang's template showed others than the request's (a named tool only, none for
"none"; validation.py refuses a history whose Choices differ in them).

Sampler logprobs of a choice without ids (validation.py has already checked that they spell the content). Let N be the number
of entries that spell the content and M the number of re-tokenized content tokens:
- N == M: the entries are the old logprobs of the content tokens; a trailing stop-token entry, when
  present, is the old logprob of the end-of-turn token.
- Where the server split tool calls or reasoning off the content, the text cannot be compared: N is
  all entries, less a last one for the stop token when that makes N == M.
- N != M (the sampler's tokenization of the text differs from the tokenizer's, or a tool call rendered
  by the template differs from the sampled text): re-tokenization mismatch. The choice's sampler logprobs are dropped and the
  trainer's own detached logprobs stand in (importance ratio 1 for that choice); counted in
  `tokenize/logprob_mismatch`.
- No logprobs at all (allowed only with allow_training_without_logprobs): the same stand-in, counted in
  `tokenize/no_logprobs`. Tokens without a sampler logprob carry NaN here.
Sequences of any length are returned; the trainer drops those longer than its row length (as ART).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import grammars
from ..chat_format import template_tool_calls, template_tools
from ..constraints import carried, grammars_available
from ..errors import TrainingInputError
from ..grammars import TokenConstraint
from ..token_bounds import longest_token_bytes, min_tokens
from .validation import (
    WireGroup,
    content_entry_count,
    histories,
    is_choice,
    logprob_entries,
    prompt_tools,
    sampled_ids,
    text_checkable,
)

NAN = float("nan")
_STOPPED = ("stop", "tool_calls")


@dataclass
class TokenizedSequence:
    """One sequence to train on. `old_logprobs[t]` is the sampler's logprob of `input_ids[t]` (NaN where
    unknown); `sampled_mask[t]` is 1 where the model sampled `input_ids[t]`."""

    input_ids: list[int]
    sampled_mask: list[int]
    old_logprobs: list[float]
    group: int
    trajectory: int
    advantage: float = 0.0
    weight: float = 0.0  # the trajectory's token weight (advantages.py)
    sampler_logprobs: list[float] | None = None  # set when old_logprobs were precalculated
    # Per token, the sampling constraint it was drawn under (constraints.py); None: no token has one.
    constraints: list[TokenConstraint | None] | None = None

    @property
    def num_sampled(self) -> int:
        return sum(self.sampled_mask)


def sampled_constraints(batch: list[TokenizedSequence]) -> list[TokenConstraint | None] | None:
    """The constraint of each sampled token after the first position (the tokens a forward pass scores),
    in the batch's row-major order; None when no token of the batch has one."""
    if all(s.constraints is None for s in batch):
        return None
    return [
        s.constraints[t] if s.constraints is not None else None
        for s in batch
        for t in range(1, len(s.input_ids))
        if s.sampled_mask[t]
    ]


@dataclass
class TokenizeStats:
    logprob_mismatch: int = 0
    no_logprobs: int = 0
    choices: int = 0
    exact_ids: int = 0
    constrained: int = 0
    too_long_skipped: int = 0

    def metrics(self) -> dict[str, float]:
        return {
            "tokenize/too_long_skipped": float(self.too_long_skipped),
            "tokenize/choices": float(self.choices),
            "tokenize/exact_ids": float(self.exact_ids),
            "tokenize/constrained": float(self.constrained),
            "tokenize/retokenized": float(self.choices - self.exact_ids),
            "tokenize/logprob_mismatch": float(self.logprob_mismatch),
            "tokenize/no_logprobs": float(self.no_logprobs),
        }


@dataclass
class _Builder:
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    constraints: list[TokenConstraint | None] = field(default_factory=list)
    rendered: str = ""

    def add(
        self,
        ids: list[int],
        sampled: bool,
        logprobs: list[float] | None = None,
        constraints: list[TokenConstraint | None] | None = None,
    ) -> None:
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [NAN] * len(ids)
        self.constraints += constraints if constraints is not None and sampled else [None] * len(ids)

    def sequence(self, group: int, index: int) -> TokenizedSequence:
        constrained = any(c is not None for c in self.constraints)
        return TokenizedSequence(
            self.ids,
            self.mask,
            self.logprobs,
            group,
            index,
            constraints=self.constraints if constrained else None,
        )


class ChatTokenizer:
    """Renders wire-format trajectories (see validation.py) with a Hugging Face tokenizer."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        end_of_turn_ids: list[int] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # The model's vocabulary (SGLang builds its grammar masks over it); None: the tokenizer's.
        self.vocab_size = vocab_size
        self._grammars: grammars.GrammarCompiler | None = None
        ids = end_of_turn_ids if end_of_turn_ids is not None else [tokenizer.eos_token_id]
        self.end_of_turn = {tokenizer.convert_ids_to_tokens(i): i for i in ids if i is not None}
        # The chat_template_kwargs rollouts send with every request, so training renders what sampling saw.
        self.template_kwargs = dict(template_kwargs or {})

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """The vocabulary's longest entry in UTF-8 bytes (token_bounds.py), read once: walking a
        152k-entry vocabulary took ~0.15 s of every `train` call on every rank."""
        return longest_token_bytes(self.tokenizer)

    @classmethod
    def for_model(
        cls, tokenizer: Any, model_path: str | Path, *, template_kwargs: dict[str, Any] | None = None
    ) -> ChatTokenizer:
        """End-of-turn tokens = the tokenizer's EOS plus generation_config.json's eos_token_id(s); the
        vocabulary size is config.json's."""
        ids = [tokenizer.eos_token_id]
        config = Path(model_path) / "generation_config.json"
        if config.exists():
            extra = json.loads(config.read_text()).get("eos_token_id")
            ids += extra if isinstance(extra, list) else [extra]
        model_config = Path(model_path) / "config.json"
        vocab = json.loads(model_config.read_text()).get("vocab_size") if model_config.exists() else None
        return cls(
            tokenizer,
            end_of_turn_ids=list(dict.fromkeys(i for i in ids if i is not None)),
            template_kwargs=template_kwargs,
            vocab_size=vocab if isinstance(vocab, int) else None,
        )

    def tokenize_trajectory(
        self, trajectory: WireGroup, *, group: int, index: int, stats: TokenizeStats
    ) -> list[TokenizedSequence]:
        sequences: list[TokenizedSequence] = []
        for items, tools in histories(trajectory):
            # The tools the prompts were rendered with when sampling (validation refused a mix of them
            # unless the user trains unconstrained: then the history's own).
            shown = prompt_tools(items, tools)
            rendered = shown[0] if len(shown) == 1 else tools
            try:
                sequences += self._tokenize_history(items, rendered, group, index, stats)
            except TrainingInputError:
                raise
            except Exception as exc:  # a template error names the trajectory it came from
                raise TrainingInputError(
                    f"group {group}, trajectory {index}: the chat template could not render it: {exc}"
                ) from exc
        return sequences

    def _tokenize_history(
        self, items: list[Any], tools: list[Any] | None, group: int, index: int, stats: TokenizeStats
    ) -> list[TokenizedSequence]:
        messages = [_as_message(item) for item in items]
        done: list[_Builder] = []
        current = _Builder()
        for position, item in enumerate(items):
            if not is_choice(item):
                continue
            stats.choices += 1
            prompt = self._render(messages[:position], tools, generation_prompt=True)
            full = self._render(messages[: position + 1], tools, generation_prompt=False)
            if not (current.rendered and prompt.startswith(current.rendered)):
                if current.ids:
                    done.append(current)
                current = _Builder()
            current.add(self._encode(prompt[len(current.rendered) :]), sampled=False)
            completion = full[len(prompt) :] if full.startswith(prompt) else None
            self._add_choice(current, item, completion, stats)
            current.rendered = full if completion is not None else ""
        if current.ids:
            done.append(current)
        return [b.sequence(group, index) for b in done]

    def _add_choice(
        self, builder: _Builder, choice: WireGroup, completion: str | None, stats: TokenizeStats
    ) -> None:
        content, eot, trailer = self._split_completion(choice, completion)
        exact = sampled_ids(choice)
        if exact is not None:
            self._add_exact(builder, choice, exact, eot, trailer, stats)
            return
        content_ids = self._encode(content)
        entries = logprob_entries(choice)
        content_lps: list[float] | None = None
        eot_lp = NAN
        if entries is None:
            stats.no_logprobs += 1
        else:
            count = self._entry_count(choice, entries, len(content_ids))
            if count == len(content_ids):
                content_lps = [float(e["logprob"]) for e in entries[: len(content_ids)]]
                if count is not None and count < len(entries):
                    eot_lp = float(entries[count]["logprob"])
            else:
                stats.logprob_mismatch += 1
        builder.add(content_ids, sampled=True, logprobs=content_lps)
        if eot is not None:
            stopped = choice.get("finish_reason") in _STOPPED
            builder.add([eot], sampled=stopped, logprobs=[eot_lp if stopped else NAN])
        builder.add(self._encode(trailer), sampled=False)

    def _add_exact(
        self,
        builder: _Builder,
        choice: WireGroup,
        ids: list[int],
        eot: int | None,
        trailer: str,
        stats: TokenizeStats,
    ) -> None:
        """The sampled ids as they are, their logprob entries 1:1 (a further entry is the stop token's)."""
        stats.exact_ids += 1
        steps = self._constraint_steps(choice, ids, eot, stats)
        entries = logprob_entries(choice)
        if entries is None:
            stats.no_logprobs += 1
        lps = [float(e["logprob"]) for e in entries] if entries is not None else [NAN] * (len(ids) + 1)
        builder.add(ids, sampled=True, logprobs=lps[: len(ids)], constraints=steps[: len(ids)])
        if eot is not None and not (ids and ids[-1] in self.end_of_turn.values()):
            stopped = choice.get("finish_reason") in _STOPPED
            eot_lp = lps[len(ids)] if stopped and len(lps) > len(ids) else NAN
            builder.add([eot], sampled=stopped, logprobs=[eot_lp], constraints=steps[len(ids) :])
        builder.add(self._encode(trailer), sampled=False)

    def _constraint_steps(
        self, choice: WireGroup, ids: list[int], eot: int | None, stats: TokenizeStats
    ) -> list[TokenConstraint | None]:
        """The constraint of each sampled id and of a further end-of-turn token. A constraint that does not
        allow that token means the server stopped on something else: it is trained unconstrained. A grammar
        is replayed when xgrammar is installed; otherwise validation refused it unless the user trains
        without it, and it is dropped."""
        constraint = carried(choice, "choice")
        if constraint is None:
            return [None] * (len(ids) + 1)
        stats.constrained += 1
        base = constraint.without_grammar()
        eot_step = base if base is not None and eot is not None and base.allows(eot) else None
        if constraint.grammar is None or not grammars_available():
            return [base] * len(ids) + [eot_step]
        try:
            matcher = self._grammar_compiler().matcher(constraint.grammar)
            steps: list[TokenConstraint | None] = list(grammars.replay(matcher, ids, base))
        except grammars.GrammarError as exc:
            raise TrainingInputError(f"a {constraint.grammar.kind}-constrained choice: {exc}") from exc
        end = matcher.bitmask()
        steps.append(
            grammars.GrammarStep(end, base) if eot is not None and grammars.allows(end, eot) else None
        )
        return steps

    def _grammar_compiler(self) -> grammars.GrammarCompiler:
        if self._grammars is None:
            vocab = self.vocab_size or len(self.tokenizer)
            self._grammars = grammars.GrammarCompiler(self.tokenizer, vocab, self.end_of_turn.values())
        return self._grammars

    @staticmethod
    def _entry_count(choice: WireGroup, entries: list[dict[str, Any]], tokens: int) -> int | None:
        """Entries that belong to the content. Where the text cannot be compared (tool calls, reasoning)
        the counts decide: `tokens` entries, or one more for the stop token."""
        if text_checkable(choice):
            return content_entry_count(choice, entries)
        return tokens if len(entries) in (tokens, tokens + 1) else len(entries)

    def _split_completion(self, choice: WireGroup, completion: str | None) -> tuple[str, int | None, str]:
        """(sampled text, end-of-turn token id or None, template trailer)."""
        if completion is None:
            # The template does not render the assistant turn right after its generation prompt; train the
            # raw content followed by the end-of-turn token.
            return (choice.get("message") or {}).get("content") or "", self._first_eot(), ""
        found = [(completion.find(text), text) for text in self.end_of_turn if text in completion]
        if not found:
            return completion, None, ""
        at, text = min(found)
        return completion[:at], self.end_of_turn[text], completion[at + len(text) :]

    def _first_eot(self) -> int | None:
        return next(iter(self.end_of_turn.values()), None)

    def _render(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, *, generation_prompt: bool
    ) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(
            messages,
            tools=template_tools(tools),
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **self.template_kwargs,
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []


def _as_message(item: Any) -> dict[str, Any]:
    """The chat-template form of a message or Choice: string content, and tool calls as SGLang hands
    them to the template (chat_format.py: arguments as the JSON object they encode, SGLang's key order)."""
    message = (item.get("message") or {}) if is_choice(item) else item
    out: dict[str, Any] = {**message, "content": message.get("content") or ""}
    if is_choice(item):
        out = {"role": "assistant", "content": out["content"]}
    if message.get("tool_calls"):
        out["tool_calls"] = template_tool_calls(message["tool_calls"])
    return out


def tokenize_groups(
    chat: ChatTokenizer, groups: list[WireGroup], *, max_seq_length: int | None = None
) -> tuple[list[list[list[TokenizedSequence]]], TokenizeStats]:
    """Sequences per group per trajectory (none for a trajectory without a Choice: it is context).

    With `max_seq_length`, a trajectory whose text alone cannot fit is not rendered or tokenized at all
    (it would be dropped as too long after seconds of tokenizing); it has no sequences and is counted in
    `tokenize/too_long_skipped`."""
    stats = TokenizeStats()
    longest = chat.longest_token_bytes
    out: list[list[list[TokenizedSequence]]] = []
    for gi, group in enumerate(groups):
        per_trajectory = []
        for ti, trajectory in enumerate(group["trajectories"]):
            if max_seq_length is not None and _certainly_too_long(trajectory, longest, max_seq_length):
                stats.too_long_skipped += 1
                per_trajectory.append([])
                continue
            per_trajectory.append(chat.tokenize_trajectory(trajectory, group=gi, index=ti, stats=stats))
        out.append(per_trajectory)
    return out, stats


def _certainly_too_long(trajectory: WireGroup, longest: int, max_seq_length: int) -> bool:
    """Some sequence of the trajectory needs more than `max_seq_length` tokens. The sequence that ends
    with a history's last Choice renders every message before it; earlier assistant turns are left out
    of the bound, as a template may rewrite them (e.g. drop their reasoning)."""
    for items, _ in histories(trajectory):
        last = max((i for i, item in enumerate(items) if is_choice(item)), default=None)
        if last is None:
            continue
        kept = [
            _as_message(item) for i, item in enumerate(items[: last + 1]) if i == last or not _assistant(item)
        ]
        if min_tokens(kept, longest) > max_seq_length:
            return True
    return False


def _assistant(item: Any) -> bool:
    return is_choice(item) or (isinstance(item, dict) and item.get("role") == "assistant")
