"""A head's config, typed: the draft layer's shape (``DraftArch``), the user's options (``HeadOptions``, each
head type's model declared beside the head) and what ties the head to its target; and its on-disk form,
``config.json``.

The JSON keeps the layout heads have always been saved in (the options at the top level, beside ``type``,
``target`` and the sizes; the layer shape under ``arch``), which the exports and imports read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar

from headstart.core.settings import Count, Section, check
from headstart.heads.registry import head_options_models

CONFIG_NAME = "config.json"


class HeadOptions(Section):
    """A head type's options (the config's ``head:`` section); each head type declares its model beside the head
    (``heads.eagle3.Eagle3Options``), and ``DraftHead.options_model`` names it."""

    if TYPE_CHECKING:
        type: str  # each head type's model declares it, as a Literal with its one value

    # The training loss. null: the head type's own (its soft cross-entropy to the target's distribution, or its
    # published loss); lk: the LK hybrid of arXiv 2602.23881 in place of its distribution term, which moves from the
    # KL to the acceptance rate itself as the draft improves (heads/losses.py, lk_loss). A block drafter's model adds
    # its own choices (to mypy, any name: a model may widen the choices). Left null, it is not saved: heads from
    # before it read the same.
    if TYPE_CHECKING:
        loss: str | None
    else:
        loss: Literal["lk"] | None = None

    # The values of options that a head saved before they existed was trained with, where today's defaults differ:
    # such a head's config.json lacks the key and reads as it was trained (``HeadConfig.from_json``).
    saved_before: ClassVar[dict[str, Any]] = {}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {name: field.default for name, field in cls.model_fields.items() if name != "type"}

    def trained_depth(self) -> int:
        """How many draft positions training scores (the predicted tau's chain; the memory estimate's depth):
        one, unless the head type says more."""
        return 1

    def draft_vocab(self) -> int | None:
        """The reduced draft vocabulary's size, when the head drafts over one (else the target's whole one)."""
        return None

    def length_problems(self, max_length: int) -> list[str]:
        """What is wrong with these options for samples of at most ``max_length`` tokens (data.max_length)."""
        return []


class LayerOptions(HeadOptions):
    """The options of a head that builds a dense draft decoder layer (EAGLE-1/2, EAGLE-3, P-EAGLE, DFlash)."""

    # The draft MLP's width; null: the target's dense MLP's (heads.target.draft_mlp_width), which a target whose
    # every layer routes to experts lacks: then it must be set.
    intermediate_size: Count | None = None


class FeatureOptions(LayerOptions):
    """The options of a head that drafts the target's next feature from a token embedding (EAGLE-1/2, EAGLE-3,
    P-EAGLE): ``heads.base.EmbeddingDrafter``."""

    # The head's own token embedding [V, H] (``embed_tokens.weight``), read in place of the target's and trained,
    # started from the target's rows: what a published draft that trained its embedding holds (speculators'
    # ``embed_requires_grad``, its P-EAGLE default), and what vLLM then serves (it keeps a draft's embedding that
    # differs from the target's). null: the target's, frozen; not written, so older heads read the same.
    own_embedding: bool | None = None


# What builds a head: a config's validated head: section, or the options as a mapping ({"type": "eagle3", ...}).
HeadSettings = HeadOptions | dict[str, Any]
Options = TypeVar("Options", bound=HeadOptions)
Parsed = TypeVar("Parsed", bound=Section)
Value = TypeVar("Value")


def resolved(value: Value | None, option: str) -> Value:
    """A head option that ``make_config`` fills in when the user leaves it unset (null), as every saved head has it."""
    if value is None:
        raise ValueError(f"head option {option} is unset: make the head's config with its make_config")
    return value


def parse_section(model: type[Parsed], data: dict[str, Any], where: str | Path) -> Parsed:
    """``data`` checked by ``model``; ValueError naming ``where`` and each problem as the config check words it
    (``ttt_steps must be >= 1, got 0``)."""
    parsed, problems = check(data, model)
    if parsed is None:
        raise ValueError(f"{where}: " + "; ".join(problems))
    return parsed


@dataclass(kw_only=True)
class DraftArch:
    """The draft decoder layer's shape: the target's (``heads.target.arch_from_target``), or a published draft's
    own MLP width, norm eps and rotary on import. Field order is the JSON order."""

    family: str | None = None  # the target's model_type; heads saved before families record none
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    rope: dict[str, Any]  # transformers' rope_parameters: rope_type, rope_theta and the type's own keys
    vocab_size: int
    num_hidden_layers: int  # the target's: its last hidden state is hidden_states[num_hidden_layers]
    # Heads saved before these two flags existed are plain Llama layers.
    qkv_bias: bool = False  # biases on q/k/v, not o (Qwen2's attention)
    qk_norm: bool = False  # RMSNorm over each head's query and key before rotary (Qwen3's attention)


@dataclass(kw_only=True)
class HeadConfig(Generic[Options]):
    """Everything a saved head needs to be rebuilt without its target, and checked against one."""

    options: Options  # the head's type and its options, checked by that type's HeadOptions model
    target: str | None  # the target's path or hub id, as it was loaded
    target_hidden_size: int
    vocab_size: int  # the target's
    arch: DraftArch
    tokenizer_hash: str | None = None  # the target tokenizer's (core.fingerprint), when training recorded one
    training: dict[str, Any] | None = None  # the last held-out evaluation's summary (train.loop)
    # How the training data reached the target: "chat" (its chat template) or "raw" (data.format: text, the way a
    # completion API prompts it; data_recipes.prompts). None for heads saved before it was recorded.
    prompt_format: str | None = None

    @property
    def type(self) -> str:
        return self.options.type

    @property
    def trained_depth(self) -> int:
        """How many draft positions training scored (``HeadOptions.trained_depth``, each head type's own)."""
        return self.options.trained_depth()

    def to_json(self) -> dict[str, Any]:
        """The config.json form: the keys in the order heads have always been saved with."""
        out = {
            "type": self.type,
            "target": self.target,
            "target_hidden_size": self.target_hidden_size,
            "vocab_size": self.vocab_size,
            # An option left unset (null) is not written: heads saved before it existed read the same.
            **self.options.model_dump(exclude={"type"}, exclude_none=True),
            "arch": asdict(self.arch),
        }
        if self.tokenizer_hash is not None:
            out["tokenizer_hash"] = self.tokenizer_hash
        if self.training is not None:
            out["training"] = self.training
        if self.prompt_format is not None:
            out["prompt_format"] = self.prompt_format
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str | Path) -> HeadConfig[HeadOptions]:
        """The config of a config.json's content; ValueError naming ``where`` and the key when it is not one."""
        head_type = data.get("type")
        known = head_options_models()
        if head_type not in known:
            raise ValueError(f"{where}: unknown head type {head_type!r}; known: {sorted(known)}")
        own = {f.name for f in fields(cls)} - {"options"}
        options_model = known[head_type]
        saved = options_model.saved_before | {k: v for k, v in data.items() if k not in own}
        options = parse_section(options_model, saved, where)
        try:
            arch = DraftArch(**data["arch"])
            return HeadConfig(options=options, arch=arch, **{k: data[k] for k in own - {"arch"} if k in data})
        except (KeyError, TypeError) as err:
            raise ValueError(f"{where}: not a {head_type} head config ({err})") from None


def read_head_config(head_dir: str | Path) -> HeadConfig:
    path = Path(head_dir) / CONFIG_NAME
    return HeadConfig.from_json(json.loads(path.read_text()), path)


@dataclass(frozen=True)
class HeadFolder:
    """A saved head's folder with its config.json, read once: what a run checks, matches with trees and loads."""

    path: str
    config: HeadConfig


def read_head_folder(head_dir: str | Path) -> HeadFolder:
    return HeadFolder(str(head_dir), read_head_config(head_dir))


def write_head_config(config: HeadConfig, head_dir: Path) -> None:
    (head_dir / CONFIG_NAME).write_text(json.dumps(config.to_json(), indent=2) + "\n")
