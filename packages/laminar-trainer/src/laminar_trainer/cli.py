"""``laminar-trainer``: ``run`` (the trainer) and ``warmstart`` (build the demo's tiny model).

Arguments are parsed and the config validated completely before torch or
transformers are imported, so ``--help`` and config errors are instant.
Logging is configured here, once.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="laminar-trainer",
                                description="Laminar trainer tier: streaming GRPO.")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the trainer")
    r.add_argument("--config", help="YAML or TOML config file")
    r.add_argument("--set", action="append", default=[], metavar="A.B=C",
                   help="override a config field (repeatable)")
    r.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in checkpoint.dir")
    r.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    w = sub.add_parser("warmstart", help="build, briefly supervise and save the demo's tiny model")
    w.add_argument("--out", required=True, help="output directory (save_pretrained)")
    w.add_argument("--task", default="sort", help="synthetic task (sort, reverse, add)")
    w.add_argument("--steps", type=int, default=None,
                   help="supervised steps (the most of them with --target-accuracy)")
    w.add_argument("--difficulty", action="append", default=[], metavar="KEY=INT",
                   help="task difficulty override, e.g. max_len=6 (repeatable)")
    w.add_argument("--demo-error-rate", type=float, default=0.0,
                   help="fraction of demonstrations answering with the task's plausible mistake")
    w.add_argument("--target-accuracy", type=float, default=None,
                   help="stop once greedy accuracy on unseen train prompts reaches this")
    w.add_argument("--seed", type=int, default=0, help="seed")
    w.add_argument("--force", action="store_true", help="rebuild even if --out holds a model")
    return p


def _warmstart(args) -> int:
    from pathlib import Path

    import torch

    from laminar_common.launch.tasks import parse_difficulty

    from .warmstart import DEFAULT_WARM_START_STEPS, warm_start

    out = Path(args.out)
    if (out / "warm_start.json").is_file() and not args.force:
        print(f"warm start: {out} already holds a model "
              f"({(out / 'warm_start.json').read_text().strip()[:200]}); --force rebuilds it")
        return 0
    torch.set_num_threads(2)
    try:
        result = warm_start(
            out, task=args.task, seed=args.seed,
            steps=args.steps if args.steps is not None else DEFAULT_WARM_START_STEPS,
            difficulty=parse_difficulty(args.task, args.difficulty),
            demo_error_rate=args.demo_error_rate, target_accuracy=args.target_accuracy)
    except ValueError as exc:
        print(f"laminar-trainer warmstart: {exc}", file=sys.stderr)
        return 2
    print("warm start: " + json.dumps({k: v for k, v in vars(result).items()
                                       if isinstance(v, (int, float, str))}))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "warmstart":
        return _warmstart(args)
    from laminar_common.config import dump_config, load_config
    from laminar_common.errors import LaminarError
    from laminar_common.logs import setup_logging

    from .config import TrainerConfig

    try:
        config = load_config(TrainerConfig, args.config, args.set)
        if config.model_dir is None and config.simulate is None:
            raise LaminarError("trainer config: set model_dir (or simulate, for benchmarks)")
    except LaminarError as exc:
        print(f"laminar-trainer run: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(dump_config(config))
        return 0
    from .distributed import init_distributed

    try:
        dist = init_distributed(config.device, config.batch_groups, config.wait_timeout_s + 600)
    except LaminarError as exc:
        print(f"laminar-trainer run: {exc}", file=sys.stderr)
        return 2
    member = config.trainer_id if dist is None else f"{config.trainer_id}/rank{dist.rank}"
    setup_logging(config.logging.level, config.job, member, config.logging.json_format)
    if dist is None or dist.is_main:
        logging.getLogger(__name__).info("resolved config:\n%s", dump_config(config))
    try:
        if dist is not None and not dist.is_main:
            from .training import run_follower

            return run_follower(config, dist)
        from .service import TrainerService

        return TrainerService(config, resume=args.resume, dist=dist).run_forever()
    except LaminarError as exc:
        print(f"laminar-trainer run: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if dist is not None:
            dist.close()


if __name__ == "__main__":
    sys.exit(main())
