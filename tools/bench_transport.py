"""ZeroMQ trajectory throughput on loopback (msgs/s and MB/s).

A sender process PUSHes encoded ``Trajectory`` messages of about SIZE bytes
(1 KB and 1 MB by default) to a PULL receiver in this process, which decodes
and validates every one. Side by side, in the same run, it sends raw frames of
the same size with no codec, so the ratio shows what encoding + validation
costs. Real sockets, real processes; nothing simulated.

    python tools/bench_transport.py --seconds 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

from laminar_common import codec
from laminar_common.transport import ZmqPullReceiver, ZmqPushSender, flush_and_terminate


def make_trajectory(size_bytes: int) -> codec.Trajectory:
    # Token ids < 128 encode as 1 byte in msgpack; logprobs as 9 bytes (float64).
    n = max(1, size_bytes // 10)
    return codec.Trajectory(
        trajectory_id="bench:0", prompt_id="bench", group_size=1, sample_index=0,
        worker_id="bench", policy_version=1, prompt_token_ids=(1, 2, 3),
        response_token_ids=tuple(i % 100 for i in range(n)),
        behaviour_logprobs=tuple(-0.5 for _ in range(n)), reward=1.0, finish_reason="stop",
    )


def _sender(endpoint: str, frame: bytes, count: int) -> None:
    sender = ZmqPushSender(endpoint, hwm=100, send_timeout_s=60)
    for _ in range(count):
        sender.send_frame(frame)
    sender.close(linger_s=120)
    flush_and_terminate()


def measure(frame: bytes, count: int, decode: bool) -> tuple[float, float]:
    receiver = ZmqPullReceiver("tcp://127.0.0.1:0", hwm=100, max_frame_bytes=len(frame) + 1024)
    raw_sock = receiver._sock
    proc = mp.get_context("spawn").Process(target=_sender, args=(receiver.endpoint, frame, count))
    proc.start()
    got = 0
    t0 = None
    while got < count:
        if decode:
            msg = receiver.recv(timeout_s=60)
            if msg is None:
                raise RuntimeError(f"receiver timed out after {got}: {receiver.stats}")
        else:
            if not raw_sock.poll(60_000):
                raise RuntimeError("receiver timed out")
            raw_sock.recv(copy=False)
        if t0 is None:
            t0 = time.perf_counter()
        got += 1
    elapsed = time.perf_counter() - t0
    proc.join()
    receiver.close()
    msgs_per_s = (count - 1) / elapsed
    return msgs_per_s, msgs_per_s * len(frame) / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1024,1048576", help="approximate message sizes in bytes")
    p.add_argument("--seconds", type=float, default=2.0, help="rough target time per case")
    args = p.parse_args()
    print("ZeroMQ PUSH/PULL over loopback TCP, sender in a separate process (no simulation)")
    print(f"{'size':>10} {'mode':<16} {'msgs/s':>12} {'MB/s':>10}")
    for size in (int(s) for s in args.sizes.split(",")):
        frame = codec.encode(make_trajectory(size))
        count = max(50, int(args.seconds * (200_000 if size < 65536 else 1_000)))
        codec_rate, codec_mb = measure(frame, count, decode=True)
        raw_rate, raw_mb = measure(frame, count, decode=False)
        print(f"{len(frame):>10} {'codec+validate':<16} {codec_rate:>12,.0f} {codec_mb:>10.1f}")
        print(f"{len(frame):>10} {'raw frames':<16} {raw_rate:>12,.0f} {raw_mb:>10.1f}")
        print(f"{'':>10} codec/raw ratio: {codec_rate / raw_rate:.2f}")


if __name__ == "__main__":
    main()
