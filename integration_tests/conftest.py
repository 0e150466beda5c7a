"""Fixtures for cross-package tests: a real etcd and real child processes."""

from __future__ import annotations

import sys
import time

import pytest

from laminar_common.launcher_etcd import LocalEtcd
from laminar_common.processes import ChildProcess


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
