"""``laminar-rollout``: ``serve`` (a generation worker) and ``manage`` (the rollout manager).

A click group. Arguments are parsed and the config validated completely
before anything heavy (torch, transformers, the services) is imported, so
``--help``, shell completion and config errors are instant. Logging is
configured here, once.

Environment:
    * Config fields: ``LAMINAR_A__B=c`` sets ``a.b`` (a YAML scalar), read by
      :func:`laminar_common.config.load_config`; precedence is defaults <
      ``--config`` file < ``LAMINAR_*`` env < ``--set a.b=c``.
    * Options: ``LAMINAR_ROLLOUT_<COMMAND>_<OPTION>`` (click's
      ``auto_envvar_prefix``), e.g. ``LAMINAR_ROLLOUT_MANAGE_CONFIG=m.yaml``
      or ``LAMINAR_ROLLOUT_MANAGE_RESUME=1``; the command line wins. ``--set``
      is command-line only. No option's variable names a config field.

Shell completion (bash; ``zsh_source`` and ``fish_source`` likewise)::

    eval "$(_LAMINAR_ROLLOUT_COMPLETE=bash_source laminar-rollout)"

Exit codes: 0 closed on request, 2 bad arguments, a bad config or a
:class:`~laminar_common.errors.LaminarError` from the service (printed as
one line, ``laminar-rollout CMD: ...``).
"""

from __future__ import annotations

import logging
import sys
import zlib

import click

from laminar_common import clitools

__all__ = ["main", "cli", "make_worker_service", "make_manager_service"]

_CONTEXT = clitools.context("LAMINAR_ROLLOUT")
_option = clitools.option
_EPILOG = ("Config precedence: defaults < --config file < LAMINAR_A__B=c env vars "
           "< --set a.b=c.")


def _config_options(fn):
    """The options ``serve`` and ``manage`` share."""
    for option in reversed((
        clitools.config_option(),
        clitools.set_option(),
        _option("--print-config", is_flag=True, help="print the resolved config and exit"),
    )):
        fn = option(fn)
    return fn


@click.group(context_settings=_CONTEXT, help="Laminar rollout tier: workers and the manager.")
def cli() -> None:
    """The ``laminar-rollout`` group; each command imports its service when it runs."""


@cli.command(short_help="run a generation worker", help="Run a generation worker.",
             epilog=_EPILOG)
@_config_options
def serve(config: str | None, overrides: tuple[str, ...], print_config: bool) -> int:
    return _run("serve", config, overrides, print_config, resume=False)


@cli.command(short_help="run the rollout manager", help="Run the rollout manager.",
             epilog=_EPILOG)
@_config_options
@_option("--resume", is_flag=True, help="restore the cursor and ledger saved in state_dir")
def manage(config: str | None, overrides: tuple[str, ...], print_config: bool,
           resume: bool) -> int:
    return _run("manage", config, overrides, print_config, resume=resume)


def _run(cmd: str, path: str | None, overrides: tuple[str, ...], print_config: bool,
         resume: bool) -> int:
    from laminar_common.service import serve as serve_tier

    from .config import ManagerConfig, WorkerConfig

    worker = cmd == "serve"

    def checks(config) -> list[str]:
        from .preflight import WARNING_PREFIX, check_manager, check_worker

        lines = check_worker(config) if worker else check_manager(config)
        return [f"{WARNING_PREFIX}{line}" for line in lines]

    def run(config, _ctx: None) -> int:
        service = make_worker_service(config) if worker else \
            make_manager_service(config, resume=resume)
        return service.run_forever()

    return serve_tier(f"laminar-rollout {cmd}", WorkerConfig if worker else ManagerConfig,
                      path, overrides, print_only=print_config, checks=checks, run=run,
                      member=lambda c, _ctx: c.worker_id if worker else c.manager_id,
                      logger=logging.getLogger(__name__))


def engine_config_for(eng, worker_id: str):
    """``eng`` with its ``seed`` filled in when unset: CRC-32 of ``worker_id``, so that the
    replicas of one job file (equal configs but for the id) draw different random streams
    (same-seeded workers would sample the same draws for a group's samples)."""
    if getattr(eng, "seed", 0) is None:
        return eng.model_copy(update={"seed": zlib.crc32(worker_id.encode())})
    return eng


def make_worker_service(config):
    """Build a :class:`WorkerService` (engine, tokenizer, relay fetcher) from its config."""
    from laminar_common.auth import TlsFiles
    from laminar_common.etcd import make_coordinator
    from laminar_common.relay.client import RelayClient

    from .engines import make_engine_from_config
    from .relay_fetch import make_relay_fetcher
    from .tokenizer import make_tokenizer
    from .worker import WorkerService

    eng = engine_config_for(config.engine, config.worker_id)
    engine = make_engine_from_config(eng)
    coordinator = make_coordinator(config.etcd, config.job)
    tls = TlsFiles.client_from_dir(config.auth.dir) if config.auth.dir else None
    if config.relay is not None:
        client = RelayClient(address=config.relay, client_id=config.worker_id, tls=tls,
                             host=config.host)
    else:
        client = RelayClient(coordinator, client_id=config.worker_id, tls=tls, host=config.host)
    fetcher = make_relay_fetcher(client, with_tensors=eng.type != "simulated",
                                 wait_s=config.fetch_timeout_s)
    return WorkerService(config, engine, make_tokenizer(eng), fetcher, coordinator=coordinator)


def make_manager_service(config, resume: bool = False):
    from .manager import ManagerService

    return ManagerService(config, resume=resume)


def main(argv: list[str] | None = None) -> int:
    """``laminar-rollout`` on ``argv`` (default ``sys.argv[1:]``): its exit code (:func:`clitools.run`)."""
    return clitools.run(cli, argv, "laminar-rollout")


if __name__ == "__main__":
    sys.exit(main())
