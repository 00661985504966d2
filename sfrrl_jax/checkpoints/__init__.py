"""Checkpoints: Hugging Face safetensors directories (`hf`: load_hf/save_hf) and the trainer's own
resumable orbax checkpoints (`Checkpointer` + `trainer_state`/`load_trainer_state`).

    ckpt = Checkpointer(run_dir / "checkpoints", save_every=10)
    ckpt.maybe_save(trainer.step_index, *trainer_state(trainer, rollout))
    restored = ckpt.restore_latest(abstract_trainer_state(trainer.params, trainer.opt_state))
    if restored is not None:
        _, state, host = restored
        load_trainer_state(trainer, state, host, rollout)
"""
from sfrrl_jax.checkpoints.hf import load_adapter, load_hf, save_adapter, save_hf
from sfrrl_jax.checkpoints.orbax_store import (CheckpointCorruptError, CheckpointFallbackWarning, Checkpointer,
                                               CheckpointMismatchError, DamagedCheckpointError,
                                               NoRestorableCheckpointError)
from sfrrl_jax.checkpoints.trainer_state import abstract_trainer_state, load_trainer_state, trainer_state

__all__ = ["CheckpointCorruptError", "CheckpointFallbackWarning", "CheckpointMismatchError", "Checkpointer",
           "DamagedCheckpointError", "NoRestorableCheckpointError", "abstract_trainer_state", "load_adapter", "load_hf",
           "load_trainer_state", "save_adapter", "save_hf",
           "trainer_state"]
