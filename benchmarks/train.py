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

Prints tokens/s per round and the medians over ``--rounds``, and the 1-worker overhead vs plain (target <= 15%).
The 2-worker runs give each worker half of ``train.cpus_per_worker``, so both variants use the same CPUs. On a 2-core machine two workers
share the same cores, so the 2-worker figure shows the cost of data parallelism, not a speed-up.

    .venv/bin/python benchmarks/train.py -c configs/smollm2-135m-cpu.yaml --steps 20 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default=None)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each variant; medians are printed")
    args = ap.parse_args()

    import pyarrow.parquet as pq
    import torch

    from eagle3ray import blocks, storage
    from eagle3ray.artifacts import load_vocab
    from eagle3ray.config import load_config
    from eagle3ray.machine import resolve_autocast
    from eagle3ray.train import train
    from eagle3ray.train_worker import DraftStep, pack_rows, row_to_sample
    from eagle3ray.verifier import VerifierSpec
    from eagle3ray.vocab import build_vocab

    cfg = load_config(args.config, args.overrides)
    src = storage.run_paths(cfg)
    build_vocab(cfg)
    man, files = blocks.read_committed(src.fs, src.hidden_states)
    spec = VerifierSpec.from_config(cfg)
    tc = cfg.train.model_dump()
    budget = cfg.train.max_tokens_per_batch
    print(f"blocks={len(files)} samples={man['counts']['samples']} tokens={man['counts']['tokens']} "
          f"max_tokens_per_batch={budget} steps={args.steps}", flush=True)

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
    rounds: dict[str, list[float]] = {"plain": [], "ray_train_1w": [], "ray_train_2w": []}
    for r in range(args.rounds):
        step_times, step_tokens = [], []
        for _ in range(args.steps):
            group = next(stream)
            t = time.time()
            batch = step.collate([s for _, s in group])
            step.step(batch)
            step_times.append(time.time() - t)
            step_tokens.append(int((batch["document_ids"] >= 0).sum()))
        rounds["plain"].append(sum(step_tokens) / sum(step_times))
        print(f"round {r + 1}: plain loop {rounds['plain'][-1]:.0f} tok/s (median step "
              f"{statistics.median(step_times):.2f} s)", flush=True)
    del step

    tmp = tempfile.mkdtemp(prefix="e3r-bench-train-")
    for r in range(args.rounds):
        for workers in (1, 2):
            name = f"bench-train-{workers}w-r{r}"
            # N workers share the CPUs one worker has (the same cores, so the figure is data parallelism's cost);
            # more would starve Ray Data's read tasks of the local cluster's logical CPUs
            over = [*args.overrides, f"run.storage=file://{tmp}", f"run.name={name}",
                    f"train.num_workers={workers}", f"train.cpus_per_worker={cfg.train.cpus_per_worker / workers:g}",
                    f"train.max_steps={args.steps}",
                    f"train.checkpoint_every={max(1, args.steps // 2)}", "train.max_failures=0"]
            wcfg = load_config(args.config, over)
            dst = storage.run_paths(wcfg)
            for sub in ("hidden_states", "vocab", "conversations"):
                src.fs.copy(src.sub(sub), dst.sub(sub), recursive=True)
            s = train(wcfg)
            tps = s.final_metrics.get("tokens_per_s", float("nan"))
            rounds[f"ray_train_{workers}w"].append(tps)
            print(f"round {r + 1}: ray train {workers} worker(s) {tps:.0f} tok/s (last interval of "
                  f"{args.steps // 2} steps)", flush=True)
    results = {k: statistics.median(v) for k, v in rounds.items()}
    plain = results["plain"]
    print(f"\nmedians over {args.rounds} rounds, tokens/s: " + ", ".join(f"{k} {v:.0f}" for k, v in results.items()))
    print(f"1-worker overhead vs plain: {(1 - results['ray_train_1w'] / plain) * 100:.1f}% (target <= 15%)")
    print(f"2 workers / 1 worker: {results['ray_train_2w'] / results['ray_train_1w']:.2f}")


if __name__ == "__main__":
    main()
