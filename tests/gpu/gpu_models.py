"""Random-init Qwen2 models for the GPU suite and benchmarks, built offline in seconds.

`tiny`: correctness (head_dim 64 like the model the device kit verified SGLang with). `qwen2.5-1.5b-shape`
and `qwen2.5-7b-shape` (6.6B parameters, 13 GB): the GPU tests and the earlier timings; Qwen2.5-1.5B's and
-7B's layer shapes with the project's 4,096-token tokenizer, so their vocabulary, and with it the LM head
and the embedding, is far smaller than the real models' (151,936 rows: 233M parameters at 1.5B).

`qwen2.5-1.5b-random` and `qwen2.5-7b-random`: the benchmarks' models, Qwen2.5-1.5B's and -7B's
architecture exactly (layers, heads, MLP, RoPE theta, 32k positions, tied embeddings at 1.5B and not at
7B) including the vocabulary of 151,936 ids: the offline tokenizer padded with 147,840 added tokens
`<tN>` (N its id; plain text, not special), so every id decodes to text and the text of an answer
encodes back to the same added tokens; the embedding and LM head have 151,936 rows. Weights are random:
serving and training cost do not depend on their values (a random model's answers are near-uniform
draws over the vocabulary, so most answer tokens are padding tokens). Saved in bfloat16, the dtype both
SGLang and the trainer run them in.

    python tests/gpu/gpu_models.py OUT_DIR [SHAPE ...]   # OUT_DIR/<shape> for each (default: tiny, 1.5B)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# Qwen2.5's embedding rows (its tokenizer has 151,665 ids; the embedding is padded to a multiple of 128).
QWEN25_VOCAB = 151_936
OFFLINE_VOCAB = 4096  # the project's offline BPE tokenizer (art_sglang/tiny_model.py)
_QWEN25_1_5B = {"hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "intermediate": 8960, "tie": True}
_QWEN25_7B = {"hidden": 3584, "layers": 28, "heads": 28, "kv_heads": 4, "intermediate": 18944, "tie": False}
SHAPES: dict[str, dict[str, int | bool]] = {
    "tiny": {"hidden": 128, "layers": 2, "heads": 2, "kv_heads": 1, "intermediate": 256, "tie": False},
    "qwen2.5-1.5b-shape": _QWEN25_1_5B,
    "qwen2.5-7b-shape": _QWEN25_7B,
    "qwen2.5-1.5b-random": {**_QWEN25_1_5B, "vocab": QWEN25_VOCAB},
    "qwen2.5-7b-random": {**_QWEN25_7B, "vocab": QWEN25_VOCAB},
}
_MARKER = "gpu_model.json"


def padding_token(token_id: int) -> str:
    """The text of the added token with id `token_id` (delimited, so no token's text holds another's)."""
    return f"<t{token_id}>"


def pad_vocabulary(tokenizer: Any, size: int) -> Any:
    """`tokenizer` with plain-text added tokens appended until it has `size` ids."""
    from tokenizers import AddedToken

    first = len(tokenizer)
    if size < first:
        raise ValueError(f"a vocabulary of {size} ids is smaller than the tokenizer's {first}")
    tokenizer.add_tokens(
        [AddedToken(padding_token(i), special=False, normalized=False) for i in range(first, size)]
    )
    return tokenizer


def build_gpu_model(out: str | Path, shape: str = "tiny") -> Path:
    """Write tokenizer + random-init bf16 Qwen2 of `shape` to `out`; reuse a finished build."""
    return build_model(out, shape, SHAPES[shape])


def build_model(out: str | Path, shape: str, s: dict[str, Any]) -> Path:
    """`build_gpu_model` for the layer sizes `s` (hidden, layers, heads, kv_heads, intermediate, tie, and
    optionally vocab: the tokenizer padded to that many ids)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from art_sglang.tiny_model import build_tiny_model

    out = Path(out)
    spec = {"shape": shape, **s}
    if (out / _MARKER).exists() and json.loads((out / _MARKER).read_text()) == spec:
        return out
    # The project's offline tokenizer (ChatML template with tools); its 1-layer model is replaced below.
    build_tiny_model(out, hidden=64, layers=1, vocab=OFFLINE_VOCAB)
    (out / "tiny_model.json").unlink()
    tokenizer = AutoTokenizer.from_pretrained(out)
    if "vocab" in s:
        pad_vocabulary(tokenizer, int(s["vocab"])).save_pretrained(out)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=s["tie"],
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    (out / _MARKER).write_text(json.dumps(spec))
    return out


def main() -> None:
    root = Path(sys.argv[1])
    for shape in sys.argv[2:] or ["tiny", "qwen2.5-1.5b-shape"]:
        path = build_gpu_model(root / shape, shape)
        print(f"{shape}: {path}")


if __name__ == "__main__":
    main()
