"""The one config schema: every key any command reads, with its type, range and default.

One YAML file drives several commands (regenerate, capture, training), so each command checks the
whole file against its own root model: ``CaptureConfig``, ``RegenerateConfig``, ``TrainConfig``, and
``DemoConfig`` / ``BuildDemoModelsConfig`` for the two scripts with configs of their own. A root model
requires the sections its command reads; the other stages' sections may be present, but they are
checked against their own section schema too, so a typo anywhere in the file fails whichever command
reads it first. ``validate_config`` runs before any model is loaded and raises one ConfigError naming
every problem by its dotted key (``capture.shard_samples must be >= 1, got -1``); it returns a plain
dict with the defaults filled in, which is what the rest of the code reads.

Values are checked strictly: no string is read as a number, no number as a flag. The one exception is
YAML 1.1's: it reads ``1e-4`` (an exponent without a dot) as a string, so a float accepts numeric strings.
"""

from __future__ import annotations

import contextlib
import json
import re
import types
import typing
import urllib.parse
from argparse import Namespace
from collections.abc import Iterator
from pathlib import PurePath
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, PydanticCustomError

from headstart.core.config import ConfigError


def _yaml_number(value: Any) -> Any:
    if isinstance(value, str):
        with contextlib.suppress(ValueError):  # not a number: reported as a wrong type
            return float(value)
    return value


def _not_a_flag(value: Any) -> Any:
    # Literal[0, 1, ...] takes True for 1 (True == 1 in Python); a yes/no where a number belongs is a mistake.
    if isinstance(value, bool):
        raise PydanticCustomError("literal_error", "not one of the choices")
    return value


Float = Annotated[float, BeforeValidator(_yaml_number), Field(allow_inf_nan=False)]
Positive = Annotated[Float, Field(gt=0)]
NonNegativeFloat = Annotated[Float, Field(ge=0)]
Fraction = Annotated[Float, Field(ge=0, le=1)]
Decay = Annotated[Float, Field(gt=0, le=1)]  # weight decay**k of the k-th term: 0 drops them all, > 1 grows
Count = Annotated[int, Field(ge=1)]  # sizes, steps, lengths: at least one
NonNegative = Annotated[int, Field(ge=0)]
Dtype = Literal["fp32", "float32", "bf16", "bfloat16", "fp16", "float16"]
StoreDtype = Literal["fp32", "float32", "bf16", "bfloat16", "fp16", "float16", "fp8_e4m3"]  # shards only
Formats = Literal["alpaca", "gsm8k", "messages", "sharegpt", "text"]  # data_recipes.formats.FORMATS


class Section(BaseModel):
    """A mapping with exactly these keys (an unknown key is a typo), values checked strictly."""

    model_config = ConfigDict(extra="forbid", strict=True)
    command: ClassVar[str] = "config"  # as a root model: who reads it ("invalid capture config: ...")
    top_level: ClassVar[str] = "key"  # as a root model: what its keys are called in errors


class Target(Section):
    path: str  # a local folder or a hub id
    device: str = "auto"  # cuda when present, else cpu
    dtype: Dtype = "fp32"  # the frozen target's compute dtype
    tp_size: Count = 1  # processes one copy of the target is split across (torchrun; docs/TRAINING.md)


class Data(Section):
    source: str  # a .jsonl/.json/.parquet file or a hub dataset id
    format: Formats
    max_length: Count | None = None  # tokens per sample; required where samples are tokenized
    on_error: Literal["raise", "skip"] = "raise"
    limit: Count | None = None  # null: every record


class TokenizedData(Data):
    max_length: Count


class Capture(Section):
    out_dir: str | None = None  # the shards; training may compute the states online instead
    aux_layers: Literal["auto"] | list[NonNegative] = "auto"  # auto: core.models.default_aux_layers; [] none
    store_dtype: StoreDtype = "bf16"  # fp8_e4m3: a float32 scale per token and layer (docs/DATA.md)
    shard_samples: Count = 256
    batch_tokens: Count = 8192  # padded tokens per forward
    # Train on shards whose manifest names other target weights (a fine-tune of the same shape): only
    # for users who know the states still fit; the run warns.
    allow_other_weights: bool = False
    # Who runs the target: hf, transformers in this process (torchrun ranks, target.tp_size); vllm, a vLLM
    # server with extract_hidden_states (docs/DATA.md, "Capture through vLLM"): the one at base_url, or one
    # started here from engine_python with target.tp_size as its tensor_parallel_size.
    engine: Literal["hf", "vllm"] = "hf"
    engine_python: str = ".venv-engines/bin/python"  # the venv with vllm (make verify-engines builds it)
    base_url: str | None = None  # a running server's API root; null: start one (engine vllm)
    model: str | None = None  # the served model name; null: target.path
    concurrency: Count = 8  # requests in flight (the server batches them)
    timeout_s: Positive = 600.0  # per request: no answer within it is a failed attempt
    retries: NonNegative = 3  # per request, after connection errors, timeouts and 5xx/429 answers

    @model_validator(mode="after")
    def _a_server_only_for_the_vllm_engine(self) -> Capture:
        if self.engine == "hf" and self.base_url:
            raise PydanticCustomError(
                "section_rule", "base_url is only read by engine 'vllm' (set engine: vllm to capture through it)"
            )
        return self


