"""Extraction end to end on a tiny random verifier served by vLLM (CPU) through Ray Serve + Ray Data.

One Ray cluster and one verifier engine serve every test here (same identity -> the Serve app is
reused), so the engine loads once per session.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from eagle3ray import blocks, storage
from eagle3ray.extract import extract, plan_units
from eagle3ray.prepare import prepare
from eagle3ray.sources import read_mtbench

from conftest import TINY_AUX, write_chat_jsonl

pytestmark = pytest.mark.slow


def _convs(n: int, words: int = 20, seed: int = 0) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    vocab = "alpha beta gamma delta eagle ray draft verifier token layer hidden state vllm train".split()
    out = []
    for i in range(n):
        q = " ".join(rng.choice(vocab, size=words)) + f" question {i}?"
        a = " ".join(rng.choice(vocab, size=int(words * 1.5))) + f" answer {i}."
        out.append([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
    return out


def _committed_rows(cfg) -> list[dict]:
    paths = storage.run_paths(cfg)
    man, files = blocks.read_committed(paths.fs, paths.hidden_states)
    rows = []
    for f in files:
        with paths.fs.open(f, "rb") as fh:
            rows.extend(pq.read_table(fh).to_pylist())
    return rows


def _hf_states(model_dir: str, input_ids: list[int], layer_ids: list[int]) -> np.ndarray:
    """[T, L, H] from a transformers forward: hidden_states[i] for aux ids, last layer pre-norm for id L."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    captured = {}

    def hook(_m, _inp, out):
        captured["prenorm"] = out[0] if isinstance(out, tuple) else out

    h = model.model.layers[-1].register_forward_hook(hook)
    with torch.no_grad():
        out = model(torch.tensor([input_ids]), output_hidden_states=True)
    h.remove()
    L = model.config.num_hidden_layers
    per_layer = []
    for i in layer_ids:
        per_layer.append(captured["prenorm"][0] if i == L else out.hidden_states[i][0])
    # transformers' hidden_states[L] is after the final norm: make sure the test would notice a mix-up.
    assert not torch.allclose(out.hidden_states[L][0], captured["prenorm"][0], atol=1e-3)
    return torch.stack(per_layer, dim=1).numpy()  # shape: [T, L, H]


def test_states_match_transformers_per_layer_in_shared_batches(ray_session, tmp_path, make_cfg, tiny_verifier):
    train = write_chat_jsonl(tmp_path / "train.jsonl", _convs(12))
    cfg = make_cfg([train])
    prepare(cfg)
    s = extract(cfg, progress=False)
    assert s.samples == 12 and s.total_samples == 12
    man = storage.read_json(*_man(cfg))
    assert man["complete"] and man["layer_ids"] == TINY_AUX + [8]
    assert max(b["rows"] for b in man["blocks"]) > 1, "samples must share engine batches for this test"
    rows = _committed_rows(cfg)
    assert sorted(r["sample_id"] for r in rows) == sorted(f"chat:c{i}" for i in range(12))
    for r in rows[:6]:
        got = blocks.decode_states(r)  # bf16 -> fp32, shape: [T, 4, 128]
        want = _hf_states(tiny_verifier, r["input_ids"], man["layer_ids"])
        assert got.shape == want.shape == (r["seq_len"], 4, 128)
        for j, lid in enumerate(man["layer_ids"]):
            scale = np.abs(want[:, j]).max()
            err = np.abs(got[:, j] - want[:, j]).max()
            assert err <= 1e-2 * scale + 1e-3, f"{r['sample_id']} layer {lid}: max err {err} (scale {scale})"
    # The pipeline's own audit passed on these states and recorded each layer's error.
    audit = man["audit"]
    assert audit["passed"] and len(audit["samples"]) == 2 and audit["tokens"] > 0
    assert list(audit["layers"]) == [str(i) for i in man["layer_ids"]]
    assert all(v["nearest_layer"] == int(i) and v["mean_rel_err"] < audit["tolerance"]
               for i, v in audit["layers"].items())
    assert "passed on 2 samples" in dict(s.rows())["audit vs transformers (mean / max relative error per layer)"]
    # Loss-masked token frequencies agree with the stored masks.
    paths = storage.run_paths(cfg)
    from eagle3ray.artifacts import load_token_frequencies

    freq = load_token_frequencies(paths)
    assert freq.sum() == sum(sum(r["loss_mask"]) for r in rows) == man["counts"]["loss_tokens"]


def _man(cfg):
    paths = storage.run_paths(cfg)
    return paths.fs, f"{paths.hidden_states}/manifest.json"


