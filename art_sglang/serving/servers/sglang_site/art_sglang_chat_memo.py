"""The `chat-template-memo` backport (art_sglang_backports.py): SGLang's HTTP process turns each chat request's
messages into prompt ids with the chat template and the tokenizer, one request after another on its event loop
(~2.3 ms of tokenizing for a 1,100-token prompt on CPU). A GRPO group sends the same messages for each of its
rollouts, so this memo keeps the ids of recent text-only prompts and hands a copy to the group's later requests.

Only SGLang's own Jinja path is memoised (`OpenAIServingChat._apply_jinja_template` with no custom encoder and a
text-only model; the same method and call on 0.5.17 and 0.5.23); the key holds every input that path reads
(see `template_inputs`). Imports nothing of art_sglang and no SGLang.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

# Distinct prompts kept: a whole wave's prompts (up to 256 groups) stay in even when the group's requests
# arrive round-robin (every group's first rollout, then every group's second, ...).
MEMO_SIZE = 256
_PLAIN_LEAVES = (str, int, float, bool, type(None))


def _plain(value: Any) -> bool:
    """Whether `value` is JSON-shaped data (str-keyed dicts, lists, tuples, scalars), whose repr says all of it."""
    if isinstance(value, _PLAIN_LEAVES):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _plain(item) for key, item in value.items())
    return False


def memo_key(inputs: dict[str, Any]) -> str | None:
    """The memo's key for a prompt's `inputs` (plain data), None where any input is not plain data (not
    memoised). Equal keys only for equal inputs: repr keeps dict order (templates render in that order) and
    tells tuples from lists, 1 from True and 1 from '1'."""
    return repr(inputs) if _plain(inputs) else None


class PromptMemo:
    """Least-recently-used memo of prompt ids and the result that carried them, at most `size` entries."""

    def __init__(self, size: int = MEMO_SIZE) -> None:
        self._size = size
        self._entries: OrderedDict[str, tuple[tuple[int, ...], Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> tuple[tuple[int, ...], Any] | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key: str, ids: tuple[int, ...], result: Any) -> None:
        self._entries[key] = (ids, result)
        self._entries.move_to_end(key)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)


def template_inputs(chat: Any, request: Any, tools: list[dict] | None) -> dict[str, Any]:
    """Everything SGLang's Jinja path (0.5.17 to 0.5.23) reads to make the prompt ids: the tokenizer and its
    template, the template's content format, the request's messages as dumped, the tools it passes, the
    template kwargs, the reasoning effort, whether the last assistant message is continued, and the
    generation-prompt / special-token switches newer releases read (None where a release lacks them).
    Server-wide settings a request cannot change (default template kwargs, reasoning config) are merged
    into the request or fixed for the process."""
    tokenizer = chat.tokenizer_manager.tokenizer
    return {
        "tokenizer": id(tokenizer),
        "chat_template": tokenizer.chat_template,
        "content_format": chat.template_manager.jinja_template_content_format,
        "messages": [message.model_dump() for message in request.messages],
        "tools": tools,
        "chat_template_kwargs": request.chat_template_kwargs,
        "reasoning_effort": request.reasoning_effort,
        "continue_final_message": request.continue_final_message,
        "add_generation_prompt": getattr(request, "_format_add_generation_prompt", None),
        "add_special_tokens": getattr(request, "_format_add_special_tokens", None),
    }


_MEMO = PromptMemo()


def _text_only(result: Any) -> bool:
    return (
        isinstance(result.prompt_ids, list)
        and not result.prompt
        and result.image_data is None
        and result.audio_data is None
        and result.video_data is None
        and not result.modalities
    )


def memoised_jinja_template(
    original: Callable[..., Any], chat: Any, request: Any, tools: list[dict] | None, is_multimodal: bool
) -> Any:
    """AROUND hook of `OpenAIServingChat._apply_jinja_template`: the memo's copy where it holds the prompt,
    else SGLang's own result (memoised when text-only). Errors are never memoised."""
    # A custom encoder (0.5.17's chat_encoding_spec, 0.5.23's encoding adapter too) or a model that takes
    # media: SGLang's own path, whose inputs this key does not hold.
    if is_multimodal or chat.chat_encoding_spec is not None or getattr(chat, "_encoding_adapter", None):
        return original(chat, request, tools, is_multimodal)
    key = memo_key(template_inputs(chat, request, tools))
    found = _MEMO.get(key) if key is not None else None
    if found is not None:
        ids, kept = found
        # A fresh result: the caller sets its stop, constraint and reasoning fields and may extend the ids.
        return dataclasses.replace(kept, prompt_ids=list(ids), stop=request.stop, modalities=[])
    result = original(chat, request, tools, is_multimodal)
    if key is not None and _text_only(result):
        _MEMO.put(key, tuple(result.prompt_ids), dataclasses.replace(result, prompt_ids=[], modalities=[]))
    return result
