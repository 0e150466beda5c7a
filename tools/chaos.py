"""Chaos soak: seeded random faults on the real stack for minutes, then an exactly-once check.

Starts real etcd (``LocalEtcd``), ``--relays`` relays, the manager (with a
state_dir), ``--workers`` rollout workers and the trainer (checkpointing) as
separate processes, as integration_tests/test_faults.py does. Two parts are
SIMULATED and the output says so: the workers' engine (``engine.type=simulated``)
and the training step (``simulate.step_s``: a sleep, then a real weight publish).

About every ``--interval-s`` (jittered by the seeded RNG) one fault is drawn:
SIGKILL (then a restart under the same id) or SIGSTOP (2 x TTL, then SIGCONT)
of a random worker, a random relay, the manager or the trainer; SIGTERM of the
trainer; SIGSTOP of etcd itself for 2 x TTL. ``--faults`` draws from a list of
its own instead, which may name ``master-kill`` and ``master-stop`` (the relay
holding the master election at that moment): the relay-failover benchmark is

    python tools/chaos.py --minutes 3 --interval-s 15 --faults master-kill,master-stop --compare

and its per-kind table gives the longest step gap after each against the
baseline's. The manager and the trainer come
back with ``--resume``. Only pids this tool started are ever signalled. A tier
that exits on its own is an incident: recorded, then restarted.

At the end everything stops gracefully (workers, the trainer, relays, then the
manager, so its last ledger write has every ack) and exactly-once is checked:
no id twice in the trainer's consumed.jsonl, every id the ledger holds as
acked was consumed, no id in two ledger states. Printed, and written to
OUT/chaos_result.json: wall time; useful training time (sum of ``step_s`` of
the steps that survived, i.e. were not rolled back by a resume, / soak wall
time), the same for a no-fault baseline (``--compare``) and the ratio; the
longest gap between steps; each fault with its recovery time (fault -> next
trainer step; for worker faults also -> the worker back in etcd membership);
counts by kind; trajectories consumed, lost and duplicated. Exit code 0 iff
exactly-once held in every run (and, with ``--require-useful F``, the useful
time, as a ratio to the baseline when there is one, reached F).

    python tools/chaos.py --minutes 10 --interval-s 30 --seed 1 --compare --out runs/chaos
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

from laminar_common.errors import LaminarError
from laminar_common.etcd import EtcdCoordinator
from laminar_common.launch.local_etcd import LocalEtcd
from laminar_common.launch.processes import ChildProcess
from laminar_common.launch.readiness import wait_ready
from laminar_common.membership import MemberRecord
from laminar_common.testing.hosts import EmulatedHosts, start_etcd, unavailable
from laminar_examples.tasks import make_task_records, write_jsonl

FAULTS = ("worker-kill", "worker-stop", "relay-kill", "relay-stop", "manager-kill",
          "manager-stop", "trainer-kill", "trainer-stop", "trainer-term", "etcd-pause")
LINK_FAULTS = ("worker-cut", "worker-cut-trainer", "worker-cut-relays", "worker-slow",
               "relay-cut", "master-cut", "master-cut-trainer", "manager-cut", "trainer-cut-relays",
               "etcd-cut")
"""Faults of links, with ``--hosts`` only (every tier on an emulated host of its own): a
host cut from every other (``-cut``) or from some (``worker-cut-trainer``: a worker that
still reaches etcd and the manager but not the trainer; ``worker-cut-relays``: one that
cannot fetch weights; ``trainer-cut-relays``) for 2 x TTL, then healed; ``worker-slow``: a worker's link at 1 Mbit/s for 4 x TTL."""
SLOW_MBIT = 1.0
MASTER_FAULTS = ("master-kill", "master-stop")
"""Faults of the master relay in particular (``--faults master-kill,master-stop``: the
relay-failover benchmark); the random draw above hits it one time in ``--relays``."""
SIMULATED = ("SIMULATED: rollout engine (engine.type=simulated) and training step "
             "(simulate.step_s sleep); real etcd, relays, manager, workers, trainer processes.")
JOB = "chaos"
USEFUL_GOAL = 0.9
MAX_INCIDENTS = 30


