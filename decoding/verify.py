"""The one verification core: a proposer's tree -> one target forward -> the accepted path + a bonus token.

KV layout (as in gpt-fast): the target's cache holds every committed token EXCEPT the newest one, the
pending root. A step feeds [root, tree nodes...] in one forward with a tree attention mask and tree
position ids; the root's row scores the first level, node i's row scores node i's children. The
accepted rows (root + path) are gathered into place right after the prefix and the rest is cropped,
so nothing is recomputed; the bonus token becomes the next pending root. An empty tree is plain
autoregressive decoding through the same code.

Acceptance:
- greedy (temperature 0): a node is accepted when it equals the target's argmax at its parent, so the
  output is the target's own greedy decoding token for token;
- exact sampling: multi-draft rejection sampling over siblings (SpecInfer / EAGLE), lossless, see ``_walk``;
- typical (``acceptance="typical"``): Medusa's typical acceptance. LOSSY: the output distribution is
  not the target's; it trades fidelity for acceptance length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import Cache, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from headstart.decoding.static_cache import StaticCache, bucket, span_buffer, static_decoding
from headstart.decoding.target_cache import (
    States,
    commit_rows,
    crop_attention,
    layer_masks,
    new_cache,
    recurrent_target,
    restore_states,
    snapshot_states,
    target_forward,
    why_chains,
)
from headstart.decoding.tree import Tree, additive_mask, capped, empty_tree, is_chain, tree_batch_inputs
from headstart.decoding.tree_config import Schedule, scheduled_depth


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    acceptance: str = "exact"  # "exact" (lossless) or "typical" (Medusa, lossy)
    typical_threshold: float = 0.09  # Medusa's posterior_threshold
    typical_alpha: float = 0.3  # Medusa's posterior_alpha

    def __post_init__(self) -> None:
        if self.acceptance not in ("exact", "typical"):
            raise ValueError(f"acceptance must be 'exact' or 'typical', got {self.acceptance!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The sampling distribution [..., V] of ``logits``: temperature, then top-k, then top-p (nucleus)."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        # Drop a token once the more likely ones already hold top_p of the mass (the first always stays).
        sorted_probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        logits = logits.masked_fill(torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted), float("-inf"))
    return logits.softmax(-1)


class Proposer(Protocol):
    """What the generation loop needs from a drafting method."""

    # Target ``hidden_states`` indices the proposer reads (HF convention: i < L is the input of decoder
    # layer i, L the final normed state); () when it needs none, so the target skips returning them.
    hidden_layers: tuple[int, ...]

    def reset(self, sampling: Sampling) -> None:
        """Start a new sequence: drop caches, remember whether to draft greedily or by sampling."""

    def propose(self, tokens: torch.Tensor) -> Tree:
        """A tree below ``tokens[-1]`` (the pending root) given every committed token [T]."""

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """After a commit: ``tokens`` [T] committed so far, ``hidden`` [m, ...] the target's states (per
        ``hidden_layers``, concatenated) of the m rows just added to the target's cache, i.e. of tokens
        ``tokens[T-1-m : T-1]``, or None when the proposer asked for none."""


@dataclass
class Stats:
    target_forwards: int = 0  # verification forwards (the prompt's prefill is not counted)
    # Forwards that rebuilt a recurrent target's state after a rejected draft (``replay``): not verification, so
    # not in tau, but in the wall time (tokens/s and speedups count them).
    replay_forwards: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # tokens committed per forward, bonus included
    depth_accepts: list[int] = field(default_factory=list)  # [d - 1]: forwards that accepted a depth-d node
    wall_time: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward (1.0 for plain decoding)."""
        return sum(self.accepted_lengths) / max(self.target_forwards, 1)

    def record(self, accepted: int) -> None:
        self.target_forwards += 1
        self.accepted_lengths.append(accepted + 1)
        self.depth_accepts.extend([0] * (accepted - len(self.depth_accepts)))
        for d in range(accepted):
            self.depth_accepts[d] += 1


