"""The verifier (target) model: one vLLM engine that extracts hidden states and generates answers.

:class:`VerifierEngine` is plain Python (no Ray): it loads vLLM once and serves

- ``extract(samples)``: prefill only (``max_tokens=1``) through vLLM's ``extract_hidden_states``
  speculative method and this project's :mod:`eagle3ray.connector`; returns, per sample, the
  states of the layer ids in ``spec.layer_ids`` as a [T, L, H] array;
- ``generate(prompts, ...)``: ordinary decoding on the same engine (self-distillation answers).

How it is hosted (a Ray Serve deployment, long-lived and shared between jobs) lives in
:mod:`eagle3ray.verifier_service`.

Layer-id convention (vLLM ``eagle_aux_hidden_state_layer_ids``, speculators): id ``i`` is the
*input* of decoder layer ``i``, i.e. transformers' ``hidden_states[i]`` for ``i < L``; id ``L``
(= num_hidden_layers) is the last layer's output *before* the final norm (transformers'
``hidden_states[L]`` is after it). EAGLE-3 trains on the three auxiliary ids plus ``L``, and
applies the verifier's norm and lm_head itself.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .blocks import STORAGE_DTYPES, to_storage_array
from .draft import normalized_text_config, resolve_layer_ids
from .serving_engine import cpu_engine_options, engine_threads, pin_threads

log = logging.getLogger(__name__)

class VerifierError(RuntimeError):
    """The verifier produced something that cannot be right (wrong tokens, NaN, wrong shape)."""


@dataclass
class VerifierSpec:
    """Everything that defines a loaded verifier engine; its hash names the shared service."""

    model_path: str
    layer_ids: list[int]
    device: str = "cpu"
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    max_model_len: int = 2048
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 64
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 2.0
    cpu_threads: int | None = None
    seed: int = 0
    tmp_dir: str = "/dev/shm"
    engine: str = "vllm"  # "stand_in": StandInEngine (no model; rehearsals and tests)
    stand_in_tokens_per_s: float | None = None
    trust_remote_code: bool = False
    revision: str | None = None  # hub commit of model_path (required with trust_remote_code by the config)
    model_identity: dict = field(default_factory=dict)  # config/tokenizer hashes, filled by from_config

    @classmethod
    def from_config(cls, cfg) -> "VerifierSpec":
        """Build from a :class:`eagle3ray.config.Config` (resolves the model folder, reads config.json)."""
        from .verifier_source import resolve_verifier

        v = cfg.verifier
        path = resolve_verifier(v.model, v.cache_dir)
        ident = {"name": v.model, **model_identity(path, v.cache_dir)}
        layer_ids = resolve_layer_ids(v.aux_layer_ids, ident["num_hidden_layers"])
        return cls(
            model_path=path, layer_ids=layer_ids, device=v.device, dtype=v.dtype,
            tensor_parallel_size=v.tensor_parallel_size, max_model_len=v.max_model_len,
            max_num_batched_tokens=cfg.extract.max_tokens_per_batch, max_num_seqs=v.max_num_seqs,
            enforce_eager=v.enforce_eager, gpu_memory_utilization=v.gpu_memory_utilization,
            cpu_kv_cache_gib=v.cpu_kv_cache_gib, cpu_threads=v.cpu_threads, seed=v.seed,
            tmp_dir=cfg.extract.tmp_dir, engine=v.engine,
            stand_in_tokens_per_s=v.stand_in_tokens_per_s, trust_remote_code=v.trust_remote_code,
            revision=v.revision, model_identity=ident,
        )

    def identity(self) -> dict:
        """What must match for a running engine to be reused (everything but scratch paths; ``revision`` only
        when set, so identities of unpinned verifiers stay what they were)."""
        d = asdict(self)
        d.pop("tmp_dir")
        if d["revision"] is None:
            d.pop("revision")
        return d

    def identity_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:12]


_IDENTITY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def _compute_identity(path: str) -> dict:
    hf = normalized_text_config(path)
    ident = {
        "config_hash": hashlib.sha256(json.dumps(hf, sort_keys=True, default=str).encode()).hexdigest()[:16],
        "num_hidden_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "vocab_size": hf["vocab_size"],
    }
    # a folder with config.json alone (the shipped verifier configs, for the stand-in engine) has no tokenizer
    if "://" not in path and any((Path(path) / f).exists() for f in _IDENTITY_FILES[1:]):
        from transformers import AutoTokenizer

        from .chat import tokenizer_identity

        ident.update(tokenizer_identity(AutoTokenizer.from_pretrained(path)))
    return ident


def model_identity(path: str, cache_dir: str | os.PathLike = "~/.cache/eagle3ray") -> dict:
    """The verifier's identity: hashes of its (text) config, tokenizer vocabulary and chat template, plus
    depth, hidden size and vocabulary size. Reads config.json and loads the tokenizer (seconds: it imports
    transformers); for a local folder the result is cached under ``<cache_dir>/identity/``, keyed by the
    path and the size and mtime of its config and tokenizer files, so later stages and jobs read it in
    milliseconds (the warm path of a job against a running verifier service)."""
    folder = Path(path)
    if "://" in path or not folder.is_dir():
        return _compute_identity(path)
    stats = [(n, st.st_size, st.st_mtime_ns) for n in _IDENTITY_FILES
             if (f := folder / n).is_file() and (st := f.stat())]
    key = hashlib.sha256(json.dumps([str(folder.resolve()), stats]).encode()).hexdigest()[:24]
    cache = Path(cache_dir).expanduser() / "identity" / f"{key}.json"
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    ident = _compute_identity(path)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(ident))
        os.replace(tmp, cache)
    except OSError as e:  # a read-only home only costs the speed-up
        log.debug("identity cache not written: %s", e)
    return ident


class _EngineCounters:
    """Load time, uptime and request/token counters shared by the engines (``info`` reports them)."""

    loads_in_process = 0  # engines of this class loaded by this process (a reused service stays at 1)

    def _start_counters(self, load_seconds: float) -> None:
        type(self).loads_in_process += 1
        self.load_seconds = load_seconds
        self.loaded_at = time.time()
        self.stats = {"extract_calls": 0, "generate_calls": 0, "samples": 0, "tokens": 0, "batch_tokens": [],
                      "extract_seconds": 0.0}

    def _count_extract(self, samples: list[dict], seconds: float) -> None:
        """Count one extract call: its samples, tokens and ``seconds`` (wall time inside the engine's ``extract``:
        the engine call, reading and checking the states; ``benchmarks/extract.py`` compares it with the
        pipeline's wall time)."""
        ntok = sum(len(s["input_ids"]) for s in samples)
        self.stats["extract_calls"] += 1
        self.stats["extract_seconds"] += seconds
        self.stats["samples"] += len(samples)
        self.stats["tokens"] += ntok
        self.stats["batch_tokens"].append(ntok)
        del self.stats["batch_tokens"][:-1000]

    def _count_generate(self, prompts: list[list[int]]) -> None:
        self.stats["generate_calls"] += 1
        self.stats["tokens"] += sum(len(p) for p in prompts)

    def info(self) -> dict:
        """Identity, load time (s), uptime (s), requests served, tokens processed, per-call batch tokens, seconds
        spent in extract calls."""
        return {
            "identity_hash": self.spec.identity_hash(), "identity": self.spec.identity(), "pid": os.getpid(),
            "load_seconds": self.load_seconds, "uptime_seconds": time.time() - self.loaded_at,
            "loads_in_process": type(self).loads_in_process, **self.stats,
        }


SCRATCH_PREFIX = "eagle3ray-hs-"


class HiddenStateScratch:
    """A verifier engine's private directory for the hidden-state connector's per-request files (in
    ``verifier.tmp_dir``, ``/dev/shm`` by default: RAM, so left-over files cost memory until the host reboots).

    - Created by ``tempfile.mkdtemp`` (an unpredictable name, mode 0700, created exclusively), so a directory or
      symlink planted beforehand in the world-writable ``/dev/shm`` is never written through
      (:class:`eagle3ray.connector.CpuSafeHiddenStatesConnector` also refuses a scratch folder that is a symlink or
      another user's).
    - Named ``eagle3ray-hs-<space>-<pid>-<random>``, ``space`` a hash of this machine's boot id and pid namespace
      (:func:`eagle3ray.lease.process_space`): a new engine removes the folders of engines of this user, in this
      pid space, whose process is gone (a replica killed by Serve, an OOM-killed actor). Folders of other pid
      spaces (another container sharing ``/dev/shm``) and of live processes are left alone.
    - :meth:`discard` removes a call's files whatever happened to the call; the folder goes at a normal exit.

    Raises:
        OSError: ``root`` does not exist or is not writable.
    """

    def __init__(self, root: str):
        from .lease import process_space

        self.root = root
        space = process_space()
        self.space = hashlib.sha256(space.encode()).hexdigest()[:8] if space else "nospace"
        os.makedirs(root, exist_ok=True)
        self.swept = self.sweep_stale(root, self.space)
        self.path = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{self.space}-{os.getpid()}-", dir=root)
        import atexit

        atexit.register(self.remove)

    @staticmethod
    def sweep_stale(root: str, space: str) -> list[str]:
        """Remove ``root``'s scratch folders of dead engines of this user in pid space ``space``; returns their
        paths. A folder whose pid exists (even if reused by another process) is kept: the safe side."""
        removed = []
        try:
            names = os.listdir(root)
        except OSError:
            return removed
        for name in names:
            parts = name[len(SCRATCH_PREFIX):].split("-") if name.startswith(SCRATCH_PREFIX) else []
            if len(parts) != 3 or parts[0] != space or not parts[1].isdigit():
                continue
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
                if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.geteuid():
                    continue
                os.kill(int(parts[1]), 0)
            except ProcessLookupError:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            except OSError:  # vanished, or the pid exists as another user's process
                continue
        if removed:
            log.info("removed %d hidden-state scratch folder(s) of dead engines in %s", len(removed), root)
        return removed

    def discard(self, paths: list[str | None]) -> None:
        """Remove these request files (states, ``.part``, ``.lock``), whether or not they were read."""
        for p in paths:
            if not p:
                continue
            for f in (p, p + ".part", p + ".lock"):
                try:
                    os.remove(f)
                except FileNotFoundError:
                    pass

    def clear(self) -> None:
        """Remove every file in the folder (after an engine call that failed before naming its files; calls on
        one engine are serialized: a Serve replica takes one request at a time)."""
        for name in os.listdir(self.path) if os.path.isdir(self.path) else []:
            try:
                os.remove(os.path.join(self.path, name))
            except OSError:
                pass

    def remove(self) -> None:
        """Remove the folder and everything in it."""
        shutil.rmtree(self.path, ignore_errors=True)


class VerifierEngine(_EngineCounters):
    """A vLLM engine configured for hidden-state extraction (and usable for generation).

    Args:
        spec: the engine settings. ``spec.max_num_batched_tokens`` caps every engine step's tokens
            (vLLM chunks longer prefills), so an extraction batch never prefills more than that.
    """

    loads_in_process = 0

    def __init__(self, spec: VerifierSpec | dict):
        self.spec = spec if isinstance(spec, VerifierSpec) else VerifierSpec(**spec)
        s = self.spec
        t0 = time.time()
        if s.device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(max(1, s.cpu_kv_cache_gib))))
        from vllm import LLM

        self.scratch = HiddenStateScratch(s.tmp_dir)
        self._scratch = self.scratch.path
        kwargs = dict(
            model=s.model_path, dtype=s.dtype, tensor_parallel_size=s.tensor_parallel_size,
            max_model_len=s.max_model_len, max_num_batched_tokens=s.max_num_batched_tokens,
            max_num_seqs=s.max_num_seqs, enforce_eager=s.enforce_eager, seed=s.seed,
            trust_remote_code=s.trust_remote_code,
            # the remote code, weights and tokenizer all come from the pinned commit (None: the hub's default branch)
            revision=s.revision, code_revision=s.revision, tokenizer_revision=s.revision,
            # Prefix caching truncates the dumped states (cached tokens are not recomputed).
            enable_prefix_caching=False,
            speculative_config={
                "method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(s.layer_ids)}},
            },
            kv_transfer_config={
                "kv_connector": "CpuSafeHiddenStatesConnector",
                "kv_connector_module_path": "eagle3ray.connector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self._scratch},
            },
        )
        if s.device == "cuda":
            kwargs["gpu_memory_utilization"] = s.gpu_memory_utilization
            if s.tensor_parallel_size > 1:
                kwargs["distributed_executor_backend"] = "ray"
        opts = cpu_engine_options(s.device, s.tensor_parallel_size, s.cpu_threads)
        kwargs.update(opts)
        self._threads = engine_threads(opts)
        self.llm = LLM(**kwargs)
        self._start_counters(time.time() - t0)
        log.info("verifier loaded in %.1f s: %s layers %s", self.load_seconds, s.model_path, s.layer_ids)

    def extract(self, samples: list[dict], storage_dtype: str = "bfloat16") -> list[dict]:
        """Hidden states of each sample, prefilled together in one engine call.

        Args:
            samples: [{"sample_id": str, "input_ids": list[int] (T tokens)}], total tokens should fit
                ``max_num_batched_tokens`` (the caller forms batches by token budget).
            storage_dtype: encoding of the returned bytes.

        Returns:
            [{"sample_id", "hidden_states": bytes of [T, L, H] in storage_dtype, "shape": (T, L, H)}], in order.

        Raises:
            VerifierError: a sample longer than max_model_len, token ids that do not round-trip
                (samples mixed in a batch), NaN/Inf states, or an unexpected layer count.
        """
        from vllm import SamplingParams

        if storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype {storage_dtype!r} not in {sorted(STORAGE_DTYPES)}")
        for s in samples:
            if len(s["input_ids"]) > self.spec.max_model_len:
                raise VerifierError(f"sample {s['sample_id']}: {len(s['input_ids'])} tokens > max_model_len")
        prompts = [{"prompt_token_ids": list(map(int, s["input_ids"]))} for s in samples]
        t0 = time.perf_counter()
        pin_threads(self._threads)
        try:
            outs = self.llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        except BaseException:
            self.scratch.clear()  # files of this call, if any were written, are named nowhere else
            raise
        paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
        try:
            return self._read_states(samples, paths, storage_dtype, t0)
        finally:
            self.scratch.discard(paths)  # every file of the call, also when a sample was rejected mid-batch

    def _read_states(self, samples: list[dict], paths: list[str | None], storage_dtype: str,
                     t0: float) -> list[dict]:
        """Read and check each sample's states file (:meth:`extract`'s checks and return value); ``t0``: the
        ``time.perf_counter()`` at which the call began, for the engine's ``extract_seconds``."""
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        self._write_pending_states(paths)
        n_layers = len(self.spec.layer_ids)
        results = []
        for s, path in zip(samples, paths):
            if not path:
                raise VerifierError(f"sample {s['sample_id']}: engine returned no hidden states")
            data = load_hidden_states(path)
            cleanup_hidden_states(path)
            states, token_ids = data["hidden_states"], data["token_ids"]  # shape: [T, L, H], [T]
            if token_ids.tolist() != list(map(int, s["input_ids"])):
                raise VerifierError(f"sample {s['sample_id']}: stored token ids differ from the request's")
            if states.dim() != 3 or states.shape[0] != len(s["input_ids"]) or states.shape[1] != n_layers:
                raise VerifierError(f"sample {s['sample_id']}: states shape {tuple(states.shape)}, expected "
                                    f"[{len(s['input_ids'])}, {n_layers}, H]")
            if not bool(states.isfinite().all()):
                raise VerifierError(f"sample {s['sample_id']}: NaN/Inf in hidden states")
            results.append({"sample_id": s["sample_id"], "hidden_states": to_storage_array(states, storage_dtype),
                            "shape": tuple(states.shape)})
        self._count_extract(samples, time.perf_counter() - t0)
        return results

    def _write_pending_states(self, paths: list[str | None]) -> None:
        """Step an in-process engine until every finished request's states file is written.

        vLLM's hidden-states connector writes a finished request's states on the engine step *after*
        the one that finished it (``get_finished`` of the next ``execute_model``). vLLM's engine-core
        process keeps stepping while such saves are pending (``Scheduler.has_requests``), but an
        in-process engine is stepped by ``LLM.generate`` only while requests are unfinished, so without
        this the reader would wait forever on the file's lock, held by this same process.

        Raises:
            VerifierError: the files did not appear within a few idle steps.
        """
        from vllm.v1.engine.core_client import InprocClient

        if not isinstance(self.llm.llm_engine.engine_core, InprocClient):
            return  # vLLM's engine-core process writes them; readers wait on the lock files
        for _ in range(8):
            if all(p is None or os.path.exists(p) for p in paths):
                return
            self.llm.llm_engine.step()
        missing = [p for p in paths if p is not None and not os.path.exists(p)]
        raise VerifierError(f"{len(missing)} hidden-state files were not written, e.g. {missing[0]}")

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 seed: int | None = None) -> list[dict]:
        """Decode answers for token-id prompts; returns [{"token_ids": list[int], "text": str, "finish_reason"}]."""
        from vllm import SamplingParams

        sp = SamplingParams(
            max_tokens=max_new_tokens, temperature=temperature, seed=seed,
            extra_args={"kv_transfer_params": {"skip_hidden_states": True}},
        )
        pin_threads(self._threads)
        outs = self.llm.generate([{"prompt_token_ids": list(map(int, p))} for p in prompts], sp, use_tqdm=False)
        self._count_generate(prompts)
        return [{"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
                 "finish_reason": o.outputs[0].finish_reason} for o in outs]

    def probe(self) -> None:
        """A one-token greedy decode of a one-token prompt (the replica's idle health probe; no hidden states
        written, not counted in the engine's metrics).

        Raises:
            whatever the engine raises: vLLM's ``EngineDeadError`` when its engine-core process or a
            tensor-parallel worker died.
        """
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=1, temperature=0.0,
                            extra_args={"kv_transfer_params": {"skip_hidden_states": True}})
        pin_threads(self._threads)  # the probe runs on another thread than requests (serving_engine.pin_threads)
        self.llm.generate([{"prompt_token_ids": [0]}], sp, use_tqdm=False)


