"""Configuration of the RL trainer (bound by gin at the experiment edge)."""
from __future__ import annotations

import dataclasses
from typing import Literal

from sfrrl_jax.checks import check_bool_fields, check_int, check_int_fields, check_seed
from sfrrl_jax.config import PagedAttention
from sfrrl_jax.rl.config import AdvantageConfig

Mode = Literal["sync", "pipelined", "one_step_off"]
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
# estimators whose baseline is the sample's own group: a group of one sample has advantage 0
GROUP_RELATIVE_ESTIMATORS = GROUP_ESTIMATORS + ("reinforce_pp_baseline",)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """One RL step = `groups_per_step` prompts x `group_size` samples, one optimizer update.

    mode: 'sync' (roll out everything, then train), 'pipelined' (train finished groups while the
      engine would idle; one update per step; on-policy), 'one_step_off' (train step k-1's batch
      during step k's rollout: off-policy by one update; use TIS in the loss).
    max_slots / max_len / decode_steps / buckets / decode_buckets: the engine (slots decode
      together; max_slots None (the default): one per sample the step launches at first,
      `engine_slots`, so a step decodes all its samples together rather than in waves; the
      trainer lowers it to what the KV-cache budget holds and warns, naming the figures; max_len bounds prompt + all turns; decode_steps tokens per device call; buckets:
      prompt lengths prefill pads to; decode_buckets: cache lengths a decode chunk may read,
      None = max_len / 8, / 4, / 2, max_len, none below 128).
    page_size / num_pages: page the engine's KV cache (`Engine(page_size=, num_pages=)`): None
      (the default) reserves max_slots x max_len tokens; a page size makes slots take pages as
      they grow, from `num_pages` shared pages (None: as many tokens as the dense cache).
    prefix_cache_pages: a paged cache's prefix cache across requests (`Engine(prefix_cache_pages=)`;
      0, the default: off): a later prompt, or a trajectory restored after eviction, maps the
      cached pages of its leading tokens (a system prompt, tool schemas) instead of computing
      them; at most this many pages nobody holds are kept. Forgotten at every weight update.
      Exact to float rounding only (the rest of a prompt reads the cached keys), hence off. A
      group's samples share their prompt's pages either way.
    paged_attention: how a paged cache's decode attends (`Engine(paged_attention=)`): 'auto' (the
      paged kernel on a GPU where page_size and head_dim are powers of two, else 'gather'),
      'gather' (a slot's pages copied into a contiguous view) or 'pallas' (the kernel; on CPU it
      runs in Pallas interpret mode, slowly).
    swap_cache: 'pipelined' / 'one_step_off': the engine's KV cache waits in pinned host memory
      while a micro-step runs during the rollout, so the micro-step has its device memory
      (`Engine(swap_cache=True)`; two host transfers of the cache per micro-step). What a long
      context needs when cache and training do not fit together (docs/plan_gpt_oss_120b_1m.md).
      'sync' frees the cache before it trains, so there it is refused.
    underfull_slots: in pipelined mode, a gradient micro-step runs before a decode chunk when at
      most this many slots are decoding (0 = only when none is); decode keeps priority above it.
    longest_first: start groups longest expected first: a prompt's expected duration is its
      earlier groups' slowest sample (tool seconds + tokens at the engine's pace), unseen prompts
      first (`trainer.scheduling`). Matters when the batch exceeds the slots (a queue forms).
    overprovision_groups: launch this many extra groups and keep the first `groups_per_step` that
      finish (the rest are cancelled; biases towards short trajectories).
    dynamic_sampling: drop groups whose rewards are all equal and launch replacements, at most
      `max_refill_groups` per step.
    groups_per_microbatch: finished groups per gradient micro-step.
    microbatch_rows: split each micro-batch into micro-steps of at most this many rows (0 = off):
      finer work units leave a returning tool less to wait for (micro-steps are not preempted).
      With `pack_rows` a row may hold several trajectories, so a row is a token budget of the
      row's width rather than one sample.
    seq_bucket: micro-batch widths are multiples of this (capped at max_len): the micro-step
      compiles once per [rows, width] shape, and the widths bound how many there are.
    pack_rows: several trajectories share a micro-batch row (packed: segment ids 1, 2, ... along
      the row, positions restarting per trajectory; `trainer.batching.pack_rows`), which leaves
      far less of the computed positions to padding (`train/padding_share`) for the same loss and
      gradient. False: one trajectory per row, right-padded to the longest (the former layout,
      kept for comparisons). Early samples (`early_groups`) train one-row micro-steps either way.
    early_groups: pipelined: once at most this many groups of the step are unfinished (the
      rollout's tail), their finished samples train before the group finishes (advantage-deferred
      gradients, `learner.deferred`; needs a loss linear in the advantages: `Loss.linear_in_advantages`,
      for the built-in policy loss behavior='current'), so a straggler holds back
      only itself. Each such group holds two or three param-sized float32 buffers until it
      finishes. 0 = train whole groups only.
    skip_zero_advantage_backward: a trajectory whose advantage is exactly 0 (every sample of a
      group whose rewards were all equal, under GRPO) adds exactly nothing to the gradient when
      the train step's loss declares `Loss.zero_advantage_zero_gradient` (the built-in policy loss
      with kl_coef and entropy_coef 0) and the router loss coefficients are 0: such trajectories
      are packed apart into micro-steps of their own that run forward only
      (`TrainStep.stats_microstep`: their loss, token counts and metrics still accumulate;
      `train/forward_only_microsteps` counts them). The update is the same up to float summation
      order (a micro-step holds other rows); `train/num_microbatches` counts the micro-steps run.
      Used only where the loss allows it, on one process (a multi-process step keeps every
      micro-step a gradient one), never for early samples or the micro-step that merges their
      buffers. False: today's micro-steps, exactly.
    max_nonfinite_steps: this many updates in a row skipped as non-finite (nan/inf loss or
      gradient norm) end the run with `trainer.health.TrainingDivergedError` (0 = never).
    warn_no_signal_steps: warn after this many steps in a row in which every kept group's rewards
      were all equal (no advantage, nothing learned), and every that many steps after (0 = never).
    With a group-relative advantage (grpo, dr_grpo, rloo, reinforce_pp_baseline) `group_size`
    must be >= 2: a group of one has advantage 0 and trains nothing.
    """

    mode: Mode = "pipelined"
    groups_per_step: int = 4
    group_size: int = 4
    max_slots: int | None = None
    max_len: int = 256
    decode_steps: int = 1
    buckets: tuple[int, ...] | None = None
    decode_buckets: tuple[int, ...] | None = None
    page_size: int | None = None
    num_pages: int | None = None
    prefix_cache_pages: int = 0
    paged_attention: PagedAttention = "auto"
    swap_cache: bool = False
    underfull_slots: int = 0
    longest_first: bool = True
    overprovision_groups: int = 0
    dynamic_sampling: bool = False
    max_refill_groups: int = 8
    groups_per_microbatch: int = 1
    microbatch_rows: int = 0
    early_groups: int = 0
    seq_bucket: int = 32
    pack_rows: bool = True
    skip_zero_advantage_backward: bool = True
    advantage: AdvantageConfig = AdvantageConfig()
    seed: int = 0
    max_nonfinite_steps: int = 3
    warn_no_signal_steps: int = 5

    def __post_init__(self):
        own = "TrainerConfig"
        if self.mode not in Mode.__args__:
            raise ValueError(f"{own}.mode={self.mode!r}; valid: {list(Mode.__args__)}")
        check_int(f"{own}.max_slots", self.max_slots, 1, optional=True)
        check_int_fields(self, ("groups_per_step", "group_size", "max_len", "decode_steps",
                                "groups_per_microbatch", "seq_bucket"), 1)
        check_int_fields(self, ("underfull_slots", "overprovision_groups", "max_refill_groups",
                                "microbatch_rows", "early_groups", "max_nonfinite_steps",
                                "warn_no_signal_steps"), 0)
        check_bool_fields(self, ("longest_first", "dynamic_sampling", "swap_cache", "pack_rows",
                                 "skip_zero_advantage_backward"))
        if self.swap_cache and self.mode == "sync":
            raise ValueError(f"{own}.swap_cache=True moves the KV cache out while micro-steps run during the "
                             "rollout; mode='sync' trains after it, with the cache freed: nothing to swap")
        for k in ("page_size", "num_pages"):
            check_int(f"{own}.{k}", getattr(self, k), 1, optional=True)
        check_int(f"{own}.prefix_cache_pages", self.prefix_cache_pages, 0)
        if self.prefix_cache_pages and self.page_size is None:
            raise ValueError(f"{own}.prefix_cache_pages={self.prefix_cache_pages} keeps pages of a paged cache: "
                             f"set {own}.page_size")
        if self.paged_attention not in PagedAttention.__args__:
            raise ValueError(f"{own}.paged_attention={self.paged_attention!r}; valid: {list(PagedAttention.__args__)}")
        if self.paged_attention == "pallas" and self.page_size is None:
            raise ValueError(f"{own}.paged_attention='pallas' reads a paged cache: set {own}.page_size")
        check_seed(f"{own}.seed", self.seed)
        for name in ("buckets", "decode_buckets"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (tuple, list)) or not value:
                raise ValueError(f"{own}.{name} must be None or a non-empty tuple of ints, got {value!r}")
            for i, b in enumerate(value):
                check_int(f"{own}.{name}[{i}]", b, 1, self.max_len if name == "decode_buckets" else None)
            object.__setattr__(self, name, tuple(value))  # hashable: a static jit argument
        if not isinstance(self.advantage, AdvantageConfig):
            raise ValueError(f"{own}.advantage must be an AdvantageConfig, got {type(self.advantage).__name__}")
        if self.group_size == 1 and self.advantage.estimator in GROUP_RELATIVE_ESTIMATORS:
            raise ValueError(
                f"{own}.group_size=1 with advantage.estimator={self.advantage.estimator!r}: a group-relative "
                f"advantage compares a sample with the other samples of its prompt, so a group of one has "
                f"advantage 0 and nothing would ever train. Use group_size >= 2, or a batch baseline: "
                f"advantage.estimator='reinforce_pp' with mode='sync'")
        if self.groups_per_step % self.groups_per_microbatch:
            raise ValueError(
                f"{own}.groups_per_step={self.groups_per_step} is not divisible into micro-batches "
                f"of groups_per_microbatch={self.groups_per_microbatch}")
        if self.early_groups and self.mode != "pipelined":
            raise ValueError(f"{own}.early_groups={self.early_groups} trains samples while their group "
                             f"is still rolling out, which only mode='pipelined' does; got mode={self.mode!r}")
        if self.mode != "sync" and self.advantage.estimator not in GROUP_ESTIMATORS:
            raise ValueError(
                f"{own}.mode={self.mode!r} trains a group as soon as it finishes, so its advantages "
                f"must be final then: advantage.estimator={self.advantage.estimator!r} normalises over "
                f"the whole batch; use one of {list(GROUP_ESTIMATORS)} or mode='sync'")

    @property
    def batch_size(self) -> int:
        return self.groups_per_step * self.group_size

    @property
    def engine_slots(self) -> int:
        """The engine's slots: `max_slots`, or where it is None every sample the step launches at
        first, (groups_per_step + overprovision_groups) x group_size (before the trainer fits it
        to the KV-cache budget)."""
        if self.max_slots is not None:
            return self.max_slots
        return (self.groups_per_step + self.overprovision_groups) * self.group_size

    @property
    def failed_groups_limit(self) -> int:
        """More groups than this whose rollout function raised, in one step, stop the step: one
        that keeps raising is a bug to see, not to refill forever. It is as many groups as the step
        launches at first (groups_per_step + overprovision_groups), so that failures at a steady
        rate (a flaky sandbox) do not end a run that over-provisions to absorb them."""
        return self.groups_per_step + self.overprovision_groups
