"""Acceptance measured while training: the current head drafts, the target verifies, through the decoding engine.

At each held-out evaluation (``train.eval_every``) the head decodes ``train.eval_prompts`` prompts greedily,
``train.eval_new_tokens`` new tokens each, drafting chains at the depth it was trained for
(``HeadConfig.trained_depth``; Medusa: its usual tree of that depth) with the same ``decoding.methods.build_proposer``
and ``decoding.verify.generate`` that ``eval.acceptance`` runs. The cost is fixed: prompts x new tokens target
positions per evaluation, split over the data-parallel groups.

The prompts are the held-out samples' own (a chat: everything before its first assistant token; a text: its first
half, ``data_recipes.prompts.text_prompt_length``) or, with ``train.eval_bench``, the first turn of a benchmark's
first prompts. They are written once, as token ids, to ``<train.out_dir>/eval_prompts.jsonl``, so
``acceptance_command`` repeats a measurement exactly with ``eval.acceptance``.

``train.keep_best: measured_tau`` keeps the head of the best measured tau in ``<out_dir>/best/head`` (its record
in ``best.json``) and makes it the exported ``<out_dir>/head`` when training ends. The record is bound to that head
as a checkpoint's ``COMPLETE`` is to its files: it holds the sha256 of each of the head's files
(``train.checkpoint.digest_problems``), and its values are checked (a step, a finite tau the head's depth allows)
when a run resumes and again before the export; a record that fails is refused, naming the file.
"""

from __future__ import annotations

import contextlib
import json
import math
import shlex
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from headstart.core.acceptance import chain_acceptance
from headstart.core.io import atomic_dir, atomic_write_text
from headstart.core.models import load_tokenizer
from headstart.data_recipes.bench import check_positions, check_token_ids, load_bench, turn_prompt
from headstart.data_recipes.prompts import data_prompt_format, text_prompt_length
from headstart.decoding.methods import TreeSettings, build_proposer
from headstart.decoding.proposers import DepthRecorder
from headstart.decoding.tree_config import TreeSpec
from headstart.decoding.verify import Sampling, generate
from headstart.heads import DraftHead, drafting_of
from headstart.train.checkpoint import digest_problems, file_digests, save_head_files
from headstart.train.data import TrainData, token_rows
from headstart.train.train_config import TrainConfig, measures_acceptance

PROMPTS_FILE = "eval_prompts.jsonl"
BEST_RECORD = "best.json"


def sample_prompt(input_ids: list[int], loss_mask: list[int]) -> list[int]:
    """A training sample's prompt: the tokens before its first loss token (a chat's system and user turns and the
    assistant header), or for a text (every token in the loss) its first ``text_prompt_length`` tokens."""
    first = next((i for i, m in enumerate(loss_mask) if m), len(loss_mask))
    return input_ids[:first] if first else input_ids[: text_prompt_length(len(input_ids))]


def heldout_prompts(data: TrainData, count: int) -> list[list[int]]:
    """The prompts of the first ``count`` held-out samples (in sample order)."""
    rows = token_rows(data.dataset, data.heldout_ids[:count])
    return [sample_prompt(ids.tolist(), mask.tolist()) for ids, mask in rows]


def bench_prompts(path: str, count: int, tokenizer: PreTrainedTokenizerBase, prompt_format: str) -> list[list[int]]:
    """The first turn of the first ``count`` prompts of a benchmark file (round-robin over its categories), as the
    head's data reached the target (``prompt_format``)."""
    return [turn_prompt(tokenizer, item, [], prompt_format)[0].tolist() for item in load_bench(path, count)]


