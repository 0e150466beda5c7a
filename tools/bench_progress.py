"""What a worker's progress reports cost: every token so far vs only the new ones.

Every ``report_interval_s`` a worker tells the manager how far each unfinished
trajectory has got (so a lost worker's trajectories resume from their tokens).
Until protocol 8 each report repeated every token of every unfinished trajectory,
one message each: with S slots at mean length L, S x L tokens a report, so a
long-tail job's reports grow with the square of its lengths. Now a report is one
frame carrying the tokens since the last report (and every token once every
``FULL_PROGRESS_EVERY`` reports).

This measures, side by side in one run, per report of S trajectories that each
decoded G new tokens since the last one: bytes on the wire, and CPU time of the
worker's encode plus the manager's decode and ledger update (the real codec and
the real ``TrajectoryLedger``; in one process, no socket: the transport adds a
copy per frame on top). The old way is replayed as it ran (one full
``PartialProgress`` per trajectory); the new way as it runs now, amortised over
its cycle of reports (continuations and one full report, ``FULL_PROGRESS_EVERY``).

    python tools/bench_progress.py --slots 256 --lengths 50,1000,8000 --new 15
"""

from __future__ import annotations

import argparse
import time

from laminar_common import codec
from laminar_common.codec import PartialProgress, SamplingSpec, WorkerReport
from laminar_rollout.ledger import TrajectoryLedger
from laminar_rollout.prompts import PromptRecord
from laminar_rollout.worker import FULL_PROGRESS_EVERY as FULL_EVERY


def _ledger(slots: int) -> TrajectoryLedger:
    led = TrajectoryLedger()
    for i in range(slots):
        led.add_group(PromptRecord(f"p{i}", "x", {}), 1, SamplingSpec())
    led.take_pending("w", 0, slots)
    return led


def _report(progress: tuple[PartialProgress, ...]) -> WorkerReport:
    return WorkerReport(worker_id="w", policy_version=0, active=len(progress), queued=0,
                        max_batch=len(progress), kv_used_tokens=0, kv_capacity_tokens=0,
                        progress=progress)


def _apply(led: TrajectoryLedger, frames: list[bytes]) -> None:
    for frame in frames:
        msg = codec.decode(frame)
        items = msg.progress if isinstance(msg, WorkerReport) else (msg,)
        for p in items:
            led.record_partial(p.trajectory_id, "w", p.policy_version, p.token_ids,
                               p.logprobs, p.offset)


def measure(slots: int, length: int, new: int, reports: int) -> dict:
    tokens = [tuple((i * 7 + j) % 30000 for j in range(length)) for i in range(slots)]
    logprobs = [tuple(-0.5 - (j % 13) * 0.01 for j in range(length)) for _ in range(slots)]

    def old_frames() -> list[bytes]:
        return [codec.encode(PartialProgress(trajectory_id=f"p{i}#0", worker_id="w",
                                             policy_version=0, token_ids=tokens[i],
                                             logprobs=logprobs[i])) for i in range(slots)]

    def new_frames(full: bool) -> list[bytes]:
        start = 0 if full else length - new
        return [codec.encode(_report(tuple(
            PartialProgress(trajectory_id=f"p{i}#0", worker_id="w", policy_version=0,
                            token_ids=tokens[i][start:], logprobs=logprobs[i][start:],
                            offset=start) for i in range(slots))))]

    out = {}
    for name in ("old", "new"):
        led = _ledger(slots)
        _apply(led, new_frames(True))  # the manager already holds every token
        nbytes, t0 = 0, time.perf_counter()
        for r in range(reports):
            frames = old_frames() if name == "old" else new_frames(r % FULL_EVERY == 0)
            nbytes += sum(len(f) for f in frames)
            _apply(led, frames)
        dt = time.perf_counter() - t0
        out[name] = {"bytes": nbytes / reports, "ms": dt / reports * 1e3,
                     "frames": len(frames)}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=256, help="unfinished trajectories")
    p.add_argument("--lengths", default="50,1000,8000",
                   help="tokens each trajectory holds so far (comma list)")
    p.add_argument("--new", type=int, default=15, help="tokens decoded per report interval")
    p.add_argument("--reports", type=int, default=FULL_EVERY, help="reports measured")
    args = p.parse_args()
    print(f"{args.slots} unfinished trajectories, {args.new} new tokens each per report; "
          f"real codec + TrajectoryLedger in one process (no socket). Per report:")
    print(f"{'length':>7} {'old KB':>9} {'new KB':>8} {'bytes x':>8} "
          f"{'old ms':>8} {'new ms':>7} {'CPU x':>6}")
    for length in (int(x) for x in args.lengths.split(",")):
        r = measure(args.slots, max(length, args.new), args.new, args.reports)
        o, n = r["old"], r["new"]
        print(f"{length:>7} {o['bytes'] / 1e3:>9.1f} {n['bytes'] / 1e3:>8.1f} "
              f"{o['bytes'] / n['bytes']:>7.1f}x {o['ms']:>8.2f} {n['ms']:>7.2f} "
              f"{o['ms'] / n['ms']:>5.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
