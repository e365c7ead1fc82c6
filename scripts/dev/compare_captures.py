"""Two captures of the same conversations side by side: are they the same data? (an engine capture against the
transformers one, a tensor-parallel capture against one process, two store dtypes, ...)

    python -m scripts.dev.compare_captures runs/capture-engine/capture-hf runs/capture-engine/capture

Token ids, loss masks, offsets and sample ids must be identical shard by shard (else it stops, naming the
shard and tensor). For each stored layer it prints how far the hidden states are apart in bf16 steps
(``data_recipes.capture_diff``: the measure and its noise floor).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from headstart.data_recipes.capture_diff import differences


def compare(first: Path, second: Path) -> list[str]:
    """The report's lines; ValueError naming the shard and tensor where the token side differs."""
    found = differences(first, second)
    if found["token_side"]:
        raise ValueError(f"{found['token_side'][0]} differs between {first} and {second}")
    lines = [f"{found['samples']} samples, {found['tokens']:,} tokens: token ids, masks, offsets identical"]
    for name, t in found["layers"].items():
        lines.append(
            f"{name}: {t['one'] / t['values']:.4%} one step apart, {t['over_two'] / t['values']:.4%} more than two; "
            f"worst beyond the floor {t['worst']:.2f} steps; token relative L2 median {t['relative_median']:.1e}, "
            f"max {t['relative_max']:.1e}"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("first", type=Path, help="a capture folder (its manifest.json and shards)")
    parser.add_argument("second", type=Path, help="another capture of the same conversations")
    args = parser.parse_args(argv)
    print("\n".join(compare(args.first, args.second)))


if __name__ == "__main__":
    main()
