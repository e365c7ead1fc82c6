"""``DraftHead``: what every head shares (its typed config, the parts borrowed from the target, build,
save and load), and a head folder's files: ``config.json`` (``heads.head_config``) + ``model.safetensors``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar, TypeVar

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from headstart.core.fingerprint import tokenizer_hash
from headstart.core.io import atomic_dir
from headstart.core.weights import first_names
from headstart.heads.head_config import (
    CONFIG_NAME,
    HeadConfig,
    HeadOptions,
    HeadSettings,
    LayerOptions,
    parse_section,
    read_head_config,
    write_head_config,
)
from headstart.heads.layers import KVCache
from headstart.heads.target import (
    TargetParts,
    arch_from_target,
    check_compatible,
    check_tokenizer,
    draft_mlp_width,
    draft_target_config,
    target_parts,
)

WEIGHTS_NAME = "model.safetensors"
SHOWN_PROBLEMS = 6  # tensor problems named in an error; a wrong layer count can miss dozens
# From this many tokens per sample, training recomputes a head's drafting steps in backward by default: below it the
# steps' activations are small beside the rest of a step, above it they are most of its memory (docs/TRAINING.md,
# "Long sequences"), and recomputing them costs one more forward of the draft layer per step.
RECOMPUTE_FROM = 4096
Head = TypeVar("Head", bound="DraftHead")
Embedder = TypeVar("Embedder", bound="EmbeddingDrafter")


def state_problems(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Every missing, unexpected and wrongly shaped tensor of ``got`` against ``expected``, in words."""
    problems = [f"missing {k}" for k in sorted(expected.keys() - got.keys())]
    problems += [f"unexpected {k}" for k in sorted(got.keys() - expected.keys())]
    for k in sorted(expected.keys() & got.keys()):
        if got[k].shape != expected[k].shape:
            problems.append(f"{k} has shape {tuple(got[k].shape)}, expected {tuple(expected[k].shape)}")
    return problems


class NonFiniteWeights(ValueError):
    """A head tensor holding NaN or infinity: such a head drafts garbage while every name and shape check passes
    (and can even look lossless: the target's verification keeps the output right), so it is refused wherever a
    head's tensors are read (load, import, export, push)."""


