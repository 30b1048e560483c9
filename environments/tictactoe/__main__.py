"""Train tic-tac-toe against a scripted opponent (multi-turn; prefix-cache hits on SGLang):
`python -m environments.tictactoe --model Qwen/Qwen2.5-1.5B-Instruct --steps 20`. With `--action-mask`
every move is sampled under an action mask (only free cells' digits), and trained under it."""

import argparse

from environments.common import main
from environments.tictactoe import TicTacToeTask

flags = argparse.ArgumentParser(add_help=False)
flags.add_argument("--action-mask", action="store_true")
known, rest = flags.parse_known_args()
task = (
    TicTacToeTask(name="tic-tac-toe-masked", max_tokens=1, action_mask=True)
    if known.action_mask
    else TicTacToeTask()
)
main(task, __doc__, rest)
