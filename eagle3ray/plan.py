"""A time budget instead of fixed sizes: measure this machine, then pick the run's sizes to fit the budget.

``run.time_budget`` (e.g. ``15m``) with ``data.max_samples: plan`` and/or ``train.max_steps: plan`` makes every
entry point (``eagle3ray run``, each stage command, ``eagle3ray check``, the Ray Jobs) run with planned sizes:

1. **Probe** (:func:`probe`, a subprocess of its own so that nothing it loads stays in the caller; about 30-60 s on
   a 2-core CPU): the verifier's vLLM engine (:class:`eagle3ray.serving_engine.ServingEngine`, the engine that
   regeneration and validation use) loaded once and timed, then prefill tokens/s on the run's own first
   training prompts, decode tokens/s at regeneration's batch (``verifier.max_num_seqs``) and at validation's,
   then the Ray Train worker's own step (:class:`eagle3ray.train_worker.DraftStep`) on synthetic states of the
   verifier's shapes, with ``train.cpus_per_worker`` torch threads.
2. **Model** (:func:`estimate`): per stage, a fixed cost (process and cluster start-up, engine loads) plus
   samples x seconds per sample; the rates are the probe's, the fixed costs and efficiency factors are
   :data:`OVERHEADS` (fitted on full runs, ``docs/plan.md``).
3. **Plan** (:func:`make_plan`): the largest number of training conversations N whose estimated run fits
   ``PLAN_SAFETY`` x the budget, with ``train.max_steps`` = ``train.planned_epochs`` passes over N samples'
   tokens (the split between data and steps: ``docs/plan.md``). An explicit size is kept and the other is fitted
   around it.
4. **Refit** (:func:`refit_steps`, by ``eagle3ray run`` when its train stage starts): planned steps re-fitted to the
   budget actually left, the data size being fixed by then.

The plan is written to ``<run>/plan.json`` once and reused on every later command of the run (so a resumed
run keeps its sizes, and the stages' config hashes stay the same); ``eagle3ray plan --replan`` probes again.
GPU clusters: see ``docs/plan.md`` (the same model from stated rates, ``run.plan_rates``).
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace

from . import storage

log = logging.getLogger(__name__)

PLAN_FILE = "plan.json"
#: A block row's Arrow bytes per token besides its states: ``input_ids`` (int32) and ``loss_mask`` (int8)
#: (:data:`eagle3ray.blocks.BLOCK_SCHEMA`).
ROW_BYTES_PER_TOKEN = 5
PLAN_SAFETY = 0.96  # plan for this fraction of the budget: run-to-run spread on one machine (docs/plan.md)

#: Fixed costs (s) and efficiency factors of the stage model. Fitted on two full runs of the CPU config (AMD EPYC,
#: 2 cores, no AMX-BF16, fp32; ``docs/plan.md``, "Fit"): the probe's rates carry the machine's speed, these carry
#: what the probe does not see (process and cluster start-up, batching tails, Ray's overhead).
OVERHEADS = {
    "prepare_fixed_s": 18.0,      # Ray start, sources read and tokenized, regeneration actor start (+ engine load)
    "regen_efficiency": 0.74,     # regeneration's answer throughput over the probe's (chunks of max_num_seqs wait
                                  # for their longest answer; longer contexts than the probe's): 0.9 fitted with
                                  # 32-token decode prompts, / 1.21, what 8-token ones measure more (session 30,
                                  # benchmarks/probe_decode.py; DECODE_PROBE_PROMPT_TOKENS)
    "answer_fill": 1.0,           # regenerated answer length over data.max_new_tokens (ShareGPT answers fill it)
    "extract_fixed_s": 12.0,      # Serve application and Ray Data pipeline start (+ engine load)
    "extract_efficiency": 0.63,   # extraction tokens/s over the probe's plain prefill tokens/s: refitted on four
                                  # whole runs of 2026-12-03 (0.55-0.68; 0.82 had them at 1.18-1.41x; docs/plan.md)
    "vocab_s": 3.0,
    "train_fixed_s": 45.0,        # Ray Train worker group start, block verification, final checkpoint
    "train_overhead": 1.77,       # a Ray Train step over the probe's plain DraftStep.step: the worker also waits
                                  # for its Ray Data shard, 0.25-0.6x the step (metrics.jsonl worker_data_s vs
                                  # worker_step_s); refitted on the two default runs of 2026-12-02 (docs/plan.md)
    "train_overhead_replay": 1.14,  # the same for an epoch replayed from train.cache_shard_mib's memory (every
                                    # epoch after the first, when each worker's share fits): fitted so that three
                                    # passes, (1.77 + 2 x 1.14) / 3 = 1.35, meet the run of 2026-12-04 it was fitted
                                    # on (session 23) and session 26's (385.9 s against 384); docs/plan.md
    "eval_fraction": 0.05,        # held-out evaluations, as a fraction of training time
    "export_s": 2.0,
    "validate_fixed_s": 10.0,
    "engine_actor_s": 3.0,        # per validation engine: Ray actor start, on top of the probe's fresh-process start
    "engines_together": 0.8,      # each further engine started together adds this fraction of one engine's start
                                  # (two: 32-37 s against 18-22 s alone; docs/results.md, session 19); used where
                                  # the probe did not measure it (Rates.engines_together; older plans, stated rates)
    "val_decode_efficiency": 0.48,  # validation's tokens/s over the probe's at its batch (MT-Bench's longer
                                    # prompts, 128-token answers, the batch's tail): 0.55 fitted with 32-token
                                    # decode prompts, / 1.15 for 8-token ones (as regen_efficiency)
    "spec_slowdown": 1.9,         # the engine with the draft over the one without, CPU (validate.json's speedup)
    "check_decode_slowdown": 1.55,  # the greedy check's pair (validation.greedy_check_dtype, float32) decodes this
                                    # much slower than the compute-dtype pair (bf16) that the probe times: 1.52 and
                                    # 1.59 in two runs on an AMD EPYC with AVX512-BF16 (validate's log lines,
                                    # session 32, docs/plan.md); not yet measured on a CPU with AMX-BF16
}


class PlanChanged(RuntimeError):
    """The run was planned for another ``run.time_budget`` (``<run>/plan.json``)."""


def parse_duration(text: str) -> float:
    """``"15m"``, ``"1h30m"``, ``"90s"``, ``"2h"`` or plain seconds -> seconds.

    Raises:
        ValueError: anything else (the message shows the accepted forms).
    """
    t = str(text).strip().lower().replace(" ", "")
    if re.fullmatch(r"\d+(\.\d+)?", t):
        return float(t)
    m = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?:in)?)?(?:(\d+(?:\.\d+)?)s)?", t)
    if not t or not m or not any(m.groups()):
        raise ValueError(f"run.time_budget {text!r}: use a duration like 15m, 1h30m, 90s or 2h")
    h, mi, s = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mi * 60 + s


@dataclass
class Rates:
    """What the probe measured on this machine (all per second unless named ``_s``)."""

    engine_load_s: float          # one vLLM engine built (LLM()), s
    prefill_tok_s: float          # prompt tokens/s, first training prompts, max_tokens=1
    decode_tok_s: float           # generated tokens/s at regeneration's batch (decode_batch sequences)
    decode_batch: int
    val_decode_tok_s: float       # generated tokens/s at validation's batch
    val_batch: int
    prompt_tokens_mean: float     # mean first-prompt length of kept training records (chat template applied)
    kept_fraction: float          # kept / read records of the first ones read (held-out, duplicate, too long)
    train_step_s: float           # median DraftStep.step at train.max_tokens_per_batch tokens, s
    probe_s: float = 0.0          # the probe's own wall time, s
    engine_start_s: float = 0.0   # a fresh process's start to a loaded engine (interpreter, imports, load), s;
                                  # what each validation engine pays: the probe's own start, or a warm import +
                                  # load where smaller (cold machine). 0 (older plans, stated rates): 2 x load
    machine: dict = field(default_factory=dict)
    state_bytes_per_token: float = 0.0  # one token's row in a block, uncompressed (states + ids), bytes; what a
                                        # worker's shard cache holds. 0 (older plans, stated rates): unknown
    step_s_by_optimizer: dict = field(default_factory=dict)  # {"adamw": s, "muon": s}: both steps, probed when
                                    # train.optimizer says plan (train_step_s is then the chosen one's); else {}
    engines_together: float = -1.0  # each further fresh process started together adds this fraction of one's
                                    # start, measured by the probe (two warm ``import torch, vllm`` at once against
                                    # one, clipped to [0, 1]); -1 (older plans, stated rates): OVERHEADS' figure

    @classmethod
    def from_dict(cls, d: dict) -> "Rates":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def tokens_per_sample(cfg, rates: Rates) -> float:
    """Mean tokens of one extracted training sample: first prompt + regenerated answer (estimated)."""
    return rates.prompt_tokens_mean + cfg.data.max_new_tokens * OVERHEADS["answer_fill"]


def train_tokens(cfg, n: int, rates: Rates) -> float:
    """Estimated tokens of n samples' training split (``train.val_fraction`` held out)."""
    return n * (1 - cfg.train.val_fraction) * tokens_per_sample(cfg, rates)


