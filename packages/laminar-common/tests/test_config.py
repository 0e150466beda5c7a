import pytest
from pydantic import Field, ValidationError

from laminar_common.config import EtcdConfig, LaminarModel, dump_config, load_config
from laminar_common.errors import ConfigError


class Engine(LaminarModel):
    batch: int = Field(default=8, ge=1)
    name: str = "torch"


class TierConfig(LaminarModel):
    job: str = "j"
    etcd: EtcdConfig = EtcdConfig()
    engine: Engine = Engine()


def test_precedence_defaults_file_env_set(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("job: from-file\nengine:\n  batch: 2\n  name: file\n")
    env = {"LAMINAR_ENGINE__BATCH": "3", "LAMINAR_JOB": "from-env", "OTHER": "x"}
    cfg = load_config(TierConfig, path, ["engine.batch=4"], env=env)
    assert cfg.job == "from-env"
    assert cfg.engine.batch == 4
    assert cfg.engine.name == "file"
    assert cfg.etcd.ttl_s == 10


def test_toml_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('job = "t"\n[etcd]\nendpoints = ["127.0.0.1:1234"]\nttl_s = 5\n')
    cfg = load_config(TierConfig, path, env={})
    assert cfg.etcd.endpoints == ("127.0.0.1:1234",)
    assert cfg.etcd.ttl_s == 5


def test_typo_names_field_path_and_suggestion():
    with pytest.raises(ConfigError) as info:
        load_config(TierConfig, overrides=["engine.bacth=3"], env={})
    text = str(info.value)
    assert "engine.bacth: unknown field" in text
    assert "did you mean 'batch'" in text


def test_bad_value_names_field_and_value():
    with pytest.raises(ConfigError) as info:
        load_config(TierConfig, overrides=["engine.batch=0"], env={})
    assert "engine.batch" in str(info.value)
    assert "(got 0)" in str(info.value)


def test_every_bad_field_is_listed():
    with pytest.raises(ConfigError) as info:
        load_config(TierConfig, overrides=["engine.batch=0", "etcd.ttl_s=1"], env={})
    assert "engine.batch" in str(info.value) and "etcd.ttl_s" in str(info.value)


def test_config_is_frozen():
    cfg = load_config(TierConfig, env={})
    with pytest.raises(ValidationError):
        cfg.job = "other"


@pytest.mark.parametrize("bad", ["novalue", "=3", "a..b=1"])
def test_bad_override_syntax(bad):
    with pytest.raises(ConfigError):
        load_config(TierConfig, overrides=[bad], env={})


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(TierConfig, tmp_path / "nope.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("job: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid"):
        load_config(TierConfig, bad, env={})
    ini = tmp_path / "c.ini"
    ini.write_text("x")
    with pytest.raises(ConfigError, match="yaml"):
        load_config(TierConfig, ini, env={})
    scalar = tmp_path / "s.yaml"
    scalar.write_text("3\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(TierConfig, scalar, env={})


def test_override_into_a_value_is_refused():
    with pytest.raises(ConfigError, match="is a value"):
        load_config(TierConfig, overrides=["job=x", "job.x=1"], env={})


def test_dump_masks_secrets():
    cfg = load_config(TierConfig, overrides=["etcd.password=hunter2", "etcd.user=u"], env={})
    text = dump_config(cfg)
    assert "hunter2" not in text and "***" in text


def test_a_misspelt_env_variable_is_warned_with_a_did_you_mean(capsys):
    env = {"LAMINAR_ENGIN__BATCH": "3", "LAMINAR_JOBB": "x",
           # another tier's field and a CLI option variable: silent, one env serves all
           "LAMINAR_TOTAL_STEPS": "9", "LAMINAR_ROLLOUT_MANAGE_RESUME": "1"}
    cfg = load_config(TierConfig, env=env)
    assert cfg.engine.batch == 8 and cfg.job == "j"
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "laminar-preflight WARNING: LAMINAR_ENGIN__BATCH sets no TierConfig field and is "
        "ignored: did you mean LAMINAR_ENGINE__BATCH?",
        "laminar-preflight WARNING: LAMINAR_JOBB sets no TierConfig field and is ignored: "
        "did you mean LAMINAR_JOB?"]


def test_the_resolved_config_goes_beside_the_config_file_not_into_the_log(tmp_path, caplog):
    import logging

    from laminar_common.config import log_resolved

    path = tmp_path / "worker.yaml"
    path.write_text("job: from-file\n")
    cfg = load_config(TierConfig, path, env={})
    logger = logging.getLogger("test.resolved")
    with caplog.at_level(logging.INFO, logger="test.resolved"):
        log_resolved(logger, cfg, path)
        log_resolved(logger, cfg, None)
    written = tmp_path / "worker.resolved.yaml"
    assert written.read_text() == dump_config(cfg) + "\n"
    first, second = caplog.messages
    assert first == f"resolved config: {written}"
    assert second.startswith("resolved config:\njob: from-file\n")


def test_another_tiers_field_in_the_environment_is_not_a_typo(capsys):
    from laminar_common.launch.member import MemberConfig

    assert set(MemberConfig.model_fields) <= __import__(
        "laminar_common.config", fromlist=["TIER_FIELD_NAMES"]).TIER_FIELD_NAMES


    class WorkerLike(LaminarModel):  # fields a worker has
        kv_port: int = 0
        reward_timeout_s: float = 30.0

    # The trainer's wait_timeout_s and the manager's ack_port are near this model's
    # fields, but are other tiers' own: silent. A true typo still warns.
    load_config(WorkerLike, env={"LAMINAR_WAIT_TIMEOUT_S": "5", "LAMINAR_ACK_PORT": "1"})
    assert capsys.readouterr().err == ""
    load_config(WorkerLike, env={"LAMINAR_KV_PROT": "1"})
    assert "did you mean LAMINAR_KV_PORT?" in capsys.readouterr().err
