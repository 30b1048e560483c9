"""The adapter gateway's routing rule, as pure functions over (method, target, body, what is served): which
requests reach the server, on which canonical path, with which body, and what the others are answered.

Why a rule at all: SGLang 0.5.17 selects an adapter only by `model="<base>:<adapter>"` or the `lora_path`
field; a bare `model="<adapter>"` is answered with HTTP 200 *by the base model*, the requested name echoed
back, whether or not an adapter of that name is loaded. A rollout on the wrong weights would look like
success. So:

- Only what rollouts need is forwarded: the OpenAI inference routes, `/v1/models`, `/generate` and the
  health checks. Everything else (the server's admin API: adapter loading, weight updates, memory
  release, server info with its launch arguments) is 404 from the gateway.
- The decision is taken on the normalized path (percent-decoded once, dot segments and repeated or
  trailing slashes removed, lower case), and that normalized path is what the server gets, so the server
  can never see a path the gateway did not decide on (and never answers with a redirect to itself).
- On the inference routes the body must be a JSON object; the `model` (and `lora_path`) names must be
  served. A loaded adapter named by `model` is forwarded with `lora_path` set to it (the response still
  echoes the name the client sent), an alias (merged weights) is rewritten to the base id, the base
  model's ids pass, and any other name is a 404 in OpenAI's error shape listing the loaded adapters.
- `n > 1` on an adapter is a 400: SGLang 0.5.17 then never releases the adapter (it cannot be unloaded).
  `n` is read as the server reads it (choice_count.py: `2.0`, `"2"`, /generate's `sampling_params`); one
  the server would refuse is a 400 here.
- Sampling constraints (constraints.py): malformed ones are a 400, `custom_logit_processor` always (it is
  dill-deserialized Python); `allowed_token_ids` is forwarded as SGLang's `logit_bias`; the canonical
  constraint goes in `Forward.constraint`, which the gateway attaches to each returned choice. A streamed
  constrained request on a trained model is a 400: its chunks could not carry the constraint to training.
- A chat request's tools and tool_choice, read as SGLang reads them with the server's `--tool-call-parser`
  (tool_choice.py): the grammar SGLang decodes a forced call under (a structural tag; without a parser its
  JSON array schema) joins the constraint unless the request has a grammar of its own (SGLang then drops
  the tool's), and the tools the template rendered, where they are not the request's ("none": none; a
  named tool: that one), travel on each choice as `art_template_tools`. A tool_choice that constrains with
  a parser whose constraint is not reproduced is a 400 on a trained model.
- A non-streaming chat or text completion on an adapter (or an alias) also gets `return_token_ids: true`
  unless the client set the field itself, so each Choice carries the ids the server sampled and the
  trainer trains on exactly those instead of re-tokenizing the text. (SGLang 0.5.17's stream chunks are
  not recorded carrying the ids, so a rollout that needs exact ids should not stream.)
- A request on an alias is marked for the merged-weight update in flight (`Forward.versioned`, `resend`:
  resend.py, stream_resend.py).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from ...constraints import ALLOWED_FIELD, CONSTRAINT_FIELD, ConstraintError, SamplingConstraint, constraint_of
from ...tool_choice import DEFAULT_PARSER, TEMPLATE_TOOLS_FIELD, ToolUse, UnknownParser, tool_use
from ..choice_count import GENERATE_PATH, ChoiceCountError, choices_per_prompt
from ..served_names import parse_served_name, served_prefix, step_of
from . import json_body

# Paths whose body names a model; the first two can carry the sampled ids (`return_token_ids`).
CHAT_PATH = "/v1/chat/completions"
INFERENCE_PATHS = frozenset({CHAT_PATH, "/v1/completions", GENERATE_PATH})
TOKEN_ID_PATHS = frozenset({CHAT_PATH, "/v1/completions"})
READ_PATHS = frozenset({"/v1/models", "/health", "/health_generate"})
# Headers not forwarded either way: hop-by-hop ones (RFC 9110 7.6.1), those the transport sets itself, and
# the client's key (the gateway sends the server's own).
NOT_FORWARDED = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length", "authorization"}
)  # fmt: skip


@dataclass(frozen=True)
class Served:
    """What may be requested: loaded adapters, the base model's ids, and aliases (name -> base id) for
    names served by the base slot (merged weights); the server's `--tool-call-parser`."""

    adapters: frozenset[str] = frozenset()
    base_ids: frozenset[str] = frozenset()
    aliases: Mapping[str, str] = field(default_factory=dict)
    tool_call_parser: str | None = DEFAULT_PARSER

    def is_trained(self, name: object) -> bool:
        """Whether `name` selects a trained model: an adapter, an alias, or "<base>:<adapter>"."""
        if not isinstance(name, str):
            return False
        if name in self.adapters or name in self.aliases:
            return True
        base, sep, adapter = name.partition(":")
        return bool(sep) and base in self.base_ids and adapter in self.adapters

    def uses_adapter(self, name: str) -> bool:
        """Whether `name` is served by a LoRA adapter (not by the base slot, as an alias is)."""
        return self.is_trained(name) and name not in self.aliases

    def serves(self, name: str) -> bool:
        return name in self.base_ids or self.is_trained(name)


