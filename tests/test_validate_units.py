"""Validation's pure parts: prompts balanced over categories, acceptance from per-request histograms, the
report's rows and gate, the deprecated ``validation.temperature`` key, the plot. No engine, no Ray."""

from __future__ import annotations

import pytest

from eagle3ray.config import ConfigError, SourceSpec, load_config
from eagle3ray.serving_engine import acceptance, counters_delta, histogram_counters
from eagle3ray.sources import first_turn_prompts
from eagle3ray.validate import ValidateReport, by_category, plot_report

MTBENCH_CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


def test_mtbench_prompts_balanced_over_categories():
    ev = first_turn_prompts([SourceSpec(kind="mtbench")], 40)
    assert len(ev.convs) == 40 and ev.name == "mtbench"
    assert {c: ev.categories.count(c) for c in MTBENCH_CATEGORIES} == {c: 5 for c in MTBENCH_CATEGORIES}
    assert ev.categories[:8] == MTBENCH_CATEGORIES  # round-robin, in file order
    assert all(len(c) == 1 and c[0]["role"] == "user" for c in ev.convs)
    first = first_turn_prompts([SourceSpec(kind="mtbench")], 40, balance_categories=False)
    assert set(first.categories) == {"writing", "roleplay", "reasoning", "math"}  # why balancing is the default


def test_chat_and_sharegpt_eval_sets(tmp_path):
    p = tmp_path / "ev.jsonl"
    p.write_text('{"messages": [{"role": "user", "content": "a"}], "category": "x"}\n'
                 '{"messages": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "B"}]}\n'
                 '{"messages": [{"role": "user", "content": "c"}], "category": "x"}\n'
                 '{"messages": [{"role": "assistant", "content": "no prompt"}]}\n')
    ev = first_turn_prompts([SourceSpec(kind="chat", path=str(p))], 10)
    # prompts need no answer; round-robin over categories "x" and "" (none); the answer-only record is rejected
    assert ev.name == "chat:ev.jsonl" and ev.categories == ["x", "", "x"]
    assert [c[0]["content"] for c in ev.convs] == ["a", "b", "c"]
    sg = first_turn_prompts([SourceSpec(kind="sharegpt", max_records=5)], 5)
    assert len(sg.convs) == 5 and sg.name == "sharegpt" and set(sg.categories) == {""}
    assert all(c[0]["role"] == "user" for c in sg.convs)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n')
    with pytest.raises(ValueError, match="bad.jsonl: no prompts"):
        first_turn_prompts([SourceSpec(kind="chat", path=str(bad))], 10)


def test_histograms_give_vllm_counters():
    # request 0: drafts with 0, 1, 3 accepted; request 1: 2 and 2 accepted (k = 3)
    h = [[1, 1, 0, 1], [0, 0, 2, 0]]
    c = histogram_counters(h, 3)
    assert c == {"drafts": 5, "draft_tokens": 15, "accepted": 0 + 1 + 3 + 4, "accepted_per_pos": [4, 3, 1]}
    a = acceptance(c)
    assert a["mean_acceptance_length"] == pytest.approx(1 + 8 / 5)
    assert a["acceptance_per_position"] == pytest.approx([0.8, 0.6, 0.2])
    # mean acceptance length is 1 + the sum of per-position rates: both views agree
    assert a["mean_acceptance_length"] == pytest.approx(1 + sum(a["acceptance_per_position"]))
    d = counters_delta({"drafts": 9, "draft_tokens": 27, "accepted": 10, "accepted_per_pos": [5, 3, 2]},
                       {"drafts": 4, "draft_tokens": 12, "accepted": 2, "accepted_per_pos": [1, 1, 0]})
    assert d == {"drafts": 5, "draft_tokens": 15, "accepted": 8, "accepted_per_pos": [4, 2, 2]}


def test_by_category():
    cats = ["writing", "math", "writing", ""]
    h = [[1, 0, 0, 0], [0, 0, 0, 2], [0, 1, 0, 0], [1, 1, 0, 0]]
    out = by_category(cats, h, 3)
    assert list(out) == ["writing", "math", "(none)"]
    assert out["writing"]["num_prompts"] == 2 and out["writing"]["mean_acceptance_length"] == pytest.approx(1.5)
    assert out["math"]["mean_acceptance_length"] == pytest.approx(4.0)
    assert out["math"]["acceptance_per_position"] == pytest.approx([1, 1, 1])
    assert sum(v["num_drafts"] for v in out.values()) == 6


