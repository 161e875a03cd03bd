"""Benchmark: a run's draft, scored offline by replaying greedy speculative decoding on extracted blocks.

For each sample of the evaluation blocks (the verifier's own greedy answers and their hidden states)
the draft proposes k tokens at every answer position, teacher-forced as in training (speculators'
``Eagle3DraftModel`` forward over k TTT steps, draft ids mapped to verifier ids with d2t); a proposal
is accepted up to its first token that differs from the verifier's next token. Walking each answer
the way vLLM does (draft at a position, advance by accepted + 1) gives the mean acceptance length
``1 + accepted / drafts`` and the acceptance per position that ``eagle3ray validate`` reads from
vLLM's counters; "all positions" is the same mean over every answer position instead of the walk.

On the default run's draft and the 40 validation prompts this gave 1.4505 (0.3207, 0.1036, 0.0262;
3090 drafts) against vLLM's 1.4528 (0.321, 0.105, 0.027; 3094 drafts), so draft changes can be
compared in seconds on prompts that were never trained on, without starting vLLM twice.

Evaluation blocks: write prompts as chat JSONL (``--write-prompts``), then let the pipeline answer and
extract them in a run of their own (regenerated greedily, no held-out filter):

    .venv/bin/python benchmarks/offline_acceptance.py --write-prompts /tmp/mtdev.jsonl --prompts 40:80
    .venv/bin/eagle3ray prepare run.name=mtdev 'data.train=[{kind: chat, path: /tmp/mtdev.jsonl}]' \\
        'data.eval=[]' data.max_samples=40 data.max_new_tokens=128 data.max_prompt_tokens=1024 \\
        verifier.max_num_seqs=40
    .venv/bin/eagle3ray extract run.name=mtdev 'data.train=[{kind: chat, path: /tmp/mtdev.jsonl}]' \\
        'data.eval=[]' data.max_samples=40 data.max_new_tokens=128 data.max_prompt_tokens=1024 \\
        verifier.max_num_seqs=40
    .venv/bin/python benchmarks/offline_acceptance.py run.name=smollm2-135m-cpu --blocks runs/mtdev -k 3

MT-Bench prompts 0:40 are the ones validate uses; 40:80 make a development set that validate never sees.
"""

from __future__ import annotations

import argparse
import json


def write_prompts(path: str, cfg, span: str) -> None:
    from eagle3ray.sources import first_turn_prompts

    lo, hi = (int(x) for x in span.split(":"))
    convs, _ = first_turn_prompts(cfg.validation.eval, hi)
    with open(path, "w") as f:
        for i, c in enumerate(convs[lo:hi]):
            # the placeholder answer is replaced by the verifier's own (data.regenerate)
            f.write(json.dumps({"id": f"eval{lo + i}", "messages": c + [{"role": "assistant", "content": "-"}]})
                    + "\n")
    print(f"wrote {hi - lo} prompts to {path}")


def simulate(cfg, blocks_root: str, k: int, checkpoint: str | None = None) -> dict:
    """Greedy speculative decoding replayed offline; see the module docstring. Returns the figures."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import load as st_load
    from speculators.train.data import CollateFn

    from eagle3ray import storage
    from eagle3ray.draft import TRAINABLE_FILE, build_draft
    from eagle3ray.train_worker import pack_rows, row_to_sample
    from eagle3ray.verifier import VerifierSpec
    from eagle3ray.artifacts import load_vocab

    paths = storage.run_paths(cfg)
    best = storage.read_json(paths.fs, f"{paths.sub('checkpoints')}/best.json")
    ckpt = checkpoint or best["checkpoint"]
    spec = VerifierSpec.from_config(cfg)
    d2t, t2d = load_vocab(paths)
    d2t = torch.as_tensor(d2t, dtype=torch.long)
    tc = cfg.train.model_dump()
    tc["ttt_steps"] = k
    draft = build_draft(spec.model_path, spec.layer_ids[:-1], d2t, t2d, tc)
    with paths.fs.open(f"{ckpt}/{TRAINABLE_FILE}", "rb") as f:
        draft.load_state_dict(st_load(f.read()), strict=False)
    draft.eval()
    with open(f"{blocks_root}/hidden_states/manifest.json") as f:
        man = json.load(f)
    if not man.get("complete"):
        raise SystemExit(f"{blocks_root}/hidden_states: extraction not complete")
    rows = [(r["sample_id"], row_to_sample(r)) for b in man["blocks"]
            for r in pq.read_table(f"{blocks_root}/hidden_states/{b['path']}").to_pylist()]
    collate = CollateFn(4096, spec.model_identity["hidden_size"], len(spec.layer_ids) - 1, dtype=torch.float32)
    walk, every = [], []
    with torch.no_grad():
        for group in pack_rows(rows, 4096):
            samples = [s for _, s in group]
            batch = {n: v for n, v in collate(samples).items()
                     if isinstance(v, torch.Tensor) and n != "verifier_last_hidden_states"}
            preds = draft(**batch, ttt_steps=k)  # k x [1, 4096] draft-vocabulary ids
            off = 0
            for s in samples:
                T, ids = int(s["lengths"][0]), s["input_ids"]
                accepted = np.zeros(T, dtype=int)
                alive = np.ones(T, dtype=bool)
                for j in range(k):  # step j at position t proposes input_ids[t + 1 + j]
                    p = preds[j][0, off:off + T]
                    ok = np.zeros(T, dtype=bool)
                    ok[:T - 1 - j] = ((p + d2t[p])[:T - 1 - j] == ids[1 + j:]).numpy()
                    alive &= ok
                    accepted += alive
                off += T
                starts = [t for t in np.nonzero(s["loss_mask"].numpy())[0] if t + k < T]
                if not starts:
                    continue
                every += [1 + accepted[t] for t in starts]
                t = starts[0]
                while t + k < T:
                    walk.append(1 + accepted[t])
                    t += accepted[t] + 1
    walk_a = np.array(walk)
    return {"mean_acceptance_length": round(float(walk_a.mean()), 4), "drafts": len(walk),
            "acceptance_per_position": [round(float((walk_a > j + 1).mean()), 4) for j in range(k)],
            "all_positions_mean": round(float(np.mean(every)), 4), "checkpoint": ckpt, "samples": len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default=None)
    ap.add_argument("overrides", nargs="*", help="config overrides naming the run whose draft is scored")
    ap.add_argument("--blocks", help="run folder whose hidden_states/ hold the evaluation answers")
    ap.add_argument("-k", type=int, default=3, help="draft tokens per proposal (vLLM num_speculative_tokens)")
    ap.add_argument("--checkpoint", default=None, help="checkpoint folder (default: the run's best)")
    ap.add_argument("--write-prompts", default=None, help="write validation prompts as chat JSONL and exit")
    ap.add_argument("--prompts", default="0:40", help="with --write-prompts: which prompts, lo:hi")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    a = ap.parse_args()
    from eagle3ray.config import load_config

    cfg = load_config(a.config, a.overrides)
    if a.write_prompts:
        write_prompts(a.write_prompts, cfg, a.prompts)
        return
    if not a.blocks:
        ap.error("--blocks is required")
    import torch

    torch.set_num_threads(a.threads)
    print(json.dumps(simulate(cfg, a.blocks, a.k, a.checkpoint)))


if __name__ == "__main__":
    main()
