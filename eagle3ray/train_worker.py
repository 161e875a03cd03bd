"""The Ray Train worker: one named training step, one checkpoint layout, and a loop short enough to read.

Model, data alignment and loss are speculators' own: ``Eagle3DraftModel`` (:func:`eagle3ray.draft.build_draft`),
``shift_batch`` (pairs the states of token t with token t+1, as speculators' trainer does) and ``CollateFn``
(packs samples into one sequence of ``max_tokens_per_batch`` tokens with document ids). The loop around them is
ours because speculators' ``Trainer`` is CUDA-only (FIELD_NOTES).

- :class:`DraftStep`: draft, AdamW (or Muon + AdamW), linear warm-up then cosine decay to ``min_lr_ratio``, bf16 autocast
  (``train.autocast``), gradient clipping, speculators' loss with TTT steps; ``step(batch) -> metrics`` and
  ``evaluate(batches) -> sums``. Every benchmark that times a training step uses this object.
- :class:`WorkerCheckpoint`: what a checkpoint directory holds and how a worker restores it.
- :func:`epoch_batches`: one epoch of a worker's Ray Data shard, decoded (:func:`row_to_sample`) and packed by
  token budget (:func:`eagle3ray.packing.pack_by_tokens`), skipping samples already consumed this epoch.
- :func:`train_loop_per_worker`: the Ray Train entry. All workers take the same number of steps per epoch (an
  all-reduce of "has a batch" ends the epoch for everyone; the leftovers are counted as ``epoch_tail_samples``;
  Ray Train's split gives every worker the same number of rows, leaving out up to ``num_workers - 1`` rows of an
  epoch, uncounted);
  every ``checkpoint_every`` steps (and at the end): held-out evaluation, a checkpoint and ``ray.train.report``;
  samples consumed in the checkpoint's epoch (by any worker) are skipped on resume, so no batch is skipped or
  repeated.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from . import blocks, check_code_fingerprint, storage
from .artifacts import metrics_path, progress_path
from .draft import TRAINABLE_FILE, build_draft
from .machine import tcmalloc_loaded
from .packing import pack_by_tokens

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"


# ------------------------------------------------------------------------------------------------ data
def row_to_sample(row: dict, all_positions: bool = False):
    """A block row -> speculators' per-sample dict, shifted (token t+1 with the states of token t).

    Args:
        row: one block row (``blocks.BLOCK_SCHEMA``).
        all_positions: loss on every position instead of the row's ``loss_mask`` (assistant tokens).

    Returns tensors: hidden_states [T-1, 3H], input_ids [T-1], verifier_last_hidden_states [T-1, H],
    loss_mask [T-1], lengths [1], position_ids [T-1].
    """
    import torch
    from speculators.models.eagle3.data import shift_batch

    st = torch.from_numpy(blocks.decode_states(row).copy())  # shape: [T, L, H], L = 3 aux + final
    T = st.shape[0]
    return shift_batch({
        "hidden_states": st[:, :-1].flatten(1),  # shape: [T, 3H]
        "input_ids": torch.as_tensor(row["input_ids"], dtype=torch.long),
        "verifier_last_hidden_states": st[:, -1],  # shape: [T, H]
        "loss_mask": (torch.ones(T, dtype=torch.long) if all_positions
                      else torch.as_tensor(row["loss_mask"], dtype=torch.long)),
        "lengths": torch.tensor([T]),
        "position_ids": torch.arange(T),
    })


def add_hidden_noise(hidden_states, num_aux: int, scale: float):
    """Feature-noise augmentation (EAGLE, Li et al. 2024): ``h + scale * rms(h) * N(0, 1)`` per auxiliary layer.

    Args:
        hidden_states: [..., num_aux * H] concatenated auxiliary hidden states (speculators' layout).
        num_aux: number of auxiliary layers concatenated on the last axis.
        scale: noise standard deviation as a fraction of each layer's per-token root-mean-square.

    Returns a new tensor of the same shape and dtype (the input is not modified).
    """
    import torch

    x = hidden_states.unflatten(-1, (num_aux, -1))  # shape: [..., num_aux, H]
    rms = x.float().pow(2).mean(-1, keepdim=True).sqrt()
    return (x + (scale * rms * torch.randn_like(x, dtype=torch.float32)).to(x.dtype)).flatten(-2)


def pack_rows(rows, max_tokens: int):
    """Group (sample_id, sample) pairs greedily into lists of at most ``max_tokens`` shifted tokens."""
    return pack_by_tokens(rows, max_tokens, lambda r: int(r[1]["lengths"][0]))


class NonFiniteLoss(RuntimeError):
    """A training step produced a NaN/Inf loss or gradient norm; the message names the step and its samples.
    Raised before the optimizer step, so no checkpoint holds the damage."""


class NonFiniteMarker:
    """``checkpoints/nonfinite.json``: {"fit", "rank", "error"}, written by the worker whose step was non-finite.

    Ray Train retries every worker error up to ``train.max_failures`` (its ``FailureConfig`` cannot exempt one), and
    a retry resumes from the last checkpoint and reaches the same data again. So a (re)started worker of the same
    ``fit`` (a token the driver draws per ``trainer.fit``) that finds the marker raises at once, before training,
    and the driver reports the first error (:func:`eagle3ray.train.train`). The driver removes the marker before
    each fit: a new ``eagle3ray train`` (with another ``train.lr``, say) tries again.
    """

    @staticmethod
    def path(config: dict) -> str:
        paths = storage.RunPaths.create(config["storage_uri"], config["run_name"], config["endpoint_url"])
        return f"{paths.sub('checkpoints')}/nonfinite.json"

    @staticmethod
    def write(config: dict, rank: int, error: str) -> None:
        paths = storage.RunPaths.create(config["storage_uri"], config["run_name"], config["endpoint_url"])
        storage.write_json_atomic(paths.fs, NonFiniteMarker.path(config),
                                  {"fit": config.get("fit_token"), "rank": rank, "error": error})

    @staticmethod
    def raise_if_set(config: dict) -> None:
        """Raises:
            NonFiniteLoss: this fit already met a non-finite step (its message)."""
        paths = storage.RunPaths.create(config["storage_uri"], config["run_name"], config["endpoint_url"])
        m = storage.read_json(paths.fs, NonFiniteMarker.path(config))
        if m and m.get("fit") == config.get("fit_token"):
            raise NonFiniteLoss(f"{m['error']} (rank {m['rank']}; not trained again on a retry)")


class ShardCache:
    """A worker's share of a dataset kept in its memory after one whole pass, so later epochs replay it instead
    of streaming it again from storage through Ray Data (``train.cache_shard_mib``).

    Every epoch of a streamed shard reads, decompresses and ships the same blocks again; on a 2-core machine that
    work shares the cores with the draft's step (the default run's worker waited 0.16 s a step for data and its step
    ran 1.45x the plan's probed step, docs/plan.md). Rows are recorded as Python dicts (their ``hidden_states``
    bytes copied out of the object store, so nothing stays pinned there) while their Arrow size stays within
    ``limit_bytes``; past it the cache drops what it holds and the shard streams every epoch, as without it.
    ``complete`` turns true only when a whole pass was recorded (a cut-short epoch still drains the rest of its
    share into it). Which rows a rank holds is its first pass's share: Ray Data's ``streaming_split`` may give a
    rank other rows in a later epoch, the cache gives it the same ones, shuffled anew each epoch.
    """

    def __init__(self, limit_bytes: int):
        self.limit, self.rows, self.nbytes = limit_bytes, [], 0
        self.overflow, self.complete = limit_bytes <= 0, False

    def record(self, rows: list, nbytes: int) -> None:
        """Keep ``rows`` (one Arrow batch, as dicts) of ``nbytes`` Arrow bytes, unless the limit is passed."""
        if self.overflow or self.complete:
            return
        self.nbytes += nbytes
        if self.nbytes > self.limit:
            self.overflow, self.rows = True, []
            log.info("train.cache_shard_mib %d: this worker's share passed it; streaming every epoch",
                     self.limit >> 20)
            return
        self.rows.extend(rows)

    def finish(self) -> None:
        """A whole pass was recorded."""
        if not self.overflow and not self.complete:
            self.complete = True
            log.info("cached this worker's shard in memory: %d rows, %.0f MiB (train.cache_shard_mib %d)",
                     len(self.rows), self.nbytes / 2**20, self.limit >> 20)


class EpochBatches:
    """One epoch of a Ray Data shard as packed batches ``(sample_ids, batch)``, skipping ``skip`` ids.

    Samples are shuffled on the worker in a buffer of ``train.shuffle_buffer_rows`` rows (seeded with ``seed``):
    each incoming row swaps into a random slot and the row it displaces is trained on, O(1) per row, and the
    order is a function of the seed. Ray Data's own ``local_shuffle_buffer_size`` re-assembles an Arrow buffer
    of rows of megabytes of hidden states for every batch taken from it: iterating the 100 rows of a default-run
    extraction took 9.7 s with a 64-row buffer and 4.4 s without (one in-process run, docs/results.md).

    With a ``cache`` (:class:`ShardCache`) the rows streamed are recorded in it; with ``replay`` the epoch reads
    the cache instead of the shard (which is then not iterated at all) and shuffles all of its rows with ``seed``.

    A sample longer than ``train.max_tokens_per_batch`` (shifted tokens) fills a batch alone and speculators'
    ``CollateFn`` trains on its first ``max_tokens_per_batch`` tokens: such samples are counted in ``truncated``
    (reported as ``truncated_samples``) and the first one is logged, never truncated silently.

    ``drain()`` consumes the rest of the epoch without decoding it (streaming splits expect full epochs) and
    returns the number of this epoch's rows (not in ``skip``) that were not handed out in a batch: those it
    skipped, the shuffle buffer's, and those read ahead by the packing.
    """

    def __init__(self, shard, step: "DraftStep", seed: int, skip: set, all_positions: bool = False,
                 cache: ShardCache | None = None, replay: bool = False):
        if replay and not (cache and cache.complete):
            raise ValueError("replay needs a complete ShardCache")
        self._it = iter(()) if replay else iter(shard.iter_batches(batch_size=8, batch_format="pyarrow"))
        self._cache, self._replay = cache, replay
        self._step, self._skip, self._all = step, skip, all_positions
        self._rng, self._buffer = random.Random(seed), []
        self._pulled = self._packed = 0  # rows taken from the shard (not in ``skip``), rows handed out in batches
        self.truncated = 0
        self._replayed = []
        if replay:
            self._replayed = [r for r in cache.rows if r["sample_id"] not in skip]
            self._rng.shuffle(self._replayed)
            self._pulled = len(self._replayed)

    def _shuffled(self):
        """Rows not in ``skip``, through the shuffle buffer (none with ``shuffle_buffer_rows`` 0 or 1), or the
        cache's rows in a full shuffle."""
        if self._replay:
            yield from self._replayed
            return
        size, buf = self._step.tc["shuffle_buffer_rows"], self._buffer
        for tbl in self._it:
            every = tbl.to_pylist()
            if self._cache is not None:
                self._cache.record(every, tbl.nbytes)
            rows = [r for r in every if r["sample_id"] not in self._skip]
            self._pulled += len(rows)
            for row in rows:
                if size <= 1:
                    yield row
                    continue
                buf.append(row)
                if len(buf) >= size:
                    i = self._rng.randrange(len(buf))
                    buf[i], buf[-1] = buf[-1], buf[i]
                    yield buf.pop()
        if self._cache is not None:
            self._cache.finish()
        self._rng.shuffle(buf)
        while buf:
            yield buf.pop()

    def _rows(self):
        budget = self._step.tc["max_tokens_per_batch"]
        for row in self._shuffled():
            sample = row_to_sample(row, self._all)
            n = int(sample["lengths"][0])
            if n > budget:
                if not self.truncated:
                    log.warning("sample %s has %d tokens > train.max_tokens_per_batch %d: trained on its "
                                "first %d (counted as truncated_samples)", row["sample_id"], n, budget, budget)
                self.truncated += 1
            yield row["sample_id"], sample

    def __iter__(self):
        groups, t0 = pack_rows(self._rows(), self._step.tc["max_tokens_per_batch"]), time.perf_counter()
        for group in groups:
            batch = self._step.collate([s for _, s in group])
            self._step.seconds["data_s"] += time.perf_counter() - t0  # reading, decoding, packing this batch
            self._packed += len(group)
            yield [sid for sid, _ in group], batch
            t0 = time.perf_counter()

    def drain(self) -> int:
        self._buffer.clear()
        rest = 0  # a replay pulled all its rows at the start
        for t in self._it:
            if self._cache is not None and not self._cache.overflow:
                self._cache.record(t.to_pylist(), t.nbytes)
            rest += len(set(t.column("sample_id").to_pylist()) - self._skip)
        if self._cache is not None and not self._replay:
            self._cache.finish()
        return self._pulled - self._packed + rest