def steps_for(cfg, n: int, rates: Rates) -> int:
    """``train.planned_epochs`` passes over n samples' tokens, in steps of ``train.max_tokens_per_batch`` per worker."""
    t = cfg.train
    return max(1, math.ceil(t.planned_epochs * train_tokens(cfg, n, rates) / (t.max_tokens_per_batch * t.num_workers)))


def shard_cached(cfg, rates: Rates, n: int) -> bool:
    """Whether each train worker's share of n samples' states fits ``train.cache_shard_mib`` (offline runs, with
    the probe's ``state_bytes_per_token``), so that epochs after the first replay it from memory."""
    t = cfg.train
    share = train_tokens(cfg, n, rates) * rates.state_bytes_per_token / t.num_workers
    return (t.cache_shard_mib > 0 and t.data_source == "offline" and rates.state_bytes_per_token > 0
            and share <= t.cache_shard_mib * 2**20)


def train_overhead(cfg, rates: Rates, n: int = 0, steps: int = 0) -> float:
    """A Ray Train step over the probe's plain step, for ``steps`` steps over n training samples: the streamed
    ``train_overhead`` for the first epoch's steps; when each worker's share fits the shard cache
    (:func:`shard_cached`), ``train_overhead_replay`` for the later epochs' steps, which replay it from memory. So
    1.5 passes pay the streamed figure on two thirds of their steps, 3 passes on one third (docs/plan.md)."""
    o, t = OVERHEADS, cfg.train
    if not (n and steps and shard_cached(cfg, rates, n)):
        return o["train_overhead"]
    first = min(1.0, train_tokens(cfg, n, rates) / (t.max_tokens_per_batch * t.num_workers) / steps)
    return first * o["train_overhead"] + (1 - first) * o["train_overhead_replay"]


def _step_s(cfg, rates: Rates, tps: float, n: int = 0, steps: int = 0) -> float:
    """Estimated wall seconds of one optimizer step in the train stage, averaged over ``steps`` steps for n
    training samples (:func:`train_overhead`). Online (``train.data_source``), the step's tokens are extracted
    again for it: on one machine the verifier and the workers share the cores, so the two times add (on a
    cluster with separate pools they would overlap; not modelled)."""
    o, t = OVERHEADS, cfg.train
    step = rates.train_step_s * train_overhead(cfg, rates, n, steps) * (1 + o["eval_fraction"])
    if t.data_source == "online":
        step += t.max_tokens_per_batch * t.num_workers / (rates.prefill_tok_s * o["extract_efficiency"])
    return step


