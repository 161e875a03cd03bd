"""Benchmark: does the train stage give the same draft twice on the same blocks, settings and seed?

Copies an extracted run's ``conversations/``, ``hidden_states/`` and ``vocab/`` into ``--rounds`` fresh runs and
runs the product's ``eagle3ray.train.train`` on each (no plan: ``train.max_steps`` as given), with
``WorkerHooks(trace_dir=...)`` recording the sample ids of every step. Prints each run's wall time and metrics rows
(``step``, held-out ``val_full_acc_0``, ``train_loss``), then whether every run stepped through the same samples in
the same order as the first, where they first differ, and whether their metrics are identical.

    .venv/bin/python benchmarks/train_determinism.py runs/smollm2-135m-cpu --rounds 2 --steps 80
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a local run folder whose extract and vocab stages finished")
    ap.add_argument("overrides", nargs="*", help="config overrides (section.key=value) for every round")
    ap.add_argument("-c", "--config", default="configs/smollm2-135m-cpu.yaml")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    args = ap.parse_args()

    from eagle3ray import blocks, storage
    from eagle3ray.config import load_config
    from eagle3ray.train import train
    from eagle3ray.train_worker import WorkerHooks

    run_dir = os.path.abspath(args.run_dir)
    src = storage.RunPaths.create(f"file://{os.path.dirname(run_dir)}", os.path.basename(run_dir))
    man, _ = blocks.read_committed(src.fs, src.hidden_states)
    tmp = tempfile.mkdtemp(prefix="e3r-bench-det-")
    print(f"source {run_dir}: {man['counts']['samples']} samples, {len(man['blocks'])} blocks; runs under {tmp}",
          flush=True)
    runs = []
    for r in range(args.rounds):
        name = f"det-{r}"
        cfg = load_config(args.config, [*args.overrides, f"run.storage=file://{tmp}", f"run.name={name}",
                                        "run.time_budget=null", f"data.max_samples={man['counts']['samples']}",
                                        f"train.max_steps={args.steps}",
                                        f"train.checkpoint_every={max(1, args.steps // 2)}"])
        dst = storage.run_paths(cfg)
        for sub in ("conversations", "hidden_states", "vocab"):
            shutil.copytree(f"{run_dir}/{sub}", f"{tmp}/{name}/{sub}")
        trace = f"{tmp}/trace-{name}"
        t = time.time()
        train(cfg, hooks=WorkerHooks(trace_dir=trace))
        wall = time.time() - t
        order = [json.loads(line) for f in sorted(glob.glob(f"{trace}/rank*.jsonl")) for line in open(f)]
        rows = [(m.get("step"), m.get("val_full_acc_0"), m.get("train_loss"))
                for m in (json.loads(line) for line in dst.fs.cat_file(f"{dst.sub('checkpoints')}/metrics.jsonl")
                          .decode().splitlines())]
        runs.append((order, rows))
        print(f"round {r + 1}: train {wall:.1f} s, {len(order)} steps traced; (step, val_full_acc_0, train_loss) "
              f"{rows}", flush=True)
    first = runs[0]
    for r, (order, rows) in enumerate(runs[1:], start=2):
        diff = next((k for k, (a, b) in enumerate(zip(first[0], order)) if a != b), None)
        if diff is None and len(first[0]) != len(order):
            diff = min(len(first[0]), len(order))
        print(f"round {r} against round 1: same samples in the same order: {diff is None}"
              + ("" if diff is None else f" (first difference at step {diff + 1})")
              + f"; identical metrics: {rows == first[1]}")


if __name__ == "__main__":
    main()
