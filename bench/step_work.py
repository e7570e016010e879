"""The serial per-step work of a training step, and whole steps before and after a change.

``python -m bench.step_work [--reps N] [--baseline REV] [--rounds N] [--json PATH]``

Part 1, components (this tree, one thread on one core of the caller's): for each model of the
accuracy benchmark (``bench.estimator_accuracy.MODELS``, A-F) the work the gpt runtime
does once per step after backward, each timed over ``--reps`` interleaved repetitions
(median): AdamW's step as PyTorch's per-tensor ``loop``, ``foreach`` and ``fused``
(``agent.runtime.optim.make_adamw``); the gradient check per tensor
(``isfinite(g).all()``, the runtime's until 2026-12-06) and ``optim.all_finite``; the
synthetic data source's batch (``agent.runtime.data.walk_reference``, the torch walk,
and ``SyntheticSource.batch``) at 16 rows of the model's context.

Part 2, whole steps (with ``--baseline REV``): the 14 configurations of ``CONFIGS``
(single-device, two cores, pp, dp, tp, a multimodal shape) run by the runtime of this
tree and of revision REV (a ``git worktree`` of it, removed after),
each tree in a long-lived worker process that forks a fresh run per request
(``bench._measure.run_jobs``, or ``estimator_accuracy.run_workload`` for the multimodal
shape — the grid's protocol: 3 warm-up + 5 measured steps, the median step less other
tenants' run-queue wait). The two trees alternate per configuration (the order flips
each round), so a slow phase of the host falls on both; ``--rounds`` rounds. Prints per
configuration the median step of each tree and the median over rounds of the per-round
ratio this / baseline, and the median of those ratios.

About 10 s for part 1 (40 reps) and ~25 s a round for part 2 (8 rounds: ~3.5 minutes) on 2 vCPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Whole-step configurations: (label, request). gpt requests name a grid-like job; the
# multimodal one the accuracy benchmark's colocated shape at quota 1.
CONFIGS = [
    ("A 16x64", {"model": "A", "batch": 16, "seq": 64, "m": 1, "plan": {}, "cores": [[0]]}),
    ("A 48x32", {"model": "A", "batch": 48, "seq": 32, "m": 1, "plan": {}, "cores": [[0]]}),
    ("B 8x64", {"model": "B", "batch": 8, "seq": 64, "m": 1, "plan": {}, "cores": [[0]]}),
    ("B 16x64 m=4", {"model": "B", "batch": 16, "seq": 64, "m": 4, "plan": {}, "cores": [[0]]}),
    ("C 8x64", {"model": "C", "batch": 8, "seq": 64, "m": 1, "plan": {}, "cores": [[0]]}),
    ("D 8x64", {"model": "D", "batch": 8, "seq": 64, "m": 1, "plan": {}, "cores": [[0]]}),
    ("E 8x32", {"model": "E", "batch": 8, "seq": 32, "m": 1, "plan": {}, "cores": [[0]]}),
    ("F 16x48", {"model": "F", "batch": 16, "seq": 48, "m": 1, "plan": {}, "cores": [[0]]}),
    ("A 16x64 q=2", {"model": "A", "batch": 16, "seq": 64, "m": 1, "plan": {}, "cores": [[0, 1]]}),
    ("A 16x64 pp=2", {"model": "A", "batch": 16, "seq": 64, "m": 1, "plan": {"pp": 2}, "cores": [[0], [1]]}),
    ("E 8x64 pp=2 m=2", {"model": "E", "batch": 8, "seq": 64, "m": 2, "plan": {"pp": 2, "micro_batches": 2},
                         "cores": [[0], [1]]}),
    ("B 8x64 dp=2", {"model": "B", "batch": 8, "seq": 64, "m": 1, "plan": {"dp": 2}, "cores": [[0], [1]]}),
    ("C 8x64 tp=2", {"model": "C", "batch": 8, "seq": 64, "m": 1, "plan": {"tp": 2}, "cores": [[0], [1]]}),
    ("multimodal q=1", {"shape": "mm-colocated", "cores": [[0]]}),
]

# Runs in each tree's worker (``python -c``, cwd and PYTHONPATH the tree): only APIs that
# revisions since 2026-12-06's ninth session have, so that any of them can be the baseline.
WORKER = r"""
import json, sys
from bench import estimator_accuracy as ea
from bench._measure import run_jobs
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if req.get("shape"):
        r = ea.run_workload(ea.workload_heldout(req["shape"]), req["cores"][0], ea.WARMUP)
    else:
        plan = {"micro_batches": req["m"], **req["plan"]}
        wl = ea.workload(req["model"], req["batch"], req["seq"], req["m"], ea.WARMUP + ea.MEASURED, plan)
        r = run_jobs([{"workload": wl, "cores": req["cores"]}], ea.WARMUP)[0]
    print(json.dumps({"step_s": r["step_s"], "wall_s": r["wall_s"]}), flush=True)
