"""The time-budget plan: the stage model, the choice of sizes, and plan.json reuse (no probe here: fixed rates)."""
import json

import pytest

from eagle3ray import plan as P
from eagle3ray.config import ConfigError, load_config

RATES = P.Rates(engine_load_s=8.0, prefill_tok_s=800.0, decode_tok_s=550.0, decode_batch=256,
                val_decode_tok_s=300.0, val_batch=40, prompt_tokens_mean=60.0, kept_fraction=0.5,
                train_step_s=0.45, step_s_by_optimizer={"adamw": 0.40, "muon": 0.45}, probe_s=50.0, machine={"cpu_model": "test", "amx_bf16": False, "dtype": "float32"})


def cfg_for(tmp_path, *overrides):
    return load_config(None, [f"run.storage=file://{tmp_path}", *overrides])


@pytest.mark.parametrize("text,seconds", [("15m", 900), ("1h30m", 5400), ("90s", 90), ("2h", 7200), ("600", 600),
                                          ("1.5h", 5400), ("15min", 900)])
def test_durations(text, seconds):
    assert P.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "15x", "m", "1d"])
def test_bad_durations_say_what_is_accepted(text):
    with pytest.raises(ValueError, match="15m, 1h30m"):
        P.parse_duration(text)


def test_plan_needs_a_budget_and_names_the_field():
    with pytest.raises(ConfigError, match="data.max_samples, train.max_steps, train.optimizer: `plan` needs run.time_budget"):
        load_config(None, ["run.time_budget=null"])


@pytest.mark.parametrize("budget", ["10m", "15m", "1h"])
def test_the_plan_is_the_largest_that_fits(tmp_path, budget):
    cfg = cfg_for(tmp_path, f"run.time_budget={budget}")
    seconds = P.parse_duration(budget)
    p = P.make_plan(cfg, RATES, seconds)
    n = p["max_samples"]
    assert p["total_s"] <= seconds * P.PLAN_SAFETY and p["fits"]
    assert p["max_steps"] == P.steps_for(cfg, n, RATES)
    bigger = RATES.probe_s + sum(P.estimate(cfg, RATES, n + 1, P.steps_for(cfg, n + 1, RATES)).values())
    assert bigger > seconds * P.PLAN_SAFETY  # one more conversation would not fit
    assert p["planned"] == ["data.max_samples", "train.max_steps", "train.optimizer"]


def test_a_longer_budget_buys_more_data_and_steps(tmp_path):
    cfg = cfg_for(tmp_path)
    a, b = P.make_plan(cfg, RATES, 900), P.make_plan(cfg, RATES, 1800)
    assert b["max_samples"] > 2 * a["max_samples"] and b["max_steps"] > 2 * a["max_steps"]


def test_explicit_sizes_are_kept_and_the_other_is_fitted(tmp_path):
    p = P.make_plan(cfg_for(tmp_path, "data.max_samples=200"), RATES, 900)
    assert p["max_samples"] == 200 and p["planned"] == ["train.max_steps", "train.optimizer"]
    assert p["total_s"] <= 900 * P.PLAN_SAFETY + RATES.train_step_s * 2
    step_s = (p["estimates"]["train"] - P.OVERHEADS["train_fixed_s"]) / p["max_steps"]
    assert p["total_s"] >= 900 * P.PLAN_SAFETY - 2 * step_s, p  # the fitted steps fill the budget
    q = P.make_plan(cfg_for(tmp_path, "train.max_steps=100"), RATES, 900)
    assert q["max_steps"] == 100 and q["planned"] == ["data.max_samples", "train.optimizer"]
    assert q["max_samples"] > P.make_plan(cfg_for(tmp_path), RATES, 900)["max_samples"]  # fewer steps: more data


