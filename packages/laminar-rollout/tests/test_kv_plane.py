"""The worker-to-worker KV plane: an exported cache waits on its source worker and the
destination fetches it straight from there (real ZeroMQ sockets on loopback), checks it
against the ref the manager passed on, and re-prefills whenever it cannot get it."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from laminar_common import codec
from laminar_common.codec import Hello, KvCache, KvRef, PromptTask, SamplingSpec
from laminar_common.errors import ProtocolError
from laminar_common.membership import InMemoryCoordinator, InMemoryEtcd
from laminar_common.transport import make_client
from laminar_rollout.config import WorkerConfig
from laminar_rollout.engines import GenerationRequest, SamplingParams, TorchEngine
from laminar_rollout.engines.kv_wire import kv_to_wire
from laminar_rollout.kv_plane import KvFetchError, KvPlane, fetch_kv
from laminar_rollout.tokenizer import ByteTokenizer
from laminar_rollout.worker import FetchedVersion, WorkerService

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MB = 2**20


def _blob(num_tokens: int = 4, fill: int = 1) -> KvCache:
    data = bytes([fill]) * (2 * 2 * 2 * num_tokens * 8 * 4)
    return KvCache(engine="TorchEngine", dtype="float32", layers=2, kv_heads=2, head_dim=8,
                   num_tokens=num_tokens, data=data)


@pytest.fixture
def plane():
    p = KvPlane("tcp://127.0.0.1:*", "src", max_bytes=MB, hold_s=30.0).start()
    yield p
    p.close()


def _fetch(ref: KvRef, timeout_s: float = 5.0) -> KvCache:
    return fetch_kv(ref, "dst", timeout_s=timeout_s, max_cache_bytes=MB)


def test_a_cache_is_served_once_to_the_holder_of_its_token(plane):
    blob = _blob()
    ref = plane.offer("p0#0", blob)
    assert ref.endpoint.startswith("tcp://127.0.0.1:") and ref.nbytes == len(blob.data)
    # The ref travels through the manager inside the task: a few hundred bytes.
    task = PromptTask(trajectory_id="p0#0", prompt_id="p0", group_size=1, sample_index=0,
                      prompt="", resume_token_ids=(1,), policy_version=0, kv=ref)
    assert codec.decode(codec.encode(task)).kv == ref
    bare = msgspec.structs.replace(task, kv=None)
    assert len(codec.encode(task)) - len(codec.encode(bare)) < 400

    wrong = msgspec.structs.replace(ref, token="0" * 32)
    with pytest.raises(KvFetchError, match="wrong token"):
        _fetch(wrong)
    got = _fetch(ref)  # a wrong token took nothing away
    assert got == blob
    with pytest.raises(KvFetchError, match=r"KV cache of p0#0 from tcp://.*not held here"):
        _fetch(ref)  # served once
    assert plane.counters["served"] == 1 and plane.counters["wrong_token"] == 1
    assert plane.held_bytes == 0


def test_what_comes_must_be_what_the_ref_names(plane):
    blob = _blob()
    ref = plane.offer("p1#0", blob)
    other = codec.kv_digest(_blob(fill=2).data)
    with pytest.raises(KvFetchError, match="do not match the ref's digest"):
        _fetch(msgspec.structs.replace(ref, digest=other))
    ref = plane.offer("p1#0", blob)
    with pytest.raises(KvFetchError, match="engine 'TorchEngine' where the ref says 'Vllm'"):
        _fetch(msgspec.structs.replace(ref, engine="Vllm"))
    # A ref whose sizes disagree is refused where its frame lands, naming the field.
    body = msgspec.to_builtins(PromptTask(trajectory_id="t", prompt_id="p", group_size=1,
                                          sample_index=0, prompt="", kv=ref))
    body["kv"]["nbytes"] = 5
    frame = codec.encode(PromptTask(trajectory_id="t", prompt_id="p", group_size=1,
                                    sample_index=0, prompt=""))[:6] + msgspec.msgpack.encode(body)
    with pytest.raises(ProtocolError, match=r"kv ref says 5 bytes; its shape takes \d+.*\$\.kv"):
        codec.decode(frame)


def test_caches_expire_and_the_oldest_is_evicted_over_budget():
    plane = KvPlane("tcp://127.0.0.1:*", "src", max_bytes=3000, hold_s=0.3).start()
    try:
        a = plane.offer("a", _blob(num_tokens=4))  # 1,024 bytes each
        b = plane.offer("b", _blob(num_tokens=4))
        c = plane.offer("c", _blob(num_tokens=8))  # 2,048: a and b cannot both stay
        assert plane.counters["evicted"] == 2 and plane.held_bytes == 2048
        for ref in (a, b):
            with pytest.raises(KvFetchError, match="not held here"):
                _fetch(ref)
        time.sleep(0.8)  # past hold_s, and the plane's 0.2-s tick
        with pytest.raises(KvFetchError, match="not held here"):
            _fetch(c)
        assert plane.counters["expired"] == 1 and plane.held_bytes == 0
    finally:
        plane.close()


def test_a_dead_or_silent_source_costs_the_destination_one_timeout(plane):
    ref = plane.offer("p2#0", _blob())
    # Well-formed but wrong frames to the plane are counted and change nothing.
    client = make_client(ref.endpoint, Hello(member_id="junk", role="worker",
                                             protocol_version=codec.PROTOCOL_VERSION))
    client.connect(5)
    client.send(codec.Acked(trajectory_ids=("p2#0",)))
    client.send_frame(b"LMNR\x00\x09not msgpack")
    client.close()
    deadline = time.monotonic() + 5
    while plane.counters["rejected"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert plane.counters["rejected"] == 1
    assert _fetch(ref).num_tokens == 4  # still served
    plane.close()
    t0 = time.monotonic()
    with pytest.raises(KvFetchError, match=r"no answer in 0.5s"):
        _fetch(msgspec.structs.replace(ref, trajectory_id="p2#1"), timeout_s=0.5)
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(KvFetchError, match="over kv_transfer_max_mb"):
        fetch_kv(ref, "dst", timeout_s=1, max_cache_bytes=100)


# -- the worker: export to the plane, fetch on the destination --------------------------


def _model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.3, tie_word_embeddings=False)).eval()


def _worker(engine, wid: str, **cfg) -> WorkerService:
    config = WorkerConfig(job="unit", worker_id=wid, engine={"type": "simulated"}, **cfg)
    return WorkerService(config, engine, ByteTokenizer(),
                         fetch_weights=lambda v: FetchedVersion(v, None),
                         reward_fn=lambda prompt, text, meta: 1.0,
                         coordinator=InMemoryCoordinator(InMemoryEtcd(), "unit"))


def _exported_task(model, plane: KvPlane | None, prompt, steps) -> PromptTask:
    """Start ``prompt`` greedily on a source engine, export it after ``steps`` steps as
    the source worker does (the cache offered on ``plane``), as the manager passes it on."""
    source = TorchEngine(model, max_batch=2, eos_token_ids=())
    source.add_request(GenerationRequest("p0#0", prompt,
                                         SamplingParams(temperature=0, max_tokens=24)))
    for _ in range(steps):
        source.step()
    (moved,) = source.export_with_kv(["p0#0"])
    blob = kv_to_wire(moved.kv)
    task = PromptTask(trajectory_id="p0#0", prompt_id="p0", group_size=1, sample_index=0,
                      prompt="", prompt_token_ids=tuple(prompt),
                      sampling=SamplingSpec(max_tokens=24, temperature=0.0,
                                            stop_token_ids=(299,)),
                      resume_token_ids=tuple(moved.resume_token_ids),
                      resume_logprobs=tuple(moved.resume_logprobs), policy_version=0,
                      kv=plane.offer("p0#0", blob) if plane is not None else blob)
    return codec.decode(codec.encode(task))


def _run_destination(worker: WorkerService, task: PromptTask):
    worker._handle(task)
    assert list(worker.kv.waiting) == ["p0#0"]  # held while the cache comes
    deadline = time.monotonic() + 15
    while worker.kv.waiting and time.monotonic() < deadline:
        time.sleep(0.02)
        for ready in worker.kv.collect():  # what the worker's loop does each turn
            worker.generation.add(ready)
    assert not worker.kv.waiting
    (out,) = worker.engine.run_until_done([])
    return out


def test_the_destination_fetches_the_cache_from_the_source_and_skips_the_prefill(plane):
    model = _model()
    prompt = [11, 12, 13, 14, 15]
    uninterrupted = TorchEngine(model, eos_token_ids=()).run_until_done(
        [GenerationRequest("u", prompt, SamplingParams(temperature=0, max_tokens=24))])[0]
    task = _exported_task(model, plane, prompt, steps=9)
    assert isinstance(task.kv, KvRef)
    worker = _worker(TorchEngine(model, max_batch=4, eos_token_ids=(299,)), "w-dest")
    out = _run_destination(worker, task)
    assert worker.counters["kv_fetched"] == 1 and worker.counters["kv_migrated_in"] == 1
    assert worker.counters["kv_fetch_failed"] == worker.counters["kv_refused"] == 0
    assert worker.engine.prefilled_tokens == 0
    assert worker.engine.kv_reused_tokens == len(prompt) + 9 - 1
    assert out.token_ids == uninterrupted.token_ids
    assert torch.allclose(torch.tensor(out.logprobs), torch.tensor(uninterrupted.logprobs),
                          atol=1e-5)
    assert plane.counters["served"] == 1


def test_a_cache_the_destination_cannot_get_is_re_prefilled_and_nothing_is_lost(plane):
    model = _model()
    prompt = [21, 22, 23]
    task = _exported_task(model, plane, prompt, steps=6)
    plane.close()  # the source died (or paused) after the export
    worker = _worker(TorchEngine(model, max_batch=2, eos_token_ids=(299,)), "w-dest",
                     kv_fetch_timeout_s=0.5)
    out = _run_destination(worker, task)
    assert worker.counters["kv_fetch_failed"] == 1 and worker.counters["kv_migrated_in"] == 0
    assert worker.engine.prefilled_tokens == len(prompt) + 6
    assert out.token_ids[:6] == list(task.resume_token_ids) and out.finish_reason == "length"


def test_a_cache_of_another_shape_is_never_fetched(plane):
    model = _model()
    task = _exported_task(model, plane, [31, 32, 33], steps=5)
    other = TorchEngine(_model().to(torch.float64), max_batch=2, eos_token_ids=(299,))
    worker = _worker(other, "w-dest")
    worker._handle(task)
    assert not worker.kv.waiting  # refused from the ref alone
    (out,) = other.run_until_done([])
    assert worker.counters["kv_refused"] == 1 and worker.counters["kv_fetched"] == 0
    assert plane.counters["served"] == 0 and plane.held_bytes > 0
    assert other.prefilled_tokens == 3 + 5 and out.token_ids[:5] == list(task.resume_token_ids)


def test_the_plane_is_a_config_choice_checked_where_it_is_read():
    with pytest.raises(ValueError, match=r"kv_transfer_max_mb 64.0 is over 32.*kv_plane: "
                                         r"manager"):
        WorkerConfig(job="unit", worker_id="w", engine={"type": "simulated"},
                     kv_plane="manager", kv_transfer_max_mb=64)
    engine = TorchEngine(_model(), max_batch=2, eos_token_ids=())
    assert _worker(engine, "w-src").kv.direct
    assert not _worker(engine, "w-m", kv_plane="manager", kv_transfer_max_mb=16).kv.direct
    assert not _worker(engine, "w-off", kv_transfer_max_mb=0).kv.direct


_SOURCE = """
import sys
import msgspec
from laminar_common.codec import KvCache
from laminar_rollout.kv_plane import KvPlane
plane = KvPlane("tcp://127.0.0.1:*", "src", max_bytes=2**20, hold_s=60).start()
blob = KvCache(engine="TorchEngine", dtype="float32", layers=2, kv_heads=2, head_dim=8,
               num_tokens=4, data=bytes(1024))
