"""`MicroBatch`: the typed pytree one train micro-step reads.

    mb = MicroBatch(tokens, loss_mask, advantages=adv, rollout_logprobs=logp, segment_ids=seg)
    mb.rows, mb.width                    # [rows, width] of tokens
    jax.tree.map(lambda v: v[:2], mb)    # a pytree: slice rows, place on devices, pass to jit
    mb.get("advantages"), mb.present     # a field by name; the names of the fields it holds
    MicroBatch.from_mapping({"tokens": ..., "loss_mask": ..., "my_field": ...})  # unknown -> extras

Every field is `[rows, width]` like `tokens` (stored aligned to the token it belongs to; the train
step shifts them to the targets, `learner.objective`), except `advantages`, which may be per-row
`[rows]` on unpacked rows, and `routes`, `[rows, width, moe layers, top_k]`. A field the batch does
not carry is None (an empty pytree node: jit keys its functions on which fields are present).
Fields a custom loss declares beyond the built-in ones (`Loss.fields`) live in `extras`, by name.

Which fields a loss needs is the loss's declaration (`Loss.required_fields` / `optional_fields`);
`validate_microbatch` checks a concrete micro-batch against it at the edge (the train step's entry),
never inside traced code.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sfrrl_jax.rl.loss_fn import BUILTIN_FIELDS, REPLAY_FIELDS, Loss, as_loss
from sfrrl_jax.rl.config import LossConfig


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One train micro-step's arrays (module doc); a pytree whose leaves are the present fields.

    Attributes:
      tokens: `[rows, width]` int token ids.
      loss_mask: `[rows, width]` float 1 on the tokens the loss trains (policy-generated), else 0.
      advantages: `[rows, width]` float per token (0 off the loss mask), or `[rows]` per row (unpacked rows).
      rollout_logprobs: `[rows, width]` float the engine's log-prob of each token when it sampled it.
      old_logprobs: `[rows, width]` float log-probs under the policy before this update (behavior='old').
      ref_logprobs: `[rows, width]` float log-probs under the reference policy (KL penalty).
      segment_ids: `[rows, width]` int packed rows: 1, 2, ... per trajectory along a row, 0 = padding.
      positions: `[rows, width]` int explicit positions (None: derived from the segments).
      routes: `[rows, width, moe layers, top_k]` int the engine's experts (routing replay).
      routes_mask: `[rows, width]` int 1 where `routes` holds the engine's choice.
      extras: a custom loss's own fields by name (`Loss.fields` beyond the built-in ones), each
        `[rows, width]`.
    """

    tokens: Any
    loss_mask: Any = None
    advantages: Any = None
    rollout_logprobs: Any = None
    old_logprobs: Any = None
    ref_logprobs: Any = None
    segment_ids: Any = None
    positions: Any = None
    routes: Any = None
    routes_mask: Any = None
    extras: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        clash = sorted(set(self.extras) & set(BUILTIN_FIELDS))
        if clash:
            raise ValueError(f"MicroBatch.extras holds {clash}, which are built-in fields: pass them as "
                             "MicroBatch(...) arguments")
        object.__setattr__(self, "extras", dict(self.extras))

    # -- by name ----------------------------------------------------------------------------------
    def get(self, name: str, default: Any = None) -> Any:
        """The field `name` (built-in or extra), or `default` where the batch does not carry it."""
        value = getattr(self, name) if name in BUILTIN_FIELDS else self.extras.get(name)
        return default if value is None else value

    @property
    def present(self) -> tuple[str, ...]:
        """The names of the fields this batch carries (not None): built-ins in declaration order, then extras."""
        return tuple(k for k in BUILTIN_FIELDS if getattr(self, k) is not None) + tuple(
            k for k, v in self.extras.items() if v is not None)

    def fields(self) -> dict[str, Any]:
        """{name: array} of the present fields (a new dict; the batch is unchanged)."""
        return {k: self.get(k) for k in self.present}

    def replace(self, **changes: Any) -> "MicroBatch":
        """A copy with these fields changed (a name that is not built-in goes to `extras`; None drops it)."""
        builtin = {k: v for k, v in changes.items() if k in BUILTIN_FIELDS}
        extra = {k: v for k, v in changes.items() if k not in BUILTIN_FIELDS}
        extras = {k: v for k, v in {**self.extras, **extra}.items() if v is not None}
        return dataclasses.replace(self, **builtin, extras=extras)

    def select(self, names) -> "MicroBatch":
        """A copy carrying only the fields in `names` (and always `tokens`): what a loss reads."""
        keep = set(names) | {"tokens"}
        return dataclasses.replace(self, **{k: None for k in BUILTIN_FIELDS if k not in keep},
                                   extras={k: v for k, v in self.extras.items() if k in keep})

    # -- shape ------------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        """The number of rows (`tokens.shape[0]`)."""
        return int(np.shape(self.tokens)[0])

    @property
    def width(self) -> int:
        """The row width in tokens (`tokens.shape[1]`)."""
        return int(np.shape(self.tokens)[1])

    def row_slice(self, start: int, stop: int) -> "MicroBatch":
        """Rows `[start, stop)` of every field."""
        return jax.tree.map(lambda v: v[start:stop], self)

    # -- from / to mappings -----------------------------------------------------------------------
    @classmethod
    def from_mapping(cls, fields: Mapping[str, Any]) -> "MicroBatch":
        """A MicroBatch of a {name: array} mapping: built-in names to their attributes, the rest to
        `extras`; None values are left out. Raises KeyError when 'tokens' is missing."""
        if not isinstance(fields, Mapping):
            raise TypeError(f"a micro-batch is a MicroBatch (or a mapping of field name -> array), got "
                            f"{type(fields).__name__}")
        present = {k: v for k, v in fields.items() if v is not None}
        if "tokens" not in present:
            raise KeyError(f"micro-batch has no 'tokens' (fields: {sorted(present)})")
        return cls(**{k: v for k, v in present.items() if k in BUILTIN_FIELDS},
                   extras={k: v for k, v in present.items() if k not in BUILTIN_FIELDS})


