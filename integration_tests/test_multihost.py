"""Issue 15: a stack spread over hosts, emulated on this machine.

Three hosts are three network namespaces (issue 38: separate network stacks, joined by
a bridge, links capped at 1 Gbit/s; ``laminar_common.testing.hosts``), at 198.18.0.1,
.2 and .3, each with its own ``host_id``. Every tier runs in its host's namespace and
binds only its own host's address, so a member that advertised loopback, its bind
address of another host, or the wrong host would be unreachable (loopback is each
host's own) and the job would not finish; a worker that read weights from another
host's relay shows up in the relays' fetch counters. etcd (embedded) listens on host A
only. The test itself runs outside every host and reads etcd and the metrics through
forwards into host A.

- ``test_three_hosts_...``: ``laminar up`` with authentication on everywhere
  (``laminar keys --split --host`` for the three addresses): host A runs etcd,
  a relay, the manager and the trainer; hosts B and C a relay and a worker
  each. The job ends with every prompt trained exactly once, every member's
  etcd record advertises its own host's address, and each worker's fetches
  are counted by its own host's relay only.
- ``test_a_job_spanning_hosts_without_auth_is_refused``: the same job without
  ``auth.dir`` is refused before anything starts, naming the tiers; with
  ``auth: {insecure: true}`` it passes that check with a loud warning.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import consumed_ids, laminar_up, metric_value, scrape_metrics
from laminar_common.errors import LaminarError
from laminar_common.etcd import EtcdCoordinator
from laminar_common.launch.processes import ChildProcess
from laminar_common.launch.readiness import wait_ready
from laminar_common.roles import Extra
from laminar_common.testing.hosts import EmulatedHosts, unavailable

# One pytest-xdist worker runs this file's tests and the launcher's Ray test (the "ray"
# group): they share a module fixture, and one Ray cluster at a time runs on this machine.
# The cost is the file's (so its tests stay together, in file order).
WHY = unavailable()
pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.cost(150),
              pytest.mark.skipif(WHY is not None, reason=str(WHY))]

HOSTS = {"a": "198.18.0.1", "b": "198.18.0.2", "c": "198.18.0.3"}


@pytest.fixture(scope="module")
def net():
    """Hosts a, b, c (in this order: the addresses above)."""
    with EmulatedHosts(list(HOSTS), rate_mbit=1000) as hosts:
        assert {h: hosts.address(h) for h in HOSTS} == HOSTS
        yield hosts


def _wrap(net, host: str) -> list[str]:
    return net.cmd(host, [])


def _local(net, address: str) -> str:
    """``HOST:PORT`` (or a URL) on host A, as the test reaches it: a forward into A."""
    scheme, _, rest = address.rpartition("//")
    host, port = rest.split("/", 1)[0].rsplit(":", 1)
    path = rest[len(host) + len(port) + 1:]
    name = next((h for h, ip in HOSTS.items() if ip == host), None)
    assert name is not None, f"{address!r} is on none of the hosts {HOSTS}"
    local = f"127.0.0.1:{net.forward(name, int(port))}{path}"
    return f"{scheme}//{local}" if scheme else local
STEPS = 6
GROUPS, GROUP_SIZE = 4, 4


TIER_MODULES = {"laminar-relay": "laminar_relay.cli", "laminar-rollout": "laminar_rollout.cli",
                "laminar-trainer": "laminar_trainer.cli"}


def _on_host(net, host: str, command: list[str]) -> list[str]:
    """A tier's command run in host ``host``'s namespace with this interpreter."""
    return _wrap(net, host) + [sys.executable, "-m", TIER_MODULES[command[0]], *command[1:]]


def _job(run_dir: Path, auth: dict | None, net) -> dict:
    """Host A: etcd, relay-a, manager, trainer; hosts B, C: a relay and a worker each."""

    def on(host: str, tier: str, **config) -> dict:
        listen = {"bind_host": HOSTS[host]} if tier != "worker" else {}
        a = auth if auth is None or "dir" not in auth else \
            {"dir": f"{auth['dir']}/{'rollout' if tier in ('manager', 'worker') else tier}"}
        return {"host_id": f"host-{host}", **listen, **({"auth": a} if a else {}), **config}

    tiers: dict = {}
    for h in HOSTS:
        tiers[f"relay-{h}"] = {
            "command": _on_host(net, h, ["laminar-relay", "serve"]),
            "config": on(h, "relay", member_id=f"relay-{h}",
                         metrics={"port": 0, "host": HOSTS[h]},
                         store={"max_bytes": 64 << 20})}
    tiers["manager"] = {
        "command": _on_host(net, "a", ["laminar-rollout", "manage"]), "ready": "manager",
        "config": on("a", "manager", prompts="{run_dir}/train.jsonl", group_size=GROUP_SIZE,
                     batch_groups=GROUPS, mode="laminar", sampling={"max_tokens": 64})}
    for h in ("b", "c"):
        tiers[f"worker-{h}"] = {
            "command": _on_host(net, h, ["laminar-rollout", "serve"]),
            "config": on(h, "worker", worker_id=f"worker-{h}", report_interval_s=0.2,
                         engine={"type": "simulated", "max_batch": 8, "median_length": 12,
                                 "max_length": 64, "step_time_base": 0.002,
                                 "step_time_per_seq": 0.0002})}
    tiers["trainer"] = {
        "command": _on_host(net, "a", ["laminar-trainer", "run"]),
        "config": on("a", "trainer", trainer_id="trainer",
                     simulate={"step_s": 0.3, "weight_bytes": 1 << 20}, batch_groups=GROUPS,
                     total_steps=STEPS, run_dir="{run_dir}/trainer",
                     publish_delta_full_every=4)}
    setup = [["laminar-examples", "prompts", "--task", "sort", "--n", "500", "--split", "train",
              "--out", "{run_dir}/train.jsonl"]]
    if auth and "dir" in auth:
        setup.append(["laminar", "keys", "--split", "--out", auth["dir"],
                      *[a for ip in HOSTS.values() for a in ("--host", ip)]])
    return {"job": "threehosts", "run_dir": str(run_dir),
            "etcd": {"embedded": True, "host": HOSTS["a"], "ttl_s": 3},
            "setup": setup, "tiers": tiers, "wait_for": "trainer", "timeout_s": 300}


def test_three_hosts_train_exactly_once_and_read_weights_from_their_own_hosts_relay(tmp_path,
                                                                                    net):
    run_dir = tmp_path / "run"
    up = laminar_up(tmp_path, _job(run_dir, {"dir": "{run_dir}/keys"}, net),
                    wrap=_wrap(net, "a"))
    try:
        up.wait_for_line(r"this job spans hosts \(.*3 host ids", 60)
        endpoint = up.wait_for_line(r"etcd at (\S+)", 120).group(1)
        assert endpoint == f"{HOSTS['a']}:{endpoint.rsplit(':', 1)[1]}", endpoint
        up.wait_for_line(r"trainer: STEP 3 ", 240)
        coord = EtcdCoordinator([_local(net, endpoint)], "threehosts", connect_timeout_s=10)
        try:
            members = coord.members()
        finally:
            coord.close()
        # Every listening member advertises its own host's address, every member its host id.
        for mid, host in (("relay-a", "a"), ("relay-b", "b"), ("relay-c", "c"),
                          ("manager", "a"), ("trainer", "a")):
            rec = members[mid]
            assert rec.address.split("//")[-1].rsplit(":", 1)[0] == HOSTS[host], (mid, rec)
            assert rec.host_id == f"host-{host}", (mid, rec.host_id)
        for h in ("b", "c"):
            assert members[f"worker-{h}"].host_id == f"host-{h}"
        # Each worker read weights from its own host's relay, and from no other.
        fetches = {h: scrape_metrics(_local(net, members[f"relay-{h}"].extra[Extra.METRICS]))
                   for h in HOSTS}
        for h in HOSTS:
            for w in ("b", "c"):
                n = metric_value({k: v for k, v in fetches[h].items()
                                  if f'reader="worker-{w}"' in k},
                                 "laminar_relay_fetches_total")
                assert (n > 0) == (h == w), (f"relay-{h}", f"worker-{w}", n, fetches[h])
        up.wait_for_line(r"trainer exited with \[0\]", 240)
        assert up.proc.wait(120) == 0
    finally:
        up.stop(grace_s=30)
    # Versions after the first went as deltas (full every 4th); workers rebuilt them.
    for h in ("b", "c"):
        text = (run_dir / "logs" / f"worker-{h}.log").read_text()
        assert "rebuilt from deltas" in text, text[-2000:]
    trainer_dir = run_dir / "trainer"
    consumed = consumed_ids(trainer_dir)
    assert len(consumed) == len(set(consumed)) == STEPS * GROUPS * GROUP_SIZE
    summary = json.loads((trainer_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS


def test_a_job_spanning_hosts_without_auth_is_refused(tmp_path, net):
    up = laminar_up(tmp_path, _job(tmp_path / "run", None, net), wrap=_wrap(net, "a"))
    assert up.proc.wait(60) != 0
    up.wait_for_line(r"this job spans hosts \(.*3 host ids.*\) but relay-a, relay-b, relay-c, "
                     r"manager, worker-b, worker-c, trainer run without authentication", 10)
    assert not (tmp_path / "run" / "logs" / "relay-a.log").exists()

    insecure = tmp_path / "insecure"
    insecure.mkdir()
    job = _job(insecure / "run", {"insecure": True}, net)
    job["tiers"]["trainer"]["config"]["total_steps"] = 1
    up = laminar_up(insecure, job, wrap=_wrap(net, "a"))
    try:
        up.wait_for_line(r"WARNING: this job spans hosts .* run WITHOUT AUTHENTICATION", 60)
    finally:
        up.stop(grace_s=30)


# -- a real multi-node Ray cluster on this machine ------------------------------------------
#
# A head node at host A's address and two worker nodes at B and C (``ray start`` with
# --node-ip-address, each its own raylet). ``laminar up --backend ray --address`` runs the
# job on it: etcd embedded on the head's address, manager and trainer on the head (custom
# resource ``head``), one relay on every node that runs workers (``replicas: -1`` with the
# ``rollout`` resource) and two workers spread over B and C. No tier address or host id is
# configured: each actor tells its tier the node it runs on.

# Room for a third worker on each worker node: a worker lost with node C is restarted on
# node B beside B's worker (1) and relay (0.01); with 2 it waited until the run ended.
RAY_NODES = {"a": '{"head": 1}', "b": '{"rollout": 3}', "c": '{"rollout": 3}'}


def _descendants(pid: int) -> list[int]:
    """``pid``'s children, grandchildren, ... (read from /proc)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(proc.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(child: ChildProcess) -> list[int]:
    """SIGKILL ``child`` and every process under it (a node lost: raylet, actors, tiers)."""
    victims = [child.pid, *_descendants(child.pid)]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return victims