def stream_balance(cfg, rates: Rates) -> dict:
    """The two pools of an online or hybrid run (``train.data_source``), from ``rates``: tokens/s of states the
    verifier pool can produce (``extract.max_replicas`` x ``prefill_tok_s`` x the extraction efficiency) and the
    train pool can consume (``train.num_workers`` x ``train.max_tokens_per_batch`` per step of ``train_step_s`` plus
    its held-out evaluations), which side is the bottleneck, and the replicas that would keep the workers fed.

    Returns ``{"produce_tok_s", "consume_tok_s", "bottleneck" ("verifier" | "train"), "ratio" (produce / consume),
    "replicas_to_keep_up"}``. On separate resources the slower side sets the pace; on one machine (a local Ray) the
    two pools share the cores and their times add instead (:func:`estimate`).
    """
    o, t = OVERHEADS, cfg.train
    per_replica = rates.prefill_tok_s * o["extract_efficiency"]
    produce = cfg.extract.max_replicas * per_replica
    consume = t.num_workers * t.max_tokens_per_batch / (rates.train_step_s * (1 + o["eval_fraction"]))
    return {"produce_tok_s": produce, "consume_tok_s": consume, "ratio": produce / consume,
            "bottleneck": "verifier" if produce < consume else "train",
            "replicas_to_keep_up": max(1, math.ceil(consume / per_replica))}


def decode_tok_s_at(rates: Rates, batch: int) -> float:
    """Decode tokens/s at ``batch`` sequences: the probe's two measured batches (regeneration's and validation's),
    interpolated linearly in the batch between them and held at the nearer one outside (decoding on a CPU gets
    cheaper per token as the batch grows: 324 tok/s at 256 against 210 at 40 on an AMD EPYC with AVX2, session 30)."""
    (b0, r0), (b1, r1) = sorted([(rates.val_batch, rates.val_decode_tok_s), (rates.decode_batch, rates.decode_tok_s)])
    if r0 <= 0 or r1 <= 0:  # one batch not measured (stated rates): the other's rate
        return max(r0, r1)
    if batch >= b1:
        return r1
    if batch <= b0:
        return r0
    return r0 + (r1 - r0) * (batch - b0) / (b1 - b0)


def regeneration_decode_s(cfg, rates: Rates, n: int) -> float:
    """Seconds of decoding n regenerated answers of ``data.max_new_tokens`` (x ``answer_fill``), in chunks of
    ``verifier.max_num_seqs`` as :func:`eagle3ray.prepare.regenerate` sends them: the last, partial chunk decodes at
    its own, smaller batch (:func:`decode_tok_s_at`)."""
    per = cfg.data.max_new_tokens * OVERHEADS["answer_fill"]
    chunk = max(1, cfg.verifier.max_num_seqs)
    full, tail = divmod(n, chunk)
    return full * chunk * per / decode_tok_s_at(rates, chunk) + (tail * per / decode_tok_s_at(rates, tail)
                                                                  if tail else 0.0)


def estimate(cfg, rates: Rates, n: int, steps: int) -> dict[str, float]:
    """Estimated wall seconds per stage for n training conversations and ``steps`` optimizer steps.

    The model: fixed cost + work / rate per stage (module docstring); ``validate`` runs one pair of engines, or
    two when ``validation.greedy_check_dtype`` differs from the compute dtype.
    """
    o, d, v, vc = OVERHEADS, cfg.data, cfg.verifier, cfg.validation
    load = rates.engine_load_s
    tps = tokens_per_sample(cfg, rates)
    prepare = o["prepare_fixed_s"] + (load + (n * rates.prompt_tokens_mean / rates.prefill_tok_s
                                              + regeneration_decode_s(cfg, rates, n)) / o["regen_efficiency"]
                                      if d.regenerate else 0.0)
    extract = o["extract_fixed_s"] + load + n * tps / (rates.prefill_tok_s * o["extract_efficiency"])
    train = o["train_fixed_s"] + steps * _step_s(cfg, rates, tps, n, steps)
    if cfg.train.data_source == "online":  # no extract stage; train streams the held-out states once, then its
        train += load + n * cfg.train.val_fraction * tps / (rates.prefill_tok_s * o["extract_efficiency"])
        extract = 0.0
    elif cfg.train.data_source == "hybrid":  # train streams (and commits) every sample once; later epochs read them
        train += extract  # back from storage at the offline step's cost (on one machine, as extraction would)
        extract = 0.0
    export = o["export_s"]
    from .machine import resolve_dtype

    dtype = resolve_dtype(vc.dtype or v.dtype, v.device)
    check = 0.0 in vc.temperatures and resolve_dtype(vc.greedy_check_dtype or dtype, v.device) != dtype
    gen = vc.max_prompts * vc.max_new_tokens / (rates.val_decode_tok_s * o["val_decode_efficiency"])
    engine = (rates.engine_start_s or 2 * load) + o["engine_actor_s"]
    drafts = 1 + len(vc.reference_drafts)  # each draft's engine decodes at every temperature; so does the baseline
    from .validate import engines_at_once

    engines = drafts + 1 + (2 if check else 0)  # started in groups of engines_at_once, in this order
    at_once = engines_at_once(vc, v.device)
    groups = [min(at_once, engines - i) for i in range(0, engines, at_once)]
    together = rates.engines_together if rates.engines_together >= 0 else o["engines_together"]
    starts = sum(engine * (1 + together * (g - 1)) for g in groups)
    validate = o["validate_fixed_s"] + starts + len(vc.temperatures) * gen * (1 + drafts * o["spec_slowdown"]) + (
        gen * (1 + o["spec_slowdown"]) * o["check_decode_slowdown"] if check else 0.0)  # the check pair: T=0 only
    return {"prepare": prepare, "extract": extract, "vocab": o["vocab_s"], "train": train, "export": export,
            "check": 2.0, "validate": validate}