def _report(mal=1.4, gate=None):
    t0 = {"temperature": 0.0, "mean_acceptance_length": mal, "acceptance_per_position": [0.3, 0.08, 0.02],
          "speedup": 0.5, "by_category": {"writing": {"mean_acceptance_length": 1.5, "acceptance_per_position":
                                                      [0.4, 0.1, 0.0], "num_prompts": 1, "num_drafts": 10},
                                          "math": {"mean_acceptance_length": 1.3, "acceptance_per_position":
                                                   [0.2, 0.1, 0.0], "num_prompts": 1, "num_drafts": 10}}}
    t1 = {**t0, "temperature": 0.7, "mean_acceptance_length": 1.3}
    return ValidateReport({
        **t0, "temperatures": [t0, t1], "eval_set": "mtbench", "num_prompts": 2, "num_speculative_tokens": 3,
        "dtype": "float32", "tokens_per_s_spec": 100.0, "tokens_per_s_baseline": 200.0, "greedy_identical": "2/2",
        "greedy_check": None, "checkpoint": {"step": 7}, "vllm_cpu_expand_fix": "applied",
        "reference_drafts": [{"label": "old step 3", "temperatures": [t1]}], "gate": gate})


def test_report_rows_and_gate():
    r = _report()
    rows = dict(r.rows())
    assert rows["acceptance length by category"] == "writing 1.50, math 1.30"
    assert "acceptance length by category" not in dict(r.rows(compact=True))  # `run`'s short closing table
    assert "at T=0.7: acceptance length / per position / speedup" in rows
    assert rows["reference draft old step 3"].startswith("T=0.7: 1.300")
    assert rows["CPU sampler fix (vLLM #55005)"] == "applied"
    assert r.ok and "acceptance gate" not in rows
    failed = _report(gate={"min_acceptance_length": 1.5, "passed": False})
    assert not failed.ok and "BELOW the gate" in failed.headline()
    assert dict(failed.rows())["acceptance gate"].startswith("FAILED")
    assert _report(gate={"min_acceptance_length": 1.2, "passed": True}).ok


def test_plot_has_category_panel():
    png = plot_report(_report(), [])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import io

    from PIL import Image

    one = Image.open(io.BytesIO(plot_report({**_report(), "by_category": {}, "temperatures": [
        {**_report()["temperatures"][0], "by_category": {}}]}, []))).size
    two = Image.open(io.BytesIO(png)).size
    assert two[0] > one[0]  # a second panel: the categories


def test_old_temperature_key_is_read_as_a_list(tmp_path):
    cfg = load_config(None, ["validation.temperature=0.7"])
    assert cfg.validation.temperatures == [0.7]
    assert load_config(None, ["validation.temperatures=[0.0,0.7]"]).validation.temperatures == [0.0, 0.7]
    from eagle3ray.config import ConfigError

    with pytest.raises(ConfigError):
        load_config(None, ["validation.temperatures=[]"])
    with pytest.raises(ConfigError):
        load_config(None, ["validation.min_acceptance_length=0.5"])


def test_engines_at_once_auto_is_two_on_cpu_and_one_on_gpu_and_does_not_invalidate_a_report():
    from eagle3ray.validate import _settings, engines_at_once

    cfg = load_config(None, [])
    assert cfg.validation.engines_at_once == "auto"
    assert engines_at_once(cfg.validation, "cpu") == 2 and engines_at_once(cfg.validation, "cuda") == 1
    three = load_config(None, ["validation.engines_at_once=3"]).validation
    assert engines_at_once(three, "cuda") == 3
    with pytest.raises(ConfigError, match="engines_at_once"):
        load_config(None, ["validation.engines_at_once=0"])
    # how the engines start is not what they measure: a stored report stays valid
    assert _settings(three) == _settings(cfg.validation) and "engines_at_once" not in _settings(three)