def check_eval_bench(cfg: TrainConfig) -> None:
    """Refuse a ``train.eval_bench`` that ``eval.acceptance`` would refuse, before any model loads or step runs, by
    its own rule (``check_token_ids``, ``check_positions``): ids past the target's vocabulary would fail in the
    embedding after the first step with a bare IndexError, prompts past its positions would be measured anyway.
    Checked as training decodes them (each item's first turn, ``train.eval_new_tokens``) and with the tree budget
    of the ``acceptance_command`` it prints, so that command measures the same file too."""
    train = cfg.train
    if not (measures_acceptance(train) and train.eval_bench):
        return
    tokenizer = load_tokenizer(cfg.target.path)
    positions = AutoConfig.from_pretrained(cfg.target.path).get_text_config().max_position_embeddings
    try:
        items = [replace(item, turns=item.turns[:1]) for item in load_bench(train.eval_bench, train.eval_prompts)]
        check_token_ids(tokenizer, items)
        tree_tokens = TreeSettings.model_fields["total_tokens"].default
        prompts = data_prompt_format(cfg.data.format)
        check_positions(tokenizer, items, train.eval_new_tokens, tree_tokens, positions, prompts)
    except (ValueError, FileNotFoundError) as err:
        kind = FileNotFoundError if isinstance(err, FileNotFoundError) else ValueError
        where = f"train.eval_bench {train.eval_bench}"
        raise kind(f"{where}: {err} (measured with train.eval_new_tokens={train.eval_new_tokens})") from None


@dataclass
class Decoded:
    """What a set of greedy decodes adds up to: accepted draft tokens and proposed depth per target forward."""

    accepted: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    new_tokens: int = 0
    prompts: int = 0

    def merge(self, other: Decoded) -> None:
        self.accepted += other.accepted
        self.depths += other.depths
        self.new_tokens += other.new_tokens
        self.prompts += other.prompts


def head_flags(head: DraftHead) -> TreeSpec:
    """The drafting ``acceptance_command`` names: static chains at the head's trained depth (Medusa: its tree)."""
    return TreeSettings.model_validate({"tree": "static", "depth": head.config.trained_depth}).tree_spec()


@torch.no_grad()
def decode_prompts(
    target: PreTrainedModel, head: DraftHead, prompts: list[list[int]], new_tokens: int, eos_token_id: int | None
) -> Decoded:
    """Greedy speculative decoding of each prompt with ``head`` drafting, through the one verification core."""
    method = drafting_of(head.config).method
    proposer = DepthRecorder(build_proposer(method, head_flags(head), heads={method: head}))
    decoded = Decoded()
    for prompt in prompts:
        ids = torch.tensor([prompt], device=target.device)
        out, stats = generate(target, proposer, ids, new_tokens, Sampling(temperature=0.0), eos_token_id)
        decoded.accepted += [n - 1 for n in stats.accepted_lengths]
        decoded.new_tokens += out.shape[1] - ids.shape[1]
        decoded.prompts += 1
    decoded.depths = proposer.depths
    return decoded


def measured_record(step: int, decoded: Decoded, seconds: float) -> dict[str, Any]:
    """metrics.jsonl's record of one measurement (split ``measured``): tau as ``eval.acceptance`` reports it, the
    acceptance rate at each draft depth (``acc_depth_<d>``), the pooled alpha and what it cost."""
    by_depth, alpha = chain_acceptance(decoded.depths, decoded.accepted)
    forwards = len(decoded.accepted)
    return {
        "step": step,
        "split": "measured",
        "tau": sum(decoded.accepted) / max(forwards, 1) + 1,
        **{f"acc_depth_{d}": rate for d, rate in enumerate(by_depth, start=1) if rate is not None},
        "alpha": alpha,
        "target_forwards": forwards,
        "prompts": decoded.prompts,
        "new_tokens": decoded.new_tokens,
        "seconds": seconds,
    }


