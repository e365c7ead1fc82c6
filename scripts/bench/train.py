"""Head-training throughput (tokens/s) of each head type on a config's target.

    python -m scripts.bench.train [--config configs/demo-eagle3.yaml] [--steps 10] [--batch-size 4] [--online]
        [--pack]

Times what one training step costs the head alone: forward, loss (EAGLE-3's includes the target
lm_head over last_hidden), backward and an AdamW step, on real samples of the config's data. The
target's hidden states are captured once beforehand (as offline shards would hold them), so the
number is the trainer's ceiling on one process, without DeepSpeed's communication. ``--online`` also
times each step with the target's forward inside it (``train.online_capture``), side by side, and prints
the ratio: what training without shards costs per step against training from them. ``--pack`` also times the
same samples packed end to end in one row per batch (``train.pack``) against padded, side by side.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from transformers import PreTrainedModel

from headstart.core.config_files import load_config
from headstart.core.models import load_target
from headstart.core.runtime import resolve_dtype
from headstart.core.settings import parse
from headstart.core.timing import timed
from headstart.data_recipes.recipes import Sample, load_samples
from headstart.data_recipes.shards import pack_collate, pad_collate
from headstart.data_recipes.states import OnlineCapture, resolve_aux_layers
from headstart.heads import HEAD_TYPES, DraftHead, HeadOptions, build_head
from headstart.train.data import SampleDataset, fuses_layers
from headstart.train.train_config import TrainConfig


def head_options(cfg: TrainConfig, head_type: str, aux_layers: list[int]) -> HeadOptions:
    """The config's own head options when it trains this type, else the head's defaults."""
    options = cfg.head if cfg.head.type == head_type else HEAD_TYPES[head_type].head.options_of({"type": head_type})
    if fuses_layers(options):  # the captured layers
        options = options.model_copy(update={"layer_ids": aux_layers})
    return options


def step_batches(
    samples: list[Sample], batch_size: int, pad_id: int, capture: OnlineCapture
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """(token batches, the same with their captured states) of ``batch_size`` samples, as training collates
    them, on the target's device; a last partial batch is left out."""
    dataset = SampleDataset(samples)
    assert capture.model is not None, "the bench captures with a target loaded here"
    device = capture.model.device
    raw, batches = [], []
    for k in range(0, len(dataset) - batch_size + 1, batch_size):
        batch = pad_collate([dataset[i] for i in range(k, k + batch_size)], pad_id)
        raw.append({key: v.to(device) for key, v in batch.items()})
        batches.append(capture(raw[-1]))
    return raw, batches


def bench_head(spec: dict[str, Any], layers: list[int], target: PreTrainedModel) -> DraftHead:
    """A bench's head from ``spec``: head options, plus ``"attention": "fused"`` for ``train.attention``'s fused
    training-time-test attention (a training setting, set on the head as training sets it)."""
    options = {key: value for key, value in spec.items() if key != "attention"}
    head = build_head(options | {"layer_ids": layers}, target)
    head.fused_attention = spec.get("attention") == "fused"
    return head


def random_batch(
    vocab_size: int, hidden_size: int, layers: int, seq_len: int, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """One sample of ``seq_len`` random tokens, every one a label, with random captured states (``layers`` fused
    layers and the last hidden state): a head step's input at a shape, without running the target."""
    return {
        "input_ids": torch.randint(0, vocab_size, (1, seq_len), device=device),
        "attention_mask": torch.ones(1, seq_len, dtype=torch.long, device=device),
        "loss_mask": torch.ones(1, seq_len, dtype=torch.long, device=device),
        "aux_hidden": torch.randn(1, seq_len, layers * hidden_size, dtype=dtype, device=device),
        "last_hidden": torch.randn(1, seq_len, hidden_size, dtype=dtype, device=device),
    }


def packed(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A padded batch's samples end to end in one row (``train.pack``), their states too: a causal target's states
    of a right-padded row's real tokens are the sample's own."""
    lengths = batch["attention_mask"].sum(1).tolist()
    rows = [
        {key: value[i] if value.ndim == 1 else value[i, :n] for key, value in batch.items()}
        for i, n in enumerate(lengths)
    ]
    return pack_collate([{key: value for key, value in row.items() if key != "attention_mask"} for row in rows])


def bench(
    head: DraftHead,
    batches: list[dict[str, torch.Tensor]],
    steps: int,
    capture: OnlineCapture | None = None,
) -> float:
    """Tokens/s of head steps on ``batches``: their stored states, or (``capture``) states computed in the step."""
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4)

    def train_step(batch: dict[str, torch.Tensor]) -> None:
        loss, _ = head.loss(capture(batch) if capture is not None else batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    tokens, seconds = 0, 0.0
    for step in range(steps + 1):  # step 0 warms up (allocations, kernel choice) and is not timed
        batch = batches[step % len(batches)]
        _, step_s = timed(batch["input_ids"].device, train_step, batch)
        if step:
            seconds += step_s
            tokens += int(batch["attention_mask"].sum())
    return tokens / seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/demo-eagle3.yaml")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--heads", nargs="+", default=sorted(HEAD_TYPES), choices=sorted(HEAD_TYPES))
    parser.add_argument("--online", action="store_true", help="also time steps that run the target (online capture)")
    parser.add_argument("--pack", action="store_true", help="also time the batches packed in one row (train.pack)")
    args = parser.parse_args(argv)
    cfg = parse(load_config(args.config), TrainConfig, args.config)
    target, tokenizer = load_target(
        cfg.target.path, cfg.target.device, cfg.target.dtype, attention=cfg.target.attn_implementation
    )
    data = cfg.data
    samples, _ = load_samples(
        data.source, data.format, tokenizer, data.max_length, limit=args.batch_size * min(args.steps, 8)
    )
    aux_layers = resolve_aux_layers(cfg.capture.aux_layers, target.config.num_hidden_layers)
    store_dtype = resolve_dtype(cfg.capture.store_dtype)
    capture = OnlineCapture(target, aux_layers, store_dtype)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    raw, batches = step_batches(samples, args.batch_size, pad_id, capture)
    print(f"target {cfg.target.path} ({target.dtype}, {target.device}), batches of {args.batch_size} samples")
    if args.pack:
        real = sum(int(batch["attention_mask"].sum()) for batch in batches)
        print(
            f"padding: {1 - real / sum(batch['attention_mask'].numel() for batch in batches):.1%} of the padded slots"
        )
    for head_type in args.heads:
        torch.manual_seed(0)
        head = build_head(head_options(cfg, head_type, aux_layers), target)
        offline = bench(head, batches, args.steps)
        line = f"{head_type:>7}: {offline:,.0f} tokens/s from stored states"
        if args.online:
            online = bench(head, raw, args.steps, capture)
            line += f", {online:,.0f} tokens/s with the target in the step ({online / offline:.2f}x)"
        if args.pack:
            pack = bench(head, [packed(batch) for batch in batches], args.steps)
            line += f", {pack:,.0f} tokens/s packed ({pack / offline:.2f}x)"
        print(line)


if __name__ == "__main__":
    main()