class Stack:
    """The processes of one soak; it signals only the pids it started."""

    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        self.root, self.args, self.ttl = root, args, args.ttl_s
        (root / "logs").mkdir(parents=True, exist_ok=True)
        self.run_dir, self.state_dir = root / "trainer", root / "manager"
        self.hosts: EmulatedHosts | None = None
        if getattr(args, "hosts", False):
            # Every tier on a host of its own (a network namespace, its link capped).
            names = ["etcd", "manager", "trainer", *[f"relay-{i}" for i in range(args.relays)],
                     *[f"worker-{i}" for i in range(args.workers)]]
            self.hosts = EmulatedHosts(names, rate_mbit=args.link_mbit).start()
            try:
                self.etcd, self.etcd_local = start_etcd(self.hosts, "etcd", str(root / "etcd"))
            except BaseException:
                self.hosts.close()
                raise
        else:
            self.etcd = LocalEtcd().start()
            self.etcd_local = self.etcd.endpoint
        self.etcd_paused = False
        self.cmds: dict[str, list[str]] = {}
        self.procs: dict[str, ChildProcess] = {}
        self.stopped: set[str] = set()
        self.incidents: list[dict] = []
        self.t0 = time.time()
        try:
            self.watch = EtcdCoordinator([self.etcd_local], JOB, ttl_s=self.ttl,
                                         connect_timeout_s=20, rpc_timeout_s=1.0)
        except LaminarError:
            self.etcd.close()
            if self.hosts is not None:
                self.hosts.close()
            raise

    def listen(self, name: str) -> list[str]:
        """Where tier ``name`` binds and what host it says it is on."""
        if self.hosts is None:
            return ["--set", "bind_host=127.0.0.1", "--set", "advertise_host=127.0.0.1"]
        return ["--set", f"bind_host={self.hosts.address(name)}", "--set", f"host_id={name}"]

    def common(self) -> list[str]:
        return ["--set", f"job={JOB}", "--set", f"etcd.endpoints=[{self.etcd.endpoint}]",
                "--set", f"etcd.ttl_s={self.ttl}"]

    def start(self) -> None:
        a, c = self.args, self.common()
        prompts = self.root / "prompts.jsonl"
        write_jsonl(prompts, make_task_records("sort", 2000, a.seed))
        for i in range(a.relays):
            self.cmds[f"relay-{i}"] = ["laminar_relay.cli", "serve", *c, "--set",
                                       f"member_id=relay-{i}", *self.listen(f"relay-{i}")]
        self.cmds["manager"] = ["laminar_rollout.cli", "manage", *c, *self.listen("manager"),
                                "--set", f"prompts={prompts}",
                                "--set", "group_size=2", "--set", "batch_groups=2",
                                "--set", "epochs=1000", "--set", "sampling.max_tokens=48",
                                "--set", f"state_dir={self.state_dir}",
                                "--set", f"worker_timeout_s={2 * self.ttl}"]
        for i in range(a.workers):
            self.cmds[f"worker-{i}"] = [
                "laminar_rollout.cli", "serve", *c, "--set", f"worker_id=worker-{i}",
                *(["--set", f"host_id=worker-{i}"] if self.hosts else []),
                "--set", "engine.type=simulated", "--set", "engine.max_batch=4",
                "--set", "engine.median_length=8", "--set", "engine.max_length=48",
                "--set", "engine.step_time_base=0.003", "--set", "report_interval_s=0.1"]
        # total_steps far beyond what the soak can reach: the trainer never finishes.
        self.cmds["trainer"] = [
            "laminar_trainer.cli", "run", *c, *self.listen("trainer"), "--set", "trainer_id=trainer",
            "--set", f"simulate.step_s={a.step_s}", "--set", "simulate.weight_bytes=262144",
            "--set", "batch_groups=2", "--set", "total_steps=10000000",
            "--set", f"run_dir={self.run_dir}", "--set", f"checkpoint.dir={self.root / 'ckpt'}",
            "--set", "checkpoint.every_steps=5"]
        for name in [n for n in self.cmds if n.startswith("relay")] + ["manager"]:
            self.spawn(name)
        self.ready("manager")
        for name in [n for n in self.cmds if n.startswith("worker")] + ["trainer"]:
            self.spawn(name)
        self.ready("trainer")

    def spawn(self, name: str, resume: bool = False) -> None:
        extra = getattr(self.args, "extra", None) or {}
        cmd = [sys.executable, "-m", *self.cmds[name], *extra.get(name.split("-")[0], ()),
               *(["--resume"] if resume else [])]
        if self.hosts is not None:
            cmd = self.hosts.cmd(name, cmd)
        self.procs[name] = ChildProcess(name, cmd, str(self.root / "logs" / f"{name}.log"))

    def ready(self, name: str, timeout_s: float = 60) -> MemberRecord | None:
        """The ready etcd record of the process now running as ``name`` (manager, trainer)."""
        child = self.procs[name]
        try:
            return wait_ready(self.watch, name, name, timeout_s=timeout_s,
                              newer_than=child.started_at, alive=child.alive)[0]
        except LaminarError as exc:
            self.incident(name, f"not ready: {str(exc).splitlines()[0]}")
            return None

    def restart(self, name: str) -> int | None:
        """Start ``name`` again under the same id (manager and trainer with --resume).

        Returns the step a restarted trainer resumed at."""
        self.procs[name].stop(grace_s=1)  # reaps the dead pid and closes its log
        self.spawn(name, resume=name in ("manager", "trainer"))
        if name in ("manager", "trainer"):
            rec = self.ready(name)
            return int(rec.extra["step"]) if rec is not None and "step" in rec.extra else None
        return None

    def signal(self, name: str, sig: signal.Signals) -> None:
        if name == "etcd":
            assert self.etcd.proc is not None
            os.kill(self.etcd.proc.pid, sig)
            self.etcd_paused = sig == signal.SIGSTOP
        else:
            os.kill(self.procs[name].pid, sig)
            (self.stopped.add if sig == signal.SIGSTOP else self.stopped.discard)(name)

    def master(self) -> str:
        """The relay holding the master election now (any relay if etcd has none)."""
        try:
            leader = self.watch.leader("relay-master")
        except LaminarError:
            leader = None
        return leader if leader in self.procs else sorted(
            n for n in self.procs if n.startswith("relay"))[0]

    def incident(self, name: str, what: str) -> None:
        self.incidents.append({"time": time.time(), "name": name, "what": what,
                               "log_tail": self.procs[name].lines[-5:]})
        print(f"  INCIDENT {name}: {what}", flush=True)

    def check_exits(self) -> None:
        """A tier that exited on its own is an incident; it is restarted (bounded)."""
        for name, proc in list(self.procs.items()):
            if not proc.alive() and len(self.incidents) < MAX_INCIDENTS:
                self.incident(name, f"exited on its own with {proc.proc.returncode}")
                self.restart(name)

    def workers_seen(self) -> dict[str, tuple] | None:
        """Worker id -> incarnation as etcd has them now; None while etcd does not answer."""
        if self.etcd_paused:
            return None
        try:
            return {k: r.incarnation for k, r in self.watch.members("worker").items()}
        except LaminarError:
            return None

    def shutdown(self) -> dict[str, int | None]:
        """SIGCONT what is stopped, then stop gracefully: workers, trainer, relays, manager.

        The trainer stops while a relay is up (its close waits for the in-flight
        publish) and the manager last, so its final ledger write has every ack.
        """
        if self.etcd_paused:
            self.signal("etcd", signal.SIGCONT)
        if self.hosts is not None:
            for name in self.hosts.cuts():
                self.hosts.heal(name)
        for name in list(self.stopped):
            self.signal(name, signal.SIGCONT)
        order = sorted(self.procs, key=lambda n: (n == "manager", n.startswith("relay"),
                                                  n == "trainer", n))
        codes = {n: self.procs[n].stop(grace_s=30 if n in ("trainer", "manager") else 10)
                 for n in order}
        self.watch.close()
        self.etcd.close()
        if self.hosts is not None:
            self.hosts.close()
        return codes


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def inject(stack: Stack, kind: str, rng: random.Random, pending: list[dict]) -> dict:
    """Apply one fault (blocking through a stop, a cut or a slow spell) and return its record."""
    tier, action = kind.split("-", 1)
    if tier == "master":
        tier, target = "relay", stack.master()
    else:
        names = sorted(n for n in stack.procs if n.startswith(tier))
        target = "etcd" if tier == "etcd" else rng.choice(names)
    before = stack.workers_seen() or {}
    rec = {"kind": kind, "target": target, "time": time.time()}
    print(f"  [{rec['time'] - stack.t0:7.1f}s] {kind} {target}", flush=True)
    if action in ("kill", "term"):
        if action == "kill":
            stack.procs[target].kill()
        else:
            rec["rc"] = stack.procs[target].stop(grace_s=30)
        rows = read_jsonl(stack.run_dir / "metrics.jsonl")  # final: the pid is gone
        resumed_at = stack.restart(target)
        if tier == "trainer" and rows and resumed_at is not None:
            # Steps after the checkpoint it resumed from are trained again: wasted.
            rec["rolled_back_steps"] = max(0, rows[-1]["step"] - resumed_at)
    elif action.startswith("cut") or action == "slow":
        link_fault(stack, target, action, pending)
    else:
        stack.signal(target, signal.SIGSTOP)
        idle(stack, 2 * stack.ttl, pending)
        stack.signal(target, signal.SIGCONT)
    rec["resumed"] = time.time()
    if tier == "worker":
        rec["old_incarnation"] = before.get(target)
        pending.append(rec)
    return rec


