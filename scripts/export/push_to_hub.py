"""Publish a head on the Hugging Face Hub: its export, with a model card, eval report and training config.

    python -m scripts.export.push_to_hub --head runs/demo/eagle3/head --repo-id ORG/NAME [--format vllm] [--target PATH]
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
is refused. Every staged file is then redacted with ``core.redact``'s one rule set: a secret (by its shape,
``sk-...``, ``hf_...``, ``AKIA...``, an ``Authorization`` header, or by its name, ``api_key: ...``,
``HF_TOKEN=...``), a credential inside a URL and every local path (``/home/me``, ``~/x``, ``~user/x``,
``file:///x``, ``C:\\Users\\me``, also after ``key:`` and as a JSON or YAML key) are replaced, and the run lists
each by file, key and kind. A file that cannot be rewritten (weights whose header metadata holds one, a binary
file holding a secret's shape) is refused, naming it.
``--repo-id`` must be ``namespace/name`` as the hub takes it, checked before anything is staged.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import ClassVar, NamedTuple

from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.utils import HFValidationError, validate_repo_id
from pydantic import Field
from safetensors import safe_open

from headstart.core.command_flags import CommandFlags, command_failed
from headstart.core.config_files import run_command
from headstart.core.redact import LOCAL_PATH, redact_data, redact_document, redact_text
from headstart.export.common import file_inside
from headstart.heads import read_head_config
from headstart.scripts.export.command import ExportFormat, export_head


class Push(CommandFlags):
    """``python -m scripts.export.push_to_hub``'s flags, the config's ``push:`` section: a head's export, card and eval
    report on the Hugging Face Hub."""

    section: ClassVar[str] = "push"

    head: str = Field(description="a head folder saved by training")
    repo_id: str = Field(description="ORG/NAME on the hub")
    format: ExportFormat = Field("vllm", description="export format")
    target: str | None = Field(
        None, description="the target to check the head against; null: the one in the head's config"
    )
    target_id: str | None = Field(None, description="the target as users load it, e.g. its hub id; null: --target")
    report: str | None = Field(
        None, description="an eval report folder (report.md, report.json, *.png) to show in the card"
    )
    parity: str | None = Field(
        None, description="parity.json from `make verify-engines`: the served-acceptance figures go in the card"
    )
    private: bool = Field(False, description="make the hub repo private, when this creates it")
    dry_run: bool = Field(False, description="print the staged files and card; upload nothing")


REPORT_FILES = ("report.md", "report.json")
HEAD_NAME = "<head-folder>"  # how the card names the head folder: its path is the uploader's own business

# The hub's own rules for a repo id (huggingface_hub.utils.validate_repo_id, which also takes a bare name): each
# part of namespace/name of these characters, no '--' or '..', no '-' or '.' at either end, at most 96 long.
HUB_ID_PART = re.compile(r"[A-Za-z0-9._-]{1,96}")


class Redaction(NamedTuple):
    file: str  # its path in the hub repo
    key: str  # the dotted key of a JSON or YAML value, else "line N"
    kind: str  # core.redact's kind: secret, credential in a URL, local path (... in a key)

    def __str__(self) -> str:
        return f"{self.file}: {self.key} ({self.kind})"


class Staged(NamedTuple):
    folder: Path  # what the hub repo gets
    redacted: list[Redaction]  # what was replaced in it on the way


def check_repo_id(repo_id: str, flag: str = "--repo-id") -> None:
    """ValueError naming ``flag`` and the id unless it is ``namespace/name`` as the hub takes it: a dry run must
    not stage, under ``../../etc`` or ``a/b/c``, what an upload would then refuse (or put elsewhere)."""
    parts = repo_id.split("/")
    if len(parts) != 2:
        problem = f"it must be namespace/name, with one '/' (got {len(parts) - 1})"
    else:
        problem = next((p for p in map(_hub_part_problem, parts) if p), "")
    if problem:
        raise ValueError(f"{flag} {repo_id!r} is not a hub id: {problem}")


def _hub_part_problem(part: str) -> str:
    if not HUB_ID_PART.fullmatch(part):
        return f"{part!r} must be 1 to 96 of A-Z, a-z, 0-9, '.', '_', '-'"
    if ".." in part or "--" in part:
        return f"{part!r} holds '..' or '--'"
    if part[0] in "-." or part[-1] in "-.":
        return f"{part!r} starts or ends with '-' or '.'"
    return ""


def redact_file(path: Path, name: str) -> list[Redaction]:
    """Redact a staged file in place (rewritten only when something was found); ``name``: its repo path.

    Text (JSON and YAML value by value, so each find has its key, ``target.path``; other text by line) with
    ``core.redact``'s rules. A file that is not text cannot be rewritten safely: one holding a secret's shape,
    or a safetensors file whose header metadata holds a secret or a path, is refused naming it and the key."""
    data = path.read_bytes()
    if path.suffix == ".safetensors":
        _check_metadata(path, name)
        return []
    try:
        text = data.decode()
    except UnicodeDecodeError:
        _check_binary(data, name)
        return []
    redacted, found = redact_document(text, path.suffix)
    if found:
        path.write_text(redacted)
    return [Redaction(name, key, kind) for key, kind in found]


def _check_metadata(path: Path, name: str) -> None:
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    found: list[tuple[str, str]] = []
    redact_data(metadata, "__metadata__", found)
    if found:
        key, kind = found[0]
        raise ValueError(f"{name}: its header's {key} holds a {kind}; weights are not rewritten: save them without it")


def _check_binary(data: bytes, name: str) -> None:
    # Paths are not looked for: any byte string holds '/' runs. A secret's shape in random bytes is ~1e-40 likely.
    _, found = redact_text(data.decode("ascii", "replace"))  # non-ASCII bytes: U+FFFD, no word character
    if any(kind != LOCAL_PATH for _, kind in found):
        kind = next(kind for _, kind in found if kind != LOCAL_PATH)
        raise ValueError(f"{name}: a binary file that holds a {kind}; it cannot be redacted: leave it out")


def redact_folder(folder: Path) -> list[Redaction]:
    """Every staged file redacted or checked (``redact_file``): what is staged becomes public."""
    found: list[Redaction] = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        found += redact_file(path, str(path.relative_to(folder)))
    return found


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
) -> Staged:
    """Write everything the hub repo gets into ``out``, redacted (``redact_folder``); return it and the redactions.

    A target that is no hub id is refused, unless ``dry_run`` (nothing is published): then a note says so.
    """
    check_repo_id(repo_id)  # it names the repo in the card too
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
    # HEAD_NAME stands for the user's folder: a placeholder, not a value to quote.
    made_by = f"python -m scripts.export.push_to_hub --head {HEAD_NAME} " + shlex.join(
        ["--repo-id", repo_id, "--format", fmt]
    )
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
    return Staged(out, redact_folder(out))


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


def parse_args(argv: list[str] | None = None) -> Push:
    """The command line as validated settings: the flags are ``Push``'s fields."""
    return Push.from_argv(argv, "python -m scripts.export.push_to_hub", __doc__.split("\n")[0])


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


def run(args: Push) -> None:
    """Stage what ``args`` describe (from flags, or a config's ``push:`` section), then upload it unless a dry run."""
    with tempfile.TemporaryDirectory(prefix="headstart-hub-") as tmp:
        try:
            folder, redacted = stage(
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
            command_failed(f"push_to_hub failed: {err}")
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        print(f"staged for {args.repo_id}:")
        for path in files:
            print(f"  {path.relative_to(folder)}  ({path.stat().st_size} bytes)")
        if redacted:
            print("redacted (replaced in the staged files, never published):")
            for redaction in redacted:
                print(f"  {redaction}")
        if args.dry_run:
            print("\n" + (folder / "README.md").read_text())
            return
        try:
            print(f"uploaded: {upload(folder, args.repo_id, args.private)}")
        except RuntimeError as err:
            command_failed(f"push_to_hub failed: {err}")


if __name__ == "__main__":
    run_command(main, "python -m scripts.export.push_to_hub")
