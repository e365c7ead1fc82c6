"""Acceptance length and speedup of drafting methods on a benchmark, measured against vanilla decoding.

    python -m eval.acceptance --target assets/demo-target --draft assets/demo-draft \
        --method vanilla,ngram,draft_model --bench assets/data/gsm8k_test.jsonl --limit 8 --out runs/acc

Every method decodes the same prompts through the one verification core (``eval.verify.generate``);
vanilla runs first as the speedup baseline (also when not asked for). ``--out`` gets report.json,
report.md and PNG plots (``eval.report``).
"""

from __future__ import annotations

import argparse
import platform
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from core.models import load_model, load_tokenizer
from core.runtime import prepare_decoding, resolve_device, resolve_dtype, seed_everything
from eval.bench import BenchItem, load_bench, render
from eval.proposers import DFlash, DraftModel, Eagle, Medusa, NGram, Vanilla, check_draft_vocab
from eval.report import write_report
from eval.tree import MC_SIM_7B_63, Tree, load_tree_config
from eval.verify import Proposer, Sampling, generate
from heads import load_head
from heads.common import read_head_config

METHODS = ("vanilla", "ngram", "draft_model", "eagle", "eagle3", "medusa", "dflash")
HEAD_METHODS = ("eagle", "eagle3", "medusa", "dflash")  # a head's config["type"] is its method name
WARMUP_TOKENS = 16


def predicted_speedup(alpha: float, c: float, k: int) -> float:
    """Expected speedup of drafting k tokens per step: (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)).

    Leviathan et al. (2023), chain view: each drafted token is accepted independently with probability
    alpha given its parent was, so one target forward commits 1 + alpha + ... + alpha^k tokens on average
    (the bonus included), and a step costs k draft calls of c target forwards each plus the forward
    itself. A tree is seen as its chain of depths, alpha as the rate at which depth d is accepted once
    depth d - 1 was, so the branching only shows up as a higher alpha.
    """
    expected_tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return expected_tokens / (k * c + 1)


def chain_acceptance(proposed_depths: list[int], accepted: list[int]) -> tuple[list[float | None], float]:
    """(acceptance rate per depth, pooled alpha) from each step's tree depth and accepted draft count.

    Depth d is tried in a step whose tree reaches depth d and which accepted depth d - 1; its rate is
    accepted / tried, None when never tried. The pooled alpha (all accepts over all tries) is the
    maximum-likelihood per-token acceptance of the chain model above, truncated at each step's own depth.
    A step that proposed nothing (an n-gram miss) tries nothing, so for such methods the model, which
    drafts k every step, is optimistic.
    """
    depth = max(proposed_depths, default=0)
    tried = [sum(p >= d and a >= d - 1 for p, a in zip(proposed_depths, accepted)) for d in range(1, depth + 1)]
    hits = [sum(a >= d for a in accepted) for d in range(1, depth + 1)]
    by_depth = [h / t if t else None for h, t in zip(hits, tried)]
    return by_depth, sum(hits) / sum(tried) if sum(tried) else 0.0


def _clock(device: torch.device) -> float:
    if device.type == "cuda":  # kernels run asynchronously: wait for them before reading the clock
        torch.cuda.synchronize(device)
    return time.perf_counter()


class TimedProposer:
    """A proposer wrapper that times drafting apart from the target's forwards (hooked on the target).

    Only decoding steps count: the target's prompt prefill and the drafter's first read of the prompt
    features (``update`` before the first ``propose``) are left out, as the speedup model has no term
    for them. A draft model reads the prompt inside its first ``propose``, which therefore counts.
    """

    def __init__(self, proposer: Proposer, device: torch.device):
        self.proposer, self.device = proposer, device
        self.hidden_layers = proposer.hidden_layers
        self.depths: list[int] = []  # proposed tree depth per step
        self.draft_s = self.target_s = 0.0
        self.target_calls, self.decoding, self._start = 0, False, 0.0

    def reset(self, sampling: Sampling) -> None:
        self.decoding = False
        self.proposer.reset(sampling)

    def propose(self, tokens: torch.Tensor) -> Tree:
        self.decoding = True
        start = _clock(self.device)
        tree = self.proposer.propose(tokens)
        self.draft_s += _clock(self.device) - start
        self.depths.append(int(tree.depths.max()) if len(tree) else 0)
        return tree

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        start = _clock(self.device)
        self.proposer.update(tokens, hidden)
        if self.decoding:
            self.draft_s += _clock(self.device) - start

    def before_forward(self, module, args) -> None:
        self._start = _clock(self.device)

    def after_forward(self, module, args, output) -> None:
        if self.decoding:
            self.target_s += _clock(self.device) - self._start
            self.target_calls += 1