@dataclass(frozen=True)
class Forward:
    """Send `body` to the server as `method path?query`; `names` are the models it asks for; `read`: a
    read-only request (model list, health); `payload`: the body as parsed (inference routes), so later
    steps need not parse it again; `constraint`: the sampling constraint to attach to each choice;
    `template_tools`: the tools the chat template rendered, to attach where they are not the request's;
    `prompt`: which requests share its prompt (`prefill_sharing.prompt_key`), set once by the gateway
    where prefill sharing or the choice among replicas groups requests by it. `aliased`: it names an alias
    (merged weights); `versioned`: such a request answered whole, whose choices get their weight versions;
    `resend`: an aliased request continued when an update aborts it (resend.py, or stream_resend.py for a
    stream). A push waits for the other aliased ones to finish."""

    path: str
    body: bytes
    names: tuple[str, ...] = ()
    read: bool = False
    payload: Mapping[str, Any] | None = field(default=None, compare=False)
    constraint: SamplingConstraint | None = None
    template_tools: list[Any] | None = None
    prompt: str | None = field(default=None, compare=False)
    aliased: bool = False
    versioned: bool = False
    resend: bool = False

    @property
    def annotated(self) -> bool:
        """Whether each returned choice gets a field for training (the answer is then read whole)."""
        return self.constraint is not None or self.template_tools is not None or self.versioned


@dataclass(frozen=True)
class Refuse:
    """Answer `status` with `payload` (OpenAI's error shape). `unknown` lists the names that are not served
    (a 404 the gateway may still turn into a forward by loading them)."""

    status: int
    payload: dict
    unknown: tuple[str, ...] = ()


def normalize_path(target: str) -> tuple[str, str]:
    """(normalized path, query) of a request target: percent-decoded once, dot segments and repeated or
    trailing slashes removed, lower case."""
    raw, _, query = target.partition("?")
    path = posixpath.normpath("/" + unquote(raw, errors="strict")).lower()
    return ("/" if path in ("", ".") else "/" + path.lstrip("/")), query


