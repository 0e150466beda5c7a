"""Repack's KV transfer on loopback: the worker-to-worker KV plane against the manager path.

Real processes, real sockets, real codec; the caches are random bytes of a real shape.

- ``direct`` (``kv_plane: direct``): a source process holds N caches on its
  :class:`~laminar_rollout.kv_plane.KvPlane`; this process (the destination) fetches each
  with :func:`~laminar_rollout.kv_plane.fetch_kv` (connect, hello, fetch, digest check),
  two at a time as a worker's fetch pool does.
- ``manager`` (``kv_plane: manager``): the source sends each cache inside its
  ``PromptTask`` to a relay process standing for the manager's data path (it decodes the
  frame, as the manager's server does, and encodes it again for the destination, as its
  dispatch does; the manager's ledger bookkeeping is not modelled), which pushes it to
  this process, which decodes it. At most 32 MiB a cache (the manager's 64 MiB frame).

Printed: per size, MB/s and milliseconds per cache for each path and their ratio.

    python tools/bench_kv_plane.py --sizes-mb 1,16 --direct-only-mb 256 --count 8
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from concurrent.futures import ThreadPoolExecutor

from laminar_common import codec
from laminar_common.codec import KvCache, PromptTask
from laminar_common.transport import (
    ZmqPullReceiver,
    ZmqPushSender,
    ZmqServer,
    flush_and_terminate,
    make_client,
)

LAYERS, HEADS, HEAD_DIM = 28, 4, 128  # a 7B-class GQA shape, bfloat16: 56 KiB a position
FETCH_THREADS = 2
"""Fetches a destination worker runs at once (its ``kv-fetch`` pool)."""


def _cache(mb: float, seed: int) -> KvCache:
    per_token = 2 * LAYERS * HEADS * HEAD_DIM * 2
    n = max(1, int(mb * 2**20) // per_token)
    data = os.urandom(16) * (n * per_token // 16) + bytes(n * per_token % 16)
    data = bytes([seed % 256]) + data[1:]
    return KvCache(engine="TorchEngine", dtype="bfloat16", layers=LAYERS, kv_heads=HEADS,
                   head_dim=HEAD_DIM, num_tokens=n, data=data)


def _task(i: int, blob: KvCache | None) -> PromptTask:
    return PromptTask(trajectory_id=f"p{i}#0", prompt_id=f"p{i}", group_size=1,
                      sample_index=0, prompt="", resume_token_ids=(1,) * 8,
                      resume_logprobs=(-0.5,) * 8, policy_version=3, kv=blob)


def _source_plane(mb: float, count: int, conn) -> None:
    from laminar_rollout.kv_plane import KvPlane

    plane = KvPlane("tcp://127.0.0.1:*", "src", max_bytes=2**40, hold_s=600).start()
    conn.send([plane.offer(f"p{i}#0", _cache(mb, i)) for i in range(count)])
    conn.recv()  # done
    plane.close()


def _source_via_manager(mb: float, count: int, endpoint: str, ready, go) -> None:
    from laminar_common.codec import Hello

    client = make_client(endpoint, Hello(member_id="src", role="worker",
                                         protocol_version=codec.PROTOCOL_VERSION),
                         send_timeout_s=120)
    client.connect(30)
    frames = [codec.encode(_task(i, _cache(mb, i))) for i in range(count)]
    ready.set()
    go.wait()
    for f in frames:
        client.send_frame(f)
    time.sleep(1.0)
    client.close()
    flush_and_terminate()


def _manager_relay(server_ready, dest_endpoint: str, count: int) -> None:
    server = ZmqServer("tcp://127.0.0.1:*", member_id="manager")
    server_ready.send(server.endpoint)
    push = ZmqPushSender(dest_endpoint, hwm=4, send_timeout_s=120)
    got = 0
    while got < count:
        item = server.recv(timeout_s=120)
        if item is None:
            break
        _, msg = item
        if isinstance(msg, PromptTask):
            push.send(msg)  # encoded again, as the manager's dispatch does
            got += 1
    push.close(linger_s=120)
    server.close()
    flush_and_terminate()


def bench_direct(mb: float, count: int) -> float:
    from laminar_rollout.kv_plane import fetch_kv

    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_source_plane, args=(mb, count, child))
    proc.start()
    refs = parent.recv()

    def one(ref):
        blob = fetch_kv(ref, "dst", timeout_s=120, max_cache_bytes=2**40)
        assert len(blob.data) == ref.nbytes

    t0 = time.perf_counter()
    with ThreadPoolExecutor(FETCH_THREADS) as pool:  # as a destination worker fetches
        list(pool.map(one, refs))
    dt = time.perf_counter() - t0
    parent.send("done")
    proc.join(30)
    return dt


def bench_via_manager(mb: float, count: int) -> float:
    ctx = mp.get_context("spawn")
    receiver = ZmqPullReceiver("tcp://127.0.0.1:*", hwm=4, expect=PromptTask)
    parent, child = ctx.Pipe()
    relay = ctx.Process(target=_manager_relay, args=(child, receiver.endpoint, count))
    relay.start()
    endpoint = parent.recv()
    ready, go = ctx.Event(), ctx.Event()
    source = ctx.Process(target=_source_via_manager, args=(mb, count, endpoint, ready, go))
    source.start()
    ready.wait(300)  # the source encodes its frames before the clock starts
    t0 = time.perf_counter()
    go.set()
    for _ in range(count):
        msg = receiver.recv(timeout_s=120)
        assert isinstance(msg, PromptTask) and msg.kv is not None
    dt = time.perf_counter() - t0
    receiver.close()
    for p in (source, relay):
        p.join(30)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", default="1,16", help="sizes run both ways (<= 32)")
    ap.add_argument("--direct-only-mb", default="256", help="sizes only the plane can move")
    ap.add_argument("--count", type=int, default=8)
    args = ap.parse_args()
    print(f"caches of {LAYERS} layers x {HEADS} KV heads x {HEAD_DIM}, bfloat16 "
          f"({2 * LAYERS * HEADS * HEAD_DIM * 2 // 1024} KiB a position); {args.count} "
          "caches a size; loopback TCP, separate processes")
    print(f"{'size':>8}  {'direct MB/s':>12} {'ms/cache':>9}  {'manager MB/s':>13} "
          f"{'ms/cache':>9}  {'direct/manager':>14}")
    for mb in [float(x) for x in args.sizes_mb.split(",") if x]:
        d = bench_direct(mb, args.count)
        m = bench_via_manager(mb, args.count)
        total = mb * args.count
        print(f"{mb:>6.0f}MB  {total / d:>12,.0f} {1000 * d / args.count:>9.1f}  "
              f"{total / m:>13,.0f} {1000 * m / args.count:>9.1f}  {m / d:>13.2f}x")
    for mb in [float(x) for x in args.direct_only_mb.split(",") if x]:
        n = max(2, args.count // 2)
        d = bench_direct(mb, n)
        print(f"{mb:>6.0f}MB  {mb * n / d:>12,.0f} {1000 * d / n:>9.1f}  "
              f"{'(over 32 MiB)' if mb > 32 else '(not run)':>13} {'':>9}  {'':>14}")


if __name__ == "__main__":
    main()
