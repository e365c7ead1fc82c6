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
from transformers import DynamicCache

from eval.tree import Tree, tree_attention_mask, tree_position_ids


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    acceptance: str = "exact"  # "exact" (lossless) or "typical" (Medusa, lossy)
    typical_threshold: float = 0.09  # Medusa's posterior_threshold
    typical_alpha: float = 0.3  # Medusa's posterior_alpha

    def __post_init__(self):
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
        q = tree.dists[tree.dist_index[siblings[0]]] if tree.dists is not None else None
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


def commit_kv(cache: DynamicCache, prefix_len: int, path: torch.Tensor, tree_size: int) -> None:
    """Keep the root's and the accepted nodes' cache rows, moved right after the prefix; drop the rest."""
    rows = prefix_len + torch.cat((path.new_zeros(1), path + 1))
    for layer in cache.layers:
        layer.keys[:, :, prefix_len : prefix_len + len(rows)] = layer.keys[:, :, rows]
        layer.values[:, :, prefix_len : prefix_len + len(rows)] = layer.values[:, :, rows]
    cache.crop(-(tree_size - len(path)))


def _hidden(out, layers: tuple[int, ...]) -> torch.Tensor | None:
    """The requested hidden states of the forward's first batch row, concatenated: [rows, len(layers) * H]."""
    if not layers:
        return None
    return torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)


def verify(
    target: torch.nn.Module,
    cache: DynamicCache,
    root: torch.Tensor,
    tree: Tree,
    sampling: Sampling,
    hidden_layers: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One target forward over [root, tree]; returns (accepted node ids, bonus [1], hidden of root + path rows).

    On return the cache holds the prefix, the root and the accepted nodes (the bonus is the new root).
    """
    prefix_len = cache.get_seq_length()
    out = target(
        input_ids=torch.cat((root, tree.tokens))[None],
        attention_mask=tree_attention_mask(tree, prefix_len, target.dtype),
        position_ids=tree_position_ids(tree, prefix_len),
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=bool(hidden_layers),
    )
    path, bonus = accept(tree, out.logits[0], sampling)
    commit_kv(cache, prefix_len, path, len(tree))
    hidden = _hidden(out, hidden_layers)
    return path, bonus, None if hidden is None else hidden[torch.cat((path.new_zeros(1), path + 1))]


@torch.no_grad()
def generate(
    target: torch.nn.Module,
    proposer: Proposer,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    eos_token_id: int | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Speculative decoding of one sequence: (prompt + new tokens [1, S + new], stats).

    Stops after ``max_new_tokens`` or at ``eos_token_id`` (kept), as ``target.generate`` does. Sampling
    draws from torch's global generator: seed it for reproducible runs.
    """
    start, stats = time.perf_counter(), Stats()
    sampling = sampling or Sampling()
    tokens = input_ids.flatten().to(target.device)
    prompt_len = len(tokens)
    cache = DynamicCache(config=target.config)
    proposer.reset(sampling)
    layers = proposer.hidden_layers
    hidden = None
    if prompt_len > 1:
        out = target(tokens[None, :-1], past_key_values=cache, use_cache=True, output_hidden_states=bool(layers))
        hidden = _hidden(out, layers)
    proposer.update(tokens, hidden)
    while len(tokens) - prompt_len < max_new_tokens:
        tree = proposer.propose(tokens)
        path, bonus, hidden = verify(target, cache, tokens[-1:], tree, sampling, layers)
        new = torch.cat((tree.tokens[path], bonus))
        tokens = torch.cat((tokens, new))
        stats.record(len(path))
        if eos_token_id is not None and bool((new == eos_token_id).any()):
            break
        proposer.update(tokens, hidden)
    new = tokens[prompt_len : prompt_len + max_new_tokens]
    if eos_token_id is not None and bool((new == eos_token_id).any()):
        new = new[: int((new == eos_token_id).nonzero()[0]) + 1]
    stats.wall_time = time.perf_counter() - start
    return torch.cat((tokens[:prompt_len], new))[None], stats
