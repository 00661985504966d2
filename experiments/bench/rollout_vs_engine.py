"""Benchmark: the agent loop's generated tok/s against the engine's own decode, same model, same batch.

    python experiments/bench/rollout_vs_engine.py --hf_dir /tmp/smollm2_hf [--shapes 2x4 8x8]
        [--repeats 3] [--profile] [--out bench_out/rollout_vs_engine.json]

Issue #44 point 2 ("rollout at engine speed"). On one model (an HF directory, fp32, a 1-device
mesh) and one batch shape (P prompts x G samples), warm (one untimed round of every side first):

  agent   the trainer's rollout as `RLTrainer` runs it: `AgentRollout` (the agent loop,
          `agents.run_agent`) over reasoning-gym chain_sum items with `qa_environment` (the
          scorer + answer-format reward, as `experiments/smollm2.py`), <= `--new` tokens, T 1.0,
          one `call_rollout` per sample, the G samples of a prompt gathered as the step
          schedule's `run_group` does, every group at once; the engine built as `RLTrainer`
          builds it from `TrainerConfig()`'s defaults (decode_steps, buckets, decode_buckets,
          max_len), except max_slots = P x G (a trainer default of 8 would make 64 samples 8
          waves, not the same batch; `--trainer_slots` keeps a default that is a number).
  engine  the same prompts (the agent's prompt tokens) straight into `Engine.complete` with the
          same per-sample token counts (max_new_tokens = what the agent generated for that
          sample in the same round, no stop ids, T 1.0): the same decode work without the loop,
          on an engine built as the agent's.
  decode  that engine's decode chunks alone: tokens over the seconds of its decode device calls
          (its trace's 'decode' spans): the engine's own decode at this batch and these lengths,
          what the rollout would reach with no prefill and no host time between device calls.
          The headline ratio, agent / decode (issue #44.2: goal >= 0.8).
  generate the same work on an engine built as `S.generate` builds one (a slot per prompt, its
          default decode_steps 4).

`--follow_ups K` makes each trajectory K + 1 turns: after each answer the user asks to check it
(`FollowUps`), a delta appended to the trajectory's parked slot as a tool result would be
(SmolLM2's template renders no tools); the engine side replays the same feeds and counts.

Each round runs agent, engine, generate in turn (alternating reduces the bias of a shared
machine); per side the table shows the fastest of `--repeats` rounds. tok/s is generated tokens
over wall seconds of the whole batch (prefill included, except in `decode`). Ratios are the
agent's tok/s over the other side's within one round, median over rounds: compare those, not
tok/s across runs, on a loaded machine. Rounds draw the same tokens run after run (seeds are
per task, sample and visit). `--profile` adds, per shape, one more agent round with the engine's
device spans (prefill / decode) and counters and a cProfile of the event-loop thread: the
wall's shares (prefill, decode, host gaps), prompts admitted vs prefill rows computed, slot
occupancy, and the top host functions.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import io
import json
import os
import pathlib
import pstats
import time

import jax
import numpy as np

import sfrrl_jax as S
from sfrrl_jax.agents import AgentConfig, answer_correct, answer_format
from sfrrl_jax.agents.tasks.environments import qa_environment
from sfrrl_jax.agents.protocols import GenerationRequest
from sfrrl_jax.agents.tasks.loading import load_tasks
from sfrrl_jax.aio import run_sync
from sfrrl_jax.checkpoints.hf import load_hf
from sfrrl_jax.engine import Engine
from sfrrl_jax.tokenizer import load_tokenizer
from sfrrl_jax.trainer.agent_rollout import AgentRollout
from sfrrl_jax.trainer.config import TrainerConfig
from sfrrl_jax.trainer.rollout_fn import call_rollout

GENERATE_DECODE_STEPS = 4   # S.generate's default


class Spans:
    """An engine trace sink (`Engine.set_trace`): device spans by name."""

    def __init__(self):
        self.spans: list[tuple[str, float, float]] = []

    def add(self, name, lane, t0, t1):
        self.spans.append((name, t0, t1))

    def summary(self, wall: float) -> dict:
        out = {"wall_s": wall, "device_s": sum(t1 - t0 for _, t0, t1 in self.spans)}
        for name in sorted({n for n, _, _ in self.spans}):
            ts = [t1 - t0 for n, t0, t1 in self.spans if n == name]
            out[f"{name}_spans"] = len(ts)   # prefill: admissions (prefills and appends), decode: chunks
            out[f"{name}_s"] = sum(ts)
        out["device_share"] = out["device_s"] / wall
        return out


def trainer_engine(cfg, params, tc: TrainerConfig, slots: int) -> Engine:
    """The engine `RLTrainer` builds from `tc` (one process, no routing replay), `slots` slots."""
    return Engine(cfg, params, max_slots=slots, max_len=tc.max_len, buckets=tc.buckets,
                  decode_steps=tc.decode_steps, decode_buckets=tc.decode_buckets, page_size=tc.page_size,
                  num_pages=tc.num_pages, paged_attention=tc.paged_attention, swap_cache=tc.swap_cache)


def generate_engine(cfg, params, slots: int, longest_prompt: int, new: int) -> Engine:
    """The engine `S.generate` builds for `slots` prompts (one slot each, its max_len rule)."""
    max_len = min(cfg.max_seq_len, 1 << (longest_prompt + new).bit_length())
    return Engine(cfg, params, max_slots=slots, max_len=max_len, decode_steps=GENERATE_DECODE_STEPS)


async def agent_round(engine: Engine, rollout: AgentRollout, tasks, group_size: int):
    """Every group at once, each group's samples gathered (`step_schedule.RLStep.run_group`)."""
    async def group(task):
        return await asyncio.gather(*(call_rollout(rollout, engine, task, s) for s in range(group_size)))
    groups = await asyncio.gather(*(group(t) for t in tasks))
    return [t for g in groups for t in g]