def as_microbatch(batch: MicroBatch | Mapping[str, Any]) -> MicroBatch:
    """`batch` as a MicroBatch: itself, or `MicroBatch.from_mapping` of a mapping (an API edge's convenience).

    Args:
      batch: a `MicroBatch`, or a mapping of field name -> array (built-in names to their attributes,
        the rest to `extras`, None values left out).
    Returns:
      `batch` itself when it is a MicroBatch, else a new MicroBatch of its fields (the same arrays).
    Raises:
      TypeError: `batch` is neither. KeyError: a mapping without 'tokens'.
    """
    return batch if isinstance(batch, MicroBatch) else MicroBatch.from_mapping(batch)


_DATA_FIELDS = [f.name for f in dataclasses.fields(MicroBatch)]
jax.tree_util.register_dataclass(MicroBatch, data_fields=_DATA_FIELDS, meta_fields=[])


def validate_microbatch(batch: MicroBatch | Mapping[str, Any], loss: Loss | LossConfig,
                        vocab_size: int | None = None) -> None:
    """Host-side checks (fields, shapes, dtypes, token range) with messages naming the field.

    Required fields are the loss's `required_fields` (and under routing replay 'routes' and
    'routes_mask'); a field is unknown unless a built-in loss or this loss reads it
    (`rl.loss_fn.BUILTIN_FIELDS`, `Loss.fields`).

    Args:
      batch: the micro-batch (a `MicroBatch`, or a mapping `as_microbatch` takes): 'tokens' `[rows, width]`
        int (width >= 2); every other field `[rows, width]` like it, except 'advantages', which may be
        per-row `[rows]` on unpacked rows (no 'segment_ids'), and 'routes', `[rows, width, moe layers, top_k]`
        int.
      loss: the loss (`sfrrl_jax.rl.Loss`, or a `LossConfig` mapped to its built-in).
      vocab_size: when given, every token id must lie in `[0, vocab_size)`.
    Returns:
      None, when the micro-batch passes every check.
    Raises:
      TypeError: when `batch` is neither a MicroBatch nor a mapping, or 'tokens' is not integer.
      KeyError: when a required field is missing, or a field is unknown.
      ValueError: when a shape is wrong, per-row advantages meet packed rows, or a token id is out of range.
    """
    batch = as_microbatch(batch)
    loss = as_loss(loss)
    present = batch.present
    missing = [k for k in loss.required_fields if k not in present]
    if missing:
        raise KeyError(f"micro-batch is missing {missing}, required by the loss {loss.name} "
                       f"(Loss.required_fields={list(loss.required_fields)}); has {sorted(present)}")
    if loss.routing_replay == "r3":
        missing = [k for k in REPLAY_FIELDS if k not in present]
        if missing:
            raise KeyError(f"micro-batch is missing {missing}: routing replay (routing_replay='r3') trains "
                           f"on the engine's experts (an Engine built with record_routes=True); has {sorted(present)}")
    known = set(BUILTIN_FIELDS) | set(loss.fields)
    unknown = sorted(set(present) - known)
    if unknown:
        raise KeyError(f"micro-batch has unknown keys {unknown} (fields neither a built-in loss nor this "
                       f"loss reads); valid: {sorted(known)}")
    shape = tuple(np.shape(batch.tokens))
    if len(shape) != 2 or shape[1] < 2:
        raise ValueError(f"micro-batch 'tokens' must be [rows, width] with width >= 2, got {shape}")
    if not np.issubdtype(batch.tokens.dtype, np.integer):
        raise TypeError(f"micro-batch 'tokens' must be integer ids, got {batch.tokens.dtype}")
    for k, v in batch.fields().items():
        if k == "tokens":
            continue
        s = tuple(np.shape(v))
        if k == "routes":
            if len(s) != 4 or s[:2] != shape or not np.issubdtype(v.dtype, np.integer):
                raise ValueError(f"micro-batch 'routes' must be int [rows, width, moe layers, top_k] with "
                                 f"[rows, width] = {shape} like 'tokens', got {v.dtype} {s}")
            continue
        if k == "advantages" and s == shape[:1]:
            if batch.segment_ids is not None:
                raise ValueError("micro-batch 'advantages' is per-row [rows] but rows are packed "
                                 "('segment_ids' given): pass per-token [rows, width] advantages")
            continue
        if s != shape:
            raise ValueError(f"micro-batch '{k}' has shape {s}, expected {shape} like 'tokens'")
    if vocab_size is not None and batch.tokens.size:
        lo, hi = int(jnp.min(batch.tokens)), int(jnp.max(batch.tokens))
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"micro-batch 'tokens' must lie in [0, {vocab_size}); found min {lo}, max {hi}")
