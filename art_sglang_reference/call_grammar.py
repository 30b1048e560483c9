"""Constrained decoding for `tool_choice="required"` and a named tool_choice, as SGLang 0.5.17 does it:
the completion is forced to be a JSON array of calls, `[{"name": <a tool's name>, "parameters": {...}}]`
(at least one; exactly one of the named tool for a named choice), which the chat route then returns as
`tool_calls` instead of parsing `<tool_call>` markup.

SGLang compiles the JSON schema of that array (with each tool's parameter schema) to a grammar; here a
small pushdown automaton over characters accepts the same arrays in `json.dumps` spelling (`": "` and
`", "` separators, no other whitespace) with "parameters" any JSON object — the tools' parameter schemas
are not enforced. At every step the tokens whose text would leave the language are masked, and the end of
sequence is allowed only once the array is closed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# A parse state: a tuple of frames, innermost last. Each frame is (kind, position, detail).
State = tuple[tuple[str, int, str], ...]

_CALL_KEYS = ('{"name": ', ', "parameters": ')
_HEX = "0123456789abcdefABCDEF"
_LITERALS = ("true", "false", "null")
_MAX_DEPTH = 16  # nesting of the parameters object; deeper output is cut off by the mask


class CallGrammar:
    """Which next tokens keep a completion inside the calls language. `names`: the tools that may be
    called; `max_calls`: 1 for a named tool_choice, None for "required"."""

    def __init__(self, names: Sequence[str], max_calls: int | None, token_texts: Sequence[str]) -> None:
        self._names = ['"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"' for name in names]
        self._max_calls = max_calls
        self._token_texts = token_texts
        self.state: State | None = (("calls", 0, "0"),)

    def mask(self, eos_ids: set[int]) -> torch.Tensor:
        """True for every token allowed next (the end-of-sequence ids once the array is complete)."""
        allowed = torch.zeros(len(self._token_texts), dtype=torch.bool)
        if self.state is None:
            return allowed
        done = self.state == (("calls", 4, ""),)
        for token, text in enumerate(self._token_texts):
            if token in eos_ids:
                allowed[token] = done
            elif text and not done and self._advance(self.state, text) is not None:
                allowed[token] = True
        return allowed

    def accept(self, text: str) -> None:
        """Move past a chosen token's text."""
        if self.state is not None:
            self.state = self._advance(self.state, text)

    def advance(self, token: int) -> None:
        """Move past a chosen token."""
        self.accept(self._token_texts[token])

    def _advance(self, state: State, text: str) -> State | None:
        for char in text:
            next_state = self._step(state, char)
            if next_state is None:
                return None
            state = next_state
        return state

    def _step(self, state: State, char: str) -> State | None:
        """The state after `char`, or None if `char` leaves the language."""
        if not state:
            return None
        *outer, (kind, position, detail) = state
        base = tuple(outer)
        if kind == "calls":  # 0: "[" expected; 1: in a call; 2: ", " or "]"; 3: " " of ", "; 4: done
            count = int(detail or 0)
            if position == 0 and char == "[":
                return (*base, ("calls", 1, str(count)), ("lit", 0, _CALL_KEYS[0]))
            if position == 2 and char == ",":
                if self._max_calls is not None and count >= self._max_calls:
                    return None
                return (*base, ("calls", 3, str(count)))
            if position == 3 and char == " ":
                return (*base, ("calls", 1, str(count)), ("lit", 0, _CALL_KEYS[0]))
            if position == 2 and char == "]":
                return (*base, ("calls", 4, ""))
            return None
        if kind == "lit":  # a fixed text; `detail` is the text, `position` how much of it is matched
            if detail[position] != char:
                return None
            if position + 1 < len(detail):
                return (*base, ("lit", position + 1, detail))
            return self._after_literal(base, detail)
        if kind == "name":  # `detail`: the name literal typed so far
            typed = detail + char
            if typed in self._names:
                return (*base, ("lit", 0, _CALL_KEYS[1]))
            if any(name.startswith(typed) for name in self._names):
                return (*base, ("name", 0, typed))
            return None
        if kind == "end":  # the closing "}" of a call
            if char != "}":
                return None
            *rest, (_, _, count) = base
            return (*rest, ("calls", 2, str(int(count) + 1)))
        return self._step_value(base, kind, position, detail, char)

    def _after_literal(self, base: State, text: str) -> State:
        if text == _CALL_KEYS[0]:
            return (*base, ("name", 0, ""))
        if text == _CALL_KEYS[1]:
            return (*base, ("end", 0, ""), ("value", 0, "object"))
        if text in _LITERALS:  # the literal was a value
            return self._close(base)
        return base  # a separator (": ", ", "): what it separates comes next

    # --- a JSON value in json.dumps spelling -----------------------------------------------------------
    def _step_value(self, base: State, kind: str, position: int, detail: str, char: str) -> State | None:
        if kind == "value":  # a value starts; `detail` "object" allows only an object
            if char in "{[" and len(base) > _MAX_DEPTH:
                return None
            if char == "{":
                return (*base, ("obj", 0, ""))
            if detail == "object":
                return None
            if char == "[":
                return (*base, ("arr", 0, ""))
            if char == '"':
                return (*base, ("str", 0, ""))
            if char == "-" or char.isdigit():
                return (
                    (*base, ("num", 0, "")) if char == "-" else (*base, ("num", 1 if char == "0" else 2, ""))
                )
            for literal in _LITERALS:
                if literal[0] == char:
                    return (*base, ("lit", 1, literal))
            return None
        if kind == "obj":  # 0: key or "}"; 1: in a key; 2: ", " or "}"; 3: a key after ", "
            if position in (0, 3) and char == '"':
                return (*base, ("obj", 1, ""), ("str", 0, ""))
            if position in (0, 2) and char == "}":
                return self._close(base)
            if position == 2 and char == ",":
                return (*base, ("obj", 3, ""), ("lit", 1, ", "))
            return None
        if kind == "arr":  # 0: value or "]"; 2: ", " or "]"
            if position == 0 and char == "]":
                return self._close(base)
            if position == 0:
                return self._step((*base, ("arr", 2, ""), ("value", 0, "")), char)
            if position == 2 and char == "]":
                return self._close(base)
            if position == 2 and char == ",":
                return (*base, ("arr", 2, ""), ("value", 0, ""), ("lit", 1, ", "))
            return None
        if kind == "str":  # 0: inside; 1: after a backslash; 2..5: hex digits of \\u
            if position == 0:
                if char == '"':
                    return self._close(base)
                if char == "\\":
                    return (*base, ("str", 1, ""))
                return None if ord(char) < 0x20 else (*base, ("str", 0, ""))
            if position == 1:
                if char == "u":
                    return (*base, ("str", 2, ""))
                return (*base, ("str", 0, "")) if char in '"\\/bfnrt' else None
            if char not in _HEX:
                return None
            return (*base, ("str", 0 if position == 5 else position + 1, ""))
        if kind == "num":
            return self._step_number(base, position, char)
        return None

    def _close(self, base: State) -> State:
        """A value (or key) ended; `base` is what contained it. After an object's key come ": " and its
        value; every other container already waits for what follows a value (", ", "]", "}")."""
        *rest, (kind, position, detail) = base
        if kind == "obj" and position == 1:
            return (*rest, ("obj", 2, detail), ("value", 0, ""), ("lit", 0, ": "))
        return base

    def _step_number(self, base: State, position: int, char: str) -> State | None:
        # 0: after "-"; 1: after a leading 0; 2: integer digits; 3: after "."; 4: fraction digits;
        # 5: after "e"; 6: after the exponent's sign; 7: exponent digits. 1, 2, 4, 7 may end the number.
        moves = {
            0: {"0": 1, **dict.fromkeys("123456789", 2)},
            1: {".": 3, "e": 5, "E": 5},
            2: {**dict.fromkeys("0123456789", 2), ".": 3, "e": 5, "E": 5},
            3: dict.fromkeys("0123456789", 4),
            4: {**dict.fromkeys("0123456789", 4), "e": 5, "E": 5},
            5: {**dict.fromkeys("0123456789", 7), "+": 6, "-": 6},
            6: dict.fromkeys("0123456789", 7),
            7: dict.fromkeys("0123456789", 7),
        }
        if char in moves[position]:
            return (*base, ("num", moves[position][char], ""))
        if position in (1, 2, 4, 7):
            return self._step(self._close(base), char)
        return None
