"""A minimal custom trainer: take trajectories from a Laminar job, train on them, ack them.

Start it next to a rollout manager and workers (etcd and a relay as for any job):

    python examples/custom_stack/my_trainer.py --etcd 127.0.0.1:2379 --job demo --count 64

``TrajectoryConsumer`` is the whole contract with the job: it registers this
process as the job's trainer (workers push trajectories to it), hands out each
trajectory id once, refuses malformed ones, and sends your acks to the manager,
which then counts those prompts done, exactly once, across restarts of either side.
"""

import argparse
import json
import statistics

from laminar_common import TrajectoryConsumer


def train_step(batch) -> float:
    """Your loss and optimizer step go here (e.g. GRPO: group by ``t.prompt_id``,
    normalise ``t.reward`` in each group, weight ``t.behaviour_logprobs``)."""
    return statistics.fmean(t.reward for t in batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--etcd", default="127.0.0.1:2379", help="etcd host:port")
    p.add_argument("--job", default="demo", help="Laminar job name")
    p.add_argument("--count", type=int, default=64, help="stop after this many trajectories")
    p.add_argument("--batch", type=int, default=4, help="trajectories per training step")
    p.add_argument("--timeout", type=float, default=60.0, help="give up after this long idle")
    p.add_argument("--out", help="write the received ids and the consumer's counters here")
    args = p.parse_args()

    received = []
    with TrajectoryConsumer.connect(args.etcd, args.job) as consumer:
        print(f"trainer registered at {consumer.endpoint}", flush=True)
        batch = []
        while len(received) < args.count:
            traj = consumer.poll(timeout_s=args.timeout)
            if traj is None:
                raise SystemExit(f"no trajectory in {args.timeout:.0f}s "
                                 f"(got {len(received)} of {args.count})")
            batch.append(traj)
            if len(batch) == args.batch or len(received) + len(batch) == args.count:
                reward = train_step(batch)
                consumer.step += 1
                # Ack once the step is durable for you (after your checkpoint, if any).
                consumer.ack(t.trajectory_id for t in batch)
                received += batch
                print(f"step {consumer.step}: {len(batch)} trajectories, reward {reward:.3f}",
                      flush=True)
                batch = []
        stats = vars(consumer.stats)
    print(f"done: {len(received)} trajectories, {stats['duplicates']} duplicate copies dropped",
          flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"ids": [t.trajectory_id for t in received], "stats": stats}, fh)


if __name__ == "__main__":
    main()
