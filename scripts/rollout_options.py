"""`bench_rollouts.py`'s command line: its options, the checks of which side takes which, and the side
a parsed command line measures, in words."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from bench_common import (
    DEFAULT_LORA_BACKEND,
    DEFAULT_LORA_EXPERIMENTAL_PATH,
    add_server_args,
    server_settings,
    sglang_config,
)
from rollout_targets import CLIENTS, DROPS, ROUTES
from rollout_workloads import DEFAULT_RUNS, KINDS, run_spec

from art_sglang.serving.servers.sglang_site import art_sglang_backports as backports


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The options of `bench_rollouts.py` (`description`: its help text)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_server_args(parser, engines=("sglang", "reference", "vllm"))
    parser.set_defaults(lora_rank=16)
    parser.add_argument("--side", choices=("backend", "direct"), default="backend")
    parser.add_argument("--label", default="", help="the pass this side is, e.g. A1 and A2 in an A/B/A order")
    parser.add_argument(
        "--runs", type=run_spec, nargs="+", default=[run_spec(r) for r in DEFAULT_RUNS],
        metavar="KIND-TOKENS:GROUPS[@CLIENT]", help=f"default: {' '.join(DEFAULT_RUNS)}",
    )  # fmt: skip
    parser.add_argument("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS))
    parser.add_argument(
        "--routes", nargs="+", choices=ROUTES, default=["gateway"],
        help="backend side: through its gateway, and/or straight to its own server as the gateway forwards",
    )  # fmt: skip
    parser.add_argument(
        "--off-kinds", nargs="*", choices=KINDS, default=[],
        help="backend side: the workloads that also run with prefill sharing off",
    )  # fmt: skip
    parser.add_argument(
        "--weights", choices=("lora", "merged"), default="lora",
        help="backend side: the adapter served by LoRA kernels, or merged into the weights the trainer pushes "
        "(weight_sync_method='merged', the server without LoRA)",
    )  # fmt: skip
    parser.add_argument(
        "--train-steps", type=int, default=None,
        help="backend side: steps trained (and served) before measuring; default 1 merged, 0 lora",
    )  # fmt: skip
    parser.add_argument(
        "--lora", action=argparse.BooleanOptionalAction, default=True,
        help="direct side: --no-lora serves the base weights (vLLM without --enable-lora) and names the base model",
    )  # fmt: skip
    parser.add_argument(
        "--flags", choices=("bench", "backend"), default="bench",
        help="direct SGLang: 'backend' launches it exactly as SGLangBackend does (its settled flags and keys)",
    )  # fmt: skip
    parser.add_argument("--drop", nargs="*", choices=sorted(DROPS), default=[], help="with --flags backend")
    parser.add_argument(
        "--request-form", choices=("name", "gateway"), default="name",
        help="direct SGLang: the adapter as <base>:<adapter>, or as the gateway forwards it (lora_path, "
        "return_token_ids)",
    )  # fmt: skip
    parser.add_argument(
        "--watchdog", action=argparse.BooleanOptionalAction, default=True,
        help="backend side: --no-watchdog keeps the backend's watchdog from probing its server (GET /health)",
    )  # fmt: skip
    parser.add_argument(
        "--beside-trainer", action="store_true",
        help="direct side: the backend's trainer worker started beside the server on its GPU, idle",
    )  # fmt: skip
    parser.add_argument(
        "--profile-run", default=None, metavar="KIND-TOKENS:GROUPS",
        help="sample every server process with py-spy during this run's first repeat (into --profile-dir)",
    )  # fmt: skip
    parser.add_argument("--profile-dir", type=Path, default=None, help="where --profile-run's samples go")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="tokens of a group's prompt body")
    parser.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation")
    parser.add_argument(
        "--varying-mean-fraction", type=float, default=1 / 3,
        help="varying: mean answer length as a share of the longest run's tokens",
    )  # fmt: skip
    parser.add_argument("--min-seconds", type=float, default=10.0, help="a run repeats waves this long")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ttft-requests", type=int, default=20, help="lone requests per setting (0: none)")
    parser.add_argument(
        "--deadline-s", type=float, default=None, help="start no run after this many seconds since the start"
    )
    parser.add_argument("--resume", action="store_true", help="skip configurations --json already holds")
    parser.add_argument(
        "--compare", type=Path, nargs="+", default=None, metavar="JSON",
        help="pool these results (no server started) into --json/--markdown",
    )  # fmt: skip
    return parser


def parse_arguments(description: str | None, argv: list[str]) -> argparse.Namespace:
    """`argv` parsed and checked (an option of the other side is an error); `--train-steps` settled."""
    parser = build_parser(description)
    if "--compare" in argv and "--model" not in argv:
        argv = [*argv, "--model", "-"]  # --compare reads the model from the results
    args = parser.parse_args(argv)
    if args.compare:
        return args
    if args.side == "backend" and args.engine == "vllm":
        parser.error("--side backend runs SGLangBackend: --engine sglang or reference")
    if args.side != "backend" and (args.weights != "lora" or args.train_steps):
        parser.error("--weights and --train-steps are for --side backend (direct: --no-lora)")
    if args.train_steps is None:
        args.train_steps = 1 if args.weights == "merged" else 0
    if args.weights == "merged" and args.train_steps < 1:
        parser.error("--weights merged measures weights the trainer pushed: --train-steps 1 or more")
    if (args.flags == "backend" or args.drop) and (args.side != "direct" or args.engine == "vllm"):
        parser.error("--flags backend and --drop are for --side direct --engine sglang (or reference)")
    if args.drop and args.flags != "backend":
        parser.error("--drop removes from the backend's flags: give --flags backend")
    if args.side == "backend" and args.beside_trainer:
        parser.error("--beside-trainer is for --side direct (the backend starts its own trainer)")
    if args.side != "backend" and not args.watchdog:
        parser.error("--no-watchdog is for --side backend (a direct server has no watchdog)")
    return args


def backport_changes(raw: str | None) -> list[str]:
    """The backports the `ART_SGLANG_BACKPORTS` value `raw` adds to (+) or takes from (-) the defaults."""
    chosen, default = set(backports.selection(raw)), set(backports.selection(None))
    changes = [f"+{name}" for name in sorted(chosen - default)] + [
        f"-{name}" for name in sorted(default - chosen)
    ]
    return [f"backports {' '.join(changes)}"] if changes else []


def variant(args: argparse.Namespace) -> str:
    """The server and request form of this side, in words."""
    kernels: list[str] = []  # SGLang's LoRA kernels where they are not SGLangConfig's
    if args.engine != "vllm":
        settings = server_settings(args)
        served = sglang_config(settings)
        usual = sglang_config(
            replace(
                settings,
                lora_backend=DEFAULT_LORA_BACKEND,
                lora_experimental_path=DEFAULT_LORA_EXPERIMENTAL_PATH,
            )
        )
        if (served.lora_backend, served.experimental_lora_served) != (
            usual.lora_backend,
            usual.experimental_lora_served,
        ):
            path = "experimental path" if served.experimental_lora_served else "no experimental path"
            kernels.append(f"--lora-backend {args.lora_backend} {path}")
    # ART_SGLANG_BACKPORTS other than the defaults (suite.sh's BACKPORTS_WITH): a server of its own.
    changes = backport_changes(os.environ.get(backports.SELECT_ENV)) if args.engine == "sglang" else []
    if args.side == "backend":
        return ", ".join([args.weights, *kernels, *changes]) + ("" if args.watchdog else ", no watchdog")
    words = ["lora" if args.lora else "base"]
    if args.flags == "backend":
        words.append("backend flags" + "".join(f" -{name}" for name in args.drop))
    words += kernels if args.lora else []
    if args.sglang_args:  # last on the command line: they win over the flags above (issue 39's r39-lora-*)
        words.append(" ".join(args.sglang_args))
    if args.engine != "vllm" and args.lora and args.request_form == "gateway":
        words.append("gateway form")
    if args.beside_trainer:
        words.append("beside an idle trainer")
    return ", ".join([*words, *changes])
