"""Hidden states from a serving engine: vLLM's ``extract_hidden_states`` method, turned into the very tensors the
transformers capture stores (``capture.engine: vllm``, ``train.online_capture: vllm``).

The server runs the target with ``extract_hidden_states`` over the captured layers plus the last one, and a
hidden-states KV connector that writes one safetensors file per request: ``hidden_states`` [tokens, layers,
hidden] in ascending layer order and ``token_ids``. Each sample goes as a prompt of its own token ids with
``max_tokens: 1``; the answer names the file (``kv_transfer_params.hidden_states_path``), which is read once
its lock is released, checked against the request (ids, shape, dtype, finite values), and deleted. The name is
the server's word: only a regular file directly in the states folder the capture owns (the one it gave the
server it started, or ``capture.states_dir``) is read or deleted (``states_file``), every wait bounded.

What the layers mean, in vLLM and here: layer id i < L is the residual stream entering decoder layer i, HF's
``hidden_states[i]``, as capture's pre-hooks catch it. Layer id L is the last layer's output *before* the final
norm, where HF's ``hidden_states[L]`` (our ``last_hidden``) comes after it, so the target's own final norm
module is applied here: a shard means the same whichever engine wrote it (docs/DATA.md).

Without CUDA the stock connector cannot write (it copies through CUDA streams into pinned memory); the server
then loads ours, ``data_recipes/vllm_side/headstart_hidden_states.py``, which saves on the CPU.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load
from torch import nn
from transformers import AutoConfig

from headstart.core.runtime import barrier, rank_zero_value, resolve_dtype
from headstart.core.weights import borrowed_model
from headstart.data_recipes.engine_client import ChatServer, EngineError, quote
from headstart.data_recipes.engine_server import check_engine_python, vllm_server
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
    target's final norm, HF's convention) and, with ``aux_layers``, ``aux_hidden`` [n, k*H].

    ``states_dir`` is the one folder whose files an answer may name (``states_file``); ``hidden_size`` is the
    target's H, which every file is checked against."""

    def __init__(
        self, server: ChatServer, aux_layers: list[int], final_norm: nn.Module, states_dir: Path, hidden_size: int
    ) -> None:
        self.server, self.aux_layers, self.final_norm = server, aux_layers, final_norm
        self.states_dir, self.hidden_size = Path(states_dir), hidden_size

    def __call__(self, samples: list[list[int]], sample_ids: list[int]) -> list[dict[str, torch.Tensor]]:
        """The states of ``samples`` (token-id lists), asked ``server.concurrency`` at a time; ``sample_ids``
        name them in errors."""
        body = {"model": self.server.model, "max_tokens": 1, "temperature": 0.0}
        requests = [({**body, "prompt": ids}, f"sample {i}") for ids, i in zip(samples, sample_ids)]
        answers = self.server.post_all("/completions", requests)
        return [self._read(answer, ids, what) for answer, ids, (_, what) in zip(answers, samples, requests)]

    def _read(self, answer: Any, ids: list[int], what: str) -> dict[str, torch.Tensor]:
        where = f"{self.server.base_url}: {what}"
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        path = params.get("hidden_states_path") if isinstance(params, dict) else None
        if path is None:
            raise EngineError(
                f"{where}: the answer names no hidden-states file (kv_transfer_params): "
                "is the server running extract_hidden_states with a hidden-states KV connector?"
            )
        shape = (len(ids), len(self.aux_layers) + 1, self.hidden_size)
        with states_file(path, self.states_dir, self.server.timeout_s, where, most_bytes(shape)) as tensors:
            hidden = checked_states(tensors, ids, shape, f"{where}: {path}")
        return engine_states(hidden, len(self.aux_layers), self.final_norm)


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


STATES_DIR = "engine-states"  # under the work folder: where a server started here writes its files
HEADER_BYTES = 1 << 20  # a safetensors header of two tensors takes well under a kilobyte: ample slack
LOCK_POLL_S = 0.05
MOST_BYTES = 1 << 34  # a file read with no request to size it against: 16 GiB
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a server computes in (VLLM_DTYPES)


def most_bytes(shape: tuple[int, int, int]) -> int:
    """The most bytes a states file of ``shape`` [tokens, layers, hidden] takes: float32 states (the widest a
    server computes in) and int64 ids, plus a header. A larger file is not the answer to the request."""
    tokens, layers, hidden = shape
    return tokens * (layers * hidden * 4 + 8) + HEADER_BYTES


