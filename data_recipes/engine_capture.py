"""Hidden states from a serving engine: vLLM's ``extract_hidden_states`` method, turned into the very tensors the
transformers capture stores (``capture.engine: vllm``, ``train.online_capture: vllm``).

The server runs the target with ``extract_hidden_states`` over the captured layers plus the last one, and a
hidden-states KV connector that writes one safetensors file per request: ``hidden_states`` [tokens, layers,
hidden] in ascending layer order and ``token_ids``. Each sample goes as a prompt of its own token ids with
``max_tokens: 1``; the answer names the file (``kv_transfer_params.hidden_states_path``), which is read once
its lock is released, checked against the ids sent, and deleted.

What the layers mean, in vLLM and here: layer id i < L is the residual stream entering decoder layer i, HF's
``hidden_states[i]``, as capture's pre-hooks catch it. Layer id L is the last layer's output *before* the final
norm, where HF's ``hidden_states[L]`` (our ``last_hidden``) comes after it, so the target's own final norm
module is applied here: a shard means the same whichever engine wrote it (docs/DATA.md).

Without CUDA the stock connector cannot write (it copies through CUDA streams into pinned memory); the server
then loads ours, ``data_recipes/vllm_side/headstart_hidden_states.py``, which saves on the CPU.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig

from headstart.core.runtime import barrier, rank_zero_value, resolve_dtype
from headstart.core.weights import borrowed_model
from headstart.data_recipes.engine_client import ChatServer, EngineError
from headstart.data_recipes.engine_server import vllm_server
from headstart.data_recipes.settings import Capture, Target

CPU_CONNECTOR = ("CPUHiddenStatesConnector", "headstart_hidden_states")  # class, module (in vllm_side/)
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
VLLM_SIDE = Path(__file__).resolve().parent / "vllm_side"
VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def server_args(target: Target, layer_ids: list[int], max_length: int, states_dir: Path) -> list[str]:
    """vLLM's flags for a hidden-states server over ``layer_ids`` (ascending; the last is the target's depth).

    Every state is computed fresh (no prefix cache) in one piece (no chunked prefill), and the context holds the
    longest sample plus the one generated token and the step after it: past ``max_model_len`` vLLM skips the
    states step for the whole batch without a word.
    """
    cuda = torch.cuda.is_available() and target.device != "cpu"
    connector = (
        {"kv_connector": STOCK_CONNECTOR}
        if cuda
        else dict(zip(("kv_connector", "kv_connector_module_path"), CPU_CONNECTOR))
    )
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
    }
    transfer = {
        **connector,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(states_dir)},
    }
    context = max_length + 2
    return [
        "--dtype", VLLM_DTYPES[resolve_dtype(target.dtype)],
        "--tensor-parallel-size", str(target.tp_size),
        "--max-model-len", str(context),
        "--max-num-batched-tokens", str(max(context, 8192)),
        "--no-enable-prefix-caching",
        "--no-enable-chunked-prefill",
        "--speculative-config", json.dumps(speculative),
        "--kv-transfer-config", json.dumps(transfer),
    ]  # fmt: skip


class EngineStates:
    """Per sample, the hidden states a vLLM server computes for its token ids: ``last_hidden`` [n, H] (after the
    target's final norm, HF's convention) and, with ``aux_layers``, ``aux_hidden`` [n, k*H]."""

    def __init__(self, server: ChatServer, aux_layers: list[int], final_norm: nn.Module):
        self.server, self.aux_layers, self.final_norm = server, aux_layers, final_norm

    def __call__(self, samples: list[list[int]], sample_ids: list[int]) -> list[dict[str, torch.Tensor]]:
        """The states of ``samples`` (token-id lists), asked ``server.concurrency`` at a time; ``sample_ids``
        name them in errors."""
        body = {"model": self.server.model, "max_tokens": 1, "temperature": 0.0}
        requests = [({**body, "prompt": ids}, f"sample {i}") for ids, i in zip(samples, sample_ids)]
        answers = self.server.post_all("/completions", requests)
        return [self._read(answer, ids, what) for answer, ids, (_, what) in zip(answers, samples, requests)]

    def _read(self, answer: dict[str, Any], ids: list[int], what: str) -> dict[str, torch.Tensor]:
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise EngineError(
                f"{self.server.base_url}: {what}: the answer names no hidden-states file (kv_transfer_params): "
                "is the server running extract_hidden_states with a hidden-states KV connector?"
            )
        tensors = read_states_file(path)
        served = tensors["token_ids"].tolist()
        if served != list(ids):
            at = next((i for i, (a, b) in enumerate(zip(served, ids)) if a != b), min(len(served), len(ids)))
            raise EngineError(
                f"{self.server.base_url}: {what}: the engine's token ids differ from ours at position {at} "
                f"({len(served)} ids vs {len(ids)}): the server must serve the target's own tokenizer and vocabulary"
            )
        return engine_states(tensors["hidden_states"], len(self.aux_layers), self.final_norm)


def engine_states(hidden: torch.Tensor, n_aux: int, final_norm: nn.Module) -> dict[str, torch.Tensor]:
    """vLLM's [n, n_aux + 1, H] (aux layers ascending, then the last layer before the final norm) -> capture's
    ``last_hidden`` [n, H], normed as HF's last hidden state is, and ``aux_hidden`` [n, n_aux * H]."""
    weight = next(final_norm.parameters())
    with torch.no_grad():
        last = final_norm(hidden[:, n_aux].to(weight.dtype))
    states = {"last_hidden": last}
    if n_aux:
        states["aux_hidden"] = hidden[:, :n_aux].flatten(1)
    return states