# ------------------------------------------------------------------------------------------------ step
def build_optimizers(draft, tc: dict) -> list:
    """The optimizers of the draft's trainable weights, by ``train.optimizer``.

    ``adamw``: one ``torch.optim.AdamW`` (``lr``, ``weight_decay``) over every trainable weight. ``muon``:
    speculators' ``build_optimizers`` (speculators/train/optimizers.py, the default optimizer of its trainer):
    ``torch.optim.Muon`` (``muon_lr`` or ``lr``, ``muon_weight_decay``, ``muon_momentum``, 5 Newton-Schulz steps,
    ``adjust_lr_fn="match_rms_adamw"``) over the 2D weight matrices other than embeddings and ``lm_head``, then
    AdamW (``lr``, ``weight_decay``) over the rest: ``[Muon, AdamW]``.

    Raises:
        ValueError: ``optimizer`` is neither (``plan`` must be resolved first: :func:`eagle3ray.plan.planned_config`).
    """
    import torch

    if tc.get("optimizer", "adamw") not in ("adamw", "muon"):
        raise ValueError(f"train.optimizer {tc['optimizer']!r}: the plan has not resolved it to adamw or muon")
    if tc.get("optimizer", "adamw") == "adamw":  # kept as before: checkpoints' optimizer states index this list
        return [torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=tc["lr"],
                                  weight_decay=tc["weight_decay"])]
    from types import SimpleNamespace

    from speculators.train.optimizers import build_optimizers as speculators_build

    use_fp32_newton_schulz_on_slow_bf16_cpus()
    return speculators_build(draft, SimpleNamespace(
        optimizer="muon", lr=tc["lr"], weight_decay=tc["weight_decay"], muon_lr=tc.get("muon_lr") or tc["lr"],
        muon_momentum=tc["muon_momentum"], muon_weight_decay=tc["muon_weight_decay"], muon_ns_steps=5,
        muon_adjust_lr_fn="match_rms_adamw"))


