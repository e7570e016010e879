"""Per-operator costs of the runtime's GPT step, the evidence behind feature weights.

``python -m bench.op_costs [--threads N] [--json PATH]`` runs forward + backward of
``agent.runtime.model.GPT`` (the runtime's model, cross-entropy loss) for a set of
shapes under ``torch.profiler`` on one process and thread, and sums each aten op's self
time into groups:

- ``gemm``: ``mm`` / ``addmm`` per matmul FLOP of the blocks and the head;
- ``attention``: the fused attention kernels (``scaled_dot_product_*``) forward +
  backward per score (one head's (T, T) matrix, full square, per layer);
- ``cross_entropy``: ``log_softmax`` / ``nll_loss`` forward + backward per logit;
- ``elementwise``: GELU, layer norms, adds, copies, sums, fills, concatenations per
  element unit (``tessera.perfmodel.features`` counts 20 units per token and hidden
  unit and block, 2 for the embedding);
- the rest (views, autograd bookkeeping): per block;
- gradient accumulation (``AccumulateGrad`` + ``add_``, 4 micro-batches against 1) per
  parameter and extra micro-batch.

It prints them per shape and the implied weights of ``features.mb_features``: units per
attention score (net of the attention FLOPs that ``flops`` already prices) and per logit.
Each shape's value is the fastest of three profiled windows of three steps (this host is
shared; other tenants only ever add time). Not part of the accuracy benchmark: it
explains a constant, it does not fit one.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys

# (name, layers, hidden, heads, vocab, batch, seq): the accuracy benchmark's zoo.
SHAPES = [
    ("A", 2, 64, 4, 256, 8, 64), ("A", 2, 64, 4, 256, 32, 32), ("A", 2, 64, 4, 256, 4, 32),
    ("B", 4, 128, 4, 256, 8, 64), ("B", 4, 128, 4, 256, 4, 64), ("B", 4, 128, 4, 256, 8, 16),
    ("C", 3, 96, 4, 256, 8, 64), ("D", 6, 64, 4, 512, 4, 64), ("D", 6, 64, 4, 512, 8, 64),
    ("D", 6, 64, 4, 512, 4, 128), ("E", 2, 192, 4, 256, 8, 64), ("E", 2, 192, 4, 256, 4, 32),
    ("F", 5, 80, 4, 256, 8, 64),
]
ELEMENTWISE = {"aten::gelu", "aten::gelu_backward", "aten::native_layer_norm", "aten::native_layer_norm_backward",
               "aten::add", "aten::add_", "aten::copy_", "aten::sum", "aten::fill_", "aten::cat", "aten::mul",
               "aten::div"}


def group(op: str) -> str:
    """The cost group of an aten op (profiler key)."""
    o = op.lower()
    if "scaled_dot_product" in o or "scaleddotproduct" in o:
        return "attention"
    if o in ("aten::mm", "aten::addmm"):
        return "gemm"
    if "log_softmax" in o or "logsoftmax" in o or "nll_loss" in o or "nllloss" in o:
        return "cross_entropy"
    if o in ELEMENTWISE:
        return "elementwise"
    return "other"


def counts(layers: int, hidden: int, heads: int, vocab: int, batch: int, seq: int) -> dict:
    """The units each group is divided by (see the module doc)."""
    tok = batch * seq
    return {"gemm": 6.0 * tok * (layers * 12 * hidden * hidden + hidden * vocab),
            "attention": float(layers * batch * heads * seq * seq),
            "attention_flops_per_score": 6.0 * hidden / heads,  # QK^T and PV, fwd + bwd, causal half
            "cross_entropy": float(tok * vocab),
            "elementwise": 20.0 * tok * hidden * layers + 2.0 * tok * hidden,
            "other": float(layers)}


def _model(shape: tuple):
    """(model, tokens, targets) of a shape: the runtime's GPT, seeded, one batch."""
    import torch

    from agent.runtime.model import GPT, GPTConfig

    _, layers, hidden, heads, vocab, batch, seq = shape
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=vocab, seq_len=seq, layers=layers, hidden=hidden, heads=heads))
    return model, torch.randint(vocab, (batch, seq)), torch.randint(vocab, (batch, seq))


def measure(shape: tuple, windows: int = 3, steps: int = 3) -> dict[str, float]:
    """Seconds per step of each group for one shape (fastest window)."""
    from torch.profiler import ProfilerActivity, profile

    from agent.runtime.model import lm_loss

    model, x, y = _model(shape)
    for _ in range(5):  # warm: allocator, kernels
        lm_loss(model(x), y).backward()
        model.zero_grad(set_to_none=True)
    best: dict[str, float] | None = None
    for _ in range(windows):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                lm_loss(model(x), y).backward()
                model.zero_grad(set_to_none=True)
        g: dict[str, float] = collections.Counter()
        for e in prof.key_averages():
            g[group(e.key)] += e.self_cpu_time_total * 1e-6 / steps
        if best is None or sum(g.values()) < sum(best.values()):
            best = dict(g)
    return best or {}