@pytest.fixture(scope="module")
def ray_cluster(net):
    pytest.importorskip("ray")
    ray_bin = str(Path(sys.executable).parent / "ray")
    temp = tempfile.mkdtemp(prefix="lr", dir="/tmp")  # short: Ray's socket paths must fit
    port = 6379  # host A is a fresh network stack: nothing else listens there
    # Ray's token authentication, one token for this cluster: every node, the driver
    # (laminar up) and the actors present it (and a ~/.ray/auth_token left by another
    # Ray never decides the mode).
    # A lost node is declared dead after ~5 failed 1 s health checks (Ray's default is
    # 5 x 3 s after a 5 s delay), so the node-loss test does not depend on a slow machine
    # being fast enough to restart the worker before the run ends.
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "1000",
           "RAY_health_check_timeout_ms": "3000", "RAY_health_check_failure_threshold": "5"}
    nodes: dict[str, ChildProcess] = {}
    common = ["--num-cpus", "1", "--object-store-memory", str(100 << 20),
              "--disable-usage-stats", "--block"]
    try:
        for h, resources in RAY_NODES.items():
            where = ["--head", "--port", str(port), "--temp-dir", temp,
                     "--include-dashboard", "false"] if h == "a" else \
                ["--address", f"{HOSTS['a']}:{port}"]
            # Each node in its host's namespace (`ip netns exec` execs: the pid is ray's).
            nodes[h] = ChildProcess(f"ray-{h}", net.cmd(h, [
                ray_bin, "start", *where, "--node-ip-address", HOSTS[h], "--resources",
                resources, *common]), f"{temp}/ray-{h}.log", env=env)
            nodes[h].wait_for_line(r"Ray runtime started", 120)
        probe = subprocess.run(
            net.cmd("a", [sys.executable, "-c", "import ray, time\n"
             f"ray.init(address='{HOSTS['a']}:{port}', log_to_driver=False)\n"
             "for _ in range(200):\n"
             "    ips = sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])\n"
             "    if len(ips) == 3: break\n"
             "    time.sleep(0.3)\n"
             "print(' '.join(ips))"]), capture_output=True, text=True, timeout=120,
            env={**os.environ, **env})
        assert probe.stdout.split() == sorted(HOSTS.values()), probe.stdout + probe.stderr
        yield f"{HOSTS['a']}:{port}", nodes, env, net
    finally:
        for child in reversed(list(nodes.values())):
            tree = _descendants(child.pid)
            child.stop(grace_s=30)
            for pid in tree:  # whatever `ray start` left behind, by pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(temp, ignore_errors=True)


