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

MT-Bench prompts 0:40 are the ones validate uses (balanced over the categories, as validate takes them);
40:80 make a development set that validate never sees.

At a temperature T > 0 (``--temperature``) acceptance follows vLLM's rule for a greedy draft (its rejection
sampler treats the draft's distribution as one-hot): draft token x at a position is accepted with the
verifier's probability p_T(x) = softmax(logits / T)[x], and a proposal stops at its first rejection. The
verifier's logits come from the blocks' final pre-norm states through the verifier's own final norm and LM head
(transformers, the same weights). The approximation: both the draft's proposals and the verifier's
distributions are taken along the block's greedy answer (teacher-forced, as in training), where vLLM's
sampled answers wander off it. Reported: the expected acceptance over every answer position
(``all_positions_mean``, exact under that approximation) and a Monte Carlo walk that advances by the sampled
acceptance + 1 as vLLM does (``mean_acceptance_length``, 16 seeds). At T = 0 both reduce to the greedy replay.
"""

from __future__ import annotations

import argparse
import json


def write_prompts(path: str, cfg, span: str) -> None:
    from eagle3ray.sources import first_turn_prompts

    lo, hi = (int(x) for x in span.split(":"))
    convs = first_turn_prompts(cfg.validation.eval, hi, cfg.validation.balance_categories).convs
    with open(path, "w") as f:
        for i, c in enumerate(convs[lo:hi]):
            # the placeholder answer is replaced by the verifier's own (data.regenerate)
            f.write(json.dumps({"id": f"eval{lo + i}", "messages": c + [{"role": "assistant", "content": "-"}]})
                    + "\n")
    print(f"wrote {hi - lo} prompts to {path}")


def verifier_head(model_path: str):
    """The verifier's final norm and LM head (transformers): final pre-norm states [T, H] -> logits [T, V]."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    norm, head = m.model.norm, m.get_output_embeddings()

    def logits(h):
        with torch.no_grad():
            return head(norm(h.float()))
    return logits


def simulate(cfg, blocks_root: str, k: int, checkpoint: str | None = None, temperature: float = 0.0,
             seeds: int = 16) -> dict:
    """Speculative decoding replayed offline (greedy, or vLLM's rule at ``temperature``); see the module
    docstring. Returns the figures."""
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
    walk, every, every_pos = [], [], []
    rng = np.random.default_rng(0)
    walks = [[] for _ in range(seeds)] if temperature > 0 else []
    logits_of = verifier_head(spec.model_path) if temperature > 0 else None
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
                chain = np.ones(T)  # T > 0: probability that steps 0..j were all accepted
                chains = []
                if temperature > 0:
                    # logits[t] (from the shifted final state of token t+1) predict input_ids[t + 1]
                    probs = torch.softmax(logits_of(s["verifier_last_hidden_states"]) / temperature, dim=-1)
                for j in range(k):  # step j at position t proposes input_ids[t + 1 + j]
                    p = preds[j][0, off:off + T]
                    ok = np.zeros(T, dtype=bool)
                    ok[:T - 1 - j] = ((p + d2t[p])[:T - 1 - j] == ids[1 + j:]).numpy()
                    alive &= ok
                    accepted += alive
                    if temperature > 0:
                        pj = np.zeros(T)
                        v = (p + d2t[p])[:T - 1 - j]
                        pj[:T - 1 - j] = probs[torch.arange(j, T - 1), v].numpy()
                        chain = chain * pj
                        chains.append(chain)
                off += T
                starts = [t for t in np.nonzero(s["loss_mask"].numpy())[0] if t + k < T]
                if not starts:
                    continue
                every += [1 + accepted[t] for t in starts]
                t = starts[0]
                while t + k < T:
                    walk.append(1 + accepted[t])
                    t += accepted[t] + 1
                if temperature > 0:
                    every_pos += [[float(c[t]) for c in chains] for t in starts]
                    step_p = [np.divide(chains[j], chains[j - 1], out=np.zeros(T), where=chains[j - 1] > 0)
                              if j else chains[0] for j in range(k)]
                    for w in walks:  # vLLM's walk with sampled acceptance
                        t = starts[0]
                        while t + k < T:
                            a = 0
                            while a < k and rng.random() < step_p[a][t]:
                                a += 1
                            w.append(a)
                            t += a + 1
    walk_a = np.array(walk)
    out = {"temperature": temperature, "mean_acceptance_length": round(float(walk_a.mean()), 4),
           "drafts": len(walk), "acceptance_per_position": [round(float((walk_a > j + 1).mean()), 4) for j in range(k)],
           "all_positions_mean": round(float(np.mean(every)), 4), "checkpoint": ckpt, "samples": len(rows)}
    if temperature > 0:
        w = np.concatenate([np.array(x) for x in walks])
        e = np.array(every_pos)  # [positions, k]: P(steps 0..j accepted)
        out.update({
            "mean_acceptance_length": round(float(1 + w.mean()), 4), "drafts": round(len(w) / seeds),
            "acceptance_per_position": [round(float((w > j).mean()), 4) for j in range(k)],
            "all_positions_mean": round(float(1 + e.sum(1).mean()), 4),
            "all_positions_per_position": [round(float(x), 4) for x in e.mean(0)],
            "greedy_replay": {"mean_acceptance_length": round(float(walk_a.mean()), 4),
                              "all_positions_mean": round(float(np.mean(every)), 4)}, "seeds": seeds})
    return out


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
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0],
                    help="sampling temperatures to score at (vLLM's rule for a greedy draft; see above)")
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
    for t in a.temperature:
        print(json.dumps(simulate(cfg, a.blocks, a.k, a.checkpoint, temperature=t)))


if __name__ == "__main__":
    main()
