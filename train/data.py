"""Training data: offline shards or online samples, a held-out slice, and the order batches come in.

The order is a pure function of (seed, epoch, step): a resumed run asks for step N and gets exactly
the samples the uninterrupted run saw at step N, with no sampler state to save.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from headstart.core.fingerprint import tokenizer_hash, weights_hash
from headstart.core.runtime import mix_seed, resolve_dtype
from headstart.core.weights import is_vision_language
from headstart.data_recipes.capture_plan import check_max_length, samples_hash
from headstart.data_recipes.recipes import Sample, load_samples, require_samples
from headstart.data_recipes.shards import ShardDataset, check_manifest, pack_collate, pad_collate
from headstart.data_recipes.states import EngineCapture, OnlineCapture, resolve_aux_layers
from headstart.heads import HeadOptions, head_type
from headstart.train.train_config import Train, TrainConfig


class SampleDataset(Dataset):
    """Tokenized samples for online capture: the hidden states are computed inside the step."""

    def __init__(self, samples: list[Sample]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.samples[index]
        return {
            "input_ids": torch.tensor(sample.input_ids, dtype=torch.long),
            "loss_mask": torch.tensor(sample.loss_mask, dtype=torch.long),
            "sample_id": torch.tensor(index),
        }


@dataclass
class TrainData:
    dataset: SampleDataset | ShardDataset
    train_ids: list[int]
    heldout_ids: list[int]
    aux_layers: list[int]  # the target layers the head fuses (EAGLE-3), [] otherwise
    capture: OnlineCapture | None  # set when the states are computed in the step
    pad_id: int
    pack: bool = False  # train.pack: a micro-batch is one row of its samples end to end


def fuses_layers(options: HeadOptions) -> bool:
    """Whether the head trains on fused target layers (its head type's entry says; EAGLE-3, DFlash)."""
    return head_type(options.type).fuses_layers


def head_settings(options: HeadOptions, aux_layers: list[int]) -> HeadOptions:
    """The head's options; a head that fuses target layers fuses exactly the layers the capture recorded."""
    if fuses_layers(options):
        given = options.model_dump()["layer_ids"]  # every fusing head type has it (heads.register checks)
        if given is not None and sorted(set(given)) != aux_layers:
            raise ValueError(
                f"head.layer_ids {given} differ from the captured layers {aux_layers} (capture.aux_layers)"
            )
        return options.model_copy(update={"layer_ids": aux_layers})
    return options


def load_data(
    cfg: TrainConfig, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, aux: bool, online_states: bool
) -> TrainData:
    """The samples to train on, split into train and held-out ids; shards are checked against the target first.

    ``aux``: the head reads fused target layers (EAGLE-3). ``online_states``: compute hidden states in the
    step with ``OnlineCapture`` (Medusa-2 runs the target itself and passes False).
    """
    data, cap, train = cfg.data, cfg.capture, cfg.train
    text = target.config.get_text_config()  # a vision-language target's text model: what the head reads
    num_layers = text.num_hidden_layers
    aux_layers = resolve_aux_layers(cap.aux_layers, num_layers) if aux else []
    capture: OnlineCapture | None = None
    if train.online_capture and is_vision_language(target.config):
        raise ValueError(
            f"{cfg.target.path} is a vision-language target: train.online_capture runs text samples only; "
            "capture its shards (python -m data_recipes.capture) and train from them"
        )
    if train.online_capture:
        check_max_length(data.max_length, target.config, cfg.target.path)
        samples, report = load_samples(
            data.source, data.format, tokenizer, data.max_length, data.on_error, limit=data.limit,
            over_length=data.over_length,
        )  # fmt: skip
        require_samples(samples, report, data.source, data.max_length)
        dataset: SampleDataset | ShardDataset = SampleDataset(samples)
        store_dtype = resolve_dtype(cap.store_dtype)
        if online_states and train.online_capture == "vllm":  # a server's states; the target is not here
            work_dir = Path(train.out_dir) / "engine"
            capture = EngineCapture(cfg.target, cap, data.max_length, aux_layers, store_dtype, work_dir)
        elif online_states:
            capture = OnlineCapture(target, aux_layers, store_dtype)
    else:
        assert cap.out_dir is not None  # consistency_problems: shards need capture.out_dir
        dataset = ShardDataset(cap.out_dir, vocab_size=text.vocab_size)
        check_manifest(
            dataset.manifest,
            hidden_size=text.hidden_size,
            num_hidden_layers=num_layers,
            tokenizer_hash=tokenizer_hash(tokenizer),
            weights_hash=weights_hash(cfg.target.path, cfg.target.dtype),  # borrowed tensors + inventory
            aux_layers=aux_layers if aux else None,
            allow_other_weights=cap.allow_other_weights,
        )
        if not aux:  # EAGLE-1/2 and Medusa read only the last layer: skip reading the fused ones
            dataset.keys = [key for key in dataset.keys if key != "aux_hidden"]
    train_ids, heldout_ids = split_heldout(len(dataset), train.heldout_samples, train.seed)
    if len(train_ids) < train.batch_size:
        raise ValueError(
            f"{len(train_ids)} training samples ({len(dataset)} minus {len(heldout_ids)} held out) "
            f"do not fill one batch of train.batch_size={train.batch_size}"
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return TrainData(dataset, train_ids, heldout_ids, aux_layers, capture, pad_id, train.pack)


def data_fingerprint(data: TrainData) -> str:
    """Which samples these are: the capture's manifest fingerprint, or a hash of the online samples' tokens
    and loss masks. A checkpoint records it; resuming on other data of the same size is refused."""
    if isinstance(data.dataset, ShardDataset):
        return f"capture {data.dataset.manifest['fingerprint']}"
    return f"samples {samples_hash(data.dataset.samples)}"


def split_heldout(n: int, heldout: int, seed: int) -> tuple[list[int], list[int]]:
    """A seeded random held-out slice (shards are stored longest first, so a plain tail would be biased)."""
    if not 0 <= heldout < n:
        raise ValueError(f"train.heldout_samples={heldout} must be in [0, {n}) for {n} samples")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[heldout:]), sorted(order[:heldout])


def epoch_order(train_ids: list[int], seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(mix_seed(seed, epoch + 1))
    return [train_ids[i] for i in torch.randperm(len(train_ids), generator=generator).tolist()]


def rank_micro_batches(
    order: list[int], step: int, batch_size: int, micro_batch_size: int, rank: int, world: int
) -> list[list[int]]:
    """This rank's micro-batches of optimizer step ``step`` (within the epoch), in accumulation order.

    The step's batch is cut into chunks of ``micro_batch_size``; micro-step m on rank r takes chunk
    m * world + r. Chunk c holds the same samples whatever the world size, so one process accumulating
    over all chunks and N processes averaging their shares see identical micro-batches.
    """
    batch = order[step * batch_size : (step + 1) * batch_size]
    chunks = [batch[i : i + micro_batch_size] for i in range(0, batch_size, micro_batch_size)]
    return chunks[rank::world]


def step_batches(
    data: TrainData, train: Train, start: int, total: int, rank: int, world: int
) -> Iterator[tuple[int, list[dict[str, torch.Tensor]]]]:
    """Yield (step, this rank's collated micro-batches) for global steps start..total-1 over the epochs."""
    per_epoch = len(data.train_ids) // train.batch_size  # the last partial batch of an epoch is dropped
    step = start
    while step < total:
        epoch, first = divmod(step, per_epoch)
        order = epoch_order(data.train_ids, train.seed, epoch)
        steps = range(first, min(per_epoch, first + total - step))
        size, micro = train.batch_size, train.micro_batch_size
        plan = [mb for s in steps for mb in rank_micro_batches(order, s, size, micro, rank, world)]
        accum = size // (micro * world)
        batches = iter(_loader(data, plan, train.num_workers))
        for _ in steps:
            yield step, [next(batches) for _ in range(accum)]
            step += 1


def heldout_batches(data: TrainData, micro_batch_size: int, rank: int, world: int) -> DataLoader:
    """This rank's share of the held-out samples, in micro-batches."""
    ids = data.heldout_ids
    chunks = [ids[i : i + micro_batch_size] for i in range(0, len(ids), micro_batch_size)]
    return _loader(data, chunks[rank::world], 0)


def _loader(data: TrainData, plan: list[list[int]], num_workers: int) -> DataLoader:
    collate = pack_collate if data.pack else partial(pad_collate, pad_id=data.pad_id)
    return DataLoader(data.dataset, batch_sampler=plan, collate_fn=collate, num_workers=num_workers)


def loss_token_counts(dataset: Dataset, indices: list[int], vocab_size: int) -> torch.Tensor:
    """[V] counts of the loss-masked tokens of samples ``indices``: what EAGLE-3's draft vocabulary is cut from."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for input_ids, loss_mask in token_rows(dataset, indices):
        counts += torch.bincount(input_ids[loss_mask.bool()].long(), minlength=vocab_size)
    return counts


def token_rows(dataset: Dataset, indices: list[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(dataset, ShardDataset):
        # Only ids and masks: going through dataset[i] would read every sample's hidden states as well.
        yield from dataset.token_rows(indices)
        return
    for i in indices:
        sample = dataset[i]
        yield sample["input_ids"], sample["loss_mask"]
