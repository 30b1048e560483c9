"""Names of the trainer worker's JSON-lines protocol (see worker.py), in a module of their own so the
parent side imports them without importing the worker module: `python -m art_sglang.training.worker`
would otherwise find the worker already in sys.modules and print runpy's RuntimeWarning at every start."""

from __future__ import annotations

PROGRESS, RESULT, ERROR = "progress", "result", "error"
INPUT_ERROR, STEP_ERROR, TRAINER_ERROR = "TrainingInputError", "TrainingError", "TrainerError"
# Commands rank 0 runs alone (the other ranks skip them): an error in one leaves the ranks in step, so it
# does not end a worker of several ranks.
MAIN_RANK_COMMANDS = ("push_merged", "join_update_group")
