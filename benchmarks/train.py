"""Benchmark: draft-training throughput, Ray Train (1 and 2 workers) vs a plain single-process loop.

All three train the same speculators ``Eagle3DraftModel`` on the same committed blocks of an existing
run (one whose extract stage finished), with the same per-step token budget:

1. plain: this process, pyarrow reads the blocks, packs and collates them exactly like the workers
   (``row_to_sample``, ``pack_rows``, speculators' ``CollateFn``) and runs the workers' own step object
   (:class:`eagle3ray.train_worker.DraftStep`: the same autocast, loss, TTT step decay, feature noise, clipping
   and LR schedule); timed after 2 warm-up steps;
2. Ray Train, 1 worker; 3. Ray Train, 2 workers: ``eagle3ray.train.train`` on copies of the run's blocks,
   throughput from the workers' own report (tokens of the last checkpoint interval / its wall time,
   evaluation excluded).

4. (``--variants ...,1w-glibc``) Ray Train, 1 worker started without tcmalloc (``EAGLE3RAY_CPU_PRELOAD=off`` for
   that ``train`` call): the product's CPU workers start with it preloaded where it is installed.

Prints tokens/s per round and the medians over ``--rounds``, and the 1-worker overhead vs plain (target <= 15%).
The 2-worker runs give each worker half of ``train.cpus_per_worker``, so both variants use the same CPUs. On a 2-core machine two workers
share the same cores, so the 2-worker figure shows the cost of data parallelism, not a speed-up.

    .venv/bin/python benchmarks/train.py -c configs/smollm2-135m-cpu.yaml --steps 20 --rounds 3
    .venv/bin/python benchmarks/train.py run.name=RUN --variants 1w,1w-glibc --steps 60 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default=None)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each variant; medians are printed")
    ap.add_argument("--variants", default="plain,1w,2w",
                    help="comma-separated, of: plain, 1w, 2w, 1w-glibc (1 worker without tcmalloc)")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - {"plain", "1w", "2w", "1w-glibc"}
    if unknown:
        ap.error(f"unknown --variants {sorted(unknown)}")

    from eagle3ray import blocks, plan, storage
    from eagle3ray.config import load_config
    from eagle3ray.machine import cpu_engine_env
    from eagle3ray.verifier import VerifierSpec
    from eagle3ray.vocab import build_vocab

    cfg = load_config(args.config, args.overrides)
    src = storage.run_paths(cfg)
    build_vocab(cfg)
    man, files = blocks.read_committed(src.fs, src.hidden_states)
    spec = VerifierSpec.from_config(cfg)
    tc = plan.timing_train_settings(cfg.train, max_steps=args.steps)  # a planned optimizer times adamw
    budget = cfg.train.max_tokens_per_batch
    print(f"blocks={len(files)} samples={man['counts']['samples']} tokens={man['counts']['tokens']} "
          f"max_tokens_per_batch={budget} steps={args.steps}", flush=True)

    rounds: dict[str, list[float]] = {v: [] for v in variants}
    print(f"Ray Train CPU workers' preload: {cpu_engine_env('cpu') or 'none (not installed, or off)'}", flush=True)
    if "plain" in variants:
        plain_loop(args, cfg, src, files, spec, tc, budget, rounds["plain"])
    ray_train_variants(args, cfg, src, variants, rounds)
    results = {k: statistics.median(v) for k, v in rounds.items()}
    print(f"\nmedians over {args.rounds} rounds, tokens/s: " + ", ".join(f"{k} {v:.0f}" for k, v in results.items()))
    if "plain" in results and "1w" in results:
        print(f"1-worker overhead vs plain: {(1 - results['1w'] / results['plain']) * 100:.1f}% (target <= 15%)")
    if "2w" in results and "1w" in results:
        print(f"2 workers / 1 worker: {results['2w'] / results['1w']:.2f}")
    if "1w-glibc" in results and "1w" in results:
        print(f"1 worker with tcmalloc / without: {results['1w'] / results['1w-glibc']:.2f}")


def plain_loop(args, cfg, src, files, spec, tc, budget, out: list[float]) -> None:
    """The workers' step in this process (variant ``plain``); appends tokens/s per round to ``out``."""
    import pyarrow.parquet as pq
    import torch

    from eagle3ray.artifacts import load_vocab
    from eagle3ray.machine import resolve_autocast
    from eagle3ray.train_worker import DraftStep, pack_rows, row_to_sample

    # 1. plain loop, with the threads one Ray Train worker gets (Ray sets OMP_NUM_THREADS to its CPUs, >= 1)
    threads = max(1, int(cfg.train.cpus_per_worker))
    torch.set_num_threads(threads)
    print(f"plain loop torch threads: {threads} (= one worker's)", flush=True)
    d2t, t2d = load_vocab(src)
    autocast = resolve_autocast(cfg.train.autocast, "cpu")
    print(f"plain loop autocast: {'bf16' if autocast else 'off'} (train.autocast {cfg.train.autocast}, as the "
          "Ray Train driver resolves it)", flush=True)
    torch.manual_seed(tc["seed"])
    step = DraftStep.build(tc, spec.model_path, spec.layer_ids[:-1], d2t, t2d, spec.model_identity["hidden_size"],
                           autocast)
    step.to_device(torch.device("cpu"))
    step.model.train()

    def rows():
        while True:
            for f in files:
                with src.fs.open(f, "rb") as fh:
                    for row in pq.read_table(fh).to_pylist():
                        yield row["sample_id"], row_to_sample(row)

    stream = iter(pack_rows(rows(), budget))
    for _ in range(2):  # warm-up steps, untimed
        step.step(step.collate([s for _, s in next(stream)]))
    for r in range(args.rounds):
        step_times, step_tokens = [], []
        for _ in range(args.steps):
            group = next(stream)
            t = time.time()
            batch = step.collate([s for _, s in group])
            step.step(batch)
            step_times.append(time.time() - t)
            step_tokens.append(int((batch["document_ids"] >= 0).sum()))
        out.append(sum(step_tokens) / sum(step_times))
        print(f"round {r + 1}: plain loop {out[-1]:.0f} tok/s (median step "
              f"{statistics.median(step_times):.2f} s)", flush=True)