sys.stdout.write(msgspec.json.encode(plane.offer("p3#0", blob)).decode() + "\\n")
sys.stdout.flush()
sys.stdin.readline()
plane.close()
"""


def _wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Until every thread of ``pid`` is in the stopped state (``T`` in /proc)."""
    import os

    deadline = time.monotonic() + timeout_s
    states: list[str] = []
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                states.append(fh.read().rsplit(")", 1)[1].split()[0])
        if states and all(state == "T" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout_s}s: {states}")


def test_a_paused_source_costs_one_timeout_and_still_holds_the_cache_when_it_resumes():
    """The source is another process, stopped (SIGSTOP) after its export: the destination
    gives up after its timeout (and re-prefills); resumed, the source serves the cache."""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _SOURCE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        ref = msgspec.json.decode(proc.stdout.readline(), type=KvRef)
        os.kill(proc.pid, signal.SIGSTOP)
        # SIGSTOP takes effect when each thread is next scheduled: on a loaded machine the
        # plane's I/O thread could still answer. Fetch only once every thread is stopped.
        _wait_stopped(proc.pid)
        try:
            t0 = time.monotonic()
            with pytest.raises(KvFetchError, match=r"p3#0 from tcp://.*no answer in 0.5s"):
                _fetch(ref, timeout_s=0.5)
            assert time.monotonic() - t0 < 2.0
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert _fetch(ref).data == bytes(1024)
    finally:
        proc.stdin.close()
        proc.wait(10)