class CaptureToDisk(Capture):
    out_dir: str


class Regenerate(Section):
    out: str  # the regenerated dataset: OpenAI-messages JSONL, or {"text": ...} JSONL for data.format text
    max_new_tokens: Count
    temperature: NonNegativeFloat = 0.0  # 0: greedy
    top_p: Annotated[Float, Field(gt=0, le=1)] = 1.0
    top_k: NonNegative = 0  # 0: no top-k cut
    chunk_size: Count = 64  # conversations per resumable part
    seed: NonNegative = 0
    discard_stale_parts: bool = False  # parts made with other settings: delete them (else refuse)
    # Who generates: hf, the target in this process (transformers); openai, an OpenAI-compatible server
    # (vLLM, SGLang) at base_url, serving the target as ``model``.
    engine: Literal["hf", "openai"] = "hf"
    base_url: str | None = None  # the server's API root, e.g. http://localhost:8000/v1
    model: str | None = None  # the served model name; null: target.path (what `vllm serve PATH` names it)
    concurrency: Count = 16  # requests in flight (the server batches them)
    timeout_s: Positive = 600.0  # per request: no answer within it is a failed attempt
    retries: NonNegative = 3  # per request, after connection errors, timeouts and 5xx/429 answers

    @field_validator("base_url")
    @classmethod
    def _an_http_url(cls, url: str | None) -> str | None:
        # Only http(s) with a host: a file:// URL would have a client read a local file (and quote it in errors).
        parts = urllib.parse.urlsplit(url or "")
        if url and (parts.scheme not in ("http", "https") or not parts.hostname):
            raise PydanticCustomError("url", "must be an http(s) URL, the server's API root (http://localhost:8000/v1)")
        return url

    @model_validator(mode="after")
    def _a_server_for_the_openai_engine(self) -> Regenerate:
        if self.engine == "openai" and not self.base_url:
            raise PydanticCustomError(
                "section_rule", "base_url is required when engine is 'openai' (e.g. http://localhost:8000/v1)"
            )
        if self.engine == "hf" and self.base_url:
            raise PydanticCustomError(
                "section_rule", "base_url is only read by engine 'openai' (set engine: openai to use the server)"
            )
        return self


class Train(Section):
    out_dir: str
    seed: NonNegative = 0
    epochs: Count = 1
    max_steps: Count | None = None  # null: epochs x steps per epoch
    batch_size: Count = 16  # samples per optimizer step, over all ranks
    micro_batch_size: Count = 4  # samples per forward, per rank
    lr: Positive = 1e-4
    min_lr_ratio: Fraction = 0.0  # cosine decays to lr * min_lr_ratio
    warmup_steps: NonNegative = 0
    weight_decay: NonNegativeFloat = 0.0
    betas: Annotated[list[Annotated[Float, Field(ge=0, lt=1)]], Field(min_length=2, max_length=2)] = [0.9, 0.95]
    max_grad_norm: NonNegativeFloat = 1.0  # 0: no clipping
    zero_stage: Annotated[Literal[0, 1, 2, 3], BeforeValidator(_not_a_flag)] = 2
    dtype: Literal["fp32", "bf16"] = "fp32"  # the head's training precision
    # true: the target runs inside each step, here; vllm: each batch's states are asked of a vLLM server
    # (capture.base_url, or one started from capture.engine_python); false: the shards in capture.out_dir
    online_capture: bool | Literal["vllm"] = False
    heldout_samples: NonNegative = 0
    eval_every: NonNegative = 0  # 0: held-out eval at the end only
    # Measured acceptance at each held-out evaluation (train/measured.py): the head drafts greedy chains at its
    # trained depth and the target verifies, on eval_prompts prompts (the held-out samples' prompts, or the first
    # of eval_bench), eval_new_tokens new tokens each. 0: off (it loads the whole target, not only the borrowed
    # tensors).
    eval_prompts: NonNegative = 0
    eval_new_tokens: Count = 64
    eval_bench: str | None = None  # a benchmark JSONL (data_recipes.bench) instead of the held-out samples
    # last: the exported head (<out_dir>/head) is the last step's; measured_tau: the one whose measured tau was best
    keep_best: Literal["last", "measured_tau"] = "last"
    save_every: NonNegative = 0  # 0: checkpoint at the end only
    keep_checkpoints: NonNegative = 2  # 0 keeps them all
    num_workers: NonNegative = 0
    resume: Literal["auto"] | bool = "auto"