def ray_train_variants(args, cfg, src, variants, rounds) -> None:
    """``eagle3ray.train.train`` on copies of the run's blocks, once per Ray Train variant and round."""
    from eagle3ray import storage
    from eagle3ray.config import load_config
    from eagle3ray.train import train

    tmp = tempfile.mkdtemp(prefix="e3r-bench-train-")
    for r in range(args.rounds):
        for variant in [v for v in variants if v != "plain"]:
            workers = 2 if variant == "2w" else 1
            name = f"bench-train-{variant}-r{r}"
            # N workers share the CPUs one worker has (the same cores, so the figure is data parallelism's cost);
            # more would starve Ray Data's read tasks of the local cluster's logical CPUs
            over = [*args.overrides, f"run.storage=file://{tmp}", f"run.name={name}",
                    f"train.num_workers={workers}", f"train.cpus_per_worker={cfg.train.cpus_per_worker / workers:g}",
                    f"train.max_steps={args.steps}", f"train.optimizer={tc['optimizer']}",
                    f"train.checkpoint_every={max(1, args.steps // 2)}", "train.max_failures=0"]
            wcfg = load_config(args.config, over)
            dst = storage.run_paths(wcfg)
            for sub in ("hidden_states", "vocab", "conversations"):
                src.fs.copy(src.sub(sub), dst.sub(sub), recursive=True)
            before = os.environ.get("EAGLE3RAY_CPU_PRELOAD")
            if variant == "1w-glibc":
                os.environ["EAGLE3RAY_CPU_PRELOAD"] = "off"  # read by train() when it builds the workers' env
            try:
                s = train(wcfg)
            finally:
                if before is None:
                    os.environ.pop("EAGLE3RAY_CPU_PRELOAD", None)
                else:
                    os.environ["EAGLE3RAY_CPU_PRELOAD"] = before
            m = s.final_metrics
            tps = m.get("tokens_per_s", float("nan"))
            rounds[variant].append(tps)
            print(f"round {r + 1}: ray train {variant} {tps:.0f} tok/s (last interval of {args.steps // 2} steps; "
                  f"worker_tcmalloc {m.get('worker_tcmalloc')})", flush=True)


if __name__ == "__main__":
    main()