def link_fault(stack: Stack, target: str, action: str, pending: list[dict],
               seconds: float | None = None) -> None:
    """Cut ``target``'s host (from everything, or from the hosts ``action`` names) for
    ``seconds`` (default 2 x TTL), or slow its link to SLOW_MBIT (default 4 x TTL); then
    heal it."""
    hosts = stack.hosts
    if hosts is None:
        raise LaminarError(f"link fault {action} of {target} needs --hosts")
    if action == "slow":
        rate = hosts.rate(target)
        hosts.cap(target, SLOW_MBIT)
        try:
            idle(stack, 4 * stack.ttl if seconds is None else seconds, pending)
        finally:
            hosts.cap(target, rate)
        return
    peers = {"cut": None, "cut-trainer": ["trainer"],
             "cut-relays": sorted(n for n in stack.procs if n.startswith("relay"))}[action]
    hosts.cut(target, peers)
    try:
        idle(stack, 2 * stack.ttl if seconds is None else seconds, pending)
    finally:
        hosts.heal(target)


def idle(stack: Stack, seconds: float, pending: list[dict]) -> None:
    """Wait ``seconds``, watching worker membership for the faults in ``pending``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen = stack.workers_seen() if pending else None
        now = time.time()
        for rec in list(pending if seen is not None else ()):
            inc = seen.get(rec["target"])
            back = inc is not None and (inc != rec["old_incarnation"]
                                        if rec["kind"] == "worker-kill" else True)
            if "resumed" in rec and back:
                rec["member_back_s"] = round(now - rec["time"], 2)
                pending.remove(rec)
        if not stack.stopped and not stack.etcd_paused:
            stack.check_exits()
        time.sleep(max(0.0, min(0.5, deadline - time.monotonic())))


def soak(args: argparse.Namespace, root: Path, faults: bool) -> dict:
    """One run: start the stack, inject faults until the deadline, stop, analyse."""
    label = "chaos" if faults else "baseline"
    print(f"{label}: starting the stack in {root}", flush=True)
    if root.exists():
        # A soak starts from nothing: an earlier run's checkpoints or ledger in here
        # would be resumed from (or pruned against) and corrupt this run's figures.
        shutil.rmtree(root)
    stack = Stack(root, args)
    rng = random.Random(args.seed)
    records: list[dict] = []
    pending: list[dict] = []
    codes: dict[str, int | None] = {}
    try:
        stack.start()
        deadline = time.monotonic() + 120
        while not read_jsonl(stack.run_dir / "metrics.jsonl") and time.monotonic() < deadline:
            idle(stack, 0.5, pending)
        rows = read_jsonl(stack.run_dir / "metrics.jsonl")
        if not rows:
            raise LaminarError("the trainer took no step within 120 s of starting")
        stack.t0 = t0 = rows[0]["time"]
        end = t0 + args.minutes * 60
        print(f"{label}: training started; soaking {args.minutes:g} min", flush=True)
        max_faults = int(args.minutes * 60 / (0.5 * args.interval_s)) + 1
        next_at = t0 + rng.uniform(0.5, 1.5) * args.interval_s
        while time.time() < end:
            if faults and time.time() >= next_at and len(records) < max_faults \
                    and time.time() < end - 2 * args.ttl_s - 5:
                records.append(inject(stack, rng.choice(args.faults), rng, pending))
                next_at = time.time() + rng.uniform(0.5, 1.5) * args.interval_s
            idle(stack, min(1.0, max(0.0, end - time.time())), pending)
        t_end = time.time()
        idle(stack, min(10.0, 2 * args.ttl_s + 2), pending)  # last worker faults come back
    except LaminarError as exc:
        print(f"{label}: aborted: {exc}", flush=True)
        stack.incidents.append({"time": time.time(), "name": "chaos", "what": str(exc)})
        t0, t_end = stack.t0, time.time()
    finally:
        codes = stack.shutdown()
    result = analyse(stack, records, t0, t_end)
    result.update(label=label, exit_codes=codes, incidents=stack.incidents)
    return result


def analyse(stack: Stack, records: list[dict], t0: float, t_end: float) -> dict:
    rows = read_jsonl(stack.run_dir / "metrics.jsonl")
    # A resume cuts metrics.jsonl back to its checkpoint, or (older trainers) logs the
    # rolled-back steps again: the last row of each step is the one that survived.
    surviving = {r["step"]: r for r in rows}
    in_window = [r for r in rows if t0 <= r["time"] <= t_end]
    kept = [r for r in surviving.values() if t0 <= r["time"] <= t_end]
    wall = max(t_end - t0, 1e-9)
    times = sorted(r["time"] for r in in_window)
    gaps = [b - a for a, b in zip(times, [*times[1:], t_end])]
    for i, rec in enumerate(records):
        after = rec["resumed"] if rec["kind"].startswith("trainer") else rec["time"]
        nxt = next((r["time"] for r in rows if r["time"] > after), None)
        rec["next_step_s"] = round(nxt - rec["time"], 2) if nxt else None
        until = records[i + 1]["time"] if i + 1 < len(records) else t_end
        ts = [rec["time"], *[t for t in times if rec["time"] < t <= until], until]
        rec["max_gap_s"] = round(max(b - a for a, b in zip(ts, ts[1:])), 2)
        rec["t"] = round(rec["time"] - t0, 1)
        rec.pop("old_incarnation", None)
    return {
        "wall_s": round(wall, 1), "steps": len(kept),
        "steps_rolled_back": sum(r.get("rolled_back_steps", 0) for r in records),
        "useful_fraction": sum(r["step_s"] for r in kept) / wall,
        "max_gap_s": round(max(gaps, default=wall), 2),
        "faults": records, "fault_counts": dict(collections.Counter(r["kind"] for r in records)),
        "gaps_by_kind": {k: [r["max_gap_s"] for r in records if r["kind"] == k]
                         for k in {r["kind"] for r in records}},
        "exactly_once": check_exactly_once(stack.run_dir, stack.state_dir),
    }


def _ids(value: object) -> tuple[list[str], dict]:
    """A ledger state's ids and any summary counters (plain list, or a compacted form)."""
    if isinstance(value, list):
        return [str(x) for x in value], {}
    if isinstance(value, dict):
        ids = [str(x) for v in value.values() if isinstance(v, list) for x in v]
        return ids, {k: v for k, v in value.items() if not isinstance(v, list)}
    return [], {"count": value}


