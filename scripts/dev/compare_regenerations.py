"""Compare two regenerations of the same conversations, reply by reply (e.g. the hf engine's and vLLM's).

    python -m scripts.dev.compare_regenerations runs/bench/hf.jsonl runs/bench/engine.jsonl \\
        --tokenizer assets/demo-target

Prints, as JSON: how many assistant replies are identical (the agreement rate), the generated tokens
in each file (the replies re-tokenized by the target's tokenizer, for tokens/s), and for each reply
that differs the first token where it does.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from headstart.core.models import load_tokenizer


def assistant_replies(path: Path) -> list[str]:
    rows = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
    return [m["content"] for messages in rows for m in messages if m["role"] == "assistant"]


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where the token lists differ (the shorter one's length when one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(first: Path, second: Path, tokenizer_path: str) -> dict[str, Any]:
    tokenizer = load_tokenizer(tokenizer_path)
    replies = assistant_replies(first), assistant_replies(second)
    if len(replies[0]) != len(replies[1]):
        raise ValueError(f"{first} has {len(replies[0])} assistant replies, {second} {len(replies[1])}: not one run's")
    tokens = [[tokenizer.encode(r, add_special_tokens=False) for r in side] for side in replies]
    differ = [
        {"reply": i, "first_differing_token": first_difference(a, b), "tokens": [len(a), len(b)]}
        for i, (a, b) in enumerate(zip(*tokens))
        if a != b
    ]
    total = len(replies[0])
    return {
        "replies": total,
        "identical": total - len(differ),
        "agreement": round((total - len(differ)) / total, 4) if total else None,
        "generated_tokens": {str(first): sum(map(len, tokens[0])), str(second): sum(map(len, tokens[1]))},
        "differing": differ,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--tokenizer", required=True, help="the target's folder: its tokenizer counts the tokens")
    args = parser.parse_args(argv)
    print(json.dumps(compare(args.first, args.second, args.tokenizer), indent=1))


if __name__ == "__main__":
    main()
