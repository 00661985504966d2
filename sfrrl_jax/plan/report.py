"""Markdown of a `planner.Plan`: the per-phase peak table, each phase's breakdown, the verdict.

All sizes are per device in GB (1e9 bytes), as `planner` states.
"""
from __future__ import annotations

from sfrrl_jax.plan.abstract import GB


def _gb(x: float) -> str:
    return f"{x / GB:,.2f}" if abs(x) >= 0.01 * GB or x == 0 else f"{x / GB:.2g}"


def plan_markdown(plan) -> str:
    inp, cfg = plan.inputs, plan.config
    m = inp.model_cfg
    mesh = " x ".join(f"{k}={v}" for k, v in plan.shapes["mesh"].items())
    budget = plan.budget
    lines = [
        f"**Model** {m.name} ({m.param_count() / 1e9:.1f}B params, {m.param_dtype} params, "
        f"{m.compute_dtype} compute, remat={m.remat!r}, attention={m.attention_impl!r})"
        + (" - compiled as float16 (same bytes; XLA:CPU widens bf16 arithmetic to f32, a GPU does not: "
           "`PlanConfig.bf16_as_f16`)" if cfg.bf16_as_f16 and "bfloat16" in (m.param_dtype, m.compute_dtype) else "")
        + "  ",
        f"**Mesh** {mesh} ({inp.mesh.size} devices)  ",
        f"**Device memory** {cfg.device_memory_gb:g} GB" + (f" - {cfg.reserve_gb:g} GB reserve" if cfg.reserve_gb else "")
        + f"; **mode** {plan.shapes['mode']}; **micro-batch** {plan.shapes['microbatch'][0]} x "
        f"{plan.shapes['microbatch'][1]:,} tokens; **engine** {plan.shapes['max_slots']} slots x "
        f"{plan.shapes['max_len']:,} tokens, prefill bucket {plan.shapes['prefill_len']:,}, "
        + ("dense KV cache" if plan.shapes["paging"] is None else
           f"paged KV cache (page {plan.shapes['paging'][0]}, {plan.shapes['paging'][1]} pages"
           + _group_fit(plan.shapes.get("paged_groups")) + ")")
        + (" swapped to pinned_host during micro-steps" if plan.shapes.get("swap_cache") else "")
        + f"; **optimizer state** {'pinned_host' if inp.optimizer.offload_state else 'device'}"
        + f", split over {inp.optimizer.state_shard_axis!r}"
        + ("; **gradient sums** pinned_host between micro-steps" if inp.optimizer.offload_accumulator else "")
        + _lora_text(plan.shapes.get("lora"))
        + "  ",
        f"**Compile** {plan.compile_s:.0f} s for {len(plan.phases)} phases (setup {plan.setup_s:.0f} s)"
        + (f"; configs from `{inp.source}`" if inp.source else ""),
        "",
        "| phase | what | peak / device (GB) | fits | compile (s) |",
        "|---|---|---:|---|---:|",
    ]
    for p in plan.phases:
        ok = "yes" if p.peak <= budget else f"**no** (+{_gb(p.peak - budget)})"
        lines.append(f"| {p.name} | {p.what} | {_gb(p.peak)} | {ok} | {p.compile_s:.1f} |")
    lines += ["", f"**Verdict: {'FITS' if plan.fits else 'DOES NOT FIT'}** - highest peak "
              f"{_gb(plan.peak)} GB of {_gb(budget)} GB per device.", "",
              "Between calls, per device (GB): " + ", ".join(f"{k} {_gb(v)}" for k, v in plan.static.items() if v),
              "", "Breakdown per phase (GB per device; XLA temp = activations, saved residuals, "
              "gradients before they are summed into the accumulator, collective buffers):", ""]
    keys = []
    for p in plan.phases:
        for k in p.breakdown():
            if k not in keys:
                keys.append(k)
    lines.append("| item | " + " | ".join(p.name for p in plan.phases) + " |")
    lines.append("|---|" + "---:|" * len(plan.phases))
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(_gb(p.breakdown()[k]) if k in p.breakdown() else "-"
                                          for p in plan.phases) + " |")
    lines.append("| **peak** | " + " | ".join(f"**{_gb(p.peak)}**" for p in plan.phases) + " |")
    return "\n".join(lines) + "\n"


def _group_fit(groups: dict | None) -> str:
    """How many groups of G at max_len the page pool holds, with the prompt's pages shared and not."""
    if not groups:
        return ""
    return (f"; holds {groups['shared']} groups of {groups['group_size']} at max_len with their prompt's pages "
            f"shared, {groups['unshared']} without")


def _lora_text(lora: dict | None) -> str:
    """The LoRA part of the header: what is trained (gradient sums and optimizer state are its size)."""
    if not lora:
        return ""
    return (f"; **LoRA** rank {lora['rank']} on {', '.join(lora['targets'])} ({lora['adapter_params'] / 1e6:.1f}M "
            "trained params; the base frozen)")