def check_exactly_once(run_dir: Path, state_dir: Path) -> dict:
    """Trained at most once, every acked id trained, no id in two ledger states."""
    consumed = [i for row in read_jsonl(run_dir / "consumed.jsonl") for i in row["ids"]]
    twice = {i: n for i, n in collections.Counter(consumed).items() if n > 1}
    path = state_dir / "manager_state.json"
    if not path.exists():
        return {"holds": False, "error": f"no manager state at {path}", "consumed": len(consumed)}
    state = json.loads(path.read_text())
    ledger = state.get("ledger", {})
    by_state, counters = {}, {}
    for name, value in ledger.get("states", {}).items():
        by_state[name], extra = _ids(value)
        if extra:
            counters[name] = extra
    other = {k: v for k, v in ledger.items() if k not in ("states", "groups", "dispatched_to")}
    listed = collections.Counter(i for ids in by_state.values() for i in ids)
    in_two = sorted(i for i, n in listed.items() if n > 1)
    acked = set(by_state.get("acked", ()))
    lost = sorted(acked - set(consumed))
    # Groups compacted behind the ledger's watermark leave only counts: check those.
    compacted = other.get("compacted") if isinstance(other.get("compacted"), dict) else {}
    acked_total = len(acked) + int(compacted.get("acked", 0))
    over = max(0, acked_total - len(set(consumed)))
    return {
        "holds": not twice and not lost and not in_two and not over,
        "acked_total": acked_total, "acked_beyond_consumed": over,
        "consumed": len(consumed), "consumed_unique": len(set(consumed)),
        "duplicated": sum(n - 1 for n in twice.values()), "duplicated_ids": sorted(twice)[:20],
        "acked_listed": len(acked), "lost": len(lost) + over, "lost_ids": lost[:20],
        "in_two_states": len(in_two), "in_two_states_ids": in_two[:20],
        "consumed_not_acked": len(set(consumed) - acked),
        "ledger_counts": {k: len(v) for k, v in by_state.items()},
        "ledger_counters": counters, "ledger_other": other,
        "manager_summary": {k: state.get("summary", {}).get(k) for k in
                            ("ledger", "acks", "workers_lost", "recovery_seconds", "settled")},
    }


