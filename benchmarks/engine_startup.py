"""Benchmark: a CPU vLLM generation engine built with vLLM's processes vs in-process (``cpu_engine_options``).

Each mode runs in a fresh subprocess (vLLM reads ``VLLM_ENABLE_V1_MULTIPROCESSING`` once per process):
``LLM()`` construction time and one greedy generation (40 prompts x 64 new tokens) on the config's
verifier, modes interleaved, ``--rounds`` times; prints medians and the ratios to the default.
``in-process-1-thread`` is what a Ray actor with ``num_cpus=1`` got before ``cpu_engine_options``
pinned the thread count: Ray sets ``OMP_NUM_THREADS`` to the actor's CPUs.

    .venv/bin/python benchmarks/engine_startup.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def one(mode: str, model: str) -> dict:
    from eagle3ray.serving_engine import cpu_engine_options

    kw = dict(model=model, dtype="float32", max_model_len=2048, enforce_eager=True, max_num_seqs=40, seed=0)
    if mode == "in-process":
        kw.update(cpu_engine_options("cpu", 1))
    elif mode == "in-process-1-thread":
        kw.update(cpu_engine_options("cpu", 1, cpu_threads=1))
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(**kw)
    t1 = time.time()
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}] * 40, SamplingParams(max_tokens=64, temperature=0),
                 use_tqdm=False)
    return {"llm_s": t1 - t0, "generate_s": time.time() - t1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    from eagle3ray.config import load_config
    from eagle3ray.verifier import VerifierSpec

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    model = VerifierSpec.from_config(load_config(a.config, [])).model_path
    if a.child:
        print("RESULT " + json.dumps(one(a.child, model)), flush=True)
        return
    res: dict[str, list[dict]] = {"default": [], "in-process": [], "in-process-1-thread": []}
    for r in range(a.rounds):
        for mode in res:
            cmd = [sys.executable, __file__, "--child", mode] + (["-c", a.config] if a.config else [])
            env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if mode.endswith("1-thread") else {})}
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env).stdout
            m = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            res[mode].append(m)
            print(f"round {r} {mode:19s}: LLM() {m['llm_s']:.1f} s, generate 40 x 64 {m['generate_s']:.1f} s",
                  flush=True)
    med = {mode: {k: statistics.median(x[k] for x in v) for k in ("llm_s", "generate_s")} for mode, v in res.items()}
    for mode, m in med.items():
        print(f"median {mode:19s}: LLM() {m['llm_s']:.1f} s, generate {m['generate_s']:.1f} s")
    for mode in ("in-process", "in-process-1-thread"):
        print(f"ratio {mode}/default: LLM() {med[mode]['llm_s'] / med['default']['llm_s']:.2f}, "
              f"generate {med[mode]['generate_s'] / med['default']['generate_s']:.2f}")


if __name__ == "__main__":
    main()
