"""Resume checks: a changed config field is named; a field added to the code after a checkpoint
was written does not block resuming while it keeps its default."""
import dataclasses

import pytest

from sfrrl_jax.checkpoints.trainer_state import check_resumable, config_fingerprint, diff_fingerprints
from sfrrl_jax.config import ModelConfig
from sfrrl_jax.trainer.config import TrainerConfig


def _host(fingerprint):
    from sfrrl_jax.checkpoints.trainer_state import HOST_FORMAT
    return {"format": HOST_FORMAT, "tasks": {"num_tasks": 4}, "config": fingerprint}


def test_changed_field_is_named_and_a_new_field_at_its_default_is_not():
    model = ModelConfig.preset("tiny-moe")
    saved = config_fingerprint(model=model, trainer=TrainerConfig())
    assert diff_fingerprints(saved, config_fingerprint(model=model, trainer=TrainerConfig())) == []
    now = config_fingerprint(model=model.replace(remat="full"), trainer=TrainerConfig(max_slots=4))
    assert diff_fingerprints(saved, now) == ["model.remat: checkpoint 'none', now 'full'",
                                             "trainer.max_slots: checkpoint None, now 4"]
    # a checkpoint from before `llep_threshold` existed (and before defaults were recorded)
    old = {k: dict(v) for k, v in saved.items()}
    for part in old.values():
        part.pop("__defaults__")
    del old["model"]["llep_threshold"]
    check_resumable(_host(old), config_fingerprint(model=model, trainer=TrainerConfig()), 4, "ckpt")
    with pytest.raises(ValueError, match=r"model.llep_threshold: checkpoint '<absent>', now 2.0"):
        check_resumable(_host(old), config_fingerprint(model=model.replace(llep_threshold=2.0),
                                                       trainer=TrainerConfig()), 4, "ckpt")
    assert all(f.name in saved["model"]["__defaults__"] for f in dataclasses.fields(ModelConfig))


def test_dense_layers_added_after_a_checkpoint_resumes_at_its_default():
    model = ModelConfig.preset("tiny-moe", n_layers=3, d_ff=40)
    old = config_fingerprint(model=model)
    old["model"].pop("__defaults__")
    del old["model"]["dense_layers"]          # a checkpoint written before the field existed
    check_resumable(_host(old), config_fingerprint(model=model), 4, "ckpt")
    with pytest.raises(ValueError, match=r"model.dense_layers: checkpoint '<absent>', now \[1\]"):
        check_resumable(_host(old), config_fingerprint(model=model.replace(dense_layers=(1,))), 4, "ckpt")
