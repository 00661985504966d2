"""Losses as values: a `Loss` is a pure per-micro-batch objective plus what it declares.

    loss = policy_loss(LossConfig(clip_high=0.28))      # a built-in, from its config
    loss = loss_from_config(cfg)                         # 'policy' or 'sft', whichever cfg says
    loss = Loss(fn=my_objective, required_fields=("tokens", "loss_mask", "advantages"),
                linear_in_advantages=True, has_advantage_free_terms=False,
                advantage_metrics=("agg/my_pg",))        # a new loss, no library edit
    ts = make_train_step(model_cfg, loss, optimizer)     # `sfrrl_jax.learner`

`fn(inputs: LossInputs) -> ObjectiveParts` sees one micro-batch, *target-aligned* (see
`learner.objective`): `inputs.logp` / `inputs.entropy` [batch, seq] are the current params'
log-probs and entropies of the predicted tokens (differentiable), `inputs.mask` [batch, seq] is
the float target mask, `inputs.layout` the sequence layout (packed rows), and `inputs.fields`
holds every other field the loss declares and the batch carries, shifted to the same alignment
as float32 [batch, seq] ('advantages' given per row [batch] is broadcast over the row first).
It returns the parts of an exact accumulation (`rl.losses.ObjectiveParts`): a differentiable
numerator and a denominator that are sums over sequences (`rl.aggregation.aggregation_parts`
builds both), token/sequence counts, and metric sums ('agg/<name>' divided by the denominator at
the end, 'tok/<name>' by the loss tokens), maxima and minima. The metric keys must not depend on
the values, nor on which optional fields are present (the accumulator is laid out once, from a
call with every declared field present).

What a Loss declares, and who reads it:
  required_fields   batch keys that must be present (always incl. 'tokens' and 'loss_mask');
                    `rl.microbatch.validate_microbatch` raises naming a missing one.
  optional_fields   batch keys read when present; any other key outside the built-in fields is
                    rejected, and keys the loss does not read are dropped before the jit.
                    'segment_ids' and 'positions' (packing) are always optional.
  linear_in_advantages  the numerator's gradient is `A * H + K` per row with H, K independent of
                    the advantages A, and `ObjectiveParts.advantage_term` is the A-carrying part
                    of the numerator: advantage-deferred gradients (`learner.deferred`) need it.
  has_advantage_free_terms  the numerator has terms besides `advantage_term` whose gradient is
                    not 0 (KL, entropy): the deferred path then back-propagates them separately.
                    Default True (always correct, one more param-sized buffer per early group).
  advantage_metrics metric sums equal to `advantage_term` (deferred: recombined at the merge).
  zero_advantage_zero_gradient  a row whose advantages are all 0 adds exactly nothing to the
                    numerator's gradient (every term of it is a product with the advantage), so
                    such rows may train forward only: their loss, counts and metrics are still
                    accumulated, their backward pass is skipped (`TrainStep.stats_microstep`;
                    the trainer's zero-advantage trajectories, `TrainerConfig
                    .skip_zero_advantage_backward`). Needs 'advantages' in required_fields.
                    Default False (always correct: every row back-propagates). The built-in
                    policy loss declares it when it has no advantage-free terms (kl_coef and
                    entropy_coef 0), whatever its clip, behavior and IS correction; SFT does not.
  vocab_chunk / seq_chunk  chunk sizes of the log-prob computation; router_aux_coef /
                    router_z_coef: router loss coefficients (None: the model config's).
  routing_replay    'off' or 'r3': the forward replays the engine's experts (MoE models), so
                    the batch must carry `REPLAY_FIELDS` (see `LossConfig.routing_replay`).

A Loss is a frozen dataclass: hashable and comparable (built-ins compare by their config), so a
train step can be cached per (model, loss, optimizer).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax.numpy as jnp

from sfrrl_jax.rl.aggregation import SequenceLayout
from sfrrl_jax.rl.config import LossConfig
from sfrrl_jax.rl.losses import ObjectiveParts, policy_objective, sft_objective

# Every loss reads these: the forward's input and the loss mask the target mask is built from.
BASE_FIELDS = ("tokens", "loss_mask")
# Always optional: packing (segment ids; 0 = padding) and explicit positions, read by the forward.
LAYOUT_FIELDS = ("segment_ids", "positions")
# Read by the forward under routing replay: the engine's experts per token, routes [batch, seq,
# moe layers, top_k] int, and where they hold, routes_mask [batch, seq] (0: the router's own choice).
REPLAY_FIELDS = ("routes", "routes_mask")
# Fields the built-in losses read; a batch may carry any of them whatever the loss.
BUILTIN_FIELDS = (BASE_FIELDS + ("advantages", "rollout_logprobs", "old_logprobs", "ref_logprobs") + LAYOUT_FIELDS
                  + REPLAY_FIELDS)


class LossInputs(NamedTuple):
    """What a loss function sees for one micro-batch (all `[batch, seq]`, target-aligned).

    Attributes:
      logp: `[batch, seq]` float current params' log-probs of the predicted tokens (differentiable).
      entropy: `[batch, seq]` float their predictive entropies (differentiable).
      mask: `[batch, seq]` float32 target mask: 1 = a loss token predicted from its own segment.
      layout: the `SequenceLayout`: which tokens form a sequence (packed rows).
      fields: the declared, present batch fields (not tokens/loss_mask/layout), each float32
        `[batch, seq]` ('advantages' given per row `[batch]` is broadcast over the row first).
    """
    logp: jnp.ndarray        # current params' log-probs of the predicted tokens (differentiable)
    entropy: jnp.ndarray     # their predictive entropies (differentiable)
    mask: jnp.ndarray        # float32 target mask: 1 = a loss token predicted from its own segment
    layout: SequenceLayout   # which tokens form a sequence (packed rows)
    fields: dict             # declared, present batch fields (not tokens/loss_mask/layout), float32


def _check_fields(name: str, value) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"Loss.{name} must be a tuple of field names, got {value!r}")
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class Loss:
    """A per-micro-batch objective and its declarations; see the module doc.

    Attributes:
      fn: the objective, `LossInputs -> ObjectiveParts`.
      required_fields: batch keys that must be present; must include 'tokens' and 'loss_mask'.
      optional_fields: batch keys read when present (none of them also required).
      linear_in_advantages: the numerator's gradient is `A * H + K` per row, and
        `ObjectiveParts.advantage_term` is its A-carrying part (needs 'advantages' required).
      has_advantage_free_terms: the numerator has terms besides `advantage_term` with a nonzero gradient.
      advantage_metrics: metric sums equal to `advantage_term`.
      zero_advantage_zero_gradient: a row whose advantages are all 0 adds nothing to the gradient (a
        bool; needs 'advantages' required).
      name: a label used in messages.
      vocab_chunk: vocab chunk size of the log-prob computation (int >= 1).
      seq_chunk: sequence chunk size of the log-prob computation (int >= 1).
      router_aux_coef: router auxiliary loss coefficient (>= 0); None: the model config's.
      router_z_coef: router z-loss coefficient (>= 0); None: the model config's.
      routing_replay: 'off' or 'r3' (the forward replays the engine's experts; `REPLAY_FIELDS` then
        required, and never declared as loss fields).
      config: the `LossConfig` a built-in was made from (None: custom).
    Raises:
      TypeError: `fn` is not callable, a field list is not a tuple of names, or
        `zero_advantage_zero_gradient` is not a bool.
      ValueError: any other declaration breaks the rules above.
    """

    fn: Callable[[LossInputs], ObjectiveParts]
    required_fields: tuple[str, ...] = BASE_FIELDS
    optional_fields: tuple[str, ...] = ()
    linear_in_advantages: bool = False
    has_advantage_free_terms: bool = True
    advantage_metrics: tuple[str, ...] = ()
    zero_advantage_zero_gradient: bool = False
    name: str = "custom"
    vocab_chunk: int = 8192
    seq_chunk: int = 1024
    router_aux_coef: float | None = None
    router_z_coef: float | None = None
    routing_replay: str = "off"   # 'off' | 'r3'
    config: LossConfig | None = None  # the LossConfig a built-in was made from (None: custom)

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"Loss.fn must be callable (LossInputs -> ObjectiveParts), got {self.fn!r}")
        for name in ("required_fields", "optional_fields", "advantage_metrics"):
            object.__setattr__(self, name, _check_fields(name, getattr(self, name)))
        missing = [k for k in BASE_FIELDS if k not in self.required_fields]
        if missing:
            raise ValueError(f"Loss {self.name!r}: required_fields must include {missing} "
                             f"(every loss reads them), got {self.required_fields}")
        both = sorted(set(self.required_fields) & set(self.optional_fields))
        if both:
            raise ValueError(f"Loss {self.name!r}: {both} declared both required and optional")
        if self.linear_in_advantages and "advantages" not in self.required_fields:
            raise ValueError(f"Loss {self.name!r}: linear_in_advantages=True needs 'advantages' in "
                             f"required_fields, got {self.required_fields}")
        if not isinstance(self.zero_advantage_zero_gradient, bool):
            raise TypeError("Loss.zero_advantage_zero_gradient must be a bool, got "
                            f"{self.zero_advantage_zero_gradient!r}")
        if self.zero_advantage_zero_gradient and "advantages" not in self.required_fields:
            raise ValueError(f"Loss {self.name!r}: zero_advantage_zero_gradient=True needs 'advantages' in "
                             f"required_fields (the rows it skips are those whose advantages are 0), got "
                             f"{self.required_fields}")
        for name in ("vocab_chunk", "seq_chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Loss.{name} must be an int >= 1, got {v!r}")
        for name in ("router_aux_coef", "router_z_coef"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"Loss.{name} must be None or a number >= 0, got {v!r}")
        if self.routing_replay not in ("off", "r3"):
            raise ValueError(f"Loss.routing_replay={self.routing_replay!r}; valid: ['off', 'r3']")
        clash = sorted(set(self.fields) & set(REPLAY_FIELDS))
        if clash:
            raise ValueError(f"Loss {self.name!r}: {clash} are the forward's routing-replay fields "
                             "(set routing_replay='r3'), not loss fields")

    @property
    def fields(self) -> tuple[str, ...]:
        """Every batch field the loss reads: required, then optional."""
        return self.required_fields + self.optional_fields

    @property
    def input_fields(self) -> tuple[str, ...]:
        """The declared fields `fn` receives in `LossInputs.fields` (all but tokens/mask/layout)."""
        return tuple(k for k in self.fields if k not in BASE_FIELDS and k not in LAYOUT_FIELDS)

    @property
    def forward_fields(self) -> tuple[str, ...]:
        """The batch fields the model forward reads besides tokens: layout, and under routing
        replay the engine's routes (required then)."""
        return LAYOUT_FIELDS + (REPLAY_FIELDS if self.routing_replay == "r3" else ())

    def __call__(self, inputs: LossInputs) -> ObjectiveParts:
        return self.fn(inputs)


