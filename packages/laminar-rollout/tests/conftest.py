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
