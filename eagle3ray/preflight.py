"""Preflight: what a run config will build and whether it fits, from configs only (no weights, seconds).

``eagle3ray check -c CONFIG`` answers, before anything loads:

1. **Draft shape.** The EAGLE-3 draft's decoder-layer config derived from the verifier's
   ``config.json`` (``text_config`` resolved for nested/multimodal configs): hidden size, heads, KV heads,
   ``head_dim`` (``train.draft_head_dim`` > the verifier's explicit ``head_dim`` > hidden/heads), vocab and
   draft vocab sizes, aux layer ids within depth, and the tensor shapes vLLM will allocate
   (:func:`eagle3ray.draft.expected_shapes`). Verifiers whose architecture speculators/vLLM have no EAGLE-3
   layer for (e.g. DeepSeek-V3/Kimi-K2 MLA+MoE) get a Llama decoder layer, as the published Kimi-K2 drafts do.
2. **vLLM acceptance.** vLLM's own speculators-config hook (``update_eagle3``) is run on the draft config;
   model types it rejects, heads that tensor parallelism cannot split, and aux ids outside the verifier
   are problems.
3. **Verifier memory per GPU** (:class:`MemoryPlan`): weights / TP + KV cache for the tokens in flight +
   prefill activations with hidden-state capture + a fixed runtime overhead, against
   ``verifier.gpu_memory_gib * verifier.gpu_memory_utilization``. On failure it names the largest
   ``extract.max_tokens_per_batch`` that fits.
4. **Hidden-state storage**: tokens x raw bytes per token of ``extract.storage_dtype``
   (:func:`eagle3ray.blocks.bytes_per_token`: (aux layers + 1) x hidden x bytes per value, + a float32 scale
   per layer for float8_e4m3) against ``extract.max_storage_gib``, and an estimate of what the blocks will
   hold after ``extract.compression`` (raw x :data:`STORED_RATIO`, measured). Tokens come from the run's
   conversations manifest when prepare has run, else ``data.max_samples x data.tokens_per_sample_estimate``.
5. **Ray resources** the plan needs (verifier replicas as STRICT_PACK groups of TP GPUs, training
   workers) against what the cluster offers, when connected.

The memory model is an estimate (documented per term in :func:`memory_plan`); it exists to catch the
order-of-magnitude mistakes (a 503k-token prefill, a model that needs twice the node) before they cost
GPU-hours, not to replace vLLM's own profiling.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from .blocks import VALUE_BYTES, bytes_per_token
from .machine import cpu_bf16_is_fast
from .draft import (DRAFT_LAYER_TYPES, draft_config_dict, expected_shapes, read_config_json, resolve_head_dim,
                    resolve_layer_ids, text_config)

GIB = 1024**3
#: CUDA context, NCCL buffers, CUDA-graph pool, allocator slack per GPU (GiB). Measured values on H100s with
#: vLLM are 1.5-3 GiB; 3 is the conservative end.
RUNTIME_OVERHEAD_GIB = 3.0
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # compute dtypes (weights, KV cache, activations)
#: Block file bytes over the raw states (:func:`eagle3ray.blocks.bytes_per_token`) per (extract.storage_dtype,
#: extract.compression), input ids, loss mask and Parquet overhead included: measured by
#: ``benchmarks/block_codec.py`` on 8,989 tokens of SmolLM2-135M states (ShareGPT, 4 layers x 576; docs/results.md).
#: Another model's states may compress otherwise, so ``check`` labels the product an estimate and holds
#: ``extract.max_storage_gib`` against the raw size.
STORED_RATIO = {
    ("bfloat16", "zstd"): 0.797, ("float16", "zstd"): 0.784, ("float32", "zstd"): 0.508,
    ("float8_e4m3", "zstd"): 0.772,
    ("bfloat16", "snappy"): 1.001, ("float16", "snappy"): 1.001, ("float32", "snappy"): 0.740,
    ("float8_e4m3", "snappy"): 1.001,
    ("bfloat16", "none"): 1.001, ("float16", "none"): 1.001, ("float32", "none"): 1.000,
    ("float8_e4m3", "none"): 1.001,
}
STORED_RATIO_SOURCE = "benchmarks/block_codec.py on SmolLM2-135M states (docs/results.md)"


class PreflightError(ValueError):
    """The config cannot be checked (missing verifier config); the message names the file and field."""


@dataclass
class PreflightReport:
    """Everything preflight found. ``ok`` when ``problems`` is empty; each problem names the config field."""

    config: str = ""
    verifier: dict = field(default_factory=dict)
    draft: dict = field(default_factory=dict)
    shapes: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    storage: dict = field(default_factory=dict)
    resources: dict = field(default_factory=dict)
    stream: dict = field(default_factory=dict)  # online/hybrid: the two pools' rates (plan.stream_balance)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d


# ----------------------------------------------------------------------------------------------- configs
def verifier_config_path(cfg) -> str:
    """Where preflight reads the verifier's ``config.json``: ``verifier.config_path``, else ``<model>/config.json``
    for folders and URIs, else the packaged verifier's cache (built on first use)."""
    v = cfg.verifier
    if v.config_path:
        return v.config_path
    from .verifier_source import PACKAGED, resolve_verifier

    if v.model in PACKAGED:
        return resolve_verifier(v.model, v.cache_dir) + "/config.json"
    return v.model.rstrip("/") + "/config.json"


