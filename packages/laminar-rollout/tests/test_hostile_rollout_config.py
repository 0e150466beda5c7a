"""Hostile input to the rollout tier's config loaders (``serve`` and ``manage``).

``load_config(WorkerConfig | ManagerConfig, ...)`` fed arbitrary YAML/TOML text,
bytes, mappings shaped like the model and ``--set`` strings must return a
complete, frozen config or raise :class:`ConfigError` naming the file, the
``--set`` item or every bad field path; no other exception may escape.
"""

from __future__ import annotations

import pytest

from laminar_common.testing import (
    assert_bad_field_named,
    assert_bad_file_named,
    check_load,
    make_loader_tests,
)
from laminar_rollout.config import ManagerConfig, WorkerConfig

for _model in (WorkerConfig, ManagerConfig):
    globals().update(make_loader_tests(_model, max_examples=80))


@pytest.fixture(scope="module")
def cfg_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile-config")


@pytest.mark.parametrize(("model", "items", "field"), [
    # The engine is a union on ``type``: the path names the variant it was read as.
    (WorkerConfig, ["engine.type=simulated", "engine.max_batch=0"], "engine.simulated.max_batch"),
    (WorkerConfig, ["engine.type=torch"], "engine.torch.model_dir"),
    (WorkerConfig, ["engine.type=vllm", "engine.model_dir=m", "engine.gpu_memory_utilization=2"],
     "engine.vllm.gpu_memory_utilization"),
    (WorkerConfig, ["engine.type=tpu"], "engine"),
    (WorkerConfig, ["engine.max_batch=4"], "engine"),
    (WorkerConfig, ["outbox_capacity=0"], "outbox_capacity"),
    (WorkerConfig, ["etcd.endpoints=[]"], "etcd.endpoints"),
    (WorkerConfig, ["metrics.port=70000"], "metrics.port"),
    (ManagerConfig, [], "prompts"),
    (ManagerConfig, ["prompts=p.jsonl", "sampling.top_p=0"], "sampling.top_p"),
    (ManagerConfig, ["prompts=p.jsonl", "sampling.max_tokens=many"], "sampling.max_tokens"),
    (ManagerConfig, ["prompts=p.jsonl", "repack.interval_s=0"], "repack.interval_s"),
    (ManagerConfig, ["prompts=p.jsonl", "mode=async"], "mode"),
    (ManagerConfig, ["prompts=p.jsonl", "group_size=0"], "group_size"),
])
def test_a_bad_field_names_its_full_path(model, items, field):
    assert_bad_field_named(model, items, field)


def test_a_bad_engine_field_in_a_file_names_the_file_and_the_path(cfg_dir):
    assert_bad_file_named(WorkerConfig, cfg_dir / "worker.yaml",
                          "engine:\n  type: simulated\n  max_bacth: 3\n  tail_ratio: 0.5\n",
                          ["engine.simulated.max_bacth: unknown field",
                           "engine.simulated.tail_ratio: "])


def test_a_good_file_loads_frozen(cfg_dir):
    path = cfg_dir / "manager.toml"
    path.write_text('prompts = "p.jsonl"\ngroup_size = 2\n[sampling]\ntop_p = 0.5\n')
    cfg = check_load(ManagerConfig, path)
    assert cfg is not None and cfg.group_size == 2 and cfg.sampling.top_p == 0.5
