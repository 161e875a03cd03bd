"""Benchmark: the verifier's compute dtype on this CPU, fp32 vs bf16, for the two data stages.

Side by side in one process, per dtype and round: (1) regeneration, a plain vLLM engine
(:class:`eagle3ray.serving_engine.ServingEngine`, in-process on CPU) decoding the first ``--prompts`` user
prompts of a run's conversations, ``data.max_new_tokens`` greedy tokens each, all in flight; (2)
extraction, the verifier's extraction engine (:class:`eagle3ray.verifier.VerifierEngine`, vLLM
prefill with the auxiliary hidden states captured) on the first ``--samples`` whole conversations in
``extract.max_tokens_per_batch`` batches. Prints tokens/s per dtype and round, the medians and the
ratio bf16/fp32. ``verifier.dtype: auto`` picks bf16 only on CPUs with AMX-BF16
(:func:`eagle3ray.machine.cpu_bf16_is_fast`).

    .venv/bin/python benchmarks/dtype.py run.name=b1 --prompts 256 --samples 128 --rounds 2
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="config overrides (run.name=... picks the conversations)")
    ap.add_argument("-c", "--config", default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()

    from eagle3ray import storage
    from eagle3ray.config import load_config
    from eagle3ray.extract import plan_units
    from eagle3ray.artifacts import read_conversations
    from eagle3ray.serving_engine import ServingEngine
    from eagle3ray.verifier import VerifierEngine, VerifierSpec

    cfg = load_config(a.config, a.overrides)
    _, tab = read_conversations(storage.run_paths(cfg))
    ids_all, masks = tab.column("input_ids").to_pylist(), tab.column("loss_mask").to_pylist()
    prompts = [ids[:m.index(1)] if 1 in m else ids for ids, m in zip(ids_all, masks)][:a.prompts]
    samples = [{"sample_id": str(i), "input_ids": ids} for i, ids in enumerate(ids_all[:a.samples])]
    units = plan_units(samples, cfg.extract.max_tokens_per_batch)
    tokens = sum(len(s["input_ids"]) for s in samples)
    spec0, v = VerifierSpec.from_config(cfg), cfg.verifier
    res: dict[str, dict[str, list[float]]] = {}
    for r in range(a.rounds):
        for dt in a.dtypes.split(","):
            rr = res.setdefault(dt, {"decode": [], "extract": []})
            eng = ServingEngine(spec0.model_path, dtype=dt, max_model_len=v.max_model_len,
                                max_num_seqs=len(prompts), cpu_kv_cache_gib=v.cpu_kv_cache_gib, seed=v.seed,
                                device=v.device, cpu_threads=v.cpu_threads)
            out = eng.generate(prompts, cfg.data.max_new_tokens, 0.0)
            rr["decode"].append(out["output_tokens"] / out["seconds"])
            del eng
            gc.collect()
            ex = VerifierEngine(dataclasses.replace(spec0, dtype=dt))
            t = time.time()
            for u in units:
                ex.extract(u, cfg.extract.storage_dtype)
            rr["extract"].append(tokens / (time.time() - t))
            del ex
            gc.collect()
            print(f"round {r} {dt:9s}: regeneration {rr['decode'][-1]:6.0f} output tok/s "
                  f"({len(prompts)} prompts x <= {cfg.data.max_new_tokens}), extraction {rr['extract'][-1]:6.0f} "
                  f"tok/s ({len(samples)} samples, {tokens} tokens)", flush=True)
    med = {dt: {k: statistics.median(x) for k, x in d.items()} for dt, d in res.items()}
    for dt, m in med.items():
        print(f"median {dt:9s}: regeneration {m['decode']:.0f} tok/s, extraction {m['extract']:.0f} tok/s")
    names = list(med)
    if len(names) == 2:
        x, y = med[names[1]], med[names[0]]
        print(f"ratio {names[1]}/{names[0]}: regeneration {x['decode'] / y['decode']:.2f}, "
              f"extraction {x['extract'] / y['extract']:.2f}")


if __name__ == "__main__":
    main()