def test_token_budget_is_never_exceeded(ray_session, tmp_path, make_cfg):
    from ray import serve

    from eagle3ray.verifier_service import app_name
    from eagle3ray.verifier import VerifierSpec

    train = write_chat_jsonl(tmp_path / "train.jsonl", _convs(60, words=30, seed=1))
    cfg = make_cfg([train])
    prepare(cfg)
    handle = None
    before, busy_before = 0, 0.0
    try:
        handle = serve.get_app_handle(app_name(VerifierSpec.from_config(cfg)))
        info = handle.info.remote().result()
        before, busy_before = len(info["batch_tokens"]), info["extract_seconds"]
    except Exception:
        pass
    s = extract(cfg, progress=False)
    budget = cfg.extract.max_tokens_per_batch
    man = storage.read_json(*_man(cfg))
    assert s.tokens > 5 * budget, "the test needs far more tokens than one batch"
    assert all(b["tokens"] <= budget for b in man["blocks"])
    handle = serve.get_app_handle(app_name(VerifierSpec.from_config(cfg)))
    info = handle.info.remote().result()
    calls = info["batch_tokens"][before:] if before else info["batch_tokens"]
    assert len(calls) >= len(man["blocks"]) and max(calls) <= budget
    assert info["identity"]["max_num_batched_tokens"] == budget  # the engine's own step cap
    # the replica's time inside extract calls (benchmarks/extract.py splits the pipeline's gap with it): some of the
    # stage's loop, never more of it (the first unit's call may start just before the loop's clock)
    busy = info["extract_seconds"] - busy_before
    assert 0 < busy <= s.wall_seconds


def test_bad_input_is_counted_and_nothing_is_lost(ray_session, tmp_path, make_cfg):
    good = _convs(5, seed=2)
    path = tmp_path / "mixed.jsonl"
    with open(path, "wb") as f:
        for i, msgs in enumerate(good[:3]):
            f.write((json.dumps({"id": f"g{i}", "messages": msgs}) + "\n").encode())
        f.write(b'{"id": "broken", "messages": [\n')  # malformed JSON line
        f.write(b'{"id": "empty", "messages": []}\n')  # empty conversation
        f.write(b'{"id": "noanswer", "messages": [{"role": "user", "content": "hello?"}]}\n')  # no assistant turn
        f.write(b'{"id": "latin1", "messages": [{"role": "user", "content": "caf\xe9"}]}\n')  # not UTF-8
        long_answer = " ".join(["verifier"] * 700)  # > max_model_len (512) tokens
        f.write((json.dumps({"id": "long", "messages": [{"role": "user", "content": "long?"},
                                                        {"role": "assistant", "content": long_answer}]}) + "\n").encode())
        for i, msgs in enumerate(good[3:], start=3):
            f.write((json.dumps({"id": f"g{i}", "messages": msgs}) + "\n").encode())
    cfg = make_cfg([path])
    p = prepare(cfg)
    assert p.rejected.counts == {"malformed_json": 1, "empty_conversation": 1, "no_assistant_turn": 1,
                                 "invalid_utf8": 1}
    assert any(":4" in e for e in p.rejected.examples["malformed_json"])  # names file and line
    s = extract(cfg, progress=False)
    assert s.rejected["extract"]["counts"] == {"too_long": 1}
    assert "chat:long" in s.rejected["extract"]["examples"]["too_long"][0]
    man = storage.read_json(*_man(cfg))
    assert man["complete"]
    assert man["rejected"]["prepare"]["counts"] == p.rejected.counts
    assert sorted(r["sample_id"] for r in _committed_rows(cfg)) == [f"chat:g{i}" for i in range(5)]


def interrupt_after(cfg, n_blocks: int) -> None:
    """Run extract and stop it (an exception from its commit callback) once ``n_blocks`` blocks are committed."""
    def stop(manifest):
        if len(manifest["blocks"]) >= n_blocks:
            raise _Stop()

    with pytest.raises(_Stop):
        extract(cfg, on_commit=stop, progress=False)


class _Stop(Exception):
    pass


