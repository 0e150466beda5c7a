"""``laminar-relay``: the relay tier's command line.

Owns argument parsing (a click group), loading and validating the config,
logging set-up and the exit code. Heavy modules (gRPC, ZeroMQ, pydantic, the
service) are imported only inside the command body, so ``--help`` and shell
completion are instant; the config is validated completely before anything
starts.

Environment:
    * Config fields: ``LAMINAR_A__B=c`` sets ``a.b`` (a YAML scalar), read by
      :func:`laminar_common.config.load_config`; precedence is defaults <
      ``--config`` file < ``LAMINAR_*`` env < ``--set a.b=c``.
    * Options: ``LAMINAR_RELAY_SERVE_<OPTION>`` (click's
      ``auto_envvar_prefix``), e.g. ``LAMINAR_RELAY_SERVE_CONFIG=relay.yaml``
      or ``LAMINAR_RELAY_SERVE_CHECK=1``; the command line wins. ``--set`` is
      command-line only. No option's variable names a config field.

Shell completion (bash; ``zsh_source`` and ``fish_source`` likewise)::

    eval "$(_LAMINAR_RELAY_COMPLETE=bash_source laminar-relay)"

Exit codes: 0 closed on request (SIGINT/SIGTERM), 1 failed, 2 bad config or
arguments.
"""

from __future__ import annotations

import logging
import sys

import click

from laminar_common import clitools

__all__ = ["main", "cli"]

log = logging.getLogger("laminar_relay.cli")

_CONTEXT = clitools.context("LAMINAR_RELAY")
_option = clitools.option


@click.group(context_settings=_CONTEXT,
             help="Laminar relay tier: versioned weight store and pipelined chain broadcast.")
def cli() -> None:
    """The ``laminar-relay`` group; ``serve`` imports the service when it runs."""


@cli.command(short_help="run one relay (registers in etcd, joins the chain)",
             help="Run one relay. Config precedence: defaults < --config file < "
                  "LAMINAR_A__B env vars < --set a.b=c.")
@clitools.config_option("-c")
@clitools.set_option("--set store.keep_versions=3")
@_option("--check", is_flag=True, help="validate the config, print it resolved, and exit")
def serve(config: str | None, overrides: tuple[str, ...], check: bool) -> int:
    from laminar_common.service import serve as serve_tier

    from .config import RelayConfig

    def prepare(resolved: RelayConfig) -> RelayConfig:
        if resolved.member_id is not None or check:
            return resolved
        from .service import default_member_id

        return resolved.model_copy(update={"member_id": default_member_id()})

    def run(resolved: RelayConfig, _ctx: None) -> int:
        from .service import make_relay_service

        return make_relay_service(resolved).run_forever()

    return serve_tier("laminar-relay", RelayConfig, config, overrides, print_only=check,
                      prepare=prepare, member=lambda c, _ctx: c.member_id or "", run=run,
                      logger=log, failed=1)


def main(argv: list[str] | None = None) -> int:
    """``laminar-relay`` on ``argv`` (default ``sys.argv[1:]``): its exit code (:func:`clitools.run`)."""
    return clitools.run(cli, argv, "laminar-relay")


if __name__ == "__main__":
    sys.exit(main())