def make_plan(cfg, rates: Rates, budget_s: float) -> dict:
    """The sizes to run with: ``{"max_samples", "max_steps", "estimates" (s per stage), "total_s", ...}``.

    ``data.max_samples``/``train.max_steps`` given as numbers are kept; ``plan`` ones are chosen (N by bisection
    on :func:`estimate`, at least 32; steps from :func:`steps_for`). ``fits`` is False when even the smallest
    plan exceeds the budget (the plan is still returned, and says so).
    """
    fixed_n = cfg.data.max_samples if cfg.data.max_samples != "plan" else None
    fixed_s = cfg.train.max_steps if cfg.train.max_steps != "plan" else None
    target = budget_s * PLAN_SAFETY
    optimizer = cfg.train.optimizer
    if optimizer == "plan":
        if not rates.step_s_by_optimizer:
            raise ValueError("train.optimizer: plan needs both optimizers' steps (a probe of this version, or "
                             "run.plan_rates.step_s_by_optimizer: {adamw: s, muon: s})")
        optimizer = choose_optimizer(rates.step_s_by_optimizer)
        rates = replace(rates, train_step_s=rates.step_s_by_optimizer[optimizer])

    def sizes(n: int) -> tuple[int, int]:
        return n, fixed_s if fixed_s is not None else steps_for(cfg, n, rates)

    def total(n: int) -> float:  # the probe has spent part of the budget already
        return rates.probe_s + sum(estimate(cfg, rates, *sizes(n)).values())

    if fixed_n is not None:
        n = fixed_n
        if fixed_s is None:  # fit the steps around the given data
            tps = tokens_per_sample(cfg, rates)
            base = total(n) - sizes(n)[1] * _step_s(cfg, rates, tps, n, sizes(n)[1])  # everything but the steps
            steps = sizes(n)[1]
            for _ in range(4):  # a step's cost depends on how many epochs the steps make (train_overhead)
                steps = max(1, int((target - base) / _step_s(cfg, rates, tps, n, steps)))
        else:
            steps = fixed_s
    else:
        lo, hi = 32, 32
        while total(hi * 2) <= target and hi < 10_000_000:
            hi *= 2
        hi *= 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if total(mid) <= target else (lo, mid)
        n, steps = sizes(lo)
    est = {"plan": rates.probe_s, **estimate(cfg, rates, n, steps)}
    return {"max_samples": n, "max_steps": steps, "estimates": est, "total_s": sum(est.values()),
            "budget_s": budget_s, "target_s": target, "fits": sum(est.values()) <= budget_s,
            "optimizer": optimizer,
            "planned": [k for k, given in (("data.max_samples", fixed_n), ("train.max_steps", fixed_s))
                        if given is None] + (["train.optimizer"] if cfg.train.optimizer == "plan" else []),
            "tokens_per_sample": tokens_per_sample(cfg, rates), "rates": asdict(rates),
            "overheads": dict(OVERHEADS), "safety": PLAN_SAFETY, "created_at": time.time()}


#: How far the refit (:func:`refit_steps`) scales the train stage's estimate by how the data stages ran against
#: theirs: not within ``REFIT_SPEED_DEADBAND`` (there, in 13 whole runs, their ratio did not predict train's: 0.90-1.05
#: with train at 0.92-1.10; docs/plan.md), at most ``REFIT_SPEED_LIMITS``; and how far it moves the planned steps.
REFIT_SPEED_DEADBAND = (0.85, 1.15)
REFIT_SPEED_LIMITS = (0.75, 1.25)
REFIT_STEP_LIMITS = (0.5, 2.0)


def refit_steps(cfg, plan: dict, elapsed_s: float, stage_s: dict[str, float]) -> dict | None:
    """Re-fit a planned ``train.max_steps`` to the budget actually left when the train stage starts.

    The plan's sizes come from a probe of about a minute; a shared machine is slower or faster than that minute
    for the next ten (a probe in a slow spell left 154 s of a 900 s budget unused, with prepare, extract and train
    at 0.76-0.78 of their estimates; docs/plan.md, "The train stage takes the time left"). By the train stage the
    data size is fixed; the steps are not. The time left is ``plan["target_s"]`` (``PLAN_SAFETY`` x the budget)
    minus ``elapsed_s`` minus the estimates of the stages after train; the train term of :func:`estimate` at the
    planned data size is scaled by ``speed``, how the data stages ran against their estimates (the sum of
    ``stage_s`` over prepare and extract against theirs; 1 within :data:`REFIT_SPEED_DEADBAND`, else clipped to
    :data:`REFIT_SPEED_LIMITS`: in past runs whose data stages ran at 0.77 or 1.22 of plan the train stage
    followed, at 0.76 and 1.31, while nearer 1 it did not; docs/plan.md), and the largest step count whose scaled
    term fits is taken, within :data:`REFIT_STEP_LIMITS` x the planned steps.

    Args:
        cfg: the run's config with the plan's sizes in it (:func:`planned_config`).
        plan: the run's plan (:func:`make_plan`).
        elapsed_s: wall seconds of the budget spent so far (the probe included), s.
        stage_s: wall seconds of the stages run so far, by stage name, s.

    Returns:
        None when ``train.max_steps`` was not planned, or prepare or extract did not run in ``stage_s`` (a resumed
        run: the time spent before is unknown). Else ``{"max_steps", "planned_steps", "left_s", "data_ratio" (the
        data stages' actual / estimated), "speed" (the factor applied), "train_s"}`` (``train_s``: the scaled
        estimate of the train stage at the new steps, s).
    """
    if "train.max_steps" not in plan.get("planned", ()):
        return None
    data_stages = [k for k in ("prepare", "extract") if plan["estimates"].get(k, 0) > 0]
    if not data_stages or any(k not in stage_s for k in data_stages):
        return None
    lo_v, hi_v = REFIT_SPEED_LIMITS
    ratio = sum(stage_s[k] for k in data_stages) / sum(plan["estimates"][k] for k in data_stages)
    speed = 1.0 if REFIT_SPEED_DEADBAND[0] <= ratio <= REFIT_SPEED_DEADBAND[1] else min(hi_v, max(lo_v, ratio))
    after = ("export", "check", "validate")
    left = plan["target_s"] - elapsed_s - sum(plan["estimates"].get(k, 0.0) for k in after)
    rates, n, planned = Rates.from_dict(plan["rates"]), plan["max_samples"], plan["max_steps"]

    def train_s(steps: int) -> float:
        return estimate(cfg, rates, n, steps)["train"] * speed

    lo, hi = max(1, int(planned * REFIT_STEP_LIMITS[0])), max(1, int(planned * REFIT_STEP_LIMITS[1]))
    if train_s(hi) <= left:
        steps = hi
    elif train_s(lo) > left:
        steps = lo
    else:  # train_s grows with the steps: the largest count that fits
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if train_s(mid) <= left else (lo, mid)
        steps = lo
    return {"max_steps": steps, "planned_steps": planned, "left_s": left, "data_ratio": ratio, "speed": speed,
            "train_s": train_s(steps)}


