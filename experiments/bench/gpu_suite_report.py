"""The GPU suite's report: its results (the dict `gpu_suite.main` returns and writes as JSON)
printed as one table a section, then the goals. `experiments/bench/gpu_suite.py` imports it; the
columns are described in that script's docstring."""


def fmt(v, spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return format(v, spec)


def print_table(title: str, rows: list[dict], columns) -> None:
    """columns: (header, key or function of the row, format spec)."""
    print(f"\n{title}")
    cells = [[fmt(c(r) if callable(c) else r.get(c), f) for _, c, f in columns] for r in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, (h, _, _) in enumerate(columns)]
    print("  ".join(h.rjust(wd) for (h, _, _), wd in zip(columns, widths)))
    for row in cells:
        print("  ".join(c.rjust(wd) for c, wd in zip(row, widths)))


def pct(key):
    return lambda r: None if r.get(key) is None else 100 * r[key]


def print_results(res: dict) -> None:
    m = res["meta"]
    print(f"gpu_suite: size {m['size']}, {m['model']} x {m['layers']} layers {m['dtype']}, backend "
          f"{m['backend']} ({m['device_kind']}, {m['devices']} devices), peak HBM "
          f"{fmt(m['peak_hbm'] and m['peak_hbm'] / 1e12, '.2f')} TB/s, peak bf16 "
          f"{fmt(m['peak_flops'] and m['peak_flops'] / 1e12, '.0f')} TFLOP/s per device")
    if "decode" in res:
        r0 = res["decode"][0]
        print_table(f"decode ({r0['decode_steps']} tokens/call, cache {r0['context']} at {r0['start_len']}; "
                    f"{m['seconds']['decode']:.0f} s)", res["decode"], [
                        ("batch", "batch", "d"), ("tok/s", "tok_s", ".0f"), ("ms/step", "ms_step", ".3f"),
                        ("experts", pct("experts_touched"), ".0f"), ("uniform", pct("experts_uniform"), ".0f"),
                        ("GB/step", lambda r: r["bytes_step"] / 1e9, ".4g"),
                        ("KV GB", lambda r: r["kv_bytes"] / 1e9, ".4g"),
                        ("GB/s", lambda r: r["bandwidth"] / 1e9, ".4g"), ("HBM %", pct("hbm_share"), ".1f")])
    if "train" in res:
        print_table(f"train step ({m['seconds']['train']:.0f} s)", res["train"], [
            ("tokens", "tokens", "d"), ("attention", "attention", "s"), ("ms", "ms_step", ".1f"),
            ("tok/s", "tok_s", ".0f"), ("model TF", lambda r: r["model_flops"] / 1e12, ".4g"),
            ("TFLOP/s", "model_tflops_s", ".4g"), ("MFU %", pct("mfu"), ".1f"), ("loss", "loss", ".4f")])
    if "moe" in res:
        r0 = res["moe"][0]
        note = "; 1 shard: same code" if r0["same_code"] else ""
        print_table(f"MoE dispatch, one layer fwd+bwd, {r0['tokens']} tokens on {r0['shards']} expert shards"
                    f"{note} ({m['seconds']['moe']:.0f} s)", res["moe"], [
                        ("dispatch", "dispatch", "s"), ("ms", "ms", ".2f"), ("/padded", "time_vs_padded", ".2f"),
                        ("max|dy|", "out_diff", ".2e"), ("grad diff", "grad_diff", ".2e")])
    if "attention" in res:
        r0 = res["attention"][0]
        print_table(f"attention vs naive, model fwd+bwd, batch {r0['batch']} x seq {r0['seq']} "
                    f"({m['seconds']['attention']:.0f} s)", res["attention"], [
                        ("dtype", "dtype", "s"), ("impl", "impl", "s"), ("ms", "ms", ".2f"),
                        ("/naive", "time_vs_naive", ".2f"), ("max|dlogit|", "logit_diff", ".2e"),
                        ("rel", "logit_rel", ".2e"), ("grad diff", "grad_diff", ".2e")])
        for r in res["attention"]:
            if "error" in r:
                print(f"  {r['dtype']} {r['impl']} failed: {r['error']}")
    if "paged" in res:
        r0 = res["paged"][0]
        print_table(f"paged decode attention, one layer, batch {r0['batch']}, cache {r0['context']} in pages of "
                    f"{r0['page']}: kernel vs gather ({m['seconds']['paged']:.0f} s)", res["paged"], [
                        ("window", "window", "d"), ("mean len", "mean_len", ".0f"), ("kernel ms", "kernel_ms", ".3f"),
                        ("gather ms", "gather_ms", ".3f"), ("gather/kernel", "gather_vs_kernel", ".2f"),
                        ("KV GB/s", lambda r: r["bandwidth"] / 1e9, ".4g"), ("max rel", "max_rel", ".2e")])
    for name, g in res.get("goals", {}).items():
        verdict = "-" if g["value"] is None else "met" if g["value"] >= g["goal"] else "missed"
        print(f"goal: {name} {fmt(g['value'], '.1f')} % (>= {g['goal']} %: {verdict})")
