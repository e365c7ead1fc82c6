"""EAGLE-3: fuse three target layers, one decoder layer over (embedding, feature), a reduced draft vocab.

Weight names follow the EAGLE repo's layout (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``,
``t2d``), which vLLM (``llama_eagle3.py``, ``midlayer.`` -> ``layers.0.``) and SGLang load as-is.

The layer (EAGLE repo ``traineagle3/cnets.py``, SpecForge ``llama3_eagle.py``, vLLM's default
``norm_before_residual=False``): q/k/v read cat(input_layernorm(embedding), hidden_norm(feature))
(2H wide); the residual around attention is the feature itself, un-normed (option ``norm_before_residual``:
hidden_norm(feature), as speculators' trainer writes by default and vLLM's ``llama_eagle3.py`` serves it); then
the usual post_attention_layernorm + MLP residual. Its output, before ``norm``, is the feature fed to the
next draft step; ``lm_head(norm(output))`` gives draft-vocab logits.

Alignment: at step 0, position i pairs fc(aux_hidden_i) with the embedding of input_ids[i+1] at
rotary position i and predicts input_ids[i+2] (as EAGLE-1). Training-time test step j keeps index i
on the chain that started there: it pairs the head's own step-(j-1) output at i (its guess of the
feature at i+j) with the embedding of input_ids[i+j+1], at rotary position i+j, and predicts
input_ids[i+j+2]. The chain's attention is what drafting sees: the true prefix (step-0 keys 0..i)
plus its own keys from steps 1..j (``ttt_attention_mask``).

P-EAGLE (option ``parallel_drafting``): steps j >= 1 read the mask token and fc(``mask_hidden``), a
learned point in the fused target states' space, instead of (input_ids[i+j+1], the step-(j-1) output).
A step then depends on the earlier ones only through attention, with the same mask and rotary positions,
so the steps are one causal forward over [context pairs, next token, mask x (k-1)]: exactly what vLLM's
``parallel_drafting`` feeds the draft (``vllm/v1/spec_decode/utils.py`` ``copy_and_expand_eagle_inputs``;
``llama_eagle3.py`` loads ``mask_hidden`` [1, num_aux * target_hidden] and puts it through fc).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BeforeValidator
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig

from headstart.core.models import default_aux_layers
from headstart.core.settings import Count, Decay, NonNegative, Section
from headstart.heads.base import EmbeddingDrafter
from headstart.heads.head_config import DraftArch, FeatureOptions, HeadConfig, HeadOptions, HeadSettings, resolved
from headstart.heads.layers import MLP, Attention, KVCache, RMSNorm, RotaryEmbedding, StepKVCache, default_positions
from headstart.heads.losses import (
    acceptance_rate,
    batch_positions,
    draft_vocab_mass,
    label_mask,
    lk_loss,
    shift_left,
    soft_cross_entropy,
)
from headstart.heads.registry import Drafting, HeadType
from headstart.heads.sparse_attention import chunked, query_chunk
from headstart.heads.target import NORM_BEFORE_FC_FAMILIES, check_eagle_family


def default_mask_token(target_config: PretrainedConfig) -> int:
    """P-EAGLE's mask token when the head config names none: the target's pad token, else its (first) eos.

    Any id in the target's embedding serves: the head reads that embedding frozen, so every mask slot gets
    the same row, and vLLM does the same (it shares the target's embedding with a draft that ships none).
    What the head learns for the mask slots is ``mask_hidden``, the other half of the layer's input.
    """
    for name in ("pad_token_id", "eos_token_id"):
        token = getattr(target_config, name, None)
        token = token[0] if isinstance(token, list) and token else token
        if isinstance(token, int):
            return token
    raise ValueError(
        "the target's config has no pad_token_id or eos_token_id to draft P-EAGLE's mask slots with: "
        "set head.parallel_drafting.mask_token_id"
    )


def draft_vocab_rows(target_lm_head: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """The target lm_head's rows [draft_vocab, H] for the draft vocabulary's target ids: the lm_head a draft starts
    from and keeps when it does not train its own."""
    return target_lm_head.detach()[draft_ids.to(target_lm_head.device)]


def build_vocab_mapping(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft vocabulary = the ``draft_vocab_size`` most frequent target ids (ties: lower id), kept in id order.

    Returns ``d2t`` [draft_vocab] int64 OFFSETS (target id = draft id + d2t[draft id], as vLLM and SGLang
    read it) and ``t2d`` [V] bool, True for the target ids in the draft vocabulary.
    """
    vocab = token_counts.numel()
    size = min(draft_vocab_size, vocab)
    order = torch.argsort(token_counts.cpu(), descending=True, stable=True)
    kept = order[:size].sort().values
    d2t = kept - torch.arange(size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


class ParallelDrafting(Section):
    """P-EAGLE: present -> the EAGLE-3 head drafts its ``ttt_steps`` depths in ONE forward, as vLLM's
    ``parallel_drafting`` serves it: depth 1 reads the next token and the target's features as usual,
    depths 2.. read the mask token and the learned ``mask_hidden`` (heads/eagle3.py)."""

    mask_token_id: NonNegative | None = None  # null: the target's pad token, else its eos; recorded in the head


def _flag_as_section(value: Any) -> Any:
    # `parallel_drafting: true` (vLLM's spelling) is the section with its defaults; false is no section.
    return {} if value is True else None if value is False else value


class Eagle3Options(FeatureOptions):
    type: Literal["eagle3"] = "eagle3"
    # null: core.models.default_aux_layers, (2, L//2, L-3); the capture must use the same.
    layer_ids: list[NonNegative] | None = None
    draft_vocab_size: Count = 32000
    ttt_steps: Count = 7  # training-time-test depth
    ttt_decay: Decay = 0.8
    # "target": the target family's layer where vLLM has one (Qwen3: q/k norm, served as
    # Eagle3Qwen3ForCausalLM); "llama": a plain Llama layer, which every engine serves (SGLang included).
    draft_layer: Literal["target", "llama"] = "target"
    # An RMSNorm over the fused target states before fc (vLLM's and SGLang's norm_before_fc, input_norm.weight);
    # null: on for the families of heads.target.NORM_BEFORE_FC_FAMILIES (gpt-oss), off for the others.
    norm_before_fc: bool | None = None
    # EAGLE-3.1 (arXiv 2605.09992; vLLM's and SGLang's names): one RMSNorm per fused target layer before fc
    # (fc_norm.{i}.weight, after norm_before_fc's), and the post-norm output fed to the next step (norm_output).
    fc_norm: bool = False
    norm_output: bool = False
    # The residual around the draft layer's attention is the normed feature, hidden_norm(feature), instead of the
    # feature itself (vLLM's and speculators' norm_before_residual; speculators' trainer default). null: off, and
    # not written to config.json, so heads saved before the option existed read and save the same.
    norm_before_residual: bool | None = None
    # The draft-vocabulary lm_head is the target lm_head's rows for those tokens, frozen (speculators' EAGLE-3
    # trainer loads them and never trains them); off: its own, randomly initialised and trained. null: off, and not
    # written to config.json, so heads saved before the option existed read and save the same.
    frozen_lm_head: bool | None = None
    # P-EAGLE (true, or {mask_token_id: ...}); absent: EAGLE-3's autoregressive drafting.
    parallel_drafting: Annotated[ParallelDrafting | None, BeforeValidator(_flag_as_section)] = None

    def trained_depth(self) -> int:
        return self.ttt_steps

    def draft_vocab(self) -> int | None:
        return self.draft_vocab_size


class Eagle3Layer(nn.Module):
    """The ``midlayer``: attention over the normed (embedding, feature) pair, residual on the raw feature (on the
    normed one with ``norm_before_residual``: vLLM's ``_norm_before_residual``, speculators' ``Eagle3FirstLayerMixin``).

    Its attention follows the target family where vLLM has that family's EAGLE-3 layer: Qwen3's q/k
    norm (``qwen3_eagle3.py``, ``Eagle3Qwen3ForCausalLM``). Never q/k/v biases: vLLM and SGLang replace
    the layer's qkv projection by a 2H-wide one without (``llama_eagle3.py``, ``attention_bias`` false).
    """

    def __init__(self, arch: DraftArch, norm_before_residual: bool = False):
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = Attention(arch, 2 * hidden)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(arch)

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | StepKVCache | None = None,
    ) -> torch.Tensor:
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        x = residual + self.self_attn(torch.cat((self.input_layernorm(embeds), normed), dim=-1), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(EmbeddingDrafter):
    head_type = "eagle3"
    options_model = Eagle3Options
    shape_keys = (
        *EmbeddingDrafter.shape_keys,
        "arch.intermediate_size",
        "layer_ids",
        "draft_vocab_size",
        "parallel_drafting",
        "norm_before_fc",
        "fc_norm",
    )
    config: HeadConfig[Eagle3Options]
    d2t: torch.Tensor  # buffers (register_buffer): draft id -> target id offset, target id -> in the draft vocab
    t2d: torch.Tensor
    mask_hidden: nn.Parameter  # P-EAGLE only

    @classmethod
    def make_config(cls, settings: HeadSettings, target_config: PretrainedConfig) -> HeadConfig[Eagle3Options]:
        options = cls.options_of(settings)  # checked before the target's family: a wrong draft_layer says so first
        check_eagle_family(target_config, cls.head_type)
        config = super().make_config(options, target_config)
        options = config.options
        config.arch.qkv_bias = False  # see Eagle3Layer
        if options.draft_layer == "llama":
            config.arch.qk_norm = False
        layers = target_config.num_hidden_layers
        ids = options.layer_ids or default_aux_layers(layers)
        options.layer_ids = sorted(set(ids))
        if len(options.layer_ids) != 3:
            raise ValueError(
                f"EAGLE-3 fuses three distinct target layers, got {ids} for a {layers}-layer target: set layer_ids"
            )
        options.draft_vocab_size = min(options.draft_vocab_size, config.vocab_size)
        if options.norm_before_fc is None:
            options.norm_before_fc = target_config.model_type in NORM_BEFORE_FC_FAMILIES
        parallel = options.parallel_drafting  # its mask_hidden goes through the same norms and fc (first_features)
        if parallel is not None:
            if parallel.mask_token_id is None:
                parallel.mask_token_id = default_mask_token(target_config)
            if parallel.mask_token_id >= config.vocab_size:
                raise ValueError(
                    f"head.parallel_drafting.mask_token_id {parallel.mask_token_id} is not a token of the "
                    f"target's {config.vocab_size}-token vocabulary"
                )
        return config

    def __init__(self, config: HeadConfig[Eagle3Options]):
        super().__init__(config)
        arch, options = config.arch, config.options
        hidden, vocab, draft_vocab = arch.hidden_size, config.vocab_size, options.draft_vocab_size
        fused = len(resolved(options.layer_ids, "layer_ids")) * config.target_hidden_size
        if options.norm_before_fc:
            self.input_norm = RMSNorm(fused, arch.rms_norm_eps)
        if options.fc_norm:
            layers = len(resolved(options.layer_ids, "layer_ids"))
            self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, arch.rms_norm_eps) for _ in range(layers))
        self.fc = nn.Linear(fused, hidden, bias=False)
        if options.parallel_drafting is not None:
            # In the fused states' space, before fc, as vLLM loads it; randn like speculators' P-EAGLE.
            self.mask_hidden = nn.Parameter(torch.randn(1, fused))
        self.midlayer = Eagle3Layer(arch, bool(options.norm_before_residual))
        self.norm = RMSNorm(hidden, arch.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False).requires_grad_(not options.frozen_lm_head)
        self.rotary = RotaryEmbedding(arch)
        # Until set_vocab_mapping: the first draft_vocab target ids.
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(vocab) < draft_vocab)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The fused target layers (``hidden_states`` indices, ascending)."""
        return tuple(resolved(self.config.options.layer_ids, "layer_ids"))

    def picks_draft_vocab(self) -> bool:
        return True

    def set_vocab_mapping(self, token_counts: torch.Tensor) -> None:
        """Pick the draft vocabulary from target-token frequencies in the training data ([V] counts); a frozen
        lm_head takes the target's rows for it."""
        d2t, t2d = build_vocab_mapping(token_counts, self.config.options.draft_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        if self.config.options.frozen_lm_head:
            self.lm_head.weight.data.copy_(
                draft_vocab_rows(
                    self.target.lm_head.weight, self.target_ids(torch.arange(d2t.numel(), device=self.d2t.device))
                )
            )

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target-vocab ids of draft-vocab ids."""
        return draft_ids + self.d2t[draft_ids]

    def to_target_vocab(self, draft_scores: torch.Tensor) -> torch.Tensor:
        """[..., draft_vocab] -> [..., V]; target ids outside the draft vocabulary get -inf."""
        out = draft_scores.new_full((*draft_scores.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self.target_ids(torch.arange(self.d2t.numel(), device=self.d2t.device))] = draft_scores
        return out

    def first_features(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The head's step-0 features: fc over the fused target layers ``aux_hidden`` [B,S,3H] (ascending), normed
        first as a whole (``norm_before_fc``), then layer by layer (``fc_norm``), in vLLM's order
        (``combine_hidden_states``), which P-EAGLE's ``mask_hidden`` goes through too."""
        options = self.config.options
        fused = aux_hidden.to(self.fc.weight.dtype)
        if options.norm_before_fc:
            fused = self.input_norm(fused)
        if options.fc_norm:
            chunks = fused.chunk(len(self.fc_norm), dim=-1)
            fused = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(fused)

    def fed_back(self, out: torch.Tensor) -> torch.Tensor:
        """What the next drafting step reads of this step's output: the pre-norm output (EAGLE-3), or the
        post-norm one (EAGLE-3.1's ``norm_output``)."""
        return self.norm(out) if self.config.options.norm_output else out

    def mask_slots(self, batch: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """P-EAGLE's inputs at ``n`` mask slots: (the mask token [batch, n], fc(mask_hidden) [batch, n, H])."""
        parallel = self.config.options.parallel_drafting
        if parallel is None:
            raise ValueError("mask slots are P-EAGLE's: this EAGLE-3 head has no head.parallel_drafting")
        token = resolved(parallel.mask_token_id, "parallel_drafting.mask_token_id")
        ids = torch.full((batch, n), token, dtype=torch.long, device=self.mask_hidden.device)
        return ids, self.first_features(self.mask_hidden).expand(batch, n, -1)

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft-vocab logits [B,n,draft_vocab], the features the next step reads [B,n,H]: ``fed_back``)."""
        if position_ids is None:
            position_ids = default_positions(input_ids, cache)
        dtype = self.fc.weight.dtype
        cos, sin = self.rotary(position_ids, dtype)
        out = self.midlayer(self.embed(input_ids), features.to(dtype), cos, sin, mask, cache)
        return self.lm_head(self.norm(out)), self.fed_back(out)

    def ttt_features(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        steps: int,
        positions: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> Iterator[torch.Tensor]:
        """Yield the midlayer's output features [B,S,H] (before ``norm``) for training-time-test steps 0..steps-1.

        ``features`` are the step-0 inputs (``first_features``). All steps share one cache of keys, one set per
        step; step j attends sparsely to what ``ttt_step_mask`` (its block row of ``ttt_attention_mask``) lets it
        see (``heads.sparse_attention.ttt_attention``: memory linear in the length). P-EAGLE's
        steps 1.. read the mask slots (``mask_slots``) in place of the next token and the previous output. Where
        ``recomputes``, each step keeps only its inputs, output, keys and values, and runs again in backward.
        A packed row (``positions`` restarting per sample, ``segments`` [B, S] naming each position's sample) keeps
        every sample's attention within itself.
        """
        dtype = self.fc.weight.dtype
        positions = default_positions(input_ids) if positions is None else positions
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        recompute = self.recomputes(input_ids.shape[1])
        parallel = self.config.options.parallel_drafting is not None
        if parallel:
            mask_ids, mask_features = self.mask_slots(*input_ids.shape)

        def step(j: int, embeds: torch.Tensor, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            """(step j's output, its keys, its values): free of side effects, so recomputing it in backward is
            the same computation (the earlier steps' keys as they were then)."""
            cos, sin = self.rotary(positions + j, dtype)
            cache = StepKVCache(keys[:j], values[:j], segments, self.fused_attention)
            out = self.midlayer(embeds, inputs, cos, sin, cache=cache)
            return out, cache.keys[-1], cache.values[-1]

        for j in range(steps):
            if parallel and j > 0:
                ids, inputs = mask_ids, mask_features
            else:
                ids, inputs = shift_left(input_ids, j + 1), features
            args = (j, self.embed(ids), inputs)
            out, k, v = checkpoint(step, *args, use_reentrant=False) if recompute else step(*args)
            keys.append(k)
            values.append(v)
            yield out
            features = self.fed_back(out)

    def greedy_in_vocab(self, batch: dict[str, torch.Tensor], target_logits: torch.Tensor | None) -> torch.Tensor:
        """Bool [B, S]: whether the target's greedy token after each position is in the draft vocabulary (else the
        draft cannot match it)."""
        with torch.no_grad():
            greedy = self.target.greedy(batch["last_hidden"]) if target_logits is None else target_logits.argmax(-1)
            return self.t2d[greedy]

    def loss(
        self, batch: dict[str, torch.Tensor], target_logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Training-time-test loss: sum_j ttt_decay**j * soft cross-entropy to the target's draft-vocab distribution.

        P-EAGLE trains its ``ttt_steps`` parallel depths with the same weights: the acceptance length's
        sensitivity to depth j's accuracy falls with j (d tau / d a_j sums products over the depths >= j),
        so the geometric decay spends the draft's capacity where tau gains; speculators' and SpecForge's
        P-EAGLE weight depths equally (``ttt_decay: 1.0`` does that).

        (Soft cross-entropy is the forward KL plus the target's entropy: the same gradient.) With ``loss: lk``, each
        step's loss is the LK hybrid of its mean soft cross-entropy and its mean acceptance rate (``lk_loss``, the
        KL's weight set by that step's mean acceptance, as SpecForge weights it), the acceptance measured against
        the target's whole-vocabulary probabilities of the draft's tokens.

        Batch keys: ``input_ids``, ``loss_mask``, ``attention_mask``, ``aux_hidden``, and ``last_hidden``
        unless ``target_logits`` [B,S,V] (the target's logits at each position, soft-capped where it caps them:
        ``TargetParts.logits``) are given. Step j at index i
        is scored on the target's distribution at position i+j+1 (over input_ids[i+j+2]); it counts when that
        token is a label and, as in EAGLE-3, the target's argmax is in the draft vocab (else the draft cannot
        match it). Each step's loss is averaged over the positions with a label at that step. Metrics
        (detached 0-d tensors): loss_j (the soft cross-entropy) and acc_j (draft argmax == target argmax, over the
        same positions, out-of-vocab targets counting as misses) for each step j, and with ``loss: lk`` its mean
        acceptance rate acceptance_j.
        """
        options = self.config.options
        steps, (batch_size, seq) = options.ttt_steps, batch["input_ids"].shape
        features = self.first_features(batch["aux_hidden"])
        segments = batch.get("segment_ids")
        outs = list(self.ttt_features(features, batch["input_ids"], steps, batch_positions(batch), segments))
        labelled = torch.stack([label_mask(batch, j + 2) for j in range(steps)])  # [steps, B, S]
        in_vocab = self.greedy_in_vocab(batch, target_logits)
        counted = labelled & torch.stack([shift_left(in_vocab, j + 1, False) for j in range(steps)])
        draft_in_target = self.target_ids(torch.arange(self.d2t.numel(), device=self.d2t.device))
        # Positions per chunk: the chunk's target and draft logits over the draft vocabulary (k - 1 target rows more
        # for the later steps) within the score budget, so memory does not grow with it beyond one chunk.
        chunk = max(1, query_chunk(seq, len(draft_in_target), batch_size, features.device) - steps)
        lk = options.loss == "lk"

        def chunk_sums(start: int, end: int) -> torch.Tensor:
            """[3, steps]: each step's summed loss, count of agreeing argmaxes and (``lk``) summed acceptance rate
            over positions start..end-1."""
            rows = slice(start + 1, end + steps)  # the target's positions that steps 0..k-1 score
            with torch.no_grad():
                target_probs, on_draft = self.draft_vocab_targets(batch, target_logits, rows, draft_in_target, lk)
                padding = (0, 0, 0, end + steps - 1 - start - target_probs.shape[1])  # past the end
                target_probs = F.pad(target_probs, padding)
                on_draft = None if on_draft is None else F.pad(on_draft, padding)
            sums = []
            for j, out in enumerate(outs):
                logits = self.lm_head(self.norm(out[:, start:end]))
                target, scored = target_probs[:, j : j + end - start], counted[j, :, start:end]
                with torch.no_grad():
                    agree = (logits.argmax(-1) == target.argmax(-1)) & scored
                accepted = (
                    0.0
                    if on_draft is None
                    else (acceptance_rate(logits, on_draft[:, j : j + end - start]) * scored).sum()
                )
                loss = (soft_cross_entropy(logits, target) * scored).sum()
                sums.append(torch.stack((loss, agree.sum().float(), torch.as_tensor(accepted, device=loss.device))))
            return torch.stack(sums, 1)

        loss_sums, agree_sums, accepted_sums = chunked(chunk_sums, seq, chunk, dim=0).view(-1, 3, steps).sum(0)
        counts = labelled.flatten(1).sum(1).clamp(min=1)
        step_losses, acceptance = loss_sums / counts, accepted_sums / counts
        step_objectives = lk_loss(step_losses, acceptance, acceptance) if lk else step_losses
        weights = options.ttt_decay ** torch.arange(steps, device=step_losses.device, dtype=step_losses.dtype)
        metrics = {}
        for j in range(steps):
            metrics[f"loss_{j}"] = step_losses[j].detach()
            metrics[f"acc_{j}"] = (agree_sums[j] / counts[j]).detach()
            if lk:
                metrics[f"acceptance_{j}"] = acceptance[j].detach()
        return (weights * step_objectives).sum(), metrics

    def draft_vocab_targets(
        self,
        batch: dict[str, torch.Tensor],
        target_logits: torch.Tensor | None,
        rows: slice,
        draft_in_target: torch.Tensor,
        whole_vocab: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the target's distribution over the draft vocabulary, renormalised there [B, n, V_draft]: what the soft
        cross-entropy reads; its own probabilities of those tokens [B, n, V_draft]: what acceptance reads) at the
        positions ``rows``, from ``target_logits`` or ``last_hidden``. ``whole_vocab`` false: None for the second,
        and only the draft vocabulary's logits are computed."""
        if target_logits is None:
            hidden = batch["last_hidden"][:, rows]
            logits = self.target.logits(hidden) if whole_vocab else self.target.logits(hidden, draft_in_target)
        else:
            logits = target_logits[:, rows]
        draft_logits = logits[..., draft_in_target] if whole_vocab or target_logits is not None else logits
        target_probs = draft_logits.float().softmax(-1)
        if not whole_vocab:
            return target_probs, None
        return target_probs, target_probs * draft_vocab_mass(logits, draft_logits)


def drafts_in_parallel(options: HeadOptions) -> bool:
    """P-EAGLE: an EAGLE-3 head trained with ``parallel_drafting`` drafts every depth in one forward."""
    return isinstance(options, Eagle3Options) and options.parallel_drafting is not None


HEAD_TYPE = HeadType(
    name="eagle3",
    head=Eagle3Head,
    trainer="eagle",
    fuses_layers=True,
    drafting=Drafting("eagle3", "EAGLE-3"),
    variant=(
        drafts_in_parallel,
        Drafting(
            "peagle",
            "P-EAGLE",
            card_title="P-EAGLE (EAGLE-3, parallel drafting)",
            requires="with parallel_drafting",
        ),
    ),
)