@dataclass
class MethodRun:
    ids: list[str] = field(default_factory=list)  # item ids, in run order
    outputs: list[list[list[int]]] = field(default_factory=list)  # per item: new tokens per turn
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per target forward
    by_category: dict[str, list[int]] = field(default_factory=dict)  # category -> [committed, forwards]
    new_tokens: int = 0
    wall_s: float = 0.0
    timer: TimedProposer | None = None
    peak_memory_mb: float = 0.0


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss: the process's peak resident set so far, in KiB on Linux and bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def decode_item(target, tokenizer, proposer, item: BenchItem, max_new_tokens: int, sampling: Sampling):
    """Yield (new tokens [n], stats) per turn; each turn is asked after the model's own previous answer."""
    messages = list(item.history)
    for turn in item.turns:
        messages.append({"role": "user", "content": turn})
        prompt = render(tokenizer, messages).to(target.device)
        out, stats = generate(target, proposer, prompt, max_new_tokens, sampling, tokenizer.eos_token_id)
        new = out[0, prompt.shape[1] :]
        messages.append({"role": "assistant", "content": tokenizer.decode(new, skip_special_tokens=True)})
        yield new, stats


def run_method(
    target,
    tokenizer,
    proposer: Proposer,
    items: list[BenchItem],
    max_new_tokens: int,
    sampling: Sampling,
    seed: int,
    name: str,
) -> MethodRun:
    """Decode every item with ``proposer``, after an untimed warm-up on the first one."""
    device = target.device
    seed_everything(seed)
    for _ in decode_item(target, tokenizer, proposer, items[0], min(WARMUP_TOKENS, max_new_tokens), sampling):
        pass
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seed_everything(seed)
    run = MethodRun(timer=TimedProposer(proposer, device))
    hooks = [
        target.register_forward_pre_hook(run.timer.before_forward),
        target.register_forward_hook(run.timer.after_forward),
    ]
    try:
        for item in tqdm(items, desc=name, leave=False):
            counts = run.by_category.setdefault(item.category, [0, 0])
            run.ids.append(item.id)
            run.outputs.append([])
            for new, stats in decode_item(target, tokenizer, run.timer, item, max_new_tokens, sampling):
                run.outputs[-1].append(new.tolist())
                run.accepted.extend(n - 1 for n in stats.accepted_lengths)
                counts[0] += sum(stats.accepted_lengths)
                counts[1] += stats.target_forwards
                run.new_tokens += len(new)
                run.wall_s += stats.wall_time  # generate()'s own clock: prefill + decoding, not the chat template
    finally:
        for hook in hooks:
            hook.remove()
    run.peak_memory_mb = _peak_memory_mb(device)
    return run


def summarize(run: MethodRun, baseline: MethodRun, greedy: bool) -> dict:
    """The report entry of one method (stable keys; see ``eval.report``)."""
    timer = run.timer
    by_depth, alpha = chain_acceptance(timer.depths, run.accepted)
    k = max(timer.depths, default=0)
    forward_s = timer.target_s / max(timer.target_calls, 1)
    # c: one draft call's cost in target forwards, with k draft calls per step.
    c = timer.draft_s / max(len(timer.depths), 1) / (k * forward_s) if k and forward_s else 0.0
    tokens_per_s = run.new_tokens / run.wall_s if run.wall_s else 0.0
    base_tokens_per_s = baseline.new_tokens / baseline.wall_s if baseline.wall_s else 0.0
    mismatched = [i for i, out, ref in zip(run.ids, run.outputs, baseline.outputs) if out != ref] if greedy else []
    return {
        "tau": sum(run.accepted) / max(len(run.accepted), 1) + 1,
        "acceptance_by_depth": by_depth,
        "alpha": alpha,
        "mean_accepted": sum(run.accepted) / max(len(run.accepted), 1),
        "target_forwards": len(run.accepted),
        "new_tokens": run.new_tokens,
        "wall_s": run.wall_s,
        "tokens_per_s": tokens_per_s,
        "speedup_vs_vanilla": tokens_per_s / base_tokens_per_s if base_tokens_per_s else 0.0,
        "draft_depth": k,
        "draft_cost_ratio": c,
        "target_forward_ms": forward_s * 1e3,
        "predicted_speedup": predicted_speedup(alpha, c, k),
        "peak_memory_mb": run.peak_memory_mb,
        "greedy_identical": not mismatched if greedy else None,
        "mismatched_prompts": mismatched,
        "per_category": {
            cat: {"tau": committed / max(forwards, 1), "target_forwards": forwards}
            for cat, (committed, forwards) in run.by_category.items()
        },
    }


