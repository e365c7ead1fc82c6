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
from functools import cached_property
from typing import Protocol

import torch
from transformers import Cache, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from headstart.core.vision import TEXT_POSITIONS, TOKEN_KEYS, DraftPositions, on_model, rope_positions
from headstart.decoding.proposers_schedule import SpeculationByLoad
from headstart.decoding.static_cache import StaticCache, StaticVerifyCache, static_decoding
from headstart.decoding.target_cache import (
    ReplayingCache,
    VerifyCache,
    check_recurrent,
    layer_masks,
    new_cache,
    recurrent_target,
)
from headstart.decoding.tree import Tree, additive_mask, tree_batch_inputs
from headstart.decoding.tree_config import Schedule


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

    def reset(self, sampling: Sampling, positions: DraftPositions = TEXT_POSITIONS) -> None:
        """Start a new sequence: drop caches, remember whether to draft greedily or by sampling and where a draft
        model or head puts each row (``positions``: an image prompt's are not always the rows' indices)."""

    def propose(self, tokens: torch.Tensor) -> Tree:
        """A tree below ``tokens[-1]`` (the pending root) given every committed token [T]."""

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """After a commit: ``tokens`` [T] committed so far, ``hidden`` [m, ...] the target's states (per
        ``hidden_layers``, concatenated) of the m rows just added to the target's cache, i.e. of tokens
        ``tokens[T-1-m : T-1]``, or None when the proposer asked for none."""


@dataclass
class Stats:
    target_forwards: int = 0  # verification forwards (the prompt's prefill is not counted)
    # Forwards that rebuilt a recurrent target's state after a rejected draft (``ReplayingCache``): not
    # verification, so not in tau, but in the wall time (tokens/s and speedups count them).
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


@dataclass
class Verdict:
    """One sequence's outcome of a verify step."""

    tree: Tree
    path: torch.Tensor  # accepted node ids, root first
    bonus: torch.Tensor  # [1] the target's token after them: the next pending root
    hidden: torch.Tensor | None  # the target's states (per ``hidden_layers``) of the root and path rows
    logits: torch.Tensor  # [n + 1, V] the target's at [root, nodes...]; a static cache's graph rewrites them next step

    @cached_property
    def new_tokens(self) -> torch.Tensor:
        """The tokens the step commits: the accepted nodes', then the bonus."""
        return torch.cat((self.tree.tokens[self.path], self.bonus))


@dataclass
class Verification:
    """A verify step's outcome over B sequences."""

    verdicts: list[Verdict]
    valid: torch.Tensor  # [B, P + keep] the cache slots holding each sequence's committed rows
    replayed: bool  # a recurrent target ran the accepted rows again to rebuild its state (``ReplayingCache``)


def verify_cache(target: PreTrainedModel, cache: Cache) -> VerifyCache:
    """How a verify step runs on ``cache``: the static cache's, a recurrent target's replays, or the dynamic one's."""
    if isinstance(cache, StaticCache):
        return StaticVerifyCache(target, cache)
    if recurrent_target(target):
        return ReplayingCache(target, cache)
    return VerifyCache(target, cache)


