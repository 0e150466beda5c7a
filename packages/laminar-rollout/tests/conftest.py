"""Shared fixtures of laminar-rollout's tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def single_torch_thread():
    """One torch thread for the module: the CI boxes are 2 shared cores, and OpenMP
    spinning on a busy core makes tiny matmuls hundreds of times slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under ``LAMINAR_REQUIRE_VLLM=1`` (the ``vllm`` tox env) a skipped vLLM test that
    is not GPU-marked fails: that env exists to run every one of them."""
    import os

    outcome = yield
    report = outcome.get_result()
    if (os.environ.get("LAMINAR_REQUIRE_VLLM") == "1" and report.skipped
            and "vllm" in item.nodeid and item.get_closest_marker("gpu") is None):
        report.outcome = "failed"
        report.longrepr = f"skipped under LAMINAR_REQUIRE_VLLM=1: {report.longrepr}"
