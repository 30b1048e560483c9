"""`python -m art_sglang_reference <flags>`: load the model, then serve until SIGTERM/SIGINT."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from types import FrameType

from art_sglang.sglang_env import KEEP_ALIVE_ENV

from .cli import log_ignored, parse_args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
    )
    log_ignored(args)
    # `kill -USR1 <pid>` writes every thread's stack to the log: the way to see what a stuck server does.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Heavy imports after argument parsing, so `--help` and flag errors are instant.
    import torch
    import uvicorn

    from .app import create_app
    from .engine import ReferenceEngine

    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    engine = ReferenceEngine(args)
    logging.getLogger("art_sglang_reference").info(
        "loaded %s in %.1fs (context %d, adapters %s)",
        args.model_path,
        engine.load_seconds,
        engine.context_length,
        list(engine.adapters.loaded) or "none",
    )
    app = create_app(args, engine)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
        # SGLang's variable and default, so the backend sets both engines' keep-alive the same way.
        timeout_keep_alive=int(os.environ.get(KEEP_ALIVE_ENV, "5")),
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # Stop generations at their next token so SIGTERM exits promptly, not after a long answer.
            engine.shutdown()
            super().handle_exit(sig, frame)

    server = Server(config)
    logging.getLogger("art_sglang_reference").info(
        "The server is fired up and ready to roll! http://%s:%d", args.host, args.port
    )
    server.run()


if __name__ == "__main__":
    main()
