"""Supervised warm start: masked next-token NLL on demonstrations, with the RL train step.

    examples = [dict(zip(("tokens", "loss_mask"), render_sft_example(tok, demo, tools))) ...]
    params, opt_state, metrics = run_sft(model_cfg, params, OptimizerConfig(...), examples,
                                         steps=200, batch_size=16, seed=0, seq_bucket=32)

Batches are drawn from a seeded per-epoch permutation of the examples (every example once per
epoch), one row per example, right-padded to the longest example of the *whole set* rounded up
to `seq_bucket`: every step has the same [batch_size, width] shape, so the fused step compiles
exactly once. Padding carries segment id 0 and loss mask 0, so it never counts.
"""
from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sfrrl_jax.config import ModelConfig
from sfrrl_jax.models.api import mesh_of
from sfrrl_jax.models.transformer import forward_with_aux
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.rl.microbatch import MicroBatch
from sfrrl_jax.learner.optimizer import OptimizerConfig
from sfrrl_jax.trainer.rl_trainer import shared_train_step

if TYPE_CHECKING:
    from sfrrl_jax.learner.optimizer import OptState
    from sfrrl_jax.models.transformer import Params


def check_examples(examples: Sequence[Mapping], vocab_size: int, max_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens int32 [T_i], loss_mask float32 [T_i]) per example; bad ones raise naming the index."""
    if not examples:
        raise ValueError("run_sft: no examples")
    out = []
    for i, ex in enumerate(examples):
        for key in ("tokens", "loss_mask"):
            if key not in ex:
                raise KeyError(f"run_sft: example {i} has no {key!r} (keys: {sorted(ex)})")
        tokens = np.asarray(ex["tokens"], np.int32).reshape(-1)
        mask = np.asarray(ex["loss_mask"], np.float32).reshape(-1)
        if tokens.shape != mask.shape:
            raise ValueError(f"run_sft: example {i}: tokens has {tokens.size} entries, loss_mask {mask.size}")
        if tokens.size < 2:
            raise ValueError(f"run_sft: example {i} has {tokens.size} tokens; need at least 2")
        if tokens.size > max_len:
            raise ValueError(f"run_sft: example {i} has {tokens.size} tokens > ModelConfig.max_seq_len={max_len}")
        if tokens.min() < 0 or tokens.max() >= vocab_size:
            raise ValueError(f"run_sft: example {i}: token ids must lie in [0, {vocab_size}); "
                             f"found {tokens.min()}..{tokens.max()}")
        if not mask[1:].any():
            raise ValueError(f"run_sft: example {i} has no loss token after position 0")
        out.append((tokens, mask))
    return out


def padded_width(lengths: Sequence[int], seq_bucket: int, max_len: int) -> int:
    """Longest length rounded up to a multiple of `seq_bucket` (capped at `max_len`)."""
    if seq_bucket < 1:
        raise ValueError(f"run_sft: seq_bucket must be >= 1, got {seq_bucket}")
    longest = max(lengths)
    return min(-(-longest // seq_bucket) * seq_bucket, max(max_len, longest))


def make_batch(rows: Sequence[tuple[np.ndarray, np.ndarray]], width: int) -> MicroBatch:
    """A `MicroBatch` of host arrays [len(rows), width]: tokens int32, loss_mask float32, segment_ids
    int32 (1 on real tokens, 0 = pad), each row's example from column 0."""
    tokens = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.float32)
    seg = np.zeros((len(rows), width), np.int32)
    for i, (t, m) in enumerate(rows):
        tokens[i, :t.size], mask[i, :t.size], seg[i, :t.size] = t, m, 1
    return MicroBatch(tokens, loss_mask=mask, segment_ids=seg)


