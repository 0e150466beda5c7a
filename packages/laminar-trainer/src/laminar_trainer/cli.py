"""``laminar-trainer``: ``run`` (the trainer), ``export`` (a checkpoint's model as a clean
Hugging Face directory) and ``replay`` (recompute a step). The demo's warm starts are
``laminar-examples warmstart`` / ``warmstart-chat`` (the laminar-examples package).

A click group. Arguments are parsed and the config validated completely
before torch or transformers are imported, so ``--help``, shell completion
and config errors are instant. Logging is configured here, once.

Environment:
    * Config fields of ``run``: ``LAMINAR_A__B=c`` sets ``a.b`` (a YAML
      scalar), read by :func:`laminar_common.config.load_config`; precedence
      is defaults < ``--config`` file < ``LAMINAR_*`` env < ``--set a.b=c``.
    * Options: ``LAMINAR_TRAINER_<COMMAND>_<OPTION>`` (click's
      ``auto_envvar_prefix``), e.g. ``LAMINAR_TRAINER_RUN_CONFIG=t.yaml`` or
      ``LAMINAR_TRAINER_RUN_RESUME=1``; the command line wins. ``--set`` is
      command-line only. No option's variable names a config field.

Shell completion (bash; ``zsh_source`` and ``fish_source`` likewise)::

    eval "$(_LAMINAR_TRAINER_COMPLETE=bash_source laminar-trainer)"

Exit codes: 0 done, 2 bad arguments, a bad config or a
:class:`~laminar_common.errors.LaminarError` (printed as one line,
``laminar-trainer CMD: ...``).
"""

from __future__ import annotations

import logging
import sys

import click

from laminar_common import clitools

__all__ = ["main", "cli"]

_CONTEXT = clitools.context("LAMINAR_TRAINER")
_option = clitools.option


@click.group(context_settings=_CONTEXT, help="Laminar trainer tier: streaming GRPO.")
def cli() -> None:
    """The ``laminar-trainer`` group; each command imports torch only when it runs."""


@cli.command(short_help="run the trainer",
             help="Run the trainer. Config precedence: defaults < --config file < "
                  "LAMINAR_A__B=c env vars < --set a.b=c.")
@clitools.config_option()
@clitools.set_option()
@_option("--resume", is_flag=True, help="continue from the latest checkpoint in checkpoint.dir")
@_option("--print-config", is_flag=True, help="print the resolved config and exit")
def run(config: str | None, overrides: tuple[str, ...], resume: bool, print_config: bool) -> int:
    return _run(config, overrides, resume, print_config)


def _run(path: str | None, overrides: tuple[str, ...], resume: bool, print_config: bool) -> int:
    from laminar_common.errors import LaminarError
    from laminar_common.service import serve as serve_tier

    from .config import TrainerConfig

    def prepare(config: TrainerConfig) -> TrainerConfig:
        if config.model_dir is None and config.simulate is None:
            raise LaminarError("trainer config: set model_dir (or simulate, for benchmarks)")
        return config

    def context(config: TrainerConfig):
        from .distributed import init_distributed

        return init_distributed(config.device, config.batch_groups, config.wait_timeout_s + 600,
                                config.optim.mini_batches)

    def member(config: TrainerConfig, dist) -> str:
        return config.trainer_id if dist is None else f"{config.trainer_id}/rank{dist.rank}"

    def run(config: TrainerConfig, dist) -> int:
        if dist is not None and not dist.is_main:
            from .policy import run_follower

            return run_follower(config, dist)
        from .service import make_trainer_service

        return make_trainer_service(config, resume=resume, dist=dist).run_forever()

    return serve_tier("laminar-trainer run", TrainerConfig, path, overrides,
                      print_only=print_config, prepare=prepare, context=context, member=member,
                      run=run, logger=logging.getLogger(__name__))


@cli.command(short_help="export a checkpoint's model as a Hugging Face directory",
             help="Export the model of a checkpoint (CHECKPOINT: a checkpoint.dir, one "
                  "step-N checkpoint in it (full or sharded), or a model directory such as the "
                  "final one) as "
                  "a clean Hugging Face directory: safetensors weights in --dtype, "
                  "config.json, generation_config.json and the tokenizer with its chat "
                  "template; no optimizer or trainer state.")
@click.argument("checkpoint", type=click.Path())
@_option("--out", required=True, type=click.Path(),
         help="output directory (absent or empty, unless --force)")
@_option("--dtype", type=click.Choice(["bf16", "fp32", "fp16"]), default="bf16",
         help="dtype of the exported weights (fp32: the trainer's master weights as they are)")
@_option("--force", is_flag=True, help="replace a non-empty --out")
def export(checkpoint: str, out: str, dtype: str, force: bool) -> int:
    from laminar_common.errors import LaminarError
    from laminar_common.logs import setup_logging

    setup_logging("WARNING")
    from transformers.utils import logging as hf_logging

    from .export import export_model, resolve_model_dir

    hf_logging.disable_progress_bar()

    try:
        source = resolve_model_dir(checkpoint)
        written = export_model(source, out, dtype, force=force)
    except LaminarError as exc:
        print(f"laminar-trainer export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {source} as {dtype} to {written}")
    return 0


@cli.command(short_help="recompute a step and compare it with its checkpoint",
             help="Recompute step --step of a run (RUN_DIR: the job's or the trainer's run "
                  "directory) from the checkpoint before it and the step's record, and "
                  "compare every weight with the checkpoint after it: bit-exact on the same "
                  "machine and environment, else each differing tensor with its largest "
                  "difference. Without --step: the replayable steps. Exit 0: exact (or "
                  "listed); 1: differs; 2: cannot.")
@click.argument("run_dir", type=click.Path(exists=True))
@_option("--step", type=int, default=None, help="the step to recompute")
def replay(run_dir: str, step: int | None) -> int:
    from laminar_common.logs import setup_logging

    setup_logging("WARNING")
    from .replay import main as replay_main

    return replay_main([run_dir, *(["--step", str(step)] if step is not None else [])])


def main(argv: list[str] | None = None) -> int:
    """``laminar-trainer`` on ``argv`` (default ``sys.argv[1:]``): its exit code (:func:`clitools.run`)."""
    return clitools.run(cli, argv, "laminar-trainer")


if __name__ == "__main__":
    sys.exit(main())
