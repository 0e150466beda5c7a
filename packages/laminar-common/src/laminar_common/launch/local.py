"""``laminar up job.yaml``: start a whole stack from one job file (local backend).

Owns reading the job file, running the job's set-up commands, starting an
embedded etcd (or using the given endpoints), writing one config file per
tier replica and starting each tier's own CLI as a child process with its log
in ``<run_dir>/logs/``. It imports no tier: it only runs their entry points.

Job file::

    job: demo
    run_dir: runs/demo
    etcd: {embedded: true}            # or {endpoints: ["host:2379"]}
    setup:                            # commands run in order before the tiers
      - [laminar-examples, warmstart, --out, "{run_dir}/model"]
    tiers:                            # started in this order
      relay:   {command: [laminar-relay, serve], replicas: 1, config: {...}}
      manager: {command: [laminar-rollout, manage], config: {...}}
      worker:  {command: [laminar-rollout, serve], replicas: 2, config: {...},
                id_field: worker_id}
      trainer: {command: [laminar-trainer, run], config: {...}}
    wait_for: trainer                 # the run ends when this tier exits

Strings may use ``{run_dir}``, ``{job}``, ``{name}`` (tier replica name) and
``{index}``. Every tier config gets ``job`` and ``etcd.endpoints`` filled in.
Laminar's console scripts and ``python`` / ``python3`` in a command (set-up or
tier) run with the interpreter ``laminar up`` itself runs in.

The embedded etcd follows the tiers' ``auth.dir`` (the one switch): when every
tier's ``auth.dir`` holds the ``laminar keys --etcd`` files (and the tier sets
no ``etcd.ca_cert`` / ``client_cert`` / ``client_key`` of its own), etcd
serves ``https://127.0.0.1:PORT`` with them, requiring client certificates
when the dir has ``etcd-client.pem``; when none does, it serves plaintext. A
mix is a :class:`ConfigError` naming the tiers. It starts after the set-up
commands, so a set-up step may write the keys (``laminar keys --etcd --out
{run_dir}/keys``).

Order of a launch: (1) lock the run dir and check every tier replica's
config with the tier's own check (:mod:`laminar_common.launch.preflight`,
``--print-config``; parallel, well under a second a tier here) — a failure
names the tier, its config file and the tier's error text and ends the
launch with nothing started; (2) make the run dir this launch's
(:mod:`laminar_common.launch.rundir`: ``launch.json``, fresh ``logs/`` and
etcd data); (3) the set-up commands, then the checks a set-up product was
missing for, again; (4) etcd; (5) the tiers, in order.

A tier process that exits while the job runs (any replica of another tier,
or a ``wait_for`` replica with a non-zero code) ends the launch: its name,
exit code and the last lines of its log are printed, the rest of the stack
is stopped and ``run`` returns 1. The report (``report``) reads only what
this launch wrote.

Invariants: children are stopped (SIGTERM, then SIGKILL) in reverse start
order on exit, failure or Ctrl-C — only the pids this launcher started.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from laminar_common.auth import ETCD_CA, ETCD_TLS_FIELDS, etcd_tls_for
from laminar_common.errors import ConfigError, LaminarError
from laminar_common.launch import preflight
from laminar_common.launch.databudget import check_data_budget
from laminar_common.launch.hosts import check_auth, is_laminar_tier, spanning_reasons
from laminar_common.launch.jobfile import JobFile, TierSpec, fill_placeholders, saved_state
from laminar_common.launch.layout import apply_layout, usable_cores
from laminar_common.launch.local_etcd import LocalEtcd
from laminar_common.launch.processes import ChildProcess, tier_env
from laminar_common.launch.readiness import wait_ready
from laminar_common.launch.rundir import RunDir

__all__ = ["LocalLauncher", "TAIL_LINES", "SETUP_ECHO_LINES"]

SETUP_ECHO_LINES = 60
"""Lines of a set-up step's output ``laminar up`` shows as they come (the rest: its log)."""

