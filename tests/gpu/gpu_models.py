"""Random-init Qwen2 models for the GPU suite and benchmarks, built offline in seconds.

`tiny`: correctness (head_dim 64 like the model the device kit verified SGLang with). `qwen2.5-1.5b-shape`
and `qwen2.5-7b-shape` (6.6B parameters, 13 GB): timings; Qwen2.5-1.5B's and -7B's layer shapes (hidden 1536, 28 layers, 12 query / 2 KV heads, MLP 8960, tied
embeddings) with the project's 4k tokenizer, so its vocabulary, and with it the LM head, is smaller than the
real model's 151k. Serving and training cost do not depend on the weights' values. Saved in bfloat16,
the dtype both SGLang and the trainer run it in.

    python tests/gpu/gpu_models.py OUT_DIR [SHAPE ...]   # OUT_DIR/<shape> for each (default: tiny, 1.5B)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SHAPES: dict[str, dict[str, int | bool]] = {
    "tiny": {"hidden": 128, "layers": 2, "heads": 2, "kv_heads": 1, "intermediate": 256, "tie": False},
    "qwen2.5-1.5b-shape": {
        "hidden": 1536,
        "layers": 28,
        "heads": 12,
        "kv_heads": 2,
        "intermediate": 8960,
        "tie": True,
    },
    "qwen2.5-7b-shape": {
        "hidden": 3584,
        "layers": 28,
        "heads": 28,
        "kv_heads": 4,
        "intermediate": 18944,
        "tie": False,
    },
}
_MARKER = "gpu_model.json"


def build_gpu_model(out: str | Path, shape: str = "tiny") -> Path:
    """Write tokenizer + random-init bf16 Qwen2 of `shape` to `out`; reuse a finished build."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from art_sglang.tiny_model import build_tiny_model

    out = Path(out)
    spec = {"shape": shape, **SHAPES[shape]}
    if (out / _MARKER).exists() and json.loads((out / _MARKER).read_text()) == spec:
        return out
    # The project's offline tokenizer (ChatML template with tools); its 1-layer model is replaced below.
    build_tiny_model(out, hidden=64, layers=1, vocab=4096)
    (out / "tiny_model.json").unlink()
    tokenizer = AutoTokenizer.from_pretrained(out)
    s = SHAPES[shape]
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
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