@dataclasses.dataclass(frozen=True)
class _PolicyObjective:
    cfg: LossConfig

    def __call__(self, x: LossInputs) -> ObjectiveParts:
        f = x.fields
        return policy_objective(x.logp, x.entropy, x.mask, f["advantages"], f.get("rollout_logprobs"),
                                x.layout, self.cfg, old_logp=f.get("old_logprobs"),
                                ref_logp=f.get("ref_logprobs"))


@dataclasses.dataclass(frozen=True)
class _SFTObjective:
    cfg: LossConfig

    def __call__(self, x: LossInputs) -> ObjectiveParts:
        return sft_objective(x.logp, x.entropy, x.mask, x.layout, self.cfg)


def _common(cfg: LossConfig) -> dict:
    return dict(vocab_chunk=cfg.vocab_chunk, seq_chunk=cfg.seq_chunk, router_aux_coef=cfg.router_aux_coef,
                router_z_coef=cfg.router_z_coef, routing_replay=cfg.routing_replay, config=cfg)


def policy_loss(cfg: LossConfig = LossConfig()) -> Loss:
    """The clipped policy gradient of `cfg` (objective 'policy': PPO/GSPO, KL, entropy, IS correction).

    Requires tokens, loss_mask, advantages, rollout_logprobs (+ old_logprobs for behavior='old',
    ref_logprobs for kl_coef > 0). Linear in the advantages exactly when behavior='current' (the
    ratio is 1 in value, so the clip never binds); KL and entropy are its advantage-free terms.
    Without them (kl_coef == entropy_coef == 0) it declares `zero_advantage_zero_gradient`: its
    numerator is then the aggregated clipped term alone, each token's loss -A * r (or its clip, its
    dual clip -c * A, times a stop-gradient IS weight), whose gradient at A = 0 is exactly 0 for
    every policy_loss, behavior and is_correction. Its `fn` calls `rl.losses.policy_objective`.

    Args:
      cfg: a `LossConfig` with objective 'policy' (default: `LossConfig()`).
    Returns:
      The `Loss`, with metric 'agg/pg_loss' as its `advantage_metrics`.
    Raises:
      ValueError: `cfg.objective` is not 'policy'.
    """
    if cfg.objective != "policy":
        raise ValueError(f"policy_loss: LossConfig.objective={cfg.objective!r}, expected 'policy' "
                         "(use loss_from_config to dispatch on the objective)")
    required = BASE_FIELDS + ("advantages", "rollout_logprobs")
    if cfg.behavior == "old":
        required += ("old_logprobs",)
    if cfg.kl_coef > 0:
        required += ("ref_logprobs",)
    optional = tuple(k for k in ("old_logprobs", "ref_logprobs") if k not in required)
    name = (f"policy(policy_loss={cfg.policy_loss!r}, behavior={cfg.behavior!r}, kl_coef={cfg.kl_coef}; "
            f"LossConfig.objective='policy')")
    return Loss(fn=_PolicyObjective(cfg), required_fields=required, optional_fields=optional,
                linear_in_advantages=cfg.behavior == "current",
                has_advantage_free_terms=cfg.kl_coef > 0 or cfg.entropy_coef > 0,
                zero_advantage_zero_gradient=cfg.kl_coef == 0 and cfg.entropy_coef == 0,
                advantage_metrics=("agg/pg_loss",), name=name, **_common(cfg))


