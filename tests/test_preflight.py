"""Preflight (`eagle3ray check -c CONFIG`): offline, configs only, for every shipped config and for the
mistakes it exists to catch (a token budget that cannot fit, aux layer ids past the depth, hidden states
over the storage limit, TP that does not divide the heads)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3ray.config import load_config
from eagle3ray.draft import draft_layer_config
from eagle3ray.preflight import (
    check_cluster,
    memory_plan,
    preflight,
    required_resources,
    weight_bytes,
)

ROOT = Path(__file__).resolve().parent.parent
REAL = ["llama-3.1-8b-instruct", "qwen3-8b", "kimi-k2.5"]


def _cfg(name: str, *overrides: str):
    return load_config(ROOT / "configs" / f"{name}.yaml", list(overrides))


@pytest.mark.parametrize("name", REAL)
def test_shipped_config_passes_offline_in_seconds(name, tmp_path):
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "eagle3ray.cli", "check", "-c", f"configs/{name}.yaml", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "NO_PROXY": "*"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["ok"] and rep["problems"] == []
    assert time.time() - t0 < 60
    assert rep["memory"]["budget_gib"] > rep["memory"]["total_gib"] > rep["memory"]["weights_gib"] > 0
    assert rep["storage"]["gib"] < rep["storage"]["limit_gib"]
    assert rep["resources"]["required"]["replica_bundles"] == [{"GPU": 1}] * 8
    assert rep["shapes"]["model.fc.weight"] == [rep["verifier"]["hidden_size"], 3 * rep["verifier"]["hidden_size"]]


def test_kimi_draft_shapes_and_memory_plan():
    rep = preflight(_cfg("kimi-k2.5"))
    assert rep.ok, rep.problems
    assert rep.verifier["nested_text_config"] and rep.verifier["num_hidden_layers"] == 61
    assert rep.draft["head_dim"] == 128 and rep.draft["head_dim_from"] == "train.draft_head_dim"
    assert rep.draft["layer_ids"] == [2, 30, 58, 61]
    assert rep.draft["vllm_architecture"] == "Eagle3LlamaForCausalLM"
    assert rep.shapes["model.layers.0.self_attn.q_proj.weight"] == [64 * 128, 2 * 7168]
    assert rep.shapes["model.layers.0.self_attn.o_proj.weight"] == [7168, 64 * 128]
    assert rep.shapes["model.fc.weight"] == [7168, 3 * 7168]
    # ~1T parameters, INT4 routed experts: about 550 GiB of weights, 1/8 of it per GPU at TP 8
    assert 1.0e12 < rep.memory["params_billion"] * 1e9 < 1.1e12
    assert 520 < rep.memory["weights_total_gib"] < 580
    assert rep.memory["weights_gib"] == pytest.approx(rep.memory["weights_total_gib"] / 8)


def test_llama_and_qwen_drafts_keep_their_layer_type():
    for name, arch, hd_from in [("llama-3.1-8b-instruct", "Eagle3LlamaForCausalLM", "hidden_size / num_attention_heads"),
                                ("qwen3-8b", "Eagle3Qwen3ForCausalLM", "verifier config head_dim")]:
        rep = preflight(_cfg(name))
        assert rep.draft["vllm_architecture"] == arch
        assert rep.draft["head_dim"] == 128 and rep.draft["head_dim_from"] == hd_from
        assert rep.shapes["model.layers.0.self_attn.k_proj.weight"] == [8 * 128, 2 * 4096]


def test_token_budget_that_cannot_fit_names_the_largest_that_fits():
    rep = preflight(_cfg("kimi-k2.5", "extract.max_tokens_per_batch=503000"))
    assert not rep.ok
    (msg,) = [p for p in rep.problems if p.startswith("extract.max_tokens_per_batch")]
    best = rep.memory["max_fitting_tokens_per_batch"]
    assert f"largest extract.max_tokens_per_batch that fits is {best:,}" in msg
    assert 16384 <= best < 503000
    # the named budget really fits, one step more does not
    assert preflight(_cfg("kimi-k2.5", f"extract.max_tokens_per_batch={best}")).ok
    assert not preflight(_cfg("kimi-k2.5", f"extract.max_tokens_per_batch={best + 4096}")).ok


def test_weights_that_cannot_fit_ask_for_more_tensor_parallelism():
    rep = preflight(_cfg("kimi-k2.5", "verifier.gpu_memory_gib=64"))  # H100 80 GB holds it, barely
    (msg,) = [p for p in rep.problems if p.startswith("extract.max_tokens_per_batch")]
    assert "raise verifier.tensor_parallel_size" in msg and "TP >= " in msg


def test_aux_layer_past_depth_fails():
    rep = preflight(_cfg("llama-3.1-8b-instruct", "verifier.aux_layer_ids=[2,16,33]"))
    assert not rep.ok
    assert any("aux_layer_ids" in p and "[0, 32)" in p and "33" in p for p in rep.problems), rep.problems
    # the off-by-one: L itself is the final pre-norm state, appended automatically
    rep = preflight(_cfg("llama-3.1-8b-instruct", "verifier.aux_layer_ids=[2,16,32]"))
    assert any("32 (= num_hidden_layers) is the final pre-norm state" in p for p in rep.problems), rep.problems


def test_storage_over_limit_fails():
    rep = preflight(_cfg("qwen3-8b", "extract.max_storage_gib=100"))
    (msg,) = [p for p in rep.problems if p.startswith("extract.max_storage_gib")]
    assert "the limit holds 3,276,800 tokens" in msg  # 100 GiB / (4 layers x 4096 x 2 B)


def test_tp_that_does_not_divide_heads_fails():
    rep = preflight(_cfg("llama-3.1-8b-instruct", "verifier.tensor_parallel_size=3"))
    assert any("tensor_parallel_size 3 does not divide the verifier's 32 attention heads" in p for p in rep.problems)


def test_cli_exit_code_and_message():
    proc = subprocess.run([sys.executable, "-m", "eagle3ray.cli", "check", "-c", "configs/qwen3-8b.yaml",
                           "verifier.tensor_parallel_size=6"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "PROBLEM" in proc.stdout and "does not divide" in proc.stdout


def test_memory_plan_terms_scale_with_the_token_budget():
    t = json.loads((ROOT / "configs/verifiers/Llama-3.1-8B-Instruct/config.json").read_text())
    kw = dict(tp=8, dtype="bfloat16", max_model_len=8192, num_captured_layers=4, max_num_seqs=256,
              gpu_memory_gib=80, gpu_memory_utilization=0.9)
    a, b = memory_plan(t, max_tokens_per_batch=65536, **kw), memory_plan(t, max_tokens_per_batch=131072, **kw)
    assert a.weights_gib == b.weights_gib
    assert b.kv_cache_gib == pytest.approx(2 * a.kv_cache_gib)
    # 8 KV heads over TP 8 = 1 head per GPU: 32 layers x 2 x 1 x 128 x 2 bytes per token
    assert a.kv_bytes_per_token == 32 * 2 * 1 * 128 * 2
    # weights: 8.03B params at bf16 (embeddings untied)
    assert weight_bytes(t, "bfloat16")["params"] == pytest.approx(8.03e9, rel=0.01)


def test_cluster_placement_needs_tp_gpus_on_one_node():
    cfg = _cfg("llama-3.1-8b-instruct", "extract.min_replicas=2")
    req = required_resources(cfg)
    node = lambda gpus: {"Alive": True, "Resources": {"CPU": 64, "GPU": gpus}}  # noqa: E731
    assert check_cluster(req, [node(8), node(8)]) == []
    probs = check_cluster(req, [node(4), node(4), node(4), node(4)])  # 16 GPUs, but no node holds 8
    assert any("STRICT_PACK" in p and "room for 0" in p for p in probs)
    probs = check_cluster(required_resources(_cfg("llama-3.1-8b-instruct", "train.num_workers=32")), [node(8)])
    assert any("train.num_workers 32" in p for p in probs)


def test_draft_layer_config_builds_in_speculators(tiny_verifier):
    """The layer config preflight prints is the one training builds (explicit head_dim honoured)."""
    from transformers import AutoConfig

    vt = json.loads((Path(tiny_verifier) / "config.json").read_text())
    d = draft_layer_config(vt, 1, head_dim_override=64)
    cfg = AutoConfig.for_model(**d)
    assert cfg.head_dim == 64 and cfg.num_hidden_layers == 1 and cfg.model_type == "llama"
    mla = {"model_type": "kimi_k2", "hidden_size": 96, "intermediate_size": 160, "num_attention_heads": 4,
           "num_key_value_heads": 4, "vocab_size": 300, "rms_norm_eps": 1e-5, "kv_lora_rank": 16,
           "qk_rope_head_dim": 8, "head_dim": 8, "max_position_embeddings": 256}
    d = draft_layer_config(mla, 1)
    assert d["model_type"] == "llama" and d["head_dim"] == 24  # MLA's head_dim is RoPE-only: not taken
    assert "kv_lora_rank" not in d


def test_default_cpu_config_preflight(smollm2_dir):
    rep = preflight(load_config(None))
    assert rep.ok, rep.problems
    assert rep.draft["layer_ids"] == [2, 15, 27, 30] and rep.memory["budget_gib"] is None


def test_trained_draft_matches_the_preflight_shapes(tiny_verifier):
    """build_draft (training/export) allocates exactly the tensors preflight promises vLLM (explicit head_dim)."""
    import torch

    from eagle3ray.draft import expected_shapes, vllm_key
    from eagle3ray.draft import draft_config_dict
    from eagle3ray.draft import build_draft

    vt = json.loads((Path(tiny_verifier) / "config.json").read_text())
    Vd = 512
    d2t, t2d = torch.zeros(Vd, dtype=torch.long), torch.zeros(vt["vocab_size"], dtype=torch.bool)
    t2d[:Vd] = True
    cfg = load_config(None, ["train.draft_head_dim=64", f"vocab.draft_vocab_size={Vd}", "verifier.aux_layer_ids=[2,4,5]"])
    tc = cfg.train.model_dump()
    draft = build_draft(tiny_verifier, [2, 4, 5], d2t, t2d, tc)
    got = {vllm_key(n): list(p.shape) for n, p in draft.state_dict().items() if vllm_key(n) and "verifier" not in n}
    want = expected_shapes(draft_config_dict(cfg, vt, [2, 4, 5, 8]), 3, vt["hidden_size"])
    assert got["model.layers.0.self_attn.q_proj.weight"] == [4 * 64, 2 * 128]
    for k, shape in want.items():
        assert got[k] == shape, k


def test_dedicated_regeneration_on_gpus_is_noted():
    noted = [n for n in preflight(_cfg("qwen3-8b", "data.regenerate_engine=dedicated")).notes
             if n.startswith("data.regenerate_engine dedicated")]
    assert len(noted) == 1 and "second copy of the verifier on 8 GPU(s)" in noted[0]
    assert not [n for n in preflight(_cfg("qwen3-8b")).notes if n.startswith("data.regenerate_engine")]


def test_fp32_on_a_cpu_without_amx_is_noted(monkeypatch):
    import eagle3ray.preflight as pf

    def note(cfg):
        return [n for n in preflight(cfg).notes if n.startswith("this CPU has neither AMX-BF16 nor AVX512-BF16")]

    monkeypatch.setattr(pf, "cpu_bf16_is_fast", lambda: False)
    assert len(note(load_config(None, ["verifier.dtype=float32"]))) == 1
    monkeypatch.setattr(pf, "cpu_bf16_is_fast", lambda: True)
    assert not note(load_config(None, ["verifier.dtype=float32"]))


def test_cluster_check_catches_a_train_worker_that_cannot_fit_beside_the_service():
    """README's 2-CPU `ray start --head` with the CPU config: the service keeps 1 CPU, the worker asks for 2."""
    cfg = load_config(None)
    node = {"Alive": True, "Resources": {"CPU": 2.0}}
    probs = check_cluster(required_resources(cfg), [node])
    assert len(probs) == 1 and "train.cpus_per_worker 2" in probs[0] and "ray start --num-cpus=4" in probs[0], probs
    assert check_cluster(required_resources(cfg), [{"Alive": True, "Resources": {"CPU": 4.0}}]) == []
    probs = check_cluster(required_resources(load_config(None, ["train.cpus_per_worker=3"])),
                          [{"Alive": True, "Resources": {"CPU": 2.0}}] * 3)
    assert len(probs) == 1 and "no node has that many CPUs" in probs[0], probs