FOLLOW_UP = "Check your answer once more, then give the final answer as <answer>...</answer>."


class FollowUps:
    """`qa_environment` with `k` user follow-ups: each answer is followed by FOLLOW_UP as the
    next user turn (appended to the trajectory's parked slot, as a tool result would be), so a
    trajectory has k + 1 turns (SmolLM2's template renders no tools: this is its multi-turn)."""

    def __init__(self, env, k: int):
        self.env, self.k = env, k

    def tool_schemas(self):
        return self.env.tool_schemas()

    def reset(self, task):
        return self.env.reset(task)

    async def step(self, calls):
        return await self.env.step(calls)

    def reward(self, task, traj):
        return self.env.reward(task, traj)

    def open_episode(self, task):
        env, left = self, [self.k]

        class Episode:
            def reset(self):
                return env.reset(task)

            async def step(self, calls):
                return await env.step(calls)

            def next_user_turn(self):
                if not left[0]:
                    return None
                left[0] -= 1
                return [{"role": "user", "content": FOLLOW_UP}]

            def close(self):
                pass
        return Episode()


def scripts_of(trajs) -> list[list[tuple[list[int], int]]]:
    """Per trajectory, what it fed the engine and how many tokens it got back, turn by turn: the
    prompt then each observation (a follow-up's delta), with the turn's generated count."""
    out = []
    for t in trajs:
        fed, script = t.tokens[:t.prompt_len], []
        for turn in t.turns:
            script.append((fed, turn.gen_end - turn.gen_start))
            fed = t.tokens[turn.gen_end:turn.obs_end]
        out.append(script)
    return out


