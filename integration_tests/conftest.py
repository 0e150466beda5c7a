"""Fixtures for cross-package tests: a real etcd and real child processes."""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from laminar_common.etcd import EtcdCoordinator
from laminar_common.launch import readiness
from laminar_common.launch.local_etcd import LocalEtcd
from laminar_common.launch.processes import ChildProcess
from laminar_common.membership import MemberRecord


def pytest_collection_modifyitems(config, items):
    """Longest tests first (``@pytest.mark.cost(seconds)``, as measured on a 2-core
    machine; unmarked tests count 0, in file order). tox runs this suite on two
    pytest-xdist workers (``--dist loadgroup --no-loadscope-reorder``), which take work
    in this order, so the long jobs start at once and the short ones fill in behind."""
    def cost(item) -> float:
        mark = item.get_closest_marker("cost")
        return float(mark.args[0]) if mark else 0.0

    items.sort(key=cost, reverse=True)


@pytest.fixture(autouse=True)
def _xdist_group_took(request):
    """With ``--dist loadgroup``, xdist keeps an ``xdist_group``'s tests on one worker by
    suffixing their node ids with the group; pytest 9.2 silently undid that
    (pytest-dev/pytest-xdist#1386), which splits a module fixture or runs two Ray
    clusters at once. A grouped test whose group did not take fails, not quietly."""
    item = request.node
    if getattr(request.config.option, "loadgroup", False) and \
            item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
        pytest.fail(f"xdist_group did not take for {item.nodeid}: pytest-xdist cannot "
                    f"group tests with pytest {pytest.__version__} (tox.ini pins it below 9.2)")


@pytest.fixture
def etcd():
    server = LocalEtcd().start()
    yield server
    server.close()


@pytest.fixture
def spawn(tmp_path):
    """Start ``python -m <module> args...`` as a child; all are stopped at teardown."""
    children: list[ChildProcess] = []

    def start(name: str, module: str, *args: str, env: dict[str, str] | None = None):
        child = ChildProcess(name, [sys.executable, "-m", module, *args],
                             str(tmp_path / f"{name}.log"), env=env)
        children.append(child)
        return child

    yield start
    for child in children:
        child.stop(grace_s=5)


def wait_until(cond, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``cond`` until it is true or the deadline passes; returns the last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval_s)
    return bool(cond())


def wait_ready(etcd, job: str, child: ChildProcess, role: str, member_id: str | None = None,
               timeout_s: float = 60, **etcd_kwargs) -> MemberRecord:
    """The ready etcd record ``child`` registered as ``role`` (readiness is the
    member's own record, never its stdout); fails fast if the child exits."""
    coord = EtcdCoordinator([etcd.endpoint], job, connect_timeout_s=10, **etcd_kwargs)
    try:
        return readiness.wait_ready(coord, role, member_id, timeout_s=timeout_s,
                                    newer_than=child.started_at, alive=child.alive)[0]
    finally:
        coord.close()


def read_steps(run_dir: Path) -> list[dict]:
    """The trainer's metrics.jsonl rows so far ([] before the first step)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def scrape_metrics(url: str) -> dict[str, float]:
    """One Prometheus scrape: ``name{labels}`` -> value."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            out[name_labels] = float(value)
    return out


def metric_value(samples: dict[str, float], name: str) -> float:
    """The sum of a metric over its label values."""
    return sum(v for k, v in samples.items() if re.match(rf"{name}(\{{|$)", k))


def tier_args(etcd, job: str, ttl_s: int) -> list[str]:
    """The ``--set`` overrides every tier of a test stack shares: job, etcd, lease TTL."""
    return ["--set", f"job={job}", "--set", f"etcd.endpoints=[{etcd.endpoint}]",
            "--set", f"etcd.ttl_s={ttl_s}"]


def laminar_up(tmp_path: Path, job: dict, *args: str, env: dict[str, str] | None = None,
               name: str = "job.yaml", wrap: list[str] | None = None) -> ChildProcess:
    """Write ``job`` to ``tmp_path/name`` and start ``laminar up`` on it (``args``: more
    CLI arguments; ``wrap``: a command it runs under, such as ``ip netns exec NS`` for an
    emulated host); its output goes to ``tmp_path/up.log``. The caller stops it."""
    import yaml

    path = tmp_path / name
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return ChildProcess("up", [*(wrap or []), sys.executable, "-m", "laminar_common.launch.cli",
                               "up", str(path), *args], str(tmp_path / "up.log"),
                        cwd=str(tmp_path), env=env)


def run_to_end(up: ChildProcess, timeout_s: float, done: str = r"trainer exited with \[0\]"
               ) -> None:
    """Wait for ``laminar up`` to print ``done`` and exit 0; stops it whatever happens."""
    try:
        up.wait_for_line(done, timeout_s)
        assert up.proc.wait(120) == 0
    finally:
        up.stop(grace_s=30)


def consumed_ids(trainer_run_dir: Path) -> list[str]:
    """Every trajectory id the trainer recorded as trained (consumed.jsonl), in order."""
    path = Path(trainer_run_dir) / "consumed.jsonl"
    return [i for line in path.read_text().splitlines() if line.strip()
            for i in json.loads(line)["ids"]]