def report(r: dict) -> None:
    e = r["exactly_once"]
    print(f"\n== {r['label']} ==  wall {r['wall_s']:.0f} s, {r['steps']} steps "
          f"(+{r['steps_rolled_back']} rolled back by resumes), useful training time "
          f"{r['useful_fraction']:.3f}, max step gap {r['max_gap_s']} s")
    if r["faults"]:
        print(f"{'t (s)':>7} {'fault':<18} {'target':<9} {'next step':>9} {'max gap':>8} "
              f"{'member back':>11}")
        for f in r["faults"]:
            print(f"{f['t']:>7.1f} {f['kind']:<18} {f['target']:<9} {_s(f['next_step_s']):>9} "
                  f"{_s(f['max_gap_s']):>8} {_s(f.get('member_back_s', '-')):>11}")
        counts = sorted(r["fault_counts"].items())
        print("faults by kind: " + ", ".join(f"{k} {v}" for k, v in counts))
        for kind, gaps in sorted(r["gaps_by_kind"].items()):
            print(f"  {kind:<18} longest step gap after it: max {max(gaps):.2f} s, "
                  f"median {sorted(gaps)[len(gaps) // 2]:.2f} s over {len(gaps)}")
    print(f"trajectories: consumed {e.get('consumed', 0)}, lost {e.get('lost', '?')}, "
          f"duplicated {e.get('duplicated', '?')}, in two ledger states "
          f"{e.get('in_two_states', '?')}; acked {e.get('acked_total', '?')}; "
          f"exactly-once {'HOLDS' if e['holds'] else 'BROKEN'}" + (f" ({e['error']})"
                                                                   if "error" in e else ""))
    for inc in r["incidents"]:
        print(f"  incident {inc['name']}: {inc['what']}")
    bad = {n: c for n, c in r["exit_codes"].items() if c not in (0, None)}
    if bad:
        print(f"  non-zero exit codes at the final stop: {bad}")


