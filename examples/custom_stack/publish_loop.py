"""A plain PyTorch training loop that publishes its weights through Laminar's relay tier.

Needs etcd and at least one relay of the job (``laminar-relay serve``):

    python examples/custom_stack/publish_loop.py --etcd 127.0.0.1:2379 --job demo \
        --steps 50 --publish-every 10 --save published.pt

Every ``--publish-every`` steps the state dict becomes the next weight version:
``publish_state_dict`` returns once the master relay holds it, verified, and
etcd shows it as latest; rollout workers (or ``fetch_engine.py``) pull it from there.
"""

import argparse

import torch
from tiny_model import TinyModel

from laminar_common import EtcdConfig, make_coordinator
from laminar_common.relay.client import RelayClient
from laminar_trainer.publishing import publish_state_dict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--etcd", default="127.0.0.1:2379", help="etcd host:port")
    p.add_argument("--job", default="demo", help="Laminar job name")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--publish-every", type=int, default=10)
    p.add_argument("--save", help="also torch.save the last published state dict here")
    args = p.parse_args()

    torch.manual_seed(0)
    model = TinyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    coordinator = make_coordinator(EtcdConfig(endpoints=(args.etcd,)), args.job)
    client = RelayClient(coordinator, client_id="publish-loop")
    try:
        latest = client.latest()
        version = 0 if latest is None else latest.version + 1  # versions only move forward
        publish_state_dict(client, model.state_dict(), version, step=0)
        print(f"published the initial weights as v{version}", flush=True)
        for step in range(1, args.steps + 1):
            x = torch.randn(64, 4)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % args.publish_every == 0:
                version += 1
                result = publish_state_dict(client, model.state_dict(), version, step=step)
                print(f"step {step}: loss {loss.item():.4f}, published v{version} "
                      f"({result.total_bytes} bytes in {result.seconds:.3f}s)", flush=True)
        if args.save:
            torch.save(model.state_dict(), args.save)
    finally:
        client.close()
        coordinator.close()


if __name__ == "__main__":
    main()