def test_interrupted_extraction_resumes_exactly_once(ray_session, tmp_path, make_cfg):
    train = write_chat_jsonl(tmp_path / "train.jsonl", _convs(40, words=25, seed=3))
    cfg = make_cfg([train], "extract.max_tokens_per_batch=512")
    prepare(cfg)

    interrupt_after(cfg, 2)
    paths = storage.run_paths(cfg)
    man, _ = blocks.read_committed(paths.fs, paths.hidden_states)  # the snapshot with the commit log folded in
    assert not man["complete"] and len(man["blocks"]) == 2
    first = {b["path"] for b in man["blocks"]}
    # An interrupted write: a block file that was never committed must not count, and is cleaned up.
    paths = storage.run_paths(cfg)
    orphan = f"{paths.hidden_states}/blocks/part-orphan.parquet"
    with paths.fs.open(f"{paths.hidden_states}/{sorted(first)[0]}", "rb") as src, paths.fs.open(orphan, "wb") as dst:
        dst.write(src.read())
    s = extract(cfg, progress=False)
    assert s.resumed_from > 0 and s.orphans_removed >= 1
    man = storage.read_json(*_man(cfg))
    assert man["complete"] and first <= {b["path"] for b in man["blocks"]}
    ids = [r["sample_id"] for r in _committed_rows(cfg)]
    assert sorted(ids) == sorted(f"chat:c{i}" for i in range(40))  # every sample exactly once
    assert not paths.fs.exists(orphan)
    again = extract(cfg, progress=False)  # a finished run does nothing
    assert again.skipped and again.total_samples == 40



def test_the_storage_limit_stops_extraction_keeping_what_was_committed_and_a_larger_one_resumes(ray_session,
                                                                                                  tmp_path, make_cfg):
    """extract.max_storage_gib holds at runtime, not only in preflight's estimate: past the limit the stage stops
    naming the committed size, the limit and the ways on; the committed blocks stay, and a larger limit resumes."""
    from eagle3ray.extract import StorageLimitExceeded

    train = write_chat_jsonl(tmp_path / "train.jsonl", _convs(24, words=25, seed=8))
    cfg = make_cfg([train], "extract.max_tokens_per_batch=512", "extract.max_storage_gib=0.0001")  # ~105 kB
    prepare(cfg)
    with pytest.raises(StorageLimitExceeded, match=r"extract.max_storage_gib 0.0001: the committed blocks hold "
                                                   r".* GiB after \d+ of 24 samples .*raise the limit"):
        extract(cfg, progress=False)
    paths = storage.run_paths(cfg)
    man, _ = blocks.read_committed(paths.fs, paths.hidden_states)
    assert not man["complete"] and man["blocks"] and man["counts"]["bytes"] > 0.0001 * 2**30
    kept = {b["path"] for b in man["blocks"]}
    s = extract(make_cfg([train], "extract.max_tokens_per_batch=512", "extract.max_storage_gib=1"), progress=False)
    assert s.resumed_from > 0
    man = storage.read_json(*_man(cfg))
    assert man["complete"] and kept <= {b["path"] for b in man["blocks"]}
    assert sorted(r["sample_id"] for r in _committed_rows(cfg)) == sorted(f"chat:c{i}" for i in range(24))


def test_replica_written_blocks_hold_the_same_states_exactly_once(ray_session, tmp_path, make_cfg):
    """extract.block_writer: replica (the replica writes each block) with two writers per replica gives the same
    committed samples and states as the default path, where the states travel to a Ray Data writer actor."""
    train = write_chat_jsonl(tmp_path / "train.jsonl", _convs(16, words=20, seed=5))
    base = make_cfg([train], "extract.max_tokens_per_batch=256", "run.name=via-actor")
    via_replica = make_cfg([train], "extract.max_tokens_per_batch=256", "run.name=via-replica",
                           "extract.block_writer=replica", "extract.writers_per_replica=2")
    for cfg in (base, via_replica):
        prepare(cfg)
        assert extract(cfg, progress=False).total_samples == 16
    a = {r["sample_id"]: r for r in _committed_rows(base)}
    b = {r["sample_id"]: r for r in _committed_rows(via_replica)}
    assert len(b) == len(_committed_rows(via_replica)) == 16 and sorted(a) == sorted(b)  # each sample once
    man = storage.read_json(*_man(via_replica))
    assert man["complete"] and len(man["blocks"]) > 2
    for sid, r in a.items():
        assert r["input_ids"] == b[sid]["input_ids"] and r["loss_mask"] == b[sid]["loss_mask"]
        np.testing.assert_allclose(blocks.decode_states(b[sid]), blocks.decode_states(r), rtol=0, atol=1e-2)