class Lora(Section):
    """Medusa-2: present -> the target trains jointly through LoRA adapters."""

    r: Count = 16
    alpha: Positive = 32.0
    dropout: Annotated[Float, Field(ge=0, lt=1)] = 0.05
    target_modules: Annotated[list[str], Field(min_length=1)] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    head_weight: NonNegativeFloat = 0.2  # weight of the Medusa heads' loss beside the LM loss
    head_weight_warmup: NonNegative = 0  # steps over which that weight rises from 0


class Wandb(Section):
    mode: Literal["online", "offline", "disabled"] = "disabled"
    project: str = "headstart"
    name: str | None = None


class Metrics(Section):
    """Where training metrics go besides metrics.jsonl (always written) and wandb (its own section)."""

    tensorboard: bool = False  # event files in <train.out_dir>/tensorboard
    mlflow: bool = False  # an MLflow file store in <train.out_dir>/mlruns: no server, no network
    mlflow_experiment: str = "headstart"  # each launch is one run in it, named after train.out_dir


class HeadOptions(Section):
    """A head type's options; ``heads`` takes its defaults from here (``DraftHead.options_model``)."""

    if typing.TYPE_CHECKING:
        type: str  # each head type's model declares it, as a Literal with its one value

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {name: field.default for name, field in cls.model_fields.items() if name != "type"}


class EagleOptions(HeadOptions):
    type: Literal["eagle"] = "eagle"
    # EAGLE-1's loss weights: 1.0 * feature regression (smooth L1) + 0.1 * token cross-entropy.
    vloss_weight: NonNegativeFloat = 1.0
    ploss_weight: NonNegativeFloat = 0.1
    fc_bias: bool = False  # vLLM's fc has no bias (a bias in the checkpoint would be silently skipped there)


class ParallelDrafting(Section):
    """P-EAGLE: present -> the EAGLE-3 head drafts its ``ttt_steps`` depths in ONE forward, as vLLM's
    ``parallel_drafting`` serves it: depth 1 reads the next token and the target's features as usual,
    depths 2.. read the mask token and the learned ``mask_hidden`` (heads/eagle3.py)."""

    mask_token_id: NonNegative | None = None  # null: the target's pad token, else its eos; recorded in the head


def _flag_as_section(value: Any) -> Any:
    # `parallel_drafting: true` (vLLM's spelling) is the section with its defaults; false is no section.
    return {} if value is True else None if value is False else value


class Eagle3Options(HeadOptions):
    type: Literal["eagle3"] = "eagle3"
    # null: core.models.default_aux_layers, (2, L//2, L-3); the capture must use the same.
    layer_ids: list[NonNegative] | None = None
    draft_vocab_size: Count = 32000
    ttt_steps: Count = 7  # training-time-test depth
    ttt_decay: Decay = 0.8
    # "target": the target family's layer where vLLM has one (Qwen3: q/k norm, served as
    # Eagle3Qwen3ForCausalLM); "llama": a plain Llama layer, which every engine serves (SGLang included).
    draft_layer: Literal["target", "llama"] = "target"
    # P-EAGLE (true, or {mask_token_id: ...}); absent: EAGLE-3's autoregressive drafting.
    parallel_drafting: Annotated[ParallelDrafting | None, BeforeValidator(_flag_as_section)] = None


class MedusaOptions(HeadOptions):
    type: Literal["medusa"] = "medusa"
    num_heads: Count = 4  # head k guesses the token k+2 ahead
    num_layers: NonNegative = 1  # residual blocks per head
    decay: Decay = 0.8  # loss weight decay**k for head k