def route(
    method: str, target: str, body: bytes, served: Served, *, authorized: bool = True
) -> Forward | Refuse:
    """What to do with one request. `authorized`: the client holds the gateway's key (or none is set); a
    client without it is never told which names are served."""
    try:
        path, query = normalize_path(target)
    except UnicodeDecodeError:
        return Refuse(400, error("the request path is not valid UTF-8 after percent-decoding", "bad_path"))
    canonical = f"{path}?{query}" if query else path
    if path in READ_PATHS and method in ("GET", "HEAD"):
        return Forward(canonical, body, read=True)
    if path not in INFERENCE_PATHS:
        return Refuse(404, error(f"the gateway does not serve {method} {path}", "not_found"))
    if method != "POST":
        return Refuse(405, error(f"{path} takes POST, not {method}", "method_not_allowed"))
    payload = parse_object(body)
    if isinstance(payload, Refuse):
        return payload
    names = requested_names(payload)
    unknown = tuple(name for name in names if not served.serves(name))
    if unknown:
        if not authorized:
            # Do not list the served names to a caller without the key; the server would say 401 too.
            return Refuse(401, error("invalid API key", "invalid_api_key"))
        return Refuse(404, error(not_served(unknown[0], served), "model_not_found", "model"), unknown)
    try:
        n = choices_per_prompt(path, payload)
    except ChoiceCountError as exc:
        return Refuse(400, error(str(exc), "invalid_n", exc.field))
    if n > 1 and any(served.uses_adapter(name) for name in names):
        message = (
            f"n={n} on a LoRA adapter is refused: SGLang 0.5.17 counts such a request's use of the adapter "
            "once but releases it once per choice, after which the adapter can never be unloaded (the backend "
            "unloads old steps' adapters). Send n separate requests; the gateway computes their shared "
            "prompt once."
        )
        where = "sampling_params.n" if path == GENERATE_PATH else "n"
        return Refuse(400, error(message, "n_with_adapter", where))
    constrained = constrain(payload, served, completions=path in TOKEN_ID_PATHS, chat=path == CHAT_PATH)
    if isinstance(constrained, Refuse):
        return constrained
    constraint, shown = constrained
    if rewrite(payload, served, token_ids=path in TOKEN_ID_PATHS) or constraint is not None:
        body = json.dumps(payload).encode()
    if payload.get("stream"):  # allowed on untrained models only: relayed as it comes, nothing to annotate
        constraint = shown = None
    aliased = any(name in served.aliases for name in names)
    versioned = aliased and path in TOKEN_ID_PATHS and not payload.get("stream")
    plain = constraint is None and shown is None and not payload.get("tools")  # as its continuation samples
    streamed = aliased and path == CHAT_PATH and bool(payload.get("stream")) and n == 1
    resend = plain and (payload.get("return_token_ids") is True if versioned else streamed)
    return Forward(
        canonical, body, tuple(names), payload=payload, constraint=constraint, template_tools=shown,
        aliased=aliased, versioned=versioned, resend=resend,
    )  # fmt: skip


def serving_version(names: tuple[str, ...], served: Served) -> str | None:
    """The weights a request on an alias is served by now: its model's newest step the merged weights hold
    (older aliases are served by them too)."""
    models = {parsed[0] for name in names if name in served.aliases and (parsed := parse_served_name(name))}
    held = [alias for alias in served.aliases if (parsed := parse_served_name(alias)) and parsed[0] in models]
    return max(held, key=step_of, default=None)


def not_served(name: str, served: Served) -> str:
    """Why `name` is refused: another step of a model whose merged weights hold one step (they would answer
    it with another policy), or a name that is not loaded."""
    parsed = parse_served_name(name)
    holding = [a for a in served.aliases if parsed is not None and a.startswith(served_prefix(parsed[0]))]
    if holding:
        return (
            f"The model `{name}` is not served: the merged weights hold `{max(holding, key=step_of)}`, and "
            "only the step they hold is (and the steps up to SGLangConfig.max_steps_off_policy before it; "
            "an older step's weights are replaced when a newer one is published). Use "
            "model.get_inference_name() for the current step."
        )
    loaded = sorted(served.adapters) or ["(no adapter loaded)"]
    return (
        f"The model `{name}` is not loaded on the inference server, so it would have been answered by the "
        f"base model. Loaded adapters: {', '.join(loaded)}. Use model.get_inference_name() for the current step."
    )