def test_a_step_budget_below_the_sample_length_is_flagged():
    notes = [n for n in preflight(_cfg("qwen3-8b")).notes if n.startswith("train.max_tokens_per_batch")]
    assert len(notes) == 1 and "truncated_samples" in notes[0], notes
    fits = _cfg("qwen3-8b", "train.max_tokens_per_batch=16384")
    assert not [n for n in preflight(fits).notes if n.startswith("train.max_tokens_per_batch")]


def test_a_local_cluster_too_small_for_training_and_ray_data_is_a_problem():
    """The CPU config's local cluster (ray.num_cpus 4) holds the service (1), one 2-CPU worker and Ray Data's reads;
    a second worker would leave Ray Data no CPU and training would never start."""
    assert preflight(load_config(None)).ok
    rep = preflight(load_config(None, ["train.num_workers=2"]))
    probs = [p for p in rep.problems if "train.num_workers 2" in p]
    assert len(probs) == 1 and "ray.num_cpus=6" in probs[0], rep.problems


RATES = ("run.plan_rates={engine_load_s: 120, prefill_tok_s: 40000, decode_tok_s: 8000, decode_batch: 256, "
         "val_decode_tok_s: 3000, val_batch: 64, prompt_tokens_mean: 300, kept_fraction: 0.9, train_step_s: %s}")


