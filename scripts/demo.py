"""The main job on the bundled default: ``make demo`` runs this.

    python -m scripts.demo --config configs/demo.yaml [key=value ...]

Loads the bundled target and draft from disk (no network) and prints a greedy chat completion from
each, with the tokens/s of plain autoregressive decoding: the baseline every head must beat.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from core.config import load_config
from core.runtime import resolve_device, resolve_dtype


def load_model(path: str, device: torch.device, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tokenizer


@torch.no_grad()
def chat(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: str, max_new_tokens: int
) -> dict[str, Any]:
    """Greedy completion of one user turn under the model's own chat template."""
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    ).to(model.device)
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    new_tokens = out[0, inputs["input_ids"].shape[1] :]
    return {
        "text": tokenizer.decode(new_tokens, skip_special_tokens=True),
        "tokens": len(new_tokens),
        "tokens_per_s": len(new_tokens) / seconds,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    device, dtype = resolve_device(cfg["device"]), resolve_dtype(cfg["dtype"])
    print(f"device {device}, dtype {dtype}")
    print(f"user: {cfg['prompt']}\n")
    for role in ("target", "draft"):
        model, tokenizer = load_model(cfg[role], device, dtype)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        reply = chat(model, tokenizer, cfg["prompt"], cfg["max_new_tokens"])
        print(f"--- {role} ({cfg[role]}, {params:.1f}M parameters) ---")
        print(reply["text"])
        print(f"[{reply['tokens']} tokens, {reply['tokens_per_s']:.1f} tokens/s, vanilla greedy decoding]\n")


if __name__ == "__main__":
    main()