@contextmanager
def states_file(
    path: Any, states_dir: Path, timeout_s: float, where: str, most: int
) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors of the file an answer names, read once its writer releases the ``.lock`` beside it (the answer
    may come before the write ends), that wait bounded by ``timeout_s``; the file and its lock are deleted when
    the block ends without an error (the block checks the tensors: a bad file is kept to be looked at).

    The path is the server's word, and whatever answers at the URL may name any file: only a regular file (no
    symlink, FIFO, folder) directly in ``states_dir``, the folder the capture owns, of at most ``most`` bytes, is
    opened, read or deleted. Both are opened relative to the folder's descriptor, so a path swapped in between
    the check and the read cannot lead outside it. ``where`` names the server and the sample in errors.
    """
    name = _name_in(path, states_dir, where)
    try:
        folder = os.open(states_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise EngineError(f"{where}: the states folder {states_dir} cannot be opened: {err.strerror}") from None
    try:
        lock = _open_regular(name + ".lock", folder, where, path + ".lock")
        try:
            if lock is not None:
                _wait_for_writer(lock, timeout_s, where, path + ".lock")
            data = _read_regular(name, folder, where, path, most)
        finally:
            if lock is not None:
                os.close(lock)
        try:
            tensors = load(data)
        except (SafetensorError, ValueError) as err:
            raise EngineError(f"{where}: {path} is not a safetensors file ({err})") from None
        yield tensors
        for leftover in [name] + ([name + ".lock"] if lock is not None else []):
            with suppress(FileNotFoundError):  # another reader of a shared folder took it: nothing to remove
                os.unlink(leftover, dir_fd=folder)
    finally:
        os.close(folder)


def read_states_file(path: str, states_dir: Path, timeout_s: float) -> dict[str, torch.Tensor]:
    """A connector's file as ``states_file`` reads it (a regular file directly in ``states_dir``, its lock
    waited for ``timeout_s`` at most, at most ``MOST_BYTES``), then deleted with its lock; the tensors unchecked
    (``checked_states`` checks them against a request)."""
    with states_file(path, states_dir, timeout_s, "a states file", MOST_BYTES) as tensors:
        return tensors


def _name_in(path: Any, states_dir: Path, where: str) -> str:
    """The file's name, if ``path`` names a .safetensors file directly in ``states_dir`` (not via ``..``)."""
    if not isinstance(path, str) or not path:
        raise EngineError(f"{where}: the answer's hidden_states_path is {quote(path)}, not a file's path")
    folder, name = os.path.split(os.path.normpath(path))
    inside = os.path.isabs(path) and "\0" not in path and os.path.realpath(folder) == os.path.realpath(states_dir)
    if not inside or not name.endswith(".safetensors"):
        raise EngineError(
            f"{where}: the server named {quote(path)} as its hidden-states file, which is not a .safetensors file "
            f"directly in {states_dir} (the folder it was given to write to, or capture.states_dir): not read, "
            "not deleted"
        )
    return name


