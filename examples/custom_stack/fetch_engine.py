"""Weights from the relay tier in your own model: fetched once (this script), or as an engine.

As a script, fetch one version (default: the latest) into a ``TinyModel``:

    python examples/custom_stack/fetch_engine.py --etcd 127.0.0.1:2379 --job demo --save fetched.pt

As a rollout worker's engine, with this directory on the worker's PYTHONPATH:

    engine: {type: custom, factory: "fetch_engine:make_engine", options: {max_batch: 4}}

the worker fetches every version it pulls and hands the tensors to
``load_weights``, which loads them into ``TinyEngine.model``. Generation here is
the simulated engine's (token ids from a cost model); a real engine decodes
with its model instead (see ``laminar_rollout.engines.GenerationEngine``).
"""

import argparse

import torch
from tiny_model import TinyModel

from laminar_common import EtcdConfig, make_coordinator
from laminar_common.relay.client import RelayClient
from laminar_rollout.engines import SimulatedEngine
from laminar_trainer.publishing import load_into


class TinyEngine(SimulatedEngine):
    """Simulated generation, real weights: each version the worker pulls lands in ``model``."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.model = TinyModel()

    def load_weights(self, version, named_tensors) -> None:
        tensors = dict(named_tensors or ())
        super().load_weights(version, None)  # refuses an older version or a busy engine
        if tensors:
            self.model.load_state_dict(tensors)


def make_engine(**options) -> TinyEngine:
    """The factory ``engine.factory`` names; ``engine.options`` are its arguments."""
    return TinyEngine(**options)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--etcd", default="127.0.0.1:2379", help="etcd host:port")
    p.add_argument("--job", default="demo", help="Laminar job name")
    p.add_argument("--version", type=int, help="weight version (default: the latest)")
    p.add_argument("--save", help="torch.save the loaded state dict here")
    args = p.parse_args()

    model = TinyModel()
    coordinator = make_coordinator(EtcdConfig(endpoints=(args.etcd,)), args.job)
    client = RelayClient(coordinator, client_id="fetch-engine")
    try:
        with client.fetch(args.version, wait_s=30) as fetched:
            version = load_into(model, fetched)
            print(f"loaded v{version} from {fetched.relay_id} ({fetched.source})", flush=True)
    finally:
        client.close()
        coordinator.close()
    with torch.no_grad():
        print(f"model(1, 1, 1, 1) = {model(torch.ones(1, 4)).item():.4f} (learning 4.0)")
    if args.save:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