def test_an_online_plan_streams_the_states_in_the_train_stage(tmp_path):
    """``train.data_source: online``: no extract stage; each step costs its tokens' extraction too (the verifier
    and the workers share this machine's cores), so the same budget buys fewer samples and steps."""
    off = P.make_plan(cfg_for(tmp_path), RATES, 900)
    on = P.make_plan(cfg_for(tmp_path, "train.data_source=online"), RATES, 900)
    assert on["estimates"]["extract"] == 0 and off["estimates"]["extract"] > 0
    assert on["total_s"] <= 900 * P.PLAN_SAFETY and on["max_samples"] < off["max_samples"]
    cfg = cfg_for(tmp_path, "train.data_source=online", "data.max_samples=200", "train.max_steps=100")
    t = P.estimate(cfg, RATES, 200, 100)["train"] - P.estimate(cfg_for(tmp_path), RATES, 200, 100)["train"]
    tps = P.tokens_per_sample(cfg, RATES)
    streamed = (100 * cfg.train.max_tokens_per_batch * cfg.train.num_workers + 200 * cfg.train.val_fraction * tps)
    expect = RATES.engine_load_s + streamed / (RATES.prefill_tok_s * P.OVERHEADS["extract_efficiency"])
    assert t == pytest.approx(expect)


def test_a_budget_too_small_says_so(tmp_path):
    p = P.make_plan(cfg_for(tmp_path), RATES, 120)
    assert not p["fits"] and p["max_samples"] == 32
    assert "raise run.time_budget" in P.render(p)


def test_planned_config_probes_once_then_reuses_plan_json(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(P, "probe", lambda cfg: calls.append(1) or RATES)
    cfg = cfg_for(tmp_path)
    seen = []
    a = P.planned_config(cfg, on_plan=lambda plan, fresh: seen.append(fresh))
    assert isinstance(a.data.max_samples, int) and isinstance(a.train.max_steps, int)
    assert a.train.optimizer == "muon"  # RATES: Muon's step 1.125x AdamW's
    written = json.loads((tmp_path / "smollm2-135m-cpu" / P.PLAN_FILE).read_text())
    assert written["max_samples"] == a.data.max_samples and written["rates"]["train_step_s"] == 0.45
    monkeypatch.setattr(P, "probe", lambda cfg: pytest.fail("probed again"))
    b = P.planned_config(cfg, on_plan=lambda plan, fresh: seen.append(fresh))
    assert (b.data.max_samples, b.train.max_steps) == (a.data.max_samples, a.train.max_steps)
    assert seen == [True, False] and calls == [1]
    explicit = cfg_for(tmp_path, "data.max_samples=7", "train.max_steps=9", "train.optimizer=adamw")
    assert P.planned_config(explicit) is explicit  # nothing says plan: no probe, no plan


def test_the_printed_plan_names_every_stage_and_the_machine(tmp_path):
    text = P.render(P.make_plan(cfg_for(tmp_path), RATES, 900))
    for stage in ("plan", "prepare", "extract", "vocab", "train", "export", "check", "validate", "total"):
        assert f"  {stage} " in text
    assert "amx_bf16=False" in text and "test" in text


def test_stated_rates_replace_the_probe_and_name_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "probe", lambda cfg: pytest.fail("probed although run.plan_rates is set"))
    rates = {k: v for k, v in vars(RATES).items() if k not in ("probe_s", "machine")}
    cfg = cfg_for(tmp_path, "run.time_budget=2h", f"run.plan_rates={json.dumps(rates)}")
    planned = P.planned_config(cfg)
    assert planned.data.max_samples == P.make_plan(cfg, P.stated_rates(cfg), 7200)["max_samples"]
    del rates["train_step_s"]
    bad = cfg_for(tmp_path / "b", "run.time_budget=2h", f"run.plan_rates={json.dumps(rates)}")
    with pytest.raises(ValueError, match="lacks train_step_s"):
        P.planned_config(bad)


def test_a_stage_command_plans_only_when_its_own_size_says_plan(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "probe", lambda cfg: pytest.fail("probed for a stage whose size was given"))
    cfg = cfg_for(tmp_path, "data.max_samples=6")  # train.max_steps still says plan
    assert P.planned_config(cfg, stage="extract") is cfg and P.planned_config(cfg, stage="prepare") is cfg
    monkeypatch.setattr(P, "probe", lambda cfg: RATES)
    planned = P.planned_config(cfg, stage="train")
    assert planned.data.max_samples == 6 and isinstance(planned.train.max_steps, int)


