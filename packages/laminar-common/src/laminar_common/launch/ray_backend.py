"""``laminar up --backend ray``: each tier replica as a Ray actor.

Owns placing replicas on a Ray cluster by resources and restarting failed
ones. Each actor supervises one child process — the tier's own CLI, exactly
as the local backend starts it — so the tiers stay Ray-agnostic and this
module imports none of them. Ray is imported only here (optional extra
``laminar-common[ray]``).

Placement: a tier's ``resources`` map (``{GPU: 1}``, ``{CPU: 2}``, custom
resources) becomes the actor's Ray resource request, so rollouts and the
trainer land on GPU nodes. ``replicas: -1`` starts one replica on every
alive node, pinned there (node affinity; the usual choice for relays, so
every rollout has a local one); other relay replicas, and the replicas of any
tier with more than one, are spread over the nodes that fit them (``SPREAD``:
one node lost takes as few of a tier's replicas as it can).
A replica whose process exits with a non-zero code (or whose actor dies) is
restarted by Ray, up to the tier's ``max_restarts`` (-1: always), with the
tier's resume arguments added (its ``restart_args``, else ``--resume`` for Laminar's
trainer and manager: a restart that started afresh would remove the run's checkpoints); this
includes the ``wait_for`` tier, whose exit with 0 ends the run.

Per node: each actor tells its tier which node it runs on, unless the tier's
config says so itself: ``LAMINAR_HOST_ID=ray-<node id>`` (members on one Ray
node are one host: a worker maps the weights of the relay on its own node)
and, on a cluster of more than one node, for a tier that sets neither
``bind_host`` nor ``advertise_host``, ``LAMINAR_ADVERTISE_HOST=<node address>``
(the address Ray knows the node by, which the other nodes reach; on one node
the tiers stay on loopback). ``replicas: -1`` with custom ``resources``
places one replica on every alive node that has those resources (``{rollout:
0.01}`` for relays puts one relay on each node that runs workers). A tier's
process is started under ``setpriv --pdeathsig KILL`` where there is one, so
it dies with its actor: a node lost takes its tiers with it, and a restarted
actor never finds its old process still running.

etcd: on a single node the embedded etcd listens on loopback; on a cluster of
more than one node it listens on the head node's address (the driver's, as
Ray knows it; ``etcd.host`` overrides it), so every node reaches it — or give
``etcd.endpoints`` of an external etcd. It serves TLS exactly as with the
local backend (the tiers' ``auth.dir``; see :mod:`laminar_common.launch.local`;
its certificate must then name that address: ``laminar keys --etcd
--etcd-host ADDR``). A job on more than one node is a job that spans hosts
(:mod:`laminar_common.launch.hosts`): it needs ``auth.dir`` in every tier, or
``auth: {insecure: true}``.

Before anything starts, the tier configs are checked on this machine as with
the local backend, except with ``--ray-address`` (the tiers run on the
cluster's nodes, whose paths and environment may differ): then the tiers
check their own configs when they start. The run dir is this launch's and the
report reads only its metrics, as with the local backend.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from laminar_common.errors import LaminarError
from laminar_common.launch.jobfile import JobFile, fill_placeholders, resume_args
from laminar_common.launch.local import LocalLauncher
from laminar_common.launch.readiness import wait_ready

__all__ = ["RayLauncher", "node_env"]


def node_env(config: dict, environ, node_id: str, node_ip: str | None) -> dict[str, str]:
    """The ``LAMINAR_*`` variables that tell a tier replica which Ray node it runs on.

    Only what neither the tier's ``config`` nor the node's environment sets:
    ``LAMINAR_HOST_ID`` (``ray-<node id>``) and, given a ``node_ip`` (on a
    cluster of more than one node; on one node the tiers stay on loopback), for
    a tier that chooses no address itself, ``LAMINAR_ADVERTISE_HOST``. A tier
    without such a field ignores the variable (see :func:`~laminar_common.config.load_config`).
    """
    env = {}
    if not config.get("host_id") and "LAMINAR_HOST_ID" not in environ:
        env["LAMINAR_HOST_ID"] = f"ray-{node_id[:16]}"
    if node_ip and not (config.get("bind_host") or config.get("advertise_host")) and \
            "LAMINAR_ADVERTISE_HOST" not in environ and "LAMINAR_BIND_HOST" not in environ:
        env["LAMINAR_ADVERTISE_HOST"] = node_ip
    return env


def _actor_class(ray):
    @ray.remote(max_task_retries=0)
    class TierReplica:
        """Runs one tier replica's CLI as a child process and reports on it."""

        def __init__(self, name: str, argv: list[str], config_text: str, log_dir: str,
                     restart_args: list[str], multi_node: bool) -> None:
            import shutil
            import sys

            import ray
            import yaml

            from laminar_common.launch.processes import ChildProcess, tier_env

            self.name = name
            context = ray.get_runtime_context()
            if context.was_current_actor_reconstructed:
                argv = [*argv, *restart_args]
            work = Path(tempfile.mkdtemp(prefix=f"laminar-{name}-"))
            cfg = work / f"{name}.yaml"
            cfg.write_text(config_text)
            argv = [sys.executable if a == "{python}" else a for a in argv]
            argv = [str(cfg) if a == "{config}" else a for a in argv]
            setpriv = shutil.which("setpriv")
            if setpriv:
                argv = [setpriv, "--pdeathsig", "KILL", "--", *argv]
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            env = tier_env(os.environ)
            env.update(node_env(yaml.safe_load(config_text) or {}, os.environ,
                                context.get_node_id(),
                                ray.util.get_node_ip_address() if multi_node else None))
            self.node = context.get_node_id()
            self.child = ChildProcess(name, argv, str(Path(log_dir) / f"{name}.log"), env=env)
            self.seen = 0

        def node_id(self) -> str:
            return self.node

        def poll(self) -> tuple[bool, int | None, list[str], int]:
            lines = self.child.lines[self.seen:]
            self.seen += len(lines)
            code = self.child.poll()
            return code is None, code, lines, os.getpid()

        def fail_if_crashed(self) -> bool:
            """Exit the actor (so Ray restarts it) if the child crashed."""
            code = self.child.poll()
            if code not in (None, 0):
                os._exit(1)
            return code is None

        def stop(self) -> int:
            return self.child.stop(grace_s=15)

    return TierReplica


