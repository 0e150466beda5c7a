"""What every Laminar CLI's tests check the same way: a clean ``LAMINAR_*`` environment,
each option's environment variable, ``--help`` naming every option and variable, and
click's shell completion. Each package's ``test_cli.py`` calls these with its own group."""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["assert_completion", "assert_help_lists_options", "clear_laminar_env", "complete", "completion_script",
           "option_envvars", "run_fresh"]


def clear_laminar_env(monkeypatch) -> None:
    """Remove every ``LAMINAR_*`` variable (a CLI test starts from a clean environment)."""
    import os

    for name in list(os.environ):
        if name.startswith("LAMINAR_"):
            monkeypatch.delenv(name)


def option_envvars(group, prog_name: str, envvar_prefix: str, command_name: str) -> dict[str, str]:
    """``--option`` -> the variable click reads it from, as ``--help`` shows it."""
    import click

    root = click.Context(group, info_name=prog_name, auto_envvar_prefix=envvar_prefix)
    ctx = click.Context(group.commands[command_name], info_name=command_name, parent=root)
    return {p.opts[0]: f"{ctx.auto_envvar_prefix}_{p.name.upper()}"
            for p in ctx.command.params
            if isinstance(p, click.Option) and p.allow_from_autoenv}


def assert_help_lists_options(group, main: Callable[[Sequence[str]], int], prog_name: str,
                              envvar_prefix: str, command: str, capsys) -> str:
    """``main([command, "--help"])`` exits 0 with click's usage line and names every option,
    every argument (in its usage form) and every option's environment variable; returns
    the help text."""
    import click

    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Usage: {prog_name} {command} [OPTIONS]"), out
    for param in group.commands[command].params:
        if isinstance(param, click.Option):
            for opt in param.opts:
                assert opt in out, (opt, out)
        else:
            assert param.human_readable_name in out, (param.name, out)
    flat = out.replace("\n", "").replace(" ", "")
    for envvar in option_envvars(group, prog_name, envvar_prefix, command).values():
        assert envvar in flat, (envvar, out)
    return out


def _complete_var(prog_name: str) -> str:
    return "_" + prog_name.replace("-", "_").upper() + "_COMPLETE"


def completion_script(group, prog_name: str, shell: str = "bash") -> str:
    """The completion script click prints for ``shell`` (``eval "$(_PROG_COMPLETE=bash_source
    prog)"``); asserts it came out with exit code 0."""
    from click.testing import CliRunner

    result = CliRunner().invoke(group, [], prog_name=prog_name,
                                env={_complete_var(prog_name): f"{shell}_source"})
    assert result.exit_code == 0, result.output
    return result.output


def complete(group, prog_name: str, words: str) -> list[str]:
    """What bash completion offers for the command line ``words`` (completing its last
    word, which may be empty): click's ``type,value`` items, e.g. ``["plain,--resume"]``."""
    from click.testing import CliRunner

    parts = words.split(" ")
    result = CliRunner().invoke(group, [], prog_name=prog_name, env={
        _complete_var(prog_name): "bash_complete", "COMP_WORDS": words,
        "COMP_CWORD": str(len(parts) - 1)})
    return result.output.split()


def assert_completion(group, main: Callable[[Sequence[str]], int], prog_name: str, monkeypatch,
                      offers: dict[str, list[str]], shell: str = "bash") -> None:
    """Shell completion works: the bash script registers ``prog_name``, completing each
    command line in ``offers`` gives its items (:func:`complete`), and the console
    script's ``main([])`` prints the ``shell`` script and exits 0."""
    import pytest

    fn = "_" + prog_name.replace("-", "_") + "_completion"
    assert f"complete -o nosort -F {fn} {prog_name}" in completion_script(group, prog_name)
    for words, items in offers.items():
        assert complete(group, prog_name, words) == items, words
    monkeypatch.setenv(_complete_var(prog_name), f"{shell}_source")
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 0


def run_fresh(code: str, heavy: Sequence[str], timeout_s: float = 60) -> tuple[object, list[str]]:
    """Run ``code`` in a fresh interpreter (its output swallowed); it sets ``result`` to
    something JSON can carry. Returns that result and the modules it imported whose top
    package is in ``heavy`` (what a ``--help`` must not import: torch, transformers, ...)."""
    import json
    import subprocess
    import sys
    import textwrap

    script = (
        "import contextlib, io, json, sys\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        + textwrap.indent(textwrap.dedent(code), "    ") + "\n"
        f"print(json.dumps([result, sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{tuple(heavy)!r})]))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=timeout_s)
    assert out.returncode == 0, out.stderr
    result, imported = json.loads(out.stdout.splitlines()[-1])
    return result, imported
