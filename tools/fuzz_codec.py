"""Fuzz target for the wire codec (and the chunk-header decoder).

``test_one_input(data)`` is the target: decoding arbitrary bytes must return a
valid message that re-encodes to an equal one, or raise ``ProtocolError`` —
any other exception is a bug. Run it under atheris (coverage-guided, if
installed: ``python tools/fuzz_codec.py -atheris -max_total_time=60``) or with
the built-in mutational loop (``python tools/fuzz_codec.py --seconds 30``),
which mutates valid frames of every message kind and counts outcomes.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from laminar_common import codec
from laminar_common.errors import ProtocolError
from laminar_common.relay.dataplane import decode_chunk_header

SEEDS = [
    codec.Hello(member_id="w0", role="worker", protocol_version=codec.PROTOCOL_VERSION),
    codec.PromptTask(trajectory_id="p#0", prompt_id="p", group_size=2, sample_index=0,
                     prompt="sort 21=", metadata={"answer": "12"}),
    codec.Trajectory(trajectory_id="p#0", prompt_id="p", group_size=2, sample_index=0,
                     worker_id="w0", policy_version=3, prompt_token_ids=(1, 2),
                     response_token_ids=(3, 4), behaviour_logprobs=(-0.5, -1.0), reward=1.0,
                     finish_reason="stop", data_source="openai/gsm8k"),
    codec.Ack(trajectory_ids=("p#0", "p#1"), trainer_step=1, trainer_version=1),
    codec.ExportTrajectories(trajectory_ids=("p#0",)),
    codec.GroupsFiltered(prompt_ids=("p", "q"), trainer_step=2),
    codec.WorkerReport(worker_id="w0", policy_version=1, active=1, queued=0, max_batch=4,
                       kv_used_tokens=9, kv_capacity_tokens=99),
]


def test_one_input(data: bytes) -> None:
    try:
        msg = codec.decode(data)
    except ProtocolError:
        pass
    else:
        if codec.decode(codec.encode(msg)) != msg:
            raise AssertionError(f"round trip changed {msg!r}")
    try:
        decode_chunk_header(data)
    except ProtocolError:
        pass


def mutate(rng: random.Random, frame: bytes) -> bytes:
    data = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        if op == 0 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif op == 1 and data:
            del data[rng.randrange(len(data)):][: rng.randint(1, 8)]
        elif op == 2:
            pos = rng.randrange(len(data) + 1)
            data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        else:
            data = data[: rng.randrange(len(data) + 1)]
    return bytes(data)


def main() -> int:
    if "-atheris" in sys.argv:
        import atheris  # optional

        argv = [a for a in sys.argv if a != "-atheris"]
        atheris.Setup(argv, test_one_input)
        atheris.Fuzz()
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0, help="how long to fuzz")
    p.add_argument("--seed", type=int, default=0, help="RNG seed")
    args = p.parse_args()
    rng = random.Random(args.seed)
    frames = [codec.encode(m) for m in SEEDS]
    deadline = time.monotonic() + args.seconds
    runs = accepted = 0
    while time.monotonic() < deadline:
        data = mutate(rng, rng.choice(frames))
        test_one_input(data)
        runs += 1
        try:
            codec.decode(data)
            accepted += 1
        except ProtocolError:
            pass
    print(f"{runs} mutated frames: {accepted} decoded to valid messages, "
          f"{runs - accepted} refused with ProtocolError, 0 other exceptions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