log = logging.getLogger(__name__)

TAIL_LINES = 40
"""Lines of a tier's log printed when it exits early."""

_UNSTARTED_ETCD = "127.0.0.1:2379"
"""The endpoint tier configs are checked with before the embedded etcd has its port."""


class LocalLauncher:
    """Runs a :class:`JobFile` as local subprocesses."""

    lays_out = True
    """Whether ``layout: auto`` applies (this machine's cores run every tier)."""

    def __init__(self, job: JobFile, echo: bool = True, job_file: str | None = None,
                 start: str = "new") -> None:
        self.start = start
        """``new``, ``resume`` or ``fresh`` (see :func:`laminar_common.launch.up.run_job`)."""
        self.cores = usable_cores()
        job, self.layout, self._layout_said = apply_layout(job, self.cores) \
            if self.lays_out else (job, None, [])
        self.job = job
        self.job_file = job_file
        self.run_dir = Path(fill_placeholders(job.run_dir, {"job": job.job}))
        self.subs = {"run_dir": str(self.run_dir), "job": job.job}
        self.launch = RunDir(self.run_dir)
        self.children: list[ChildProcess] = []
        self.tier_children: list[tuple[str, ChildProcess]] = []
        """(tier, process) of every tier replica started, in start order."""
        self.etcd: LocalEtcd | None = None
        self._coord = None
        self.endpoints: list[str] = list(job.etcd.endpoints)
        self.echo = echo
        self._stop = threading.Event()
        if job.wait_for not in job.tiers:
            raise ConfigError(f"wait_for: {job.wait_for!r} is not one of the tiers "
                              f"({', '.join(job.tiers)})")
        if not job.etcd.embedded and not job.etcd.endpoints:
            raise ConfigError("etcd: set embedded: true or give endpoints")
        for tier, spec in job.tiers.items():
            _torchrun(tier, spec, _resolve(list(spec.command)))  # refuses ranks it cannot start

    def _say(self, text: str) -> None:
        if self.echo:
            print(f"[laminar up] {text}", flush=True)

    def start_etcd(self) -> None:
        if self.job.etcd.embedded and not self.endpoints:
            tls_dir, mutual = self.embedded_etcd_tls()
            data_dir = self.run_dir / "etcd"
            data_dir.mkdir(parents=True, exist_ok=True)
            self.etcd = LocalEtcd(data_dir=str(data_dir), tls_dir=tls_dir,
                                  client_cert_auth=mutual, host=self.etcd_host()).start()
            self.endpoints = [self.etcd.endpoint]
            how = "" if tls_dir is None else \
                f" ({'mutual ' if mutual else ''}TLS with {tls_dir}/etcd-*.pem)"
            self._say(f"etcd at {self.etcd.endpoint}{how}")
        if not self.endpoints:
            raise ConfigError("etcd: set embedded: true or give endpoints")
        tls_dir = self.embedded_etcd_tls()[0] if self.etcd is not None else None
        self.launch.record(etcd=list(self.endpoints),
                           etcd_tls_dir=None if tls_dir is None else str(tls_dir))

    def etcd_host(self) -> str:
        """The address an embedded etcd listens on (``etcd.host``; 127.0.0.1 by default)."""
        return self.job.etcd.host or "127.0.0.1"

    def nodes(self) -> int:
        """Machines this launcher places tier replicas on (the local backend: this one)."""
        return 1

    def check_hosts(self) -> None:
        """Refuse a job that spans hosts without authentication (:mod:`.hosts`).

        Raises:
            ConfigError: it spans hosts and a Laminar tier sets neither ``auth.dir``
                nor ``auth.insecure: true``.
        """
        configs = {}
        for tier, spec in self.job.tiers.items():
            for i in range(self.replica_count(spec) if is_laminar_tier(spec.command) else 0):
                name, _, config = self._replica(tier, spec, i)
                configs[name] = config
        endpoints = self.job.etcd.endpoints or \
            ([f"{self.etcd_host()}:2379"] if self.job.etcd.embedded else [])
        reasons = spanning_reasons(configs, endpoints, self.nodes())
        insecure = check_auth(configs, reasons)
        if insecure:
            self._say(f"WARNING: this job spans hosts ({'; '.join(reasons)}) and "
                      f"{', '.join(insecure)} run WITHOUT AUTHENTICATION (auth.insecure: true): "
                      "anyone who reaches their sockets can push trajectories or publish "
                      "weights")
        elif reasons:
            self._say(f"this job spans hosts ({'; '.join(reasons)}): authentication on in "
                      "every Laminar tier")

    def embedded_etcd_tls(self) -> tuple[Path | None, bool]:
        """How the embedded etcd serves, decided by the tiers' ``auth.dir``.

        Returns:
            ``(None, False)``: plaintext (no tier takes etcd TLS from its
            ``auth.dir``); else the dir whose ``etcd-*.pem`` etcd serves and
            whether it requires client certificates (every such dir has
            ``etcd-client.pem``).

        Raises:
            ConfigError: some tiers take etcd TLS from ``auth.dir`` and others
                do not, or their dirs hold different etcd CAs.
        """
        with_tls: dict[str, dict[str, str]] = {}
        without: dict[str, str] = {}
        for tier, spec in self.job.tiers.items():
            _, _, config = self._replica(tier, spec, 0)
            paths, reason = _etcd_tls_of(tier, config)
            if paths:
                with_tls[tier] = paths
            else:
                without[tier] = reason
        if not with_tls:
            return None, False
        if without:
            raise ConfigError(
                "the embedded etcd serves either TLS or plaintext to every tier, but tiers "
                + ", ".join(f"{t} (auth.dir {str(Path(p['ca_cert']).parent)!r})"
                            for t, p in with_tls.items())
                + " take etcd TLS from auth.dir and tiers "
                + ", ".join(f"{t} ({why})" for t, why in without.items())
                + " do not: set the same auth.dir (from `laminar keys --etcd`) in every tier, "
                  "or none")
        cas = {tier: Path(p["ca_cert"]).read_bytes() for tier, p in with_tls.items()}
        first = next(iter(with_tls))
        differ = [t for t, ca in cas.items() if ca != cas[first]]
        if differ:
            raise ConfigError(
                f"tiers {first} and {', '.join(differ)} take etcd TLS from auth.dirs with "
                f"different {ETCD_CA} ({with_tls[first]['ca_cert']!r}, "
                f"{with_tls[differ[0]]['ca_cert']!r}); the embedded etcd trusts one CA: "
                "use one auth.dir for the whole job")
        mutual = all("client_cert" in p for p in with_tls.values())
        return Path(with_tls[first]["ca_cert"]).parent, mutual

    def run_setup(self) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for i, cmd in enumerate(self.job.setup):
            argv = fill_placeholders(list(cmd), self.subs)
            self._say("setup: " + shlex.join(argv))
            t0 = time.monotonic()
            child = ChildProcess(f"setup-{i}", _resolve(argv), str(logs / f"setup-{i}.log"),
                                 append=False, env=tier_env(os.environ))
            self.children.append(child)
            # Its output as it comes (a warm start's progress lines), at most
            # SETUP_ECHO_LINES of it; the whole of it is in the step's log.
            shown = 0
            while child.alive():
                if self._stop.wait(0.2):
                    raise LaminarError("interrupted during set-up")
                shown = self._echo_setup(child, shown)
            code = child.stop()
            shown = self._echo_setup(child, shown)
            if shown > SETUP_ECHO_LINES:
                self._say(f"  ({shown - SETUP_ECHO_LINES} more lines in {child.log_path})")
                if code != 0:  # its error is at the end: show that part too
                    for line in child.lines[max(SETUP_ECHO_LINES, shown - 10):]:
                        self._say(f"  {line[:200]}")
            if code != 0:
                raise LaminarError(f"setup command failed ({code}): {shlex.join(argv)}; "
                                   f"see {child.log_path}")
            self._say(f"setup done in {time.monotonic() - t0:.1f}s")

    def _echo_setup(self, child: ChildProcess, shown: int) -> int:
        """Say ``child``'s lines after the first ``shown`` (up to SETUP_ECHO_LINES in all);
        returns how many it has printed so far."""
        for line in child.lines[shown:]:
            if shown < SETUP_ECHO_LINES:
                self._say(f"  {line[:200]}")
            shown += 1
        return shown

    def replica_count(self, spec: TierSpec) -> int:
        """How many replicas of ``spec`` to start (``-1``, one per node, is 1 here)."""
        return 1 if spec.replicas == -1 else spec.replicas

    def _replica(self, tier: str, spec: TierSpec,
                 index: int) -> tuple[str, dict[str, str], dict[str, Any]]:
        """A replica's name, its substitutions and its config as the job file gives it."""
        name = tier if spec.replicas == 1 else f"{tier}-{index}"
        subs = dict(self.subs, name=name, index=str(index))
        return name, subs, fill_placeholders(dict(spec.config), subs)

    def replica_argv(self, tier: str, spec: TierSpec, index: int,
                     ranked: bool = True) -> tuple[str, list[str]]:
        """Write a replica's config file (``<run_dir>/configs/<name>.yaml``); its name and argv
        (under torchrun when ``spec.ranks`` > 1, unless not ``ranked``).

        Before etcd starts, an embedded etcd's endpoint is a placeholder
        (:data:`_UNSTARTED_ETCD`); the tiers are started with the real one.

        Raises:
            ConfigError: ``ranks`` > 1 for a command that is not ``python -m``.
        """
        name, subs, config = self._replica(tier, spec, index)
        config["job"] = self.job.job
        etcd = dict(config.get("etcd", {}))
        etcd.setdefault("endpoints", self.endpoints or [_UNSTARTED_ETCD])
        etcd.setdefault("ttl_s", self.job.etcd.ttl_s)
        config["etcd"] = etcd
        if spec.id_field:
            config[spec.id_field] = name
        cfg_dir = self.run_dir / "configs"
        cfg_dir.mkdir(parents=True, exist_ok=True)
        cfg_path = cfg_dir / f"{name}.yaml"
        cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
        argv = _resolve(list(spec.command)) + ["--config", str(cfg_path)] + \
            fill_placeholders(list(spec.args), subs)
        return name, _torchrun(tier, spec, argv) if ranked else argv

    def tier_checks(self) -> tuple[list[preflight.TierCheck], list[str]]:
        """Every replica's config check, and the tiers that have none (``check``)."""
        checks, unchecked = [], []
        for tier, spec in self.job.tiers.items():
            flag = spec.check if spec.check is not None else \
                preflight.default_check_args(spec.command)
            if not flag:
                unchecked.append(tier)
                continue
            for i in range(self.replica_count(spec)):
                name, argv = self.replica_argv(tier, spec, i, ranked=False)
                config_path = argv[argv.index("--config") + 1]
                shown = shlex.join([*spec.command, "--config", config_path,
                                    *argv[len(_resolve(list(spec.command))) + 2:], *flag])
                checks.append(preflight.TierCheck(tier, name, config_path,
                                                  (*argv, *flag), shown))
        return checks, unchecked

    def check_configs(self) -> list[preflight.TierCheck]:
        """Check every tier replica's config with the tier's own check, before the set-up.

        Returns:
            The checks deferred to after the set-up (every line of their error
            names a path a set-up command names; see :mod:`.preflight`).

        Raises:
            ConfigError: a check failed; the message names the tier, its config
                file and the tier's error text.
        """
        for old in (self.run_dir / "configs").glob("*.yaml"):
            old.unlink()  # a replica of an earlier launch's job file
        t0 = time.monotonic()
        checks, unchecked = self.tier_checks()
        failures = preflight.run_checks(checks, stop=self._stop,
                                        warn=lambda text: self._say(f"WARNING: {text}"))
        paths = preflight.setup_paths(
            (fill_placeholders(list(cmd), self.subs) for cmd in self.job.setup), self.run_dir)
        deferred = [f for f in failures if preflight.is_deferred(f.text, paths)]
        preflight.raise_for([f for f in failures if f not in deferred],
                            self.job_file or "the job file")
        note = "" if not deferred else \
            f" ({', '.join(f.check.replica for f in deferred)} again after the set-up, " \
            "which writes what they lack)"
        if unchecked:
            note += f"; not checked: {', '.join(unchecked)} (no check for their command)"
        self._say(f"checked {len(checks) - len(deferred)} tier config(s) in "
                  f"{time.monotonic() - t0:.1f}s{note}")
        return [f.check for f in deferred]

    def recheck_configs(self, checks: list[preflight.TierCheck]) -> None:
        """The checks deferred by :meth:`check_configs`, after the set-up.

        Raises:
            ConfigError: one still fails.
        """
        if not checks:
            return
        preflight.raise_for(preflight.run_checks(
            checks, stop=self._stop, warn=lambda text: self._say(f"WARNING: {text}")),
                            self.job_file or "the job file", after_setup=True)
        self._say(f"checked {len(checks)} tier config(s) after the set-up")

    def prepare(self, check: bool = True) -> None:
        """Everything before the tiers: lock, config checks, launch stamp, set-up, etcd."""
        self.launch.lock()
        self.check_earlier_run()
        self.check_hosts()
        deferred = self.check_configs() if check else []
        self.launch.begin(self.job.job, self.job_file,
                          self.job.etcd.embedded and not self.job.etcd.endpoints)
        self._say(f"launch {self.launch.launch_id} in {self.run_dir} "
                  f"(logs in {self.run_dir / 'logs'})")
        if self.layout is not None:
            how = "measured" if self.layout.measured else "extrapolated, not measured"
            self._say(f"layout auto for {self.cores} core(s) ({how}; laminar_common.launch."
                      f"layout): {'; '.join(self._layout_said)}")
        self.run_setup()
        self.recheck_configs(deferred)
        self.check_data()
        self.start_etcd()

    def check_data(self) -> None:
        """The prompts last the training (:mod:`.databudget`), after the set-up wrote them.

        Raises:
            ConfigError: they run out before the trainer's last step.
        """
        tiers = {tier: (tuple(spec.command), self._replica(tier, spec, 0)[2])
                 for tier, spec in self.job.tiers.items()}
        for text in check_data_budget(tiers):
            self._say(f"WARNING: {text}")

    def check_earlier_run(self) -> None:
        """What the run dir holds of an earlier run, said before anything starts: a new
        run is refused where a tier's checkpoints would be removed (``--resume`` or
        ``--fresh`` says which); ``--resume`` says where each resumable tier goes on from.

        Raises:
            ConfigError: a new start (no ``--resume`` or ``--fresh``) over checkpoints.
        """
        for tier, spec in self.job.tiers.items():
            saved = saved_state(spec.command, self._replica(tier, spec, 0)[2])
            if saved is None:
                continue
            field, where = saved
            trainer = field == "checkpoint.dir"
            found = _resume_source(Path(where), trainer) if where else None
            if self.start == "resume":
                self._say(f"--resume: {tier} goes on from {found}" if found else
                          f"--resume: {tier} has nothing to resume from ({field} "
                          f"{where or 'unset'}): it starts fresh")
            elif found and trainer and self.start == "new":
                raise ConfigError(
                    f"{self.run_dir} holds an earlier run's checkpoints ({tier}: {found}): "
                    "laminar up --resume goes on from them, --fresh starts a new run and "
                    "removes them")
            elif found and trainer:
                self._say(f"--fresh: {tier} removes the earlier run's checkpoints ({found})")

    def start_tiers(self) -> dict[str, list[ChildProcess]]:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        started: dict[str, list[ChildProcess]] = {}
        for tier, spec in self.job.tiers.items():
            started[tier] = []
            t0 = time.time()
            for i in range(self.replica_count(spec)):
                name, argv = self.replica_argv(tier, spec, i)
                child = ChildProcess(name, argv, str(logs / f"{name}.log"), append=False,
                                     env=tier_env(os.environ))
                self.children.append(child)
                self.tier_children.append((tier, child))
                started[tier].append(child)
                self._say(f"started {name} (pid {child.pid}): {shlex.join(argv)}")
            if spec.ready:
                self.wait_ready(spec.ready, started[tier], t0)
        return started

    def exited_early(self) -> ChildProcess | None:
        """The first tier replica that ended while the job runs, if any.

        That is any replica of a tier other than ``wait_for`` that exited, or a
        ``wait_for`` replica that exited with a non-zero code.
        """
        for tier, child in self.tier_children:
            code = child.poll()
            if code is not None and (tier != self.job.wait_for or code != 0):
                return child
        return None

    def say_exited(self, child: ChildProcess, how: str) -> None:
        """Print that ``child`` exited (``how``), its exit code and its log's last lines."""
        tail = child.tail(TAIL_LINES)
        self._say(f"{child.name} {how} with exit code {child.proc.returncode} "
                  f"(pid {child.pid}); last {len(tail)} lines of {child.log_path}:")
        if self.echo:
            print("\n".join(f"    {child.name}| {line}" for line in tail) or "    (no output)",
                  flush=True)

    def _coordinator(self):
        """A read-only etcd client for readiness (TLS as the tiers use it)."""
        if self._coord is None:
            from laminar_common.etcd import EtcdCoordinator

            tls: dict[str, str] = {}
            for tier, spec in self.job.tiers.items():
                tls = _etcd_tls_of(tier, self._replica(tier, spec, 0)[2])[0]
                if tls:
                    break
            self._coord = EtcdCoordinator(self.endpoints, self.job.job, connect_timeout_s=10,
                                          **tls)
        return self._coord

    def wait_ready(self, role: str, children: list[ChildProcess], since: float) -> None:
        """Wait until ``children`` (one tier's replicas) registered ready as ``role``."""
        try:
            wait_ready(self._coordinator(), role, count=len(children), timeout_s=300,
                       newer_than=since, alive=lambda: self.exited_early() is None)
        except LaminarError as exc:
            if self.exited_early() is not None:
                raise  # run() names the process that exited
            raise LaminarError(f"{exc}; see {', '.join(c.log_path for c in children)}") from exc
        self._say(f"{len(children)} {role} ready")

    def stop_all(self) -> None:
        for child in reversed(self.children):
            if child.alive():
                self._say(f"stopping {child.name} (pid {child.pid})")
            child.stop(grace_s=15)
        if self._coord is not None:
            self._coord.close()
            self._coord = None
        if self.etcd is not None:
            self.etcd.stop()

    def run(self) -> int:
        """Check, set up and start everything, wait for ``wait_for`` to exit, stop everything.

        Returns:
            0: every ``wait_for`` replica exited with 0; 1: a tier exited early
            (see :meth:`exited_early`); 124: ``timeout_s`` passed; 130: interrupted.

        Raises:
            ConfigError: a tier config check failed (nothing was started).
            LaminarError: the run dir is in use, a set-up command failed, or a
                tier did not get ready.
        """
        previous = {s: signal.signal(s, lambda *_: self._stop.set())
                    for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.prepare()
            try:
                started = self.start_tiers()
            except LaminarError:
                failed = self.exited_early()
                if failed is None:
                    raise
                return self._stop_for(failed)
            target = started[self.job.wait_for]
            deadline = time.monotonic() + self.job.timeout_s
            seen = 0
            while any(c.alive() for c in target):
                if self._stop.wait(0.5):
                    self._say("interrupted: shutting down")
                    return 130
                if time.monotonic() > deadline:
                    self._say(f"timeout after {self.job.timeout_s:.0f}s: shutting down")
                    return 124
                for line in target[0].lines[seen:]:
                    if line.startswith(("STEP", "EVAL", "WAITING")):
                        self._say(f"{target[0].name}: {line}")
                seen = len(target[0].lines)
                failed = self.exited_early()
                if failed is not None:
                    return self._stop_for(failed)
            for line in target[0].tail(None)[seen:]:
                if line.startswith(("STEP", "EVAL", "TRAINER DONE")):
                    self._say(f"{target[0].name}: {line[:300]}")
            for c in target:
                c.wait_exit(60)  # its final CPU count, before wait() reaps it
            codes = [c.proc.wait() for c in target]
            self._say(f"{self.job.wait_for} exited with {codes}")
            failed = [c for c in target if c.proc.returncode != 0]
            for child in failed[1:]:
                self.say_exited(child, "failed")
            # A replica that failed before the loop saw it is reported as one it saw.
            return self._stop_for(failed[0]) if failed else 0
        finally:
            t_stop = time.time()
            self.stop_all()
            self._say_cpu(t_stop)
            self.launch.release()
            for s, h in previous.items():
                signal.signal(s, h)
            # After the stop: workers write their timelines (stats_path) on exit.
            if self.job.report and self.tier_children:
                self._report(fill_placeholders(self.job.report, self.subs))

    def cpu_by_member(self) -> dict[str, float]:
        """CPU seconds of each tier process of this launch (every thread, read from /proc;
        final for the ones that exited), by process name; {} without /proc."""
        out = {}
        for _tier, child in self.tier_children:
            cpu = child.cpu_seconds()
            if cpu is not None:
                out[child.name] = cpu
        return out

    def _say_cpu(self, stopped_at: float) -> None:
        """Each tier's CPU time from the first tier's start to ``stopped_at`` (wall time),
        so the bottleneck is visible; also ``cpu.json`` in the report's run dir."""
        cpu = self.cpu_by_member()
        if not cpu:
            return
        wall_s = stopped_at - min(c.started_at for _, c in self.tier_children)
        cores = self.cores
        self._say(f"CPU time over {wall_s:.0f} s on {cores} cores: " + ", ".join(
            f"{name} {secs:.1f} s" for name, secs in sorted(cpu.items(), key=lambda x: -x[1]))
            + f"; total {sum(cpu.values()):.1f} s ({sum(cpu.values()) / max(wall_s, 1e-9) / cores:.0%}"
            " of the cores)")
        if self.job.report:
            target = Path(fill_placeholders(self.job.report, self.subs))
            if target.is_dir():
                (target / "cpu.json").write_text(json.dumps(
                    {"wall_s": wall_s, "cores": cores, "cpu_s": cpu}, indent=2))

    def _stop_for(self, child: ChildProcess) -> int:
        """Report ``child``'s early exit; the caller's ``finally`` stops the rest."""
        if any(c is child for tier, c in self.tier_children if tier == self.job.wait_for):
            self.say_exited(child, "failed")
            self._say(f"{child.name} failed: stopping the rest of the stack")
        else:
            self.say_exited(child, "exited early")
            self._say(f"{child.name} ended before the job did: stopping the rest of the stack")
        return 1

    def _report(self, run_dir: str) -> None:
        """This launch's metrics in ``run_dir`` as a summary and plots (none: says why)."""
        from laminar_common.launch.report import (
            find_worker_stats,
            load_metrics,
            summarize,
            write_plots,
        )

        since = self.launch.started_at
        try:
            # A resumed trainer cut metrics.jsonl back to its checkpoint and went on: every
            # row is this run's, the launches before this one included.
            rows, summary = load_metrics(run_dir, since=since,
                                         rows_since=None if self.start == "resume" else since)
        except LaminarError as exc:
            self._say(f"no report: {exc}")
            return
        print(summarize(rows, summary), flush=True)
        plots = write_plots(rows, summary, run_dir,
                            workers=find_worker_stats(run_dir, since=since))
        self._say(f"metrics: {run_dir}/metrics.jsonl"
                  + (f"; summary: {run_dir}/summary.json" if summary else
                     " (no summary.json from this launch: the run did not finish)"))
        self._say("plot: " + (", ".join(map(str, plots)) if plots else
                              "none (pip install matplotlib to plot)"))


def _resume_source(where: Path, trainer: bool) -> str | None:
    """The checkpoint (trainer) or ledger state (manager) a resume would read, or None."""
    if not trainer:
        path = where / "manager_state.json"
        return str(path) if path.is_file() else None
    latest = where / "LATEST"
    try:
        name = latest.read_text().strip()
    except OSError:
        return None
    return str(where / name) if name else None


def _etcd_tls_of(tier: str, config: dict[str, Any]) -> tuple[dict[str, str], str]:
    """The etcd TLS files a tier's config takes from its ``auth.dir``, or why none.

    The tiers' rule (:func:`~laminar_common.auth.etcd_tls_for`) applied to the
    job file's dict, with the reason when none: the launcher imports no tier
    config class.

    Returns:
        ``(paths, "")`` with :func:`~laminar_common.auth.etcd_tls_for`'s
        fields, or ``({}, reason)``.
    """
    auth = config.get("auth")
    auth_dir = auth.get("dir") if isinstance(auth, dict) else None
    if not isinstance(auth_dir, str):
        return {}, "no auth.dir"
    etcd = config.get("etcd")
    etcd = etcd if isinstance(etcd, dict) else {}
    try:
        paths = etcd_tls_for(auth_dir, etcd)
    except ConfigError as exc:
        raise ConfigError(f"tiers.{tier}.config.auth.dir: {exc}") from exc
    if paths:
        return paths, ""
    own = [k for k in ETCD_TLS_FIELDS if etcd.get(k) is not None]
    if own:
        return {}, f"sets etcd.{own[0]}, which wins over auth.dir"
    return {}, f"auth.dir {auth_dir!r} has no {ETCD_CA}"


def _torchrun(tier: str, spec: TierSpec, argv: list[str]) -> list[str]:
    """``argv`` (``PYTHON -m MODULE ...``) under torchrun when ``spec.ranks`` > 1.

    Raises:
        ConfigError: ``argv`` does not run a Python module.
    """
    if spec.ranks == 1:
        return argv
    if len(argv) < 3 or argv[1] != "-m":
        raise ConfigError(f"tiers.{tier}.ranks: {spec.ranks} processes are started by torchrun, "
                          "which runs a Python module: the command must be a Laminar tier or "
                          f"`python -m MODULE` (got {list(spec.command)})")
    return [argv[0], "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(spec.ranks), *argv[1:]]


def _resolve(argv: list[str]) -> list[str]:
    """Run the tiers' console scripts, and ``python`` / ``python3``, with this interpreter
    (the environment ``laminar up`` runs in, whatever ``python`` on PATH is)."""
    scripts = {"laminar": "laminar_common.launch.cli", "laminar-relay": "laminar_relay.cli",
               "laminar-rollout": "laminar_rollout.cli", "laminar-trainer": "laminar_trainer.cli",
               "laminar-examples": "laminar_examples.cli"}
    if argv and argv[0] in scripts:
        return [sys.executable, "-m", scripts[argv[0]], *argv[1:]]
    if argv and argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    return argv
