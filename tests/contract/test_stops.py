"""Where an answer stops, as SGLang 0.5.17 decides it: stop strings and `stop_regex` are looked for only in
the text of the last tokens (a stop string's canonical token count + 1, a regex's length bound + 1), the
text is cut at the first occurrence of what matched, a stream holds back the start of a stop string but
not of a regex, and stop tokens come after the length limit and are off with ignore_eos.

The forced answers are deterministic on any model: a regex allows only FORCED, and +100 on the tokens of
one spelling makes the one allowed biased token win each step."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest
from contract_helpers import chat, parse_sse

from art_sglang.serving.servers.process import ServerProcess

STOP = "</tool_call>"
FORCED = "cool" + STOP
ANY_CHARACTER = r"[\s\S]"  # matches the first token's text, whatever the model writes

needs_grammars = pytest.mark.usefixtures("grammars")


def _bias(tokenizer: Any, pieces: list[str]) -> dict[str, int]:
    """logit_bias that makes a FORCED answer come in `pieces` (each one token). Checked here: at each step
    exactly one biased token fits what is left of FORCED."""
    ids = {}
    for piece in pieces:
        (ids[piece],) = tokenizer.encode(piece, add_special_tokens=False)
    rest = FORCED
    for piece in pieces:
        assert [p for p in ids if rest.startswith(p)] == [piece], (rest, pieces)
        rest = rest[len(piece) :]
    assert not rest
    return {str(token): 100 for token in ids.values()}


def canonical(tokenizer: Any) -> dict[str, int]:
    return _bias(
        tokenizer, [tokenizer.decode([t]) for t in tokenizer.encode(FORCED, add_special_tokens=False)]
    )


def characters(tokenizer: Any) -> dict[str, int]:
    # In single characters the stop takes more tokens than its window: 12 against 6 + 1 here.
    assert len(tokenizer.encode(STOP, add_special_tokens=False)) + 1 < len(STOP)
    return _bias(tokenizer, list(FORCED))


def forced(client: httpx.Client, bias: dict[str, int], **body: Any) -> dict[str, Any]:
    """The choice of a greedy chat answer held to FORCED and spelled as `bias` says."""
    response = chat(client, regex=FORCED, logit_bias=bias, max_tokens=32, **body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def outcome(choice: dict[str, Any]) -> tuple[str, Any, str]:
    return choice["finish_reason"], choice["matched_stop"], choice["message"]["content"]


def streamed_content(client: httpx.Client, bias: dict[str, int], **body: Any) -> str:
    response = chat(client, regex=FORCED, logit_bias=bias, max_tokens=32, stream=True, **body)
    assert response.status_code == 200, response.text
    chunks = [event for event in parse_sse(response.text) if event != "[DONE]"]
    return "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)


@needs_grammars
def test_a_stop_string_is_seen_only_within_its_token_count_plus_one(
    client: httpx.Client, model_tokenizer: Any
) -> None:
    """Spelled in its canonical tokens the stop is found and cut off. Spelled in single characters it never
    lies within the last 7 tokens, so it is missed and the answer ends at the grammar's end (a stop token).
    A stop_regex beside it widens the window to one token per character, and it is found again."""
    assert outcome(forced(client, canonical(model_tokenizer), stop=[STOP])) == ("stop", STOP, "cool")
    finish, matched, content = outcome(forced(client, characters(model_tokenizer), stop=[STOP]))
    assert (finish, content) == ("stop", FORCED) and isinstance(matched, int), (finish, matched, content)
    widened = forced(client, characters(model_tokenizer), stop=[STOP], stop_regex=[STOP])
    assert outcome(widened) == ("stop", STOP, "cool")


@needs_grammars
def test_a_stop_regex_ends_the_answer_which_is_cut_only_where_the_pattern_is_spelled(
    client: httpx.Client, model_tokenizer: Any
) -> None:
    """`matched_stop` is the pattern, and SGLang cuts the text at the first occurrence of the pattern's own
    text: a literal pattern is cut off, a pattern that matches other text leaves the answer whole."""
    bias = characters(model_tokenizer)
    assert outcome(forced(client, bias, stop_regex=STOP)) == ("stop", STOP, "cool")
    pattern = r"</tool_\w+>"
    assert outcome(forced(client, bias, stop_regex=[pattern])) == ("stop", pattern, FORCED)


@needs_grammars
def test_a_stream_holds_back_the_start_of_a_stop_string_but_not_of_a_stop_regex(
    client: httpx.Client, model_tokenizer: Any
) -> None:
    """With a stop string nothing is sent while the window ends in its start, so the stream equals the
    answer. A regex holds nothing back: the stream has sent all but the last token of the match when the
    regex ends the answer, and that text stays sent."""
    bias = characters(model_tokenizer)
    assert streamed_content(client, bias, stop=[STOP], stop_regex=[STOP]) == "cool"
    assert streamed_content(client, bias, stop_regex=[STOP]) == FORCED[:-1]


def test_text_completions_and_generate_take_a_stop_regex(client: httpx.Client) -> None:
    body = {"prompt": "hello", "max_tokens": 8, "temperature": 0, "stop_regex": ANY_CHARACTER}
    answer = client.post("/v1/completions", json=body).json()
    choice = answer["choices"][0]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", ANY_CHARACTER), answer
    assert answer["usage"]["completion_tokens"] == 1
    params = {"max_new_tokens": 8, "temperature": 0, "stop_regex": [ANY_CHARACTER]}
    native = client.post("/generate", json={"text": "hello", "sampling_params": params}).json()
    assert native["meta_info"]["finish_reason"] == {"type": "stop", "matched": ANY_CHARACTER}, native
    assert len(native["output_ids"]) == 1


def test_a_stop_regex_that_does_not_parse_is_a_500_and_the_server_keeps_serving(
    client: httpx.Client, server: ServerProcess
) -> None:
    """SGLang's request checks let Python's re.error escape. Its OpenAI routes answer a JSON 500 to that
    and keep the connection; from /generate it escapes the route, and the web server answers a plain-text
    500 and closes the connection (a client that reuses it is reset: seen on an H200, 2026-11-27)."""
    message = "Internal server error: missing ), unterminated subpattern at position 0"
    for stream in (False, True):
        for response in (
            chat(client, stop_regex="(", stream=stream),
            client.post("/v1/completions", json={"prompt": "hi", "stop_regex": ["("], "stream": stream}),
        ):
            assert response.status_code == 500, response.text
            body = response.json()
            assert (body["message"], body["type"], body["code"]) == (message, "InternalServerError", 500)
    assert chat(client).status_code == 200  # on the same connection
    body = json.dumps({"text": "hi", "sampling_params": {"stop_regex": "("}}).encode()
    head, rest = _exchange_then_eof(server.base_url, b"POST /generate HTTP/1.1\r\nHost: x\r\n"
                                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    assert head.startswith(b"HTTP/1.1 500") and rest.endswith(b"Internal Server Error"), (head, rest)
    with httpx.Client(base_url=server.base_url, timeout=120.0, trust_env=False) as fresh:
        assert chat(fresh).status_code == 200


def _exchange_then_eof(base_url: str, request: bytes, wait_s: float = 10.0) -> tuple[bytes, bytes]:
    """Send one raw HTTP/1.1 request on a new connection and read until the server closes it (a reset
    counts as closing); (status line and headers, body). Fails if it stays open `wait_s` seconds."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    received = b""
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        sock.sendall(request)
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        except TimeoutError as exc:
            raise AssertionError(f"the connection stayed open after {received[:200]!r}") from exc
    head, _, rest = received.partition(b"\r\n\r\n")
    return head, rest


def test_the_length_limit_comes_before_stop_tokens_and_ignore_eos_turns_them_off(
    client: httpx.Client, model_tokenizer: Any
) -> None:
    """A stop token as the last token allowed ends the answer for its length; with no_stop_trim its text
    stays in the answer."""

    def generate(**params: Any) -> dict[str, Any]:
        body = {"text": "hello", "sampling_params": {"temperature": 0, **params}}
        response = client.post("/generate", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    def finish(**params: Any) -> dict[str, Any]:
        return generate(**params)["meta_info"]["finish_reason"]

    first = generate(max_new_tokens=1)["output_ids"][0]
    assert finish(max_new_tokens=1, stop_token_ids=[first]) == {"type": "length", "length": 1}
    stopped = generate(max_new_tokens=3, stop_token_ids=[first])
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert (stopped["output_ids"], stopped["text"]) == ([first], "")
    kept = generate(max_new_tokens=3, stop_token_ids=[first], no_stop_trim=True)["text"]
    assert kept == model_tokenizer.decode([first], skip_special_tokens=True)
    assert finish(max_new_tokens=3, stop_token_ids=[first], ignore_eos=True) == {
        "type": "length",
        "length": 3,
    }
