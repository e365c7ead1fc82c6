"""EAGLE-3 heads <-> the EAGLE repo's layout (vLLM ``eagle3``, SGLang ``EAGLE3``) and the speculators format.

Matched against vllm 0.33.0, sglang 0.5.23 and speculators 0.9.0 (docs/EXPORT.md has the details):
- Weight names are ours already: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` (offsets), ``t2d``.
  vLLM ``llama_eagle3.py`` renames ``midlayer.`` to ``layers.0.`` and reads ``d2t`` as
  ``draft_id_to_target_id`` (target id = draft id + d2t); SGLang ``llama_eagle3.py`` does the same
  rename and keeps ``d2t + arange`` as its hot token ids. speculators names the layer ``layers.0.``.
- Layer ids. vLLM (``llama.py``: id idx+1 after layer idx) and speculators: id i is the residual stream
  entering decoder layer i = HF ``hidden_states[i]`` = our ``layer_ids``; vLLM reads the top-level
  ``eagle_aux_hidden_state_layer_ids`` first (``gpu_model_runner.py``). SGLang reads only
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` and captures id + 1 (``llama.py``
  ``set_eagle3_layers_to_capture``): its id is the decoder layer whose OUTPUT is taken, ours minus one.
  The folder carries both, so one export serves both engines.
- P-EAGLE (``parallel_drafting``), vllm 0.32.0: ``mask_hidden`` is loaded by any key containing it and viewed
  as [1, num_aux * target_hidden] (``llama_eagle3.py``, ``qwen3_eagle3.py``; it raises when parallel drafting
  is on and the key is missing); the mask token is the top-level ``mask_token_id`` (``pard_token`` and
  ``ptd_token_id`` are other names, ``llm_base_proposer.py``). Parallel drafting itself is a speculative-config
  field (``"parallel_drafting": true``), not a draft-config one. The embedding is the target's (shared by
  vLLM, as the head trains it frozen), unless the head has its own (``own_embedding``: ``embed_tokens.weight``).
  speculators' type ``peagle`` maps to method eagle3 with parallel drafting and its ``mask_token_id`` to
  ``pard_token`` (``transformers_utils/configs/speculators/`` ``base.py``, ``algos.py``). SGLang 0.5.23 has no
  parallel drafting (sgl-project/sglang#23171).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from headstart.core.models import default_aux_layers
from headstart.export.card import (
    code_block,
    reexport_command,
    served_schedule,
    served_steps,
    sglang_command,
    vllm_command,
)
from headstart.export.common import (
    arch_from_decoder,
    check_sglang_embedding,
    check_vllm_serves_family,
    decoder_config,
    dtype_name,
    read_checkpoint,
    read_json,
    rename_prefixes,
)
from headstart.export.layouts import EngineFiles, Imported, layout_name, not_written
from headstart.heads import WEIGHTS_NAME, HeadConfig, arch_from_target
from headstart.heads.eagle3 import drafts_in_parallel

LAYOUTS: tuple[str, ...] = ("vllm", "sglang", "speculators")
SOURCES: tuple[str, ...] = ("eagle3", "speculators")
FILES: tuple[str, ...] = (WEIGHTS_NAME,)
SERVED = True
REPO_ARCHITECTURE = "LlamaForCausalLMEagle3"  # vLLM registry.py and SGLang llama_eagle3.py EntryClass
# A layer with Qwen3's q/k norm: vLLM's qwen3_eagle3.py (registry.py; the speculators reader maps a qwen3
# transformer_layer_config to it, algos.py). SGLang has no such class: its EAGLE-3 drafts are Llama layers.
QK_NORM_ARCHITECTURE = "Eagle3Qwen3ForCausalLM"
SPECULATORS_VERSION = "0.9.0"
# The paper's layer keeps the un-normed feature as the residual, has no norm before fc and feeds the pre-norm output
# back; speculators' trainer turns on norm_before_residual, EAGLE-3.1 fc_norm and norm_output, gpt-oss heads
# norm_before_fc (``norm_flags``: the head's). The four are always written: vLLM defaults norm_before_residual to
# TRUE for speculators configs (algos.py).
NORM_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
DEFAULT_SPECULATIVE_TOKENS = 3
SPECULATOR_ARCHITECTURES = {"eagle3": "Eagle3Speculator", "peagle": "PEagleSpeculator"}  # speculators' models/


def norm_flags(config: HeadConfig) -> dict[str, bool]:
    """The four flags as the head has them (speculators' ``norm_before_residual``, EAGLE-3.1's ``fc_norm`` and
    ``norm_output``, gpt-oss's ``norm_before_fc``); their tensors ``input_norm.weight`` and ``fc_norm.{i}.weight``
    carry vLLM's and SGLang's names as they are."""
    options = config.options
    return {
        "norm_before_residual": bool(options.norm_before_residual),
        "norm_before_fc": bool(options.norm_before_fc),
        "fc_norm": options.fc_norm,
        "norm_output": options.norm_output,
    }


def mask_token_id(config: HeadConfig) -> int | None:
    """The P-EAGLE head's mask token; None for an EAGLE-3 head that drafts autoregressively."""
    parallel = config.options.parallel_drafting
    return None if parallel is None else parallel.mask_token_id


def _parallel_fields(config: HeadConfig) -> dict[str, Any]:
    token = mask_token_id(config)
    return {} if token is None else {"mask_token_id": token}


def _vocab_tensors(config: HeadConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop d2t/t2d when the draft vocab is the whole target vocab: vLLM then has no ``draft_id_to_target_id``
    parameter and a ``d2t`` in the checkpoint fails to load (llama_eagle3.py)."""
    if config.options.draft_vocab_size != config.vocab_size:
        return dict(state)
    if state["d2t"].any():
        raise ValueError("d2t has non-zero offsets although the draft vocab is the whole target vocab")
    return {k: v for k, v in state.items() if k not in ("d2t", "t2d")}


def refusal(fmt: str) -> str:
    return not_written("eagle3", fmt, LAYOUTS)


def export_files(
    config: HeadConfig, state: dict[str, torch.Tensor], fmt: str, target: str, target_config: PretrainedConfig
) -> EngineFiles:
    """The EAGLE repo's layout (vllm, sglang) or the speculators format."""
    check_vllm_serves_family(config, fmt, "export it with --format sglang")
    check_sglang_embedding(config, fmt)
    if fmt == "speculators":
        return EngineFiles(*speculators_layout(config, state, target, target_config))
    return EngineFiles(*repo_layout(config, state, fmt))


def extra_files(config: HeadConfig, state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {}


def repo_layout(config: HeadConfig, state: dict[str, torch.Tensor], fmt: str) -> tuple[dict[str, Any], dict]:
    """config.json + tensors in the EAGLE repo's layout, which vLLM and SGLang both load (``fmt``), but for
    a layer with q/k norm (Qwen3 targets), which only vLLM has."""
    qk_norm = config.arch.qk_norm
    if mask_token_id(config) is not None and fmt == "sglang":
        raise ValueError(
            "this is a P-EAGLE head (parallel_drafting), which SGLang 0.5.23 cannot draft (no parallel drafting: "
            "sgl-project/sglang#23171): export it with --format vllm or speculators"
        )
    if config.options.norm_before_residual and fmt == "sglang":
        raise ValueError(
            "this EAGLE-3 head sets norm_before_residual, which SGLang's LlamaForCausalLMEagle3 does not read (its "
            "residual is the un-normed feature): export it with --format vllm or speculators"
        )
    if qk_norm and fmt == "sglang":
        raise ValueError(
            "this EAGLE-3 head has Qwen3's q/k norm, which no SGLang EAGLE-3 draft has (SGLang serves "
            "LlamaForCausalLMEagle3 only): export it with --format vllm or speculators (vLLM's "
            "Eagle3Qwen3ForCausalLM), or train the head with draft_layer: llama for SGLang"
        )
    layer_ids = list(config.options.layer_ids)
    engine_config = {
        "architectures": [QK_NORM_ARCHITECTURE if qk_norm else REPO_ARCHITECTURE],
        **decoder_config(config.arch, dtype_name(state)),
        "draft_vocab_size": config.options.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        **norm_flags(config),
        "eagle_aux_hidden_state_layer_ids": layer_ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layer_ids], "use_aux_hidden_state": True},
        **_parallel_fields(config),
    }
    return engine_config, _vocab_tensors(config, state)


def speculators_layout(
    config: HeadConfig, state: dict[str, torch.Tensor], target: str, target_config: PretrainedConfig
) -> tuple[dict[str, Any], dict]:
    """config.json + tensors in speculators' Eagle3SpeculatorConfig layout (speculators/models/eagle3/config.py),
    as vLLM's ``SpeculatorsConfig`` reads it (transformers_utils/configs/speculators/)."""
    dtype = dtype_name(state)
    kind = "eagle3" if mask_token_id(config) is None else "peagle"
    engine_config = {
        "architectures": [SPECULATOR_ARCHITECTURES[kind]],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": decoder_config(config.arch, dtype),
        "draft_vocab_size": config.options.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.options.layer_ids),
        **norm_flags(config),
        **_parallel_fields(config),
        "speculators_config": {
            "algorithm": kind,
            # vLLM takes num_speculative_tokens from the first proposal method.
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    # P-EAGLE: every trained depth, all drafted in one forward.
                    "speculative_tokens": DEFAULT_SPECULATIVE_TOKENS if kind == "eagle3" else config.options.ttt_steps,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target, "architectures": list(target_config.architectures or [])},
        },
        "torch_dtype": dtype,
    }
    return engine_config, rename_prefixes(_vocab_tensors(config, state), {"midlayer.": "layers.0."})


