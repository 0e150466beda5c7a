"""Job files for `laminar up`: replica counts and restart limits are validated."""

import pytest

from laminar_common.errors import ConfigError
from laminar_common.launch.jobfile import load_job
from laminar_common.launch.local import LocalLauncher


def _job(tmp_path, relay_extra: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(f"""
job: j
run_dir: {tmp_path / 'run'}
tiers:
  relay:
    command: [laminar-relay, serve]
    id_field: member_id
    {relay_extra}
wait_for: relay
""")
    return str(path)


def test_per_node_replicas_are_one_locally_and_named_by_index(tmp_path):
    job = load_job(_job(tmp_path, "replicas: -1\n    max_restarts: 3"))
    spec = job.tiers["relay"]
    assert spec.replicas == -1 and spec.max_restarts == 3
    launcher = LocalLauncher(job, echo=False)
    assert launcher.replica_count(spec) == 1
    name, argv = launcher.replica_argv("relay", spec, 0)
    assert name == "relay-0" and "--config" in argv


@pytest.mark.parametrize("extra, field", [("replicas: -2", "tiers.relay.replicas"),
                                          ("max_restarts: -5", "tiers.relay.max_restarts")])
def test_bad_counts_name_their_field(tmp_path, extra, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_job(_job(tmp_path, extra))


def test_ready_names_a_role_not_an_output_line(tmp_path):
    from laminar_common.errors import ConfigError

    path = tmp_path / "job.yaml"
    path.write_text("job: j\nwait_for: t\ntiers:\n  t: {command: [x], ready: MANAGER READY}\n")
    with pytest.raises(ConfigError, match=r"tiers\.t\.ready.*role 'MANAGER READY' is not a valid"):
        load_job(path)
    path.write_text("job: j\nwait_for: t\ntiers:\n  t: {command: [x], ready: manager}\n")
    assert load_job(path).tiers["t"].ready == "manager"


def test_ranks_start_a_replica_under_torchrun_and_check_its_config_once(tmp_path):
    import sys

    job = load_job(_job(tmp_path, "ranks: 4"))
    launcher = LocalLauncher(job, echo=False)
    _, argv = launcher.replica_argv("relay", job.tiers["relay"], 0)
    assert argv[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "4"]
    assert argv[6:9] == ["-m", "laminar_relay.cli", "serve"] and "--config" in argv
    checks, _ = launcher.tier_checks()
    assert [c.argv[:3] for c in checks] == [(sys.executable, "-m", "laminar_relay.cli")]
    with pytest.raises(ConfigError, match=r"tiers\.relay\.ranks"):
        load_job(_job(tmp_path, "ranks: 0"))


def test_ranks_need_a_python_module_command(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(f"job: j\nrun_dir: {tmp_path / 'run'}\n"
                    "tiers: {t: {command: [./train.sh], ranks: 2}}\nwait_for: t\n")
    job = load_job(str(path))
    with pytest.raises(ConfigError, match=r"tiers\.t\.ranks: 2 processes .* must be a Laminar"):
        LocalLauncher(job, echo=False)


def test_python_in_a_command_is_the_launchers_interpreter(tmp_path):
    import sys

    from laminar_common.launch.local import _resolve

    assert _resolve(["python", "script.py", "-x"]) == [sys.executable, "script.py", "-x"]
    assert _resolve(["python3", "-m", "m"]) == [sys.executable, "-m", "m"]
    assert _resolve(["./run.sh"]) == ["./run.sh"]
    # Laminar's console scripts, the examples' set-up command among them
    assert _resolve(["laminar-trainer", "run"]) == [sys.executable, "-m", "laminar_trainer.cli",
                                                    "run"]
    assert _resolve(["laminar-examples", "prompts", "--n", "3"]) == [
        sys.executable, "-m", "laminar_examples.cli", "prompts", "--n", "3"]
