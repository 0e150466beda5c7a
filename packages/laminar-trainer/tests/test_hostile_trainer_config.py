"""Hostile input to the trainer's config loader: arbitrary files, mappings and ``--set``.

``load_config(TrainerConfig, ...)`` must return a complete, frozen config or raise
:class:`ConfigError` naming the file, the ``--set`` item or every bad field path;
no other exception may escape.
"""

from __future__ import annotations

import pytest

from laminar_common.config import load_config
from laminar_common.errors import ConfigError
from laminar_common.testing import assert_bad_field_named, assert_bad_file_named, make_loader_tests
from laminar_trainer.config import TrainerConfig

globals().update(make_loader_tests(TrainerConfig, max_examples=120))


@pytest.fixture(scope="module")
def cfg_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile-config")


@pytest.mark.parametrize(("items", "field"), [
    (["optim.lr=0"], "optim.lr"),
    (["optim.lr=fast"], "optim.lr"),
    (["optim.schedule=linear"], "optim.schedule"),
    (["buffer.policy=lifo"], "buffer.policy"),
    (["buffer.downweight=2"], "buffer.downweight"),
    (["loss.clip_low=-1"], "loss.clip_low"),
    (["loss.tis_cap=0"], "loss.tis_cap"),
    (["checkpoint.every_steps=0"], "checkpoint.every_steps"),
    (["tracking.wandb.mode=loud"], "tracking.wandb.mode"),
    (["simulate.step_s=-1"], "simulate.step_s"),
    (["device=tpu"], "device"),
    (["batch_groups=0"], "batch_groups"),
    (["loss.algorithm=ppo"], "loss.algorithm"),
    (["loss.aggregation=sum"], "loss.aggregation"),
    (["optim.mini_batches=0"], "optim.mini_batches"),
    (["optim.epochs=0"], "optim.epochs"),
])
def test_a_bad_field_names_its_full_path(items, field):
    assert_bad_field_named(TrainerConfig, items, field)


def test_a_bad_field_in_a_file_names_the_file_and_the_path(cfg_dir):
    assert_bad_file_named(TrainerConfig, cfg_dir / "trainer.toml",
                          "[optim]\nlr = -1\n[tracking.wandb]\nprojet = 'x'\n",
                          ["optim.lr: ", "tracking.wandb.projet: unknown field; did you mean "
                           "'project'?"])


def test_mini_batches_that_do_not_divide_the_step_are_named():
    with pytest.raises(ConfigError, match=r"optim.mini_batches \(3\) must divide batch_groups "
                                          r"\(8\)"):
        load_config(TrainerConfig, None, ["simulate.step_s=0", "optim.mini_batches=3"], env={})


def test_an_algorithm_sets_its_defaults_and_an_explicit_value_wins():
    gspo = load_config(TrainerConfig, None, ["simulate.step_s=0", "loss.algorithm=gspo"],
                       env={})
    assert (gspo.loss.clip_low, gspo.loss.clip_high, gspo.loss.aggregation) == \
        (3e-4, 4e-4, "seq-mean-token-mean")
    mine = load_config(TrainerConfig, None, ["simulate.step_s=0", "loss.algorithm=dr_grpo",
                                             "loss.aggregation=token-mean"], env={})
    assert mine.loss.aggregation == "token-mean" and mine.loss.clip_high == 0.28
