"""``laminar-examples``: the set-up steps of the example jobs in ``examples/``.

``prompts`` writes prompt records (the synthetic tasks as JSONL, the math example's word
problems as a verl parquet), ``warmstart`` builds and briefly supervises the demo's tiny
model, ``warmstart-chat`` the math example's chat model.

A click group built with :mod:`laminar_common.clitools`, like every Laminar CLI.
Arguments are parsed before anything heavy is imported: ``prompts`` needs laminar-common
only (pyarrow for ``--task math``), the warm starts import torch and transformers when
they run (``pip install 'laminar-examples[train]'``; without them a warm start exits 2
saying so).

Environment: every option can also come from ``LAMINAR_EXAMPLES_<COMMAND>_<OPTION>``
(click's ``auto_envvar_prefix``; ``--help`` names each one), e.g.
``LAMINAR_EXAMPLES_PROMPTS_N=100``; the command line wins.

Shell completion (bash; ``zsh_source`` and ``fish_source`` likewise)::

    eval "$(_LAMINAR_EXAMPLES_COMPLETE=bash_source laminar-examples)"

Exit codes: 0 done (also when ``--out`` already holds the output: it is left as it is),
2 bad arguments, a bad task, difficulty or split, or a warm start without torch or
laminar-trainer (printed as one line, ``laminar-examples CMD: ...``).
"""

from __future__ import annotations

import json
import sys

import click

from laminar_common import clitools

__all__ = ["main", "cli"]

_CONTEXT = clitools.context("LAMINAR_EXAMPLES")
_option = clitools.option


@click.group(context_settings=_CONTEXT,
             help="Laminar's examples: prompt files and warm-started models for the jobs "
                  "in examples/.")
def cli() -> None:
    """The ``laminar-examples`` group; each command imports what it needs when it runs."""


