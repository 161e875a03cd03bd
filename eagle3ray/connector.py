"""A hidden-state KV connector for vLLM's ``extract_hidden_states`` speculative method, CPU and GPU.

vLLM's ``ExampleHiddenStatesConnector`` (and hs-connectors' ones) copy the captured states into
*pinned* host memory on a CUDA side stream, which crashes the engine on CPU (``pin_memory=True
requires a CUDA or other accelerator backend``; FIELD_NOTES). This subclass keeps everything else
of vLLM's connector (scheduler side, slot mapping, the per-request safetensors file with
``hidden_states`` [T, num_layers, H] and ``token_ids`` [T]) and replaces only the copy-out: a plain
synchronous ``.to("cpu")`` and ``save_file`` before the request is reported finished. So when
``LLM.generate`` returns, each request's file is complete and no lock files are needed.

It is loaded by vLLM through ``kv_transfer_config = {"kv_connector": "CpuSafeHiddenStatesConnector",
"kv_connector_module_path": "eagle3ray.connector", ...}``.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


def _check_scratch_folder(folder: str) -> None:
    """Create ``folder`` if missing (mode 0700); refuse one that is a symlink or another user's.

    The engine's folder is made by :class:`eagle3ray.verifier.HiddenStateScratch` before the engine starts; this
    guards the connector against a folder replaced or planted in a shared ``/dev/shm`` since.

    Raises:
        PermissionError: ``folder`` is a symlink or owned by another user.
    """
    if not os.path.lexists(folder):
        os.makedirs(folder, mode=0o700, exist_ok=True)
    st = os.lstat(folder)
    if os.path.islink(folder) or st.st_uid != os.geteuid():
        raise PermissionError(f"hidden-state scratch folder {folder} is a symlink or another user's; refusing to "
                              "write verifier states into it")


class _Done:
    """Stands in for the CUDA event vLLM's connector polls: the copy already happened."""

    @staticmethod
    def query() -> bool:
        return True


class CpuSafeHiddenStatesConnector(ExampleHiddenStatesConnector):
    """vLLM's hidden-states connector with a synchronous, unpinned copy-out (works on CPU and CUDA).

    The written file holds ``hidden_states``: [T, num_layers, H] in the KV-cache dtype and
    ``token_ids``: [T] int64, where layer order follows ``eagle_aux_hidden_state_layer_ids``.
    """

    def _submit_async_write(self, pending: PendingSave) -> None:  # noqa: D401 - vLLM hook
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()  # shape: [blocks*bs]
        num_tokens = pending.token_ids.shape[0]
        states = extract_from_kv_cache(
            self._kv_cache, slot_mapping.to(self._kv_cache.device), num_tokens
        )  # shape: [T, num_layers, H]
        tensors = {
            "hidden_states": states.to("cpu").contiguous(),
            "token_ids": pending.token_ids.clone(),
        }
        _check_scratch_folder(os.path.dirname(pending.filename))
        tmp = pending.filename + ".part"
        save_file(tensors, tmp)
        os.replace(tmp, pending.filename)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Done()

    def build_connector_meta(self, scheduler_output):  # noqa: D401 - vLLM hook
        """vLLM's metadata, minus requests that asked not to be saved.

        Generation requests sent to the same engine (answer regeneration, serving checks) pass
        ``extra_args={"kv_transfer_params": {"skip_hidden_states": True}}``: no file, no lock.
        """
        meta = super().build_connector_meta(scheduler_output)
        for new_req in scheduler_output.scheduled_new_reqs:
            sp = new_req.sampling_params
            params = (sp.extra_args or {}).get("kv_transfer_params") if sp is not None else None
            if params and params.get("skip_hidden_states"):
                meta.new_req_filenames.pop(new_req.req_id, None)
                self._request_filenames.pop(new_req.req_id, None)
        return meta