#: The planned sizes each stage reads (a stage command plans only when one of its own says ``plan``).
STAGE_SIZES = {"prepare": ("data.max_samples",), "extract": ("data.max_samples",),
               "train": ("train.max_steps", "train.optimizer")}
#: Every field that may say ``plan``.
PLANNED_FIELDS = ("data.max_samples", "train.max_steps", "train.optimizer")

#: With ``train.optimizer: plan``, Muon is taken unless the probe times its step at more than this many times
#: AdamW's. Measured at a fixed 15-minute budget on 2-core CPUs (docs/results.md, docs/plan.md): at 1.18x Muon beat
#: AdamW (1.414 against 1.343, whole runs, session 18); at 1.74x (an AMD EPYC with AVX512-BF16, bf16) Muon beat it on
#: the same blocks in the same train time (1.434 against 1.411, held-out accuracy 0.427 against 0.405, session 31);
#: at 2.7x (an AMD EPYC with AVX2 only, fp32) AdamW beat it on the same blocks (1.340 against 1.318, session 30).
#: 2.2 lies between the last two (their geometric mean is 2.17); the boundary itself is not measured.
MUON_MAX_STEP_RATIO = 2.2


def choose_optimizer(step_s_by_optimizer: dict) -> str:
    """``muon`` unless its probed step costs more than :data:`MUON_MAX_STEP_RATIO` x AdamW's, then ``adamw``.

    Args:
        step_s_by_optimizer: ``{"adamw": s, "muon": s}``, median probed steps (:func:`_probe_train_step`).

    Raises:
        KeyError: either step is missing.
    """
    muon, adamw = step_s_by_optimizer["muon"], step_s_by_optimizer["adamw"]
    return "muon" if muon <= MUON_MAX_STEP_RATIO * adamw else "adamw"


def needs_plan(cfg, sizes: tuple[str, ...] = PLANNED_FIELDS) -> bool:
    """True when one of ``sizes`` (dotted config fields) says ``plan`` (only allowed with ``run.time_budget``; the
    schema checks that)."""
    return any(getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) == "plan" for k in sizes)


def probe(cfg) -> Rates:
    """Measure this machine for the stage model (module docstring), in a subprocess; see :class:`Rates`.

    Raises:
        RuntimeError: the probe process failed (its last output lines are in the message).
    """
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(cfg.model_dump_json())
    try:
        from .machine import cpu_engine_env

        # the engines it measures for start as the stages' engines do (tcmalloc preloaded where installed)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **cpu_engine_env(cfg.verifier.device))
        p = subprocess.run([sys.executable, "-m", "eagle3ray.plan", f.name], capture_output=True, text=True,
                           env=env, timeout=900)
    finally:
        os.unlink(f.name)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RATES ")]
    for x in (p.stderr or "").splitlines():  # the probe's own breakdown (records, engine, imports, train step)
        if "probe: records" in x:
            log.info("probe: %s", x.split("probe: ", 1)[1])
    if p.returncode != 0 or not lines:
        raise RuntimeError("the plan's probe failed (run.time_budget):\n" + "\n".join(
            (p.stderr or p.stdout).splitlines()[-25:]))
    return Rates.from_dict(json.loads(lines[-1][6:]))


def stated_rates(cfg) -> Rates | None:
    """``run.plan_rates`` as :class:`Rates` (a cluster's rates, stated or measured elsewhere: no probe), or None.

    Raises:
        ValueError: a field of :class:`Rates` is missing (the message lists them).
    """
    given = cfg.run.plan_rates
    if not given:
        return None
    optional = ("probe_s", "machine", "engine_start_s", "state_bytes_per_token", "engines_together",
                "step_s_by_optimizer")
    need = [k for k in Rates.__dataclass_fields__ if k not in optional and k not in given]
    if need:
        raise ValueError(f"run.plan_rates lacks {', '.join(need)} (see eagle3ray.plan.Rates; docs/plan.md)")
    return Rates.from_dict({**given, "probe_s": 0.0, "machine": {"cpu_model": "stated (run.plan_rates)"}})


def _warm_import_s(together: int = 1) -> float:
    """Wall seconds until ``together`` fresh interpreters, started at once, have each imported torch and vLLM, now
    that this process has (page cache warm, bytecode compiled): what a validation engine's process pays before
    its load, late in a run, and (``together`` > 1) how much such starts slow each other on this machine.

    The probe's own process age at its engine's load also counts a first import on a cold machine (27 s of a 46 s
    start on an AMD EPYC whose validation engines then started in 16-24 s, two together: docs/plan.md); the probe
    takes the smaller of the two. A failed import counts as infinite (the process age is used).
    """
    t = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", "import torch, vllm"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for _ in range(together)]
    try:
        ok = all(p.wait(timeout=300) == 0 for p in procs)
    except subprocess.TimeoutExpired:
        ok = False
    finally:
        for p in procs:
            p.kill()
    return time.time() - t if ok else float("inf")