def _ray_job(run_dir: Path, steps: int) -> dict:
    keys = "{run_dir}/keys"
    auth = {t: {"dir": f"{keys}/{t}"} for t in ("relay", "rollout", "trainer")}
    return {
        "job": "raynodes", "run_dir": str(run_dir), "etcd": {"embedded": True, "ttl_s": 3},
        "setup": [["laminar-examples", "prompts", "--task", "sort", "--n", "2000", "--split", "train",
                   "--out", "{run_dir}/train.jsonl"],
                  ["laminar", "keys", "--split", "--out", keys,
                   *[a for ip in HOSTS.values() for a in ("--host", ip)]]],
        "tiers": {
            "relay": {"command": ["laminar-relay", "serve"], "replicas": -1,
                      "id_field": "member_id", "resources": {"rollout": 0.01},
                      "config": {"metrics": {"port": 0, "host": "0.0.0.0"},
                                 "store": {"max_bytes": 64 << 20},
                                 "auth": auth["relay"]}},
            "manager": {"command": ["laminar-rollout", "manage"], "ready": "manager",
                        "resources": {"head": 0.1},
                        "config": {"prompts": "{run_dir}/train.jsonl", "group_size": GROUP_SIZE,
                                   "batch_groups": GROUPS, "mode": "laminar",
                                   "sampling": {"max_tokens": 64}, "auth": auth["rollout"]}},
            "worker": {"command": ["laminar-rollout", "serve"], "replicas": 2,
                       "id_field": "worker_id", "resources": {"rollout": 1},
                       "config": {"report_interval_s": 0.2, "auth": auth["rollout"],
                                  "engine": {"type": "simulated", "max_batch": 8,
                                             "median_length": 12, "max_length": 64,
                                             "step_time_base": 0.004,
                                             "step_time_per_seq": 0.0004}}},
            "trainer": {"command": ["laminar-trainer", "run"], "resources": {"head": 0.1},
                        "config": {"trainer_id": "trainer", "batch_groups": GROUPS,
                                   "simulate": {"step_s": 0.3, "weight_bytes": 1 << 20},
                                   "total_steps": steps, "run_dir": "{run_dir}/trainer",
                                   "auth": auth["trainer"]}},
        },
        "wait_for": "trainer", "timeout_s": 600}