async def engine_round(engine: Engine, scripts, seed: int):
    """Each script's turns through `Engine.complete` (the first a prompt, the rest appended to its
    parked slot), exactly its token counts, every script at once; its slot released at the end."""
    async def one(i, script):
        handle, total = None, 0
        for turn, (fed, n) in enumerate(script):
            c = await engine.complete(GenerationRequest(tokens=list(fed), max_new_tokens=n, temperature=1.0,
                                                        seed=seed + 100 * i + turn, slot_handle=handle))
            assert len(c.tokens) == n, (len(c.tokens), n)
            handle, total = c.slot_handle, total + n
        await engine.release(handle)
        return total
    return sum(await asyncio.gather(*(one(i, s) for i, s in enumerate(scripts))))


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def compile_total(engine: Engine) -> int:
    return sum(engine.steps.compile_counts().values())


def run_shape(cfg, params, tokenizer, tasks, n_prompts, group, args, tc):
    batch = n_prompts * group
    agent_cfg = AgentConfig(max_turns=1 + args.follow_ups, max_new_tokens_per_turn=args.new,
                            max_total_tokens=tc.max_len, temperature=1.0, tool_format="compact")
    env = qa_environment(reward_fns=[answer_correct, answer_format], reward_weights=[1.0, 0.2])
    if args.follow_ups:
        env = FollowUps(env, args.follow_ups)
    rollout = AgentRollout(env, tokenizer, agent_cfg)
    chosen = tasks[:n_prompts]
    # TrainerConfig.max_slots None (where the trainer takes one slot per sample it launches) is
    # this bench's default: one per sample
    slots = tc.max_slots if args.trainer_slots and tc.max_slots is not None else batch
    eng_agent = trainer_engine(cfg, params, tc, slots)
    eng_same = trainer_engine(cfg, params, tc, slots)
    rounds = []
    gen_engines: dict[int, Engine] = {}
    for r in range(args.repeats + 1):   # round 0 warms (compiles) every side
        agent_s, trajs = timed(lambda: run_sync(agent_round(eng_agent, rollout, chosen, group)))
        failed = [t.error for t in trajs if t.error]
        if failed:
            raise RuntimeError(f"failed samples: {failed[:3]}")
        scripts = scripts_of(trajs)
        longest = max(len(t.tokens) for t in trajs)
        key = min(cfg.max_seq_len, 1 << (longest + args.new).bit_length())
        if key not in gen_engines:
            gen_engines[key] = generate_engine(cfg, params, batch, longest, args.new)
        eng_gen = gen_engines[key]
        c0 = (compile_total(eng_agent), compile_total(eng_same), compile_total(eng_gen))
        if r == 0:   # the engines' own compiles for these lengths, untimed
            run_sync(engine_round(eng_same, scripts, seed=1000))
            run_sync(engine_round(eng_gen, scripts, seed=1000))
            c0 = (compile_total(eng_agent), compile_total(eng_same), compile_total(eng_gen))
        spans = Spans()
        eng_same.set_trace(spans)
        same_s, tokens = timed(lambda: run_sync(engine_round(eng_same, scripts, seed=1000 * r)))
        eng_same.set_trace(None)
        decode_s = sum(t1 - t0 for name, t0, t1 in spans.spans if name == "decode")
        gen_s, _ = timed(lambda: run_sync(engine_round(eng_gen, scripts, seed=1000 * r)))
        c1 = (compile_total(eng_agent), compile_total(eng_same), compile_total(eng_gen))
        assert tokens == sum(t.num_generated for t in trajs)
        rounds.append({"round": r, "tokens": tokens, "agent_s": agent_s, "engine_same_s": same_s,
                       "engine_generate_s": gen_s, "engine_decode_s": decode_s, "agent_tok_s": tokens / agent_s,
                       "engine_same_tok_s": tokens / same_s, "engine_generate_tok_s": tokens / gen_s,
                       "engine_decode_tok_s": tokens / decode_s, "ratio_vs_decode": decode_s / agent_s,
                       "ratio_vs_generate": gen_s / agent_s, "ratio_vs_same": same_s / agent_s,
                       "compiles_during_engine_rounds": [b - a for a, b in zip(c0, c1)]})
        print(f"  {n_prompts}x{group} round {r}{' (warm-up)' if r == 0 else ''}: {tokens} tokens; agent "
              f"{tokens / agent_s:6.1f} tok/s, engine(trainer cfg) {tokens / same_s:6.1f} (its decode alone "
              f"{tokens / decode_s:6.1f}), engine(generate) {tokens / gen_s:6.1f}", flush=True)
    timed_rounds = rounds[1:]
    best = lambda k: min(x[k] for x in timed_rounds)
    row = {"prompts": n_prompts, "group": group, "batch": batch, "slots": slots,
           "decode_steps": tc.decode_steps, "buckets": tc.buckets, "max_len": tc.max_len,
           "agent_tok_s": max(x["agent_tok_s"] for x in timed_rounds),
           "engine_same_tok_s": max(x["engine_same_tok_s"] for x in timed_rounds),
           "engine_generate_tok_s": max(x["engine_generate_tok_s"] for x in timed_rounds),
           "engine_decode_tok_s": max(x["engine_decode_tok_s"] for x in timed_rounds),
           "median_ratio_vs_decode": float(np.median([x["ratio_vs_decode"] for x in timed_rounds])),
           "median_ratio_vs_generate": float(np.median([x["ratio_vs_generate"] for x in timed_rounds])),
           "median_ratio_vs_same": float(np.median([x["ratio_vs_same"] for x in timed_rounds])),
           "best_s": {k: best(k) for k in ("agent_s", "engine_same_s", "engine_generate_s")},
           "rounds": rounds}
    if args.profile:
        row["profile"] = profile_agent(eng_agent, rollout, chosen, group)
        row["profile_engine_same"] = profile_engine(eng_same, scripts)
    return row