def test_with_auth_only_a_peer_holding_the_job_s_keys_gets_a_cache(tmp_path):
    """auth.dir on (a worker's ``laminar keys --split`` rollout dir holds a server key
    pair, so its plane is a CURVE server): a plain or unauthorized fetch gets nothing."""
    from laminar_common.auth import CurveAuth, create_keys, refusals

    job = CurveAuth.from_dir(create_keys(tmp_path / "job"))
    other = CurveAuth.from_dir(create_keys(tmp_path / "other"))
    intruder = CurveAuth(job.server_public, None, other.client_public, other.client_secret,
                         frozenset())
    plane = KvPlane("tcp://127.0.0.1:*", "src", max_bytes=MB, hold_s=30.0, auth=job).start()
    try:
        ref = plane.offer("p4#0", _blob())
        before = refusals()["unauthorized-key"]
        for auth in (None, intruder):
            with pytest.raises(KvFetchError, match="no answer in 0.5s"):
                fetch_kv(ref, "dst", timeout_s=0.5, max_cache_bytes=MB, auth=auth)
        assert refusals()["unauthorized-key"] > before
        assert plane.counters["served"] == 0
        got = fetch_kv(ref, "dst", timeout_s=5, max_cache_bytes=MB, auth=job)
        assert got == _blob() and plane.counters["served"] == 1
    finally:
        plane.close()
