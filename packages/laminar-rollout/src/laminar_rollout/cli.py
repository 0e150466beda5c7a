"""``laminar-rollout``: ``serve`` (a generation worker) and ``manage`` (the rollout manager).

Arguments are parsed and the config validated completely before anything
heavy (torch, transformers) is imported, so ``--help`` and config errors are
instant. Logging is configured here, once.
"""

from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["main", "make_worker_service", "make_manager_service"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="laminar-rollout",
                                description="Laminar rollout tier: workers and the manager.")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, text in (("serve", "run a generation worker"),
                       ("manage", "run the rollout manager")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--config", help="YAML or TOML config file")
        s.add_argument("--set", action="append", default=[], metavar="A.B=C",
                       help="override a config field (repeatable)")
        s.add_argument("--print-config", action="store_true",
                       help="print the resolved config and exit")
        if name == "manage":
            s.add_argument("--resume", action="store_true",
                           help="restore the cursor and ledger saved in state_dir")
    return p


def make_worker_service(config):
    """Build a :class:`WorkerService` (engine, tokenizer, relay fetcher) from its config."""
    from laminar_common.auth import TlsFiles
    from laminar_common.etcd import make_coordinator
    from laminar_common.relay.client import RelayClient

    from .engines import LogNormalLengths, make_engine
    from .tokenizer import make_tokenizer
    from .weights_io import make_relay_fetcher
    from .worker import WorkerService

    eng = config.engine
    if eng.type == "torch":
        import torch

        torch.set_num_threads(eng.threads)
        engine = make_engine("torch", model=eng.model_dir, max_batch=eng.max_batch,
                             context_length=eng.context_length, device=eng.device, seed=eng.seed)
    elif eng.type == "simulated":
        engine = make_engine(
            "simulated", max_batch=eng.max_batch, kv_capacity_tokens=eng.kv_capacity_tokens,
            lengths=LogNormalLengths(median=eng.median_length, tail_ratio=eng.tail_ratio,
                                     max_length=eng.max_length),
            step_time_base=eng.step_time_base, step_time_per_seq=eng.step_time_per_seq,
            prefill_time_per_token=eng.prefill_time_per_token, vocab_size=eng.vocab_size,
            seed=eng.seed,
        )
    else:
        engine = make_engine("vllm", model=eng.model_dir, max_batch=eng.max_batch,
                             gpu_memory_utilization=eng.gpu_memory_utilization,
                             context_length=eng.context_length, seed=eng.seed)
    coordinator = make_coordinator(config.etcd, config.job)
    tls = TlsFiles.client_from_dir(config.auth.dir) if config.auth.dir else None
    if config.relay is not None:
        client = RelayClient(address=config.relay, client_id=config.worker_id, tls=tls)
    else:
        client = RelayClient(coordinator, client_id=config.worker_id, tls=tls)
    fetcher = make_relay_fetcher(client, with_tensors=eng.type != "simulated",
                                 wait_s=config.fetch_timeout_s)
    return WorkerService(config, engine, make_tokenizer(eng), fetcher, coordinator=coordinator)


def make_manager_service(config, resume: bool = False):
    from .manager import ManagerService

    return ManagerService(config, resume=resume)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from laminar_common.config import dump_config, load_config
    from laminar_common.errors import LaminarError
    from laminar_common.logs import setup_logging

    from .config import ManagerConfig, WorkerConfig

    model = WorkerConfig if args.cmd == "serve" else ManagerConfig
    try:
        config = load_config(model, args.config, args.set)
    except LaminarError as exc:
        print(f"laminar-rollout {args.cmd}: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(dump_config(config))
        return 0
    member = config.worker_id if args.cmd == "serve" else config.manager_id
    setup_logging(config.logging.level, config.job, member, config.logging.json_format)
    logging.getLogger(__name__).info("resolved config:\n%s", dump_config(config))
    try:
        service = make_worker_service(config) if args.cmd == "serve" else \
            make_manager_service(config, resume=args.resume)
        return service.run_forever()
    except LaminarError as exc:
        logging.getLogger(__name__).error("%s", exc)
        print(f"laminar-rollout {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
