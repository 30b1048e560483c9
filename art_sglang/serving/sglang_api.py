"""Names SGLang's HTTP API defines (SGLang 0.5.17), shared by the client that talks to SGLang and by the
reference engine that answers as SGLang does."""

from __future__ import annotations

# SGLang's names for the kinds of GPU memory `release_memory_occupation` can free (its own default, no
# tags, frees both). CUDA graphs stay: a graph captured against released memory is still valid on resume.
KV_CACHE_TAG, WEIGHTS_TAG = "kv_cache", "weights"
MEMORY_TAGS = (KV_CACHE_TAG, WEIGHTS_TAG)
# The routes of this API that SGLang counts as admin routes: with `--admin-api-key` set, only that key
# opens them.
ADMIN_ROUTES = frozenset(
    {
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/flush_cache",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weight_version",
        "/pause_generation",
        "/continue_generation",
    }
)
# What SGLang 0.5.17 says when it refuses a request for its length (prompt, or prompt + max_tokens, over the
# context). It checks the length only after counting the request against its adapter, and gives that
# count back only when a request finishes generating: a request refused so keeps the adapter in use for
# good, and an unload of it never returns (holding the lock every later adapter load waits for).
LENGTH_REFUSALS = (
    b"is longer than the model's context length",
    b"exceeds the model's maximum context length",
)
