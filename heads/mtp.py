"""Native multi-token prediction (MTP): the target's own MTP layer, borrowed from its checkpoint and fine-tuned
FastMTP-style (one layer applied recursively for ``steps`` draft steps).

The layer, as vLLM 0.32 serves it with ``method: mtp`` (``model_executor/models/mimo_mtp.py``,
``ernie_mtp.py``)::

    e = norm_e(embed(token i + 1)), zeroed at rotary position 0 ("masking inputs at position 0")
    h = norm_h(feature i)            step 0: the target's last hidden state, after its final norm (what vLLM's
                                     target model returns and ``lm_head`` reads: our shards' ``last_hidden``)
    x = proj(cat(e, h))              MiMo concatenates (h, e): ``MtpFamily.embed_first``
    out = the family's dense decoder layer (x) at rotary position i
    MiMo: out = final_layernorm(out); ERNIE-4.5 has no norm there
    logits = the target's lm_head(out); the next step reads out as its feature

The embedding and lm_head are the target's own (both families share them: vLLM loads them from the target's
tensors), so they are borrowed frozen, like every head's. vLLM drafts every step past the first with the same layer
(``spec_step_idx`` stays 0: ``v1/spec_decode/llm_base_proposer.py``), feeding back what the layer returns, so one
layer applied recursively is both what FastMTP trains and what the engine serves.

Alignment is EAGLE's: step j at index i reads (step j - 1's output at i, the embedding of input_ids[i + j + 1]) at
rotary position i + j and predicts input_ids[i + j + 2]; step j's attention is the chain's (the true prefix's keys
from step 0 and its own from steps 1..j: ``heads.sparse_attention.ttt_attention``), what drafting sees.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from headstart.core.settings import Count, Decay
from headstart.core.weights import read_named
from headstart.heads.base import FeatureDrafter, Head
from headstart.heads.head_config import HeadConfig, HeadOptions, HeadSettings, resolved
from headstart.heads.layers import DecoderLayer, KVCache, RMSNorm, RotaryEmbedding, StepKVCache, default_positions
from headstart.heads.losses import batch_positions, label_mask, shift_left, soft_cross_entropy
from headstart.heads.registry import Drafting, HeadType
from headstart.heads.sparse_attention import chunked, query_chunk
from headstart.heads.target import dense_mlp_width


@dataclass(frozen=True)
class MtpFamily:
    """A target family whose checkpoint carries an MTP layer vLLM serves: how to recognise its config, where its
    checkpoint keeps the layer's parts, and how the layer combines them (read from vLLM's ``*_mtp.py``)."""

    name: str
    architectures: tuple[str, ...]  # the target's config.architectures[0] that vLLM maps to this MTP model
    model_types: tuple[str, ...]  # or its model_type
    vllm_model: str  # the vLLM file that serves it
    parts: dict[str, str]  # our part -> its checkpoint prefix ("{i}": the MTP layer's index, 0 for the first)
    embed_first: bool  # cat(embedding, hidden) into the projection; False: cat(hidden, embedding)
    final_norm: bool  # a norm over the layer's output before lm_head (and before it is fed back)
    qkv_bias: bool  # the decoder layer's q/k/v biases (MiMo's is Qwen2's)

    def checkpoint_name(self, ours: str, index: int = 0) -> str:
        """The checkpoint's name of our tensor ``ours`` (``layer.self_attn.q_proj.weight``)."""
        part, _, rest = ours.partition(".")
        return self.parts[part].format(i=index) + "." + rest

    def our_name(self, theirs: str, index: int = 0) -> str | None:
        """Our name of the checkpoint's tensor ``theirs``, None where it is not part of MTP layer ``index``."""
        for part, prefix in self.parts.items():
            prefix = prefix.format(i=index) + "."
            if theirs.startswith(prefix):
                return f"{part}.{theirs[len(prefix) :]}"
        return None


MTP_FAMILIES = {
    family.name: family
    for family in (
        MtpFamily(
            name="mimo",
            architectures=("MiMoForCausalLM",),
            model_types=("mimo",),
            vllm_model="mimo_mtp.py",
            parts={
                "enorm": "model.mtp_layers.{i}.token_layernorm",
                "hnorm": "model.mtp_layers.{i}.hidden_layernorm",
                "eh_proj": "model.mtp_layers.{i}.input_proj",
                "final_norm": "model.mtp_layers.{i}.final_layernorm",
                "layer": "model.mtp_layers.{i}",  # the Qwen2 layer's own names, without vLLM's mtp_block
            },
            embed_first=False,
            final_norm=True,
            qkv_bias=True,
        ),
        MtpFamily(
            name="ernie",
            architectures=("Ernie4_5_MoeForCausalLM",),
            model_types=("ernie4_5_moe",),
            vllm_model="ernie_mtp.py",
            parts={
                "enorm": "model.mtp_emb_norm.{i}",
                "hnorm": "model.mtp_hidden_norm.{i}",
                "eh_proj": "model.mtp_linear_proj.{i}",
                "layer": "model.mtp_block.{i}",  # vLLM's LlamaDecoderLayer (neox rotary, no biases)
            },
            embed_first=True,
            final_norm=False,
            qkv_bias=False,
        ),
    )
}