@pytest.mark.parametrize("step_s, side", [("0.8", "train"), ("0.1", "verifier")])
def test_online_preflight_says_which_pool_sets_the_pace(step_s, side):
    """Issue 18: an online run's preflight sizes both pools from the stated rates. Llama-3.1-8B config: 4 replicas
    x 40,000 tok/s x 0.63 (``extract_efficiency``) = 100,800 tok/s; 8 workers x 8,192 tokens per 0.8 s step (+5%
    evaluations) = 78,019 tok/s (the train pool is slower), per 0.1 s step 624,152 tok/s (the verifier pool is,
    and 25 replicas would keep up)."""
    from eagle3ray.plan import OVERHEADS

    eff = OVERHEADS["extract_efficiency"]
    rep = preflight(_cfg("llama-3.1-8b-instruct", "train.data_source=online", RATES % step_s))
    st = rep.stream
    assert st["bottleneck"] == side and st["rates_from"] == "run.plan_rates"
    assert st["produce_tok_s"] == pytest.approx(4 * 40000 * eff)
    assert st["consume_tok_s"] == pytest.approx(8 * 8192 / (float(step_s) * 1.05))
    notes = " ".join(rep.notes)
    if side == "verifier":
        keep_up = math.ceil(8 * 8192 / (0.1 * 1.05) / (40000 * eff))
        assert keep_up == 25 and st["replicas_to_keep_up"] == keep_up
        assert f"extract.max_replicas {keep_up} would keep them fed" in notes
    else:
        assert "will be the bottleneck" not in notes


def test_online_preflight_holds_no_storage_limit_and_asks_for_rates_without_them():
    """Online stores no states: extract.max_storage_gib is not a problem there (it is offline and hybrid); without
    rates the report says how to get the pools' balance."""
    for mode, problem in (("online", False), ("hybrid", True), ("offline", True)):
        rep = preflight(_cfg("qwen3-8b", "extract.max_storage_gib=100", f"train.data_source={mode}"))
        assert any(p.startswith("extract.max_storage_gib") for p in rep.problems) == problem, mode
        assert (not rep.stream and "set run.plan_rates" in " ".join(rep.notes)) == (mode != "offline"), mode
