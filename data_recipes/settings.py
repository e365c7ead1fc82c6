"""The data stage's settings: the target, the dataset, the hidden-state capture and the regeneration of a
dataset's replies (``core.settings``: every key's type, range and default), and the roots of the two commands
that read them, ``CaptureConfig`` (``python -m data_recipes.capture``) and ``RegenerateConfig``
(``python -m data_recipes.regenerate``). Training reads ``Target``, ``Data`` and ``Capture`` too.
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

from pydantic import Field, field_serializer, field_validator, model_validator
from pydantic_core import PydanticCustomError

from headstart.core.settings import (
    AUTO_ATTENTION,
    AttentionKernel,
    Count,
    Device,
    Dtype,
    Float,
    Folder,
    NonNegative,
    NonNegativeFloat,
    Positive,
    Section,
    Stage,
    StoreDtype,
    one_of,
)
from headstart.data_recipes.formats import FORMATS

if TYPE_CHECKING:
    FormatName = str
else:
    FormatName = one_of(FORMATS)


class Target(Section):
    path: str  # a local folder or a hub id
    device: Device = "auto"  # cuda when present, else cpu
    dtype: Dtype = "fp32"  # the frozen target's compute dtype
    tp_size: Count = 1  # processes one copy of the target is split across (torchrun; docs/TRAINING.md)
    # auto: SDPA where transformers has it for the family, else the family's default (gpt-oss: eager); or
    # eager, sdpa, flash_attention_2, flex_attention, a hub kernel (core.models.attention_implementation)
    attn_implementation: AttentionKernel = AUTO_ATTENTION


class Data(Section):
    source: str  # a .jsonl/.json/.parquet file or a hub dataset id
    format: FormatName
    max_length: Count | None = None  # tokens per sample; required where samples are tokenized
    on_error: Literal["raise", "skip"] = "raise"
    limit: Count | None = None  # samples kept (over_length split: each piece counts); null: every record
    # A conversation past max_length: truncate (kept up to it), split (into samples at its turn ends, each without
    # the turns before it), or refuse (a bad record, under on_error). Each is counted in the printed report.
    over_length: Literal["truncate", "split", "refuse"] = "truncate"
    # A folder images may also be read from, besides the data file's own (data_recipes.images); null: that one only
    image_dir: Folder | None = None


class TokenizedData(Data):
    max_length: Count


class Capture(Section):
    out_dir: Folder | None = None  # the shards; training may compute the states online instead
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
    # The folder the server at base_url writes its hidden-states files to (its shared_storage_path), as seen
    # here: the only folder the capture reads and deletes a server-named file in (required with base_url).
    states_dir: Folder | None = None
    model: str | None = None  # the served model name; null: target.path
    concurrency: Count = 8  # requests in flight (the server batches them)
    # per request: no answer within it is a failed attempt; also the longest wait for a states file's lock
    timeout_s: Positive = 600.0
    retries: NonNegative = 3  # per request, after connection errors, timeouts and 5xx/429 answers

    @field_validator("base_url")
    @classmethod
    def _an_http_url(cls, url: str | None) -> str | None:
        # Regenerate's rule, the one rule for a server's URL; and a port in range, which that rule leaves to the
        # first request. The error shows the URL without its password (the value is not echoed).
        from headstart.data_recipes.engine_client import redacted_url  # it imports this module

        shown = {"url": repr(redacted_url(url or ""))}
        try:
            Regenerate._an_http_url(url)
        except PydanticCustomError as err:
            raise PydanticCustomError("value", "{rule}, got {url}", {"rule": err.message(), **shown}) from None
        try:
            _ = urllib.parse.urlsplit(url or "").port  # a ValueError past 65535 or on a port not a number
        except ValueError as err:
            raise PydanticCustomError(
                "value", "must have a port in 0..65535, got {url} ({why})", {"why": str(err), **shown}
            ) from None
        return url

    @field_serializer("base_url", when_used="json")
    def _without_password(self, url: str | None) -> str | None:
        # What a saved config (capture_config.yaml, a training run's config.yaml) records: never a password.
        from headstart.data_recipes.engine_client import redacted_url

        return url if url is None else redacted_url(url)

    @model_validator(mode="after")
    def _a_server_only_for_the_vllm_engine(self) -> Capture:
        if self.engine == "hf" and self.base_url:
            raise PydanticCustomError(
                "section_rule", "base_url is only read by engine 'vllm' (set engine: vllm to capture through it)"
            )
        if self.engine == "vllm" and self.base_url and not self.states_dir:
            raise PydanticCustomError(
                "section_rule",
                "states_dir is required with base_url: the folder that server writes its hidden-states files to "
                "(its kv_transfer_config shared_storage_path), as seen here; no other file is read or deleted",
            )
        if self.states_dir and not self.base_url:
            raise PydanticCustomError(
                "section_rule",
                "states_dir is only read with base_url (a server started here writes under out_dir/engine)",
            )
        if self.states_dir and self.out_dir and _nested(Path(self.states_dir), Path(self.out_dir)):
            raise PydanticCustomError(
                "section_rule",
                "states_dir {states} and out_dir {out} are one folder or one inside the other: the capture deletes "
                "the server's files in states_dir and writes shards in out_dir, so keep them apart",
                {"states": repr(self.states_dir), "out": repr(self.out_dir)},
            )
        return self


def _nested(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are the same folder or one holds the other (as the file system resolves them)."""
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents


class CaptureToDisk(Capture):
    out_dir: Folder


class Generation(Section):
    """How the target generates a reply or a continuation, here or on a server."""

    max_new_tokens: Count
    temperature: NonNegativeFloat = 0.0  # 0: greedy
    top_p: Annotated[Float, Field(gt=0, le=1)] = 1.0
    top_k: NonNegative = 0  # 0: no top-k cut
    seed: NonNegative = 0


class Regenerate(Generation):
    out: Folder  # the regenerated dataset: OpenAI-messages JSONL, or {"text": ...} JSONL for data.format text
    chunk_size: Count = 64  # conversations per resumable part
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


class CaptureConfig(Stage):
    command: ClassVar[str] = "capture"
    target: Target
    data: TokenizedData
    capture: CaptureToDisk
    regenerate: Regenerate | None = None


class RegenerateConfig(Stage):
    command: ClassVar[str] = "regenerate"
    target: Target
    data: Data
    regenerate: Regenerate
    capture: Capture | None = None
