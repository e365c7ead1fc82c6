"""``DraftHead``: what every head shares (its typed config, the parts borrowed from the target, build,
save and load), and a head folder's files: ``config.json`` (``heads.config``) + ``model.safetensors``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from headstart.core.fingerprint import tokenizer_hash
from headstart.core.io import atomic_dir
from headstart.core.schema import HeadOptions
from headstart.heads.config import HeadConfig, parse_section, read_head_config, write_head_config
from headstart.heads.layers import KVCache
from headstart.heads.target import TargetParts, arch_from_target, check_compatible, check_tokenizer, target_parts

WEIGHTS_NAME = "model.safetensors"
Head = TypeVar("Head", bound="DraftHead")


def load_head_weights(head: nn.Module, head_dir: str | Path, device: torch.device) -> nn.Module:
    """Load the saved tensors into ``head`` and move it to ``device`` in the dtype it was saved in."""
    state = load_file(str(Path(head_dir) / WEIGHTS_NAME))
    head.load_state_dict(state, strict=True)
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    return head.to(device=device, dtype=dtype)


class DraftHead(nn.Module):
    """What every head shares: its config, the borrowed target parts, build/save/load.

    Subclasses set ``head_type`` and ``options_model`` (the head's options model in ``core.schema``, where
    the options' defaults and ranges live) and take the full config (``make_config``'s output) in ``__init__``.
    """

    head_type: ClassVar[str]
    options_model: ClassVar[type[HeadOptions]]

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self._target: TargetParts | None = None

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
    def make_config(cls, head_cfg: dict[str, Any], target_config: PretrainedConfig) -> HeadConfig:
        """The config of a fresh head: ``head_cfg``'s options (checked against ``options_model``) for this target."""
        options = {k: v for k, v in head_cfg.items() if k != "type"}
        known = sorted(set(cls.options_model.model_fields) - {"type"})
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown {cls.head_type} head options {unknown}; known: {known}")
        return HeadConfig(
            options=parse_section(cls.options_model, {**options, "type": cls.head_type}, f"{cls.head_type} head"),
            target=getattr(target_config, "_name_or_path", "") or None,
            target_hidden_size=target_config.hidden_size,
            vocab_size=target_config.vocab_size,
            arch=arch_from_target(target_config),
        )

    @classmethod
    def build(
        cls: type[Head],
        head_cfg: dict[str, Any],
        target_model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> Head:
        """A fresh head for ``target_model``, on the target's device (fp32; the trainer picks precision).

        ``tokenizer``, the target's, is recorded as its hash in the config, so loading the head on a target
        with another tokenizer fails (``check_tokenizer``).
        """
        config = cls.make_config(head_cfg, target_model.config)
        if tokenizer is not None:
            config.tokenizer_hash = tokenizer_hash(tokenizer)
        head = cls(config)
        head.attach(target_model)
        return head.to(head.target.embed_tokens.weight.device)

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
    ) -> Head:
        """The saved head, checked against ``target_model`` (shapes) and, when given, its ``tokenizer``."""
        config = read_head_config(head_dir)
        check_compatible(config, target_model.config, cls.head_type)
        if tokenizer is not None:
            check_tokenizer(config, tokenizer_hash(tokenizer), head_dir, allow_other_tokenizer)
        head = cls(config)
        head.attach(target_model)
        load_head_weights(head, head_dir, head.target.embed_tokens.weight.device)
        return head


class FeatureDrafter(DraftHead):
    """A head that drafts by predicting the target's next feature (EAGLE-1/2, EAGLE-3): the drafting step
    they share. Its ``forward(input_ids, features, position_ids, mask, cache)`` gives (logits, features)."""

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
