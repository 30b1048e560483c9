"""The CPU reference engine: a small real HTTP server speaking SGLang 0.5.17's HTTP subset on
transformers + peft, run as `python -m art_sglang_reference <sglang launch flags>`.

It makes every orchestration path testable without a GPU; the contract tests (tests/contract) run the same
assertions against it and against real SGLang, and replay SGLang's recorded answers (status codes, JSON
shapes). Where SGLang's behaviour is kept on purpose, or where a CPU engine must differ:

- OpenAI routes pick an adapter only by `model="<base>:<adapter>"` or the `lora_path` field (/generate:
  `lora_path`), as SGLang 0.5.17 does. A bare `model` name is always served by the base model with HTTP
  200 and echoed back, even when an adapter of that name is loaded (the recorded SGLang answers show it).
  A named adapter that was unloaded is loaded again from its path (SGLang keeps every name it ever
  loaded); one never loaded -> 400 "Got LoRA adapter that has never been loaded".
- Adapters: any number loaded at once (`--max-loaded-loras` caps it if given; `--max-loras-per-batch` is a
  GPU pool size and is ignored); rank above `--max-lora-rank` or a target outside `--lora-target-modules`
  -> 400 with SGLang's message; a missing path -> 400 saying so (SGLang instead tries the model hub).
- Weights run in float32. Logprobs are log-softmax of the logits divided by the temperature, before
  top-p/top-k (SGLang's default); greedy requests report the plain log-softmax. A seeded request samples
  deterministically (choice i of n uses seed + i).
- Requests run one at a time under a lock, in a worker thread, so /health answers while generating.
- The prefix cache keeps recent KV caches per adapter (token budget `--max-total-tokens`) and reuses the
  longest common prefix, so `usage.prompt_tokens_details.cached_tokens` is real;
  `--disable-radix-cache` turns it off; /flush_cache clears it (refused while requests run, like SGLang).
  Prompt tokens are computed one at a time, as decoded ones are, so a seeded request's output is the same
  whatever prefix of it the cache holds (unlike SGLang, whose batches round differently).
- /release_memory_occupation with `--enable-memory-saver` clears the cache and drops the base weights;
  with `--enable-weights-cpu-backup` they are kept in RAM (on a CPU that backup is the weights themselves),
  without it they are re-read from disk on resume. While released, generation answers 503 and
  /health_generate 503 (/health stays 200). Without the memory saver both calls are accepted no-ops.
  A release while any request runs ends the process, as it kills SGLang's scheduler; /health is a
  one-token generation, as SGLang's is.
- /update_weights_from_disk reads a local checkpoint of the same shapes; adapters stay loaded; the cache is
  flushed. SIGTERM stops generations in flight at their next token.
- Stops are found as SGLang finds them: `stop` strings and `stop_regex` only in the last (longest stop
  string's canonical token count, or a regex's length bound) + 1 tokens, so a stop spelled in more tokens
  is missed; the length limit is checked first and stop tokens last (ignore_eos turns stop_token_ids off
  too); a `stop_regex` that does not parse -> 500, as SGLang's unexpected-exception answer.
- GPU-only flags are accepted and ignored with a log line; unknown flags too. One log line per request.
"""