def test_quiet_logging_sends_info_to_the_run_and_warnings_to_the_terminal(tmp_path, monkeypatch, capsys):
    import logging

    from eagle3ray import logs
    monkeypatch.delenv(logs.VERBOSE_ENV, raising=False)
    path = logs.setup(cfg_for(tmp_path))
    logging.getLogger("eagle3ray.test").info("detail for the log file")
    logging.getLogger("eagle3ray.test").warning("a warning that matters")
    err = capsys.readouterr().err
    text = open(path).read()
    assert "detail for the log file" in text and "a warning that matters" in text
    assert "detail for the log file" not in err and "a warning that matters" in err
    monkeypatch.setenv(logs.VERBOSE_ENV, "1")
    logs.setup()
    logging.getLogger("eagle3ray.test").info("shown with --verbose")
    assert "shown with --verbose" in capsys.readouterr().err


def test_quiet_logging_keeps_rays_worker_pool_notices_and_token_notice_off_the_terminal(tmp_path, monkeypatch,
                                                                                       capsys):
    """The raylet's "N PYTHON worker processes have been started" notices (pushed to every driver; 3 of the
    default run's 61 terminal lines) and Ray's "token authentication is enabled" notice go to driver.log or
    nowhere; any other message the raylet pushes (a worker killed, out of memory) still reaches the terminal."""
    import logging

    from ray._private import worker

    from eagle3ray import logs
    monkeypatch.delenv(logs.VERBOSE_ENV, raising=False)
    monkeypatch.setattr(worker, "print_to_stdstream", worker.print_to_stdstream)  # undone after the test
    path = logs.setup(cfg_for(tmp_path))
    capsys.readouterr()
    pool = ("WARNING: 12 PYTHON worker processes have been started on node: abc with address: 127.0.0.1, which is "
            "6x the maximum expected startup concurrency (2).")
    worker.print_to_stdstream({"lines": [pool], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    worker.print_to_stdstream({"lines": ["A worker died or was killed while executing a task"], "pid": "raylet",
                               "is_err": False}, ignore_prefix=False)
    logging.getLogger("ray._private.authentication.authentication_token_setup").warning(
        "Token authentication is enabled for this Ray cluster.")
    out = capsys.readouterr()
    assert "PYTHON worker processes" not in out.out + out.err and "Token authentication" not in out.out + out.err
    assert "A worker died or was killed" in out.out
    assert "PYTHON worker processes" in open(path).read()


def test_another_budget_on_a_planned_run_is_refused_until_replanned(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "probe", lambda cfg: RATES)
    P.planned_config(cfg_for(tmp_path))
    longer = cfg_for(tmp_path, "run.time_budget=30m")
    with pytest.raises(P.PlanChanged, match="differs from the 15 min this run was planned for"):
        P.planned_config(longer)
    assert P.planned_config(longer, replan=True).data.max_samples > P.planned_config(
        cfg_for(tmp_path / "other")).data.max_samples


def test_validate_estimate_starts_engines_in_groups_from_the_fresh_process_start(tmp_path):
    """Validation's engines each pay a fresh process's start (the probe's ``engine_start_s``); on CPU two start
    together (``validation.engines_at_once: auto``), on GPU one at a time; the greedy-check pair at another dtype
    adds a group and decodes at T=0 only. Without ``engine_start_s`` (older plans, stated rates): 2 x the load."""
    import dataclasses

    o = P.OVERHEADS
    rates = dataclasses.replace(RATES, engine_start_s=20.0)
    cfg = cfg_for(tmp_path, "verifier.dtype=float32")
    gen = cfg.validation.max_prompts * cfg.validation.max_new_tokens / (
        rates.val_decode_tok_s * o["val_decode_efficiency"])
    decode = gen * (1 + o["spec_slowdown"])
    one = 20.0 + o["engine_actor_s"]
    val = P.estimate(cfg, rates, 100, 100)["validate"]
    assert val == pytest.approx(o["validate_fixed_s"] + one * (1 + o["engines_together"]) + decode)
    # one at a time: the two starts add
    seq = P.estimate(cfg_for(tmp_path, "verifier.dtype=float32", "validation.engines_at_once=1"), rates, 100, 100)
    assert seq["validate"] == pytest.approx(o["validate_fixed_s"] + 2 * one + decode)
    assert seq["validate"] > val
    # a greedy check at another dtype: a second group of two, decoding once more at T=0, slower in float32
    chk = P.estimate(cfg_for(tmp_path, "verifier.dtype=bfloat16", "validation.greedy_check_dtype=float32"),
                     rates, 100, 100)
    assert chk["validate"] == pytest.approx(o["validate_fixed_s"] + 2 * one * (1 + o["engines_together"])
                                            + decode * (1 + o["check_decode_slowdown"]))
    # no fresh-process figure: twice the in-process load, as before the field existed
    old = P.estimate(cfg, RATES, 100, 100)["validate"]
    assert old == pytest.approx(o["validate_fixed_s"] + (2 * RATES.engine_load_s + o["engine_actor_s"])
                                * (1 + o["engines_together"]) + decode)
    # stated rates need not give it
    assert P.Rates.from_dict({**dataclasses.asdict(RATES)}).engine_start_s == 0.0


def test_validate_estimate_uses_the_probes_measured_together_factor(tmp_path):
    """Engines started together slow each other by a machine's own factor (the probe's ``engines_together``): 0
    makes a group of two cost one start, 1 two starts; -1 (older plans, stated rates) keeps OVERHEADS' figure."""
    import dataclasses

    o = P.OVERHEADS
    cfg = cfg_for(tmp_path, "verifier.dtype=float32")
    gen = cfg.validation.max_prompts * cfg.validation.max_new_tokens / (
        RATES.val_decode_tok_s * o["val_decode_efficiency"])
    decode = gen * (1 + o["spec_slowdown"])
    one = 20.0 + o["engine_actor_s"]

    def val(f):
        return P.estimate(cfg, dataclasses.replace(RATES, engine_start_s=20.0, engines_together=f), 100, 100)["validate"]

    assert val(0.0) == pytest.approx(o["validate_fixed_s"] + one + decode)
    assert val(1.0) == pytest.approx(o["validate_fixed_s"] + 2 * one + decode)
    assert val(-1.0) == pytest.approx(o["validate_fixed_s"] + one * (1 + o["engines_together"]) + decode)
    assert P.Rates.from_dict({**dataclasses.asdict(RATES)}).engines_together == -1.0  # older plans


def test_the_together_factor_is_clipped_and_unknown_when_a_time_is():
    assert P.together_factor(10.0, 10.0) == 0.0
    assert P.together_factor(10.0, 17.0) == pytest.approx(0.7)
    assert P.together_factor(10.0, 9.0) == 0.0       # noise below one alone: they overlap fully
    assert P.together_factor(10.0, 30.0) == 1.0      # slower than taking turns: capped
    assert P.together_factor(10.0, 25.0, n=3) == pytest.approx(0.75)
    assert P.together_factor(float("inf"), 10.0) == -1.0
    assert P.together_factor(10.0, float("inf")) == -1.0
    assert P.together_factor(0.0, 10.0) == -1.0


def test_a_share_that_fits_the_shard_cache_plans_cheaper_steps_and_so_more_data(tmp_path):
    """train.cache_shard_mib: when every worker's planned share of the states fits it (the probe's
    state_bytes_per_token), the epochs after the first cost train_overhead_replay a step; a share over it, a cache
    of 0, online training or an older plan without state_bytes_per_token keep the streamed overhead throughout."""
    from dataclasses import replace

    rates = replace(RATES, state_bytes_per_token=4613.0)  # SmolLM2: 4 x 576 bf16 + ids
    streamed = cfg_for(tmp_path, "run.time_budget=15m", "train.cache_shard_mib=0")
    cached = cfg_for(tmp_path, "run.time_budget=15m", "train.cache_shard_mib=2048")
    tiny = cfg_for(tmp_path, "run.time_budget=15m", "train.cache_shard_mib=1")
    assert P.shard_cached(cached, rates, 500) and not P.shard_cached(streamed, rates, 500)
    assert not P.shard_cached(tiny, rates, 500)  # ~0.3 GiB of states over a 1 MiB cache
    assert not P.shard_cached(cached, RATES, 500)  # bytes per token unknown (older plans, stated rates)
    online = cfg_for(tmp_path, "run.time_budget=15m", "train.cache_shard_mib=2048", "train.data_source=online")
    assert not P.shard_cached(online, rates, 500)
    tps = P.tokens_per_sample(cached, rates)
    o = P.OVERHEADS
    three = P.steps_for(cached, 500, rates)  # train.planned_epochs 3: one streamed epoch, two replayed
    ratio = P._step_s(cached, rates, tps, 500, three) / P._step_s(streamed, rates, tps, 500, three)
    assert ratio == pytest.approx((o["train_overhead"] + 2 * o["train_overhead_replay"]) / 3 / o["train_overhead"],
                                  rel=0.01)
    # fewer passes replay less: 1.5 pay the streamed figure on two thirds of their steps, one pass on all
    assert P.train_overhead(cached, rates, 500, three // 2) == pytest.approx(
        (2 * o["train_overhead"] + o["train_overhead_replay"]) / 3, rel=0.01)
    assert P.train_overhead(cached, rates, 500, three // 3) == pytest.approx(o["train_overhead"], rel=0.01)
    assert P.train_overhead(streamed, rates, 500, three) == o["train_overhead"]
    a, b = P.make_plan(streamed, rates, 900), P.make_plan(cached, rates, 900)
    assert b["max_samples"] > a["max_samples"] and b["max_steps"] > a["max_steps"]
    assert b["total_s"] <= 900 and b["rates"]["state_bytes_per_token"] == 4613.0


def test_the_probes_warm_import_is_timed_in_a_fresh_interpreter_and_a_failure_is_never_the_smaller(monkeypatch):
    """The probe caps a validation engine's start at load + a warm fresh-process import (cold machines inflate its
    own process age); the import is real here, and an interpreter that cannot import counts as infinite, so
    the probe's own measurement is kept."""
    import sys

    t = P._warm_import_s()
    assert 0.0 < t < 300.0
    pair = P._warm_import_s(2)  # two interpreters at once: each still imports (not a no-op)
    assert 0.0 < pair < 300.0
    monkeypatch.setattr(sys, "executable", "/bin/false")
    assert P._warm_import_s() == float("inf")
    assert P._warm_import_s(2) == float("inf")


@pytest.mark.parametrize("muon_s, chosen", [(0.45, "muon"), (0.70, "muon"), (0.88, "muon"), (0.89, "adamw"),
                                             (1.20, "adamw")])
def test_the_plan_takes_muon_unless_its_step_costs_over_the_measured_ratio(tmp_path, muon_s, chosen):
    """train.optimizer: plan: Muon up to MUON_MAX_STEP_RATIO (2.2) x AdamW's probed step (0.40 s here), AdamW above
    (at 1.74x, 0.70 s, Muon won on the same blocks in session 31; at 2.7x AdamW did in session 30); the chosen
    optimizer's step is the one the plan sizes the run with, and the printed plan says why."""
    from dataclasses import replace

    assert P.MUON_MAX_STEP_RATIO == 2.2
    rates = replace(RATES, step_s_by_optimizer={"adamw": 0.40, "muon": muon_s})
    p = P.make_plan(cfg_for(tmp_path), rates, 900)
    assert p["optimizer"] == chosen and p["rates"]["train_step_s"] == rates.step_s_by_optimizer[chosen]
    same = P.make_plan(cfg_for(tmp_path, f"train.optimizer={chosen}"), replace(rates, train_step_s=p["rates"][
        "train_step_s"]), 900)
    assert (same["max_samples"], same["max_steps"]) == (p["max_samples"], p["max_steps"])
    assert f"{chosen}: Muon's step {muon_s / 0.40:.2f}x AdamW's" in P.render(p)
    cheaper = P.make_plan(cfg_for(tmp_path), replace(rates, step_s_by_optimizer={"adamw": 0.40, "muon": 2.0}), 900)
    assert cheaper["max_samples"] >= p["max_samples"]  # AdamW's cheaper steps leave more of the budget to data


def test_a_plan_without_both_steps_cannot_choose_the_optimizer(tmp_path):
    from dataclasses import replace

    with pytest.raises(ValueError, match="step_s_by_optimizer"):
        P.make_plan(cfg_for(tmp_path), replace(RATES, step_s_by_optimizer={}), 900)
    assert P.make_plan(cfg_for(tmp_path, "train.optimizer=muon"), replace(RATES, step_s_by_optimizer={}), 900)


def test_an_unresolved_optimizer_is_refused_by_the_training_step():
    from eagle3ray.train_worker import build_optimizers

    with pytest.raises(ValueError, match="train.optimizer 'plan'"):
        build_optimizers(None, {"optimizer": "plan", "lr": 1e-3, "weight_decay": 0.0})


def test_the_last_partial_regeneration_chunk_decodes_at_its_own_smaller_batch(tmp_path):
    """Decode tokens/s between the probe's two batches (40: 300 tok/s, 256: 550) is interpolated; 300 answers are a
    chunk of 256 at 550 and one of 44 at ~305 tok/s, not 300 at 550."""
    assert P.decode_tok_s_at(RATES, 256) == 550 and P.decode_tok_s_at(RATES, 512) == 550
    assert P.decode_tok_s_at(RATES, 40) == 300 and P.decode_tok_s_at(RATES, 8) == 300
    assert P.decode_tok_s_at(RATES, 148) == pytest.approx(425)
    cfg = cfg_for(tmp_path)
    per = cfg.data.max_new_tokens * P.OVERHEADS["answer_fill"]
    assert P.regeneration_decode_s(cfg, RATES, 256) == pytest.approx(256 * per / 550)
    tail = 44 * per / P.decode_tok_s_at(RATES, 44)
    assert P.regeneration_decode_s(cfg, RATES, 300) == pytest.approx(256 * per / 550 + tail)
    assert tail > 44 * per / 550


def _at_train_start(p: dict, speed: float) -> tuple[float, dict]:
    """(elapsed s, stage s) at the train stage's start when prepare and extract ran at ``speed`` x their estimates."""
    e = p["estimates"]
    stage_s = {"prepare": e["prepare"] * speed, "extract": e["extract"] * speed, "vocab": e["vocab"]}
    return e["plan"] + sum(stage_s.values()), stage_s


def test_the_refit_keeps_the_planned_steps_when_the_run_is_on_its_plan(tmp_path):
    cfg = cfg_for(tmp_path)
    p = P.make_plan(cfg, RATES, 900)
    r = P.refit_steps(cfg, p, *_at_train_start(p, 1.0))
    assert r["speed"] == 1.0
    assert abs(r["max_steps"] - p["max_steps"]) <= 0.03 * p["max_steps"], (r, p["max_steps"])


@pytest.mark.parametrize("speed,scaled", [(0.8, 0.8), (1.2, 1.2), (0.9, 1.0), (1.1, 1.0), (0.5, 0.75)])
def test_the_refit_gives_train_the_time_the_data_stages_saved_or_took(tmp_path, speed, scaled):
    """Faster data stages leave time for more steps (each also costs less outside the dead band); slower ones take
    steps away; either way the re-fitted run's estimate meets the plan's target."""
    cfg = cfg_for(tmp_path)
    p = P.make_plan(cfg, RATES, 900)
    elapsed, stage_s = _at_train_start(p, speed)
    r = P.refit_steps(cfg, p, elapsed, stage_s)
    assert (r["max_steps"] > p["max_steps"]) == (speed < 1) and r["max_steps"] != p["max_steps"]
    assert r["speed"] == pytest.approx(scaled) and r["data_ratio"] == pytest.approx(speed)
    assert r["train_s"] <= r["left_s"]
    after = sum(p["estimates"][k] for k in ("export", "check", "validate"))
    assert r["left_s"] == pytest.approx(p["target_s"] - elapsed - after)
    assert elapsed + r["train_s"] + after <= p["target_s"] + 1e-6
    one_more = P.estimate(cfg, P.Rates.from_dict(p["rates"]), p["max_samples"], r["max_steps"] + 1)["train"] * scaled
    assert one_more > r["left_s"] or r["max_steps"] == int(p["max_steps"] * P.REFIT_STEP_LIMITS[1])


def test_the_refit_stays_within_its_limits_and_only_where_the_steps_were_planned(tmp_path):
    cfg = cfg_for(tmp_path)
    p = P.make_plan(cfg, RATES, 900)
    elapsed, stage_s = _at_train_start(p, 3.0)  # data stages far over: speed clipped, steps at the floor
    r = P.refit_steps(cfg, p, elapsed, stage_s)
    assert r["speed"] == P.REFIT_SPEED_LIMITS[1]
    assert r["max_steps"] == int(p["max_steps"] * P.REFIT_STEP_LIMITS[0])
    assert P.refit_steps(cfg, p, 10.0, {"vocab": 1.0}) is None  # prepare/extract not run here: a resumed run
    fixed = cfg_for(tmp_path, "train.max_steps=100")
    assert P.refit_steps(fixed, P.make_plan(fixed, RATES, 900), *_at_train_start(p, 0.8)) is None


def test_a_refit_is_written_to_the_plan_and_a_resumed_run_keeps_it(tmp_path, monkeypatch):
    from eagle3ray.pipeline import RunResult, refit_train

    monkeypatch.setattr(P, "probe", lambda cfg: RATES)
    cfg = P.planned_config(cfg_for(tmp_path))
    p = P.read_plan(cfg)
    elapsed, stage_s = _at_train_start(p, 0.8)
    result = RunResult(seconds=stage_s, plan=p)
    new, note = refit_train(cfg, result, elapsed)
    r = P.read_plan(cfg)["refit"]
    assert new.train.max_steps == r["max_steps"] == P.read_plan(cfg)["max_steps"] > p["max_steps"]
    assert note.startswith(f"{r['max_steps']} steps (planned {p['max_steps']}; re-fitted")
    assert note.endswith("the data stages at 0.80x their estimates, its estimate scaled by 0.80)")
    assert P.planned_config(cfg_for(tmp_path)).train.max_steps == r["max_steps"]  # a resumed run trains as far
    again, note2 = refit_train(new, RunResult(seconds=stage_s, plan=P.read_plan(cfg)), elapsed + 100)
    assert again is new and note2 is None  # one refit per run


def test_a_planned_run_trains_to_the_refitted_steps_and_says_so(tmp_path, monkeypatch):
    """pipeline.run with stand-in stages: the train stage gets the re-fitted steps (here the 2x ceiling: the data
    stages took no time), the train line carries the note, and a second run resumes with the same steps."""
    from types import SimpleNamespace

    from eagle3ray import pipeline

    monkeypatch.setattr(P, "probe", lambda cfg: RATES)
    seen: dict = {}

    def stage(name):
        def fn(cfg, progress):
            seen.setdefault(name, []).append(cfg.train.max_steps)
            return SimpleNamespace(title=name, rows=lambda: [])
        return pipeline.Stage(name, (), fn)

    monkeypatch.setattr(pipeline, "STAGES", {n: stage(n) for n in pipeline.STAGES})
    events = []
    r = pipeline.run(cfg_for(tmp_path), progress=False, on_stage=lambda ev, n, s, t: events.append((ev, n, s)))
    planned = r.plan["refit"]["planned_steps"]
    assert seen["train"] == seen["validate"] == [int(planned * P.REFIT_STEP_LIMITS[1])] != seen["prepare"]
    (note,) = [s for ev, n, s in events if ev == "start" and n == "train"]
    assert note.startswith(f"{seen['train'][0]} steps (planned {planned}; re-fitted")
    assert all(s is None for ev, n, s in events if ev == "start" and n != "train")
    pipeline.run(cfg_for(tmp_path), progress=False)  # resumed: plan.json's steps, no second refit
    assert seen["train"][1] == seen["train"][0] and P.read_plan(cfg_for(tmp_path))["refit"]["planned_steps"] == planned


def test_decode_rate_leaves_the_prefill_out_at_any_window():
    """``plan.decode_rate`` divides the tokens decoded by the difference of a long and a short call: a fake engine
    whose calls cost a prefill plus a fixed time per decode step gives back exactly its decode rate, for the 16
    tokens of regeneration's batch and the 48 of validation's (``VAL_DECODE_PROBE_TOKENS``)."""
    from eagle3ray import plan

    step_s, prefill_s = 0.05, 0.7  # per decode step of the whole batch; per call

    def gen(prompts, n_tokens):
        assert all(len(p) <= plan.DECODE_PROBE_PROMPT_TOKENS for p in prompts)
        return prefill_s + n_tokens * step_s

    prompts = [list(range(20)), list(range(5))]
    for tokens in (16, plan.VAL_DECODE_PROBE_TOKENS):
        assert plan.decode_rate(gen, prompts, 40, tokens=tokens) == pytest.approx(40 / step_s)
    assert plan.VAL_DECODE_PROBE_TOKENS > 16
