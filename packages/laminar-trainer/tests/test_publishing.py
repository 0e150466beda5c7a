"""publish_state_dict / load_into: a state dict goes through the relay's byte layout and back."""

from __future__ import annotations

import warnings
from concurrent.futures import Future

import pytest
import torch

from laminar_common.errors import LaminarError
from laminar_common.relay.client import FetchedWeights
from laminar_common.relay.manifests import build_manifest, flatten
from laminar_trainer.publishing import load_into, publish_state_dict, state_dict_from


class RecordingClient:
    """Stands in for RelayClient: lays a version out as the master stores it."""

    def __init__(self) -> None:
        self.published: dict[int, tuple] = {}

    def publish(self, version, tensors, *, trainer_step=-1):
        manifest, buffers = build_manifest(version, tensors, trainer_step=trainer_step,
                                           chunk_bytes=4096)
        # Read-only, like a relay's shared memory mapped into a reader.
        self.published[version] = (manifest, memoryview(bytes(flatten(manifest, buffers))))
        return manifest

    def publish_async(self, version, tensors, *, trainer_step=-1):
        future: Future = Future()
        future.set_result(self.publish(version, tensors, trainer_step=trainer_step))
        return future

    def fetch(self, version) -> FetchedWeights:
        manifest, buffer = self.published[version]
        return FetchedWeights(manifest, buffer, "shm", "relay-0")


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(5, 3)
        self.norm = torch.nn.BatchNorm1d(3)  # running stats and an int64 counter
        self.register_buffer("scale", torch.tensor(0.5))  # a 0-d tensor


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_a_state_dict_round_trips_bit_for_bit():
    torch.manual_seed(0)
    src, dst = Tiny(), Tiny()
    src.norm.num_batches_tracked.fill_(7)
    client = RecordingClient()
    manifest = publish_state_dict(client, src.state_dict(), 3, step=12)
    assert manifest.version == 3 and manifest.trainer_step == 12
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_into(dst, client.fetch(3)) == 3
    for (name, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert _bytes(a) == _bytes(b), name


def test_dtype_casts_floating_tensors_only_and_views_need_no_copy():
    sd = {"w": torch.randn(4, 6).t(), "steps": torch.tensor([3, 4])}  # "w" is not contiguous
    client = RecordingClient()
    publish_state_dict(client, sd, 0, dtype=torch.bfloat16)
    got = state_dict_from(client.fetch(0), copy=False)
    assert got["w"].dtype == torch.bfloat16 and got["w"].shape == (6, 4)
    assert _bytes(got["w"]) == _bytes(sd["w"].to(torch.bfloat16))
    assert got["steps"].dtype == torch.int64 and got["steps"].tolist() == [3, 4]


def test_a_background_publish_owns_its_copy():
    sd = {"w": torch.zeros(8)}
    client = RecordingClient()
    future = publish_state_dict(client, sd, 1, wait=False)
    sd["w"].add_(1)  # training goes on
    assert future.result().version == 1
    assert state_dict_from(client.fetch(1))["w"].tolist() == [0.0] * 8


def test_a_version_that_does_not_fit_the_module_is_a_laminar_error():
    client = RecordingClient()
    publish_state_dict(client, {"lin.weight": torch.zeros(2, 2)}, 0)
    with pytest.raises(LaminarError, match="weight v0 does not fit Tiny"):
        load_into(Tiny(), client.fetch(0))


def test_an_unknown_dtype_names_the_version_and_tensor_and_both_tiers_share_the_reader():
    """state_dict_from and the rollout's fetcher read versions with the one
    laminar_common.relay.tensors.tensors_from."""
    import msgspec

    from laminar_common.errors import ProtocolError
    from laminar_common.relay.tensors import tensors_from

    client = RecordingClient()
    publish_state_dict(client, {"a": torch.ones(2), "b": torch.zeros(3)}, 4)
    manifest, buffer = client.published[4]
    assert [n for n, _ in tensors_from(client.fetch(4), torch)] == ["a", "b"]
    bad_spec = msgspec.structs.replace(manifest.tensors[1], dtype="float7")
    bad = msgspec.structs.replace(manifest, tensors=(manifest.tensors[0], bad_spec))
    with pytest.raises(ProtocolError, match=r"weight v4: tensor 'b' has unknown dtype 'float7'"):
        state_dict_from(FetchedWeights(bad, buffer, "shm", "relay-0"))