def accepted_rows(paths: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[B, keep] each sequence's step rows to keep: its root (row 0), then its accepted nodes'; shorter paths are
    padded with the root (slots that are then marked invalid)."""
    rows = torch.zeros(len(paths), max(len(path) for path in paths) + 1, dtype=torch.long, device=device)
    for b, path in enumerate(paths):
        rows[b, 1 : len(path) + 1] = path + 1
    return rows


def verify_batch(
    target: PreTrainedModel,
    cache: Cache,
    valid: torch.Tensor,
    roots: torch.Tensor,
    trees: list[Tree],
    sampling: Sampling,
    hidden_layers: tuple[int, ...] = (),
    position_shift: int = 0,
) -> Verification:
    """One target forward over B sequences' [root, tree]; acceptance is per sequence.

    ``valid`` [B, P] marks the cache slots holding each sequence's committed rows: sequences that accepted
    fewer tokens than the longest in a step leave unused slots behind, masked out from then on. On return
    each sequence's root and accepted nodes follow the old slots (its bonus is its new root).
    ``position_shift``: what the rotary position of a row past an image prompt's rows adds to its index (an mrope
    target's, ``core.vision.rope_positions``; 0 for every other).
    """
    steps = verify_cache(target, cache)
    ids, mask, positions = tree_batch_inputs(valid, trees, target.dtype, steps.queries(trees))
    ids[:, 0] = roots
    positions = positions + position_shift
    key_positions = torch.cat((valid.long().cumsum(1) - 1 + position_shift, positions), dim=1)  # committed count up
    out = steps.forward(ids, mask, positions, key_positions, bool(hidden_layers))
    logits = [out.logits[b, : len(tree) + 1] for b, tree in enumerate(trees)]
    paths, bonuses = zip(*(accept(tree, scores, sampling) for tree, scores in zip(trees, logits)))
    rows = accepted_rows(list(paths), valid.device)
    replayed = steps.commit(valid.shape[1], rows)
    lengths = torch.tensor([len(path) + 1 for path in paths], device=valid.device)
    kept = torch.arange(rows.shape[1], device=valid.device)[None] < lengths[:, None]
    hidden = _hidden(out, hidden_layers)
    verdicts = [
        Verdict(tree, path, bonus, None if hidden is None else hidden[b, rows[b, : len(path) + 1]], logits[b])
        for b, (tree, path, bonus) in enumerate(zip(trees, paths, bonuses))
    ]
    return Verification(verdicts, torch.cat((valid, kept), 1), replayed)


def verify(
    target: PreTrainedModel,
    cache: Cache,
    root: torch.Tensor,
    tree: Tree,
    sampling: Sampling,
    hidden_layers: tuple[int, ...] = (),
) -> Verdict:
    """One target forward over [root, tree] of one sequence whose cache slots are all valid.

    On return the cache holds the prefix, the root and the accepted nodes (the bonus is the new root).
    """
    valid = torch.ones(1, cache.get_seq_length(), dtype=torch.bool, device=root.device)
    return verify_batch(target, cache, valid, root, [tree], sampling, hidden_layers).verdicts[0]


def _prefill(
    target: PreTrainedModel,
    cache: Cache,
    seqs: list[torch.Tensor],
    layers: tuple[int, ...],
    vision: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Read every sequence but its last token into ``cache``, right-padded: (valid [B, P], hidden per sequence).
    ``vision``: the one sequence's vision inputs for those tokens (``prompt_vision``), the images read here."""
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
    out = target(
        ids,
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=bool(layers),
        **(vision or {}),
    )
    hidden = _hidden(out, layers)
    return valid, [None if hidden is None else hidden[b, :n] for b, n in enumerate(lengths)]


def _target_cache(target: PreTrainedModel, batch: int) -> Cache:
    """An empty cache for ``batch`` sequences: the static one ``setup_static_cache`` made, for one sequence, else a
    dynamic one. A recurrent target refuses several sequences."""
    if recurrent_target(target):
        check_recurrent(target, batch)
    static = static_decoding(target) if batch == 1 else None
    return static.cache() if static is not None else new_cache(target)


@dataclass
class DecodeState:
    """One sequence being decoded: its proposer, its tokens so far and its statistics."""

    proposer: Proposer
    tokens: torch.Tensor  # [S + new] the prompt, then every committed token
    prompt_len: int
    stats: Stats = field(default_factory=Stats)

    def commit(self, verdict: Verdict, replayed: bool) -> None:
        """Append the verified tokens, count the step and hand the proposer's tree what the target scored."""
        self.tokens = torch.cat((self.tokens, verdict.new_tokens))
        self.stats.record(len(verdict.path))
        self.stats.replay_forwards += replayed
        if verdict.tree.on_target_argmax is not None:
            verdict.tree.on_target_argmax(verdict.logits.argmax(-1))

    def output(self, max_new_tokens: int, eos_token_id: int | None) -> torch.Tensor:
        """[1, S + new]: the prompt and at most ``max_new_tokens`` new tokens, up to the first ``eos_token_id``."""
        new = self.tokens[self.prompt_len : self.prompt_len + max_new_tokens]
        if eos_token_id is not None and bool((new == eos_token_id).any()):
            new = new[: int((new == eos_token_id).nonzero()[0]) + 1]
        return torch.cat((self.tokens[: self.prompt_len], new))[None]


class BatchDecoding:
    """B sequences decoded together: the prefill, then ``step`` while any is ``active``; with a ``schedule``, each
    proposer drafts as deep as it gives the sequences still decoding (``SpeculationByLoad``)."""

    def __init__(
        self,
        target: PreTrainedModel,
        sequences: list[DecodeState],
        max_new_tokens: int,
        sampling: Sampling,
        eos_token_id: int | None,
        schedule: Schedule | None,
        vision: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.target, self.sampling = target, sampling
        self.max_new_tokens, self.eos_token_id = max_new_tokens, eos_token_id
        self.start = time.perf_counter()
        self.layers = sequences[0].proposer.hidden_layers
        if any(seq.proposer.hidden_layers != self.layers for seq in sequences):
            raise ValueError("proposers of one batch must read the same target layers")
        if schedule:
            for seq in sequences:
                seq.proposer = SpeculationByLoad(seq.proposer, schedule, lambda: len(self.active))
        self.cache = _target_cache(target, len(sequences))
        prefill, positions = prompt_vision(target, [seq.tokens for seq in sequences], vision)
        self.position_shift = positions.shift
        self.valid, hidden = _prefill(target, self.cache, [seq.tokens for seq in sequences], self.layers, prefill)
        self.active = sequences if max_new_tokens > 0 else []
        for seq, rows in zip(sequences, hidden):
            seq.proposer.reset(sampling, positions)
            seq.proposer.update(seq.tokens, rows)

    def step(self) -> None:
        """Draft, verify every active sequence in one forward, commit, retire the finished ones and let the
        others' proposers read what was committed."""
        trees = [seq.proposer.propose(seq.tokens) for seq in self.active]
        roots = torch.stack([seq.tokens[-1] for seq in self.active])
        result = verify_batch(
            self.target, self.cache, self.valid, roots, trees, self.sampling, self.layers, self.position_shift
        )
        for seq, verdict in zip(self.active, result.verdicts):
            seq.commit(verdict, result.replayed)
        done = [self.is_finished(seq, verdict) for seq, verdict in zip(self.active, result.verdicts)]
        self.retire(done, result.valid)
        going = [verdict for verdict, finished in zip(result.verdicts, done) if not finished]
        for seq, verdict in zip(self.active, going):
            seq.proposer.update(seq.tokens, verdict.hidden)

    def is_finished(self, seq: DecodeState, verdict: Verdict) -> bool:
        """Whether ``seq``, after committing ``verdict``, spent its budget or reached the end of text."""
        if len(seq.tokens) - seq.prompt_len >= self.max_new_tokens:
            return True
        return self.eos_token_id is not None and bool((verdict.new_tokens == self.eos_token_id).any())

    def retire(self, done: list[bool], valid: torch.Tensor) -> None:
        """Drop the ``done`` sequences from the batch and from the target's cache (whose committed slots are
        ``valid``), timing them."""
        for seq, finished in zip(self.active, done):
            if finished:
                seq.stats.wall_time = time.perf_counter() - self.start
        kept = [j for j, finished in enumerate(done) if not finished]
        if kept and len(kept) < len(done):  # none left: no batch to select (nor can recurrent layers)
            keep = torch.tensor(kept, dtype=torch.long, device=valid.device)
            self.cache.batch_select_indices(keep)
            valid = valid[keep]
        self.valid, self.active = valid, [self.active[j] for j in kept]


def prompt_vision(
    target: PreTrainedModel, prompts: list[torch.Tensor], vision: dict[str, torch.Tensor] | None
) -> tuple[dict[str, torch.Tensor] | None, DraftPositions]:
    """An image prompt's vision inputs for its prefill (every token but the last, the pending root; on the target's
    device and dtype) and where a text-only draft puts its rows (``core.vision.rope_positions``: an mrope target's
    positions past an image are not the rows' indices, its ``shift`` where the target's own steps go too). One
    prompt at a time: each family batches images its own way."""
    if not vision:
        return None, TEXT_POSITIONS
    if len(prompts) != 1:
        raise ValueError(f"a prompt with images decodes alone, not in a batch of {len(prompts)}")
    head = prompts[0][:-1][None]
    prefill = {key: value[..., :-1] if key in TOKEN_KEYS else value for key, value in vision.items()}
    positions, shift = rope_positions(target, head, prefill)
    return on_model(prefill, target), DraftPositions(positions, shift)


@torch.inference_mode()  # no autograd bookkeeping at all: less host work per op than no_grad
def generate_batch(
    target: PreTrainedModel,
    proposers: list[Proposer],
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    eos_token_id: int | None = None,
    schedule: Schedule | None = None,
    vision: dict[str, torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[Stats]]:
    """Speculative decoding of B sequences, one proposer each (the same ``hidden_layers``), verified together.

    Per sequence: (prompt + new tokens [1, S + new], stats); a finished sequence leaves the batch. Stops
    after ``max_new_tokens`` or at ``eos_token_id`` (kept), as ``target.generate`` does. Sampling draws from
    torch's global generator: seed it for reproducible runs. A recurrent target decodes one sequence at a time.

    ``schedule`` (``decoding.tree_config.Schedule``, a tree.json's ``depth_per_batch_size``) sets speculation by load
    (``decoding.proposers_schedule.SpeculationByLoad``): the drafted trees are cut at the depth it gives the
    sequences still decoding, and at depth 0 nobody drafts. ``vision``: a vision-language target's inputs for the one
    prompt's images (its processor's, ``data_recipes.recipes.Sample.vision``); the images are read in the prefill and
    the decoding steps are text.
    """
    sequences = [
        DecodeState(proposer, prompt.flatten().to(target.device), prompt.numel())
        for proposer, prompt in zip(proposers, prompts)
    ]
    decoding = BatchDecoding(target, sequences, max_new_tokens, sampling or Sampling(), eos_token_id, schedule, vision)
    while decoding.active:
        decoding.step()
    return [seq.output(max_new_tokens, eos_token_id) for seq in sequences], [seq.stats for seq in sequences]


def generate(
    target: PreTrainedModel,
    proposer: Proposer,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    eos_token_id: int | None = None,
    vision: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Speculative decoding of one sequence: (prompt + new tokens [1, S + new], stats); see ``generate_batch``."""
    outputs, stats = generate_batch(
        target, [proposer], [input_ids], max_new_tokens, sampling, eos_token_id, vision=vision
    )
    return outputs[0], stats[0]