class DflashOptions(HeadOptions):
    type: Literal["dflash"] = "dflash"
    # Target layers fused by fc, in capture.aux_layers' convention (HF hidden_states index; vLLM's
    # dflash_config.target_layer_ids is one less). null: the capture's layers; its auto default
    # (2, L//2, L-3) is EAGLE-3's, so one capture feeds both heads.
    layer_ids: list[NonNegative] | None = None
    num_layers: Count = 1  # draft decoder layers (Qwen3-style, q/k norm)
    block_size: Annotated[int, Field(ge=2)] = 16  # one forward: the real token + block_size - 1 mask slots
    intermediate_size: Count | None = None  # the draft MLP's width; null: the target's
    # The token fed in the mask slots; null: the tokenizer's mask token, else the first row past the
    # tokenizer (an unused embedding row), else pad, else eos (heads/dflash.py, resolve_mask_token_id).
    mask_token_id: NonNegative | None = None
    mask_embedding: bool = False  # learn the mask slots' input vector (vLLM: mask_embedding.pt) instead of its row
    # null: draft over the target's whole vocabulary with its lm_head. A number: the most frequent training
    # tokens only, with the target lm_head's rows for them (frozen), shipped as lm_head + d2t (a smaller matmul).
    draft_vocab_size: Count | None = None
    causal: bool = False  # causal attention inside the block (the DFlash paper's blocks are bidirectional)
    num_anchors: Count = 512  # blocks sampled per sequence and training step
    loss_gamma: Positive = 7.0  # block position k's loss weight exp(-(k-1)/gamma): 7 for blocks of 16


# The head section: its ``type`` picks the options model, so a key is checked against that head's options.
Head = Annotated[EagleOptions | Eagle3Options | MedusaOptions | DflashOptions, Field(discriminator="type")]
HEAD_OPTIONS: dict[str, type[HeadOptions]] = {
    options.model_fields["type"].default: options for options in typing.get_args(typing.get_args(Head)[0])
}


# ---- the flag-driven commands: a section each, a field per flag (see ``flags_argv``)

PromptFormat = Literal["auto", "chat", "raw"]  # how prompts become tokens: data_recipes.prompts


class CommandFlags(Section):
    """The flags of a command driven by flags (``python -m eval.acceptance --target ...``), as a section.

    Each field is the flag of that name (``max_new_tokens`` is ``--max-new-tokens``), with the flag's
    default; ``positional`` names the fields the command takes as positional arguments. The flags stay
    the command's own interface; tests/test_cli.py checks every section against its command's parser.
    """

    positional: ClassVar[tuple[str, ...]] = ()


class Eval(CommandFlags):
    """``python -m eval.acceptance``: acceptance length and speedup against vanilla decoding."""

    target: str
    head: list[str] = []  # head folders, one per head method
    draft: str | None = None  # for method draft_model
    allow_other_tokenizer: bool = False
    method: Annotated[list[str], Field(min_length=1)]  # eval.run.METHODS
    bench: str
    prompt_format: PromptFormat = "auto"  # auto: the chat template where the tokenizer has one, else raw text
    limit: Count | None = None  # null: every prompt
    per_group: Count | None = None  # prompts per category group (eval.matrix.GROUPS); null: --limit's
    max_new_tokens: Count = 128
    temperature: NonNegativeFloat = 0.0
    temperatures: list[NonNegativeFloat] = []  # the method x group x temperature matrix (eval.matrix)
    top_p: Annotated[Float, Field(gt=0, le=1)] = 1.0
    top_k: NonNegative = 0
    tree: str | None = None  # static, dynamic or a tree.json file; null: each method's default
    top_k_draft: Count = 8
    depth: Count = 5
    total_tokens: Count = 48
    exit_layer: Count | None = None  # self_spec: the target layers that draft; null: half of them
    seed: NonNegative = 0
    device: str = "auto"
    dtype: Dtype = "fp32"
    tp_size: Count = 1  # the target split across this many torchrun processes
    out: str  # the report folder


