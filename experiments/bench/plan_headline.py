"""Benchmark (issue #19): the memory plans of the headline configs, written to docs/.

    python experiments/bench/plan_headline.py            # both configs, ~2-4 min on 2 CPU cores

Runs `sfrrl-plan` (a fresh process per config: each needs its own fake device count) on
  experiments/configs/gpt_oss_120b_1m_16xh200.gin     -> docs/plan_gpt_oss_120b_1m.md
  experiments/configs/qwen3_moe_30b_a3b_128k_8xh200.gin -> docs/plan_qwen3_moe_30b_a3b_128k.md
and prepends each report with how it was made and what is missing where a phase does not fit
(`missing`: the largest items of each phase over the budget). The planner compiles a bf16 model
as f16 (same bytes; XLA:CPU widens bf16 arithmetic to f32, a GPU does not); each report also
gives the peaks of a second plan with `--keep_bf16` (what XLA:CPU itself would allocate), so the
difference the stand-in makes is on the page. A third plan trains a LoRA adapter instead of
every weight (`ExperimentConfig.lora`, `LORA` below: rank 16 on the attention projections and the
experts' stacks, the base frozen), its peaks and state beside the full run's. Not in CI (compiles
120B-param step functions); tests/plan runs the planner on a small config.
"""
import json
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = [
    ("gpt_oss_120b_1m_16xh200.gin", "plan_gpt_oss_120b_1m.md", "gpt-oss-120b, 1M-token context, 16 x H200"),
    ("qwen3_moe_30b_a3b_128k_8xh200.gin", "plan_qwen3_moe_30b_a3b_128k.md", "Qwen3-30B-A3B, 128k context, 8 x H200"),
]
COMMAND = "python experiments/bench/plan_headline.py"
# The LoRA plan: what a researcher fitting RL of these models on fewer devices would start from.
LORA = ["--gin_param=ExperimentConfig.lora = @LoraConfig()", "--gin_param=LoraConfig.rank = 16",
        "--gin_param=LoraConfig.alpha = 32.0",
        "--gin_param=LoraConfig.targets = ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'experts.gate_proj', "
        "'experts.up_proj', 'experts.down_proj']"]


def missing(plan: dict) -> list[str]:
    out = []
    for ph in plan["phases"]:
        over = ph["peak_gb"] - plan["budget_gb"]
        if over <= 0:
            continue
        top = sorted(ph["breakdown_gb"].items(), key=lambda kv: -kv[1])[:3]
        out.append(f"- **{ph['name']}** is {over:,.1f} GB over; its largest items: "
                   + ", ".join(f"{k} {v:,.1f} GB" for k, v in top))
    return out