class StandInEngine(_EngineCounters):
    """A verifier engine that loads no model, with :class:`VerifierEngine`'s interface (``extract``,
    ``generate``, ``info``). For rehearsing what does not depend on the model: placement of
    tensor-parallel replicas, the elastic pool, node failures, metrics (``verifier.engine: stand_in``).

    ``extract`` returns deterministic states, a function of (token id, position, layer), shape
    [T, L, H] with H the verifier config's hidden size, so a retried unit yields identical bytes.
    With ``stand_in_tokens_per_s`` each call sleeps ``tokens / rate`` seconds to model engine time.
    """

    loads_in_process = 0

    def __init__(self, spec: VerifierSpec | dict):
        self.spec = spec if isinstance(spec, VerifierSpec) else VerifierSpec(**spec)
        self._start_counters(0.0)

    @staticmethod
    def states_bf16(input_ids: list[int], num_layers: int, hidden_size: int):
        """Deterministic bfloat16 states, a torch tensor [T, L, H], for token ids (the stand-in's 'model').

        Row (t, l) is row ``(id_t * 40503 + t * 2654435761) % 4093`` of a fixed table of seeded standard-normal
        values (layer l scaled by l + 1, so layers differ; :func:`_stand_in_table`): producing a unit is one
        gather, so the stand-in's own cost stays small next to the data plane it feeds at real shapes
        (``benchmarks/data_plane.py`` measures it alone), and its values are as hard to compress as noise, not as
        easy as a smooth function. The same ids give the same bytes, so a retried unit writes an identical block.
        """
        import torch

        table = _stand_in_table(num_layers, hidden_size)
        idx = (np.asarray(input_ids, dtype=np.int64) * 40503 + np.arange(len(input_ids), dtype=np.int64)
               * 2654435761) % table.shape[0]
        return torch.from_numpy(np.take(table, idx, axis=0)).view(torch.bfloat16)

    @staticmethod
    def states(input_ids: list[int], num_layers: int, hidden_size: int):
        """:meth:`states_bf16` as a float32 numpy array [T, L, H] (exact: every value is a bfloat16)."""
        return StandInEngine.states_bf16(input_ids, num_layers, hidden_size).float().numpy()

    def extract(self, samples: list[dict], storage_dtype: str = "bfloat16") -> list[dict]:
        """Deterministic states of each sample, same return format as :meth:`VerifierEngine.extract`."""
        t0 = time.perf_counter()
        stand_in_fault("extract", [s["sample_id"] for s in samples])
        ntok = sum(len(s["input_ids"]) for s in samples)
        busy = os.environ.get("EAGLE3RAY_STAND_IN_BUSY_DIR")  # rehearsals: lets a test fail a node mid-call
        marker = os.path.join(busy, f"{os.getpid()}.busy") if busy else None
        if marker:
            Path(marker).touch()
        try:
            if self.spec.stand_in_tokens_per_s:
                time.sleep(ntok / self.spec.stand_in_tokens_per_s)
        finally:
            if marker and os.path.exists(marker):
                os.remove(marker)
        H, L = self.spec.model_identity["hidden_size"], len(self.spec.layer_ids)
        out = []
        for s in samples:
            if len(s["input_ids"]) > self.spec.max_model_len:
                raise VerifierError(f"sample {s['sample_id']}: {len(s['input_ids'])} tokens > max_model_len")
            st = self.states_bf16(s["input_ids"], L, H)
            out.append({"sample_id": s["sample_id"], "hidden_states": to_storage_array(st, storage_dtype),
                        "shape": tuple(st.shape)})
        self._count_extract(samples, time.perf_counter() - t0)
        return out

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 seed: int | None = None) -> list[dict]:
        """Echoes the prompt's last tokens (no model): [{"token_ids", "text", "finish_reason"}]."""
        stand_in_fault("generate", [])
        self._count_generate(prompts)
        return [{"token_ids": list(p[-max_new_tokens:]), "text": "stand-in answer", "finish_reason": "length"}
                for p in prompts]

    def probe(self) -> None:
        """The idle health probe (:meth:`VerifierEngine.probe`): no model, so only a fault file can make it fail
        (``crash_probe_once``, ``hang_probe_once``)."""
        stand_in_fault("probe", [])


