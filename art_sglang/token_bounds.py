"""A cheap lower bound on the token count of a conversation, to refuse an over-long one before the
tokenizer spends seconds (a 50 MB message took 49 s) on text that can never fit.

No token of a vocabulary covers more bytes than its longest entry's UTF-8 spelling (byte-level BPE and
SentencePiece entries spell each byte with at least one byte), so `bytes // longest_entry` tokens at
least are needed for the text alone; chat templates only add tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def longest_token_bytes(tokenizer: Any) -> int:
    """UTF-8 length of the longest vocabulary entry (added tokens included)."""
    return max((len(entry.encode("utf-8")) for entry in tokenizer.get_vocab()), default=1) or 1


def content_bytes(messages: Iterable[Any]) -> int:
    """UTF-8 bytes of the messages' content (strings and text parts): what every chat template renders.
    Other fields (tool schemas, names, reasoning) are not counted, as a template may leave them out."""
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else message
        parts = content if isinstance(content, list) else [content]
        for part in parts:
            text = part.get("text") if isinstance(part, dict) else part
            if isinstance(text, str):
                total += len(text.encode("utf-8", errors="replace"))
    return total


def min_tokens(messages: Iterable[Any], longest: int) -> int:
    """At least this many tokens are needed to encode the messages' content (a message may also be a
    plain string: a text prompt)."""
    return content_bytes(messages) // max(longest, 1)
