"""Train tic-tac-toe against a scripted opponent (multi-turn; prefix-cache hits on SGLang):
`python -m environments.tictactoe --model Qwen/Qwen2.5-1.5B-Instruct --steps 20`."""

from environments.common import main
from environments.tictactoe import TicTacToeTask

main(TicTacToeTask(), __doc__)