def together_factor(alone_s: float, together_s: float, n: int = 2) -> float:
    """What each further process started together adds, as a fraction of one alone: ``(together_s / alone_s - 1)
    / (n - 1)``, clipped to [0, 1] (0: the starts overlap fully, 1: they take turns). -1 when either time is
    unknown (a failed or zero measurement), so that :func:`estimate` falls back to ``OVERHEADS``."""
    if not (0 < alone_s < float("inf") and 0 < together_s < float("inf")) or n < 2:
        return -1.0
    return min(1.0, max(0.0, (together_s / alone_s - 1) / (n - 1)))


def probe_prompts(cfg, spec) -> tuple[list[list[int]], float]:
    """The probe's prompts: the first user turns (chat template applied) of the run's first 64 training records,
    and the fraction of source records kept (what ``data.max_samples`` conversations cost in records read).

    Raises:
        RuntimeError: ``data.train`` yields no training record.
    """
    from transformers import AutoTokenizer

    from .prepare import RejectCounter, _prompt_ids, collect_records

    tok = AutoTokenizer.from_pretrained(spec.model_path)
    small = cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_samples": 64})})
    rejected = RejectCounter()
    recs = collect_records(small, rejected, tok)
    if not recs:
        raise RuntimeError("no training records to probe with (data.train)")
    prompts = []
    for r in recs:
        first = []
        for m in r.messages:
            first.append(m)
            if m["role"] == "user":
                break
        prompts.append(_prompt_ids(tok, first))
    return prompts, len(recs) / max(1, len(recs) + sum(rejected.counts.values()))


def probe_engine(cfg, spec):
    """The verifier's engine as the probe measures it (:class:`eagle3ray.serving_engine.ServingEngine` with the
    ``verifier`` section's settings, in this process)."""
    from .serving_engine import ServingEngine

    v = cfg.verifier
    return ServingEngine(spec.model_path, dtype=v.dtype, max_model_len=v.max_model_len, enforce_eager=v.enforce_eager,
                         max_num_seqs=v.max_num_seqs, seed=v.seed, cpu_kv_cache_gib=v.cpu_kv_cache_gib,
                         gpu_memory_utilization=v.gpu_memory_utilization,
                         tensor_parallel_size=v.tensor_parallel_size, device=v.device, cpu_threads=v.cpu_threads)


def generation_timer(eng):
    """``gen(prompts, n_tokens) -> seconds``: greedy generation of exactly ``n_tokens`` per prompt (``ignore_eos``)
    for token-id prompts, all submitted at once to ``eng``."""
    from vllm import SamplingParams

    def gen(ps, n_tokens):
        sp = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
        t = time.time()
        eng.llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        return time.time() - t

    return gen


def _probe_here(cfg) -> Rates:
    """The probe itself (runs in the subprocess :func:`probe` starts)."""
    t0 = time.time()
    import gc

    import torch

    from vllm import SamplingParams  # noqa: F401  (imported before the engine is timed, as a stage's process has it)

    from .machine import cpu_bf16_is_fast, cpu_flags, resolve_autocast
    from .serving_engine import ServingEngine  # noqa: F401  (the same)
    from .validate import engines_at_once
    from .verifier import VerifierSpec

    v = cfg.verifier
    spec = VerifierSpec.from_config(cfg)
    t_records = time.time()
    prompts, kept_fraction = probe_prompts(cfg, spec)
    t_records = time.time() - t_records  # reading the prompt sources: not part of an engine's start
    t = time.time()
    eng = probe_engine(cfg, spec)
    load = time.time() - t
    import psutil

    # what a validation engine's fresh process pays: interpreter start, imports (torch, vLLM), the load; this
    # process also read the prompt sources first (not an engine's cost), so that part is left out
    engine_start = time.time() - psutil.Process().create_time() - t_records
    gen = generation_timer(eng)
    gen(prompts[:4], 2)  # warm-up
    pre = prompts[:48]
    prefill = sum(map(len, pre)) / gen(pre, 1)

    batch = max(1, v.max_num_seqs)
    dec = decode_rate(gen, prompts, batch)
    vbatch = max(1, min(cfg.validation.max_num_seqs, cfg.validation.max_prompts))
    vdec = decode_rate(gen, prompts, vbatch, tokens=VAL_DECODE_PROBE_TOKENS) if vbatch != batch else dec
    del eng
    gc.collect()
    t_engine = time.time() - t
    warm_import = _warm_import_s()
    # validation starts its engines in groups (validate.engines_at_once); how much two fresh starts slow each other
    # differs by machine (none on a Xeon with AMX-BF16, ~0.7 on an AMD EPYC: docs/plan.md), so it is measured
    at_once = engines_at_once(cfg.validation, v.device)
    together = together_factor(warm_import, _warm_import_s(at_once), at_once) if at_once > 1 else -1.0
    engine_start = min(engine_start, load + warm_import)
    t_step = time.time()
    prompt_mean = float(sum(map(len, prompts)) / len(prompts))
    by_optimizer = {}
    if cfg.train.optimizer == "plan":  # both, for make_plan to choose between (choose_optimizer)
        by_optimizer = {o: _probe_train_step(cfg, spec, prompt_mean, optimizer=o) for o in ("adamw", "muon")}
        step_s = by_optimizer[choose_optimizer(by_optimizer)]
    else:
        step_s = _probe_train_step(cfg, spec, prompt_mean)
    from .blocks import bytes_per_token

    log.warning("probe: records %.1f s, engine %.1f s (load %.1f), warm import %.1f s (engines together %.2f), "
                "train step %.1f s", t - t0, t_engine, load, warm_import, together, time.time() - t_step)
    flags = cpu_flags()
    return Rates(engine_load_s=load, engine_start_s=engine_start, prefill_tok_s=prefill, decode_tok_s=dec,
                 decode_batch=batch, val_decode_tok_s=vdec, val_batch=vbatch,
                 prompt_tokens_mean=prompt_mean, kept_fraction=kept_fraction, train_step_s=step_s,
                 step_s_by_optimizer=by_optimizer,
                 probe_s=time.time() - t0,
                 engines_together=together,
                 state_bytes_per_token=bytes_per_token(len(spec.layer_ids), spec.model_identity["hidden_size"],
                                                       cfg.extract.storage_dtype) + ROW_BYTES_PER_TOKEN,
                 machine={"cpu_model": _cpu_model(), "amx_bf16": "amx_bf16" in flags,
                          "avx512_bf16": "avx512_bf16" in flags, "bf16_fast": cpu_bf16_is_fast(), "dtype": v.dtype,
                          "autocast": resolve_autocast(cfg.train.autocast, v.device), "torch_threads": torch.get_num_threads()})


