"""Object storage end to end (issue 16, item 7): every stage on the local S3 endpoint (moto on 127.0.0.1), with
an extraction interrupted and resumed there and a training whose worker dies and resumes from its S3 checkpoint;
then export, the vLLM compatibility check and validation read the run from S3 through ``run.endpoint_url``.

The verifier is the shared tiny vLLM engine of tests/test_extract.py (same identity: the service is reused).
"""

from __future__ import annotations

import boto3
import pytest

from eagle3ray import blocks, storage
from eagle3ray.extract import extract
from eagle3ray.pipeline import run_stage
from eagle3ray.prepare import prepare
from eagle3ray.train import train
from eagle3ray.train_worker import WorkerHooks
from eagle3ray.vocab import build_vocab

from conftest import write_chat_jsonl
from test_extract import _convs, interrupt_after

pytestmark = pytest.mark.slow


def test_every_stage_runs_on_s3_with_an_extraction_resumed_and_training_resumed_there(ray_session, tmp_path,
                                                                                      make_cfg, s3_endpoint):
    train_file = write_chat_jsonl(tmp_path / "train.jsonl", _convs(32, words=20, seed=11))
    cfg = make_cfg([train_file], f"run.endpoint_url={s3_endpoint}", "extract.max_tokens_per_batch=256",
                   "vocab.draft_vocab_size=512", "train.num_workers=1", "train.max_steps=6",
                   "train.checkpoint_every=3", "train.max_tokens_per_batch=256", "train.max_failures=1",
                   "train.val_fraction=0.2", "validation.max_prompts=4", "validation.max_new_tokens=16",
                   "validation.max_num_seqs=4", storage="s3://eagle3ray/e2e")
    prepare(cfg)

    interrupt_after(cfg, 2)
    s = extract(cfg, progress=False)  # resumed on S3
    assert s.resumed_from >= 2 and s.total_samples == 32
    paths = storage.run_paths(cfg)
    man, _ = blocks.read_committed(paths.fs, paths.hidden_states)
    ids = blocks.committed_sample_ids(paths.fs, paths.hidden_states, man)
    assert man["complete"] and sorted(ids) == sorted(f"chat:c{i}" for i in range(32))
    build_vocab(cfg)
    t = train(cfg, hooks=WorkerHooks(fail_at_step=5), progress=False)  # the worker dies; resumes from S3
    assert t.steps == 6 and t.resumed_from == 3 and t.checkpoint
    run_stage(cfg, "export")
    rep = run_stage(cfg, "check")
    assert rep.ok, rep.problems
    v = run_stage(cfg, "validate")
    assert v["temperatures"][0]["mean_acceptance_length"] >= 1.0
    keys = {o["Key"] for page in boto3.client("s3", endpoint_url=s3_endpoint).get_paginator("list_objects_v2")
            .paginate(Bucket="eagle3ray", Prefix="e2e/t/") for o in page.get("Contents", [])}
    for want in ("e2e/t/hidden_states/manifest.json", "e2e/t/export/config.json", "e2e/t/reports/validate.json",
                 "e2e/t/checkpoints/complete.json"):
        assert want in keys, sorted(keys)[:40]
