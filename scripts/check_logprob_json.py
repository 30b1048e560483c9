"""Does the `logprob-json` backport send the bytes SGLang's own chat response serialises to, and how much of the
HTTP process's time per answer does it save (CPU, SGLang's own classes)?

Builds SGLang's `OpenAIServingChat` (a stand-in tokenizer manager: only what `_build_chat_response` reads) and
hands it finished answers as its tokenizer manager hands them over: (logprob, id, text) per output token,
prompt and output ids (the r39 bench asks `return_token_ids`). For each case the body through the backport
(registered as the server registers it: `art_sglang_backports.register()`, SGLang's `HookRegistry.apply_hooks()`)
must equal `model_dump_json(by_alias=True)` of SGLang's own response (what `json-response` and 0.5.23 send).
Then times both on `--answers` 1,024-token answers, alternating: SGLang's build + serialisation against the
backport's.

    PYTHONPATH=/path/to/sglang-0.5.17 python scripts/check_logprob_json.py --tokenizer /path/to/qwen2.5-random
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SGLANG_SITE = Path(__file__).resolve().parent.parent / "art_sglang" / "serving" / "servers" / "sglang_site"
# Beside every single-id text of the first 300 ids (byte-level pieces: control characters, U+FFFD, ...).
ODD_TEXTS = ['"logprobs":{"content":[]}', '\t"\\', "\u2028", "😀", "é", ""]  # fmt: skip
ODD_LOGPROBS = [-0.0, 0.0, -math.inf, math.nan, 5e-324, -1e-7, -123456789.123, -1 / 3, -1e300, -2.5]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokenizer", default=None, help="a model directory (texts of real ids; else made up)"
    )
    parser.add_argument("--tokens", type=int, default=1024, help="output tokens per answer")
    parser.add_argument("--answers", type=int, default=64, help="answers timed each way")
    return parser.parse_args()


def serving_chat(tokenizer: Any) -> Any:
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat

    server_args = SimpleNamespace(
        tool_call_parser=None, reasoning_parser=None, default_chat_template_kwargs=None, context_length=None,
        allow_auto_truncate=False, enable_cache_report=False, tokenizer_metrics_allowed_custom_labels=None,
    )  # fmt: skip
    model_config = SimpleNamespace(
        get_default_sampling_params=lambda: {}, is_multimodal=False,
        hf_config=SimpleNamespace(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    )  # fmt: skip
    manager = SimpleNamespace(
        server_args=server_args, model_config=model_config, tokenizer=tokenizer, served_model_name="m",
        request_logger=SimpleNamespace(log_requests=False), config_value=lambda name: None,
    )  # fmt: skip
    templates = SimpleNamespace(
        chat_template_name=None, jinja_template_content_format="string", reasoning_config=None,
        python_chat_template=None, force_reasoning=False,
    )  # fmt: skip
    return OpenAIServingChat(manager, templates)


def answer(rng: random.Random, texts: Any, tokens: int, **meta: Any) -> dict[str, Any]:
    """A finished answer as TokenizerManager._handle_batch_output hands it to the chat route."""
    ids = [rng.randrange(3, 151_936) for _ in range(tokens)]
    words = texts(ids)
    triples = [(-rng.random() * 12, i, w) for i, w in zip(ids, words, strict=True)]
    info = {
        "id": f"r{rng.getrandbits(64):x}", "finish_reason": {"type": "length", "length": tokens},
        "prompt_tokens": 1100, "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0,
        "completion_tokens": tokens, "cached_tokens": 1084, "output_token_logprobs": triples,
        "output_token_logprobs_length": tokens, "e2e_latency": 1.5, **meta,
    }  # fmt: skip
    return {
        "text": "".join(words), "output_ids": ids, "meta_info": info,
        "prompt_token_ids": [rng.randrange(3, 4096) for _ in range(1100)],
    }  # fmt: skip


def cases(
    rng: random.Random, texts: Any, tokens: int
) -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    """(name, request body, answers): the plain case in its variations, and those the backport leaves to SGLang."""
    plain = {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "logprobs": True,
        "top_logprobs": 0, "temperature": 1.0, "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip

    def odd(ids: list[int]) -> list[str]:
        made = texts(list(range(300))) + ODD_TEXTS
        return [made[n % len(made)] for n in range(len(ids))]

    oddities = answer(rng, odd, 306)
    meta = oddities["meta_info"]
    meta["output_token_logprobs"] = [
        (ODD_LOGPROBS[n % len(ODD_LOGPROBS)], i, w)
        for n, (_, i, w) in enumerate(meta["output_token_logprobs"])
    ]
    marked = answer(rng, texts, 8, weight_version='"logprobs":{"content":[]}')
    marked["text"] = '"logprobs":{"content":[]} and {"content":[]}'
    stopped = answer(rng, texts, 5, finish_reason={"type": "stop", "matched": "</s>"})
    top = answer(rng, texts, 4)
    top["meta_info"]["output_top_logprobs"] = [[(-0.1, 5, "a"), (-2.0, 6, "b")] for _ in range(4)]
    none_text = answer(rng, texts, 3)
    none_text["meta_info"]["output_token_logprobs"][1] = (-0.5, 7, None)
    int_logprob = answer(rng, texts, 3)
    int_logprob["meta_info"]["output_token_logprobs"][0] = (-1, 7, "x")
    return [
        ("plain", plain, [answer(rng, texts, tokens)]),
        ("plain, no token ids", {**plain, "return_token_ids": False}, [answer(rng, texts, tokens)]),
        ("odd texts and floats", plain, [oddities]),
        ("the marker in content and metadata", plain, [marked]),
        ("matched stop", plain, [stopped]),
        ("empty answer", plain, [answer(rng, texts, 0)]),
        ("two choices", {**plain, "n": 2}, [answer(rng, texts, 30), answer(rng, texts, 20)]),
        ("SGLang's: top logprobs", {**plain, "top_logprobs": 2}, [top]),
        ("SGLang's: meta_info", {**plain, "return_meta_info": True}, [answer(rng, texts, 6)]),
        ("SGLang's: a text that is None", plain, [none_text]),
        ("SGLang's: an int logprob", plain, [int_logprob]),
        ("no logprobs asked", {**plain, "logprobs": False}, [answer(rng, texts, 6)]),
    ]


def body(response: Any) -> bytes:
    from pydantic import BaseModel

    if isinstance(response, BaseModel):
        return response.model_dump_json(by_alias=True).encode()
    return bytes(response.body)


def main() -> None:
    args = parse_args()
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.plugins.hook_registry import HookRegistry

    tokenizer = None
    texts = lambda ids: [f"<t{i}>" if i >= 4096 else chr(0x20 + i % 90) for i in ids]  # noqa: E731
    if args.tokenizer:
        from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer

        tokenizer = get_tokenizer(args.tokenizer)

        def texts(ids: list[int]) -> list[str]:  # as SGLang's detokenize_logprob_tokens makes them
            return tokenizer.batch_decode([[i] for i in ids]) if ids else []

    released = OpenAIServingChat._build_chat_response
    os.environ["ART_SGLANG_BACKPORTS"] = "logprob-json"
    sys.path.insert(0, str(SGLANG_SITE))
    import art_sglang_backports

    art_sglang_backports.register()
    HookRegistry.apply_hooks()
    assert OpenAIServingChat._build_chat_response is not released, "the hook was not applied"
    chat = serving_chat(tokenizer)
    rng = random.Random(0)
    failed = 0
    for name, raw, ret in cases(rng, texts, args.tokens):
        request = ChatCompletionRequest.model_validate(raw)
        try:
            expected: bytes | str = body(released(chat, request, ret, 1_700_000_000))
        except Exception as error:  # SGLang's own failure: the backport must fail alike
            expected = f"{type(error).__name__}"
        try:
            hooked = chat._build_chat_response(request, ret, 1_700_000_000)
            got: bytes | str = body(hooked)
            path = "SGLang's" if type(hooked).__name__ == "ChatCompletionResponse" else "one pass"
        except Exception as error:
            got, path = f"{type(error).__name__}", "raised"
        same = got == expected
        failed += not same
        size = f"{len(expected):,} bytes" if isinstance(expected, bytes) else expected
        print(f"{'same' if same else 'DIFFERENT'}: {name} ({path}, {size})")
    print(f"{failed} of the cases differ")

    plain = ChatCompletionRequest.model_validate(cases(rng, texts, 1)[0][1] | {"max_tokens": args.tokens})
    answers = [[answer(rng, texts, args.tokens)] for _ in range(args.answers)]
    spent: dict[str, list[float]] = {"released": [], "logprob-json": []}
    for ret in answers:
        for label, build in (
            ("released", released),
            ("logprob-json", OpenAIServingChat._build_chat_response),
        ):
            start = time.thread_time()  # CPU time: a busy machine's waits stay out
            body(build(chat, plain, ret, 1_700_000_000))
            spent[label].append(time.thread_time() - start)
    for label, seconds in spent.items():
        print(
            f"{label:13s} build + JSON of a {args.tokens}-token answer, CPU time: median {statistics.median(seconds) * 1e3:.3f} "
            f"ms, min {min(seconds) * 1e3:.3f} ms ({len(seconds)} answers)"
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