def _up_ray(tmp_path: Path, job: dict, cluster) -> ChildProcess:
    address, _, env, net = cluster
    return laminar_up(tmp_path, job, "--backend", "ray", "--address", address, env=env,
                      wrap=_wrap(net, "a"))


def _placement(net, endpoint: str) -> dict:
    coord = EtcdCoordinator([_local(net, endpoint)], "raynodes", connect_timeout_s=10)
    try:
        return coord.members()
    finally:
        coord.close()


def _host(address: str) -> str:
    return address.split("//")[-1].rsplit(":", 1)[0]


def test_ray_across_three_nodes_one_relay_per_worker_node_exactly_once(tmp_path, ray_cluster):
    steps = 8
    up = _up_ray(tmp_path, _ray_job(tmp_path / "run", steps), ray_cluster)
    try:
        up.wait_for_line(r"this job spans hosts \(it runs on 3 nodes", 120)
        endpoint = up.wait_for_line(r"etcd at (\S+)", 120).group(1)
        assert _host(endpoint) == HOSTS["a"], endpoint  # the head's address, not loopback
        up.wait_for_line(r"started relay-1 as a Ray actor", 60)
        assert not any("started relay-2" in line for line in up.lines)
        # Ray actors start slowly on 2 busy cores (the trainer's first line came 140 s
        # after `laminar up` in a CI run beside the tools job): the wait is generous.
        up.wait_for_line(r"trainer: STEP 3 ", 420)
        members = _placement(ray_cluster[3], endpoint)
        relays = {m: r for m, r in members.items() if r.role == "relay"}
        workers = {m: r for m, r in members.items() if r.role == "worker"}
        # One relay on each worker node, none on the head; each advertises its node.
        assert sorted(_host(r.address) for r in relays.values()) == [HOSTS["b"], HOSTS["c"]]
        assert _host(members["manager"].address) == _host(members["trainer"].address) == \
            HOSTS["a"]
        assert len({w.host_id for w in workers.values()}) == 2  # spread over B and C
        for wid, w in workers.items():
            for rid, r in relays.items():
                samples = scrape_metrics(_local(ray_cluster[3], r.extra[Extra.METRICS]))
                n = metric_value({k: v for k, v in samples.items() if f'reader="{wid}"' in k},
                                 "laminar_relay_fetches_total")
                assert (n > 0) == (r.host_id == w.host_id), (wid, rid, n)
        up.wait_for_line(r"trainer exited with 0", 240)
        assert up.proc.wait(120) == 0
    finally:
        up.stop(grace_s=60)
    consumed = consumed_ids(tmp_path / "run" / "trainer")
    assert len(consumed) == len(set(consumed)) == steps * GROUPS * GROUP_SIZE