def read_verifier_json(path: str) -> dict:
    """``config.json`` as a dict through fsspec (local or object storage).

    Raises:
        PreflightError: not found or not JSON; names the path and ``verifier.config_path``.
    """
    try:
        return read_config_json(path)
    except FileNotFoundError:
        raise PreflightError(f"verifier config {path}: not found. For a hub id, set verifier.config_path to a "
                             "copy of its config.json (configs/verifiers/ has the shipped ones)") from None
    except json.JSONDecodeError as e:
        raise PreflightError(f"verifier config {path}: not JSON ({e})") from None


# ----------------------------------------------------------------------------------------------- weights
def _linear_quant_bytes(q: dict | None) -> tuple[float | None, str]:
    """Bytes per parameter of quantized linear weights, from a HF ``quantization_config``."""
    if not q:
        return None, ""
    method = q.get("quant_method", "")
    if method == "fp8" or q.get("fmt") == "e4m3":
        return 1.0, "fp8"
    if method == "compressed-tensors":
        for group in (q.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            bits, gs = w.get("num_bits"), w.get("group_size")
            if bits:
                scale = 2 / gs if gs else 0.0  # one bf16 scale per group
                return bits / 8 + scale, f"compressed-tensors int{bits}" + (f" g{gs}" if gs else "")
    if method in ("awq", "gptq"):
        bits, gs = q.get("bits", 4), q.get("group_size", 128)
        return bits / 8 + 2 / gs, f"{method} int{bits}"
    return None, f"unknown quant_method {method!r}: counted at the compute dtype"


def weight_bytes(t: dict, dtype: str) -> dict:
    """Estimated verifier weight bytes from its text config (dense, GQA, MLA, MoE; tied embeddings).

    Quantized checkpoints (``quantization_config``: fp8, compressed-tensors intN, AWQ/GPTQ) count their
    linear weights at the quantized width; a MoE's quantization is applied to the routed experts only
    when the config's ``ignore`` list excludes attention (as Kimi-K2's does), else to all linears.

    Returns:
        {"bytes", "params", "expert_params", "quantization"}.
    """
    H, L, V = t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]
    nh = t["num_attention_heads"]
    nkv = t.get("num_key_value_heads") or nh
    hd = t.get("head_dim") or H // nh
    if t.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3, Kimi-K2)
        qk = t["qk_nope_head_dim"] + t["qk_rope_head_dim"]
        ql = t.get("q_lora_rank")
        q = H * ql + ql * nh * qk if ql else H * nh * qk
        attn = (q + H * (t["kv_lora_rank"] + t["qk_rope_head_dim"])
                + t["kv_lora_rank"] * nh * (t["qk_nope_head_dim"] + t["v_head_dim"]) + nh * t["v_head_dim"] * H)
    else:
        attn = 2 * H * nh * hd + 2 * H * nkv * hd
    n_exp = t.get("n_routed_experts") or t.get("num_experts") or t.get("num_local_experts") or 0
    if n_exp:
        moe_i = t.get("moe_intermediate_size") or t["intermediate_size"]
        dense_layers = t.get("first_k_dense_replace", 0) or 0
        moe_layers = L - dense_layers
        experts = moe_layers * n_exp * 3 * H * moe_i
        mlp_other = (dense_layers * 3 * H * t["intermediate_size"]
                     + moe_layers * ((t.get("n_shared_experts") or 0) * 3 * H * moe_i + H * n_exp))
    else:
        experts, mlp_other = 0, L * 3 * H * t["intermediate_size"]
    linear_other = L * attn + mlp_other
    embed = V * H * (1 if t.get("tie_word_embeddings") else 2)
    norms = L * 2 * H + H
    cb = _BYTES.get(dtype, 2)
    qb, qname = _linear_quant_bytes(t.get("quantization_config"))
    if qb is None:
        total = (experts + linear_other + embed + norms) * cb
    else:
        ignore = " ".join((t.get("quantization_config") or {}).get("ignore") or [])
        experts_only = bool(n_exp) and ("attn" in ignore or "self_attn" in ignore)
        total = experts * qb + linear_other * (cb if experts_only else qb) + (embed + norms) * cb
    return {"bytes": total, "params": experts + linear_other + embed + norms, "expert_params": experts,
            "quantization": qname or "none"}