def _layer_ids(engine_config: dict[str, Any], target_layers: int) -> list[int]:
    """Our layer ids from a published config: top-level ids (vLLM/speculators convention), else SGLang's
    ``eagle_config`` ids (+1), else the default both engines use (``default_aux_layers``)."""
    if engine_config.get("eagle_aux_hidden_state_layer_ids"):
        return list(engine_config["eagle_aux_hidden_state_layer_ids"])
    nested = (engine_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return [i + 1 for i in nested]
    return default_aux_layers(target_layers)


def _read_mask_token(engine_config: dict[str, Any]) -> int:
    """A P-EAGLE checkpoint's mask token, under any name vLLM reads (``llm_base_proposer.py``)."""
    for key in ("mask_token_id", "pard_token", "ptd_token_id"):
        if engine_config.get(key) is not None:
            return engine_config[key]
    raise ValueError(
        "this EAGLE-3 checkpoint has mask_hidden (P-EAGLE) but its config.json names no mask token "
        "(mask_token_id, pard_token or ptd_token_id)"
    )


def _read_norm_flags(engine_config: dict[str, Any], speculators: bool) -> dict[str, bool | None]:
    """The checkpoint's four norm flags as vLLM reads them (eagle_config first for norm_before_fc), as head
    options: ``norm_before_residual`` off is left unset (null), as a head trained without it saves it."""
    nested = engine_config.get("eagle_config") or {}
    # vLLM's default for a missing norm_before_residual: true for speculators configs, false otherwise.
    defaults = {**NORM_FLAGS, "norm_before_residual": speculators}
    flags = {k: nested.get(k, engine_config.get(k, defaults[k])) for k in NORM_FLAGS}
    flags["fc_norm"] = flags["fc_norm"] or engine_config.get("use_aux_norm", False)  # SGLang's older name
    options: dict[str, bool | None] = {key: bool(on) for key, on in flags.items()}
    options["norm_before_residual"] = options["norm_before_residual"] or None
    return options


def import_files(kind: str, src: Path, target_config: PretrainedConfig) -> Imported:
    """(head options, draft arch, our tensors) of an EAGLE-repo-layout (``eagle3``) or ``speculators`` EAGLE-3
    checkpoint."""
    engine_config, state, speculators = read_json(src / "config.json"), read_checkpoint(src), kind == "speculators"
    if speculators and engine_config.get("speculators_model_type") not in SPECULATOR_ARCHITECTURES:
        raise ValueError(
            f"speculators_model_type is {engine_config.get('speculators_model_type')!r}; only 'eagle3' and "
            "'peagle' map to a headstart head (speculators 0.9.0 has no EAGLE-1 type)"
        )
    norms = _read_norm_flags(engine_config, speculators)
    decoder = engine_config["transformer_layer_config"] if speculators else engine_config
    if decoder.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"the draft has {decoder['num_hidden_layers']} decoder layers; headstart's EAGLE-3 has one")
    layers = target_config.num_hidden_layers
    state = rename_prefixes(state, {"layers.0.": "midlayer."})
    # speculators' verifier_* copies of the target's norm and lm_head are training-only; its embed_tokens (a copy of
    # the target's, or trained) is for import_head to judge (common.keep_own_embedding).
    state = {k: v for k, v in state.items() if not k.startswith("verifier_")}
    draft_vocab = engine_config.get("draft_vocab_size") or state["lm_head.weight"].shape[0]
    if "d2t" not in state:
        if draft_vocab != target_config.vocab_size:
            raise ValueError(f"no d2t in the checkpoint although its draft vocab {draft_vocab} is not the target's")
        state["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
        state["t2d"] = torch.ones(draft_vocab, dtype=torch.bool)
    if "t2d" not in state:  # vLLM and SGLang ignore t2d; it is d2t's inverse
        t2d = torch.zeros(target_config.vocab_size, dtype=torch.bool)
        t2d[torch.arange(draft_vocab) + state["d2t"]] = True
        state["t2d"] = t2d
    state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    arch = arch_from_decoder(decoder, target_config)
    arch.qk_norm = "midlayer.self_attn.q_norm.weight" in state  # vLLM's Eagle3Qwen3ForCausalLM layer
    options = {"type": "eagle3", "layer_ids": _layer_ids(engine_config, layers), "draft_vocab_size": draft_vocab}
    options |= norms
    # "llama": a Qwen3 target's draft without q/k norm (SpecForge's, SGLang's); else the family's own layer.
    options["draft_layer"] = "target" if arch.qk_norm == arch_from_target(target_config).qk_norm else "llama"
    if "mask_hidden" in state:  # P-EAGLE: vLLM reads any shape of num_aux * target_hidden values
        state["mask_hidden"] = state["mask_hidden"].reshape(1, -1)
        options["parallel_drafting"] = {"mask_token_id": _read_mask_token(engine_config)}
    target_hidden = engine_config.get("target_hidden_size") or target_config.hidden_size
    if target_hidden != target_config.hidden_size:
        raise ValueError(f"target hidden size {target_hidden} vs {target_config.hidden_size} (checkpoint vs target)")
    return Imported(options, arch, state)


def parallel_depths(config: HeadConfig) -> int | None:
    """A P-EAGLE head's trained depths, all drafted in one forward; None for an autoregressive EAGLE-3 head."""
    return config.trained_depth if drafts_in_parallel(config.options) else None


def layout(fmt: str, short: bool = False) -> str:
    return layout_name(fmt, short)


def describe(config: HeadConfig) -> list[tuple[str, str]]:
    options = config.options
    rows = [
        ("target layers fused", f"{options.layer_ids} (HF `hidden_states` indices = vLLM aux layer ids)"),
        ("draft vocabulary", f"{options.draft_vocab_size} of the target's {config.vocab_size} tokens"),
    ]
    if options.own_embedding:
        rows.append(("embedding", "the draft's own (`embed_tokens.weight`), which vLLM serves for the target's"))
    norms = [name for name, on in norm_flags(config).items() if on]
    if norms:  # EAGLE-3.1's (fc_norm, norm_output), gpt-oss's norm_before_fc: config.json's flags say so to engines
        rows.append(("norms", ", ".join(f"`{name}`" for name in norms)))
    if options.parallel_drafting is not None:
        rows += [
            ("parallel depths", f"{options.ttt_steps}, drafted in one forward (`num_speculative_tokens` <= this)"),
            ("mask token", f"{options.parallel_drafting.mask_token_id} (the target's embedding of it)"),
        ]
    return rows


def serve(config: HeadConfig, fmt: str, target: str, draft: str, head_dir: str) -> str:
    """The EAGLE repo's layout serves both engines (layer ids written in each one's convention); P-EAGLE and
    the speculators format vLLM only."""
    depths, schedule, family = parallel_depths(config), served_schedule(head_dir), config.arch.family
    steps = served_steps(schedule)
    no_sglang = (
        "SGLang 0.5.23 cannot serve it: it has no parallel drafting (sgl-project/sglang#23171)."
        if depths
        else "SGLang 0.5.23 does not read the speculators format; export its layout with\n\n"
        + reexport_command(head_dir, "sglang", draft + "-sglang")
    )
    if fmt == "speculators":
        return (
            "vLLM reads the target from `speculators_config.verifier.name_or_path`:\n\n"
            + code_block(shlex.join(["vllm", "serve", draft]))
            + "\n\nor names it itself:\n\n"
            + code_block(vllm_command(target, draft, "eagle3", depths or steps, bool(depths), schedule, family))
            + f"\n\n{no_sglang}"
        )
    if depths:  # P-EAGLE: vLLM's eagle3 method with parallel drafting, one forward for all depths
        command = vllm_command(target, draft, "eagle3", depths, True, schedule, family)
        return "vLLM:\n\n" + code_block(command) + f"\n\n{no_sglang}"
    return (
        "vLLM:\n\n"
        + code_block(vllm_command(target, draft, "eagle3", steps, schedule=schedule, aux_family=family))
        + "\n\nSGLang:\n\n"
        + code_block(sglang_command(target, draft, "EAGLE3"))
    )