def test_ray_job_survives_losing_a_worker_node(tmp_path, ray_cluster):
    """Node C's raylet and everything under it (its relay, its worker) are SIGKILLed
    mid-run: the worker comes back on node B, reads from B's relay, and the run ends
    with every prompt trained exactly once. The run is long enough (150 steps of at
    least 0.3 s) for Ray to see the node gone and start the worker again; if the run
    ends or fails first, the test says so with ``laminar up``'s tail."""
    _, nodes, _, net = ray_cluster
    steps = 200
    up = _up_ray(tmp_path, _ray_job(tmp_path / "run", steps), ray_cluster)
    try:
        endpoint = up.wait_for_line(r"etcd at (\S+)", 120).group(1)
        up.wait_for_line(r"trainer: STEP 4 ", 420)
        before = _placement(net, endpoint)
        lost = [m for m, r in before.items() if r.role == "worker"
                and before[next(k for k, x in before.items() if x.role == "relay"
                                and x.host_id == r.host_id)].address.startswith(HOSTS["c"])]
        assert len(lost) == 1, before
        node_b = {r.host_id for r in before.values() if r.role == "relay"
                  and _host(r.address) == HOSTS["b"]}
        killed_at = time.time()
        victims = _kill_tree(nodes["c"])
        assert len(victims) > 3  # ray start, raylet, the actors, their tiers
        # The lost worker registers again, on node B this time, while the run goes on.
        coord = EtcdCoordinator([_local(net, endpoint)], "raynodes", connect_timeout_s=10)
        try:
            back = wait_ready(coord, "worker", lost[0], timeout_s=180, newer_than=killed_at,
                              alive=up.alive)[0]
        except LaminarError as exc:
            pytest.fail(f"the lost worker did not come back while the run went on ({exc}); "
                        "laminar up:\n" + "\n".join(up.tail(60)))
        finally:
            coord.close()
        assert back.host_id in node_b, (back.host_id, node_b)
        # ... and the run went on with it: the trainer had steps left when it came back.
        assert not any(f"trainer: STEP {steps} " in line for line in up.lines), up.tail(20)
        up.wait_for_line(r"trainer exited with 0", 300)
        assert up.proc.wait(120) == 0
    finally:
        up.stop(grace_s=60)
    consumed = consumed_ids(tmp_path / "run" / "trainer")
    assert len(consumed) == len(set(consumed)) == steps * GROUPS * GROUP_SIZE