def read_states_file(path: str) -> dict[str, torch.Tensor]:
    """A connector's file, once its writer has released the ``.lock`` beside it (the answer may arrive before
    the write ends); both files are deleted after reading."""
    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as held:
            fcntl.flock(held, fcntl.LOCK_SH)  # sleeps until the writer lets go
    if not os.path.exists(path):
        raise EngineError(f"{path}: the server named this hidden-states file but it is not there (another machine?)")
    tensors = load_file(path)
    for leftover in (path, lock):
        if os.path.exists(leftover):
            os.remove(leftover)
    return tensors


@contextmanager
def engine_states_for(
    target: Target, cap: Capture, max_length: int, aux_layers: list[int], work_dir: Path, rank: int = 0
) -> Iterator[EngineStates]:
    """``EngineStates`` from the server the capture section names (``cap.base_url``) or from one started here
    (``cap.engine_python``, the target split ``target.tp_size`` ways, its context ``max_length`` tokens; its log
    and files under ``work_dir``).

    Under torchrun only rank 0 starts a server, and every rank asks it (all on one machine: the states files
    are read where the server writes them); the server stops once every rank is done with it.
    """
    norm = borrowed_model(target.path, torch.device("cpu"), resolve_dtype(target.dtype)).get_decoder().norm
    model = cap.model or str(target.path)
    limits = cap.concurrency, cap.timeout_s, cap.retries
    with ExitStack() as stack:
        url = cap.base_url
        if not url and (not dist.is_initialized() or dist.get_rank() == 0):
            server = _started_server(target, cap.engine_python, max_length, aux_layers, work_dir, model)
            url = stack.enter_context(server)
        url = rank_zero_value(url)
        assert url is not None  # the given server's, or the one rank 0 started
        stack.callback(barrier)  # runs before the server stops: no rank loses it mid-request
        yield EngineStates(stack.enter_context(ChatServer(url, model, *limits)), aux_layers, norm)


def _started_server(
    target: Target, engine_python: str, max_length: int, aux_layers: list[int], work_dir: Path, model: str
) -> Any:
    states_dir = work_dir / "engine-states"
    states_dir.mkdir(parents=True, exist_ok=True)
    layers = [*aux_layers, norm_free_last_layer(target.path)]
    args = server_args(target, layers, max_length, states_dir)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(VLLM_SIDE), os.environ.get("PYTHONPATH")]))}
    return vllm_server(engine_python, str(target.path), model, work_dir / "vllm.log", tuple(args), env)


def norm_free_last_layer(path: str) -> int:
    """vLLM's id of the last layer's output (before the final norm): the target's depth."""
    return AutoConfig.from_pretrained(path).get_text_config().num_hidden_layers
