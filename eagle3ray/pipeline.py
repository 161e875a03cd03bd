"""The pipeline: the stage order, what each stage needs first, and ``run(cfg)`` for Python, the CLI and Ray Jobs.

=========  ======================================================  ==================================
stage      reads                                                   writes (under ``<storage>/<run>/``)
=========  ======================================================  ==================================
prepare    prompt sources (``data.train``, ``data.eval``)          conversations/
extract    conversations/ (+ the verifier service)                 hidden_states/ (offline; hybrid: train)
vocab      hidden_states/token_freq.safetensors (online: conv.)    vocab/
train      hidden_states/ blocks (online: the service), vocab/     checkpoints/ (hybrid: hidden_states/)
export     checkpoints/best.json, vocab/                           export/
check      export/ (config.json, safetensors headers)              (a report; nothing written)
validate   export/ (+ vLLM engines)                                reports/validate.{json,png}
=========  ======================================================  ==================================

Stages meet only in storage (:mod:`eagle3ray.artifacts`); each is skipped when its committed output already
matches the config, so :func:`run` on an interrupted run resumes where it stopped. :func:`run_stage` with
``with_needs=True`` also runs the stages a stage cannot start without (``extract`` needs ``prepare``'s output,
``train`` the draft vocabulary), each skipped when done.

Example (a notebook, or a Ray Job's entrypoint)::

    from eagle3ray.config import load_config
    from eagle3ray.pipeline import run
    result = run(load_config("configs/smollm2-135m-cpu.yaml", ["data.max_samples=64"]))
    result.summaries["validate"]["mean_acceptance_length"]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _prepare(cfg, progress: bool):
    from .prepare import prepare

    return prepare(cfg)


def _hybrid_complete(cfg) -> bool:
    """``train.data_source: hybrid`` and the run's hidden states are a complete extraction (an earlier hybrid run
    committed every sample, or an offline extraction ran): the run then reads them as an offline one."""
    from . import storage

    if cfg.train.data_source != "hybrid":
        return False
    paths = storage.run_paths(cfg)
    return bool((storage.read_json(paths.fs, f"{paths.hidden_states}/manifest.json") or {}).get("complete"))


def _extract(cfg, progress: bool):
    if cfg.train.data_source != "offline" and not _hybrid_complete(cfg):  # the train stage streams the states
        from .online import NotExtracted

        return NotExtracted(cfg.train.data_source)
    from .extract import extract

    return extract(cfg, progress=progress)


def _vocab(cfg, progress: bool):
    from .vocab import build_vocab

    if cfg.train.data_source != "offline":  # counted from the conversations (a complete hybrid: the same counts)
        from .online import conversation_frequencies

        return build_vocab(cfg, token_freq=conversation_frequencies(cfg))
    return build_vocab(cfg)


def _train(cfg, progress: bool, hooks=None):
    from .train import train

    if cfg.train.data_source == "online":
        from .online import datasets

        return train(cfg, hooks=hooks, progress=progress, stream=datasets)
    if cfg.train.data_source == "hybrid":
        from .online import HybridStream

        with HybridStream(cfg) as h:  # blocks committed as they stream; sealed when every sample is committed
            summary = train(cfg, hooks=hooks, progress=progress, stream=h.datasets)
        summary.hybrid = h.summary
        return summary
    return train(cfg, hooks=hooks, progress=progress)


def _export(cfg, progress: bool):
    from .export import export

    return export(cfg)


def _check(cfg, progress: bool):
    from . import storage
    from .draft_check import check_draft
    from .verifier import VerifierSpec

    paths = storage.run_paths(cfg)
    export_dir = paths.sub("export") if storage.is_local(paths.fs) else paths.uri + "/export"
    return check_draft(export_dir, VerifierSpec.from_config(cfg).model_path, storage.storage_options(cfg))


def _validate(cfg, progress: bool):
    from .validate import validate

    return validate(cfg)


@dataclass(frozen=True)
class Stage:
    """One stage: its name, the stages whose output it needs (run first by ``run_stage(with_needs=True)``), and
    the function that runs it (``fn(cfg, progress) -> summary``; every summary has ``title`` and ``rows()``)."""

    name: str
    needs: tuple[str, ...]
    fn: Callable[[Any, bool], Any]


#: Stages that only read the run (every other stage holds the run's writer lease while it runs).
READ_ONLY_STAGES = frozenset({"check"})

#: The stages in pipeline order.
STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("prepare", (), _prepare),
    Stage("extract", ("prepare",), _extract),
    Stage("vocab", (), _vocab),
    Stage("train", ("vocab",), _train),
    Stage("export", (), _export),
    Stage("check", (), _check),
    Stage("validate", (), _validate),
)}


class StageFailed(RuntimeError):
    """A stage finished but its result says the run cannot go on (the export check found problems)."""

    def __init__(self, stage: str, summary):
        super().__init__(f"stage {stage} failed")
        self.stage, self.summary = stage, summary


@dataclass
class RunResult:
    """What :func:`run` produced: each stage's summary and wall time (s), and the total wall time (s)."""

    summaries: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    total_seconds: float = 0.0
    plan: dict | None = None  # the run's plan (run.time_budget), when it has one


