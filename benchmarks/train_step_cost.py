"""Benchmark: what one draft-training step costs as the draft vocabulary, packed length and TTT steps change.

One process, the Ray Train worker's own step object (:class:`eagle3ray.train_worker.DraftStep`:
``row_to_sample``, ``pack_rows``, speculators' ``CollateFn``, forward over ``ttt_steps``, backward, clipping,
AdamW, LR schedule), on the committed
blocks of an existing run (one whose extract stage finished). For each draft vocabulary size the d2t/t2d
mapping is built from the run's token counts with speculators' ``build_vocab_mappings_from_distribution``,
as the vocab stage does. Timed after 2 warm-up steps; prints tokens/s per variant and the ratio to the
first variant, side by side in one run.

    .venv/bin/python benchmarks/train_step_cost.py -c configs/smollm2-135m-cpu.yaml \\
        --vocab 8192,4096 --tokens 1024,512 --ttt 3,2 --autocast off,bfloat16
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default=None)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--vocab", default="8192,4096", help="draft vocabulary sizes (comma-separated)")
    ap.add_argument("--tokens", default="1024", help="packed tokens per step (comma-separated)")
    ap.add_argument("--ttt", default="3", help="TTT steps (comma-separated)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per variant (after 2 warm-up steps)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--autocast", default="off", help="CPU autocast dtypes to compare: off,bfloat16")
    args = ap.parse_args()

    import pyarrow.parquet as pq
    import torch
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    from eagle3ray import blocks, plan, storage
    from eagle3ray.artifacts import load_token_frequencies
    from eagle3ray.config import load_config
    from eagle3ray.train_worker import DraftStep, pack_rows, row_to_sample
    from eagle3ray.verifier import VerifierSpec

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    paths = storage.run_paths(cfg)
    man, files = blocks.read_committed(paths.fs, paths.hidden_states)
    spec = VerifierSpec.from_config(cfg)
    H = spec.model_identity["hidden_size"]
    freq = load_token_frequencies(paths)
    counts = {int(i): int(c) for i, c in enumerate(freq) if c}
    samples = []
    for f in files:
        with paths.fs.open(f, "rb") as fh:
            samples += [(r["sample_id"], row_to_sample(r)) for r in pq.read_table(fh).to_pylist()]
        if sum(int(s["lengths"][0]) for _, s in samples) > 16 * 1024:
            break
    print(f"{len(samples)} samples from {paths.uri}/hidden_states, torch threads {args.threads}", flush=True)

    results = []
    grid = itertools.product(*(map(int, a.split(",")) for a in (args.vocab, args.tokens, args.ttt)),
                             args.autocast.split(","))
    for vd, T, ttt, ac in grid:
        tc = plan.timing_train_settings(cfg.train)
        tc["ttt_steps"], tc["max_tokens_per_batch"] = ttt, T
        d2t, t2d = build_vocab_mappings_from_distribution(counts, vd, len(freq))
        torch.manual_seed(0)
        step = DraftStep.build(tc, spec.model_path, spec.layer_ids[:-1], d2t, t2d, H, autocast_bf16=ac != "off")
        step.to_device(torch.device("cpu"))
        step.model.train()
        times, toks = [], []
        for i, group in enumerate(pack_rows(itertools.cycle(samples), T)):
            if i >= args.steps + 2:
                break
            t = time.perf_counter()
            b = step.collate([s for _, s in group])
            step.step(b)
            if i >= 2:
                times.append(time.perf_counter() - t)
                toks.append(int((b["document_ids"] >= 0).sum()))
        tps = sum(toks) / sum(times)
        results.append(((vd, T, ttt, ac), tps))
        print(f"draft vocab {vd:6d}, {T:5d} tokens/step, TTT {ttt}, autocast {ac}: {tps:6.0f} tok/s "
              f"(median step {statistics.median(times):.2f} s)", flush=True)
    base = results[0][1]
    print("\nratio to the first variant: " + ", ".join(f"{k}: {v / base:.2f}" for k, v in results))


if __name__ == "__main__":
    main()
