"""Build a tiny random-init Qwen2 chat model fully offline, for tests and the CPU demo.

The tokenizer is a byte-level BPE trained on the Python standard library's sources; the chat template is
ChatML (tools and tool calls included). Nothing is downloaded. `python -m art_sglang.tiny_model OUT`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from pathlib import Path

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{% if m.get('tool_calls') %}{% for call in m['tool_calls'] %}"
    "<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_MARKER = "tiny_model.json"


def build_tiny_model(
    out: str | os.PathLike[str],
    *,
    hidden: int = 64,
    layers: int = 2,
    vocab: int = 2048,
    seed: int = 0,
    logit_scale: float = 1.0,
) -> Path:
    """Write tokenizer + random-init Qwen2 (float32) to `out` and return it. Reuses a finished build.

    `logit_scale` multiplies the output layer's random weights: at 1 the logits stay within about ±1
    (normalised hidden states times rows of std 0.02), so LoRA training, which leaves that layer alone,
    can shift probabilities but not make one continuation certain; ~25 lets a few SFT steps teach an
    exact text (tests that need the model to produce a tool call)."""
    out = Path(out)
    spec = {"hidden": hidden, "layers": layers, "vocab": vocab, "seed": seed}
    if logit_scale != 1.0:
        spec["logit_scale"] = logit_scale
    marker = out / _MARKER
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    sources = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:120]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(
        sources,
        trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 32, 2),
        num_key_value_heads=max(hidden // 64, 1),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.lm_head.weight.data *= logit_scale
    model.save_pretrained(out)
    marker.write_text(json.dumps(spec))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    args = parser.parse_args()
    path = build_tiny_model(args.out, hidden=args.hidden, layers=args.layers, vocab=args.vocab)
    print(f"tiny model written to {path}")


if __name__ == "__main__":
    main()