def mtp_family(target_config: PretrainedConfig) -> MtpFamily:
    """The MTP family of the target (as vLLM picks it: its architecture, else its model_type); ValueError naming
    the families served otherwise."""
    architecture = (getattr(target_config, "architectures", None) or [""])[0]
    for family in MTP_FAMILIES.values():
        if architecture in family.architectures or target_config.model_type in family.model_types:
            return family
    served = "; ".join(f"{f.name} ({', '.join(f.architectures)}: vLLM's {f.vllm_model})" for f in MTP_FAMILIES.values())
    raise ValueError(
        f"no MTP family for a {target_config.model_type} target ({architecture or 'no architectures'}): "
        f"MTP heads are the MTP layers of {served}"
    )


class MtpOptions(HeadOptions):
    type: Literal["mtp"] = "mtp"
    # Draft steps training applies the one layer for (FastMTP's recursive steps), weighted step_decay**j, normalised.
    steps: Count = 3
    step_decay: Decay = 0.6
    # Where the layer's starting weights come from: the target checkpoint's own MTP layer, or a fresh random layer
    # (a target whose checkpoint has none, trained first as the family's pretraining would).
    init: Literal["checkpoint", "random"] = "checkpoint"
    family: str | None = None  # null: the target's (mtp_family); recorded in the head

    def trained_depth(self) -> int:
        return self.steps


