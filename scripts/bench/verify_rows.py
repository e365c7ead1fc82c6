"""The target's forward by number of queries, beside the verify step the engine runs for the same chain.

    python -m scripts.bench.verify_rows --target runs/real-smollm2/target [--context 300] [--repeats 15]

On a CPU, torch's matmuls run rows in blocks of 4 and a remainder of 2 or 3 on a slower kernel, so a forward
over 3 new tokens can cost more than one over 4; ``decoding.target_cache.verify_queries`` rounds a verify's queries
up to a multiple of ``CPU_QUERY_MULTIPLE`` there. Both columns are measured in one process, one after the other for
each q, at the same KV length: the bare forward over q new tokens, and ``decoding.verify.verify_batch`` over a chain
of q - 1 drafts (forward, acceptance and KV commit, padded where the rule says), medians of ``repeats``.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import PreTrainedModel

from headstart.core.models import load_model
from headstart.core.timing import timed
from headstart.decoding.target_cache import new_cache, verify_queries
from headstart.decoding.tree import chain
from headstart.eval.timing import measure_verify


@torch.no_grad()
def forward_ms(target: PreTrainedModel, context: torch.Tensor, queries: int, repeats: int) -> float:
    """Median ms of the bare forward over ``queries`` new tokens after ``context`` (the cache cropped back)."""
    cache = new_cache(target)
    target(context[None, :-queries], past_key_values=cache, use_cache=True)
    length = cache.get_seq_length()
    times = []
    for _ in range(repeats):
        _, seconds = timed(context.device, lambda: target(context[None, -queries:], past_key_values=cache))
        times.append(seconds * 1e3)
        cache.crop(length - cache.get_seq_length())  # negative: drop the new rows
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="target model folder")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--context", type=int, default=300, help="KV length the queries follow")
    parser.add_argument("--max-queries", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)

    target = load_model(args.target, args.device, args.dtype)
    generator = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    context = torch.randint(vocab // 10, vocab // 2, (args.context + args.max_queries,), generator=generator)
    context = context.to(target.device)
    rows = []
    for q in range(1, args.max_queries + 1):
        bare = forward_ms(target, context[: args.context + q], q, args.repeats)
        verify = measure_verify(target, context[: args.context + 1], [q - 1], [1], args.repeats)[1][0]
        rows.append((q, bare, verify, verify_queries(target.device, [chain(context[: q - 1])])))
    print(f"target {args.target} on {target.device}, {target.dtype}, {torch.get_num_threads()} torch threads, "
          f"KV length {args.context}")  # fmt: skip
    print("| new tokens q | bare forward ms | verify of a chain of q - 1 ms | queries it runs | vs one token |")
    print("|---|---|---|---|---|")
    for q, bare, verify, runs in rows:
        print(f"| {q} | {bare:.1f} | {verify:.1f} | {runs} | {verify / rows[0][2]:.2f}x |")


if __name__ == "__main__":
    main()