class MeasuredAcceptance:
    """The measurement of one run: its prompts (written to ``eval_prompts.jsonl`` by rank 0), the target, and the
    data-parallel split: each group decodes its share, in lockstep within a tensor-parallel group."""

    def __init__(
        self,
        cfg: TrainConfig,
        target: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        data: TrainData,
        prompt_format: str,
        rank: int,
        tp_size: int,
    ) -> None:
        train = cfg.train
        self.target, self.new_tokens, self.eos = target, train.eval_new_tokens, tokenizer.eos_token_id
        count = train.eval_prompts
        if train.eval_bench:
            self.prompts = bench_prompts(train.eval_bench, count, tokenizer, prompt_format)
            self.category = "bench"
        else:
            self.prompts = heldout_prompts(data, count)
            self.category = "heldout"
        self.out_dir = Path(train.out_dir)
        self.target_path = cfg.target.path
        self.first_of_group = rank % tp_size == 0
        if rank == 0:
            lines = [json.dumps({"input_ids": p, "category": self.category}) for p in self.prompts]
            atomic_write_text(self.out_dir / PROMPTS_FILE, "".join(line + "\n" for line in lines))

    def __call__(
        self, engine: deepspeed.DeepSpeedEngine, head: DraftHead, step: int, dp_rank: int, dp_world: int
    ) -> dict[str, Any]:
        """Measure the head as it is after ``step`` (every rank calls; all get the record)."""
        engine.eval()
        start = time.perf_counter()
        params = list(engine.module.parameters())
        # ZeRO-3 keeps a slice of each weight per rank: decode with whole ones.
        with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
            mine = decode_prompts(self.target, head, self.prompts[dp_rank::dp_world], self.new_tokens, self.eos)
        engine.train()
        shares: list[Any] = [None] * dist.get_world_size()
        # The ranks of a tensor-parallel group decoded the same prompts: count each group once.
        dist.all_gather_object(shares, mine if self.first_of_group else Decoded())
        total = Decoded()
        for share in shares:
            total.merge(share)
        return measured_record(step, total, time.perf_counter() - start)

    def command(self, head: DraftHead) -> str:
        """The ``eval.acceptance`` command that measures ``<out_dir>/head`` on the same prompts the same way, each
        value quoted for the shell (a path with a space or a ``;`` stays one argument when the line is pasted)."""
        return shlex.join(
            ["python", "-m", "eval.acceptance", "--target", str(self.target_path), "--head", str(self.out_dir / "head")]
            + ["--method", drafting_of(head.config).method, "--bench", str(self.out_dir / PROMPTS_FILE)]
            + ["--max-new-tokens", str(self.new_tokens), "--tree", "static", "--depth", str(head.config.trained_depth)]
            + ["--out", str(self.out_dir / "measured-eval")]
        )


# ------------------------------------------------------------------------------------------- keep best


def read_best(out_dir: Path, depth: int | None = None) -> dict[str, Any] | None:
    """``best.json``'s record, None without one; ValueError naming the file, key and value when it is not the record
    training writes: ``step`` a step number, ``measured_tau`` finite and within what a head drafting ``depth``
    tokens a step can reach (1 to depth + 1), ``files`` the sha256 of each file of its head."""
    path = out_dir / BEST_RECORD
    if not path.is_file():
        return None
    try:
        best = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not JSON ({err}): remove it (and {out_dir / 'best'}) to measure afresh") from None
    files = best.get("files") if isinstance(best, dict) else None
    if not (isinstance(files, dict) and all(isinstance(v, str) for v in files.values())):
        raise ValueError(
            f"{path} is not a best-head record ({{'step': int, 'measured_tau': float, 'files': {{name: sha256}}}}; "
            f"one written before heads were bound by digest, or altered): remove it and {out_dir / 'best'}"
        )
    problems = _value_problems(best, depth)
    if problems:
        raise ValueError(f"{path}: {'; '.join(problems)}: remove it and {out_dir / 'best'} to measure afresh")
    return best