def _train_extra(command: str) -> bool:
    """Whether the warm starts' dependencies import; if not, says what to install."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401

        import laminar_trainer  # noqa: F401
    except ImportError as exc:
        print(f"laminar-examples {command}: {exc}; the warm starts need torch, transformers "
              "and laminar-trainer: pip install 'laminar-examples[train]'", file=sys.stderr)
        return False
    return True


def _math_prompts(n: int, split: str, seed: int, out: str, difficulty: tuple[str, ...]) -> int:
    from pathlib import Path

    from .math_tasks import parse_math_difficulty, write_math_prompts

    if Path(out).is_file():
        print(f"{out} exists; leaving it")
        return 0
    try:
        written = write_math_prompts(out, n, split, seed, **parse_math_difficulty(list(difficulty)))
    except (ValueError, ImportError) as exc:
        print(f"laminar-examples prompts: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {written} math records ({split}, verl parquet) to {out}")
    return 0


@cli.command(help="Write prompt records: synthetic tasks as JSONL, math as verl parquet.")
@_option("--task", default="sort", help="sort, reverse, add, repeat or math (math: --out *.parquet)")
@_option("--n", type=int, default=1000, help="number of records")
@_option("--split", type=click.Choice(["train", "eval"]), default="train", help="split")
@_option("--seed", type=int, default=0, help="seed")
@_option("--out", required=True, type=click.Path(), help="output .jsonl path")
@_option("--difficulty", multiple=True, metavar="KEY=INT",
         help="task difficulty override, e.g. max_len=6 (repeatable)")
def prompts(task: str, n: int, split: str, seed: int, out: str,
            difficulty: tuple[str, ...]) -> int:
    from pathlib import Path

    if task == "math":
        return _math_prompts(n, split, seed, out, difficulty)
    from .tasks import make_task_records, parse_difficulty, write_jsonl

    try:
        records = make_task_records(task, n, seed, split=split,
                                    **parse_difficulty(task, list(difficulty)))
    except ValueError as exc:
        print(f"laminar-examples prompts: {exc}", file=sys.stderr)
        return 2
    if Path(out).is_file():
        print(f"{out} exists; leaving it")
        return 0
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    written = write_jsonl(out, records)
    print(f"wrote {written} {task} records ({split}) to {out}")
    return 0


def _warm_start(command: str, out: str, force: bool, run) -> int:
    """What both warm starts do around ``run(out_dir)``: check the ``train`` extra, leave a
    model already in ``out`` (unless ``force``), train on two threads, print the result; a
    bad difficulty or task (ValueError) is exit 2, one line on stderr."""
    from pathlib import Path

    if not _train_extra(command):
        return 2
    import torch

    out_dir = Path(out)
    if (out_dir / "warm_start.json").is_file() and not force:
        print(f"warm start: {out_dir} already holds a model "
              f"({(out_dir / 'warm_start.json').read_text().strip()[:200]}); --force rebuilds it")
        return 0
    torch.set_num_threads(2)
    try:
        result = run(out_dir)
    except ValueError as exc:
        print(f"laminar-examples {command}: {exc}", file=sys.stderr)
        return 2
    print("warm start: " + json.dumps({k: v for k, v in vars(result).items()
                                       if isinstance(v, (int, float, str))}))
    return 0


@cli.command(short_help="build, briefly supervise and save the demo's tiny model",
             help="Build, briefly supervise and save the demo's tiny model.")
@_option("--out", required=True, type=click.Path(), help="output directory (save_pretrained)")
@_option("--task", default="sort", help="synthetic task (sort, reverse, add, repeat)")
@_option("--steps", type=int, default=None,
         help="supervised steps (the most of them with --target-accuracy)")
@_option("--difficulty", multiple=True, metavar="KEY=INT",
         help="task difficulty override, e.g. max_len=6 (repeatable)")
@_option("--demo-error-rate", type=float, default=0.0,
         help="fraction of demonstrations answering with the task's plausible mistake")
@_option("--target-accuracy", type=float, default=None,
         help="stop once greedy accuracy on unseen train prompts reaches this")
@_option("--seed", type=int, default=0, help="seed")
@_option("--force", is_flag=True, help="rebuild even if --out holds a model")
def warmstart(out: str, task: str, steps: int | None, difficulty: tuple[str, ...],
              demo_error_rate: float, target_accuracy: float | None, seed: int,
              force: bool) -> int:
    def run(out_dir):
        from .tasks import parse_difficulty
        from .warmstart import DEFAULT_WARM_START_STEPS, warm_start

        return warm_start(
            out_dir, task=task, seed=seed,
            steps=steps if steps is not None else DEFAULT_WARM_START_STEPS,
            difficulty=parse_difficulty(task, list(difficulty)),
            demo_error_rate=demo_error_rate, target_accuracy=target_accuracy)

    return _warm_start("warmstart", out, force, run)


@cli.command("warmstart-chat",
             short_help="build, warm-start and save the math example's chat model",
             help="Build a small Qwen2-shaped chat model (BPE tokenizer, ChatML template), "
                  "warm-start it on arithmetic word problems and save it (save_pretrained).")
@_option("--out", required=True, type=click.Path(), help="output directory (save_pretrained)")
@_option("--steps", type=int, default=None, help="supervised steps (default 300)")
@_option("--difficulty", multiple=True, metavar="KEY=INT",
         help="problem difficulty override, e.g. max_value=9 (repeatable)")
@_option("--demo-error-rate", type=float, default=0.0,
         help="fraction of demonstrations making the problem's plausible reasoning mistake")
@_option("--seed", type=int, default=0, help="seed")
@_option("--force", is_flag=True, help="rebuild even if --out holds a model")
def warmstart_chat(out: str, steps: int | None, difficulty: tuple[str, ...],
                   demo_error_rate: float, seed: int, force: bool) -> int:
    def run(out_dir):
        from .chat_warmstart import DEFAULT_CHAT_STEPS, warm_start_chat
        from .math_tasks import parse_math_difficulty

        return warm_start_chat(
            out_dir, steps=steps if steps is not None else DEFAULT_CHAT_STEPS, seed=seed,
            difficulty=parse_math_difficulty(list(difficulty)), demo_error_rate=demo_error_rate)

    return _warm_start("warmstart-chat", out, force, run)


def main(argv: list[str] | None = None) -> int:
    """``laminar-examples`` on ``argv`` (default ``sys.argv[1:]``): its exit code
    (:func:`laminar_common.clitools.run`)."""
    return clitools.run(cli, argv, "laminar-examples")


if __name__ == "__main__":
    sys.exit(main())
