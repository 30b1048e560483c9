"""The demo: RL on the character-share task (environments/char_share) through SGLangBackend, printing
the mean reward and the timings of every step, then where the reward curve (PNG), the per-step results
(JSON) and the run's history.jsonl are.

Without --model it builds the tiny offline model and runs on CPU through the reference engine (about a
minute on 2 cores, more on a busy machine): the reward climbs from 0.3 to 1.0 in about 20 steps, and the
run stops at the first step whose every rollout scores 1.0 (at most --steps). With --model and a GPU it
drives real SGLang.

    python scripts/demo.py                                   # CPU, tiny model
    python scripts/demo.py --model Qwen/Qwen2.5-0.5B-Instruct --learning-rate 1e-5 --steps 20
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # environments/ from a source checkout

from environments.char_share import STEPS, CharShareTask
from environments.common import main

if __name__ == "__main__":
    main(CharShareTask(), __doc__, steps=STEPS, project="demo")
