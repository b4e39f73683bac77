"""`python -m slime.backends.embedded --model-path DIR --port P`: run the embedded engine standalone.

The token for weight/memory/control endpoints comes from $SLIME_ENGINE_TOKEN (kept out of argv so
it does not show in process listings); without it a fresh token is printed once at start-up.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
import threading

from slime.accelerator.cli import one_line_errors

TOKEN_ENV = "SLIME_ENGINE_TOKEN"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m slime.backends.embedded", description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True, help="HF checkpoint directory")
    ap.add_argument("--tokenizer-path", default=None)
    ap.add_argument("--port", type=int, default=30000, help="port (0 = any free port)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (a multi-node run: the node's)")
    ap.add_argument("--dtype", default="auto", help="auto (float32 on CPU, checkpoint dtype on a device) or a dtype")
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--context-length", type=int, default=None)
    ap.add_argument("--random-seed", type=int, default=0)
    ap.add_argument("--return-original-logprob", action="store_true",
                    help="return logprobs of the raw (temperature 1) distribution instead of the sampled one")
    ap.add_argument("--attn-implementation", default=None)
    ap.add_argument("--enable-deterministic-inference", action="store_true",
                    help="each request computed alone: results independent of the batch (SGLang's option)")
    ap.add_argument("--tp-size", type=int, default=1, help="tensor parallel over this many processes (one per device)")
    ap.add_argument("--tp-rank", type=int, default=0, help="this process's TP rank; rank 0 serves HTTP, others follow it")
    ap.add_argument("--dist-init-addr", default=None, help="host:port of rank 0's rendezvous (with --tp-size > 1)")
    ap.add_argument("--log-level", default="info")
    return ap.parse_args(argv)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.tp_size > 1 and not args.dist_init_addr:
        raise SystemExit(f"--tp-size {args.tp_size} needs --dist-init-addr HOST:PORT (rank 0's rendezvous)")
    if args.tp_rank > 0:
        return _follow(args)
    from slime.backends.embedded import EmbeddedEngine, EngineConfig, EngineHTTPServer
    from slime.backends.embedded.errors import BadRequest

    token = os.environ.get(TOKEN_ENV) or ""
    if not token:
        token = secrets.token_hex(16)
        print(f"engine token (send as 'Authorization: Bearer <token>'): {token}", flush=True)
    # Bind first: a taken port fails in a second, not after loading the model; /health is 503 meanwhile.
    server = EngineHTTPServer(None, token, args.port, host=args.host)
    server.start_in_thread()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.engine = EmbeddedEngine(EngineConfig(
            model_path=args.model_path, tokenizer_path=args.tokenizer_path, dtype=args.dtype,
            max_running_requests=args.max_running_requests, context_length=args.context_length,
            random_seed=args.random_seed, original_logprobs=args.return_original_logprob,
            tp_size=args.tp_size, dist_init_addr=args.dist_init_addr,
            attn_implementation=args.attn_implementation, deterministic=args.enable_deterministic_inference))
    except BadRequest as e:  # a checkpoint it cannot serve (e.g. a malformed block-FP8 one): one line, exit 2
        server.stop()
        print(f"slime: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
        return 2
    print(f"embedded engine serving {args.model_path} at {server.url}", flush=True)
    stop.wait()
    server.stop()
    return 0


def _follow(args: argparse.Namespace) -> int:
    """TP rank > 0: load the same model, join rank 0's group and repeat its commands (no HTTP server); the
    process's exit code (main's caller ends through exits.end_entry_point, as rank 0 does)."""
    from slime.backends.embedded import EmbeddedEngine, EngineConfig
    from slime.backends.embedded.tensor_parallel import follow

    engine = EmbeddedEngine(EngineConfig(
        model_path=args.model_path, tokenizer_path=args.tokenizer_path, dtype=args.dtype,
        context_length=args.context_length, attn_implementation=args.attn_implementation,
        tp_size=args.tp_size, tp_rank=args.tp_rank, dist_init_addr=args.dist_init_addr))
    print(f"embedded engine TP rank {args.tp_rank}/{args.tp_size} following {args.dist_init_addr}", flush=True)
    try:
        follow(engine, engine.tp_group)
    except RuntimeError as e:  # rank 0 went away (its process ended): this rank has nothing left to serve
        print(f"embedded engine TP rank {args.tp_rank}: rank 0 is gone ({str(e).splitlines()[0]})", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    from slime.utils.exits import end_entry_point

    end_entry_point(main())