#: Prompt tokens of each sequence in the probe's decode measurement. Both of its calls prefill every sequence, so
#: at regeneration's batch of 256 the prompts' length is most of the measurement's cost: 8 tokens measure in 24.5 s
#: what 32 took 57.1 s to (medians of 3, AMD EPYC with AVX2, session 30: ``benchmarks/probe_decode.py``,
#: docs/plan.md). The rates come out 1.21x (batch 256) and 1.15x (batch 40) higher than with 32 tokens, whose
#: shorter call reused the longer one's cached prefix blocks and so left part of a prefill in the difference;
#: ``OVERHEADS``' regeneration and validation efficiencies are divided by those ratios.
DECODE_PROBE_PROMPT_TOKENS = 8

#: Tokens each sequence decodes in the probe's measurement at validation's batch (40 sequences): 48, not
#: :func:`decode_rate`'s 16, so that the measured window (the difference of two calls) is about 3 s instead of 1.4 s
#: and a passing hiccup weighs less. Two probes minutes apart on one AMD EPYC with AVX512-BF16 measured 456 and 767
#: tok/s at 16 tokens (the runs' validation then decoded 1.3x apart), which moved validate's estimate from 144 to
#: 216 s; in one quiet process 16 and 48 tokens ranged 0.92-1.01 and 0.99-1.01 of their medians over 8 rounds, 48
#: at 0.98x the rate, so ``val_decode_efficiency`` is kept (``benchmarks/probe_decode.py --tokens 16,48``; docs/plan.md).
VAL_DECODE_PROBE_TOKENS = 48


def decode_rate(gen, prompts: list[list[int]], batch: int, prompt_tokens: int = DECODE_PROBE_PROMPT_TOKENS,
                tokens: int = 16) -> float:
    """Decode tokens/s at ``batch`` sequences: ``batch`` prompts of ``prompt_tokens`` tokens (the run's own training
    prompts, cycled, cut) decoded for ``tokens + 2`` and for 2 tokens; the difference leaves the prefill out.

    Args:
        gen: ``gen(prompts, n_tokens) -> seconds``, greedy generation of exactly ``n_tokens`` per prompt
            (``ignore_eos``).
        prompts: token-id lists (at least one).
        batch: sequences decoded together (``verifier.max_num_seqs`` for regeneration).
    """
    short = [prompts[i % len(prompts)][:prompt_tokens] for i in range(batch)]
    long_t = gen(short, tokens + 2)  # first: were a prefix cache on, the shorter call would reuse it (conservative)
    return batch * tokens / max(1e-6, long_t - gen(short, 2))


def timing_train_settings(train, optimizer: str | None = None, max_steps: int = 1000) -> dict:
    """The ``train`` section as the dict ``DraftStep.build`` takes, for timing steps outside a run (the probe, the
    benchmarks): a planned ``max_steps`` becomes ``max_steps`` (it only sets the LR schedule's length), and
    ``optimizer`` replaces ``train.optimizer`` (a planned one with no ``optimizer`` given becomes ``adamw``).

    Args:
        train: ``cfg.train`` (:class:`eagle3ray.config.TrainConfig`).
    """
    tc = train.model_dump()
    if not isinstance(tc["max_steps"], int):
        tc["max_steps"] = max_steps
    tc["optimizer"] = optimizer or (tc["optimizer"] if tc["optimizer"] != "plan" else "adamw")
    return tc


