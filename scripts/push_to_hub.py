"""Publish a head on the Hugging Face Hub: its export, with a model card, eval report and training config.

    python -m scripts.push_to_hub --head runs/demo/eagle3/head --repo-id ORG/NAME [--format vllm] [--target PATH]
                                  [--target-id HUB_ID] [--report DIR] [--private] [--dry-run]

Stages what ``scripts.export`` writes (config.json, weights, README.md whose serve commands name the
hub repo), plus ``eval/`` (the eval report's report.md, report.json and plots, shown in the card) when
``--report`` is given and ``training_config.yaml`` when the trainer's ``config.yaml`` sits beside the
head. Then ``create_repo`` + ``upload_folder`` with the token from ``HF_TOKEN`` or ``hf auth login``.
``--dry-run`` prints the staged files and the card and uploads nothing. ``--target-id`` names the
target as users will load it (a hub id) when the head's config holds a local path.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import HfApi, constants, get_token

from scripts.export import FORMATS, export_head

REPORT_FILES = ("report.md", "report.json")


def report_section(report_dir: Path) -> tuple[str, list[Path]]:
    """The card's evaluation section and the files it shows (report.md/.json and *.png of ``report_dir``)."""
    files = [report_dir / n for n in REPORT_FILES if (report_dir / n).is_file()] + sorted(report_dir.glob("*.png"))
    if not files:
        raise FileNotFoundError(f"no {', '.join(REPORT_FILES)} or *.png in the report folder {report_dir}")
    parts = ["## Evaluation"]
    if (report_dir / "report.md").is_file():
        parts.append((report_dir / "report.md").read_text().strip())
    parts += [f"![{p.stem}](eval/{p.name})" for p in files if p.suffix == ".png"]
    numbers = [f"[`{p.name}`](eval/{p.name})" for p in files if p.suffix != ".png"]
    if numbers:
        parts.append("Full numbers: " + ", ".join(numbers))
    return "\n\n".join(parts) + "\n", files


def stage(
    head_dir: str | Path,
    repo_id: str,
    fmt: str,
    out: str | Path,
    report_dir: str | Path | None = None,
    target: str | None = None,
    target_id: str | None = None,
    parity: str | Path | None = None,
) -> Path:
    """Write everything the hub repo gets into ``out``; return it."""
    head_dir, out = Path(head_dir), Path(out)
    sections, report_files = [], []
    if report_dir is not None:
        section, report_files = report_section(Path(report_dir))
        sections.append(section)
    training_config = head_dir.parent / "config.yaml"  # what train/ saves beside <out_dir>/head
    if training_config.is_file():
        sections.append(
            "## Training\n\nThe resolved training config is [`training_config.yaml`](training_config.yaml).\n"
        )
    made_by = f"python -m scripts.push_to_hub --head {head_dir} --repo-id {repo_id} --format {fmt}"
    export_head(
        head_dir,
        fmt,
        out,
        target,
        target_id,
        draft_name=repo_id,
        made_by=made_by,
        card_sections=sections,
        parity=parity,
    )
    if report_files:
        (out / "eval").mkdir()
        for path in report_files:
            shutil.copy2(path, out / "eval" / path.name)
    if training_config.is_file():
        shutil.copy2(training_config, out / "training_config.yaml")
    return out


def upload(folder: Path, repo_id: str, private: bool) -> str:
    """``create_repo`` (kept if it exists) + ``upload_folder``; the URL of the commit."""
    if constants.HF_HUB_OFFLINE:
        raise RuntimeError("HF_HUB_OFFLINE is set (the Makefile sets it): unset it to upload")
    token = get_token()
    if token is None:
        raise RuntimeError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (a token with write access)")
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    commit = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message="Upload draft head (headstart)")
    return commit.commit_url


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head", required=True, help="a head folder saved by training")
    parser.add_argument("--repo-id", required=True, help="ORG/NAME on the hub")
    parser.add_argument("--format", default="vllm", choices=FORMATS, help="export format (default vllm)")
    parser.add_argument("--target", help="the target to check the head against (default: the head's config)")
    parser.add_argument("--target-id", help="the target as users load it, e.g. its hub id (default: --target)")
    parser.add_argument("--report", help="an eval report folder (report.md, report.json, *.png) to show in the card")
    parser.add_argument(
        "--parity", help="parity.json from `make verify-engines`: the served-acceptance figures go in the card"
    )
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="print the staged files and card; upload nothing")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="headstart-hub-") as tmp:
        try:
            folder = stage(
                args.head,
                args.repo_id,
                args.format,
                Path(tmp) / "repo",
                args.report,
                args.target,
                args.target_id,
                args.parity,
            )
        except (ValueError, FileNotFoundError) as err:
            parser.exit(2, f"push_to_hub failed: {err}\n")
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        print(f"staged for {args.repo_id}:")
        for path in files:
            print(f"  {path.relative_to(folder)}  ({path.stat().st_size} bytes)")
        if args.dry_run:
            print("\n" + (folder / "README.md").read_text())
            return
        try:
            print(f"uploaded: {upload(folder, args.repo_id, args.private)}")
        except RuntimeError as err:
            parser.exit(2, f"push_to_hub failed: {err}\n")


if __name__ == "__main__":
    main()