class Autotune(CommandFlags):
    """``python -m eval.autotune``: the draft tree with the best expected tokens/s on this machine."""

    target: str
    head: str | None = None  # what to tune for: exactly one of head, draft, self_spec
    draft: str | None = None
    self_spec: bool = False
    exit_layers: list[Count] | None = None  # self_spec: the exit layers to try; null: every one
    allow_other_tokenizer: bool = False
    bench: str = "assets/data/gsm8k_test.jsonl"
    prompt_format: PromptFormat = "auto"  # auto: the chat template where the tokenizer has one, else raw text
    offset: NonNegative = 0
    calibration: Count = 8
    heldout: Count = 8
    max_new_tokens: Count = 128
    max_nodes: Count = 48
    max_depth: Count = 8
    comb_width: Count = 8
    batch_size: Count = 1
    batch_sizes: Annotated[list[Count], Field(min_length=1)] = [1, 2, 4, 8]
    repeats: Count = 7
    device: str = "auto"
    dtype: Dtype = "fp32"
    tp_size: Count = 1  # the target split across this many torchrun processes
    seed: NonNegative = 0
    out: str
    write_head: bool = False

    @model_validator(mode="after")
    def _one_draft_source(self) -> Autotune:
        given = [name for name in ("head", "draft", "self_spec") if getattr(self, name)]
        if len(given) != 1:
            raise PydanticCustomError(
                "section_rule",
                "give exactly one of head, draft and self_spec (got {given})",
                {"given": given or "none"},
            )
        return self


ExportFormat = Literal["vllm", "sglang", "speculators", "medusa"]  # scripts.export.FORMATS


class Export(CommandFlags):
    """``python -m scripts.export``: a trained head in a serving engine's layout."""

    head: str
    format: ExportFormat
    out: str
    overwrite: bool = False
    target: str | None = None  # null: the target the head's config names
    parity: str | None = None
    allow_other_tokenizer: bool = False


class ImportHead(CommandFlags):
    """``python -m scripts.import_head``: a published draft head in headstart's head format."""

    positional: ClassVar[tuple[str, ...]] = ("src",)

    kind: Literal["eagle", "eagle3", "medusa", "speculators", "dflash"]  # scripts.import_head.SOURCES (flag --from)
    src: str
    out: str
    overwrite: bool = False
    target: str


class Push(CommandFlags):
    """``python -m scripts.push_to_hub``: a head's export, card and eval report on the Hugging Face Hub."""

    head: str
    repo_id: str
    format: ExportFormat = "vllm"
    target: str | None = None
    target_id: str | None = None
    report: str | None = None
    parity: str | None = None
    private: bool = False
    dry_run: bool = False


class VerifyEngines(CommandFlags):
    """``python -m scripts.verify_engines``: served-acceptance parity of the EAGLE exports in vLLM and speculators."""

    eagle3: str = "runs/demo/eagle3/head"  # "": skip
    eagle: str = "runs/demo/eagle/head"  # "": skip
    peagle: str = ""  # a P-EAGLE head (EAGLE-3 with parallel_drafting); "": skip
    dflash: str = "runs/demo/dflash/head"  # "": skip
    target: str = "assets/demo-target"
    engines_python: str = ".venv-engines/bin/python"
    k: Count = 3
    prompts: Count = 8
    max_tokens: Count = 96
    prompt_format: PromptFormat = "auto"  # auto: the chat template where the tokenizer has one, else raw text
    schedule: str | None = None  # vLLM num_speculative_tokens_per_batch_size (JSON or a tree.json); null: not checked
    work: str = "runs/verify_engines"
    out: str | None = None  # null: <work>/parity.json


# Section name -> its model; the section is named for its command (``import_head``: ``import`` is Python's).
COMMAND_FLAGS: dict[str, type[CommandFlags]] = {
    "eval": Eval,
    "autotune": Autotune,
    "export": Export,
    "import_head": ImportHead,
    "push": Push,
    "verify_engines": VerifyEngines,
}


class PipelineConfig(Section):
    """Any stage's config: every section optional, each checked against its schema when present."""

    command: ClassVar[str] = "pipeline"
    top_level: ClassVar[str] = "section"

    target: Target | None = None
    data: Data | None = None
    capture: Capture | None = None
    regenerate: Regenerate | None = None
    head: Head | None = None
    train: Train | None = None
    lora: Lora | None = None
    wandb: Wandb | None = None
    metrics: Metrics | None = None
    eval: Eval | None = None
    autotune: Autotune | None = None
    export: Export | None = None
    import_head: ImportHead | None = None
    push: Push | None = None
    verify_engines: VerifyEngines | None = None

    @model_validator(mode="before")
    @classmethod
    def _empty_sections_are_absent(cls, config: Any) -> Any:
        # `wandb:` with every line commented out is YAML null: the section's defaults, not an error.
        return {k: v for k, v in config.items() if v is not None} if isinstance(config, dict) else config


class CaptureConfig(PipelineConfig):
    command: ClassVar[str] = "capture"
    target: Target
    data: TokenizedData
    capture: CaptureToDisk