def run_stage(cfg, name: str, *, with_needs: bool = False, progress: bool = True,
              on_stage: Callable[[str, str, Any, float], None] | None = None,
              on_plan: Callable[[dict, bool], None] | None = None, start_note: str | None = None) -> Any:
    """Run one stage (and, with ``with_needs``, the stages it needs first); returns its summary.

    ``on_stage(event, stage, summary, seconds)`` is called with ``event`` "start" (summary: ``start_note``, a
    line on how the stage was re-planned, or None) and "end".
    Sizes set to ``plan`` are replaced first (:func:`eagle3ray.plan.planned_config`; ``on_plan(plan, fresh)``).

    Raises:
        KeyError: no such stage.
        StageFailed: the check stage found problems (its report is ``.summary``).
        whatever the stage raises (each documents it: a missing upstream output is ``FileNotFoundError``).
    """
    from .plan import planned_config

    cfg = planned_config(cfg, on_plan=on_plan, stage=name)
    stage = STAGES[name]
    if with_needs:
        for need in stage.needs:
            run_stage(cfg, need, with_needs=True, progress=progress, on_stage=on_stage)
    if on_stage is not None:
        on_stage("start", name, start_note, 0.0)
    t = time.time()
    if name in READ_ONLY_STAGES:
        summary = stage.fn(cfg, progress)
    else:
        from . import storage
        from .lease import held

        with held(storage.run_paths(cfg), name):  # one writer per run (eagle3ray.lease)
            summary = stage.fn(cfg, progress)
    if on_stage is not None:
        on_stage("end", name, summary, time.time() - t)
    if getattr(summary, "ok", True) is False:
        raise StageFailed(name, summary)
    return summary


def run(cfg, *, progress: bool = True, on_stage: Callable[[str, str, Any, float], None] | None = None,
        on_plan: Callable[[dict, bool], None] | None = None) -> RunResult:
    """The whole pipeline in :data:`STAGES` order, each stage skipped when its output already matches ``cfg``.

    Sizes set to ``plan`` are planned once, before the first stage (:func:`eagle3ray.plan.planned_config`;
    ``on_plan(plan, fresh)`` sees the plan; ``RunResult.plan`` keeps it).

    Raises:
        StageFailed: the exported draft failed the vLLM compatibility check (validate does not run).
        whatever a stage raises; everything committed before stays committed.
    """
    from .plan import planned_config

    result = RunResult()
    t0 = time.time()

    def keep(plan: dict, fresh: bool) -> None:
        result.plan = plan
        if on_plan is not None:
            on_plan(plan, fresh)

    def record(event: str, name: str, summary, seconds: float) -> None:
        if event == "end":
            result.summaries[name], result.seconds[name] = summary, seconds
        if on_stage is not None:
            on_stage(event, name, summary, seconds)

    fresh: list[bool] = []
    cfg = planned_config(cfg, on_plan=lambda plan, new: (fresh.append(new), keep(plan, new)))
    from . import storage
    from .lease import held

    with held(storage.run_paths(cfg), "run"):  # the whole run is one writer; its stages reuse the lease
        _run_stages(cfg, progress, record, result, t0 if fresh == [True] else None)
    result.total_seconds = time.time() - t0
    return result


