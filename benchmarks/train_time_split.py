"""Benchmark: where a Ray Train step's wall time goes, the step itself or waiting for the Ray Data shard.

Runs the product's stages (``eagle3ray.pipeline.run_stage``) on a small run: extract (and its needs) and vocab
once, then ``train`` ``--rounds`` times from scratch, and prints per checkpoint interval the workers' own report
(``metrics.jsonl``): tokens/s, ``worker_step_s`` (in ``DraftStep.step``) and ``worker_data_s`` (waiting for a
decoded, packed batch of the shard, held-out batches included), plus the CPU seconds of the busiest processes
over each train. ``--iterate`` also times Ray Data's ``iter_batches`` over the run's blocks alone, with and
without Ray Data's local shuffle buffer (what the worker used before its own shuffle buffer), read as the train
stage reads them (``eagle3ray.train.read_blocks``). To compare with Ray's default Parquet reader, run it again with
``RAY_DATA_USE_DATASOURCE_V2=1`` (docs/plan.md, "Ray Data's Parquet reader").

    .venv/bin/python benchmarks/train_time_split.py --steps 150 --every 50
"""
from __future__ import annotations

import argparse
import glob
import json
import shutil
import statistics
import time


def cpu_snapshot() -> dict:
    import psutil

    out = {}
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            t = p.cpu_times()
            out[p.pid] = (t.user + t.system, " ".join(p.info["cmdline"] or [p.info["name"]])[:80])
        except psutil.Error:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default="configs/smollm2-135m-cpu.yaml")
    ap.add_argument("--storage", default="file:///tmp/eagle3ray-bench-split")
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--iterate", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for the run (repeatable), e.g. train.cache_shard_mib=1024")
    args = ap.parse_args()

    from eagle3ray import pipeline, storage
    from eagle3ray.config import load_config

    cfg = load_config(args.config, ["run.name=bench-split", f"run.storage={args.storage}",
                                    f"data.max_samples={args.samples}", "data.regenerate=false",
                                    f"train.max_steps={args.steps}", f"train.checkpoint_every={args.every}", *args.set])
    pipeline.run_stage(cfg, "extract", with_needs=True, progress=False)
    pipeline.run_stage(cfg, "vocab", progress=False)
    paths = storage.run_paths(cfg)
    local = paths.uri.replace("file://", "")
    split = []
    for r in range(args.rounds):
        shutil.rmtree(f"{local}/checkpoints", ignore_errors=True)
        a, t0 = cpu_snapshot(), time.time()
        pipeline.run_stage(cfg, "train", progress=False)
        wall, b = time.time() - t0, cpu_snapshot()
        lines = [json.loads(x) for x in open(f"{local}/checkpoints/metrics.jsonl") if "worker_step_s" in x]
        print(f"round {r + 1}: train stage {wall:.1f} s", flush=True)
        prev = {"worker_step_s": 0.0, "worker_data_s": 0.0, "step": 0}
        for m in lines:
            n = m["step"] - prev["step"]
            st, dt = m["worker_step_s"] - prev["worker_step_s"], m["worker_data_s"] - prev["worker_data_s"]
            print(f"  steps {prev['step']:4d}-{m['step']:4d}: {m['tokens_per_s']:6.0f} tok/s, step {st / n:.3f} s/step,"
                  f" waiting for data {dt / n:.3f} s/step (data/step {dt / max(st, 1e-9):.2f})", flush=True)
            if prev["step"]:
                split.append(dt / max(st, 1e-9))
            prev = m
        for s, name in sorted(((b[p][0] - a.get(p, (0,))[0], b[p][1]) for p in b), reverse=True)[:5]:
            print(f"    {s:7.1f} CPU s  {name}", flush=True)
    if split:
        print(f"median over the intervals after the first: waiting for data / step = {statistics.median(split):.2f}")
    if args.iterate:
        from eagle3ray.train import read_blocks

        files = sorted(glob.glob(f"{local}/hidden_states/blocks/*.parquet"))
        for shuf in (64, None):
            ds = read_blocks(files, None)
            t0, n = time.perf_counter(), 0
            for bt in ds.iter_batches(batch_size=8, batch_format="pyarrow", local_shuffle_buffer_size=shuf,
                                      local_shuffle_seed=1 if shuf else None):
                n += bt.num_rows
            print(f"ray data iter_batches, local shuffle buffer {shuf}: {n} rows in {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
