"""What every Laminar command line shares (click): context, options, the exit code.

Each tier's ``cli.py`` is a click group built with these, so ``--config``,
``--set a.b=c``, option environment variables, ``-h`` and error handling read
the same everywhere. Importing this module imports click only.

Environment: a group made with :func:`context` reads every option from
``<PREFIX>_<COMMAND>_<OPTION>`` (click's ``auto_envvar_prefix``), shown in
``--help``; the command line wins. ``--set`` is command-line only, and config
fields keep their own ``LAMINAR_A__B=c`` variables (read by
:func:`laminar_common.config.load_config`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import click

__all__ = ["context", "option", "config_option", "set_option", "run"]

option = partial(click.option, show_envvar=True)
"""``click.option`` that shows its environment variable in ``--help``."""


def context(envvar_prefix: str) -> dict[str, Any]:
    """Context settings for a group: ``-h``, defaults shown, option env vars."""
    return {"help_option_names": ["-h", "--help"], "auto_envvar_prefix": envvar_prefix,
            "show_default": True}


def config_option(*names: str) -> Callable:
    """``--config FILE`` (YAML or TOML); extra ``names`` such as ``-c`` are aliases."""
    return option("--config", *names, metavar="FILE", type=click.Path(),
                  help="YAML or TOML config file")


def set_option(example: str = "--set a.b=c") -> Callable:
    """``--set A.B=C`` (repeatable, command line only) into ``overrides``."""
    return click.option("--set", "overrides", multiple=True, metavar="A.B=C",
                        allow_from_autoenv=False,
                        help=f"override one config field (repeatable), e.g. {example}")


def run(group: click.Group, argv: list[str] | None, prog_name: str) -> int:
    """Run ``group`` on ``argv`` (default ``sys.argv[1:]``); return its exit code.

    Usage errors print click's message and return 2. With the group's
    ``_<PROG>_COMPLETE`` variable set, prints the completion script and exits
    (``SystemExit``), as click does.
    """
    try:
        return group.main(argv, prog_name=prog_name, standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.Abort as exc:  # Ctrl-C before a service took over the signals
        raise KeyboardInterrupt from exc