class RegenerateConfig(PipelineConfig):
    command: ClassVar[str] = "regenerate"
    target: Target
    data: Data
    regenerate: Regenerate


class TrainConfig(PipelineConfig):
    """Training; train/config.py adds the checks that span sections (batch sizes, shards or online)."""

    command: ClassVar[str] = "training"
    target: Target
    data: TokenizedData
    capture: Capture = Capture()
    head: Head
    train: Train
    wandb: Wandb = Wandb()
    metrics: Metrics = Metrics()


def _command_config(section: str) -> type[PipelineConfig]:
    """The root model of a flag-driven command: any stage's config, with the command's own section required."""
    flags = COMMAND_FLAGS[section]
    # The field's name is known at run time only; mypy matches a **dict against create_model's own keywords too.
    fields: dict[str, Any] = {section: flags}
    root = create_model(f"{flags.__name__}Config", __base__=PipelineConfig, __module__=__name__, **fields)
    root.command = section
    return root


# Section name -> the root model its command (``headstart eval``, ...) checks a config against.
COMMAND_CONFIGS: dict[str, type[PipelineConfig]] = {section: _command_config(section) for section in COMMAND_FLAGS}


class DemoStage(Section):
    name: str
    cmd: str  # {python}, {bin} and {key} (a top-level key of the config) are filled in
    inputs: list[str] = []  # files whose bytes key the stage
    outputs: list[str] = []  # files that must exist for the stage to count as done


class DemoConfig(Section):
    """configs/demo.yaml, read by scripts/demo.py."""

    command: ClassVar[str] = "demo"

    out_dir: str
    report: str
    nproc_per_node: Count = 1
    target: str | None = None  # a folder the stage commands name as {target}
    heads: str | None = None  # where stages after training read the heads, as {heads}
    stages: Annotated[list[DemoStage], Field(min_length=1)]


class ModelTraining(Section):
    seq_len: Count
    batch_size: Count
    steps: Count
    lr: Positive
    min_lr_ratio: Fraction
    warmup_steps: NonNegative
    weight_decay: NonNegativeFloat
    grad_clip: Positive
    dtype: Dtype  # autocast dtype
    ckpt_every: Count


class DemoModel(Section):
    name: str
    hidden_size: Count
    intermediate_size: Count
    num_hidden_layers: Count
    num_attention_heads: Count
    num_key_value_heads: Count
    tie_word_embeddings: bool
    train: ModelTraining


class DemoTokenizer(Section):
    vocab_size: Count
    min_frequency: Count


class BuildDemoModelsConfig(Section):
    """configs/build-demo-models.yaml, read by scripts/build_demo_models.py."""

    command: ClassVar[str] = "build-demo-models"

    seed: NonNegative
    out_dir: str
    work_dir: str
    device: str = "auto"
    train_file: str
    sample_file: str
    heldout_fraction: Annotated[Float, Field(ge=0, lt=1)]
    system_prompt_fraction: Fraction
    system_prompt: str
    tokenizer: DemoTokenizer
    target: DemoModel
    draft: DemoModel


def check_config(config: dict[str, Any], schema: type[Section]) -> tuple[dict[str, Any], list[str]]:
    """``config`` with the defaults of ``schema`` filled in, and every problem found (none: it is valid)."""
    try:
        resolved = schema.model_validate(config)
    except ValidationError as err:
        problems: list[str] = []
        for problem in _problems(schema, config, err.errors()):
            if problem not in problems:  # several members of a union may refuse a value alike
                problems.append(problem)
        return config, problems
    # An absent optional section stays absent (a lora: section is what makes Medusa-2).
    return {k: v for k, v in resolved.model_dump().items() if v is not None}, []


def validate_config(config: dict[str, Any], schema: type[Section]) -> dict[str, Any]:
    """``config`` with the defaults of ``schema`` filled in, or one ConfigError listing every problem."""
    resolved, problems = check_config(config, schema)
    raise_problems(schema, problems)
    return resolved


def flags_argv(section: str, values: dict[str, Any]) -> list[str]:
    """The command line that a validated flag-driven ``section`` amounts to: one rule for every such command.

    A field is its flag (``max_new_tokens: 64`` is ``--max-new-tokens 64``); a list is comma-joined (the
    commands split their list flags on commas); true is the bare flag; false, null and an empty list leave
    the flag out, which is its default; the section's ``positional`` fields come first, as plain values.
    """
    flags = COMMAND_FLAGS[section]
    argv = [str(values[name]) for name in flags.positional]
    for name, value in values.items():
        if name in flags.positional or value is None or value is False or value == []:
            continue
        argv.append("--" + name.replace("_", "-"))
        if value is not True:
            argv.append(",".join(map(str, value)) if isinstance(value, list) else str(value))
    return argv