def use_fp32_newton_schulz_on_slow_bf16_cpus() -> None:
    """Make ``torch.optim.Muon`` orthogonalize in float32 on CPUs where bfloat16 is slow (idempotent).

    torch's ``_zeropower_via_newtonschulz`` (torch/optim/_muon.py, Keller Jordan's quintic iteration) always casts
    the update to bfloat16. On a CPU without bf16 instructions (:func:`eagle3ray.machine.cpu_bf16_is_fast` False) bf16
    matmuls run on a slow path: on a 2-core AMD EPYC (no avx512, no amx_bf16) one call on the draft's fc
    [576, 1728] took 3.6 s in bf16 and 0.14 s in float32, and a whole Muon step of the CPU config 25.3 s against
    0.40 s with AdamW (``plan._probe_train_step``, docs/results.md). This wraps that function: a CPU tensor on
    such a CPU takes the same iteration (same coefficients, steps, transpose and norm) in float32; every other
    tensor (GPU, CPUs with AMX-BF16 or AVX512-BF16) takes torch's own. The result differs from torch's only by bf16
    rounding (a test checks it). Wrapping is needed because torch's Muon has no option for the iteration's dtype.
    """
    import functools

    from torch.optim import _muon

    if getattr(_muon._zeropower_via_newtonschulz, "eagle3ray_fp32_on_cpu", False):
        return
    torch_ns = _muon._zeropower_via_newtonschulz
    from .machine import cpu_bf16_is_fast

    slow_bf16 = functools.cache(lambda: not cpu_bf16_is_fast())

    def newton_schulz(grad, ns_coefficients, ns_steps, eps):
        if grad.device.type != "cpu" or not slow_bf16() or grad.ndim != 2 or len(ns_coefficients) != 3:
            return torch_ns(grad, ns_coefficients, ns_steps, eps)  # torch's, with its own checks
        import torch

        a, b, c = ns_coefficients
        x = grad.float()  # shape: [m, n]; a copy (grad stays untouched), as torch's .bfloat16() is
        if grad.size(0) > grad.size(1):
            x = x.T
        x = x / x.norm().clamp(min=eps)  # spectral norm <= 1
        for _ in range(ns_steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if grad.size(0) > grad.size(1) else x

    newton_schulz.eagle3ray_fp32_on_cpu = True
    newton_schulz.torch_newton_schulz = torch_ns
    _muon._zeropower_via_newtonschulz = newton_schulz


def separate_fused_loss_autotune_configs() -> None:
    """Give each of speculators' fused-loss Triton kernels its own autotune config list (idempotent).

    speculators 0.9.0 (speculators/losses/fused.py) decorates ``loss_forward_kernel`` and ``loss_backward_kernel``
    with one ``triton.autotune(configs=...)`` object, so both kernels' ``Autotuner.configs`` are the same Python
    list. On CUDA speculators ``torch.compile``s the draft's forward (``conditional_torch_compile``), and Dynamo
    (torch 2.11 on an H200, benchmarks/gpu_draft_step.py, docs/results.md) refuses to trace the backward kernel:
    ``AssertionError: ListVariable(length=21) is already tracked for mutation ... loss_backward_kernel.configs``.
    A copy of the list per kernel holds the same configs, so autotuning and results are unchanged.

    Raises:
        RuntimeError: Triton is not importable (speculators' own message: fused losses need Triton).
    """
    try:
        from speculators.losses import fused
    except ImportError as e:
        raise RuntimeError("train.loss_impl: fused needs Triton (speculators.losses.fused); use eager") from e
    seen: set[int] = set()
    for name in ("loss_forward_kernel", "loss_backward_kernel"):
        kernel = getattr(fused, name, None)
        configs = getattr(kernel, "configs", None)
        if isinstance(configs, list):
            if id(configs) in seen:
                kernel.configs = list(configs)
            seen.add(id(kernel.configs))


def lr_lambda(warmup: int, total: int, floor: float):
    """LR multiplier per step: linear warm-up over ``warmup`` steps, then cosine decay to ``floor`` at ``total``."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def summarize(sums: dict, ttt_steps: int, prefix: str) -> dict:
    """Metrics from summed speculators metrics (``loss_sum``/``loss_total``, ``full_acc_k_sum``/``_total``, ...):
    ``{prefix}loss``, ``{prefix}full_acc_k``, ``{prefix}cond_acc_k`` per TTT position k."""
    out = {}
    if sums.get("loss_total"):
        out[f"{prefix}loss"] = sums["loss_sum"] / sums["loss_total"]
    for k in range(ttt_steps):
        tot = sums.get(f"full_acc_{k}_total", 0.0)
        if tot:
            out[f"{prefix}full_acc_{k}"] = sums[f"full_acc_{k}_sum"] / tot
        tot = sums.get(f"cond_acc_{k}_total", 0.0)
        if tot:
            out[f"{prefix}cond_acc_{k}"] = sums[f"cond_acc_{k}_sum"] / tot
    return out


def accumulate(acc: dict, metrics: dict) -> None:
    """Add speculators' per-batch metric sums into ``acc`` (floats)."""
    for k, v in metrics.items():
        acc[k] = acc.get(k, 0.0) + float(v)


@dataclass
class DraftStep:
    """One optimizer step of the EAGLE-3 draft, as every training path and benchmark runs it.

    Build it with :meth:`build`; call :meth:`to_device` once (after restoring a checkpoint); then
    ``step(batch)`` trains on one packed batch and returns speculators' metric sums, ``evaluate(batches)``
    sums the held-out metrics of an iterable of ``(ids, batch)``.

    A batch is speculators' ``CollateFn`` output for ``tc["max_tokens_per_batch"]`` tokens: hidden_states
    [1, N, A*H], verifier_last_hidden_states [1, N, H], input_ids/loss_mask/position_ids/document_ids [1, N].
    """

    core: object  # the Eagle3DraftModel
    tc: dict  # the train section as a dict
    num_aux: int
    optimizers: list  # [AdamW], or [Muon, AdamW] with train.optimizer: muon (build_optimizers)
    schedulers: list  # one LambdaLR per optimizer, the same schedule
    trainable: list
    loss_cfg: object
    collate: object
    autocast_bf16: bool
    device: object = None
    model: object = None  # what training calls: the draft, or its DDP wrapper
    _autocast: object = field(default=None, repr=False)
    #: seconds since this object was built: in :meth:`step` (``step_s``) and waiting for a batch of the Ray Data
    #: shard, decoded and packed (``data_s``, :class:`EpochBatches`); reported with each checkpoint
    seconds: dict = field(default_factory=lambda: {"step_s": 0.0, "data_s": 0.0})

    @classmethod
    def build(cls, tc: dict, verifier_path: str, aux_layer_ids: list[int], d2t, t2d, hidden_size: int,
              autocast_bf16: bool) -> "DraftStep":
        """The draft (:func:`eagle3ray.draft.build_draft`, initialised from the current torch RNG), its optimizers
        (:func:`build_optimizers`), the LR schedule of each (:func:`lr_lambda`), speculators' loss config and
        collate."""
        import torch
        from speculators.losses import resolve_loss_config
        from speculators.train.data import CollateFn

        if tc["loss_impl"] == "fused":
            separate_fused_loss_autotune_configs()
        draft = build_draft(verifier_path, aux_layer_ids, d2t, t2d, tc)
        trainable = [p for p in draft.parameters() if p.requires_grad]
        opts = build_optimizers(draft, tc)
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(tc["warmup_steps"], tc["max_steps"],
                                                                 tc["min_lr_ratio"])) for o in opts]
        return cls(core=draft, tc=tc, num_aux=len(aux_layer_ids), optimizers=opts, schedulers=scheds,
                   trainable=trainable, loss_cfg=resolve_loss_config(tc["loss"], tc["loss_impl"]),
                   collate=CollateFn(tc["max_tokens_per_batch"], hidden_size, len(aux_layer_ids),
                                     dtype=torch.float32),
                   autocast_bf16=autocast_bf16)

    def to_device(self, device, wrap=None) -> None:
        """Move the draft to ``device``; ``wrap`` (e.g. ``ray.train.torch.prepare_model``) makes the module that
        training calls (evaluation calls the unwrapped draft)."""
        import torch

        self.device = device
        self.model = self.core.to(device)
        if wrap is not None:
            self.model = wrap(self.model)
        self.core = self.model.module if hasattr(self.model, "module") else self.model
        self._autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast_bf16)

    @property
    def lr(self) -> float:
        """The current learning rate of the first optimizer (Muon's with ``train.optimizer: muon``)."""
        return self.schedulers[0].get_last_lr()[0]

    def forward(self, batch: dict, training: bool):
        """(loss, metric sums) of one batch; training adds ``train.hidden_noise`` feature noise."""
        import torch

        tc = self.tc
        b = {k: v.to(self.device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if training and tc["hidden_noise"] > 0:
            b["hidden_states"] = add_hidden_noise(b["hidden_states"], self.num_aux, tc["hidden_noise"])
        with self._autocast:
            _, loss, metrics = (self.model if training else self.core)(
                **b, ttt_steps=tc["ttt_steps"], ttt_step_loss_decay=tc["ttt_step_loss_decay"],
                loss_config=self.loss_cfg)
        return loss, metrics

    def step(self, batch: dict, where: str = "a step") -> dict:
        """Forward, backward, clip to ``train.grad_clip``, optimizer and scheduler steps; returns the metric sums.

        Raises:
            NonFiniteLoss: the loss or the gradient norm is NaN/Inf (``where`` names the step and samples); the
                weights and optimizer state are left as they were before the step.
        """
        t0 = time.perf_counter()
        try:
            return self._step(batch, where)
        finally:
            self.seconds["step_s"] += time.perf_counter() - t0

    def _step(self, batch: dict, where: str) -> dict:
        import torch

        loss, metrics = self.forward(batch, training=True)
        if not torch.isfinite(loss.detach()).all():
            raise NonFiniteLoss(f"{where}: loss is {loss.item()}; the weights were not updated")
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.tc["grad_clip"])
        if not torch.isfinite(norm):
            for o in self.optimizers:
                o.zero_grad(set_to_none=True)
            raise NonFiniteLoss(f"{where}: gradient norm is {norm.item()}; the weights were not updated")
        for o, sched in zip(self.optimizers, self.schedulers, strict=True):
            o.step()
            sched.step()
        return metrics

    def evaluate(self, batches) -> dict:
        """Summed held-out metrics over ``batches`` (``(ids, batch)`` pairs), without gradients."""
        import torch

        sums: dict = {}
        self.model.eval()
        with torch.no_grad():
            for _, batch in batches:
                _, metrics = self.forward(batch, training=False)
                accumulate(sums, metrics)
        self.model.train()
        return sums


# ------------------------------------------------------------------------------------------- checkpoint
@dataclass
class DataPosition:
    """Where training stands: optimizer steps taken, the epoch, and the sample ids consumed in it (all ranks)."""

    step: int = 0
    epoch: int = 0
    consumed: set = field(default_factory=set)


class WorkerCheckpoint:
    """The layout of one Ray Train checkpoint directory (``checkpoints/train/checkpoint_*``)::

        draft_trainable.safetensors  rank 0: the draft's trainable weights (fc, decoder layer, norms, lm_head)
        trainer_state.pt             rank 0: {"optimizer", "scheduler", "step", "epoch", "torch_rng"}
        data_rank<r>.json            every rank r: {"epoch", "consumed": [sample ids rank r consumed this epoch]}
        step.json                    rank 0, written last: {"step", "epoch", "world", "sizes": {rank 0's files: bytes}}

    The data position is kept per sample, not per rank, so a run may resume with another number of workers.
    ``step.json`` lets a new driver find the newest checkpoint on storage without Ray Train's own record
    (:meth:`latest_on_storage`). Ray Train's own record misses a checkpoint whose report had not reached its
    controller when the run stopped: a driver killed between a checkpoint's upload and Ray Train's snapshot of
    it, or a worker that died shortly after reporting (seen on the local S3 endpoint: a worker dead two steps
    after its checkpoint restarted from step 0). Every worker start, first or restarted, therefore looks at
    storage too and resumes from whichever is newer.
    """

    @staticmethod
    def complete_on_storage(fs, root: str) -> dict[int, str]:
        """{step: path} of the complete checkpoints under ``root`` (``checkpoints/train``); for a step saved twice
        (by an attempt that died and by the one that resumed before it), the later one (Ray Train names its
        folders ``checkpoint_<timestamp>``).

        Complete: rank 0's ``step.json`` is there, its weights and trainer state have the sizes it records, and
        every rank's ``data_rank<r>.json`` for the world size it records is there (the layout above).
        One listing of ``root`` and one small read per checkpoint. Checkpoints written before ``step.json``
        existed are left to Ray Train's own record.
        """
        found: dict[int, str] = {}
        try:
            dirs = sorted(e["name"] for e in fs.ls(root, detail=True)
                          if e["type"] == "directory" and e["name"].rsplit("/", 1)[-1].startswith("checkpoint_"))
        except FileNotFoundError:
            return found
        for d in dirs:
            try:
                meta = storage.read_json(fs, f"{d}/step.json")
                sizes = {e["name"].rsplit("/", 1)[-1]: e["size"] for e in fs.ls(d, detail=True)}
            except (OSError, ValueError):
                continue
            if not meta or not all(sizes.get(n) == v for n, v in (meta.get("sizes") or {"-": -1}).items()) \
                    or not all(f"data_rank{r}.json" in sizes for r in range(int(meta.get("world", 1)))):
                continue  # cut short (a driver killed mid-upload): an older one is used
            found[int(meta["step"])] = d
        return found

    @staticmethod
    def latest_on_storage(fs, root: str) -> tuple[int, str] | None:
        """(step, path) of the newest complete checkpoint under ``root`` (:meth:`complete_on_storage`) whose every
        ``data_rank<r>.json`` parses (a rank killed mid-upload can leave one cut short: the one before is used),
        or None."""
        for step_, path in sorted(WorkerCheckpoint.complete_on_storage(fs, root).items(), reverse=True):
            try:
                for f in fs.ls(path, detail=False):
                    if f.rsplit("/", 1)[-1].startswith("data_rank"):
                        json.loads(fs.cat_file(f))
            except (OSError, ValueError):
                log.warning("checkpoint %s: a data_rank file is cut short; resuming from an older one", path)
                continue
            return step_, path
        return None

    @staticmethod
    def stored_for_all(config: dict, rank: int, world: int) -> tuple[int, str] | None:
        """:meth:`latest_on_storage` of the run, chosen by rank 0 and broadcast to every rank (listings may differ
        between nodes, e.g. NFS attribute caches; the data positions and optimizer state must not)."""
        paths = storage.RunPaths.create(config["storage_uri"], config["run_name"], config["endpoint_url"])
        stored = WorkerCheckpoint.latest_on_storage(paths.fs, f"{paths.sub('checkpoints')}/train") \
            if rank == 0 else None
        if world > 1:
            import torch.distributed as dist

            box = [stored]
            dist.broadcast_object_list(box, src=0)
            stored = box[0]
        return stored

    @staticmethod
    def newer(ray_ckpt, stored: tuple[int, str] | None, fs):
        """The checkpoint to resume from: Ray Train's (``ray_ckpt``, or None) or ``stored`` ((step, path) from
        :meth:`latest_on_storage`, or None), whichever holds the later step."""
        if stored is None:
            return ray_ckpt
        import ray.train

        if ray_ckpt is not None:
            try:  # one small read, not the whole checkpoint
                with ray_ckpt.filesystem.open_input_stream(f"{ray_ckpt.path}/step.json") as f:
                    ray_step = int(json.loads(f.read())["step"])
            except (OSError, ValueError, KeyError):
                ray_step = -1  # a checkpoint from before step.json: trust Ray's record unless storage has newer
            if ray_step >= stored[0]:
                return ray_ckpt
        log.info("resuming from %s (step %d): newer than Ray Train's record of its checkpoints", stored[1],
                 stored[0])
        return ray.train.Checkpoint(stored[1], filesystem=fs)

    @staticmethod
    def restore(ckpt, step: DraftStep) -> DataPosition | None:
        """Load ``ckpt`` (a ``ray.train.Checkpoint`` or None) into ``step`` (weights, optimizer, scheduler, torch
        RNG); returns the data position, or None when there is nothing to resume.

        Raises:
            RuntimeError: the checkpoint lacks trainable weights of the draft this config builds.
        """
        if ckpt is None:
            return None
        import torch
        from safetensors.torch import load_file

        pos = DataPosition()
        with ckpt.as_directory() as d:
            state = load_file(os.path.join(d, TRAINABLE_FILE))
            missing = {n for n, p in step.core.named_parameters() if p.requires_grad} - set(state)
            if missing:
                raise RuntimeError(f"checkpoint {ckpt.path} lacks trainable weights {sorted(missing)[:5]}")
            step.core.load_state_dict(state, strict=False)
            ts = torch.load(os.path.join(d, STATE_FILE), weights_only=True)
            opt_states, sched_states = ts["optimizer"], ts["scheduler"]
            if isinstance(opt_states, dict):  # one optimizer, as checkpoints held before train.optimizer existed
                opt_states, sched_states = [opt_states], [sched_states]
            if len(opt_states) != len(step.optimizers):
                raise RuntimeError(f"checkpoint {ckpt.path} holds {len(opt_states)} optimizer states, this config's "
                                   f"train.optimizer builds {len(step.optimizers)}")
            for o, sd in zip(step.optimizers, opt_states):
                o.load_state_dict(sd)
            for sched, sd in zip(step.schedulers, sched_states):
                sched.load_state_dict(sd)
            pos.step, pos.epoch = int(ts["step"]), int(ts["epoch"])
            torch.set_rng_state(ts["torch_rng"])
            for name in os.listdir(d):  # data positions of every rank (the split may differ now)
                if name.startswith("data_rank"):
                    with open(os.path.join(d, name)) as f:
                        ds_state = json.load(f)
                    if ds_state["epoch"] == pos.epoch:
                        pos.consumed.update(ds_state["consumed"])
        return pos

    @staticmethod
    def save(d: str, step: DraftStep, rank: int, n_steps: int, epoch: int, mine: set) -> None:
        """Write this rank's part of a checkpoint into folder ``d`` (``mine``: ids this rank consumed this epoch).

        Raises:
            OSError: ``ENOSPC`` naming the file, the folder and the free and needed bytes when the file system
                holding ``d`` is too full for the checkpoint (:meth:`_write`); torch's own error for a full disk
                is ``RuntimeError: basic_ios::clear: iostream error``, which names neither.
        """
        import torch
        from safetensors.torch import save_file

        if rank == 0:
            trainable = {n: p.detach().cpu().contiguous() for n, p in step.core.named_parameters() if p.requires_grad}
            need = 3 * sum(t.numel() * t.element_size() for t in trainable.values())  # weights + <= 2 moments
            WorkerCheckpoint._write(d, TRAINABLE_FILE, need, n_steps,
                                    lambda path: save_file(trainable, path))
            WorkerCheckpoint._write(d, STATE_FILE, need, n_steps, lambda path: torch.save(
                {"optimizer": [o.state_dict() for o in step.optimizers],
                 "scheduler": [sched.state_dict() for sched in step.schedulers],
                 "step": n_steps, "epoch": epoch, "torch_rng": torch.get_rng_state()}, path))
        with open(os.path.join(d, f"data_rank{rank}.json"), "w") as f:
            json.dump({"epoch": epoch, "consumed": sorted(mine)}, f)
        if rank == 0:
            import ray.train

            sizes = {n: os.path.getsize(os.path.join(d, n)) for n in (TRAINABLE_FILE, STATE_FILE)}
            with open(os.path.join(d, "step.json"), "w") as f:
                json.dump({"step": n_steps, "epoch": epoch, "world": ray.train.get_context().get_world_size(),
                           "sizes": sizes}, f)

    @staticmethod
    def _write(d: str, name: str, need: int, n_steps: int, write) -> None:
        """``write(path)`` for ``d/name``; a failure on a file system with fewer than ``need`` bytes free (a full
        disk: safetensors and torch.save word it as an I/O error) is raised as ``OSError(ENOSPC)`` naming the
        file, the step, the free and needed bytes, and where the folder comes from (``TMPDIR``: Ray Train writes
        a checkpoint in a local temporary folder first, then uploads it to ``run.storage``)."""
        path = os.path.join(d, name)
        try:
            write(path)
        except Exception as e:
            free = shutil.disk_usage(d).free
            if free >= need and not (isinstance(e, OSError) and e.errno == errno.ENOSPC):
                raise
            raise OSError(errno.ENOSPC, f"no space left for the step-{n_steps} checkpoint file {path}: "
                          f"{free:,} bytes free where it needs about {need:,} (the local temporary folder a "
                          f"checkpoint is written to before its upload; set TMPDIR for the Ray workers or free "
                          f"space, then run train again: it resumes from the last checkpoint). "
                          f"Original error: {type(e).__name__}: {e}") from e


# ------------------------------------------------------------------------------------------------ hooks
@dataclass
class WorkerHooks:
    """Test hooks, passed in by the driver (``train(cfg, hooks=...)``); the defaults do nothing.

    Args:
        fail_at_step: the last worker exits (``os._exit(1)``, a real process death) at this step on the first
            attempt (not after a resume).
        fail_once_at: the last worker exits the same way at each of these steps, once each, whichever attempt
            reaches it first (needs ``trace_dir``, where a ``failed-<step>`` file records it): several worker
            failures in one epoch.
        trace_dir: each worker appends the sample ids of every step there (``rank<r>-<pid>-<ns>.jsonl``).
        nan_at_step: a NaN in the hidden states of this step's batch, on every attempt (:meth:`poison`).
    """

    fail_at_step: int | None = None
    fail_once_at: tuple[int, ...] = ()
    trace_dir: str | None = None
    nan_at_step: int | None = None

    def poison(self, step: int, batch: dict) -> None:
        """With ``nan_at_step``: one NaN in the batch's hidden states at that step, on every attempt (a block of
        bad states read again on a retry)."""
        if self.nan_at_step is not None and step == self.nan_at_step:
            batch["hidden_states"].view(-1)[0] = float("nan")

    def start(self, rank: int) -> None:
        self._trace = None
        if self.trace_dir:
            os.makedirs(self.trace_dir, exist_ok=True)
            self._trace = open(os.path.join(self.trace_dir, f"rank{rank}-{os.getpid()}-{time.time_ns()}.jsonl"), "a")

    def before_step(self, step: int, rank: int, world: int, resumed: bool) -> None:
        once = step in self.fail_once_at and rank == world - 1 and self.trace_dir \
            and not os.path.exists(os.path.join(self.trace_dir, f"failed-{step}"))
        if once:
            open(os.path.join(self.trace_dir, f"failed-{step}"), "w").close()
        if once or (self.fail_at_step is not None and step == self.fail_at_step and not resumed
                    and rank == world - 1):
            log.warning("test hook: worker %d exits at step %d", rank, step)
            logging.shutdown()
            os._exit(1)

    def after_step(self, step: int, epoch: int, ids: list[str]) -> None:
        if self._trace is not None:
            self._trace.write(json.dumps({"step": step, "epoch": epoch, "ids": ids}) + "\n")
            self._trace.flush()

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()


# ------------------------------------------------------------------------------------------------ loop
class _Collective:
    """The two all-reduces the loop needs (no-ops with one worker)."""

    def __init__(self, world: int, device):
        self.world, self.device = world, device

    def all_min(self, flag: int) -> int:
        if self.world == 1:
            return flag
        import torch
        import torch.distributed as dist

        t = torch.tensor([flag], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def all_sum(self, d: dict) -> dict:
        """Sums of ``d``'s values over the ranks, by key. Every rank must call it; the ranks' keys may differ (a
        rank whose batches carried no metric of some kind has no key for it), so the keys are gathered first."""
        if self.world == 1:
            return d
        import torch
        import torch.distributed as dist

        every: list = [None] * self.world
        dist.all_gather_object(every, sorted(d))
        keys = sorted({k for ks in every for k in ks})
        if not keys:
            return {}
        t = torch.tensor([d.get(k, 0.0) for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))


class _Shards:
    """The worker's Ray Data shards (``train``, ``val``), each with its :class:`ShardCache` of ``limit_mib`` MiB."""

    def __init__(self, step: "DraftStep", comm: "_Collective", limit_mib: int):
        self.step, self.comm, self.limit = step, comm, limit_mib << 20
        self.caches = {"train": ShardCache(self.limit), "val": ShardCache(self.limit)}

    def epoch(self, name: str, seed: int, skip: set, all_positions: bool = False) -> EpochBatches:
        """The shard's next epoch, replayed from memory when every rank's cache holds its whole share (every rank
        calls this at the same point: the decision is an all-reduce)."""
        import ray.train

        cache = self.caches[name]
        replay = bool(self.comm.all_min(int(cache.complete))) if self.limit else False
        return EpochBatches(ray.train.get_dataset_shard(name), self.step, seed, skip, all_positions, cache, replay)


def _worker_logging() -> None:
    """Route this package's INFO records to the worker's stderr (Ray shows it in the driver and the dashboard)."""
    pkg = logging.getLogger("eagle3ray")
    if not pkg.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        pkg.addHandler(h)
        pkg.setLevel(logging.INFO)
        pkg.propagate = False


def _append_metrics(config: dict, entry: dict) -> None:
    """Append one line to ``<run>/checkpoints/metrics.jsonl`` (rank 0 only)."""
    paths = storage.RunPaths.create(config["storage_uri"], config["run_name"], config["endpoint_url"])
    storage.append_line(paths.fs, metrics_path(paths), json.dumps(entry))


def _write_progress(config: dict, entry: dict) -> None:
    """Rewrite ``<run>/checkpoints/progress.json`` (rank 0; what the driver's progress bar reads)."""
    paths = storage.RunPaths.create(config["storage_uri"], config["run_name"], config["endpoint_url"])
    storage.write_json_atomic(paths.fs, progress_path(paths), entry)


def _train_step(config: dict, step: DraftStep, hooks: WorkerHooks, rank: int, pos: DataPosition, ids: list[str],
                batch: dict) -> dict:
    """One optimizer step of the loop (metric sums); a non-finite one is recorded for the retries
    (:class:`NonFiniteMarker`) before it is raised."""
    hooks.poison(pos.step + 1, batch)
    try:
        return step.step(batch, f"step {pos.step + 1} (epoch {pos.epoch}, samples {ids})")
    except NonFiniteLoss as e:
        NonFiniteMarker.write(config, rank, str(e))
        raise


def _report(config: dict, step: DraftStep, rank: int, pos: DataPosition, mine: set, report: dict) -> None:
    """Checkpoint + ``ray.train.report`` + metrics.jsonl + Ray metrics. ``mine``: the ids this rank consumed in
    this epoch since it started or resumed; ``pos.consumed``: those consumed before the resume (all ranks)."""
    import ray.train

    # rank 0 also keeps what the checkpoint it resumed from had consumed in this epoch (every rank holds it in
    # ``pos.consumed``); without it, a second resume in the same epoch trained those samples again
    with tempfile.TemporaryDirectory() as d:
        WorkerCheckpoint.save(d, step, rank, pos.step, pos.epoch, mine | pos.consumed if rank == 0 else mine)
        ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(d))
    if rank == 0:
        from . import metrics as ray_metrics

        _append_metrics(config, report)
        ray_metrics.train_report(config["run_name"], report, step.tc["ttt_steps"])
        log.info("checkpoint at step %d: %s", pos.step, json.dumps(
            {k: round(v, 4) if isinstance(v, float) else v for k, v in report.items()}))


def _check_epoch_trained(pos: DataPosition, epoch_start: int, fresh: bool, world: int) -> None:
    """An epoch that started with nothing consumed and ended without a step would repeat forever (every epoch
    splits the same rows).

    Raises:
        RuntimeError: naming the epoch and the worker count.
    """
    if pos.step == epoch_start and fresh:
        raise RuntimeError(f"epoch {pos.epoch}: no batch for some worker of {world} (Ray Train gives each worker "
                           "an equal share of the rows, none when there are fewer rows than workers); extract more "
                           "samples or lower train.num_workers")


def train_loop_per_worker(config: dict) -> None:
    """The Ray Train worker loop (see module docstring). ``config`` is built by :func:`eagle3ray.train.train`."""
    import ray.train

    _worker_logging()
    tc = config["train"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    check_code_fingerprint(config.get("code_fingerprint"), f"Ray Train worker {rank}")
    device = ray.train.torch.get_device()
    random.seed(tc["seed"] + rank)
    np.random.seed(tc["seed"] + rank)
    import torch

    torch.manual_seed(tc["seed"])  # same init on every rank
    step = DraftStep.build(tc, config["verifier_path"], config["aux_layer_ids"], config["d2t"], config["t2d"],
                           config["hidden_size"], config["autocast_bf16"])
    ckpt = WorkerCheckpoint.newer(ray.train.get_checkpoint(), WorkerCheckpoint.stored_for_all(config, rank, world),
                                  config.get("arrow_fs"))
    NonFiniteMarker.raise_if_set(config)  # a retry would reach the same non-finite step again
    resumed = WorkerCheckpoint.restore(ckpt, step)
    step.to_device(device, ray.train.torch.prepare_model if world > 1 else None)
    comm, hooks, pos = _Collective(world, device), config.get("hooks") or WorkerHooks(), resumed or DataPosition()
    hooks.start(rank)
    shards = _Shards(step, comm, int(tc.get("cache_shard_mib", 0)))

    def evaluate() -> dict:
        sums = step.evaluate(shards.epoch("val", 0, set()))
        return summarize(comm.all_sum(sums), tc["ttt_steps"], "val_")

    if resumed is None:
        if rank == 0:
            log.info("evaluating the untrained draft on the held-out blocks")
        untrained = evaluate()
        if rank == 0:
            _append_metrics(config, {"step": 0, "event": "untrained", **untrained})
    elif rank == 0:
        log.info("resumed from step %d (epoch %d, %d samples of this epoch already consumed)", pos.step, pos.epoch,
                 len(pos.consumed))
        _append_metrics(config, {"step": pos.step, "event": "resumed"})
    step.model.train()
    mine: set = set()  # sample ids this rank consumed in the current epoch (since the last restore)
    sums: dict = {}
    t_last, tokens_since, tail = time.time(), 0, 0
    while pos.step < tc["max_steps"]:
        epoch_start, fresh = pos.step, not pos.consumed
        batches = shards.epoch("train", tc["seed"] + pos.epoch, pos.consumed, tc["loss_positions"] == "all")
        for ids, batch in batches:
            if not comm.all_min(1):  # another rank's share of this epoch is used up: all end the epoch together
                tail += len(ids) + batches.drain()
                break
            hooks.before_step(pos.step, rank, world, resumed is not None)
            accumulate(sums, _train_step(config, step, hooks, rank, pos, ids, batch))
            pos.step += 1
            mine.update(ids)
            tokens_since += int((batch["document_ids"] >= 0).sum())
            hooks.after_step(pos.step, pos.epoch, ids)
            if rank == 0 and pos.step % 10 == 0:
                m = summarize(sums, tc["ttt_steps"], "")
                log.info(f"step {pos.step}/{tc['max_steps']} loss {m.get('loss', float('nan')):.3f} "
                         + " ".join(f"acc{k} {m.get(f'full_acc_{k}', 0):.3f}" for k in range(tc["ttt_steps"]))
                         + f" lr {step.lr:.2e}")
                _write_progress(config, {"step": pos.step, "max_steps": tc["max_steps"], "loss": m.get("loss"),
                                         "acc0": m.get("full_acc_0"), "time": time.time()})
            if pos.step % tc["checkpoint_every"] == 0 or pos.step >= tc["max_steps"]:
                dt, train_m = time.time() - t_last, summarize(comm.all_sum(sums), tc["ttt_steps"], "train_")
                counts = comm.all_sum({"t": float(tokens_since), "tail": float(tail), "cut": float(batches.truncated),
                                       "tcmalloc": float(tcmalloc_loaded())})  # one collective for the counts
                report = {"step": pos.step, "epoch": pos.epoch, **train_m, **evaluate(),
                          "tokens": counts["t"], "tokens_per_s": counts["t"] / max(dt, 1e-9), "lr": step.lr,
                          "epoch_tail_samples": counts["tail"], "truncated_samples": counts["cut"],
                          **{f"worker_{k}": round(v, 1) for k, v in step.seconds.items()},
                          "worker_tcmalloc": counts["tcmalloc"] / world}
                _report(config, step, rank, pos, mine, report)
                sums, tokens_since, t_last = {}, 0, time.time()
            if pos.step >= tc["max_steps"]:
                break
        else:
            comm.all_min(0)  # this rank ran out: tell the others the epoch is over
        if pos.step >= tc["max_steps"]:
            break
        _check_epoch_trained(pos, epoch_start, fresh, world)
        pos.epoch += 1
        pos.consumed, mine = set(), set()
    hooks.close()