class MtpHead(FeatureDrafter):
    head_type = "mtp"
    options_model = MtpOptions
    shape_keys = (*FeatureDrafter.shape_keys, "arch.intermediate_size", "family")
    config: HeadConfig[MtpOptions]

    @classmethod
    def make_config(cls, settings: HeadSettings, target_config: PretrainedConfig) -> HeadConfig[MtpOptions]:
        options = cast(MtpOptions, cls.options_of(settings))
        family = mtp_family(target_config)
        if options.family not in (None, family.name):
            raise ValueError(f"head.family {options.family!r}: this target's MTP family is {family.name!r}")
        options.family = family.name
        config = super().make_config(options, target_config)
        # The MTP layer is dense in both families, as wide as the target's dense MLP (ERNIE's intermediate_size beside
        # its experts' moe_intermediate_size).
        config.arch.intermediate_size = dense_mlp_width(target_config) or target_config.intermediate_size
        config.arch.qkv_bias, config.arch.qk_norm = family.qkv_bias, False
        return config

    @property
    def family(self) -> MtpFamily:
        return MTP_FAMILIES[resolved(self.config.options.family, "family")]

    def __init__(self, config: HeadConfig[MtpOptions]):
        super().__init__(config)
        arch = config.arch
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = DecoderLayer(arch)
        if self.family.final_norm:
            self.final_norm = RMSNorm(hidden, eps)
        self.rotary = RotaryEmbedding(arch)

    @classmethod
    def build(
        cls: type[Head],
        settings: HeadSettings,
        target_model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> Head:
        """The head with the target checkpoint's own MTP layer (``init: checkpoint``), or a fresh one."""
        head = super().build(settings, target_model, tokenizer)
        assert isinstance(head, MtpHead)
        if head.config.options.init == "checkpoint":
            head.load_checkpoint_layer(target_model.config._name_or_path)
        return head

    def checkpoint_names(self) -> dict[str, str]:
        """Our tensor name -> the target checkpoint's, for the first MTP layer (the one vLLM serves recursively)."""
        return {ours: self.family.checkpoint_name(ours) for ours in self.state_dict()}

    def load_checkpoint_layer(self, target: str) -> None:
        """Copy the MTP layer's tensors from the target checkpoint ``target`` (a folder or a cached hub id)."""
        names = self.checkpoint_names()
        tensors = read_named(target, list(names.values()))
        self.load_state_dict({ours: tensors[theirs] for ours, theirs in names.items()})

    def first_features(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Step 0's features: the target's last hidden state, after its final norm."""
        return last_hidden.to(self.eh_proj.weight.dtype)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Target-vocab logits (fp32) of the layer's output, through the target's frozen lm_head."""
        return self.target.logits(out).float()

    def layer_output(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | StepKVCache | None = None,
    ) -> torch.Tensor:
        """The MTP layer's output [B, n, H] (normed where the family norms it): what lm_head and the next step read."""
        dtype = self.eh_proj.weight.dtype
        embeds = self.target.embed(input_ids).to(dtype).masked_fill((position_ids == 0)[..., None], 0)
        pair = (self.enorm(embeds), self.hnorm(features.to(dtype)))
        x = self.eh_proj(torch.cat(pair if self.family.embed_first else pair[::-1], dim=-1))
        cos, sin = self.rotary(position_ids, dtype)
        out = self.layer(x, cos, sin, mask, cache)
        return self.final_norm(out) if self.family.final_norm else out

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, n, V], the features the next step reads [B, n, H])."""
        if position_ids is None:
            position_ids = default_positions(input_ids, cache)
        out = self.layer_output(input_ids, features, position_ids, mask, cache)
        return self.logits(out), out

    def step_outputs(
        self, features: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor | None
    ) -> Iterator[torch.Tensor]:
        """The layer's outputs [B, S, H] for draft steps 0..steps-1, each step reading the one before (FastMTP's
        recursion), attending as drafting does (``StepKVCache``); recomputed in backward where ``recomputes``."""
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        recompute = self.recomputes(input_ids.shape[1])

        def step(j: int, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            cache = StepKVCache(keys[:j], values[:j], segments, self.fused_attention)
            out = self.layer_output(shift_left(input_ids, j + 1), inputs, positions + j, cache=cache)
            return out, cache.keys[-1], cache.values[-1]

        for j in range(self.config.options.steps):
            out, k, v = checkpoint(step, j, features, use_reentrant=False) if recompute else step(j, features)
            keys.append(k)
            values.append(v)
            yield out
            features = out

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """FastMTP's loss: sum_j w_j * soft cross-entropy of step j to the target's distribution at i + j + 1, with
        w_j = step_decay**j normalised to sum to 1; each step's loss averaged over the positions whose label
        input_ids[i + j + 2] exists. Metrics: loss_j and acc_j (the draft's argmax is the target's) per step.

        Batch keys: ``input_ids``, ``loss_mask``, ``attention_mask``, ``last_hidden``."""
        steps, (batch_size, seq) = self.config.options.steps, batch["input_ids"].shape
        last_hidden = batch["last_hidden"]
        features = self.first_features(last_hidden)
        outs = list(self.step_outputs(features, batch["input_ids"], batch_positions(batch), batch.get("segment_ids")))
        labelled = torch.stack([label_mask(batch, j + 2) for j in range(steps)])  # [steps, B, S]
        vocab = self.config.vocab_size
        chunk = max(1, query_chunk(seq, vocab, batch_size, features.device) - steps)

        def chunk_sums(start: int, end: int) -> torch.Tensor:
            """[2, steps]: each step's summed loss and count of agreeing argmaxes over positions start..end-1."""
            with torch.no_grad():
                rows = last_hidden[:, start + 1 : end + steps]  # the target's positions steps 0..k-1 score
                target = self.target.logits(rows).float().softmax(-1)
                target = nn.functional.pad(target, (0, 0, 0, end + steps - 1 - start - target.shape[1]))
            sums = []
            for j, out in enumerate(outs):
                logits = self.logits(out[:, start:end])
                probs, scored = target[:, j : j + end - start], labelled[j, :, start:end]
                with torch.no_grad():
                    agree = (logits.argmax(-1) == probs.argmax(-1)) & scored
                sums.append(torch.stack(((soft_cross_entropy(logits, probs) * scored).sum(), agree.sum().float())))
            return torch.stack(sums, 1)

        loss_sums, agree_sums = chunked(chunk_sums, seq, chunk, dim=0).view(-1, 2, steps).sum(0)
        counts = labelled.flatten(1).sum(1).clamp(min=1)
        step_losses = loss_sums / counts
        weights = self.config.options.step_decay ** torch.arange(steps, device=step_losses.device, dtype=torch.float)
        metrics = {}
        for j in range(steps):
            metrics[f"loss_{j}"] = step_losses[j].detach()
            metrics[f"acc_{j}"] = (agree_sums[j] / counts[j]).detach()
        return (weights / weights.sum() * step_losses).sum(), metrics


HEAD_TYPE = HeadType(
    name="mtp",
    head=MtpHead,
    trainer="eagle",
    fuses_layers=False,
    drafting=Drafting("mtp", "MTP", card_title="MTP (the target's own multi-token-prediction layer)"),
)