def flags_config(section: str, args: Namespace) -> dict[str, Any]:
    """What a flag-driven command's parsed ``args`` amount to as a config: ``{section: {flag: value}}``.

    The command saves it beside what it wrote; ``headstart <command> --config`` on it runs the same again.
    """
    values = {name: getattr(args, name) for name in COMMAND_FLAGS[section].model_fields}
    return {section: {name: _plain(value) for name, value in values.items()}}


def flag_problems(section: str, args: Namespace) -> list[str]:
    """A flag-driven command's parsed ``args`` through its section's schema, each problem named by its flag
    (``--top-p must be <= 1, got 2.0``): ``python -m eval.acceptance`` refuses what ``headstart eval`` does."""
    _, problems = check_config(flags_config(section, args), COMMAND_CONFIGS[section])
    return [_as_flag(section, problem) for problem in problems]


def _as_flag(section: str, problem: str) -> str:
    """``eval.top_p must be ...`` -> ``--top-p must be ...``: on the command line a key is its flag."""
    key = re.match(rf"{section}\.(\w+)", problem)
    if key is None or key[1] not in COMMAND_FLAGS[section].model_fields:
        return problem
    return "--" + key[1].replace("_", "-") + problem[key.end() :]


def section_keys(section: str) -> list[str]:
    """A flag-driven section's keys for ``headstart <command> --help``: each with its type and default."""
    lines = []
    for name, field in COMMAND_FLAGS[section].model_fields.items():
        default = "required" if field.is_required() else f"default {json.dumps(field.default)}"
        lines.append(f"{section}.{name}: {_describe(field.annotation)} ({default})")
    return lines


def _plain(value: Any) -> Any:
    """A parsed flag as YAML writes it: a path as its string, a tuple as a list."""
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return str(value) if isinstance(value, PurePath) else value


def raise_problems(schema: type[Section], problems: list[str]) -> None:
    if problems:
        raise ConfigError(f"invalid {schema.command} config:\n  " + "\n  ".join(problems))


# ---- pydantic's errors, told as "<dotted key> must be ..., got ..."

_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<=")}
_BOUNDS |= {"less_than": ("lt", "<")}


class _Where(NamedTuple):
    key: str  # dotted, e.g. "capture.aux_layers" or "stages[0].cmd"
    model: type[Section]  # the model holding the field (or refusing an extra key)
    field: FieldInfo | None  # None: the error is about a key of ``model`` that is not a field
    annotation: Any  # the field's type, or the union member the value was checked against
    rest: list  # what is left of pydantic's loc: list indices, union member names, an extra key
    tagged: tuple[str, str] | None  # (key, tag) when the path went through a tagged union (head.type)


def _problems(schema: type[Section], config: dict[str, Any], errors: list[ErrorDetails]) -> Iterator[str]:
    located = [(error, _locate(schema, error["loc"])) for error in errors]
    # A value of a union (capture.aux_layers: "auto" or a list) that has one member's shape (a list) is
    # refused by the others for its shape alone: report why the member it looks like refused it.
    shaped = {where.key for _, where in located if len(where.rest) > 1 and isinstance(where.rest[0], str)}
    for error, where in located:
        if where.key in shaped and where.rest and isinstance(where.rest[0], str):
            if len(where.rest) == 1:
                continue
            member = next(a for a in _union_args(where.annotation) if typing.get_origin(a) is list)
            where = where._replace(rest=where.rest[1:], annotation=member)
        yield _problem(schema, config, error, where)