def sft_loss(cfg: LossConfig = LossConfig(objective="sft")) -> Loss:
    """Masked NLL of the loss tokens (minus the entropy bonus), aggregated per `cfg.aggregation`.

    Requires tokens and loss_mask only; other built-in fields in the batch are ignored. Its `fn` calls
    `rl.losses.sft_objective`; it is not linear in advantages, and has advantage-free terms only when
    `cfg.entropy_coef` > 0.

    Args:
      cfg: a `LossConfig` with objective 'sft' (default: `LossConfig(objective="sft")`).
    Returns:
      The `Loss`.
    Raises:
      ValueError: `cfg.objective` is not 'sft'.
    """
    if cfg.objective != "sft":
        raise ValueError(f"sft_loss: LossConfig.objective={cfg.objective!r}, expected 'sft' "
                         "(use loss_from_config to dispatch on the objective)")
    return Loss(fn=_SFTObjective(cfg), required_fields=BASE_FIELDS, linear_in_advantages=False,
                has_advantage_free_terms=cfg.entropy_coef > 0,
                name="sft(LossConfig.objective='sft')", **_common(cfg))


def loss_from_config(cfg: LossConfig) -> Loss:
    """The built-in Loss `cfg` describes: `policy_loss(cfg)` or `sft_loss(cfg)` by `cfg.objective`.

    Args:
      cfg: the loss config; `objective` 'sft' gives `sft_loss(cfg)`, anything else `policy_loss(cfg)`.
    Returns:
      The `Loss`.
    """
    return sft_loss(cfg) if cfg.objective == "sft" else policy_loss(cfg)


def as_loss(loss: Loss | LossConfig) -> Loss:
    """A Loss as is; a LossConfig through `loss_from_config`.

    Args:
      loss: a `Loss`, or a `LossConfig` describing a built-in one.
    Returns:
      The `Loss`.
    Raises:
      TypeError: `loss` is neither a `Loss` nor a `LossConfig`.
    """
    if isinstance(loss, Loss):
        return loss
    if isinstance(loss, LossConfig):
        return loss_from_config(loss)
    raise TypeError(f"expected a sfrrl_jax.rl.Loss or LossConfig, got {type(loss).__name__}")