def check_finite(state: Mapping[str, torch.Tensor], where: str | Path) -> None:
    """NonFiniteWeights naming ``where`` (the file or checkpoint) and each tensor of ``state`` that holds a NaN or an
    infinity, with how many; one ``isfinite`` pass over each floating tensor, once per load."""
    bad = [(name, t) for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        said = [f"{name} ({int(t.isnan().sum())} NaN, {int(t.isinf().sum())} inf of {t.numel()})" for name, t in bad]
        raise NonFiniteWeights(
            f"{where}: tensors holding NaN or infinity: {first_names(said)}; a head with non-finite weights drafts "
            "garbage: train it again, or take it from a checkpoint before the weights diverged"
        )


def load_head_weights(head: DraftHead, head_dir: str | Path, device: torch.device) -> nn.Module:
    """Load the saved tensors into ``head`` and move it to ``device`` in the dtype it was saved in.

    Names and shapes are compared first: weights that do not fit the config.json (edited by hand, or another
    head's) would end in torch's size-mismatch or missing-key error, which names neither the folder nor the
    setting; this names both, with the config's values the shapes follow from. Then every value must be
    finite (``check_finite``).
    """
    path = Path(head_dir) / WEIGHTS_NAME
    state = load_file(str(path))
    problems = state_problems(head.state_dict(), state)
    if problems:
        more = f"; and {len(problems) - SHOWN_PROBLEMS} more" if len(problems) > SHOWN_PROBLEMS else ""
        raise ValueError(
            f"{path} does not fit {Path(head_dir) / CONFIG_NAME} ({head.shape_settings()}): "
            + "; ".join(problems[:SHOWN_PROBLEMS])
            + more
        )
    check_finite(state, path)
    head.load_state_dict(state, strict=True)
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    return head.to(device=device, dtype=dtype)


class DraftHead(nn.Module):
    """What every head shares: its config, the borrowed target parts, build/save/load.

    Subclasses set ``head_type`` and ``options_model`` (the head's options model, declared beside it, where
    the options' defaults and ranges live) and take the full config (``make_config``'s output) in ``__init__``.
    """

    head_type: ClassVar[str]
    options_model: ClassVar[type[HeadOptions]]
    # The config.json keys the tensors' shapes follow from ("arch.<key>" under arch), named when weights do not fit.
    shape_keys: ClassVar[tuple[str, ...]] = ("target_hidden_size", "vocab_size")
    # Parameters (by a part of their names) that stay with AdamW when training with Muon (train/optimizers.py), beside
    # the embedding-like and vocabulary matrices that always do: the default of ``train.muon_exclude``.
    adamw_under_muon: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self._target: TargetParts | None = None
        # Training's activation recomputation of the head's drafting steps (``train.checkpoint_steps``; True, False
        # or None: from RECOMPUTE_FROM tokens per sample). Not part of the head: never saved.
        self.checkpoint_steps: bool | None = None
        # Training's attention kernel (``train.attention: fused``; heads.sparse_attention): not saved either.
        self.fused_attention = False
        # The share of training's steps done, set by the loop before each step (1 outside training): what a loss
        # curriculum reads (Domino's lambda_base). Not saved either.
        self.training_progress = 1.0

    def recomputes(self, seq_len: int) -> bool:
        """Whether a training step over samples of ``seq_len`` tokens recomputes its drafting steps in backward."""
        if self.checkpoint_steps is None:
            return seq_len >= RECOMPUTE_FROM
        return self.checkpoint_steps

    @property
    def target(self) -> TargetParts:
        """The target's embeddings and lm_head the head borrows (``attach``)."""
        if self._target is None:
            raise RuntimeError(
                f"this {self.head_type} head is not attached to a target: make it with build_head or load_head, "
                "or call head.attach(target_model) first"
            )
        return self._target

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target's ``hidden_states`` the head reads: by default the last one (after the final norm,
        what ``lm_head`` reads)."""
        return (self.config.arch.num_hidden_layers,)

    @classmethod
    def options_of(cls, settings: HeadSettings) -> HeadOptions:
        """This head type's options, a fresh copy (``make_config`` fills in what the user left unset): ``settings``
        is a config's validated ``head:`` section, or the options as a mapping (``{"type": "eagle3", ...}``)."""
        if isinstance(settings, HeadOptions):
            if not isinstance(settings, cls.options_model):
                raise ValueError(f"{settings.type} head options given to a {cls.head_type} head")
            return settings.model_copy(deep=True)
        options = {k: v for k, v in settings.items() if k != "type"}
        known = sorted(set(cls.options_model.model_fields) - {"type"})
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown {cls.head_type} head options {unknown}; known: {known}")
        return parse_section(cls.options_model, {**options, "type": cls.head_type}, f"{cls.head_type} head")

    @classmethod
    def make_config(cls, settings: HeadSettings, target_config: PretrainedConfig) -> HeadConfig:
        """The config of a fresh head: ``settings``' options (``options_of``) for this target."""
        options, arch = cls.options_of(settings), arch_from_target(target_config)
        if isinstance(options, LayerOptions):  # the head builds a draft layer: its MLP needs a width
            arch.intermediate_size = draft_mlp_width(target_config, options.intermediate_size, cls.head_type)
        return HeadConfig(
            options=options,
            target=getattr(target_config, "_name_or_path", "") or None,
            target_hidden_size=target_config.hidden_size,
            vocab_size=target_config.vocab_size,
            arch=arch,
        )

    @classmethod
    def check_fits(cls, config: HeadConfig, target_config: PretrainedConfig, where: str | Path) -> None:
        """Refuse a saved config (``where``: its config.json) that does not fit this target or that this head's
        build would not make for it: ``check_compatible``, then ``make_config``'s own rules (the target family,
        the layer ids, the mask token, ...) run again on the saved options, which must come back unchanged.

        Loading, export and import all check a head this way: a config.json edited by hand (or from elsewhere)
        meets the same rules as a head being built, and fails naming the file, the key and its value.
        """
        target_config = draft_target_config(target_config)
        try:
            check_compatible(config, target_config, cls.head_type)
            built = cls.make_config(config.options, target_config).options
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        except NotImplementedError as err:  # the target's family (check_eagle_family)
            raise NotImplementedError(f"{where}: {err}") from None
        saved, remade = config.options.model_dump(), built.model_dump()
        # An option the file leaves unset (a head saved before the option existed) is the one the build makes.
        changed = [
            f"{k} {saved[k]!r} (a build for this target makes {remade[k]!r})"
            for k in saved
            if saved[k] is not None and saved[k] != remade[k]
        ]
        if changed:
            raise ValueError(f"{where}: not what a {cls.head_type} head's build makes: " + "; ".join(changed))

    def shape_settings(self) -> str:
        """``key value`` of each of ``shape_keys`` as config.json holds it (unset: None), for errors."""
        saved = self.config.to_json()
        values = [saved["arch"].get(k[5:]) if k.startswith("arch.") else saved.get(k) for k in self.shape_keys]
        return ", ".join(f"{k} {v}" for k, v in zip(self.shape_keys, values))

    @classmethod
    def build(
        cls: type[Head],
        settings: HeadSettings,
        target_model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> Head:
        """A fresh head for ``target_model``, on the target's device (fp32; the trainer picks precision).

        ``tokenizer``, the target's, is recorded as its hash in the config, so loading the head on a target
        with another tokenizer fails (``check_tokenizer``).
        """
        config = cls.make_config(settings, draft_target_config(target_model.config))
        config.target = getattr(target_model.config, "_name_or_path", "") or config.target
        if tokenizer is not None:
            config.tokenizer_hash = tokenizer_hash(tokenizer)
        head = cls(config)
        head.attach(target_model)
        return head.to(head.target.embed_tokens.weight.device)

    def picks_draft_vocab(self) -> bool:
        """Whether training picks this head's reduced draft vocabulary from the training samples' loss tokens
        (``set_vocab_mapping``); a head drafting over the target's whole vocabulary does not."""
        return False

    def set_vocab_mapping(self, token_counts: torch.Tensor) -> None:
        """Draft over the most frequent target ids of ``token_counts`` [V] (a head with ``picks_draft_vocab``)."""
        raise NotImplementedError(f"a {self.head_type} head drafts over the target's whole vocabulary")

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The training loss on ``batch`` (capture's keys) and its detached metrics; each head type has its own."""
        raise NotImplementedError(f"{type(self).__name__} defines no loss")

    def attach(self, target_model: PreTrainedModel) -> None:
        self._target = target_parts(target_model)

    def save_pretrained(self, out_dir: str | Path) -> None:
        """``config.json`` + ``model.safetensors``, written atomically (a reader never sees half a head)."""
        state = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        with atomic_dir(out_dir) as tmp:
            write_head_config(self.config, tmp)
            save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(
        cls: type[Head],
        head_dir: str | Path,
        target_model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        allow_other_tokenizer: bool = False,
        config: HeadConfig | None = None,
    ) -> Head:
        """The saved head, checked against ``target_model`` (shapes, the build's rules: ``check_fits``) and, when
        given, its ``tokenizer``; its weights against its config (``load_head_weights``). ``config``: its config.json
        when the caller has read it already (``HeadFolder``)."""
        config = read_head_config(head_dir) if config is None else config
        cls.check_fits(config, target_model.config, Path(head_dir) / CONFIG_NAME)
        if tokenizer is not None:
            check_tokenizer(config, tokenizer_hash(tokenizer), head_dir, allow_other_tokenizer)
        head = cls(config)
        head.attach(target_model)
        load_head_weights(head, head_dir, head.target.embed_tokens.weight.device)
        return head


class FeatureDrafter(DraftHead):
    """A head that drafts by predicting the target's next feature (EAGLE-1/2, EAGLE-3): the drafting step
    they share. Its ``forward(input_ids, features, position_ids, mask, cache)`` gives (logits, features)."""

    def first_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The features of drafting's first step from the target's hidden states the head reads [.., H]."""
        raise NotImplementedError

    def to_target_vocab(self, draft_scores: torch.Tensor) -> torch.Tensor:
        """[..., draft vocab] -> [..., V]; a head that drafts over the target's whole vocabulary maps nothing."""
        return draft_scores

    def draft_step(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        tree_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step: (log-probs over the target's ids [B,n,V], -inf off a reduced draft vocabulary;
        the new features [B,n,H]); appends to ``cache``."""
        logits, features = self(input_ids, features, position_ids, tree_mask, cache)
        return self.to_target_vocab(logits.float().log_softmax(-1)), features


class EmbeddingDrafter(FeatureDrafter):
    """A feature drafter that embeds its tokens (EAGLE-1/2, EAGLE-3, P-EAGLE): with the target's embedding, frozen,
    or with its own ``embed_tokens`` (option ``own_embedding``), which it saves, trains, and the engines serve in
    place of the target's."""

    fc: nn.Linear  # every EAGLE head's: its weight's dtype is the head's

    def __init__(self, config: HeadConfig):  # its options a FeatureOptions
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.arch.hidden_size) if self.owns_embedding else None

    @property
    def owns_embedding(self) -> bool:
        return bool(self.config.options.own_embedding)

    @classmethod
    def build(
        cls: type[Embedder],
        settings: HeadSettings,
        target_model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> Embedder:
        """``DraftHead.build``; an own embedding starts as the target's rows (the draft it was trained as starts
        from the target's, speculators' copies them)."""
        head = super().build(settings, target_model, tokenizer)
        if head.embed_tokens is not None:
            head.embed_tokens.weight.data.copy_(head.target.embed_tokens.weight.detach())
        return head

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of ``input_ids`` in the head's dtype: its own table's, else the target's
        (``TargetParts.embed``: the rows unscaled, as the engines embed a draft's tokens)."""
        if self.embed_tokens is None:
            return self.target.embed(input_ids).to(self.fc.weight.dtype)
        return self.embed_tokens(input_ids)