def parse_object(body: bytes) -> dict | Refuse:
    """The body as a JSON object, or a 400 for anything else (malformed, nested too deep, not an object)."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        return Refuse(400, error(f"the request body is not valid JSON: {exc}", "invalid_json"))
    except RecursionError:
        return Refuse(400, error("the request body's JSON is nested too deeply", "invalid_json"))
    if not isinstance(payload, dict):
        return Refuse(400, error("the request body must be a JSON object", "invalid_json"))
    return payload


def requested_names(payload: dict) -> list[str]:
    """Model/adapter names a request asks for: `model` and `lora_path` (a string or, for batched
    /generate, a list)."""
    names: list[str] = []
    for key in ("model", "lora_path"):
        value = payload.get(key)
        if isinstance(value, str):
            names.append(value)
        elif isinstance(value, list):
            names.extend(item for item in value if isinstance(item, str))
    return names


def constrain(
    payload: dict, served: Served, *, completions: bool, chat: bool = False
) -> tuple[SamplingConstraint | None, list[Any] | None] | Refuse:
    """(the request's sampling constraint, the tools its chat template renders where they are not the
    request's), with `payload` rewritten to what SGLang samples it by; a 400 for a malformed one. /generate
    is only checked for a custom logit processor (its answers are not Choices, so nothing travels from them
    to training)."""
    if not completions:
        payload = {"custom_logit_processor": payload.get("custom_logit_processor")}
    try:
        constraint = constraint_of(payload)
    except ConstraintError as exc:
        return Refuse(400, error(str(exc), "invalid_constraint", exc.param))
    if not completions:
        return None, None
    trained = any(served.is_trained(name) for name in requested_names(payload))
    tools = _tool_use(payload, served.tool_call_parser, trained) if chat else None
    if isinstance(tools, Refuse):
        return tools
    shown = None
    if tools is not None:
        if tools.constraint is not None and (constraint is None or constraint.grammar is None):
            constraint = (constraint or SamplingConstraint()).model_copy(update={"grammar": tools.constraint})
        if (tools.template_tools or []) != (payload.get("tools") or []):
            shown = tools.template_tools or []
    if constraint is None and shown is None:
        return None, None
    if payload.get("stream") and trained:
        what = (
            constraint.describe() if constraint is not None else f"only {len(shown or [])} of its tools shown"
        )
        message = (
            f"a streamed request with a sampling constraint ({what}) is refused on a trained model: the stream "
            "cannot carry it to the trainer, which must compute the sampled tokens' logprobs under it. Send it "
            "without stream."
        )
        return Refuse(400, error(message, "stream_with_constraint", "stream"))
    payload.pop(ALLOWED_FIELD, None)
    bias = constraint.forwarded_bias() if constraint is not None else {}
    if bias:
        payload["logit_bias"] = bias
    return constraint, shown


def _tool_use(payload: dict, parser: str | None, trained: bool) -> ToolUse | Refuse | None:
    """What the request's tools and tool_choice make SGLang do (tool_choice.ToolUse); None where nothing is
    to carry or SGLang answers the request with its own 400; a 400 for a constraint not reproduced here."""
    if not payload.get("tools") and payload.get("tool_choice") is None:
        return None
    parallel = payload.get("parallel_tool_calls") is not False
    try:
        return tool_use(payload.get("tools"), payload.get("tool_choice"), parallel, parser)
    except UnknownParser as exc:
        if not trained:
            return None
        message = f"{exc}: the trainer could not compute the sampled tokens' logprobs under it"
        return Refuse(400, error(message, "unsupported_tool_choice", "tool_choice"))
    except (ValueError, TypeError, AttributeError, KeyError):
        return None


def rewrite(payload: dict, served: Served, *, token_ids: bool) -> bool:
    """Make the server use the adapter the client named; True if `payload` was changed.

    A loaded adapter named by `model` gets `lora_path` (a bare name alone would be the base model); an
    alias is replaced by its base id, in `model` and in `lora_path`. With `token_ids`, a non-streaming
    request on an adapter or alias asks for the sampled ids unless the client decided itself."""
    changed = False
    model = payload.get("model")
    lora = payload.get("lora_path")
    if (
        token_ids
        and "return_token_ids" not in payload
        and not payload.get("stream")
        and any(served.is_trained(name) for name in (model, lora))
    ):
        payload["return_token_ids"] = True
        changed = True
    if isinstance(model, str):
        if model in served.aliases:
            payload["model"] = served.aliases[model]
            changed = True
        elif model in served.adapters and not payload.get("lora_path"):
            payload["lora_path"] = model
            changed = True
    lora = payload.get("lora_path")
    if isinstance(lora, str) and lora in served.aliases:
        del payload["lora_path"]
        changed = True
    elif isinstance(lora, list) and any(item in served.aliases for item in lora):
        payload["lora_path"] = [None if item in served.aliases else item for item in lora]
        changed = True
    return changed


def error(message: str, code: str, param: str | None = None) -> dict:
    # OpenAI's error shape, so the openai client raises NotFoundError/APIStatusError with this message.
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


def with_constraint(
    body: bytes, constraint: SamplingConstraint | None, template_tools: list[Any] | None = None
) -> bytes:
    """A completion's JSON body with `constraint` (`art_constraint`) and the template's tools
    (`art_template_tools`) on each choice, where given; other bodies as they are."""
    try:
        payload = json_body.loads(body)
    except ValueError:
        return body
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list):
        return body
    fields: dict[str, Any] = {}
    if constraint is not None:
        fields[CONSTRAINT_FIELD] = constraint.model_dump(mode="json")
    if template_tools is not None:
        fields[TEMPLATE_TOOLS_FIELD] = template_tools
    for choice in choices:
        if isinstance(choice, dict):
            choice.update(fields)
    return json_body.dumps(payload)
