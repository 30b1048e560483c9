"""Example RL tasks with reward functions, each runnable end to end: `python -m environments.<name>` for
char_share, arithmetic, tictactoe and calculator (environments/README.md)."""
