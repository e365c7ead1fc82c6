"""Publish a head on the Hugging Face Hub: its export, with a model card, eval report and training config.

    python -m scripts.push_to_hub --head runs/demo/eagle3/head --repo-id ORG/NAME [--format vllm] [--target PATH]
                                  [--target-id HUB_ID] [--report DIR] [--private] [--dry-run]

Stages what ``scripts.export`` writes (config.json, weights, README.md whose serve commands name the
hub repo), plus ``eval/`` (the eval report's report.md, report.json and plots, shown in the card) when
``--report`` is given and ``training_config.yaml`` when the trainer's ``config.yaml`` sits beside the
head. Then ``create_repo`` + ``upload_folder`` with the token from ``HF_TOKEN`` or ``hf auth login``.
``--dry-run`` prints the staged files and the card and uploads nothing. ``--target-id`` names the
target as users will load it (a hub id) when the head's config holds a local path: without one, a
local target is refused (a dry run only warns).

Nothing local is published: the card names the head folder ``<head-folder>``, and only regular files
inside the folders named (the report folder, the head's run folder) are staged: a link leaving them
is refused.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.utils import HFValidationError, validate_repo_id

from headstart.heads import read_head_config
from headstart.scripts.export import FORMATS, export_head
from headstart.scripts.formats.common import file_inside

REPORT_FILES = ("report.md", "report.json")
HEAD_NAME = "<head-folder>"  # how the card names the head folder: its path is the uploader's own business


def report_section(report_dir: Path) -> tuple[str, dict[str, Path]]:
    """The card's evaluation section and the files it shows: {name in eval/: the file to copy}
    (report.md/.json and *.png of ``report_dir``, each a regular file inside it)."""
    found = [report_dir / n for n in REPORT_FILES if os.path.lexists(report_dir / n)]
    found += sorted(report_dir.glob("*.png"))
    if not found:
        raise FileNotFoundError(f"no {', '.join(REPORT_FILES)} or *.png in the report folder {report_dir}")
    files = {p.name: file_inside(p, (report_dir,)) for p in found}
    parts = ["## Evaluation"]
    if "report.md" in files:
        parts.append(files["report.md"].read_text().strip())
    parts += [f"![{Path(n).stem}](eval/{n})" for n in files if n.endswith(".png")]
    numbers = [f"[`{n}`](eval/{n})" for n in files if not n.endswith(".png")]
    if numbers:
        parts.append("Full numbers: " + ", ".join(numbers))
    return "\n\n".join(parts) + "\n", files


def local_target_problem(target_id: str | None, target: str | None) -> str | None:
    """Why the hub repo would name its target by something its users cannot load, else None.

    The card's serve commands, speculators' ``verifier`` and Medusa's ``base_model_name_or_path`` name it.
    ``target`` was loaded with ``from_pretrained``: a hub id unless it is a folder here.
    """
    if target_id is not None:
        try:
            validate_repo_id(target_id)
        except HFValidationError as err:
            return f"--target-id {target_id!r} is not a hub id: {err}"
        return None
    if target is None:
        return "the head records no target: pass --target-id ORG/NAME, the target as users load it"
    if Path(target).exists():
        return f"the target {target} is a local folder: pass --target-id ORG/NAME, the target as users load it"
    return None


def stage(
    head_dir: str | Path,
    repo_id: str,
    fmt: str,
    out: str | Path,
    report_dir: str | Path | None = None,
    target: str | None = None,
    target_id: str | None = None,
    parity: str | Path | None = None,
    dry_run: bool = False,
) -> Path:
    """Write everything the hub repo gets into ``out``; return it.

    A target that is no hub id is refused, unless ``dry_run`` (nothing is published): then a note says so.
    """
    head_dir, out = Path(head_dir), Path(out)
    sections: list[str] = []
    report_files: dict[str, Path] = {}
    if report_dir is not None:
        section, report_files = report_section(Path(report_dir))
        sections.append(section)
    run_dir = head_dir.resolve().parent
    beside = run_dir / "config.yaml"  # what train/ saves beside <out_dir>/head
    training_config = file_inside(beside, (run_dir,), "the training config") if os.path.lexists(beside) else None
    if training_config is not None:
        sections.append(
            "## Training\n\nThe resolved training config is [`training_config.yaml`](training_config.yaml).\n"
        )
    made_by = f"python -m scripts.push_to_hub --head {HEAD_NAME} --repo-id {repo_id} --format {fmt}"
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
        head_name=HEAD_NAME,
    )
    problem = local_target_problem(target_id, target or read_head_config(head_dir).target)
    if problem and not dry_run:
        raise ValueError(problem)
    if problem:
        print(f"note: {problem}; a push without --dry-run is refused", file=sys.stderr)
    if report_files:
        (out / "eval").mkdir()
        for name, path in report_files.items():
            shutil.copyfile(path, out / "eval" / name)
    if training_config is not None:
        shutil.copyfile(training_config, out / "training_config.yaml")
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
                args.dry_run,
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