# ----------------------------------------------------------------------------------------------- memory
@dataclass
class MemoryPlan:
    """Per-GPU memory of one verifier replica during extraction (GiB), and the largest token budget that fits."""

    weights_gib: float
    kv_cache_gib: float
    activations_gib: float
    overhead_gib: float
    total_gib: float
    budget_gib: float | None
    max_tokens_per_batch: int
    max_fitting_tokens_per_batch: int | None
    kv_bytes_per_token: float
    activation_bytes_per_token: float
    terms: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.budget_gib is None or self.total_gib <= self.budget_gib


def memory_plan(t: dict, *, tp: int, dtype: str, max_tokens_per_batch: int, max_model_len: int,
                num_captured_layers: int, max_num_seqs: int, gpu_memory_gib: float | None,
                gpu_memory_utilization: float) -> MemoryPlan:
    """Estimate a verifier replica's memory per GPU for extraction.

    Terms (bytes; b = compute dtype bytes, N = ``max_tokens_per_batch``, M = ``max_model_len``):

    - weights: :func:`weight_bytes` / TP (vLLM shards every linear and the vocab across TP ranks);
    - KV cache: every token of a prefill batch holds KV blocks while the batch runs, so vLLM needs
      max(N, M) tokens of cache: per token L x 2 x ceil(n_kv / TP) x head_dim x b for attention
      (KV heads are replicated when TP > n_kv), or L x (kv_lora_rank + qk_rope_head_dim) x b for MLA,
      whose latent cache every rank holds whole;
    - activations, per prefill token: residual and hidden (2H), q/k/v ((n_heads + 2 n_kv) x head_dim / TP),
      MLP (3 x I / TP; for MoE top-k x MoE width + shared experts), all x b; plus the captured hidden
      states (A + 1 layers x H, unsharded) held twice (engine buffer + the connector's copy);
    - logits for the last position of each sequence: ``max_num_seqs`` x V x 4 / TP;
    - overhead: :data:`RUNTIME_OVERHEAD_GIB`.

    The budget is ``gpu_memory_gib x gpu_memory_utilization`` (vLLM's share of the GPU).
    """
    b = _BYTES.get(dtype, 2)
    H, L, V = t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]
    nh = t["num_attention_heads"]
    nkv = t.get("num_key_value_heads") or nh
    hd = t.get("head_dim") or H // nh
    W = weight_bytes(t, dtype)["bytes"] / tp
    if t.get("kv_lora_rank"):
        kv_tok = L * (t["kv_lora_rank"] + t["qk_rope_head_dim"]) * b
        qkv = nh * (t["qk_nope_head_dim"] + t["qk_rope_head_dim"]) * 2 + nh * t["v_head_dim"]
    else:
        kv_tok = L * 2 * math.ceil(nkv / tp) * hd * b
        qkv = (nh + 2 * nkv) * hd
    n_exp = t.get("n_routed_experts") or t.get("num_experts") or t.get("num_local_experts") or 0
    if n_exp:
        moe_i = t.get("moe_intermediate_size") or t["intermediate_size"]
        k = t.get("num_experts_per_tok") or 8
        mlp = max(3 * t["intermediate_size"], 3 * moe_i * (k + (t.get("n_shared_experts") or 0)))
    else:
        mlp = 3 * t["intermediate_size"]
    captured = num_captured_layers * H * b * 2
    act_tok = (2 * H + qkv / tp + mlp / tp) * b + captured
    logits = max_num_seqs * V * 4 / tp
    O = RUNTIME_OVERHEAD_GIB * GIB
    N, M = max_tokens_per_batch, max_model_len
    kv = kv_tok * max(N, M)
    act = act_tok * N + logits
    total = W + kv + act + O
    budget = gpu_memory_gib * gpu_memory_utilization * GIB if gpu_memory_gib else None
    best = None
    if budget is not None:
        free = budget - W - O - logits
        n = free / (kv_tok + act_tok)  # N >= M: both terms grow with N
        if n < M:  # below M the KV term is fixed at M tokens
            n = (free - kv_tok * M) / act_tok
        best = max(0, int(n) // 256 * 256)
    return MemoryPlan(weights_gib=W / GIB, kv_cache_gib=kv / GIB, activations_gib=act / GIB, overhead_gib=O / GIB,
                      total_gib=total / GIB, budget_gib=budget / GIB if budget else None, max_tokens_per_batch=N,
                      max_fitting_tokens_per_batch=best, kv_bytes_per_token=kv_tok, activation_bytes_per_token=act_tok,
                      terms={"captured_bytes_per_token": captured, "logits_bytes": logits, "kv_tokens": max(N, M)})


# ----------------------------------------------------------------------------------------------- checks
def _check_parallelism(t: dict, tp: int, rep: PreflightReport) -> None:
    nh = t["num_attention_heads"]
    nkv = t.get("num_key_value_heads") or nh
    if nh % tp:
        rep.problems.append(f"verifier.tensor_parallel_size {tp} does not divide the verifier's {nh} attention heads "
                            f"(vLLM shards heads across TP ranks); use one of {[d for d in range(1, nh + 1) if nh % d == 0 and d <= 64]}")
    elif not t.get("kv_lora_rank") and (nkv % tp if nkv >= tp else tp % nkv):
        rep.problems.append(f"verifier.tensor_parallel_size {tp} and the verifier's {nkv} KV heads: vLLM needs "
                            "one to divide the other (KV heads are split or replicated across TP ranks)")


def _vllm_accepts(draft_cfg: dict, rep: PreflightReport) -> None:
    """Run vLLM's own speculators-config hook for eagle3 on the draft config (no model is loaded)."""
    try:
        from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES
    except Exception as e:  # pragma: no cover - vLLM missing/broken
        rep.notes.append(f"vLLM's speculators config hook not importable ({type(e).__name__}); skipped")
        return
    layer = dict(draft_cfg["transformer_layer_config"])
    try:
        SUPPORTED_SPECULATORS_TYPES["eagle3"](draft_cfg, layer)
        rep.draft["vllm_architecture"] = layer["architectures"][0]
    except ValueError as e:
        rep.problems.append(f"draft transformer_layer_config.model_type: vLLM rejects it: {e}")


def _manifest_tokens(cfg, rep: PreflightReport) -> tuple[int | None, str]:
    """Token count of the run's conversations manifest, when prepare has completed (reads one JSON file)."""
    from . import storage

    try:
        paths = storage.run_paths(cfg)
        man = storage.read_json(paths.fs, f"{paths.conversations}/manifest.json")
    except Exception as e:  # unreachable storage must not stop a preflight
        rep.notes.append(f"run storage {cfg.run.storage} not readable ({type(e).__name__}); token count estimated")
        return None, ""
    if man and man.get("complete"):
        return man["counts"]["tokens"], f"{paths.uri}/conversations/manifest.json"
    return None, ""


def _storage_estimate(cfg, vtext: dict, n_layers: int, rep: PreflightReport, online: bool) -> None:
    tokens, source = None, ""
    if not (online or cfg.run.storage.startswith("file://")):
        rep.notes.append(f"run storage {cfg.run.storage} not read offline (pass --cluster to read it); "
                         "token count estimated")
    else:
        tokens, source = _manifest_tokens(cfg, rep)
    if tokens is None:
        if not cfg.data.max_samples:
            rep.notes.append("data.max_samples is null: hidden-state storage not estimated")
            return
        if cfg.data.max_samples == "plan":  # `eagle3ray check` plans first; a direct call may not have
            rep.notes.append("data.max_samples is planned by run.time_budget and not planned yet "
                             "(`eagle3ray plan`): hidden-state storage not estimated")
            return
        tokens = cfg.data.max_samples * cfg.data.tokens_per_sample_estimate
        source = f"data.max_samples {cfg.data.max_samples} x data.tokens_per_sample_estimate " \
                 f"{cfg.data.tokens_per_sample_estimate}"
    dtype, H = cfg.extract.storage_dtype, vtext["hidden_size"]
    per_token = bytes_per_token(n_layers, H, dtype)
    raw = f"{n_layers} layers x {H} x {VALUE_BYTES[dtype]} B" + (
        f" + {n_layers} x 4 B scales" if dtype == "float8_e4m3" else "")
    gib = tokens * per_token / GIB
    ratio = STORED_RATIO[(dtype, cfg.extract.compression)]
    rep.storage = {"tokens": tokens, "tokens_from": source, "storage_dtype": dtype, "bytes_per_token": per_token,
                   "bytes_per_token_from": raw, "gib": gib, "limit_gib": cfg.extract.max_storage_gib,
                   "compression": cfg.extract.compression, "est_ratio": ratio, "est_ratio_from": STORED_RATIO_SOURCE,
                   "est_bytes_per_token": per_token * ratio, "est_gib": gib * ratio}
    if cfg.extract.max_storage_gib is not None and gib > cfg.extract.max_storage_gib \
            and cfg.train.data_source != "online":
        fit = int(cfg.extract.max_storage_gib * GIB / per_token)
        rep.problems.append(f"extract.max_storage_gib {cfg.extract.max_storage_gib}: hidden states need {gib:,.1f} GiB "
                            f"({tokens:,} tokens x {raw}, before compression); the limit holds {fit:,} tokens")


def _stream_balance(cfg, rep: PreflightReport, read_run: bool) -> None:
    """Online or hybrid: which pool, verifier or training, will set the pace (:func:`eagle3ray.plan.stream_balance`),
    from ``run.plan_rates`` or the run's ``plan.json`` (the probe's rates; read only when ``read_run``: local
    storage, or ``--cluster``); a note when neither is there."""
    from .plan import Rates, read_plan, stated_rates, stream_balance

    try:
        rates, source = stated_rates(cfg), "run.plan_rates"
        if rates is None and read_run:
            plan = read_plan(cfg)
            rates, source = (Rates.from_dict(plan["rates"]), "the run's plan.json") if plan else (None, "")
    except Exception as e:  # noqa: BLE001 - a preflight reports, it does not stop on a bad rate
        rep.notes.append(f"stream balance not estimated: {e}")
        return
    if rates is None:
        rep.notes.append(f"train.data_source {cfg.train.data_source}: set run.plan_rates (or run `eagle3ray plan`) "
                         "to see which pool, verifier or training, will be the bottleneck")
        return
    b = stream_balance(cfg, rates)
    rep.stream = {**b, "rates_from": source}
    if b["bottleneck"] == "verifier":
        rep.notes.append(f"the verifier pool will be the bottleneck: the train workers would wait "
                         f"{1 - b['ratio']:.0%} of the time; extract.max_replicas {b['replicas_to_keep_up']} would "
                         "keep them fed")


def required_resources(cfg) -> dict:
    """Ray resources the plan needs: verifier replica bundles, extraction pool bounds, training workers."""
    v, e, tr = cfg.verifier, cfg.extract, cfg.train
    replica = {"CPU": v.num_cpus, "GPU": v.num_gpus}
    worker = {"CPU": tr.cpus_per_worker, "GPU": 1 if tr.use_gpu else 0}
    return {
        "verifier_replica": replica, "replica_bundles": [{"GPU": 1}] * v.num_gpus if v.num_gpus else [],
        "placement_strategy": "STRICT_PACK" if v.num_gpus else None,
        "min_replicas": e.min_replicas, "max_replicas": e.max_replicas,
        "train_worker": worker, "train_workers": tr.num_workers,
        "gpus_extract_min": v.num_gpus * e.min_replicas, "gpus_extract_max": v.num_gpus * e.max_replicas,
        "gpus_train": worker["GPU"] * tr.num_workers,
    }


#: CPUs Ray Data's tasks need beside the actors: its read tasks ask for 1 CPU each, and with none left the train
#: dataset never starts (benchmarks/train.py's 2-worker variant hung so with 2 x 2 CPUs on a 4-CPU local cluster).
RAY_DATA_CPUS = 1.0


def check_cluster(req: dict, nodes: list[dict], more_cpus: str = "ray start --num-cpus={n}") -> list[str]:
    """Problems placing ``req`` on ``nodes`` (``ray.nodes()``-style dicts with ``Resources`` and ``Alive``).

    A replica's TP GPUs must sit on one node (STRICT_PACK); ``min_replicas`` of them must fit at once;
    training's GPUs must exist in the cluster. Training starts while the verifier service still holds its
    replicas (it stays up for later jobs), so the train workers' CPUs must fit beside the replicas' CPUs, and
    each worker's bundle on one node; otherwise Ray Train's placement group stays pending and the worker group
    start times out and retries for ever; :data:`RAY_DATA_CPUS` more are needed for Ray Data's read tasks.
    ``more_cpus`` is the advice for more CPUs, with ``{n}`` the total needed.
    """
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    tp = len(req["replica_bundles"])
    out = []
    if tp:
        slots = sum(int(r.get("GPU", 0)) // tp for r in alive)
        if slots < req["min_replicas"]:
            biggest = max((int(r.get("GPU", 0)) for r in alive), default=0)
            out.append(f"extract.min_replicas {req['min_replicas']}: each verifier replica needs {tp} GPUs on one node "
                       f"(STRICT_PACK); the cluster has room for {slots} (largest node: {biggest} GPUs)")
    total_gpu = sum(r.get("GPU", 0) for r in alive)
    if req["gpus_train"] > total_gpu:
        out.append(f"train.num_workers {req['train_workers']} with use_gpu needs {req['gpus_train']} GPUs; the "
                   f"cluster has {total_gpu:g}")
    total_cpu = sum(r.get("CPU", 0) for r in alive)
    need_cpu = req["verifier_replica"]["CPU"] * req["min_replicas"]
    if need_cpu > total_cpu:
        out.append(f"verifier.num_cpus x extract.min_replicas = {need_cpu:g} CPUs; the cluster has {total_cpu:g}")
        return out
    w_cpu = req["train_worker"]["CPU"]
    train_cpu = w_cpu * req["train_workers"]
    if need_cpu + train_cpu + RAY_DATA_CPUS > total_cpu:
        n = math.ceil(need_cpu + train_cpu + RAY_DATA_CPUS)
        out.append(f"train.num_workers {req['train_workers']} x train.cpus_per_worker {w_cpu:g} = {train_cpu:g} CPUs "
                   f"beside the verifier service's {need_cpu:g} (verifier.num_cpus x extract.min_replicas, kept up "
                   f"during training) and {RAY_DATA_CPUS:g} for Ray Data's reads need {n}; the cluster has "
                   f"{total_cpu:g}: give Ray more logical CPUs ({more_cpus.format(n=n)}) or lower "
                   "train.cpus_per_worker")
    elif alive and w_cpu > max(r.get("CPU", 0) for r in alive):
        out.append(f"train.cpus_per_worker {w_cpu:g}: no node has that many CPUs (largest: "
                   f"{max(r.get('CPU', 0) for r in alive):g})")
    return out


def preflight(cfg, config_name: str = "", nodes: list[dict] | None = None) -> PreflightReport:
    """Check a run config before anything loads (see module docstring).

    Args:
        nodes: ``ray.nodes()`` of the cluster to check resources against; None skips that check.

    Raises:
        PreflightError: the verifier's config.json cannot be read.
    """
    rep = PreflightReport(config=config_name)
    vpath = verifier_config_path(cfg)
    raw = read_verifier_json(vpath)
    t = text_config(raw)
    v = cfg.verifier
    L = t["num_hidden_layers"]
    rep.verifier = {"config": vpath, "model_type": t.get("model_type"), "num_hidden_layers": L,
                    "hidden_size": t["hidden_size"], "num_attention_heads": t["num_attention_heads"],
                    "num_key_value_heads": t.get("num_key_value_heads"), "vocab_size": t["vocab_size"],
                    "nested_text_config": t is not raw}
    try:
        layer_ids = resolve_layer_ids(v.aux_layer_ids, L)
    except ValueError as e:
        rep.problems.append(str(e))
        layer_ids = [i for i in (v.aux_layer_ids or []) if 0 <= i < L] + [L]
    hd, hd_src = resolve_head_dim(t, cfg.train.draft_head_dim)
    dcfg = draft_config_dict(cfg, t, layer_ids)
    layer = dcfg["transformer_layer_config"]
    rep.draft = {"model_type": layer["model_type"], "num_layers": cfg.train.num_draft_layers,
                 "hidden_size": layer["hidden_size"], "num_attention_heads": layer["num_attention_heads"],
                 "num_key_value_heads": layer.get("num_key_value_heads"), "head_dim": hd, "head_dim_from": hd_src,
                 "intermediate_size": layer["intermediate_size"], "vocab_size": t["vocab_size"],
                 "draft_vocab_size": cfg.vocab.draft_vocab_size, "layer_ids": layer_ids,
                 "aux_layer_ids": layer_ids[:-1]}
    if t.get("model_type") not in DRAFT_LAYER_TYPES:
        rep.notes.append(f"verifier model_type {t.get('model_type')!r} has no EAGLE-3 layer in speculators/vLLM: "
                         "the draft uses a Llama decoder layer with the verifier's dimensions")
    if hd * layer["num_attention_heads"] != layer["hidden_size"]:
        rep.notes.append(f"draft head_dim {hd} x {layer['num_attention_heads']} heads = "
                         f"{hd * layer['num_attention_heads']} != hidden_size {layer['hidden_size']}: explicit "
                         "head_dim (vLLM and speculators honour it)")
    if cfg.vocab.draft_vocab_size > t["vocab_size"]:
        rep.problems.append(f"vocab.draft_vocab_size {cfg.vocab.draft_vocab_size} > the verifier's vocab_size "
                            f"{t['vocab_size']}")
    rep.shapes = expected_shapes(dcfg, len(layer_ids) - 1, t["hidden_size"])
    _vllm_accepts(dcfg, rep)
    _check_parallelism(t, v.tensor_parallel_size, rep)
    # draft in vLLM runs at the verifier's TP too
    if layer["num_attention_heads"] % v.tensor_parallel_size:
        rep.problems.append(f"draft heads {layer['num_attention_heads']} not divisible by verifier."
                            f"tensor_parallel_size {v.tensor_parallel_size} (vLLM runs the draft at the verifier's TP)")
    # memory
    wb = weight_bytes(t, v.dtype)
    mem = memory_plan(t, tp=v.tensor_parallel_size, dtype=v.dtype,
                      max_tokens_per_batch=cfg.extract.max_tokens_per_batch, max_model_len=v.max_model_len,
                      num_captured_layers=len(layer_ids), max_num_seqs=v.max_num_seqs,
                      gpu_memory_gib=v.gpu_memory_gib if v.device == "cuda" else None,
                      gpu_memory_utilization=v.gpu_memory_utilization)
    rep.memory = {**asdict(mem), "weights_total_gib": wb["bytes"] / GIB, "params_billion": wb["params"] / 1e9,
                  "quantization": wb["quantization"], "device": v.device}
    if v.device == "cuda" and v.gpu_memory_gib is None:
        rep.notes.append("verifier.gpu_memory_gib not set: memory plan printed but not checked")
    elif v.device == "cpu":
        rep.notes.append(f"device cpu: host memory for weights + activations ~ "
                         f"{mem.weights_gib + mem.activations_gib:.2f} GiB, KV cache verifier.cpu_kv_cache_gib "
                         f"{v.cpu_kv_cache_gib} GiB (no GPU budget to check)")
    if not mem.fits:
        best = mem.max_fitting_tokens_per_batch
        if best and best >= 256:
            hint = f"the largest extract.max_tokens_per_batch that fits is {best:,}"
        else:
            need = math.ceil(wb["bytes"] / (mem.budget_gib * GIB - mem.overhead_gib * GIB) + 1e-9) \
                if mem.budget_gib > mem.overhead_gib else None
            hint = (f"even the weights ({mem.weights_gib:.1f} GiB per GPU) leave no room for a batch: "
                    f"raise verifier.tensor_parallel_size (weights alone need TP >= {need}) or use larger GPUs")
        rep.problems.append(
            f"extract.max_tokens_per_batch {cfg.extract.max_tokens_per_batch:,}: verifier needs ~{mem.total_gib:.1f} "
            f"GiB per GPU (weights {mem.weights_gib:.1f} + KV {mem.kv_cache_gib:.1f} + activations "
            f"{mem.activations_gib:.1f} + overhead {mem.overhead_gib:.1f}) > budget {mem.budget_gib:.1f} GiB "
            f"(verifier.gpu_memory_gib {v.gpu_memory_gib} x gpu_memory_utilization {v.gpu_memory_utilization}); {hint}")
    if v.device == "cpu" and v.dtype == "float32" and not cpu_bf16_is_fast():
        rep.notes.append("this CPU has neither AMX-BF16 nor AVX512-BF16, so the verifier computes in float32, "
                         "several times slower than bf16 on a CPU with them (benchmarks/dtype.py; figures in docs/results.md): the CPU config's "
                         "fixed sizes take that much longer here")
    if v.max_model_len > cfg.train.max_tokens_per_batch:
        rep.notes.append(f"train.max_tokens_per_batch {cfg.train.max_tokens_per_batch:,} < verifier.max_model_len "
                         f"{v.max_model_len:,}: a longer sample fills a training step alone and is trained on its "
                         f"first {cfg.train.max_tokens_per_batch:,} tokens (counted as truncated_samples in the "
                         "training reports)")
    if cfg.data.regenerate and cfg.data.regenerate_engine == "dedicated" and v.device == "cuda":
        rep.notes.append("data.regenerate_engine dedicated on GPUs: prepare loads a second copy of the verifier "
                         f"on {v.num_gpus} GPU(s) and needs them free of a running verifier service ('service' "
                         "decodes on the service's engine instead)")
    if cfg.train.data_source == "online":
        rep.notes.append("train.data_source online: no hidden states are stored (the storage line is what an "
                         "offline or hybrid run would store; extract.max_storage_gib is not held against it)")
    _storage_estimate(cfg, t, len(layer_ids), rep, online=nodes is not None)
    if cfg.train.data_source != "offline":
        _stream_balance(cfg, rep, read_run=nodes is not None or cfg.run.storage.startswith("file://"))
    req = required_resources(cfg)
    rep.resources = {"required": req}
    if nodes is not None:
        rep.resources["cluster"] = {
            "nodes": sum(1 for n in nodes if n.get("Alive", True)),
            "GPU": sum(n.get("Resources", {}).get("GPU", 0) for n in nodes if n.get("Alive", True)),
            "CPU": sum(n.get("Resources", {}).get("CPU", 0) for n in nodes if n.get("Alive", True)),
        }
        rep.problems += check_cluster(req, nodes)
    elif cfg.ray.address is None and cfg.ray.num_cpus is not None:  # the local cluster a command starts
        local = [{"Alive": True, "Resources": {"CPU": cfg.ray.num_cpus, "GPU": 0}}]
        rep.problems += [p for p in check_cluster(req, local, "ray.num_cpus={n}") if "CPU" in p]
    return rep


def render(rep: PreflightReport) -> str:
    """Human-readable preflight report (the CLI prints it)."""
    d, m = rep.draft, rep.memory
    lines = [f"eagle3ray check {rep.config}: " + ("OK" if rep.ok else f"{len(rep.problems)} problem(s)")]
    v = rep.verifier
    lines.append(f"  verifier   {v['model_type']}: {v['num_hidden_layers']} layers, hidden {v['hidden_size']}, "
                 f"{v['num_attention_heads']} heads / {v['num_key_value_heads']} KV, vocab {v['vocab_size']}"
                 + (" (text_config of a nested config)" if v.get("nested_text_config") else "") + f"  [{v['config']}]")
    lines.append(f"  draft      {d['model_type']} x{d['num_layers']}: hidden {d['hidden_size']}, heads "
                 f"{d['num_attention_heads']} / {d['num_key_value_heads']} KV, head_dim {d['head_dim']} "
                 f"({d['head_dim_from']}), MLP {d['intermediate_size']}, vocab {d['vocab_size']} -> draft vocab "
                 f"{d['draft_vocab_size']}, layer ids {d['layer_ids']}"
                 + (f", vLLM class {d['vllm_architecture']}" if d.get("vllm_architecture") else ""))
    for k in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.fc.weight", "lm_head.weight"):
        if k in rep.shapes:
            lines.append(f"  shape      {k} {rep.shapes[k]}")
    budget = f"{m['budget_gib']:.1f} GiB" if m.get("budget_gib") else "not declared"
    lines.append(f"  memory     per GPU: weights {m['weights_gib']:.1f} (of {m['weights_total_gib']:.1f} GiB, "
                 f"{m['params_billion']:.1f}B params, quant {m['quantization']}) + KV {m['kv_cache_gib']:.2f} + "
                 f"activations {m['activations_gib']:.2f} + overhead {m['overhead_gib']:.1f} = {m['total_gib']:.1f} GiB; "
                 f"budget {budget}"
                 + (f"; largest fitting max_tokens_per_batch {m['max_fitting_tokens_per_batch']:,}"
                    if m.get("max_fitting_tokens_per_batch") is not None else ""))
    s = rep.storage
    if s:
        lim = f" (limit {s['limit_gib']} GiB)" if s.get("limit_gib") is not None else ""
        lines.append(f"  storage    hidden states {s['storage_dtype']} {s['gib']:,.1f} GiB raw{lim} for "
                     f"{s['tokens']:,} tokens ({s['bytes_per_token']:,} B/token = {s['bytes_per_token_from']}; tokens from "
                     f"{s['tokens_from']}); estimated on storage with {s['compression']}: ~{s['est_gib']:,.1f} GiB, "
                     f"~{s['est_bytes_per_token']:,.0f} B/token (raw x {s['est_ratio']}, measured by "
                     f"{s['est_ratio_from']})")
    r = rep.resources.get("required", {})
    if r:
        lines.append(f"  resources  verifier replica {r['verifier_replica']} x {r['min_replicas']}..{r['max_replicas']}"
                     + (f" ({len(r['replica_bundles'])} GPU bundles, {r['placement_strategy']})"
                        if r['replica_bundles'] else "")
                     + f"; training {r['train_workers']} x {r['train_worker']}")
    st = rep.stream
    if st:
        lines.append(f"  stream     verifier pool ~{st['produce_tok_s']:,.0f} tok/s (extract.max_replicas x prefill), "
                     f"train pool ~{st['consume_tok_s']:,.0f} tok/s: the {st['bottleneck']} pool sets the pace "
                     f"(rates from {st['rates_from']}; on one machine the pools share the cores and their times add)")
    if "cluster" in rep.resources:
        c = rep.resources["cluster"]
        lines.append(f"  cluster    {c['nodes']} node(s), {c['GPU']:g} GPUs, {c['CPU']:g} CPUs")
    lines += [f"  PROBLEM    {p}" for p in rep.problems]
    lines += [f"  note       {n}" for n in rep.notes]
    return "\n".join(lines)