#: Environment variable naming the folder of the stand-in engine's fault files (rehearsals and fault tests only).
STAND_IN_FAULT_DIR = "EAGLE3RAY_STAND_IN_FAULT_DIR"


def stand_in_fault(call: str, sample_ids: list[str]) -> None:
    """Real faults for rehearsals: what the files in ``$EAGLE3RAY_STAND_IN_FAULT_DIR`` ask of this call.

    - ``crash_samples`` (sample ids, one per line): an ``extract`` call whose unit holds one of them ends its
      process at once (``os._exit(1)``, as a segfaulting engine would), every time;
    - ``hang_<call>_once`` (``call``: extract or generate): the first such call, in any process, never returns
      (the file is removed by the call that takes it, so exactly one call hangs);
    - ``crash_<call>_once``: the first such call ends its process.

    Nothing happens without the variable (the product's runs never set it); read at every call, so a test can
    add a fault while a run goes on. Used by ``tests/cluster_scenarios.py``.
    """
    folder = os.environ.get(STAND_IN_FAULT_DIR)
    if not folder:
        return

    def take(name: str) -> bool:  # one process wins the remove
        try:
            os.remove(os.path.join(folder, name))
            return True
        except FileNotFoundError:
            return False

    crash = os.path.join(folder, "crash_samples")
    if sample_ids and os.path.exists(crash):
        bad = set(Path(crash).read_text().split())
        if bad & set(sample_ids):
            log.error("stand-in fault: unit with %s crashes its process", sorted(bad & set(sample_ids)))
            os._exit(1)
    if take(f"crash_{call}_once"):
        log.error("stand-in fault: %s call crashes its process", call)
        os._exit(1)
    if take(f"hang_{call}_once"):
        log.error("stand-in fault: %s call hangs", call)
        while True:
            time.sleep(3600)


@functools.lru_cache(maxsize=2)
def _stand_in_table(num_layers: int, hidden_size: int) -> np.ndarray:
    """The stand-in's table: bfloat16 bits as int16 [4093, L, H] (seeded by the shape; 134 MB at 4 x 4096)."""
    import torch

    rng = np.random.default_rng(num_layers * 100_003 + hidden_size)
    rows = rng.standard_normal((4093, num_layers, hidden_size), dtype=np.float32)
    rows *= np.arange(1, num_layers + 1, dtype=np.float32)[None, :, None]
    return torch.from_numpy(rows).to(torch.bfloat16).view(torch.int16).numpy()


def make_engine(spec: VerifierSpec | dict):
    """The engine ``spec.engine`` names: :class:`VerifierEngine` (vLLM) or :class:`StandInEngine`."""
    engine = spec.engine if isinstance(spec, VerifierSpec) else spec.get("engine", "vllm")
    return StandInEngine(spec) if engine == "stand_in" else VerifierEngine(spec)
