"""The training loop around the train step: pipelined-synchronous RL, phases, metrics, checkpoints."""