def _probe_train_step(cfg, spec, prompt_mean: float, optimizer: str | None = None) -> float:
    """Median seconds of :meth:`DraftStep.step` on synthetic packed batches of the verifier's shapes, with
    ``optimizer`` (default: ``train.optimizer``)."""
    import statistics

    import torch
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    from .machine import resolve_autocast
    from .train_worker import DraftStep

    t = cfg.train
    threads = max(1, int(t.cpus_per_worker)) if cfg.verifier.device == "cpu" else torch.get_num_threads()
    torch.set_num_threads(threads)
    H = spec.model_identity["hidden_size"]
    V = spec.model_identity["vocab_size"]
    A = len(spec.layer_ids) - 1
    tc = timing_train_settings(t, optimizer)
    d2t, t2d = build_vocab_mappings_from_distribution({i: 1 for i in range(V)}, cfg.vocab.draft_vocab_size, V)
    torch.manual_seed(0)
    step = DraftStep.build(tc, spec.model_path, spec.layer_ids[:-1], d2t, t2d, H,
                           autocast_bf16=resolve_autocast(t.autocast, cfg.verifier.device))
    step.to_device(torch.device("cuda" if cfg.verifier.device == "cuda" else "cpu"))
    step.model.train()
    L = max(8, int(prompt_mean + cfg.data.max_new_tokens * OVERHEADS["answer_fill"]))
    T = t.max_tokens_per_batch  # packed full, as pack_rows fills a step
    lengths = [L] * (T // L) + ([T % L] if T % L else [])
    times = []
    for i in range(6):
        samples = []
        for L in lengths:
            samples.append({"hidden_states": torch.randn(L, A * H), "input_ids": torch.randint(0, V, (L,)),
                            "verifier_last_hidden_states": torch.randn(L, H), "loss_mask": torch.ones(L, dtype=torch.long),
                            "lengths": torch.tensor([L]), "position_ids": torch.arange(L)})
        t0 = time.perf_counter()
        step.step(step.collate(samples))
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


# ------------------------------------------------------------------------------------------------ apply
def plan_path(cfg) -> tuple[object, str]:
    """(filesystem, path) of ``<run>/plan.json``, addressed like every other file of the run."""
    paths = storage.run_paths(cfg)
    return paths.fs, paths.sub(PLAN_FILE)


def read_plan(cfg) -> dict | None:
    """The run's ``plan.json``, or None."""
    fs, p = plan_path(cfg)
    return storage.read_json(fs, p)


def planned_config(cfg, *, replan: bool = False, on_plan=None, stage: str | None = None):
    """``cfg`` with its ``plan`` sizes replaced by the run's plan (read from ``<run>/plan.json``, or made now by
    :func:`probe` + :func:`make_plan` and written there). ``cfg`` itself when nothing says ``plan`` (with
    ``stage``: when none of the sizes that stage reads, :data:`STAGE_SIZES`, says ``plan``).

    ``on_plan(plan, fresh)`` is called with the plan used (``fresh``: made now). Raises what :func:`probe` raises.
    """
    if stage is not None and not needs_plan(cfg, STAGE_SIZES.get(stage, ())):
        return cfg
    if not needs_plan(cfg):
        return cfg
    plan = None if replan else read_plan(cfg)
    if plan is not None and abs(plan["budget_s"] - parse_duration(cfg.run.time_budget)) > 0.5:
        raise PlanChanged(
            f"run.time_budget {cfg.run.time_budget} differs from the {plan['budget_s'] / 60:g} min this run was "
            f"planned for ({plan_path(cfg)[1]}): start a new run (run.name=...) for the new budget, or "
            "`eagle3ray plan --replan` to re-plan this one (stages already finished then redo at the new sizes)")
    fresh = plan is None
    if fresh:
        rates = stated_rates(cfg) or probe(cfg)
        plan = make_plan(cfg, rates, parse_duration(cfg.run.time_budget))
        fs, p = plan_path(cfg)
        storage.write_json_atomic(fs, p, plan)
    if on_plan is not None:
        on_plan(plan, fresh)
    data = cfg.data.model_copy(update={"max_samples": plan["max_samples"]}) \
        if cfg.data.max_samples == "plan" else cfg.data
    train = cfg.train.model_copy(update={"max_steps": plan["max_steps"]}) \
        if cfg.train.max_steps == "plan" else cfg.train
    if train.optimizer == "plan":
        if plan.get("optimizer") in (None, "plan"):  # a plan.json written before train.optimizer could say plan
            raise PlanChanged(f"{plan_path(cfg)[1]} was made without an optimizer choice: `eagle3ray plan --replan` "
                              "(before the first stage finishes) or a new run.name")
        train = train.model_copy(update={"optimizer": plan["optimizer"]})
    return cfg.model_copy(update={"data": data, "train": train})


def _optimizer_note(plan: dict) -> str:
    """``, adamw: Muon's step 2.70x AdamW's`` when the plan chose the optimizer, else ``""``."""
    by = plan["rates"].get("step_s_by_optimizer") or {}
    if "train.optimizer" not in plan.get("planned", ()) or not by:
        return ""
    return f", {plan['optimizer']}: Muon's step {by['muon'] / by['adamw']:.2f}x AdamW's"


def render(plan: dict, fresh: bool = True) -> str:
    """The plan as printed before a run: one line per stage (what, how much, estimated minutes)."""
    r, e = plan["rates"], plan["estimates"]
    m = r.get("machine", {})
    n, s = plan["max_samples"], plan["max_steps"]
    what = {
        "plan": "probe: engine load, prefill, decode, draft steps",
        "prepare": f"regenerate {n} answers ({r['decode_tok_s']:.0f} tok/s at batch {r['decode_batch']})",
        "extract": f"{n} samples x ~{plan['tokens_per_sample']:.0f} tokens of states "
                   f"(prefill {r['prefill_tok_s']:.0f} tok/s)",
        "vocab": "draft vocabulary",
        "train": f"{s} steps ({r['train_step_s']:.2f} s/step probed{_optimizer_note(plan)})",
        "export": "speculators-format folder",
        "check": "vLLM's eagle3 config hook",
        "validate": "with and without the draft",
    }
    avx512 = f", avx512_bf16={m['avx512_bf16']}" if "avx512_bf16" in m else ""  # plans before 2026-12-04 lack it
    head = (f"plan for run.time_budget {plan['budget_s'] / 60:.0f} min ({'probed now' if fresh else 'from plan.json'}, "
            f"probe {r.get('probe_s', 0):.0f} s; {m.get('cpu_model', '?')}, amx_bf16={m.get('amx_bf16')}{avx512}, "
            f"dtype {m.get('dtype')}; planned: {', '.join(plan['planned']) or 'nothing'})")
    lines = [head] + [f"  {k:<9} {e[k] / 60:5.1f} min  {what.get(k, '')}" for k in e]
    lines.append(f"  {'total':<9} {plan['total_s'] / 60:5.1f} min" + ("" if plan["fits"] else
                 "  (over the budget even at the smallest size: raise run.time_budget)"))
    return "\n".join(lines)


if __name__ == "__main__":  # the probe subprocess: python -m eagle3ray.plan CONFIG_JSON
    logging.basicConfig(level=logging.WARNING)
    from .config import Config

    c = Config.model_validate_json(open(sys.argv[1]).read())
    print("RATES " + json.dumps(asdict(_probe_here(c))), flush=True)
