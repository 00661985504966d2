"""Tiny demo (the main job until the RL quickstart lands): build the mesh, init the tiny MoE,
run an expert-parallel forward on 8 fake CPU devices and greedy-decode a few tokens."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import sfrrl_jax as S  # noqa: E402


def main():
    n = len(jax.devices())
    mesh = S.make_mesh(data=max(n // 4, 1), expert=min(n, 4))
    cfg = S.ModelConfig.preset("tiny-moe")
    params = S.init_params(cfg, mesh, seed=0)
    print(f"mesh {dict(mesh.shape)} on {n} {jax.devices()[0].platform} devices; "
          f"{cfg.name}: {S.models.transformer.count_params(params):,} params")
    w = params["layers"]["moe"]["w_gate"]
    print(f"expert weights {w.shape} sharded {w.sharding.spec}: each device holds {w.addressable_shards[0].data.shape}")
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (8, 16)).astype(np.int32)
    t0 = time.perf_counter()
    logits, aux = S.forward(cfg, params, tokens, return_aux=True)
    jax.block_until_ready(logits)
    print(f"forward {tokens.shape} -> logits {logits.shape} in {time.perf_counter() - t0:.2f}s "
          f"(incl. compile); router aux loss {float(aux['router_aux_loss']):.4f}")
    seq = tokens[:2, :4]
    for _ in range(6):  # greedy by re-running the full forward (the KV-cache engine comes later)
        nxt = np.asarray(S.forward(cfg, params, seq))[:, -1].argmax(-1)
        seq = np.concatenate([seq, nxt[:, None].astype(np.int32)], axis=1)
    print("greedy continuation of 2 prompts:", seq[:, 4:].tolist())


if __name__ == "__main__":
    main()
