"""Where a base model's files will come from: a local directory, the Hugging Face cache, or the hub.

Checked before any process starts: without it a hub id that cannot be fetched (no network, a typo, a
private repository) surfaced only after the trainer had started, as a `TrainerError` wrapping an
`OSError` a minute later. The hub is asked once, without retries; the weights themselves are fetched
later by the trainer and the server, as before.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError

HUB_TIMEOUT_S = 10.0
_PROBE_FILE = "config.json"  # every transformers model repository has one


def check_base_model_source(base_model: str) -> None:
    """Raise `ConfigError` (from `base_model_source_problem`) if `base_model`'s files cannot be had."""
    problem = base_model_source_problem(base_model)
    if problem is not None:
        raise ConfigError(problem)


def base_model_source_problem(base_model: str) -> str | None:
    """Why the hub id `base_model` cannot be fetched, naming the setting and the fix; None when it is a
    local path (its shape is `model_store.base_model_problem`'s to check), cached, or on the hub. Blocking
    (up to `HUB_TIMEOUT_S`)."""
    if Path(base_model).expanduser().exists():
        return None
    try:
        from huggingface_hub import constants, model_info, try_to_load_from_cache
        from huggingface_hub.errors import RepositoryNotFoundError
    except ImportError:  # no trainer stack here: whatever loads the model reports it
        return None
    if isinstance(try_to_load_from_cache(base_model, _PROBE_FILE), str):
        return None
    fixes = (
        f"download it where the hub is reachable (`hf download {base_model}`, into the cache "
        f"{constants.HF_HUB_CACHE}), or set base_model to a local model directory"
    )
    if constants.HF_HUB_OFFLINE:
        return (
            f"base_model {base_model!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: {fixes}"
        )
    try:
        model_info(base_model, timeout=HUB_TIMEOUT_S)
    except RepositoryNotFoundError:
        return (
            f"base_model {base_model!r} is not on the Hugging Face hub ({constants.ENDPOINT}): check the "
            "name, or for a private repository log in (`hf auth login`, or set HF_TOKEN)"
        )
    except Exception as exc:  # the hub client's network errors have no common base class
        return (
            f"base_model {base_model!r} is neither a local directory nor in the Hugging Face cache, and "
            f"the hub ({constants.ENDPOINT}) could not be reached ({type(exc).__name__}: {exc}): {fixes}"
        )
    return None
