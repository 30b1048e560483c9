"""The environment variables the backend sets for the SGLang server it launches (the reference engine reads
the ones it shares with SGLang)."""

from __future__ import annotations

# How long a server keeps an idle connection open (SGLang reads the variable, so does the reference engine;
# 5 s is both engines' default). Set explicitly: the gateway's pool must drop its own idle connections
# well before the server closes them, or a burst reuses connections the server is closing.
KEEP_ALIVE_ENV = "SGLANG_TIMEOUT_KEEP_ALIVE"
# SGLang reports a sampled token's logprob after dividing the logits by the temperature; the trainer (as
# ART's) scores tokens at temperature 1, and vLLM, which ART's LocalBackend runs, reports raw logprobs.
# With this variable set SGLang reports them before the temperature (still after a logit bias or grammar
# mask), so a rollout sampled at any temperature gives the trainer the logprobs it recomputes.
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
SGLANG_ENV_DEFAULTS = {
    # SGLang checks that TP ranks see balanced free memory; a trainer sharing the host makes that check fail
    # spuriously, so the backend always disables it (the user's description of the product names it).
    "SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK": "True",
    KEEP_ALIVE_ENV: "5",
    ORIGINAL_LOGPROB_ENV: "1",
}
# SGLang 0.5.17's experimental LoRA path (SGLangConfig.lora_experimental_path): the first variable switches it
# on; the second allocates the second stream's outputs from the main stream, which keeps it right under CUDA
# graphs.
EXPERIMENTAL_LORA_ENV = {"SGLANG_EXPERIMENTAL_LORA_OPTI": "1", "SGLANG_OPT_LORA_OVERLAP_MAIN_ALLOC": "1"}
# SGLang 0.5.17 runs NCCL without cuMem in its own process (`_set_envs_and_config` sets NCCL_CUMEM_ENABLE from
# --enable-symm-mem, which the backend never passes). A process that broadcasts weights to its ranks must run
# NCCL the same way: with cuMem on one side and legacy IPC on the other, NCCL's P2P setup fails on the server
# ("Cuda failure 'invalid argument'", H200, 2026-11-28) while the sender waits on it for ever.
SGLANG_NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0"}
