"""Tiny random targets of every family a serving engine drafts for, built from transformers' own config classes
(nothing downloaded): what makes each family different, at the smallest size that still shows it. The tests
(``tests/heads/test_target_families.py``) and the device check below share them.

    python -m scripts.dev.tiny_families --device cuda --dtype fp32 --out runs/gpu-check/families

checks on a device what CI checks on the CPU: for each family, speculative decoding with the n-gram proposer and
an EAGLE-3 head (untrained: its drafts are often rejected, which is what the rollback paths need) gives exactly
the target's own greedy output (``target.generate``); trees where one forward verifies them, chains over recurrent
layers. families.json under ``--out`` holds each family's result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers import models as hf

from headstart.core.io import atomic_write_text
from headstart.core.runtime import resolve_dtype

SHAPE = dict(hidden_size=32, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2)
WINDOW = 8  # shorter than the prompt plus its continuation: the sliding layers drop keys while decoding
EXPERTS = dict(num_experts_per_tok=2)
FAMILIES: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {  # model_type: (config class, what sets it apart)
    "qwen3_moe": (
        hf.qwen3_moe.Qwen3MoeConfig,
        dict(intermediate_size=64, moe_intermediate_size=32, num_experts=4, head_dim=16, **EXPERTS),
    ),
    "gpt_oss": (
        hf.gpt_oss.GptOssConfig,
        dict(
            intermediate_size=32,
            num_local_experts=4,
            head_dim=8,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 3,
            **EXPERTS,
        ),
    ),
    "deepseek_v3": (
        hf.deepseek_v3.DeepseekV3Config,
        dict(
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=4,
            first_k_dense_replace=1,  # a dense first layer: the draft's MLP width is its
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_group=1,
            topk_group=1,
            num_key_value_heads=4,
            **EXPERTS,
        ),
    ),
    "mistral": (hf.mistral.MistralConfig, dict(intermediate_size=64, sliding_window=WINDOW)),
    "gemma3_text": (
        hf.gemma3.Gemma3TextConfig,
        dict(
            intermediate_size=64,
            head_dim=8,
            sliding_window=WINDOW,
            layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2,
        ),
    ),
    "phi3": (hf.phi3.Phi3Config, dict(intermediate_size=64)),
    "qwen3_next": (
        hf.qwen3_next.Qwen3NextConfig,
        dict(
            intermediate_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=4,
            head_dim=16,
            layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            **EXPERTS,
        ),
    ),
    "granitemoehybrid": (
        hf.granitemoehybrid.GraniteMoeHybridConfig,
        dict(
            intermediate_size=64,
            shared_intermediate_size=64,
            num_local_experts=0,
            layer_types=["mamba", "mamba", "attention"] * 2,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_d_conv=4,
            mamba_expand=2,
            position_embedding_type="rope",
        ),
    ),
}
# Targets whose every layer routes to experts: no dense MLP to size the draft's from, so the head names its own.
EXPERTS_ONLY = ("qwen3_moe", "gpt_oss", "qwen3_next")
RECURRENT = ("qwen3_next", "granitemoehybrid")  # verified as chains (decoding.target_cache)


def family_config(family: str, **overrides: Any) -> PretrainedConfig:
    """The tiny config of ``family`` (``FAMILIES``), with ``overrides`` (vocab_size at least)."""
    config_cls, extra = FAMILIES[family]
    return config_cls(**{**SHAPE, "tie_word_embeddings": False, **extra, **overrides})


def tiny_target(family: str, vocab_size: int, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A random ``family`` target whose predictions are peaked (its lm_head scaled): greedy decoding is then far from
    ties, and a head has something to learn in a few steps."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, vocab_size=vocab_size, **overrides))
    model.get_output_embeddings().weight.data *= 30
    return model.eval()


def save_target(out: Path, family: str, tokenizer: PreTrainedTokenizerBase) -> None:
    """A tiny ``family`` target with ``tokenizer``'s vocabulary and special ids, saved with it in ``out``."""
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = tiny_target(family, len(tokenizer), pad_token_id=tokenizer.pad_token_id, **ids)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def check_family(family: str, device: torch.device, dtype: torch.dtype, new_tokens: int) -> dict[str, Any]:
    """Whether n-gram and EAGLE-3 speculative decoding of a tiny ``family`` target on ``device`` give its own greedy
    output, token for token; with the steps, tau and replays of each."""
    from headstart.decoding.proposers import NGram
    from headstart.decoding.proposers_eagle import Eagle
    from headstart.decoding.verify import Proposer, generate
    from headstart.heads import build_head

    target = tiny_target(family, VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    target.to(device=device, dtype=dtype)  # type: ignore[call-arg]  # transformers' decorator loses self
    target.generation_config.eos_token_id = None  # decode every token asked for, as ours does
    width = {"intermediate_size": 64} if family in EXPERTS_ONLY else {}
    head = build_head({"type": "eagle3", "layer_ids": [1, 3, 4], "draft_vocab_size": VOCAB, **width}, target)
    top_k, nodes = (1, 3) if family in RECURRENT else (3, 8)  # chains over recurrent layers
    prompt = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0)).to(device)
    # transformers types generate as a module attribute
    expected = target.generate(prompt, do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)  # type: ignore[operator]
    result: dict[str, Any] = {}
    proposers: dict[str, Proposer] = {"ngram": NGram(), "eagle3": Eagle(head.to(dtype).eval(), top_k, 3, nodes)}
    for name, proposer in proposers.items():
        start = time.perf_counter()
        got, stats = generate(target, proposer, prompt, new_tokens)
        result[name] = {
            "greedy_identical": bool(torch.equal(got, expected)),
            "tau": round(stats.tau, 3),
            "target_forwards": stats.target_forwards,
            "replay_forwards": stats.replay_forwards,
            "wall_s": round(time.perf_counter() - start, 3),
        }
    return result


VOCAB = 256  # random ids: no tokenizer needed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m scripts.dev.tiny_families", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--dtype", default="fp32", help="fp32 (token-exact) or bf16 (near-ties may differ)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, required=True, help="folder for families.json")
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), resolve_dtype(args.dtype)
    with torch.inference_mode():
        results = {family: check_family(family, device, dtype, args.new_tokens) for family in FAMILIES}
    passed = all(m["greedy_identical"] for methods in results.values() for m in methods.values())
    report = {"device": str(device), "dtype": args.dtype, "passed": passed, "families": results}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "families.json", json.dumps(report, indent=2) + "\n")
    for family, methods in results.items():
        print(
            family,
            " ".join(f"{m}: {'ok' if r['greedy_identical'] else 'DIFFERS'} tau {r['tau']}" for m, r in methods.items()),
        )
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