"""


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def components(reps: int) -> list[dict]:
    """Part 1 (module doc): per model, median milliseconds of each piece of step work.
    Runs on one core of the caller's, one thread; both are the caller's again after."""
    import torch

    from bench import estimator_accuracy as ea

    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, [min(cores)])
    torch.set_num_threads(1)
    try:
        return [_component_row(name, dims, reps) for name, dims in ea.MODELS.items()]
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)


def _component_row(name: str, dims: tuple, reps: int) -> dict:
    import torch

    from agent.runtime.data import SyntheticSource, walk_reference
    from agent.runtime.model import GPT, GPTConfig, lm_loss
    from agent.runtime.optim import ENV, all_finite, make_adamw

    layers, hidden, heads, vocab, seq_len = dims
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=vocab, seq_len=seq_len, layers=layers, hidden=hidden, heads=heads))
    x = torch.randint(0, vocab, (8, seq_len))
    lm_loss(model(x), x).backward()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    opts = {impl: make_adamw(params, lr=1e-3, env={ENV: impl}) for impl in ("loop", "foreach", "fused")}
    src = SyntheticSource(vocab, seed=0)
    pieces = {
        **{f"adamw_{k}": o.step for k, o in opts.items()},
        "finite_per_tensor": lambda: all(bool(torch.isfinite(g).all()) for g in grads),
        "finite_all_finite": lambda: all_finite(grads),
        "data_torch_walk": lambda: walk_reference(src, 1, 16, seq_len),
        "data_batch": lambda: src.batch(1, 16, seq_len),
    }
    for fn in pieces.values():
        fn()  # first calls: lazy state, imports
    times = {k: [] for k in pieces}
    for _ in range(reps):  # interleaved: a slow phase of the host falls on every piece
        for k, fn in pieces.items():
            times[k].append(_ms(fn))
    row = {"model": name, "tensors": len(params), "params": sum(p.numel() for p in params)}
    row.update({k: statistics.median(v) for k, v in times.items()})
    return row


class Worker:
    """One tree's long-lived worker process (WORKER)."""

    def __init__(self, tree: str) -> None:
        env = dict(os.environ, PYTHONPATH=tree)
        self.p = subprocess.Popen([sys.executable, "-u", "-c", WORKER], cwd=tree, env=env, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._read()

    def _read(self) -> dict:
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"step_work worker exited with {self.p.wait()}")
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue  # a runtime's own output line

    def run(self, req: dict) -> dict:
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


def whole_steps(baseline: str, rounds: int, configs=CONFIGS) -> dict:
    """Part 2 (module doc): per configuration, per round, this tree's and the baseline's
    step seconds."""
    tmp = tempfile.mkdtemp(prefix="tessera-step-work-")
    tree = os.path.join(tmp, "baseline")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", tree, baseline], check=True,
                   capture_output=True)
    rev = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
                         text=True).stdout.strip()
    workers = {}
    try:
        workers = {"this": Worker(REPO), "baseline": Worker(tree)}
        res = {label: {"this": [], "baseline": []} for label, _ in configs}
        for r in range(rounds):
            for k, (label, req) in enumerate(configs):
                order = ("this", "baseline") if (r + k) % 2 == 0 else ("baseline", "this")
                for who in order:
                    res[label][who].append(workers[who].run(req)["step_s"])
            print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
        return {"baseline": rev, "rounds": rounds, "steps_s": res}
    finally:
        for w in workers.values():
            w.close()
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def ratios(steps_s: dict) -> dict:
    """Per configuration: median step of each tree (ms) and the median over rounds of the
    round's this / baseline; plus ``median_ratio`` over configurations."""
    rows = {}
    for label, v in steps_s.items():
        per_round = [a / b for a, b in zip(v["this"], v["baseline"]) if a > 0 and b > 0]
        rows[label] = {"this_ms": 1e3 * statistics.median(v["this"]),
                       "baseline_ms": 1e3 * statistics.median(v["baseline"]),
                       "ratio": statistics.median(per_round) if per_round else None}
    rs = [r["ratio"] for r in rows.values() if r["ratio"] is not None]
    return {"rows": rows, "median_ratio": statistics.median(rs) if rs else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30, help="repetitions per component (default 30)")
    ap.add_argument("--baseline", help="git revision whose runtime runs the same whole steps")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of whole steps (default 3)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.rounds < 1:
        ap.error("--reps and --rounds must be at least 1")
    out: dict = {"components": components(args.reps)}
    cols = ["adamw_loop", "adamw_foreach", "adamw_fused", "finite_per_tensor", "finite_all_finite",
            "data_torch_walk", "data_batch"]
    print("per-step work, ms (median of %d, one thread):" % args.reps)
    print(f"{'model':<6}{'tensors':>8}" + "".join(f"{c:>19}" for c in cols))
    for r in out["components"]:
        print(f"{r['model']:<6}{r['tensors']:>8}" + "".join(f"{r[c]:>19.3f}" for c in cols))
    if args.baseline:
        w = whole_steps(args.baseline, args.rounds)
        out["whole_steps"] = {**w, **ratios(w["steps_s"])}
        s = out["whole_steps"]
        print(f"whole steps, this tree vs {w['baseline']} ({args.rounds} rounds, alternating):")
        print(f"{'config':<18}{'baseline ms':>12}{'this ms':>10}{'this/baseline':>15}")
        for label, r in s["rows"].items():
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
            print(f"{label:<18}{r['baseline_ms']:>12.2f}{r['this_ms']:>10.2f}{ratio:>15}")
        med = "-" if s["median_ratio"] is None else f"{s['median_ratio']:.3f}"
        print(f"median this/baseline over configurations: {med}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
