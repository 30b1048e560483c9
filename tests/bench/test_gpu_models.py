"""tests/gpu/gpu_models.py on CPU: a small model with Qwen2.5's vocabulary (the benchmark models' tokenizer
and embedding size) loads with transformers, and every one of its ids decodes to text."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import gpu_models


def test_a_model_with_qwen25s_vocabulary_loads_and_every_id_decodes(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The 1.5B benchmark model's vocabulary and tied embeddings, with tiny layers.
    spec = {**gpu_models.SHAPES["qwen2.5-1.5b-random"], "hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1,
            "intermediate": 64}  # fmt: skip
    out = gpu_models.build_model(tmp_path / "model", "small-qwen2.5-vocab", spec)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    vocab = gpu_models.QWEN25_VOCAB
    assert len(tokenizer) == model.config.vocab_size == vocab == 151_936
    assert model.get_input_embeddings().weight.shape == (vocab, 32)
    assert (
        model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    )  # tied, as 1.5B's

    texts = tokenizer.batch_decode([[i] for i in range(vocab)])
    assert all(texts), [i for i, text in enumerate(texts) if not text][:10]
    assert texts[gpu_models.OFFLINE_VOCAB] == gpu_models.padding_token(gpu_models.OFFLINE_VOCAB)
    assert texts[-1] == gpu_models.padding_token(vocab - 1)
    # An answer as a random model samples it (ids from the whole vocabulary, nearly all padding ones)
    # decodes to text that encodes back to its padding tokens: a multi-turn run resends answers as text.
    ids = random.Random(0).choices(range(gpu_models.OFFLINE_VOCAB, vocab), k=200)
    assert tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] == ids
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    chat = tokenizer(text, add_special_tokens=False)["input_ids"]
    logits = model(torch.tensor([[*chat, *ids[:5]]])).logits
    assert logits.shape[-1] == vocab and torch.isfinite(logits).all()

    # A finished build is reused as it is.
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert gpu_models.build_model(out, "small-qwen2.5-vocab", spec) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
