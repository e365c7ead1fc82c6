"""A Llama target carried into MiMo's layout with a fresh MTP layer in its checkpoint: a target whose outputs mean
something (the demo's) in a dense MTP family vLLM 0.32 serves (``mimo.py``, ``mimo_mtp.py``), for measuring what
fine-tuning its MTP layer gains (``scripts.bench.mtp_demo``).

    python -m scripts.bench.carry_mtp --target assets/demo-target --out runs/mtp-demo/target-carried

MiMo's decoder is Qwen2's: Llama's layer plus q/k/v biases. Zero biases add nothing, so the carried model computes
the Llama's very logits (``carried_logit_gap`` measures it). The layer names are the same in both, so the Llama's
tensors move as they are, in fp32 (exact from bf16), beside the zero biases and a fresh MTP layer: ``MtpHead``'s own
initialisation under the checkpoint's names, as a model whose MTP layer was never trained would hold it. Only the
config changes: Qwen2's, with ``architectures: [MiMoForCausalLM]`` and one MTP layer (``scripts.dev.tiny_mtp_targets``
says why MiMo is a Qwen2 config here).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config

from headstart.core.weights import checkpoint_folder
from headstart.heads.mtp import MtpHead

# The Llama settings a Qwen2 config takes over unchanged.
CARRIED_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
    "tie_word_embeddings", "attention_dropout", "pad_token_id", "bos_token_id", "eos_token_id",
)  # fmt: skip


def mimo_config(llama: LlamaConfig) -> Qwen2Config:
    """MiMo's config (Qwen2's, one MTP layer) for the Llama ``llama``; ValueError for what Qwen2's layer cannot
    hold: biases outside q/k/v, or a head size other than hidden_size / heads (vLLM's Qwen2 derives it)."""
    if llama.mlp_bias or llama.attention_bias:
        raise ValueError("a Llama with MLP or attention biases: Qwen2's layer has biases on q/k/v only")
    if llama.head_dim != llama.hidden_size // llama.num_attention_heads:
        raise ValueError(f"head_dim {llama.head_dim}: Qwen2 takes hidden_size / num_attention_heads")
    settings = {key: getattr(llama, key) for key in CARRIED_KEYS} | {"num_nextn_predict_layers": 1}
    return Qwen2Config(**settings, architectures=["MiMoForCausalLM"])


def zero_qkv_biases(llama: LlamaConfig) -> dict[str, torch.Tensor]:
    """The q/k/v biases Qwen2's layer has and the Llama's lacks, zero: they leave every output as it was."""
    head_dim = llama.hidden_size // llama.num_attention_heads
    kv_width = (llama.num_key_value_heads or llama.num_attention_heads) * head_dim
    widths = {"q_proj": llama.num_attention_heads * head_dim, "k_proj": kv_width, "v_proj": kv_width}
    return {
        f"model.layers.{i}.self_attn.{proj}.bias": torch.zeros(width)
        for i in range(llama.num_hidden_layers)
        for proj, width in widths.items()
    }


def fresh_mtp_layer(config: PretrainedConfig, seed: int) -> dict[str, torch.Tensor]:
    """An untrained MTP layer (``MtpHead``'s own initialisation, seeded) under the checkpoint's names."""
    torch.manual_seed(seed)
    head = MtpHead(MtpHead.make_config({"type": "mtp", "init": "random"}, config))
    return {head.family.checkpoint_name(name): tensor for name, tensor in head.state_dict().items()}


def carry_to_mimo(target: str | Path, out: str | Path, seed: int = 0) -> Path:
    """Write the Llama ``target`` to ``out`` in MiMo's layout, with a fresh MTP layer; the folder."""
    folder, out = checkpoint_folder(str(target)), Path(out)
    llama = AutoConfig.from_pretrained(folder)
    if not isinstance(llama, LlamaConfig):
        raise ValueError(f"{target} is a {llama.model_type} model: only a Llama is carried into MiMo's layout")
    config = mimo_config(llama)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors |= {name: tensor.float() for name, tensor in load_file(file).items()}
    tensors |= zero_qkv_biases(llama) | fresh_mtp_layer(config, seed)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())  # save_pretrained records the model class it knows
    (out / "config.json").write_text(json.dumps(saved | {"architectures": ["MiMoForCausalLM"]}, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for file in folder.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "generation_config")) or file.name.endswith(".jinja"):
            shutil.copy(file, out / file.name)
    return out


@torch.no_grad()
def carried_logit_gap(target: str | Path, carried: str | Path, input_ids: torch.Tensor | None = None) -> float:
    """The largest |difference| between the logits of ``target`` and of its carried copy on ``input_ids`` (fp32;
    None: two seeded random rows of 128 tokens)."""
    if input_ids is None:
        vocab = AutoConfig.from_pretrained(str(carried)).vocab_size
        input_ids = torch.randint(0, vocab, (2, 128), generator=torch.Generator().manual_seed(0))
    logits = []
    for folder in (target, carried):
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        logits.append(model(input_ids).logits)
    return (logits[0] - logits[1]).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="assets/demo-target", help="a Llama model folder")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0, help="the fresh MTP layer's")
    args = parser.parse_args()
    out = carry_to_mimo(args.target, args.out, args.seed)
    print(f"{out}: logits against {args.target}'s, max |diff| {carried_logit_gap(args.target, out):.3g}")


if __name__ == "__main__":
    main()