# A greedy mismatch is a near-tie when the target's two candidate logits differ by less than this many
# units in the last place of the compute dtype (at the logits' scale): reduced precision (bf16) rounds a
# tree forward and a one-token forward differently, and such a gap is inside that rounding.
NEAR_TIE_ULPS = 4


@torch.no_grad()
def divergence(target, tokenizer, item: BenchItem, ref_turns: list[list[int]], out_turns: list[list[int]]) -> dict:
    """Where a method's greedy output first leaves vanilla's: turn, token index, both tokens, and the
    target's logit gap between them there (one full forward over the shared prefix), with ``near_tie``."""
    messages = list(item.history)
    for turn_index, (turn, ref, out) in enumerate(zip(item.turns, ref_turns, out_turns)):
        messages.append({"role": "user", "content": turn})
        if ref != out:
            at = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
            entry = {"prompt": item.id, "turn": turn_index, "token": at}
            if at == min(len(ref), len(out)):  # one output is a prefix of the other: a stop, not a token choice
                return entry | {"vanilla_token": None, "method_token": None, "logit_gap": None, "near_tie": False}
            prompt = render(tokenizer, messages).to(target.device)[0]
            ids = torch.cat((prompt, torch.tensor(ref[:at], dtype=prompt.dtype, device=prompt.device)))
            logits = target(ids[None]).logits[0, -1].float()
            gap = float(logits[ref[at]] - logits[out[at]])
            tolerance = NEAR_TIE_ULPS * torch.finfo(target.dtype).eps * float(logits.abs().max())
            return entry | {
                "vanilla_token": ref[at],
                "method_token": out[at],
                "logit_gap": gap,
                "near_tie": abs(gap) <= tolerance,
            }
        messages.append({"role": "assistant", "content": tokenizer.decode(ref, skip_special_tokens=True)})
    raise ValueError(f"{item.id}: outputs do not differ")


def heads_by_method(head_dirs: list[str]) -> dict[str, str]:
    """Method name (the head's config type) -> head folder; reads only the configs."""
    found: dict[str, str] = {}
    for head_dir in head_dirs:
        head_type = read_head_config(head_dir)["type"]
        if head_type not in HEAD_METHODS:
            raise ValueError(f"--head {head_dir}: unknown head type {head_type!r}; known: {list(HEAD_METHODS)}")
        if head_type in found:
            raise ValueError(f"--head {head_dir} and {found[head_type]} are both {head_type} heads; give one")
        found[head_type] = head_dir
    return found