class RayLauncher(LocalLauncher):
    """Runs a :class:`JobFile` on a Ray cluster (``address``) or a local Ray."""

    lays_out = False
    """A cluster's nodes, not this machine's cores, run the tiers: no ``layout: auto``."""

    def __init__(self, job: JobFile, address: str | None = None, num_cpus: int | None = None,
                 echo: bool = True, job_file: str | None = None, start: str = "new") -> None:
        super().__init__(job, echo, job_file, start=start)
        try:
            import ray
        except ImportError as exc:
            raise LaminarError("--backend ray needs Ray: pip install 'laminar-common[ray]'") from exc
        self.ray = ray
        self.address = address
        self.num_cpus = num_cpus
        self.actors: list[tuple[str, object]] = []

    def _init_ray(self):
        ray = self.ray
        if not ray.is_initialized():
            kwargs = {"address": self.address} if self.address else {"num_cpus": self.num_cpus}
            ray.init(include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONUNBUFFERED": "1"}}, **kwargs)
        return ray

    def nodes(self) -> int:
        return len(self._alive_nodes())

    def etcd_host(self) -> str:
        if self.job.etcd.host:
            return self.job.etcd.host
        return self._init_ray().util.get_node_ip_address() if self.nodes() > 1 else "127.0.0.1"

    def start_tiers(self):  # type: ignore[override]
        ray = self._init_ray()
        replica_cls = _actor_class(ray)
        multi_node = self.nodes() > 1
        started: dict[str, list[object]] = {}
        for tier, spec in self.job.tiers.items():
            started[tier] = []
            t0 = time.time()
            nodes = self._alive_nodes(spec.resources) if spec.replicas == -1 else []
            for i in range(len(nodes) or spec.replicas):
                name, argv = self.replica_argv(tier, spec, i)
                config_text = Path(argv[argv.index("--config") + 1]).read_text()
                if argv[0] == sys.executable:
                    argv[0] = "{python}"  # the actor's own interpreter
                argv[argv.index("--config") + 1] = "{config}"
                res = dict(spec.resources)
                options = {"num_cpus": res.pop("CPU", 0.1), "num_gpus": res.pop("GPU", 0),
                           "resources": res or None, "name": f"{self.job.job}-{name}",
                           "max_restarts": spec.max_restarts}
                if nodes:
                    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                    options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                        node_id=nodes[i], soft=False)
                elif tier == "relay" or spec.replicas > 1:
                    options["scheduling_strategy"] = "SPREAD"
                actor = replica_cls.options(**options).remote(
                    name, argv, config_text, str(self.run_dir / "logs"),
                    list(resume_args(spec)), multi_node)
                self.actors.append((name, actor))
                started[tier].append(actor)
                self._say(f"started {name} as a Ray actor ({options['num_cpus']} CPU, "
                          f"{options['num_gpus']} GPU)")
            if spec.ready:
                # A replica that exits before it is ready is restarted by Ray: wait on.
                wait_ready(self._coordinator(), spec.ready, count=len(started[tier]),
                           timeout_s=300, newer_than=t0)
                self._say(f"{len(started[tier])} {spec.ready} ready")
        return started

    def _alive_nodes(self, resources: dict[str, float] | None = None) -> list[str]:
        """Ids of the cluster's alive nodes that have every resource named in
        ``resources`` other than CPU (for ``replicas: -1``)."""
        needed = [r for r in (resources or {}) if r != "CPU"]
        nodes = sorted(n["NodeID"] for n in self._init_ray().nodes()
                       if n.get("Alive") and all(n.get("Resources", {}).get(r, 0) > 0
                                                 for r in needed))
        if not nodes:
            raise LaminarError("Ray reports no alive node to place per-node replicas on"
                               + (f" (with {', '.join(needed)})" if needed else ""))
        return nodes

    def run(self) -> int:
        import signal

        previous = {s: signal.signal(s, lambda *_: self._stop.set())
                    for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.address is not None:
                self._say("tier configs not checked here: the tiers run on the Ray cluster's "
                          "nodes, whose files and environment may differ from this machine's")
            self.prepare(check=self.address is None)
            started = self.start_tiers()
            target = started[self.job.wait_for][0]
            spec = self.job.tiers[self.job.wait_for]
            others = [a for _, a in self.actors if a is not target]
            deadline = time.monotonic() + self.job.timeout_s
            restarts = 0
            unreachable_since: float | None = None
            while True:
                if self._stop.wait(0.5):
                    self._say("interrupted: shutting down")
                    return 130
                if time.monotonic() > deadline:
                    self._say(f"timeout after {self.job.timeout_s:.0f}s")
                    return 124
                try:
                    alive, code, lines, _ = self.ray.get(target.poll.remote())
                    unreachable_since = None
                except self.ray.exceptions.RayActorError as exc:
                    # Ray is starting it again (it exited after its child crashed).
                    unreachable_since = unreachable_since or time.monotonic()
                    if time.monotonic() - unreachable_since > 300:
                        raise LaminarError(f"{self.job.wait_for} did not come back within "
                                           f"300s of a restart: {exc}") from exc
                    continue
                for line in lines:
                    if line.startswith(("STEP", "EVAL", "TRAINER", "WAITING")):
                        self._say(f"{self.job.wait_for}: {line[:300]}")
                if not alive and code not in (None, 0) and \
                        (spec.max_restarts < 0 or restarts < spec.max_restarts):
                    restarts += 1
                    self._say(f"{self.job.wait_for} crashed ({code}); restart {restarts} "
                              f"with {list(resume_args(spec))}")
                    target.fail_if_crashed.remote()
                    continue
                if not alive:
                    self._say(f"{self.job.wait_for} exited with {code}")
                    return code or 0
                for actor in others:
                    # A crashed replica takes its actor down; Ray starts a new one.
                    actor.fail_if_crashed.remote()
        finally:
            self.stop_all()
            self.launch.release()
            for s, h in previous.items():
                signal.signal(s, h)
            if self.job.report and self.actors:
                self._report(fill_placeholders(self.job.report, self.subs))

    def stop_all(self) -> None:
        for name, actor in reversed(self.actors):
            try:
                self.ray.get(actor.stop.remote(), timeout=30)
            except Exception as exc:  # noqa: BLE001 - best effort on shutdown; the actor is killed next
                self._say(f"{name}: stop failed ({type(exc).__name__}); killing the actor")
            self.ray.kill(actor, no_restart=True)
        if self.ray.is_initialized():
            self.ray.shutdown()
        super().stop_all()


def run_on_ray(job: JobFile, address: str | None, num_cpus: int | None,
               job_file: str | None = None, start: str = "new") -> int:
    return RayLauncher(job, address, num_cpus, job_file=job_file, start=start).run()