def _value_problems(best: dict[str, Any], depth: int | None) -> list[str]:
    # type() over isinstance: JSON's true is a Python bool, an int to isinstance, never a step.
    step, tau = best.get("step"), best.get("measured_tau")
    problems = [] if type(step) is int and step >= 1 else [f"step is {step!r}, not a step number >= 1"]
    # A step accepts at most the head's depth of drafted tokens plus the target's own: tau <= depth + 1.
    top = math.inf if depth is None else depth + 1
    if not (type(tau) is float and math.isfinite(tau) and 1 <= tau <= top):
        bound = "" if depth is None else f" and at most {top} (the head drafts {depth} tokens a step)"
        problems.append(f"measured_tau is {tau!r}, not a finite tau >= 1{bound}")
    return problems


def verified_best(out_dir: Path, depth: int | None = None) -> dict[str, Any] | None:
    """``read_best``'s record once ``<out_dir>/best/head`` holds exactly the files it names (``step`` and
    ``measured_tau`` only: what training compares); ValueError naming each file missing, added or altered."""
    best = read_best(out_dir, depth)
    if best is None:
        return None
    head = out_dir / "best" / "head"
    problems = digest_problems(head, best["files"], str(out_dir / BEST_RECORD))
    if not head.is_dir():
        problems.insert(0, f"{head} is missing")
    if problems:
        raise ValueError(
            f"{'; '.join(problems)}: {out_dir / 'best'} does not hold the head {out_dir / BEST_RECORD} records; "
            f"restore it, or remove both to measure afresh"
        )
    return {"step": best["step"], "measured_tau": best["measured_tau"]}


def forget_best_after(out_dir: Path, step: int, depth: int | None = None) -> dict[str, Any] | None:
    """The best record a resumed run keeps: one made at or before its checkpoint ``step`` (0: a fresh run keeps
    none), checked now (``verified_best``), before any step, not at the export after the last. A best recorded
    after it belongs to steps the resumed run redoes, so it is dropped with its head (they are measured again).
    Every rank reads it; any may remove it."""
    best = read_best(out_dir, depth)
    if best is not None and (step == 0 or best["step"] > step):
        (out_dir / BEST_RECORD).unlink(missing_ok=True)
        shutil.rmtree(out_dir / "best", ignore_errors=True)
        return None
    return verified_best(out_dir, depth)


def is_better(record: dict[str, Any], best: dict[str, Any] | None) -> bool:
    return best is None or record["tau"] > best["measured_tau"]


def write_best(out_dir: Path, best: dict[str, Any], head: Path | None = None) -> None:
    """``best.json``: ``best`` and the sha256 of each file of its head (``head``: ``<out_dir>/best/head``)."""
    files = file_digests(head or out_dir / "best" / "head")
    atomic_write_text(out_dir / BEST_RECORD, json.dumps({**best, "files": files}) + "\n")


def keep_best_head(
    engine: deepspeed.DeepSpeedEngine, out_dir: Path, step: int, tau: float, save_artifacts: Callable[[Path], None]
) -> dict[str, Any]:
    """Keep the head as it is after ``step`` (its measured ``tau`` the best yet) in ``<out_dir>/best`` with its
    record (every rank calls). The record is written while the head is still a temporary folder, which then
    replaces ``best``: a kill between the two leaves a record of a step past every checkpoint (this step's is
    written after), which a resume drops with ``best`` (``forget_best_after``), never a kept record beside a head
    that is not its own."""
    best = {"step": step, "measured_tau": tau}
    first = dist.get_rank() == 0
    staged = atomic_dir(out_dir / "best") if first else contextlib.nullcontext(out_dir / "best")
    with staged as folder:
        save_head_files(engine, folder, save_artifacts)
        if first:
            write_best(out_dir, best, folder / "head")
    dist.barrier()
    return best


def export_best(out_dir: Path) -> None:
    """Make the best head the exported ``<out_dir>/head`` (one rename: a reader sees the old or the new), once it
    verifies against its record again."""
    if verified_best(out_dir) is None:
        raise FileNotFoundError(
            f"{out_dir / BEST_RECORD} is missing: the best head's record was removed during the run"
        )
    with atomic_dir(out_dir / "head") as tmp:
        shutil.copytree(out_dir / "best" / "head", tmp, dirs_exist_ok=True)
