"""The deadline every engine call that may hang runs under, and weight buckets."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from laminar_common.errors import EngineError, EngineWedgedError
from laminar_rollout.engines.base import call_with_deadline, weight_buckets


def test_a_call_that_returns_in_time_gives_its_value_or_its_error():
    assert call_with_deadline(lambda: 42, 5.0, "answer") == 42
    with pytest.raises(EngineError, match="refused"):
        call_with_deadline(lambda: (_ for _ in ()).throw(EngineError("refused")), 5.0, "x")


def test_a_hung_call_is_wedged_after_the_deadline_naming_the_call():
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(EngineWedgedError, match=r"loading weights v7 did not return within 0.2s"):
        call_with_deadline(lambda: release.wait(30), 0.2, "loading weights v7")
    assert 0.2 <= time.monotonic() - t0 < 2.0
    release.set()


def test_an_engine_timeout_inside_the_call_is_wedged_too():
    def rpc():
        raise TimeoutError("RPC call to laminar_load_weights timed out.")

    with pytest.raises(EngineWedgedError, match="timed out inside the engine"):
        call_with_deadline(rpc, 5.0, "vLLM laminar_load_weights")


def test_weight_buckets_keep_order_and_the_byte_bound():
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.bfloat16))
               for i, n in enumerate([100, 300, 50, 2000, 10, 10])]
    buckets = list(weight_buckets(tensors, limit_bytes=800))
    assert [name for b in buckets for name, _ in b] == [name for name, _ in tensors]
    for b in buckets:
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= 800 or len(b) == 1  # a tensor over the bound travels alone
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert list(weight_buckets([], 800)) == []