class EpochSampler:
    """Seeded batches of example indices: a fresh permutation per epoch, no example twice in one."""

    def __init__(self, n: int, batch_size: int, seed: int):
        if batch_size < 1:
            raise ValueError(f"run_sft: batch_size must be >= 1, got {batch_size}")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch, self.order, self.pos = 0, self._perm(0), 0

    def _perm(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def next(self) -> list[int]:
        out = []
        while len(out) < self.batch_size:
            if self.pos == self.n:
                self.epoch, self.order, self.pos = self.epoch + 1, self._perm(self.epoch + 1), 0
            take = min(self.batch_size - len(out), self.n - self.pos)
            out += self.order[self.pos:self.pos + take].tolist()
            self.pos += take
        return out


def run_sft(model_cfg: ModelConfig, params: Params, optimizer_cfg: OptimizerConfig, examples: Sequence[Mapping],
            steps: int, batch_size: int, seed: int = 0, seq_bucket: int = 32, opt_state: OptState | None = None,
            log_every: int = 0, log: Callable[[str], None] = print,
            stop_when: Callable[[int, dict], bool] | None = None, check_every: int = 0
            ) -> tuple[Params, OptState, list[dict]]:
    """Up to `steps` fused SFT updates (masked NLL, token mean) -> (params, opt_state, metrics per step).

    `params` are updated in place of the caller's (the step donates them): use the returned ones.
    Batches are drawn as the module docstring says (one compile for the whole run).

    Args:
      model_cfg: the model config.
      params: the model's (sharded) params, a nested dict of `jax.Array`; donated.
      optimizer_cfg: the optimizer (AdamW, schedule, clipping).
      examples: demonstrations, each a mapping with 'tokens' `[T_i]` int ids and 'loss_mask' `[T_i]` (1 on
        the tokens to learn): at least 2 tokens, at most `model_cfg.max_seq_len`, ids in the vocabulary, a loss
        token after position 0.
      steps: the most updates to run (>= 0).
      batch_size: rows per update (>= 1).
      seed: seeds the per-epoch permutation of the examples.
      seq_bucket: rows are padded to the longest example rounded up to a multiple of it.
      opt_state: the optimizer state to continue from (None: a fresh one for `params`); donated.
      log_every: > 0 prints (`log`) a progress line every that many steps (and at the last).
      log: takes one line of text.
      stop_when: early stop: with `check_every` > 0, after every `check_every` steps
        `stop_when(steps_done, params)` is called with the live params; True ends the run there (a
        criterion on what the model does, e.g. `teacher_forced_accuracy` of held-out demonstrations,
        rather than a step count that depends on when the model happens to learn).
      check_every: how often `stop_when` is called (>= 1 with `stop_when`).
    Returns:
      `(params, opt_state, history)`: the updated params and optimizer state, and one metrics dict per step run,
      the step's metrics as floats: 'loss' (mean NLL per loss token), 'grad_norm', 'learning_rate', 'num_tokens',
      ..., plus 'step' (int), 'step_s' (wall seconds) and 'epoch' (int).
    Raises:
      ValueError: when `steps` < 0, `batch_size` or `seq_bucket` < 1, `stop_when` comes without
        `check_every` >= 1, there are no examples, or an example is bad (named by its index).
      KeyError: when an example lacks 'tokens' or 'loss_mask'.
    """
    if steps < 0:
        raise ValueError(f"run_sft: steps must be >= 0, got {steps}")
    if stop_when is not None and check_every < 1:
        raise ValueError(f"run_sft: stop_when needs check_every >= 1, got {check_every}")
    rows = check_examples(examples, model_cfg.vocab_size, model_cfg.max_seq_len)
    width = padded_width([t.size for t, _ in rows], seq_bucket, model_cfg.max_seq_len)
    train_step = shared_train_step(model_cfg, LossConfig(objective="sft"), optimizer_cfg)
    if opt_state is None:
        opt_state = train_step.init_opt_state(params)
    sampler = EpochSampler(len(rows), batch_size, seed)
    history = []
    for step in range(steps):
        batch = make_batch([rows[i] for i in sampler.next()], width)
        t0 = time.perf_counter()
        params, opt_state, metrics = train_step.step(params, opt_state, batch)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        metrics.update(step=step, step_s=time.perf_counter() - t0, epoch=sampler.epoch)
        history.append(metrics)
        if log_every and (step % log_every == 0 or step == steps - 1):
            log(f"sft step {step:4d}/{steps}  loss {metrics['loss']:.4f}  lr {metrics['learning_rate']:.2e}  "
                f"{metrics['step_s']:.2f}s")
        if stop_when is not None and (step + 1) % check_every == 0 and stop_when(step + 1, params):
            break
    return params, opt_state, history


@functools.partial(jax.jit, static_argnums=(0,))
def _argmax_hits(cfg: ModelConfig, params, tokens, segment_ids, loss_mask):
    """[batch, seq] 1.0 where the model's argmax at t-1 equals tokens[t] on a loss token, else 0."""
    logits = forward_with_aux(cfg, params, tokens, segment_ids, None)[0]
    predicted = jnp.argmax(logits[:, :-1], axis=-1)
    hit = (predicted == tokens[:, 1:]).astype(jnp.float32) * loss_mask[:, 1:]
    return jnp.pad(hit, ((0, 0), (1, 0)))


def teacher_forced_accuracy(model_cfg: ModelConfig, params: Params, examples: Sequence[Mapping],
                            seq_bucket: int = 32, batch_size: int = 32) -> dict:
    """How well the model reproduces demonstrations token by token (teacher forcing, argmax).

    Rows are padded to one bucketed width and `batch_size` (one compile); pads never count.
    A sequence counts as exact only if greedy decoding would reproduce each of its turns given
    the same observations, so on tool demonstrations this is the share the greedy policy solves.

    Args:
      model_cfg: the model config.
      params: the model's (sharded) params, a nested dict of `jax.Array` (not modified).
      examples: demonstrations, as `run_sft` takes them ('tokens', 'loss_mask').
      seq_bucket: rows are padded to the longest example rounded up to a multiple of it.
      batch_size: rows per forward.
    Returns:
      {'token_accuracy': share of loss tokens (after position 0) predicted exactly,
       'sequence_accuracy': share of examples whose every loss token is predicted exactly}.
    Raises:
      ValueError: when there are no examples, `seq_bucket` < 1, or an example is bad (named by its index).
      KeyError: when an example lacks 'tokens' or 'loss_mask'.
    """
    rows = check_examples(examples, model_cfg.vocab_size, model_cfg.max_seq_len)
    width = padded_width([t.size for t, _ in rows], seq_bucket, model_cfg.max_seq_len)
    hits_total, tokens_total, exact = 0.0, 0.0, 0
    mesh = mesh_of(params)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        chunk = chunk + [(np.zeros(2, np.int32), np.zeros(2, np.float32))] * (batch_size - len(chunk))
        batch = make_batch(chunk, width)
        with jax.set_mesh(mesh):
            hits = np.asarray(jax.device_get(_argmax_hits(model_cfg, params, batch.tokens,
                                                          batch.segment_ids, batch.loss_mask)))
        for i in range(min(batch_size, len(rows) - start)):
            needed = float(batch.loss_mask[i, 1:].sum())
            got = float(hits[i].sum())
            hits_total, tokens_total, exact = hits_total + got, tokens_total + needed, exact + (got == needed)
    return {"token_accuracy": hits_total / tokens_total, "sequence_accuracy": exact / len(rows)}