def check_methods(methods: list[str], heads: dict[str, str], draft: str | None) -> None:
    """Fail before loading anything when a method lacks what it needs (or a head would go unused)."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known: {list(METHODS)}")
    for method in methods:
        if method in HEAD_METHODS and method not in heads:
            given = f" (given: {', '.join(f'{d} is {t}' for t, d in heads.items())})" if heads else ""
            raise ValueError(f"method {method!r} needs a --head whose config type is {method!r}{given}")
    if "draft_model" in methods and not draft:
        raise ValueError("method 'draft_model' needs --draft PATH (a small LM with the target's tokenizer)")
    unused = [d for t, d in heads.items() if t not in methods]
    if unused:
        raise ValueError(f"--head {', '.join(unused)} given but its method is not in --method")


def build_proposer(method: str, args: argparse.Namespace, draft, heads: dict) -> Proposer:
    """The proposer of ``method`` with the tree flags (``--tree``: None = each method's usual shape)."""
    if method == "vanilla":
        return Vanilla()
    if method == "ngram":
        return NGram(k=args.depth)
    if method == "draft_model":
        if args.tree == "dynamic":
            return DraftModel(draft, k=args.depth, top_k=args.top_k_draft, total_tokens=args.total_tokens)
        return DraftModel(draft, k=args.depth)
    if method == "medusa":
        head = heads[method]
        depth = min(args.depth, head.config["num_heads"])
        # MC_SIM_7B_63 lists paths by how often they are accepted, parents first: a prefix is a smaller tree.
        choices = [c for c in MC_SIM_7B_63 if len(c) <= depth][: args.total_tokens]
        return Medusa(head, choices)
    if method in args.tree_configs:
        return proposer_for_tree(heads[method], args.tree_configs[method])
    if method == "dflash":  # one forward drafts every depth: a chain (a tuned tree.json: a static tree)
        head = heads[method]
        return DFlash(head, choices=[[0] * d for d in range(1, min(args.depth, head.config["block_size"] - 1) + 1)])
    if args.tree == "static":  # a chain of depth: the one-wide dynamic tree
        return Eagle(heads[method], top_k=1, depth=args.depth, total_tokens=args.depth)
    return Eagle(heads[method], top_k=args.top_k_draft, depth=args.depth, total_tokens=args.total_tokens)


def proposer_for_tree(head, config: dict) -> Eagle | DFlash:
    """An EAGLE or DFlash proposer drafting the tree of a tree.json config (``eval.tree.TREE_KEYS``)."""
    if head.config["type"] == "dflash":
        if config["shape"] != "static":
            raise ValueError("a DFlash head drafts static trees only (every depth comes from one forward)")
        return DFlash(head, choices=config["choices"])
    if config["shape"] == "static":
        return Eagle(head, choices=config["choices"])
    return Eagle(head, top_k=config["top_k"], depth=config["depth"], total_tokens=config["total_tokens"])


def tree_configs(heads: dict[str, str], tree: str | Path | None) -> dict[str, dict]:
    """EAGLE or DFlash method -> the tree.json it decodes with: ``--tree FILE``, else its head folder's tree.json (as
    ``eval.autotune --write-head`` leaves it); methods without one use the tree flags."""
    found = {}
    for method, head_dir in heads.items():
        path = tree if isinstance(tree, Path) else Path(head_dir) / "tree.json"
        if method in ("eagle", "eagle3", "dflash") and tree not in ("static", "dynamic") and path.is_file():
            found[method] = load_tree_config(path)
    return found


def training_predicted_tau(head_dir: str) -> float | None:
    """The chain tau the head's training predicted from held-out top-1 accuracies, when it recorded one."""
    return read_head_config(head_dir).get("training", {}).get("predicted_tau")


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")  # Linux names the model here; platform.processor() often is empty
    if cpuinfo.is_file():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    return f"{cpu}, {torch.get_num_threads()} torch threads"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _tree(text: str) -> str | Path:
    if text in ("static", "dynamic"):
        return text
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"expected static, dynamic or a tree.json file; no file {text}")
    return Path(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.acceptance", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="target model folder or hub id")
    p.add_argument("--head", action="append", default=[], help="head folder(s); repeat or comma-separate")
    p.add_argument("--draft", help="draft model for method draft_model")
    p.add_argument(
        "--allow-other-tokenizer",
        action="store_true",
        help="evaluate heads trained with another tokenizer than the target's (refused by default)",
    )
    p.add_argument("--method", required=True, help=f"comma-separated, of: {', '.join(METHODS)}")
    p.add_argument("--bench", required=True, help="JSONL: Spec-Bench, GSM8K, messages or prompt records")
    p.add_argument("--limit", type=_positive, help="prompts to run, round-robin over categories")
    p.add_argument("--max-new-tokens", type=_positive, default=128, help="per turn")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument(
        "--tree",
        type=_tree,
        help="static: chains (Medusa: its fixed tree); dynamic: EAGLE-2 trees for draft_model and EAGLE "
        "(n-gram and DFlash stay chains, Medusa a fixed tree); a tree.json FILE (eval.autotune): the tree of "
        "EAGLE and DFlash methods (DFlash: static ones); default: chains for ngram/draft_model/DFlash, EAGLE and "
        "DFlash a head folder's tree.json, else EAGLE dynamic",
    )
    p.add_argument("--top-k-draft", type=_positive, default=8, help="children per node in dynamic trees")
    p.add_argument("--depth", type=_positive, default=5, help="draft length / tree depth")
    p.add_argument("--total-tokens", type=_positive, default=48, help="tree nodes kept (dynamic and Medusa trees)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto|cpu|cuda")
    p.add_argument("--dtype", default="fp32", help="fp32|bf16")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    args.method = [m.strip() for m in args.method.split(",") if m.strip()]
    args.head = [h.strip() for arg in args.head for h in arg.split(",") if h.strip()]
    return args


def _describe(d: dict) -> str:
    if d["logit_gap"] is None:
        return "one output stops where the other goes on"
    kind = "a near-tie (reduced-precision rounding)" if d["near_tie"] else "NOT a near-tie: a bug"
    return f"vanilla {d['vanilla_token']} vs {d['method_token']}, target logit gap {d['logit_gap']:.4f}: {kind}"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    head_dirs = heads_by_method(args.head)
    check_methods(args.method, head_dirs, args.draft)
    items = load_bench(args.bench, args.limit)
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    prepare_decoding(device)
    target, tokenizer = load_model(args.target, device, dtype), load_tokenizer(args.target)
    draft = load_model(args.draft, device, dtype) if "draft_model" in args.method else None
    if draft is not None:
        check_draft_vocab(draft, target, args.draft, args.target)
    heads = {m: load_head(d, target, tokenizer, args.allow_other_tokenizer).to(dtype) for m, d in head_dirs.items()}
    args.tree_configs = tree_configs(head_dirs, args.tree)
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    order = ["vanilla"] + [m for m in args.method if m != "vanilla"]  # the baseline first
    runs = {}
    for method in tqdm(order, desc="methods"):
        proposer = build_proposer(method, args, draft, heads)
        runs[method] = run_method(target, tokenizer, proposer, items, args.max_new_tokens, sampling, args.seed, method)
    methods = {
        m: summarize(run, runs["vanilla"], sampling.greedy)
        | {
            "requested": m in args.method,
            "predicted_tau": training_predicted_tau(head_dirs[m]) if m in head_dirs else None,
            "tree_config": args.tree_configs.get(m),
        }
        for m, run in runs.items()
    }
    by_id = {item.id: item for item in items}
    for method, entry in methods.items():
        outputs = dict(zip(runs[method].ids, runs[method].outputs))
        vanilla = dict(zip(runs["vanilla"].ids, runs["vanilla"].outputs))
        entry["divergences"] = [
            divergence(target, tokenizer, by_id[i], vanilla[i], outputs[i]) for i in entry["mismatched_prompts"]
        ]
    report = {
        "target": str(args.target),
        "draft": args.draft,
        "heads": head_dirs,
        "bench": str(args.bench),
        "limit": args.limit,
        "prompts": len(items),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "tree": {
            "shape": str(args.tree) if args.tree else None,
            "top_k_draft": args.top_k_draft,
            "depth": args.depth,
            "total": args.total_tokens,
        },
        "seed": args.seed,
        "device": str(device),
        "dtype": args.dtype,
        "machine": machine(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "methods": methods,
    }
    print(write_report(report, args.out))
    if "vanilla" not in args.method:
        print("note: vanilla was not requested; it ran anyway as the speedup baseline", file=sys.stderr)
    for method, entry in methods.items():
        if entry["greedy_identical"] is False:
            print(
                f"WARNING: {method} is NOT identical to vanilla greedy decoding on "
                f"{len(entry['mismatched_prompts'])} prompt(s): {entry['mismatched_prompts']}",
                file=sys.stderr,
            )
            for d in entry["divergences"]:
                print(f"  {d['prompt']} turn {d['turn']} token {d['token']}: {_describe(d)}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
