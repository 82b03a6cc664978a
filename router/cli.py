"""Subcommands of ``kvroute`` that belong to ``router``.

``kvroute serve --host H --port P --replica URL [--replica URL ...] [--config FILE]
[--policy NAME] [--log-level LEVEL] [--workers N]``: flags override ``KVROUTE_*`` variables, which
override the YAML file (``router.config``).  The command line is a stable interface.
Heavy imports (uvicorn, the app) happen inside the handler so ``kvroute --help`` is fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from router import indexer_cli

if TYPE_CHECKING:
    from router.config import RouterSettings

_SERVE_EPILOG = """\
configuration sources, lowest priority first: defaults, the YAML file (--config),
KVROUTE_* environment variables (nested fields with '__', e.g.
KVROUTE_TIMEOUTS__CONNECT_S=2; lists as JSON, e.g.
KVROUTE_REPLICAS='[{"url": "http://127.0.0.1:8000"}]'), then these flags.

example:
  kvroute serve --port 8080 --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002
"""


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add this layer's subcommands to the ``kvroute`` parser."""
    _register_serve(sub)
    indexer_cli.register(sub)


def _register_serve(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the router (an OpenAI-compatible proxy in front of vLLM replicas)",
        description="Run the kvroute router: an OpenAI-compatible streaming reverse proxy "
        "that routes each request to one of the replicas.",
        epilog=_SERVE_EPILOG,
    )
    p.add_argument("--host", default=None,
                   help="address to listen on (default 127.0.0.1; setting: host)")
    p.add_argument("--port", type=int, default=None,
                   help="port to listen on (default 8080; setting: port)")
    p.add_argument("--replica", metavar="URL", action="append", default=None,
                   help="base URL of an upstream replica, e.g. http://127.0.0.1:8000; repeat "
                   "for each replica (replaces the 'replicas' setting; its id is host:port)")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="YAML file with any settings (replicas, timeouts, health, failover, "
                   "index, scoring, connections, auth, ...)")
    p.add_argument("--policy", metavar="NAME", default=None,
                   help="routing policy: kv (KV-cache aware, the default), session, "
                   "round_robin, least_loaded or random; a request may pick another with "
                   "the X-KVRoute-Policy header (setting: policy)")
    p.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                   help="largest request body accepted; larger ones get 413 (default "
                   "8388608, 8 MiB; setting: max_body_bytes)")
    p.add_argument("--log-level", default=None,
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="log level (default info; setting: log_level)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="router processes on the one port (SO_REUSEPORT; default 1); see "
                   "router.workers for what they share")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    import logging

    from router.app import create_app
    from router.config import ConfigError, RouterSettings

    cli: dict[str, Any] = {}
    if args.host is not None:
        cli["host"] = args.host
    if args.port is not None:
        cli["port"] = args.port
    if args.replica:
        cli["replicas"] = [{"url": url} for url in args.replica]
    if args.policy is not None:
        cli["policy"] = args.policy
    if args.max_body_bytes is not None:
        cli["max_body_bytes"] = args.max_body_bytes
    if args.log_level is not None:
        cli["log_level"] = args.log_level
    if args.workers < 1:
        print("kvroute serve: --workers must be at least 1", file=sys.stderr)
        return 2
    try:
        settings = RouterSettings.load(config_file=args.config, cli=cli)
        check_model_files(settings)
        create_app(settings)  # validates the wiring before any process starts
    except ConfigError as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.workers > 1:
            from router.workers import run_workers

            return run_workers(settings.model_dump(mode="json"), settings.host,
                               settings.port, args.workers, settings.timeouts.shutdown_grace_s)
        from router.listen import bind_socket
        from router.serving import run_server

        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        print(f"kvroute serve: cannot listen on {settings.host}:{settings.port}: "
              f"{exc.strerror or exc} (another process holds the port? pick another --port)",
              file=sys.stderr)
        return 1
    return run_server(settings, sock)


def check_model_files(settings: RouterSettings) -> None:
    """``ConfigError`` naming the field when a model's local tokenizer cannot be found
    (before anything starts: the renderers load it at start-up)."""
    from prompt.tokenizer import resolve_model_dir
    from router.config import ConfigError

    for i, model in enumerate(settings.scoring.models):
        if model.tokenizer is None:
            continue
        try:
            resolve_model_dir(model.tokenizer)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"invalid kvroute configuration:\n  scoring.models.{i}.tokenizer: {exc} "
                f"(model {model.name!r}: set it to a local directory with tokenizer.json or "
                "a Hugging Face id in the local cache, or leave it out to render on the "
                "replicas)") from exc
