"""The trainer learns on CPU: a fixed synthetic task (reward = share of digit tokens in the answer),
trained through the real worker process on the tiny model; the rewarded answers become more likely and
the unrewarded ones less likely. Each step's Choices carry the current policy's own logprobs, scored
from the newest checkpoint loaded in peft (which also proves the adapters load there)."""

from __future__ import annotations

from pathlib import Path
from statistics import mean

from training_helpers import Scorer, group, trajectory

from art_sglang.config import TrainerConfig
from art_sglang.training.options import TrainOptions
from art_sglang.training.process import TrainerProcess

PROMPTS = ["Write something.", "Say a few words.", "Go on."]
# Tokens of the tiny tokenizer: digits are single tokens, so the reward is the digit share per token.
ANSWERS = ["7 3 9 1", "4 a 8 b", "x 5 y z", "the cat is"]
STEPS = 10


def digit_share(tokenizer, text: str) -> float:
    tokens = [tokenizer.decode([i]).strip() for i in tokenizer.encode(text, add_special_tokens=False)]
    tokens = [t for t in tokens if t]
    return sum(t.isdigit() for t in tokens) / len(tokens)


def mean_logprob(scorer: Scorer, answers: list[str]) -> float:
    return mean(mean(scorer.token_logprobs(p, a)) for p in PROMPTS for a in answers)


async def test_rewarded_answers_become_likelier(tiny_model_path: Path, tmp_path: Path) -> None:
    trainer = TrainerProcess(
        str(tiny_model_path),
        tmp_path / "checkpoints",
        TrainerConfig(seed=0),
        gpu_ids=None,
        log_path=tmp_path / "trainer.log",
    )
    base = Scorer(tiny_model_path)
    rewards = {a: digit_share(base.tokenizer, a) for a in ANSWERS}
    rewarded = [a for a in ANSWERS if rewards[a] >= 0.5]
    unrewarded = [a for a in ANSWERS if rewards[a] == 0.0]
    assert rewarded and unrewarded
    try:
        step = await trainer.start()
        assert step == 0
        scorer = Scorer(tiny_model_path, tmp_path / "checkpoints" / "0000")
        for _ in range(STEPS):
            groups = [
                group([trajectory(p, scorer.scored_choice(p, a), rewards[a]) for a in ANSWERS])
                for p in PROMPTS
            ]
            outcome = await trainer.train(groups, TrainOptions(learning_rate=1e-2))
            assert outcome.trained and outcome.checkpoint_path is not None
            # The Choices carry the current policy's logprobs: the ratio starts at 1 (same weights).
            assert abs(outcome.metrics["ratio_mean"] - 1.0) < 1e-3
            assert outcome.metrics["tokenize/logprob_mismatch"] == 0
            scorer.use_adapter(outcome.checkpoint_path)
        assert outcome.step == STEPS
    finally:
        await trainer.stop()
    final = scorer
    before_good, after_good = mean_logprob(base, rewarded), mean_logprob(final, rewarded)
    before_bad, after_bad = mean_logprob(base, unrewarded), mean_logprob(final, unrewarded)
    print(f"rewarded {before_good:.3f} -> {after_good:.3f}; unrewarded {before_bad:.3f} -> {after_bad:.3f}")
    assert after_good > before_good + 0.5
    assert after_bad < before_bad - 0.5