def longest_path(tree: Tree, ok: torch.Tensor) -> torch.Tensor:
    """Node ids, root first, of the deepest node whose whole path is ``ok`` ([n] bool); empty if none."""
    if len(tree) == 0:
        return tree.tokens
    anc = tree.ancestors()
    path_ok = ~(anc & ~ok[None]).any(1)
    reach = torch.where(path_ok, tree.depths, 0)
    best = reach.argmax()
    if int(reach[best]) == 0:
        return tree.tokens.new_empty(0)
    return anc[best].nonzero().flatten()


def _walk(tree: Tree, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless multi-draft rejection sampling; ``probs`` [n + 1, V] the target's at [root, nodes...].

    At a node with target distribution p, its children x_1, x_2, ... were drawn one after another without
    replacement from q (or are fixed proposals: q a point mass on each). Child x_j is accepted with
    probability min(1, p(x_j) / q(x_j)); on rejection p <- norm(max(p - q, 0)) (the residual that makes the
    one-draft step exact) and q <- q with x_j removed, renormalised (the law of the next draw given the
    rejected one). By induction every step emits a token distributed exactly as the current p, so the
    token emitted at the node, accepted child or residual sample, follows the target. An accepted child
    continues the walk with its own p; when none is accepted, or the node has no children, a token is
    drawn from the current p and is the bonus.
    """
    children, path, node = tree.children(), [], -1
    p = probs[0]
    while children[node + 1]:
        siblings = children[node + 1]
        q = tree.sibling_dist(siblings[0])
        for child in siblings:
            x = tree.tokens[child]
            q_x = q[x] if q is not None else 1.0
            if bool(torch.rand((), device=p.device) * q_x < p[x]):
                path.append(child)
                node, p = child, probs[child + 1]
                break
            point = torch.nn.functional.one_hot(x, p.numel()).to(p.dtype) if q is None else q
            residual = (p - point).clamp(min=0)
            # Rejection has probability 0 when p <= q everywhere; rounding can still land here.
            p = residual / residual.sum() if residual.sum() > 0 else p
            if q is not None:
                q = q.index_fill(0, x, 0.0)
                q = q / q.sum()
        else:
            break
    bonus = torch.multinomial(p, 1)
    return torch.tensor(path, dtype=torch.long, device=tree.tokens.device), bonus


def accept(tree: Tree, logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted node ids [m] root-first, bonus token [1]) from the target's logits [n + 1, V] over the tree."""
    rows = tree.parents + 1
    if sampling.greedy:
        best = logits.argmax(-1)
        path = longest_path(tree, tree.tokens == best[rows])
        return path, best[path[-1:] + 1] if len(path) else best[:1]
    probs = probabilities(logits, sampling)
    if sampling.acceptance == "exact":
        return _walk(tree, probs)
    # Typical acceptance: x is plausible when p(x) > min(threshold, alpha * exp(-entropy(p))).
    entropy = -(probs * probs.clamp(min=1e-10).log()).sum(-1)
    cutoff = torch.minimum(
        torch.full_like(entropy, sampling.typical_threshold), sampling.typical_alpha * (-entropy).exp()
    )
    path = longest_path(tree, probs[rows, tree.tokens] > cutoff[rows])
    last = path[-1] + 1 if len(path) else 0
    return path, torch.multinomial(probs[last], 1)


def _hidden(out: CausalLMOutputWithPast, layers: tuple[int, ...]) -> torch.Tensor | None:
    """The requested hidden states, concatenated: [B, rows, len(layers) * H]."""
    if not layers:
        return None
    if out.hidden_states is None:
        raise ValueError("the target returned no hidden states: call it with output_hidden_states=True")
    return torch.cat([out.hidden_states[i] for i in layers], dim=-1)


# On a CPU, torch's matmuls run rows in blocks of 4 and a remainder of 2 or 3 rows on a slower kernel: SmolLM2's
# whole forward after 300 tokens (torch 2.13, 2-core AMD EPYC) took 60, 102, 121, 83, 90, 111, 131 and 80 ms for
# 1 to 8 new tokens (``python -m scripts.bench.verify_rows``, docs/BENCHMARKS.md). So on a CPU a verify forward of
# more than one query runs a multiple of 4, the extra queries padding that no row keeps. One query (plain
# decoding) stays one: its matrix-vector kernel is the fastest of all.
CPU_QUERY_MULTIPLE = 4


def verify_queries(device: torch.device, trees: list[Tree]) -> int:
    """The queries a verify forward over ``trees`` runs on ``device``: the root and the largest tree, on a CPU
    rounded up to a multiple of ``CPU_QUERY_MULTIPLE`` when there is a tree at all."""
    queries = 1 + max(len(tree) for tree in trees)
    if device.type != "cpu" or queries == 1:
        return queries
    return -(-queries // CPU_QUERY_MULTIPLE) * CPU_QUERY_MULTIPLE


def verify_batch(
    target: PreTrainedModel,
    cache: Cache,
    valid: torch.Tensor,
    roots: torch.Tensor,
    trees: list[Tree],
    sampling: Sampling,
    hidden_layers: tuple[int, ...] = (),
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None], torch.Tensor]:
    """One target forward over B sequences' [root, tree]; acceptance is per sequence.

    ``valid`` [B, P] marks the cache slots holding each sequence's committed rows: sequences that accepted
    fewer tokens than the longest in a step leave unused slots behind, masked out from then on. Returns
    (accepted node ids, bonus [1], hidden of root + path rows, per sequence; the new ``valid``). On return
    each sequence's root and accepted nodes follow the old slots (its bonus is its new root).
    """
    prefix_len, recurrent = valid.shape[1], recurrent_target(target)
    static = cache.engine if isinstance(cache, StaticCache) else None
    if recurrent:
        check_recurrent(target, len(trees), trees[0])
    # Padding queries would run through a recurrent layer's state: a recurrent target runs the tree's rows only.
    queries = 1 + len(trees[0]) if recurrent else verify_queries(target.device, trees)
    # A static cache's forwards come in buckets of queries (one CUDA graph each).
    ids, mask, positions = tree_batch_inputs(valid, trees, target.dtype, bucket(queries) if static else queries)
    ids[:, 0] = roots
    key_positions = torch.cat((valid.long().cumsum(1) - 1, positions), dim=1)  # committed slots count up
    saved = snapshot_states(cache) if recurrent and len(trees[0]) else None
    if static is not None:  # the keys are the whole buffer: its slots past this step's rows are hidden
        mask, key_positions = span_buffer(mask, key_positions, static.capacity)
    masks, states = layer_masks(target, mask, positions, key_positions), bool(hidden_layers)
    if static is not None:
        out = static.forward(ids, masks, positions, states)
    else:
        out = target_forward(target, cache, ids, masks, positions, states)
    paths, bonuses = zip(*(accept(tree, out.logits[b, : len(tree) + 1], sampling) for b, tree in enumerate(trees)))
    for b, tree in enumerate(trees):
        if tree.want_target_argmax:
            tree.target_argmax = out.logits[b, : len(tree) + 1].argmax(-1)
    keep = max(len(path) for path in paths) + 1
    # Row 0 is the root; padding repeats it (those slots are marked invalid below).
    rows = torch.zeros(len(trees), keep, dtype=torch.long, device=valid.device)
    for b, path in enumerate(paths):
        rows[b, 1 : len(path) + 1] = path + 1
    if saved is not None and replays(trees[0], paths[0]):
        replay(target, cache, saved, prefix_len, ids[:, rows[0]], positions[:, rows[0]])
    else:
        commit_rows(cache, prefix_len, prefix_len + rows)
    lengths = torch.tensor([len(path) + 1 for path in paths], device=valid.device)
    valid = torch.cat((valid, torch.arange(keep, device=valid.device)[None] < lengths[:, None]), 1)
    hidden = _hidden(out, hidden_layers)
    hiddens = [None if hidden is None else hidden[b, rows[b, : len(path) + 1]] for b, path in enumerate(paths)]
    return list(paths), list(bonuses), hiddens, valid


def check_recurrent(target: PreTrainedModel, batch: int, tree: Tree | None = None) -> None:
    """Refuse what a recurrent target cannot verify exactly in one forward: several sequences (their padding
    would run through the state) or a tree that is not a chain (the recurrence would run through siblings)."""
    if batch > 1:
        raise ValueError(f"cannot decode {batch} sequences together: {why_chains(target)}; decode one at a time")
    if tree is not None and not is_chain(tree):
        raise ValueError(f"cannot verify a tree that is not a chain: {why_chains(target)}; draft chains")


def replays(tree: Tree, path: torch.Tensor) -> bool:
    """Whether a recurrent target's step replays its accepted rows: some drafted node was rejected."""
    return len(path) < len(tree)


def replay(
    target: PreTrainedModel,
    cache: Cache,
    saved: States,
    prefix_len: int,
    ids: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """After a rejection on a recurrent target: put its states back as they were before the step (``saved``),
    drop the step's attention rows and run the accepted rows ``ids`` [1, keep] (root + path) again, so every
    layer holds exactly the committed tokens. A chain's accepted rows are a prefix of what ran, so the
    verify forward's outputs for them were already exact; this forward only rebuilds the state."""
    restore_states(cache, saved)
    crop_attention(cache, prefix_len)
    # No mask: one sequence, no padding, so the target's own causal (and windowed) masks are the exact ones.
    target(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)


def verify(
    target: PreTrainedModel,
    cache: Cache,
    root: torch.Tensor,
    tree: Tree,
    sampling: Sampling,
    hidden_layers: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One target forward over [root, tree] of one sequence whose cache slots are all valid; returns
    (accepted node ids, bonus [1], hidden of root + path rows).

    On return the cache holds the prefix, the root and the accepted nodes (the bonus is the new root).
    """
    valid = torch.ones(1, cache.get_seq_length(), dtype=torch.bool, device=root.device)
    paths, bonuses, hiddens, _ = verify_batch(target, cache, valid, root, [tree], sampling, hidden_layers)
    return paths[0], bonuses[0], hiddens[0]


def _prefill(
    target: PreTrainedModel, cache: Cache, seqs: list[torch.Tensor], layers: tuple[int, ...]
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Read every sequence but its last token into ``cache``, right-padded: (valid [B, P], hidden per sequence)."""
    lengths = [len(s) - 1 for s in seqs]
    width, device = max(lengths), seqs[0].device
    valid = torch.arange(width, device=device)[None] < torch.tensor(lengths, device=device)[:, None]
    if width == 0:
        return valid, [None] * len(seqs)
    ids = torch.stack([torch.cat((s[:-1], s.new_zeros(width - len(s) + 1))) for s in seqs])
    mask = None
    if not bool(valid.all()):  # padding: causal over each sequence's own tokens only
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        positions = torch.arange(width, device=device)[None]
        mask = layer_masks(target, additive_mask(causal[None] & valid[:, None], target.dtype), positions, positions)
    out = target(ids, attention_mask=mask, past_key_values=cache, use_cache=True, output_hidden_states=bool(layers))
    hidden = _hidden(out, layers)
    return valid, [None if hidden is None else hidden[b, :n] for b, n in enumerate(lengths)]


@torch.inference_mode()  # no autograd bookkeeping at all: less host work per op than no_grad
def generate_batch(
    target: PreTrainedModel,
    proposers: list[Proposer],
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    eos_token_id: int | None = None,
    schedule: Schedule | None = None,
) -> tuple[list[torch.Tensor], list[Stats]]:
    """Speculative decoding of B sequences, one proposer each (the same ``hidden_layers``), verified together.

    Per sequence: (prompt + new tokens [1, S + new], stats); a finished sequence leaves the batch. Stops
    after ``max_new_tokens`` or at ``eos_token_id`` (kept), as ``target.generate`` does. Sampling draws from
    torch's global generator: seed it for reproducible runs. A recurrent target decodes one sequence at a time.

    ``schedule`` (``decoding.tree_config.Schedule``, a tree.json's ``depth_per_batch_size``) sets speculation by load:
    at every step, with n sequences still decoding, the drafted trees are cut at the depth it gives n, and
    at depth 0 nobody drafts (plain decoding, the proposers only read what was committed).
    """
    start, stats = time.perf_counter(), [Stats() for _ in prompts]
    sampling = sampling or Sampling()
    seqs = [p.flatten().to(target.device) for p in prompts]
    prompt_lens = [len(s) for s in seqs]
    layers = proposers[0].hidden_layers
    if any(p.hidden_layers != layers for p in proposers):
        raise ValueError("proposers of one batch must read the same target layers")
    recurrent = recurrent_target(target)
    if recurrent:
        check_recurrent(target, len(prompts))
    static = static_decoding(target) if len(prompts) == 1 else None  # one sequence: setup_static_cache's engine
    cache = static.cache() if static is not None else new_cache(target)
    valid, hidden = _prefill(target, cache, seqs, layers)
    active = list(range(len(seqs))) if max_new_tokens > 0 else []
    # Rows a proposer has not read: while the schedule says nobody drafts, the proposers skip their reading
    # (an EAGLE head's forward over each new row) and catch up on all of them once drafting resumes.
    unread: list[torch.Tensor | None] = [None] * len(seqs)
    drafting = not schedule or scheduled_depth(schedule, len(active)) > 0
    for i, (proposer, seq) in enumerate(zip(proposers, seqs)):
        proposer.reset(sampling)
        _read(proposer, seq, hidden[i], unread, i, drafting)
    while active:
        depth = scheduled_depth(schedule, len(active)) if schedule else None
        if depth == 0:
            trees = [empty_tree(target.device) for _ in active]
        else:
            trees = [proposers[i].propose(seqs[i]) for i in active]
            trees = trees if depth is None else [capped(tree, depth) for tree in trees]
        roots = torch.stack([seqs[i][-1] for i in active])
        paths, bonuses, hidden, valid = verify_batch(target, cache, valid, roots, trees, sampling, layers)
        still = []
        for j, i in enumerate(active):
            new = torch.cat((trees[j].tokens[paths[j]], bonuses[j]))
            seqs[i] = torch.cat((seqs[i], new))
            stats[i].record(len(paths[j]))
            stats[i].replay_forwards += bool(recurrent and replays(trees[j], paths[j]))
            if len(seqs[i]) - prompt_lens[i] >= max_new_tokens or (
                eos_token_id is not None and bool((new == eos_token_id).any())
            ):
                stats[i].wall_time = time.perf_counter() - start
            else:
                still.append(j)
        drafting = not schedule or not still or scheduled_depth(schedule, len(still)) > 0
        for j in still:
            _read(proposers[active[j]], seqs[active[j]], hidden[j], unread, active[j], drafting)
        if not still:  # done: no batch to select (recurrent cache layers cannot select one)
            break
        if len(still) < len(active):
            keep = torch.tensor(still, dtype=torch.long, device=valid.device)
            cache.batch_select_indices(keep)
            valid, active = valid[keep], [active[j] for j in still]
    outputs = []
    for seq, prompt_len in zip(seqs, prompt_lens):
        new = seq[prompt_len : prompt_len + max_new_tokens]
        if eos_token_id is not None and bool((new == eos_token_id).any()):
            new = new[: int((new == eos_token_id).nonzero()[0]) + 1]
        outputs.append(torch.cat((seq[:prompt_len], new))[None])
    return outputs, stats


def _read(
    proposer: Proposer,
    seq: torch.Tensor,
    rows: torch.Tensor | None,
    unread: list[torch.Tensor | None],
    i: int,
    drafting: bool,
) -> None:
    """Hand sequence ``i``'s newly committed ``rows`` (and any it has not read yet) to its proposer when the next
    step drafts; otherwise keep them in ``unread[i]``."""
    before = unread[i]
    if rows is not None and before is not None:
        rows = torch.cat((before, rows))
    if drafting:
        proposer.update(seq, rows)
        unread[i] = None
    else:
        unread[i] = rows


def generate(
    target: PreTrainedModel,
    proposer: Proposer,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    eos_token_id: int | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Speculative decoding of one sequence: (prompt + new tokens [1, S + new], stats); see ``generate_batch``."""
    outputs, stats = generate_batch(target, [proposer], [input_ids], max_new_tokens, sampling, eos_token_id)
    return outputs[0], stats[0]
