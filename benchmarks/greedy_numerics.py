"""Benchmark: do the verifier's greedy outputs depend on how requests are batched, per compute dtype?

Validation compares greedy outputs with and without the draft; speculative decoding verifies k+1
tokens per sequence in one step where plain decoding runs one, so the verifier's matmuls see other
shapes. This checks the same effect with no draft at all: the plain verifier on the validation's
MT-Bench prompts, ``validation.max_new_tokens`` greedy tokens, once with all prompts in flight
(``validation.max_num_seqs``) and once with ``--small-batch`` in flight, per dtype. Prints how many
outputs are identical between the two batchings and how many tokens the first difference comes after.

    .venv/bin/python benchmarks/greedy_numerics.py --dtypes float32,bfloat16
"""

from __future__ import annotations

import argparse
import gc
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("-c", "--config", default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--small-batch", type=int, default=7, help="sequences in flight in the second batching")
    a = ap.parse_args()

    from eagle3ray.config import load_config
    from eagle3ray.serving_engine import ServingEngine
    from eagle3ray.validate import eval_prompt_ids
    from eagle3ray.verifier import VerifierSpec

    cfg = load_config(a.config, a.overrides)
    spec, v, vc = VerifierSpec.from_config(cfg), cfg.verifier, cfg.validation
    prompts, name, _ = eval_prompt_ids(spec.model_path, vc.eval, vc.max_prompts, vc.balance_categories)
    for dtype in a.dtypes.split(","):
        outs = {}
        for seqs in (vc.max_num_seqs, a.small_batch):
            eng = ServingEngine(spec.model_path, dtype=dtype, max_model_len=v.max_model_len,
                                max_num_seqs=seqs, cpu_kv_cache_gib=v.cpu_kv_cache_gib, seed=v.seed,
                                device=v.device, cpu_threads=v.cpu_threads)
            outs[seqs] = eng.generate(prompts, vc.max_new_tokens, 0.0)["outputs"]
            del eng
            gc.collect()
        x, y = outs[vc.max_num_seqs], outs[a.small_batch]
        same = sum(p == q for p, q in zip(x, y))
        first = [next((i for i, (s, t) in enumerate(zip(p, q)) if s != t), min(len(p), len(q)))
                 for p, q in zip(x, y) if p != q]
        print(f"{dtype:9s}: {same}/{len(x)} greedy outputs identical with {vc.max_num_seqs} vs {a.small_batch} "
              f"sequences in flight ({name}, {vc.max_new_tokens} tokens)"
              + (f"; first difference after a median of {statistics.median(first):.0f} tokens" if first else ""),
              flush=True)


if __name__ == "__main__":
    main()