def accumulation(shape: tuple, micro_batches: int = 4, windows: int = 3, steps: int = 3) -> float:
    """Seconds per parameter and extra micro-batch of gradient accumulation
    (``AccumulateGrad`` + ``add_`` self time, ``micro_batches`` micro-batches of the
    shape's batch against one; fastest window of each)."""
    from torch.profiler import ProfilerActivity, profile

    from agent.runtime.model import lm_loss

    model, x, y = _model(shape)
    batch = x.shape[0]

    def step(m: int) -> None:
        for i in range(m):
            rows = slice(i * batch // m, (i + 1) * batch // m)
            lm_loss(model(x[rows]), y[rows]).backward()
        model.zero_grad(set_to_none=True)

    best = {}
    for m in (1, micro_batches):
        for _ in range(3):
            step(m)
        for _ in range(windows):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    step(m)
            t = sum(e.self_cpu_time_total * 1e-6 / steps for e in prof.key_averages()
                    if "AccumulateGrad" in e.key or e.key == "aten::add_")
            best[m] = min(best.get(m, t), t)
    params = sum(p.numel() for p in model.parameters())
    return (best[micro_batches] - best[1]) / (micro_batches - 1) / params


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    ap.add_argument("--json", help="write the per-shape figures here")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error("--threads must be at least 1")
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'shape':<16} {'step ms':>8} {'gemm ps/FLOP':>13} {'attn ns/score':>14} {'CE ns/logit':>12} "
          f"{'elem ns/unit':>13} {'other ms/block':>15}")
    for shape in SHAPES:
        g = measure(shape)
        n = counts(*shape[1:])
        row = {"shape": f"{shape[0]}/{shape[5]}x{shape[6]}", "step_s": sum(g.values()),
               "gemm_s_per_flop": g.get("gemm", 0.0) / n["gemm"],
               "attention_s_per_score": g.get("attention", 0.0) / n["attention"],
               "attention_flops_per_score": n["attention_flops_per_score"],
               "cross_entropy_s_per_logit": g.get("cross_entropy", 0.0) / n["cross_entropy"],
               "elementwise_s_per_unit": g.get("elementwise", 0.0) / n["elementwise"],
               "other_s_per_block": g.get("other", 0.0) / n["other"]}
        rows.append(row)
        print(f"{row['shape']:<16} {row['step_s'] * 1e3:>8.2f} {row['gemm_s_per_flop'] * 1e12:>13.2f} "
              f"{row['attention_s_per_score'] * 1e9:>14.2f} {row['cross_entropy_s_per_logit'] * 1e9:>12.2f} "
              f"{row['elementwise_s_per_unit'] * 1e9:>13.2f} {row['other_s_per_block'] * 1e3:>15.3f}", flush=True)
    unit = statistics.median(r["elementwise_s_per_unit"] for r in rows)
    net = [(r["attention_s_per_score"] - r["attention_flops_per_score"] * r["gemm_s_per_flop"]) / unit for r in rows]
    logit = [r["cross_entropy_s_per_logit"] / unit for r in rows]
    out = {"threads": args.threads, "elementwise_unit_s": unit, "rows": rows,
           "attention_units_per_score": {"median": statistics.median(net), "min": min(net), "max": max(net)},
           "cross_entropy_units_per_logit": {"median": statistics.median(logit), "min": min(logit), "max": max(logit)}}
    acc = {r["shape"]: accumulation(shape) for r, shape in zip(rows, SHAPES) if shape[5] >= 4}
    out["accumulation_s_per_param"] = acc
    out["accumulation_units_per_param"] = {k: v / unit for k, v in acc.items()}
    print("gradient accumulation, ns per parameter and extra micro-batch (4 against 1): "
          + ", ".join(f"{k} {v * 1e9:.2f}" for k, v in acc.items()))
    a, c = out["attention_units_per_score"], out["cross_entropy_units_per_logit"]
    print(f"element-wise unit: {unit * 1e9:.2f} ns (median); attention: {a['median']:.1f} units per score net of its "
          f"FLOPs ({a['min']:.1f}-{a['max']:.1f}); cross-entropy: {c['median']:.1f} units per logit "
          f"({c['min']:.1f}-{c['max']:.1f})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