def _problem(schema: type[Section], config: dict[str, Any], error: ErrorDetails, where: _Where) -> str:
    key, model, field, annotation, rest, tagged = where
    kind, got = error["type"], f"got {error.get('input')!r}"
    if kind == "extra_forbidden":
        known = ", ".join(sorted(model.model_fields))
        if not key:
            return f"unknown {schema.top_level} {rest[0]!r} (known: {known})"
        what = f" for a {tagged[1]} {tagged[0]}" if tagged else ""
        return f"unknown key {key}.{rest[0]}{what} (known: {known})"
    if kind == "missing":
        return f"{key} is required" + (f" (a `{key}:` section)" if _model_members(field) else "")
    if kind == "section_rule":  # a rule across a section's keys, said by its model validator
        return f"{key}.{error['msg']}"
    if kind == "union_tag_not_found":
        return f"{key}.{_discriminator(field)} is required (one of {', '.join(map(str, _model_members(field)))})"
    if kind == "union_tag_invalid":
        tag, tags = error["ctx"]["tag"], ", ".join(map(str, _model_members(field)))
        return f"{key}.{_discriminator(field)} {tag!r} is not a {key} type (known: {tags})"
    if any(isinstance(item, str) for item in rest):
        # Every member of a union refused the value for its shape: say once what it may be.
        value = _lookup(config, error["loc"][: len(error["loc"]) - len(rest)])
        return f"{key} must be {_describe(annotation)}, got {value!r} ({type(value).__name__})"
    for index in rest:  # an item of a list
        key, annotation = f"{key}[{index}]", typing.get_args(_strip(annotation))[0]
    if kind.endswith(("_type", "_parsing")):
        value = error.get("input")
        return f"{key} must be {_describe(annotation)}, got {value!r} ({type(value).__name__})"
    if kind == "literal_error":
        return f"{key} must be one of {list(typing.get_args(_strip(annotation)))}, {got}"
    if kind in _BOUNDS:
        bound, sign = _BOUNDS[kind]
        return f"{key} must be {sign} {error['ctx'][bound]}, {got}"
    if kind == "too_short":
        return f"{key} must have at least {error['ctx']['min_length']} item(s), {got}"
    if kind == "too_long":
        return f"{key} must have at most {error['ctx']['max_length']} item(s), {got}"
    if kind == "finite_number":
        return f"{key} must be a finite number, {got}"
    return f"{key}: {error['msg']}, {got}"


def _locate(schema: type[Section], loc: tuple) -> _Where:
    """Follow an error's ``loc`` through the models, as far as it names fields."""
    key, model, field, rest, tagged = "", schema, None, list(loc), None
    while rest and isinstance(rest[0], str) and rest[0] in model.model_fields:
        name = rest.pop(0)
        key = f"{key}.{name}" if key else name
        field = model.model_fields[name]
        members = _model_members(field)
        if not members or not rest:
            break
        if len(members) > 1:  # a tagged union: pydantic names the member
            if rest[0] not in members:
                break
            tagged = (key, rest[0])
            model = members[rest.pop(0)]
        else:
            model = members[None]
            if typing.get_origin(_strip(field.annotation)) is list:  # a list of sections
                key += f"[{rest.pop(0)}]"
        field = None
    return _Where(key, model, field, field.annotation if field else None, rest, tagged)


def _lookup(config: Any, loc: tuple) -> Any:
    for item in loc:
        config = config[item]
    return config


def _strip(annotation: Any) -> Any:
    """``Annotated[X, ...]`` and ``X | None`` -> X (for a single X)."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _strip(args[0])
    return annotation


def _union_args(annotation: Any) -> list[Any]:
    annotation = _strip(annotation)
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return [_strip(a) for a in typing.get_args(annotation)]
    return [annotation]


def _model_members(field: FieldInfo | None) -> dict[str | None, type[Section]]:
    """The sections a field holds: {None: model} for one (or a list of them), {tag: model} for a tagged union."""
    if field is None:
        return {}
    args = _union_args(field.annotation)
    if len(args) == 1 and typing.get_origin(args[0]) is list:
        args = [_strip(typing.get_args(args[0])[0])]
    models = [a for a in args if isinstance(a, type) and issubclass(a, Section)]
    if not models or len(models) != len(args):
        return {}
    if len(models) == 1:
        return {None: models[0]}
    return {m.model_fields[_discriminator(field)].default: m for m in models}


def _discriminator(field: FieldInfo | None) -> str:
    """The tag's key of a tagged union, kept on the field (``head: Head``) or in its annotation (``Head | None``)."""
    if field is None:
        raise TypeError("no field: not a tagged union")
    if isinstance(field.discriminator, str):
        return field.discriminator
    for arg in typing.get_args(field.annotation):
        for meta in getattr(arg, "__metadata__", ()):
            if isinstance(getattr(meta, "discriminator", None), str):
                return meta.discriminator
    raise TypeError(f"{field} is not a tagged union")


def _describe(annotation: Any) -> str:
    """What a value of ``annotation`` looks like, in words: ``int``, ``'auto' or list``, ``int or null``."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(dict.fromkeys(_describe(a) for a in typing.get_args(annotation)))  # once each
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(annotation))
    if origin is list:
        return "list"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))