def _open_regular(name: str, folder: int, where: str, shown: str) -> int | None:
    """A read descriptor of ``name`` in the folder ``folder``, if it is a regular file; None if it is not there.
    Never follows a symlink, and never blocks (a FIFO opens at once, and is refused)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=folder)
    except FileNotFoundError:
        return None
    except OSError as err:
        kind = "a symbolic link" if err.errno == errno.ELOOP else err.strerror
        raise EngineError(f"{where}: {shown} cannot be opened ({kind}): not read, not deleted") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a special file"
        raise EngineError(f"{where}: {shown} is {kind}, not a regular file: not read, not deleted")
    return fd


def _wait_for_writer(lock: int, timeout_s: float, where: str, shown: str) -> None:
    """Until the writer (the connector holds LOCK_EX from the request's arrival to the end of its write) lets go
    of ``lock``, polled: a blocking flock would wait for a server that never releases it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise EngineError(
                    f"{where}: the server still holds {shown} after {timeout_s:g} s (capture.timeout_s): "
                    "its write of the states never ended"
                ) from None
            time.sleep(LOCK_POLL_S)


def _read_regular(name: str, folder: int, where: str, shown: str, most: int) -> bytes:
    fd = _open_regular(name, folder, where, shown)
    if fd is None:
        raise EngineError(
            f"{where}: the server named {shown} as its hidden-states file but it is not there (written on another "
            "machine? capture.states_dir must be the server's folder as seen here)"
        )
    with os.fdopen(fd, "rb") as f:
        data = f.read(most + 1)  # never more: the file may be anything, or still growing
    if len(data) > most:
        raise EngineError(
            f"{where}: {shown} is larger than the states of this request take ({most} bytes at most): not read"
        )
    return data


def checked_states(
    tensors: dict[str, torch.Tensor], ids: list[int], shape: tuple[int, int, int], where: str
) -> torch.Tensor:
    """The file's ``hidden_states``, once it is what the request asked for: its ``token_ids`` the ids sent, the
    states ``shape`` [tokens, layers, hidden] in a float dtype, every value finite. ``where`` names the file."""
    missing = [key for key in ("token_ids", "hidden_states") if key not in tensors]
    if missing:
        raise EngineError(f"{where}: the file has no {' or '.join(missing)} (it holds {sorted(tensors)})")
    served, hidden = tensors["token_ids"], tensors["hidden_states"]
    if served.ndim != 1 or served.dtype.is_floating_point or served.dtype == torch.bool:
        raise EngineError(f"{where}: token_ids is {served.dtype} of shape {list(served.shape)}, not a list of ids")
    _same_ids(served.tolist(), ids, where)
    if tuple(hidden.shape) != shape:
        raise EngineError(
            f"{where}: hidden_states has shape {list(hidden.shape)}, the request's is {list(shape)} ({shape[0]} "
            f"token ids sent, {shape[1] - 1} aux layers + the last asked, the target's hidden size {shape[2]})"
        )
    if hidden.dtype not in STATE_DTYPES:
        raise EngineError(f"{where}: hidden_states are {hidden.dtype}, not float32, bfloat16 or float16")
    bad = ~torch.isfinite(hidden)
    if bad.any():
        token, layer, _ = bad.nonzero()[0].tolist()
        raise EngineError(
            f"{where}: hidden_states hold {int(bad.sum())} NaN or infinite values (the first at token {token}, "
            f"layer {layer} of {shape[1]}): the target overflowed or diverged on the server"
        )
    return hidden


def _same_ids(served: list[int], ids: list[int], where: str) -> None:
    if served != list(ids):
        at = next((i for i, (a, b) in enumerate(zip(served, ids)) if a != b), min(len(served), len(ids)))
        raise EngineError(
            f"{where}: the engine's token ids differ from ours at position {at} ({len(served)} ids vs {len(ids)}): "
            "the server must serve the target's own tokenizer and vocabulary"
        )


def check_engine(target: Target, cap: Capture) -> None:
    """What an engine capture needs and can be checked before any work (tokenizing, the output folder): the
    engines venv of a server started here, or the folder and served model of the one at ``cap.base_url``."""
    if not cap.base_url:
        check_engine_python(cap.engine_python)
        return
    _check_states_dir(cap)
    with ChatServer(cap.base_url, cap.model or str(target.path), 1, cap.timeout_s, cap.retries) as server:
        server.served_model()


def _check_states_dir(cap: Capture) -> Path:
    if cap.states_dir is None or not Path(cap.states_dir).is_dir():
        raise NotADirectoryError(
            f"capture.states_dir {cap.states_dir} is not a folder here: with capture.base_url it must be the "
            "folder that server writes its hidden-states files to, as seen from this machine"
        )
    return Path(cap.states_dir)


@contextmanager
def engine_states_for(
    target: Target, cap: Capture, max_length: int, aux_layers: list[int], work_dir: Path, rank: int = 0
) -> Iterator[EngineStates]:
    """``EngineStates`` from the server the capture section names (``cap.base_url``, its files in
    ``cap.states_dir``) or from one started here (``cap.engine_python``, the target split ``target.tp_size``
    ways, its context ``max_length`` tokens; its log and files under ``work_dir``), once it serves the model.

    Under torchrun only rank 0 starts a server, and every rank asks it (all on one machine: the states files
    are read where the server writes them); the server stops once every rank is done with it.
    """
    norm = borrowed_model(target.path, torch.device("cpu"), resolve_dtype(target.dtype)).get_decoder().norm
    hidden_size = AutoConfig.from_pretrained(target.path).get_text_config().hidden_size
    model = cap.model or str(target.path)
    limits = cap.concurrency, cap.timeout_s, cap.retries
    # The one folder whose files an answer may name: the user's, or the one given to the server started here.
    states_dir = _check_states_dir(cap) if cap.base_url else (work_dir / STATES_DIR).absolute()
    with ExitStack() as stack:
        url = cap.base_url
        if not url and (not dist.is_initialized() or dist.get_rank() == 0):
            server = _started_server(target, cap.engine_python, max_length, aux_layers, work_dir, states_dir, model)
            url = stack.enter_context(server)
        url = rank_zero_value(url)
        assert url is not None  # the given server's, or the one rank 0 started
        stack.callback(barrier)  # runs before the server stops: no rank loses it mid-request
        client = stack.enter_context(ChatServer(url, model, *limits))
        client.served_model()  # another model's server would answer too, with its states: refused, naming both
        yield EngineStates(client, aux_layers, norm, states_dir, hidden_size)


def _started_server(
    target: Target,
    engine_python: str,
    max_length: int,
    aux_layers: list[int],
    work_dir: Path,
    states_dir: Path,
    model: str,
) -> Any:
    states_dir.mkdir(parents=True, exist_ok=True)
    layers = [*aux_layers, norm_free_last_layer(target.path)]
    args = server_args(target, layers, max_length, states_dir)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(VLLM_SIDE), os.environ.get("PYTHONPATH")]))}
    return vllm_server(engine_python, str(target.path), model, work_dir / "vllm.log", tuple(args), env)


def norm_free_last_layer(path: str) -> int:
    """vLLM's id of the last layer's output (before the final norm): the target's depth."""
    return AutoConfig.from_pretrained(path).get_text_config().num_hidden_layers