def run_plan(gin: str, out_json: pathlib.Path, *extra: str):
    """`sfrrl-plan` on a config in a fresh process: (its stdout, the plan's JSON), or None after
    printing its error (exit status 1 only says a phase does not fit)."""
    proc = subprocess.run([sys.executable, "-m", "sfrrl_jax.launch.plan_cli", f"--gin_file=experiments/configs/{gin}",
                           *extra, f"--json={out_json}"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        print(proc.stderr[-3000:], file=sys.stderr)
        return None
    return proc.stdout, json.loads(out_json.read_text())


def lora_section(plan: dict, lora_plan: dict, lora_stdout: str, names: list[str]) -> list[str]:
    """The LoRA plan beside the full one: peaks per phase and the state held between calls."""
    lora_peaks = {ph["name"]: ph["peak_gb"] for ph in lora_plan["phases"]}
    spec = lora_plan["shapes"]["lora"]
    keys = [k for k in plan["static_gb"] if plan["static_gb"][k] or lora_plan["static_gb"].get(k)]
    return ["", "## The same run training a LoRA adapter (`ExperimentConfig.lora`)", "",
            f"Rank {spec['rank']} on {', '.join(spec['targets'])}: {spec['adapter_params'] / 1e6:,.1f}M trained "
            "params, the base frozen (no gradient sums or optimizer moments for it; `models.lora`). "
            "Options: " + " ".join(f"`{a}`" for a in LORA) + ". Peak per phase (GB per device):", "",
            "| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names),
            "| every weight trained | " + " | ".join(f"{ph['peak_gb']:,.2f}" for ph in plan["phases"]) + " |",
            "| LoRA | " + " | ".join(f"{lora_peaks[n]:,.2f}" if n in lora_peaks else "-" for n in names) + " |",
            "", "Held between calls (GB per device):", "",
            "| | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys),
            "| every weight trained | " + " | ".join(f"{plan['static_gb'][k]:,.2f}" for k in keys) + " |",
            "| LoRA | " + " | ".join(f"{lora_plan['static_gb'].get(k, 0.0):,.2f}" for k in keys) + " |",
            "", f"Verdict with LoRA: **{'FITS' if lora_plan['fits'] else 'DOES NOT FIT'}**, highest peak "
            f"{lora_plan['peak_gb']:,.1f} GB of {lora_plan['budget_gb']:,.1f} GB."]


def main() -> int:
    for gin, doc, title in CONFIGS:
        out_json = ROOT / "bench_out" / (doc[:-3] + ".json")
        out_json.parent.mkdir(exist_ok=True)
        t0 = time.perf_counter()
        planned = run_plan(gin, out_json)
        wall = time.perf_counter() - t0
        cpu = run_plan(gin, out_json.with_name(out_json.stem + "_keep_bf16.json"), "--keep_bf16")
        lora = run_plan(gin, out_json.with_name(out_json.stem + "_lora.json"), *LORA)
        if planned is None or cpu is None or lora is None:
            return 2
        (stdout, plan), (_, cpu_plan), (lora_stdout, lora_plan) = planned, cpu, lora
        report = stdout[stdout.index("**Model**"):]
        head = [f"# Memory plan: {title}", "",
                f"Generated by `{COMMAND}` (this file is its output; {wall:.0f} s wall on a 2-core CPU, "
                f"{plan['compile_s']:.0f} s of it compiling). The config is "
                f"`experiments/configs/{gin}`; the planner is `sfrrl-plan` (`sfrrl_jax/plan`): the run's real "
                "step functions compiled by XLA:CPU for the run's mesh over fake devices, with abstract "
                "inputs (nothing allocated), per-device memory from `compiled.memory_analysis()` plus what "
                "lives between calls. Sizes are per device, GB = 1e9 bytes.", ""]
        gaps = missing(plan)
        if gaps:
            head += ["## What is missing", "", *gaps, "", "See `docs/plan_findings.md` for why and what "
                     "would make it fit.", ""]
        names = [ph["name"] for ph in plan["phases"]]
        cpu_peaks = {ph["name"]: ph["peak_gb"] for ph in cpu_plan["phases"]}
        tail = ["", "## The same plan as XLA:CPU compiles bf16 (`--keep_bf16`)", "",
                "XLA:CPU has no bf16 arithmetic: it widens bf16 dots, scatters and dynamic-update-slices to "
                "f32, and hoists whole f32 copies of weight stacks, KV cache and saved activations out of the "
                "layer loops; a GPU computes in bf16. The plan above compiles bf16 as f16 (same bytes, native "
                "on XLA:CPU); these are the peaks without that stand-in (GB per device):", "",
                "| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names),
                "| bf16 as f16 (the plan) | " + " | ".join(f"{ph['peak_gb']:,.2f}" for ph in plan["phases"]) + " |",
                "| bf16 as XLA:CPU compiles it | " + " | ".join(f"{cpu_peaks[n]:,.2f}" for n in names) + " |"]
        tail += lora_section(plan, lora_plan, lora_stdout, names)
        (ROOT / "docs" / doc).write_text("\n".join(head) + "\n## Plan\n\n" + report + "\n".join(tail) + "\n")
        print(f"{doc}: {'fits' if plan['fits'] else 'does not fit'}, peak {plan['peak_gb']:,.1f} GB, "
              f"compile {plan['compile_s']:.0f} s, wall {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