def _s(x: object) -> str:
    return "-" if x is None else (f"{x:.2f}" if isinstance(x, float) else str(x))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10, help="soak length per run")
    p.add_argument("--interval-s", type=float, default=30, help="mean seconds between faults")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule and prompts")
    p.add_argument("--ttl-s", type=int, default=3, help="etcd lease TTL of every tier")
    p.add_argument("--workers", type=int, default=3, help="rollout workers")
    p.add_argument("--relays", type=int, default=2, help="relays")
    p.add_argument("--step-s", type=float, default=0.3, help="simulated training step (s)")
    p.add_argument("--out", default="runs/chaos", help="directory for logs and chaos_result.json")
    p.add_argument("--no-faults", action="store_true", help="only the no-fault baseline run")
    p.add_argument("--compare", action="store_true",
                   help="run a no-fault baseline of the same length first; print the ratio")
    p.add_argument("--require-useful", type=float, default=None, metavar="FRACTION",
                   help="exit 1 unless useful time (ratio to the baseline if any) reaches this")
    p.add_argument("--faults", default=None,
                   help=f"comma-separated faults to draw from (default: all of {', '.join(FAULTS)}"
                        f", and with --hosts also {', '.join(LINK_FAULTS)}; "
                        f"also {', '.join(MASTER_FAULTS)})")
    p.add_argument("--hosts", action="store_true",
                   help="every tier on an emulated host of its own (a network namespace, "
                        "needs root), links capped at --link-mbit; allows link faults")
    p.add_argument("--link-mbit", type=float, default=1000.0,
                   help="with --hosts: every host's link rate each way, Mbit/s (default 1000)")
    args = p.parse_args()
    if args.hosts and unavailable():
        p.error(f"--hosts: {unavailable()}")
    default = FAULTS + LINK_FAULTS if args.hosts else FAULTS
    args.faults = [f.strip() for f in (args.faults or ",".join(default)).split(",") if f.strip()]
    known = FAULTS + MASTER_FAULTS + (LINK_FAULTS if args.hosts else ())
    unknown = sorted(set(args.faults) - set(known))
    if unknown or not args.faults:
        p.error(f"--faults: unknown {unknown}; choose from {', '.join(known)}"
                + ("" if args.hosts else f" ({', '.join(LINK_FAULTS)} need --hosts)"))
    if args.minutes <= 0 or args.interval_s <= 0 or args.workers < 1 or args.relays < 1:
        p.error("--minutes and --interval-s must be > 0, --workers and --relays >= 1")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(SIMULATED, flush=True)
    t = time.time()
    runs = {}
    if args.no_faults or args.compare:
        runs["baseline"] = soak(args, out / "baseline", faults=False)
    if not args.no_faults:
        runs["chaos"] = soak(args, out / "chaos", faults=True)
    print("\n" + SIMULATED)
    for r in runs.values():
        report(r)
    useful = (runs["chaos"] if "chaos" in runs else runs["baseline"])["useful_fraction"]
    ratio = (useful / runs["baseline"]["useful_fraction"]
             if "chaos" in runs and "baseline" in runs and runs["baseline"]["useful_fraction"]
             else None)
    measure = ratio if ratio is not None else useful
    holds = all(r["exactly_once"]["holds"] for r in runs.values())
    print(f"\nwall time {time.time() - t:.0f} s; useful training time {useful:.3f}" +
          (f", baseline {runs['baseline']['useful_fraction']:.3f}, ratio {ratio:.3f}"
           if ratio is not None else ""))
    print(f"useful-time goal {USEFUL_GOAL:.0%} ({'ratio to baseline' if ratio else 'fraction'}): "
          f"{'PASS' if measure >= USEFUL_GOAL else 'MISS'}")
    print(f"exactly-once: {'HOLDS' if holds else 'BROKEN'}")
    result = {"simulated": SIMULATED, "args": vars(args), "wall_s": round(time.time() - t, 1),
              "useful_fraction": useful, "useful_ratio": ratio, "useful_goal": USEFUL_GOAL,
              "useful_pass": measure >= USEFUL_GOAL, "exactly_once": holds, "runs": runs}
    (out / "chaos_result.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"result: {out / 'chaos_result.json'}; logs under {out}/*/logs")
    if not holds:
        return 1
    return 1 if args.require_useful is not None and measure < args.require_useful else 0


if __name__ == "__main__":
    sys.exit(main())
