"""Example RL tasks with reward functions, runnable end to end (`python -m environments.char_share`)."""