def stats_delta(engine, before) -> dict:
    """What the engine's counters moved by since `before` (a copy of `engine.stats`)."""
    s = engine.stats
    out = {k: getattr(s, k) - getattr(before, k) for k in
           ("prefills", "appends", "decode_steps", "slot_steps_active", "slot_steps_total")}
    for k in ("prefill_calls", "prefill_rows", "append_calls"):   # counters this bench's issue added
        if hasattr(s, k):
            out[k] = getattr(s, k) - getattr(before, k)
    out["slot_occupancy"] = out["slot_steps_active"] / max(out["slot_steps_total"], 1)
    return out


def profile_agent(engine, rollout, tasks, group) -> dict:
    spans = Spans()
    engine.set_trace(spans)
    before = dataclasses.replace(engine.stats)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    run_sync(agent_round(engine, rollout, tasks, group))
    prof.disable()
    wall = time.perf_counter() - t0
    engine.set_trace(None)
    out = spans.summary(wall)
    out.update(stats_delta(engine, before))
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    out["loop_thread_top_tottime"] = s.getvalue()
    return out


def profile_engine(engine, scripts) -> dict:
    spans = Spans()
    engine.set_trace(spans)
    before = dataclasses.replace(engine.stats)
    wall, _ = timed(lambda: run_sync(engine_round(engine, scripts, seed=7)))
    engine.set_trace(None)
    return {**spans.summary(wall), **stats_delta(engine, before)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf_dir", default="/tmp/smollm2_hf")
    ap.add_argument("--shapes", nargs="+", default=["2x4", "8x8"], help="PROMPTSxSAMPLES")
    ap.add_argument("--new", type=int, default=48, help="max new tokens per sample (experiments/smollm2.py's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trainer_slots", action="store_true",
                    help="keep TrainerConfig's default max_slots (else: one slot per sample)")
    ap.add_argument("--decode_steps", type=int, default=None, help="override TrainerConfig().decode_steps")
    ap.add_argument("--follow_ups", type=int, default=0,
                    help="user follow-up turns per trajectory (multi-turn: each one an append to the parked slot)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="bench_out/rollout_vs_engine.json")
    args = ap.parse_args()
    mesh = S.make_mesh(devices=jax.devices()[:1])
    cfg, params = load_hf(args.hf_dir, mesh, dtype="float32")
    tokenizer = load_tokenizer(args.hf_dir)
    tasks = load_tasks("reasoning-gym:chain_sum", size=64, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    tc = TrainerConfig()
    if args.decode_steps is not None:
        tc = dataclasses.replace(tc, decode_steps=args.decode_steps)
    print(f"model {cfg.name}; TrainerConfig defaults: max_slots {tc.max_slots}, max_len {tc.max_len}, "
          f"decode_steps {tc.decode_steps}, buckets {tc.buckets}, decode_buckets {tc.decode_buckets}; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for shape in args.shapes:
        p, g = (int(x) for x in shape.split("x"))
        rows.append(run_shape(cfg, params, tokenizer, tasks, p, g, args, tc))
    print(f"\n{'shape':>6s} {'slots':>5s} {'agent':>7s} {'engine':>7s} {'decode':>7s} {'generate':>8s} "
          f"{'agent/decode':>12s} {'agent/engine':>12s} {'agent/generate':>14s}")
    for r in rows:
        print(f"{r['prompts']}x{r['group']:<4d} {r['slots']:5d} {r['agent_tok_s']:7.1f} {r['engine_same_tok_s']:7.1f} "
              f"{r['engine_decode_tok_s']:7.1f} {r['engine_generate_tok_s']:8.1f} {r['median_ratio_vs_decode']:12.2f} "
              f"{r['median_ratio_vs_same']:12.2f} {r['median_ratio_vs_generate']:14.2f}")
    print("generated tok/s, best round per side. agent: the trainer's rollout (AgentRollout, TrainerConfig's engine);"
          "\nengine: Engine.complete of the same prompts and token counts, the same engine settings; decode: its "
          "decode\nchunks alone (tokens / decode seconds: the engine's own decode at this batch and these lengths); "
          "generate:\nthe same work on an engine built as S.generate builds one. Ratios: median over rounds of "
          "agent / side\nwithin a round (agent/decode is the issue's 'rollout at engine speed' ratio, goal >= 0.8).")
    for r in rows:
        if "profile" in r:
            pr, pe = r["profile"], r["profile_engine_same"]
            print(f"\nprofile {r['prompts']}x{r['group']}: agent wall {pr['wall_s']:.2f} s, device busy "
                  f"{pr['device_share']:.0%} (admissions {pr.get('prefill_spans', 0)}, "
                  f"{pr.get('prefill_s', 0):.2f} s, decode {pr.get('decode_spans', 0)} chunks {pr.get('decode_s', 0):.2f} s)"
                  f"; engine alone wall {pe['wall_s']:.2f} s, busy {pe['device_share']:.0%} (admissions "
                  f"{pe.get('prefill_spans', 0)}, {pe.get('prefill_s', 0):.2f} s, decode {pe.get('decode_spans', 0)} "
                  f"chunks {pe.get('decode_s', 0):.2f} s)")
            print(f"  agent: {pr['prefills']} prompts admitted, prefill rows computed "
                  f"{pr.get('prefill_rows', 'n/a')}, {pr['appends']} appends ({pr.get('append_calls', 'n/a')} "
                  f"calls), {pr.get('prefill_calls', 'n/a')} prefill calls; {pr['decode_steps']} decode steps, slot occupancy "
                  f"{pr['slot_occupancy']:.0%}; prefill {pr.get('prefill_s', 0) / pr['wall_s']:.0%} of the wall, "
                  f"decode {pr.get('decode_s', 0) / pr['wall_s']:.0%}, host gaps {1 - pr['device_share']:.0%}")
            print(pr["loop_thread_top_tottime"])
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "model": cfg.name, "cpu_count": os.cpu_count(),
                               "load_avg": os.getloadavg(),
                               "trainer_cfg": {k: getattr(tc, k) for k in ("max_slots", "max_len", "decode_steps",
                                                                           "buckets", "decode_buckets")},
                               "rows": rows}, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
