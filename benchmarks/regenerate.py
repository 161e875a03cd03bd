"""Benchmark: answer regeneration on the verifier service's engine vs a dedicated plain vLLM engine.

Both go through :func:`eagle3ray.prepare.answer_engine` (the code ``prepare`` runs), on the first
``--prompts`` user prompts of a run's conversations, ``data.max_new_tokens`` new tokens each, sent
``verifier.max_num_seqs`` at a time. The service's engine carries vLLM's ``extract_hidden_states``
speculative method (every decode step also runs its one "draft" token); the dedicated engine is a
plain ``LLM`` (in-process on CPU with TP 1). Prints load and decode seconds per mode and round, the
median ratio dedicated/service, and whether the greedy answers are identical. Each round stops
the service first, so both modes load their engine.

    .venv/bin/python benchmarks/regenerate.py run.name=c1 --prompts 256 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="config overrides (run.name=... picks the conversations)")
    ap.add_argument("-c", "--config", default=None)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()

    import ray

    from eagle3ray import storage
    from eagle3ray.config import load_config
    from eagle3ray.artifacts import read_conversations
    from eagle3ray.prepare import answer_engine
    from eagle3ray.machine import ensure_ray
    from eagle3ray.verifier_service import stop_verifier
    from eagle3ray.verifier import VerifierSpec

    res: dict[str, list[dict]] = {"service": [], "dedicated": []}
    texts: dict[str, list[str]] = {}
    for r in range(a.rounds):
        for mode in res:
            cfg = load_config(a.config, list(a.overrides) + [f"data.regenerate_engine={mode}"])
            _, tab = read_conversations(storage.run_paths(cfg))
            prompts = []
            for ids, mask in zip(tab.column("input_ids").to_pylist(), tab.column("loss_mask").to_pylist()):
                prompts.append(ids[:mask.index(1)] if 1 in mask else ids)
            prompts = prompts[:a.prompts]
            spec = VerifierSpec.from_config(cfg)
            ensure_ray(cfg)
            stop_verifier(spec)
            chunk = cfg.verifier.max_num_seqs
            t0 = time.time()
            with answer_engine(cfg, spec) as generate:
                generate(prompts[:1], 0)  # the service loads lazily: time its load here, as prepare pays it
                t1 = time.time()
                out = []
                for i in range(0, len(prompts), chunk):
                    out += generate(prompts[i:i + chunk], cfg.data.seed)
                t2 = time.time()
            stop_verifier(spec)
            texts[mode] = out
            res[mode].append({"load_s": t1 - t0, "decode_s": t2 - t1})
            print(f"round {r} {mode:9s}: load {t1 - t0:6.1f} s, {len(prompts)} answers x <= "
                  f"{cfg.data.max_new_tokens} tokens {t2 - t1:6.1f} s", flush=True)
    med = {m: {k: statistics.median(x[k] for x in v) for k in ("load_s", "decode_s")} for m, v in res.items()}
    for m, v in med.items():
        print(f"median {m:9s}: load {v['load_s']:.1f} s, decode {v['decode_s']:.1f} s")
    print(f"ratio dedicated/service: load {med['dedicated']['load_s'] / med['service']['load_s']:.2f}, "
          f"decode {med['dedicated']['decode_s'] / med['service']['decode_s']:.2f}")
    same = sum(x == y for x, y in zip(texts["service"], texts["dedicated"]))
    print(f"identical greedy answers: {same}/{len(texts['service'])}")
    ray.shutdown()


if __name__ == "__main__":
    main()
