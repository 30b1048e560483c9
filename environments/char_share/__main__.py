"""Train the character-share task: `python -m environments.char_share [--model M] [--steps N] ...`
(scripts/demo.py runs the same with the demo's project name)."""

from environments.char_share import STEPS, CharShareTask
from environments.common import main

main(CharShareTask(), __doc__, steps=STEPS)
