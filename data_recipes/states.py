"""Where the target's hidden states come from: its forward (``capture_hidden_states``: offline capture's batches,
``forward_states``, and the training step's, ``OnlineCapture``) or a vLLM server (``EngineCapture``), and which
layers are kept (``resolve_aux_layers``). Offline capture (``data_recipes.capture``) and training read them alike,
so a head trains on the same tensors either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from headstart.core.models import default_aux_layers
from headstart.core.vision import image_token_id, on_model, rope_positions, uses_mrope
from headstart.data_recipes.engine_capture import check_engine, engine_states_for
from headstart.data_recipes.recipes import Sample
from headstart.data_recipes.settings import Capture, Target
from headstart.data_recipes.shards import FP8, dequantize_fp8, store_hidden


def resolve_aux_layers(setting: Any, num_hidden_layers: int) -> list[int]:
    """``auto`` -> EAGLE-3 defaults; a list -> sorted, de-duplicated and range-checked; ``[]`` -> none."""
    if setting == "auto":
        return default_aux_layers(num_hidden_layers)
    layers = sorted(set(setting or []))
    bad = [i for i in layers if not 0 <= i < num_hidden_layers]
    if bad:
        raise ValueError(f"capture.aux_layers {bad} out of range: the target has layers 0..{num_hidden_layers - 1}")
    return layers


@torch.no_grad()
def capture_hidden_states(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    aux_layers: list[int],
    vision: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """One forward of the target's decoder; returns ``last_hidden`` [B,S,H] and ``aux_hidden`` [B,S,k*H].

    ``aux_hidden`` holds the inputs of the decoder layers in ``aux_layers`` (ascending), caught with
    pre-hooks so that only those layers are kept, not all L+1 hidden states. The decoder is run
    without ``lm_head``: the logits are not needed and cost a vocab-sized matmul. With ``vision`` inputs (a
    vision-language target's, ``Sample.vision``) the target's base model runs instead: its vision tower puts the
    images' features in their placeholder rows (and a Qwen-VL target computes its 3-D rotary positions), then the
    same decoder runs over every row, images included as context.
    """
    decoder = model.get_decoder()
    caught: dict[int, torch.Tensor] = {}

    def hook(index: int) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def keep_input(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            caught[index] = args[0] if args else kwargs["hidden_states"]

        return keep_input

    handles = [decoder.layers[i].register_forward_pre_hook(hook(i), with_kwargs=True) for i in aux_layers]
    runs = model.base_model if vision else decoder
    try:
        last = runs(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **(vision or {}))
        last = last.last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
    out = {"last_hidden": last}
    if aux_layers:
        out["aux_hidden"] = torch.cat([caught[i] for i in aux_layers], dim=-1)
    return out


class OnlineCapture:
    """Hidden states computed inside the training step, equal to what offline capture stores.

    A context manager like ``EngineCapture``: the training loop holds it open while it trains (nothing to open
    for a target loaded here)."""

    def __init__(self, model: PreTrainedModel | None, aux_layers: list[int], store_dtype: torch.dtype):
        self.model, self.aux_layers, self.store_dtype = model, aux_layers, store_dtype

    def __enter__(self) -> OnlineCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def states(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``last_hidden`` [B,S,H] and ``aux_hidden`` [B,S,k*H] of the batch, as computed (before storing)."""
        assert self.model is not None
        return capture_hidden_states(self.model, batch["input_ids"], batch["attention_mask"], self.aux_layers)

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        states = self.states(batch)
        keep = batch["attention_mask"].bool()[..., None]
        if self.store_dtype == FP8:  # the states an fp8 shard gives back: quantized, then bf16
            stored = store_hidden(states, FP8, len(self.aux_layers))
            states = {key: dequantize_fp8(stored[key], stored[f"{key}_scale"]) for key in states}
        else:
            states = store_hidden(states, self.store_dtype, len(self.aux_layers))
        # Padded positions are zero, exactly as the shard collator pads them.
        return {**batch, **{k: v.masked_fill(~keep, 0) for k, v in states.items()}}


class EngineCapture(OnlineCapture):
    """Online states asked of a vLLM server for each batch (``train.online_capture: vllm``): the same request as
    ``capture.engine: vllm`` makes per sample, so the step trains on what an engine capture's shards hold.

    Open it (``with``) to start or reach the server; a request that fails is retried (``capture.retries``,
    ``capture.timeout_s``) and then stops the run, naming the server and the sample. Each answer's file is read
    and checked as capture's are (``engine_capture.states_file``, ``checked_states``)."""

    def __init__(
        self, target: Target, cap: Capture, max_length: int, aux_layers: list[int], dtype: torch.dtype, work_dir: Path
    ):
        super().__init__(None, aux_layers, dtype)
        check_engine(target, cap)  # the venv, or the server's folder and model: before the run goes further
        self.opening = engine_states_for(target, cap, max_length, aux_layers, work_dir)
        self.engine: Any = None

    def __enter__(self) -> EngineCapture:
        self.engine = self.opening.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.opening.__exit__(*exc)

    def states(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        rows = self.engine(
            [row[keep].tolist() for row, keep in zip(ids.cpu(), mask.cpu())], batch["sample_id"].tolist()
        )
        out = {key: ids.new_zeros((*ids.shape, value.shape[-1]), dtype=value.dtype) for key, value in rows[0].items()}
        for b, found in enumerate(rows):
            for key, value in found.items():
                out[key][b, : len(value)] = value.to(ids.device)
        return out


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group consecutive (length-sorted) samples so that batch_size x longest <= ``batch_tokens``."""
    batches: list[list[int]] = []
    for index, length in enumerate(lengths):
        if batches and (len(batches[-1]) + 1) * max(lengths[batches[-1][0]], length) <= batch_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


# Per-sample hidden states of a list of samples (with their sample ids): a dict of [tokens, ...] tensors each.
StateSource = Callable[[list[Sample], list[int]], list[dict[str, torch.Tensor]]]


def forward_states(model: PreTrainedModel, aux_layers: list[int], batch_tokens: int, pad_id: int) -> StateSource:
    """The transformers target's states, run in padded batches of at most ``batch_tokens`` tokens; a sample with
    images alone (each family lays out several samples' images its own way)."""

    def states(samples: list[Sample], sample_ids: list[int]) -> list[dict[str, torch.Tensor]]:
        lengths = [len(s.input_ids) for s in samples]
        out: list[dict[str, torch.Tensor]] = [{} for _ in samples]
        for i in (i for i, sample in enumerate(samples) if sample.vision):
            ids = torch.tensor([samples[i].input_ids], device=model.device)
            found = capture_hidden_states(
                model, ids, torch.ones_like(ids), aux_layers, on_model(samples[i].vision, model)
            )
            out[i] = {key: value[0] for key, value in found.items()}
        text = [i for i, sample in enumerate(samples) if not sample.vision]
        for batch in ([text[j] for j in group] for group in length_batches([lengths[i] for i in text], batch_tokens)):
            longest = max(lengths[i] for i in batch)
            ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), longest), dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : lengths[i]] = torch.tensor(samples[i].input_ids)
                mask[row, : lengths[i]] = 1
            found = capture_hidden_states(model, ids.to(model.device), mask.to(model.device), aux_layers)
            for row, i in enumerate(batch):
                out[i] = {key: value[row, : lengths[i]] for key, value in found.items()}
        return out

    return states


@dataclass
class VisionRows:
    """What a vision-language target's shards hold beside the states (``data_recipes.shards``): which rows are image
    placeholders (``image_mask``, never trained on, kept as the context they are), and for a target with 3-D
    rotary positions (Qwen-VL's mrope) each row's position as a text-only draft sees it (``position_ids``,
    ``core.vision.rope_positions``)."""

    image_token: int
    model: PreTrainedModel | None  # an mrope target, whose positions are computed from its images; None otherwise

    @classmethod
    def of(cls, model: PreTrainedModel) -> VisionRows:
        return cls(image_token_id(model.config), model if uses_mrope(model) else None)

    @property
    def mrope(self) -> bool:
        return self.model is not None

    def tensors(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        """A shard's ``image_mask`` [T] uint8 and, for an mrope target, ``position_ids`` [T] int64."""
        ids = torch.tensor([t for s in samples for t in s.input_ids])
        out = {"image_mask": (ids == self.image_token).to(torch.uint8)}
        if self.model is not None:
            model = self.model
            rows = [rope_positions(model, torch.tensor([s.input_ids]), s.vision)[0] for s in samples]
            out["position_ids"] = torch.cat(rows) if rows else ids.long()
        return out
