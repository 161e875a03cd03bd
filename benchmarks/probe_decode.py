"""Benchmark: the plan probe's decode measurement with 32-token prompts (before) and 8-token prompts (now).

:func:`eagle3ray.plan.decode_rate` decodes ``batch`` prompts for 18 and for 2 tokens and divides 16 x batch tokens by
the difference. Both calls prefill every prompt (the verifier's engines run without prefix caching), so at
regeneration's batch of 256 the prompts' length is most of the measurement's cost. This runs the product's
functions (:func:`eagle3ray.plan.probe_prompts`, :func:`~eagle3ray.plan.probe_engine`,
:func:`~eagle3ray.plan.generation_timer`, :func:`~eagle3ray.plan.decode_rate`) on one engine, the two prompt
lengths alternating over ``--rounds``, at regeneration's batch (``verifier.max_num_seqs``) and validation's, and
prints per variant the median rate (tokens/s), the median wall seconds the measurement took, and the ratios.

    .venv/bin/python benchmarks/probe_decode.py                   # the embedded default config, 3 rounds
    .venv/bin/python benchmarks/probe_decode.py --rounds 5 --prompt-tokens 32,8
    .venv/bin/python benchmarks/probe_decode.py --rounds 8 --prompt-tokens 8 --tokens 16,48 --batches validation

``--tokens`` compares how many tokens each measurement decodes (the rate is their difference over two calls, so a
short window is more exposed to the machine's hiccups); the summary gives each variant's spread over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default=None, help="run config (default: the embedded default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", default="32,8", help="prompt lengths to compare (the first is the reference)")
    ap.add_argument("--tokens", default="16", help="decoded tokens per measurement to compare (decode_rate's "
                    "``tokens``; the first is the reference), e.g. 16,48")
    ap.add_argument("--batches", default="regeneration,validation", help="which batches to measure")
    ap.add_argument("overrides", nargs="*", help="config overrides (dotted key=value)")
    args = ap.parse_args()

    from eagle3ray import plan
    from eagle3ray.config import load_config
    from eagle3ray.machine import cpu_flags
    from eagle3ray.verifier import VerifierSpec

    cfg = load_config(args.config, args.overrides)
    spec = VerifierSpec.from_config(cfg)
    flags = cpu_flags()
    print(f"machine: {plan._cpu_model()}, amx_bf16 {'amx_bf16' in flags}, avx512_bf16 {'avx512_bf16' in flags}, "
          f"verifier dtype {cfg.verifier.dtype}", flush=True)
    prompts, _ = plan.probe_prompts(cfg, spec)
    eng = plan.probe_engine(cfg, spec)
    gen = plan.generation_timer(eng)
    gen(prompts[:4], 2)  # warm-up, as the probe does
    batches = {"regeneration": max(1, cfg.verifier.max_num_seqs),
               "validation": max(1, min(cfg.validation.max_num_seqs, cfg.validation.max_prompts))}
    batches = {k: v for k, v in batches.items() if k in args.batches.split(",")}
    lengths = [int(x) for x in args.prompt_tokens.split(",")]
    decoded = [int(x) for x in args.tokens.split(",")]
    variants = [(n, k) for n in lengths for k in decoded]
    rates: dict = {}
    walls: dict = {}
    for r in range(args.rounds):
        for name, batch in batches.items():
            for n, k in (variants if r % 2 == 0 else variants[::-1]):  # alternate the order between rounds
                t = time.perf_counter()
                rate = plan.decode_rate(gen, prompts, batch, prompt_tokens=n, tokens=k)
                wall = time.perf_counter() - t
                rates.setdefault((name, n, k), []).append(rate)
                walls.setdefault((name, n, k), []).append(wall)
                print(f"round {r} {name:12s} batch {batch:3d} prompts of {n:2d} tokens, {k:2d} decoded: {rate:7.1f} "
                      f"tok/s, measured in {wall:5.1f} s", flush=True)
    ref = variants[0]
    for name, batch in batches.items():
        for n, k in variants:
            rs = rates[(name, n, k)]
            rate, wall = statistics.median(rs), statistics.median(walls[(name, n, k)])
            r_rate = rate / statistics.median(rates[(name, *ref)])
            r_wall = wall / statistics.median(walls[(name, *ref)])
            print(f"median {name:12s} batch {batch:3d} prompts of {n:2d} tokens, {k:2d} decoded: {rate:7.1f} tok/s "
                  f"(x{r_rate:.2f} of {ref[0]}/{ref[1]}; rounds' min/max {min(rs) / rate:.2f}/{max(rs) / rate:.2f} of "
                  f"the median), measured in {wall:5.1f} s (x{r_wall:.2f})")


if __name__ == "__main__":
    main()