@pytest.mark.parametrize("block_writer", ["data_actor", "replica"])
def test_extract_to_s3_on_local_endpoint(ray_session, tmp_path, make_cfg, s3_endpoint, block_writer):
    import boto3

    train = write_chat_jsonl(tmp_path / "train.jsonl", _convs(8, seed=4))
    cfg = make_cfg([train], f"run.endpoint_url={s3_endpoint}", f"extract.block_writer={block_writer}",
                   storage=f"s3://eagle3ray/runs-{block_writer}")
    prepare(cfg)
    s = extract(cfg, progress=False)
    assert s.total_samples == 8
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=s3_endpoint)
            .list_objects_v2(Bucket="eagle3ray", Prefix=f"runs-{block_writer}/t/")["Contents"]]
    assert f"runs-{block_writer}/t/hidden_states/manifest.json" in keys and any("/blocks/part-" in k for k in keys)
    rows = _committed_rows(cfg)
    assert sorted(r["sample_id"] for r in rows) == sorted(f"chat:c{i}" for i in range(8))
    assert all(blocks.decode_states(r).shape[1:] == (4, 128) for r in rows)


def test_plan_units_packs_by_tokens():
    samples = [{"sample_id": str(i), "input_ids": [0] * n} for i, n in enumerate([100, 300, 200, 900, 50, 50])]
    units = plan_units(samples, 500)
    assert [[s["sample_id"] for s in u] for u in units] == [["0", "1"], ["2"], ["3"], ["4", "5"]]


def test_mtbench_is_shipped():
    qs = read_mtbench()
    assert len(qs) == 80 and all(len(q["turns"]) == 2 for q in qs)


def test_regenerated_answers_are_the_same_on_the_service_and_a_dedicated_engine(ray_session, tmp_path, make_cfg):
    from eagle3ray.artifacts import read_conversations

    train = write_chat_jsonl(tmp_path / "train.jsonl", _convs(12, words=12, seed=3))
    answers = {}
    for engine in ("service", "dedicated", "none"):
        cfg = make_cfg([train], f"data.regenerate={engine != 'none'}", "data.max_new_tokens=12",
                       f"run.name=regen-{engine}", f"data.regenerate_engine={'service' if engine == 'none' else engine}")
        s = prepare(cfg)
        assert s.regenerated == (engine != "none") and s.samples == 12
        _, tab = read_conversations(storage.run_paths(cfg))
        answers[engine] = {sid: ids[mask.index(1):] for sid, ids, mask in zip(
            tab.column("sample_id").to_pylist(), tab.column("input_ids").to_pylist(),
            tab.column("loss_mask").to_pylist())}
    assert answers["service"] == answers["dedicated"]
    # the written answers are the verifier's (<= 12 new tokens + the end-of-turn tokens), not the file's
    assert all(len(a) <= 12 + 3 for a in answers["service"].values())
    assert all(answers["service"][k] != answers["none"][k] for k in answers["none"])


def test_audit_catches_states_stored_under_the_wrong_layer_ids(ray_session, tmp_path, make_cfg):
    """States of layer i+1 stored as layer i (an engine off by one): the audit names each shifted layer, the stage
    fails, and the manifest stays incomplete; the correctly labelled states pass."""
    from eagle3ray.audit import AuditFailed, audit_rows
    from eagle3ray.verifier import VerifierSpec

    train = write_chat_jsonl(tmp_path / "train.jsonl", _convs(6))
    cfg = make_cfg([train])
    prepare(cfg)
    extract(cfg, progress=False)
    spec = VerifierSpec.from_config(cfg)
    rows = _committed_rows(cfg)[:2]
    good = audit_rows(rows, spec.model_path, TINY_AUX + [8], "bfloat16", "float32")
    assert good["passed"] and not good["problems"]
    shifted = [i - 1 for i in TINY_AUX]  # what the manifest would claim if the engine took layer i+1 for i
    bad = audit_rows(rows, spec.model_path, shifted + [8], "bfloat16", "float32")
    assert not bad["passed"]
    assert [p.split(" (")[0] for p in bad["problems"]] == [
        f"the states stored as layer {i - 1} match layer {i}" for i in TINY_AUX]
    # through the stage: the manifest claims the shifted ids (as an off-by-one engine would write them)
    paths = storage.run_paths(cfg)
    data, _ = blocks.read_committed(paths.fs, paths.hidden_states)
    data.update(layer_ids=shifted + [8], complete=False)
    data.pop("audit")
    blocks.Manifest(paths.fs, paths.hidden_states, data).save()
    off = make_cfg([train], f"verifier.aux_layer_ids={shifted}")
    with pytest.raises(AuditFailed, match=f"the states stored as layer {shifted[0]} match layer {TINY_AUX[0]}"):
        extract(off, progress=False)
    man = storage.read_json(*_man(cfg))
    assert not man["complete"] and not man["audit"]["passed"]
