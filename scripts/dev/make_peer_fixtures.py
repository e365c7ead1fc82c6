"""Write the peers' draft checkpoints committed under tests/fixtures/peers/, each by the peer's own published code.

    python3.11 -m venv /tmp/venv-eagle && /tmp/venv-eagle/bin/pip install ...   (each PROVENANCE.md lists the packages)
    /tmp/venv-eagle/bin/python scripts/dev/make_peer_fixtures.py eagle --out tests/fixtures/peers/eagle

Each peer is installed in a throwaway venv of its own (their pins exclude each other and the project's), so this file
imports nothing of headstart's and no peer at module level: the tests import ``tiny_target`` from it to rebuild the
target every fixture drafts for. The drafts are tiny (hidden 64), seeded, and built and saved through the peer's own
model classes and save functions; the exact calls are in each folder's PROVENANCE.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SEED = 0
# The target every fixture drafts for: a random Llama, hidden 64, eight layers (EAGLE-3's default aux layers
# (2, L // 2, L - 3) are then three distinct ones), a 256-token vocabulary.
TARGET: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
DRAFT_INTERMEDIATE = 96  # the drafts' own MLP width, unlike the target's: imports must read it from the draft


def tiny_target(seed: int = SEED) -> LlamaForCausalLM:
    """The fixtures' target, the same in any transformers version: every parameter drawn in name order from one torch
    generator (norms around 1), not by transformers' own initialisation, which changes between versions."""
    model = LlamaForCausalLM(LlamaConfig(**TARGET)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)
    return model


def save_target(out: Path) -> Path:
    """``tiny_target()`` as a model folder, sharded (an index file: the EAGLE repo reads the embedding through it)."""
    tiny_target().save_pretrained(out, max_shard_size="200KB")
    return out


REFERENCE = "reference.safetensors"
EAGLE3_LAYERS = [2, 4, 5]  # the engines' default aux layers for 8 target layers: what each EAGLE-3 fixture reads


def reference_inputs(target: LlamaForCausalLM) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(12 seeded token ids [1, 12], the target's hidden states over them): what each draft's logits are taken on."""
    ids = torch.randint(0, TARGET["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        return ids, target(ids, output_hidden_states=True).hidden_states


def save_reference(out: Path, ids: torch.Tensor, features: torch.Tensor, logits: torch.Tensor) -> None:
    """The peer's own step-0 draft logits at each position i (feature i paired with token i + 1), beside the inputs."""
    from safetensors.torch import save_file

    tensors = {"input_ids": ids, "features": features, "logits": logits}
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(out / REFERENCE))


def eagle_repo(out: Path, work: Path) -> list[str]:
    """EAGLE-1/2 through eagle-llm 1.2.1: its ``EConfig`` and ``Model`` (eagle/model/cnets.py) as its training script
    builds them (``Model(config, load_emb=True, path=basepath)``: the embedding read from the target's files), saved
    by ``accelerator.save_state`` as eagle/train/main.py saves every epoch."""
    from accelerate import Accelerator
    from eagle.model.cnets import Model
    from eagle.model.configs import EConfig

    target = save_target(work / "target")
    config = EConfig(**TARGET | {"num_hidden_layers": 1, "intermediate_size": DRAFT_INTERMEDIATE})
    torch.manual_seed(SEED)
    model = Model(config, load_emb=True, path=str(target))
    accelerator = Accelerator()
    model = accelerator.prepare(model)
    state = work / "state_0"
    accelerator.save_state(output_dir=str(state))
    out.mkdir(parents=True, exist_ok=True)
    weights = next(p for p in state.iterdir() if p.name.startswith(("model", "pytorch_model")))
    weights.rename(out / weights.name)
    config.save_pretrained(out)  # the config its training read (train_config["config_path"]), as EConfig writes it
    target_model = tiny_target()
    ids, states = reference_inputs(target_model)
    with torch.no_grad():  # its Model pairs feature i with token i + 1 (Model.generate drops the first token)
        logits = target_model.lm_head(model.eval()(hidden_states=states[-1][:, :-1], input_ids=ids[:, 1:]))
    save_reference(out, ids, states[-1], logits)
    return [
        "eagle.model.configs.EConfig(**draft_config)",
        "eagle.model.cnets.Model(config, load_emb=True, path=target_dir)",
        "accelerate.Accelerator().prepare(model); accelerator.save_state(output_dir)",
        "EConfig.save_pretrained(out)",
        "reference.safetensors: target.lm_head(Model(hidden_states=last_hidden[:, :-1], input_ids=ids[:, 1:]))",
    ]


def modelopt(out: Path, work: Path) -> list[str]:
    """EAGLE-3 through nvidia-modelopt 0.47.0: ``modelopt.torch.speculative.convert`` of the target with its
    ``EAGLE3_DEFAULT_CFG`` (the draft's layer shape set small), then ``modelopt.torch.export``'s
    ``export_speculative_decoding``, the export its examples deploy to vLLM and SGLang."""
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.export import export_speculative_decoding
    from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG

    target = tiny_target()
    config = json.loads(json.dumps(EAGLE3_DEFAULT_CFG["config"]))
    config["eagle_architecture_config"] |= {
        "intermediate_size": DRAFT_INTERMEDIATE,
        "num_attention_heads": TARGET["num_attention_heads"],
        "num_key_value_heads": TARGET["num_key_value_heads"],
        "head_dim": TARGET["hidden_size"] // TARGET["num_attention_heads"],
    }
    config["eagle_use_torch_compile"] = False  # no compiler on this CPU machine; the module is the same
    torch.manual_seed(SEED)
    mtsp.convert(target, [("eagle", config)])
    export_speculative_decoding(target, export_dir=out)
    save_reference(out, *modelopt_logits(target, out))
    return [
        "modelopt.torch.speculative.convert(target, [('eagle', EAGLE3_DEFAULT_CFG['config'] + small layer shape)])",
        "modelopt.torch.export.export_speculative_decoding(target, export_dir=out)",
        "reference.safetensors: target._eagle_forward(eagle_module.fc(aux[:, :-1]), embeddings of ids[:, 1:], "
        "_prepare_decoder_attention_mask(...)), eagle_module.rotary_emb rebuilt from the exported config.json",
    ]


