"""Helpers shared by the relay unit tests (imported, unlike conftest fixtures)."""

from __future__ import annotations

import time

import pytest


def wait_for(cond, timeout_s: float = 10.0, interval_s: float = 0.02):
    """Poll ``cond`` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"condition not met within {timeout_s}s")
        time.sleep(interval_s)


def tensors_for(version: int, nbytes: int = 3 * 1024 * 1024 + 123):
    """Deterministic content of a version: two tensors, distinct per version."""
    seed = version.to_bytes(4, "big")
    block = (seed * 64)[:256]
    big = (block * (nbytes // 256 + 1))[:nbytes]
    big = bytes([version % 251]) + big[1:]
    small = (seed * 6)[:24]
    return [("layer.weight", "uint8", (nbytes,), big), ("layer.bias", "float32", (6,), small)]
