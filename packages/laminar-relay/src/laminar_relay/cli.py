"""``laminar-relay``: the relay tier's command line.

Owns argument parsing, loading and validating the config (file < ``LAMINAR_*``
env < ``--set``), logging set-up and the exit code. Heavy modules (gRPC,
ZeroMQ, the service) are imported only after the arguments are parsed, so
``--help`` is instant; the config is validated completely before anything
starts.

Exit codes: 0 closed on request (SIGINT/SIGTERM), 1 failed, 2 bad config or
arguments.
"""

from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["main", "build_parser"]

log = logging.getLogger("laminar_relay.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="laminar-relay",
        description="Laminar relay tier: versioned weight store and pipelined chain broadcast.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="run one relay (registers in etcd, joins the chain)",
        description="Run one relay. Config precedence: defaults < --config file < "
        "LAMINAR_A__B env vars < --set a.b=c.",
    )
    serve.add_argument("--config", "-c", metavar="FILE", help="YAML or TOML config file")
    serve.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="A.B=C",
        help="override one config field (repeatable), e.g. --set store.keep_versions=3",
    )
    serve.add_argument(
        "--check", action="store_true", help="validate the config, print it resolved, and exit"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from laminar_common.config import dump_config, load_config
    from laminar_common.errors import ConfigError, LaminarError
    from laminar_common.logs import setup_logging

    from .config import RelayConfig

    try:
        config = load_config(RelayConfig, args.config, args.overrides)
    except ConfigError as exc:
        print(f"laminar-relay: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(dump_config(config))
        return 0

    from .service import default_member_id, make_relay_service

    if config.member_id is None:
        config = config.model_copy(update={"member_id": default_member_id()})
    setup_logging(
        config.logging.level,
        job=config.job,
        member=config.member_id or "",
        json_format=config.logging.json_format,
    )
    log.info("resolved config:\n%s", dump_config(config))
    try:
        service = make_relay_service(config)
        return service.run_forever()
    except LaminarError as exc:
        log.error("relay failed: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