def modelopt_logits(model: Any, exported: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, fused features, logits) of its converted model's draft, step 0, as its ``_prepare_eagle_inputs`` and
    ``_eagle_forward`` (speculative/plugins/hf_eagle.py) run it; with the rotary its export declares (its
    ``eagle_export_rope_scaling`` default adds YaRN to the config.json it writes, which vLLM applies), not the one
    it trained with: the draft as it is served."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    declared = LlamaConfig(**json.loads((exported / "config.json").read_text()))
    model.eagle_module.rotary_emb = LlamaRotaryEmbedding(config=declared)
    ids, states = reference_inputs(tiny_target())  # the converted model's own forward runs the draft too
    aux = torch.cat([states[i] for i in EAGLE3_LAYERS], dim=-1)
    with torch.no_grad():
        hidden = model.eagle_module.fc(aux[:, :-1])
        length = hidden.shape[1]
        mask = model._prepare_decoder_attention_mask(
            torch.ones(1, length, dtype=torch.bool), (1, length), 0, hidden.device, hidden.dtype
        )
        embeds = model._base_model_embeddings(ids[:, 1:])
        logits = model._eagle_forward(hidden, embeds, mask, torch.arange(length)[None])[2]
    return ids, aux, logits


def specforge(out: Path, work: Path) -> list[str]:
    """EAGLE-3 through specforge 0.2.0: its ``LlamaForCausalLMEagle3`` (modeling/draft/llama3_eagle.py) from a
    Llama draft config as its configs/ spell one, the embedding loaded from the target (``load_embedding``), its draft
    vocabulary mapped from token counts by its own ``process_token_dict_to_mappings`` and loaded with
    ``load_vocab_mapping``; saved as its SGLang exporter (export/to_sglang.py) saves a draft: the state without the
    embedding, checked by ``_serving_state``, ``save_pretrained``, then ``apply_legacy_rope_scaling``."""
    from collections import Counter

    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.export.checkpoint_io import apply_legacy_rope_scaling
    from specforge.export.to_sglang import _serving_state
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    target = save_target(work / "target")
    draft = TARGET | {"num_hidden_layers": 1, "intermediate_size": DRAFT_INTERMEDIATE, "draft_vocab_size": 128}
    config = LlamaConfig(**draft, architectures=["LlamaForCausalLMEagle3"])
    torch.manual_seed(SEED)
    model = LlamaForCausalLMEagle3(config).eval()
    model.load_embedding(str(target))
    # Token counts as a dataset's loss tokens would give them: ids 64..191 the most frequent.
    counts = Counter({i: 1000 - i for i in range(64, 192)} | {i: 1 for i in range(64)})
    d2t, t2d = process_token_dict_to_mappings(counts, draft["draft_vocab_size"], TARGET["vocab_size"])
    torch.save({"d2t": d2t, "t2d": t2d}, work / "vocab_mapping.pt")
    model.load_vocab_mapping(str(work / "vocab_mapping.pt"))
    state = {k: v for k, v in model.state_dict().items() if "embed" not in k.lower()}
    model.save_pretrained(out, state_dict=_serving_state(state, {}))
    apply_legacy_rope_scaling(str(out))
    ids, states = reference_inputs(tiny_target())
    aux = torch.cat([states[i] for i in EAGLE3_LAYERS], dim=-1)
    with torch.no_grad():  # one training-time-test step as its algorithms/eagle3/model.py runs it (sdpa)
        hidden = model.project_hidden_states(aux[:, :-1])
        length = hidden.shape[1]
        mask = model.prepare_decoder_attention_mask(
            attention_mask=torch.ones(1, length, dtype=torch.bool),
            hidden_states=hidden,
            batch_size=1,
            seq_length=length,
            past_key_values_length=0,
        )
        out_states = model.backbone(
            input_embeds=model.embed_input_ids(ids[:, 1:]),
            hidden_states=hidden,
            cache_hidden=[[], []],
            attention_mask=mask,
            position_ids=torch.arange(length)[None],
            past_key_values=None,
            use_cache=True,
        )
        save_reference(out, ids, aux, model.compute_logits(out_states))
    return [
        "specforge.modeling.draft.llama3_eagle.LlamaForCausalLMEagle3(LlamaConfig(**draft_config))",
        "model.load_embedding(target_dir)",
        "specforge.data.preprocessing.process_token_dict_to_mappings(counts, 128, 256); model.load_vocab_mapping(path)",
        "model.save_pretrained(out, state_dict=specforge.export.to_sglang._serving_state(state without embed, {}))",
        "specforge.export.checkpoint_io.apply_legacy_rope_scaling(out)",
        "reference.safetensors: compute_logits(backbone(embed_input_ids(ids[:, 1:]),"
        " project_hidden_states(aux[:, :-1]), prepare_decoder_attention_mask(...)))",
    ]


PEERS = {"eagle": eagle_repo, "modelopt": modelopt, "specforge": specforge}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("peer", choices=sorted(PEERS))
    parser.add_argument("--out", type=Path, required=True, help="the fixture folder (its PROVENANCE.md is kept)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/peer-fixtures-work"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    calls = PEERS[args.peer](args.out, args.work)
    print("\n".join(["wrote " + str(args.out), *calls]))


if __name__ == "__main__":
    main()
