"""Hostile job files for ``laminar up``: ``load_job`` on any text, bytes, mapping, ``--set``.

``load_job`` must return a complete, frozen :class:`JobFile` or raise
:class:`ConfigError` naming the file (when it cannot be read), the ``--set``
item or every bad field path; no other exception may escape.
"""

from __future__ import annotations

import pytest

from laminar_common.errors import ConfigError
from laminar_common.launch.jobfile import JobFile, load_job
from laminar_common.testing import make_loader_tests

GOOD_JOB = """
job: j
tiers:
  relay: {command: [laminar-relay, serve], replicas: 2, id_field: member_id}
wait_for: relay
"""


def _commands_are_tuples(job: JobFile) -> None:
    assert all(isinstance(spec.command, tuple) for spec in job.tiers.values())


globals().update(make_loader_tests(JobFile, load=load_job, good_text=GOOD_JOB,
                                   check=_commands_are_tuples))


@pytest.fixture(scope="module")
def cfg_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile-job")


@pytest.mark.parametrize(("items", "field"), [
    (["tiers.relay.replicas=-2"], "tiers.relay.replicas"),
    (["tiers.relay.max_restarts=x"], "tiers.relay.max_restarts"),
    (["tiers.relay.resources.GPU=lots"], "tiers.relay.resources.GPU"),
    (["tiers.relay.command=null"], "tiers.relay.command"),
    (["tiers.trainer.replicas=1"], "tiers.trainer.command"),
    (["tiers.relay.bogus=1"], "tiers.relay.bogus"),
    (["etcd.ttl_s=1"], "etcd.ttl_s"),
    (["timeout_s=0"], "timeout_s"),
    (["setup=[[a, {b: c}]]"], "setup.0.1"),
    (["job=null"], "job"),
])
def test_a_bad_field_names_its_full_path(cfg_dir, items, field):
    path = cfg_dir / "job.yaml"
    path.write_text(GOOD_JOB)
    with pytest.raises(ConfigError) as info:
        load_job(path, items)
    assert f"\n  {field}: " in str(info.value)


def test_missing_required_fields_are_each_named(cfg_dir):
    path = cfg_dir / "empty.yaml"
    path.write_text("")
    with pytest.raises(ConfigError) as info:
        load_job(path)
    for field in ("job", "tiers", "wait_for"):
        assert f"\n  {field}: Field required" in str(info.value)


def test_a_job_file_that_is_not_utf8_is_named(cfg_dir):
    path = cfg_dir / "latin1.yaml"
    path.write_bytes("job: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"config file '{path}' cannot be read as UTF-8"):
        load_job(path)
