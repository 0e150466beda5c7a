"""``laminar``: options, env vars, ``--set``, shell completion, a slim ``--help``.

``laminar prompts`` is ``laminar-examples prompts`` now (examples/tests/test_examples_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from laminar_common.config import load_config
from laminar_common.launch.cli import cli, main
from laminar_common.launch.member import MemberConfig
from laminar_common.membership import InMemoryCoordinator, InMemoryEtcd, MemberRecord, VersionRecord
from laminar_common.roles import Extra, Role
from laminar_common.testing import (
    assert_completion,
    assert_help_lists_options,
    clear_laminar_env,
    option_envvars,
    run_fresh,
)

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _no_laminar_env(monkeypatch):
    clear_laminar_env(monkeypatch)


@pytest.fixture
def started(monkeypatch):
    """Stand in for MemberService: record the config ``laminar member`` resolved."""
    configs: list[MemberConfig] = []

    class RecordingService:
        def __init__(self, config: MemberConfig) -> None:
            configs.append(config)

        def run_forever(self) -> int:
            return 0

    monkeypatch.setattr("laminar_common.launch.member.MemberService", RecordingService)
    # The CLI configures the root logger; keep pytest's handlers.
    monkeypatch.setattr("laminar_common.logs.setup_logging", lambda *a, **k: None)
    return configs


def _option_envvars(command_name: str) -> dict[str, str]:
    return option_envvars(cli, "laminar", "LAMINAR", command_name)


def test_the_commands_and_their_options_are_those_of_before():
    assert sorted(cli.commands) == ["demo", "etcd", "keys", "member", "replay",
                                    "report", "samples", "status", "up"]
    opts = {name: {o for p in cmd.params for o in p.opts} for name, cmd in cli.commands.items()}
    assert opts["up"] == {"job", "--set", "--backend", "--address", "--ray-address", "--num-cpus",
                          "--resume", "--fresh"}
    assert opts["status"] >= {"--etcd", "--job", "--auth-dir", "--etcd-ca", "--etcd-cert",
                              "--etcd-key"}
    assert opts["keys"] >= {"--out", "--etcd", "--etcd-host"}
    assert opts["replay"] == {"run_dir", "--step", "--trajectory", "--dtype"}
    assert opts["samples"] == {"run_dir", "--step", "--worst", "--best", "--longest", "--count",
                               "-n", "--width"}
    assert _option_envvars("status")["--job"] == "LAMINAR_STATUS_JOB"
    defaults = {p.name: p.default for p in cli.commands["status"].params}
    # None: RUN_DIR's etcd, else 127.0.0.1:2379 (tested with a run dir in test_launcher)
    assert defaults["etcd"] is None
    defaults = {p.name: p.default for p in cli.commands["demo"].params}
    assert defaults["members"] == 3 and defaults["ttl"] == 3


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_help_of_every_command_lists_its_options_and_env_vars(command, capsys):
    assert_help_lists_options(cli, main, "laminar", "LAMINAR", command, capsys)


def test_a_laminar_env_var_reaches_the_member_config_and_set_wins(monkeypatch, started):
    monkeypatch.setenv("LAMINAR_ETCD__TTL_S", "7")
    monkeypatch.setenv("LAMINAR_ROLE", "probe-env")
    monkeypatch.setenv("LAMINAR_MEMBER_ID", "from-env")
    assert main(["member", "--set", "member_id=from-set", "--set", "job=j"]) == 0
    (config,) = started
    assert (config.etcd.ttl_s, config.role, config.member_id, config.job) == (
        7, "probe-env", "from-set", "j")


def test_options_come_from_their_env_vars(monkeypatch, tmp_path, started, capsys):
    path = tmp_path / "member.yaml"
    path.write_text("member_id: from-file\n")
    monkeypatch.setenv("LAMINAR_MEMBER_CONFIG", str(path))
    assert main(["member"]) == 0
    assert started[0].member_id == "from-file"

    monkeypatch.setenv("LAMINAR_UP_BACKEND", "slurm")
    assert main(["up", str(tmp_path / "job.yaml")]) == 2
    assert "Invalid value for '--backend'" in capsys.readouterr().err


def test_set_reaches_the_config_and_a_bad_field_path_fails_naming_it(started, capsys):
    assert main(["member", "--set", "etcd.ttl_s=4", "--set", "role=x"]) == 0
    assert (started[0].etcd.ttl_s, started[0].role) == (4, "x")
    assert main(["member", "--set", "etcd.ttl=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("laminar member: error: invalid MemberConfig")
    assert "etcd.ttl: unknown field; did you mean 'ttl_s'?" in err
    assert len(started) == 1  # nothing started on a bad config


def test_up_refuses_a_bad_job_file_override_before_starting_anything(capsys):
    job = str(REPO / "examples" / "simulated.yaml")
    assert main(["up", job, "--set", "tiers.relay.replicaz=2"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("laminar up: error: ")
    assert "tiers.relay.replicaz: unknown field" in captured.err
    assert "started " not in captured.out


def test_usage_errors_exit_2(capsys):
    assert main(["status"]) == 2
    assert "give RUN_DIR or --job" in capsys.readouterr().err
    assert main(["status", "no/such/run"]) == 2
    assert "launch.json: not a laminar up run dir" in capsys.readouterr().err
    assert main(["up", "x.yaml", "--resume", "--fresh"]) == 2
    assert "--resume and --fresh exclude each other" in capsys.readouterr().err
    assert main(["up", "x.yaml", "--backend", "slurm"]) == 2
    assert main(["demo", "--members", "three"]) == 2
    assert main(["no-such-command"]) == 2
    assert main([]) == 2


def test_status_lists_each_members_metrics_url(monkeypatch, capsys):
    """Over the in-memory etcd twin: a member's advertised /metrics URL is printed as one
    to scrape from elsewhere (a wildcard interface becomes the member's host), ``-``
    for a member without one."""
    store = InMemoryEtcd()
    advertised = {"trainer": "http://127.0.0.1:9100/metrics",
                  "worker-0": "http://0.0.0.0:9101/metrics",
                  "manager": "http://:::9102/metrics",  # MetricsServer on host "::"
                  "relay-0": "http://::1:9103/metrics"}
    roles = {"trainer": Role.TRAINER, "worker-0": Role.WORKER, "manager": Role.MANAGER,
             "relay-0": Role.RELAY, "worker-1": Role.WORKER}
    members = []
    for member_id, role in roles.items():
        extra = {Extra.READY: "1"}
        if member_id in advertised:
            extra[Extra.METRICS] = advertised[member_id]
        coord = InMemoryCoordinator(store, "j", keepalive=False)
        coord.register(MemberRecord(member_id=member_id, role=role, host=f"{member_id}.lan",
                                    extra=extra))
        members.append(coord)
    members[0].publish_version(VersionRecord(version=3))
    monkeypatch.setattr("laminar_common.etcd.EtcdCoordinator",
                        lambda endpoints, job, **kw: InMemoryCoordinator(store, job))
    monkeypatch.setattr("laminar_common.logs.setup_logging", lambda *a, **k: None)
    assert main(["status", "--job", "j"]) == 0
    out = capsys.readouterr().out
    assert "job j: latest weight version 3" in out
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("  ")}
    assert set(lines) == set(roles)
    assert lines["trainer"].endswith(" ready=yes metrics=http://127.0.0.1:9100/metrics")
    assert lines["worker-0"].endswith(" ready=yes metrics=http://worker-0.lan:9101/metrics")
    assert lines["manager"].endswith(" ready=yes metrics=http://manager.lan:9102/metrics")
    assert lines["relay-0"].endswith(" ready=yes metrics=http://[::1]:9103/metrics")
    assert lines["worker-1"].endswith(" ready=yes metrics=-")
    for coord in members:
        coord.close()


def test_no_option_env_var_is_read_as_a_config_field():
    base = load_config(MemberConfig, env={})
    for command in cli.commands:
        for envvar in _option_envvars(command).values():
            assert load_config(MemberConfig, env={envvar: "1"}) == base, envvar


def test_completion_script_and_completions(monkeypatch):
    assert_completion(cli, main, "laminar", monkeypatch, {
        "laminar up job.yaml --backend ": ["plain,local", "plain,ray"],
        "laminar st": ["plain,status"],
    }, shell="bash")


def test_help_of_every_command_imports_nothing_heavy():
    codes, heavy = run_fresh("""
        from laminar_common.launch.cli import cli, main
        codes = [main([c, '--help']) for c in cli.commands] + [main(['--help'])]
        result = codes
    """, ('torch', 'transformers', 'vllm', 'tokenizers', 'pydantic', 'zmq', 'grpc'))
    assert codes == [0] * (len(cli.commands) + 1) and heavy == []