def _run_stages(cfg, progress: bool, record, result: RunResult, t0: float | None) -> None:
    """Every stage in order; before train, a plan made by this run (``t0``: the run's start, else None) re-fits
    ``train.max_steps`` to the time left (:func:`refit_train`)."""
    last = last_service_stage(cfg)
    for name in STAGES:
        note = None
        if name == "train" and t0 is not None:
            cfg, note = refit_train(cfg, result, time.time() - t0)
        run_stage(cfg, name, progress=progress, on_stage=record, start_note=note)
        if name == last:
            release_local_verifier(cfg)


def refit_train(cfg, result: RunResult, elapsed_s: float) -> tuple[Any, str | None]:
    """``cfg`` with a planned ``train.max_steps`` re-fitted to the budget left after ``elapsed_s`` seconds of the
    run (:func:`eagle3ray.plan.refit_steps`, from ``result``'s plan and stage times), and a line saying so.

    The new steps and the refit's figures (``plan.json``'s ``refit``) are written to the run's plan, so a resumed
    run trains to the same steps (and its train stage's config hash stays the same); a plan that already has a
    refit is kept as it is. Returns ``(cfg, None)`` unchanged where nothing was re-fitted.
    """
    from . import storage
    from .plan import plan_path, refit_steps

    plan = result.plan
    if plan is None or plan.get("refit") or cfg.train.max_steps != plan.get("max_steps"):
        return cfg, None
    r = refit_steps(cfg, plan, elapsed_s, result.seconds)
    if r is None:
        return cfg, None
    plan = {**plan, "max_steps": r["max_steps"], "refit": {**r, "elapsed_s": elapsed_s}}
    storage.write_json_atomic(*plan_path(cfg), plan)
    result.plan = plan
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": r["max_steps"]})})
    scaled = f", its estimate scaled by {r['speed']:.2f}" if r["speed"] != 1.0 else ""
    return cfg, (f"{r['max_steps']} steps (planned {r['planned_steps']}; re-fitted: {r['left_s']:.0f} s left for "
                 f"it, the data stages at {r['data_ratio']:.2f}x their estimates{scaled})")


def last_service_stage(cfg) -> str:
    """The last stage of a run that calls the verifier service: ``extract`` (offline, or a hybrid run whose
    extraction is complete), else ``train`` (online and hybrid runs stream states from it while training)."""
    return "extract" if cfg.train.data_source == "offline" or _hybrid_complete(cfg) else "train"


def release_local_verifier(cfg) -> bool:
    """Stop the verifier service when it runs on a local Ray cluster that this process started
    (:data:`eagle3ray.machine.STARTED_LOCAL_CLUSTER`: ``ray.address`` unset, no ``RAY_ADDRESS``): that cluster,
    and the service with it, ends with the command, so nothing later could reuse it, and while its engine stays
    resident validation's engines start 2-4x slower on a 24 GiB machine (vLLM's ``init engine`` 25-58 s against
    1-5 s; docs/results.md, "validation without the verifier service beside it"). On a cluster given by address
    (a Ray Job, a pinned service) the service stays up for later jobs. Returns True when a service was stopped."""
    import ray

    from . import machine

    if not (machine.STARTED_LOCAL_CLUSTER and ray.is_initialized()):
        return False
    from .verifier import VerifierSpec
    from .verifier_service import stop_verifier

    stopped = stop_verifier(VerifierSpec.from_config(cfg))
    if stopped:
        import logging

        logging.getLogger(__name__).info("verifier service stopped: no later stage of this run calls it, and the "
                                         "local cluster ends with the command")
    return stopped
