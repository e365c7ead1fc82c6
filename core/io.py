"""Atomic file writes: a reader (or a resumed job) never sees a half-written file.

Each write goes to a hidden temporary beside its target (``.<name>.<random>.tmp``) and lands in
one rename. A writer killed with SIGKILL cannot clean up, so the next write of the same target
removes the temporaries that earlier, dead writers of that target left behind. A write that runs
out of room (full disk, quota, file-size limit) raises ``OutOfSpaceError`` saying which, and
leaves the previous file in place. ``output_lock`` keeps a second writer out of a folder in use, and
``check_writable`` says "read-only" where a free-space check would say "full".

Reading: ``read_jsonl`` is the one JSON Lines reader; a line it cannot decode is a ``DataError`` naming
``file:line`` and what is wrong with it (``parse_json_line``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from headstart.core.errors import DataError

NO_ROOM = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "the file size limit (ulimit -f, RLIMIT_FSIZE) was reached",
}


class OutOfSpaceError(OSError):
    """Out of room: a write that ran out (the message names the file, what ran out and the free space), or
    a free-space check before a long write (``data_recipes.capture_plan.check_free_disk``) that says it would."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _file_mode() -> int:
    """The mode any new file gets under the umask (0644 under 022).

    Given to what we write once its writer is done: mkstemp makes 0600, and writers that replace the
    file they are handed (safetensors' ``save_file`` writes its own 0600 file and renames it) would
    otherwise leave a file that only its owner can read.
    """
    return 0o666 & ~_umask()


# torch.save's zip writer (what DeepSpeed's checkpoints go through) reports a write the disk refused in its own
# words, without the OS error: "[enforce fail at inline_container.cc:672] unexpected pos", "basic_ios::clear:
# iostream error", "PytorchStreamWriter failed writing file".
TORCH_SHORT_WRITE = ("unexpected pos", "basic_ios::clear", "iostream error", "PytorchStreamWriter failed writing")


def _no_room(err: BaseException) -> int | None:
    """The errno of an out-of-room failure, else None.

    Native writers raise their own exception types: safetensors' Rust core only quotes the OS error, as
    ``... (os error 28)``; torch's zip writer says none (``TORCH_SHORT_WRITE``), taken as a full disk.
    """
    if isinstance(err, OSError) and err.errno in NO_ROOM:
        return err.errno
    if isinstance(err, RuntimeError) and any(words in str(err) for words in TORCH_SHORT_WRITE):
        return errno.ENOSPC
    return next((code for code in NO_ROOM if f"(os error {code})" in str(err)), None)


def size_text(size: int | float) -> str:
    """Bytes in words for an error: GB, or MB below 10 MB (where "0.00 GB" would say nothing)."""
    return f"{size / 1e9:.2f} GB" if size >= 1e7 else f"{size / 1e6:.2f} MB"


def free_space_problem(folder: Path, needed: int, what: str, remedy: str) -> str | None:
    """Why ``folder`` (or the ancestor it would be made in) lacks the ``needed`` bytes ``what`` writes, ending in
    ``remedy``; None when it has them. Said before a long write: running out midway loses the work, and some
    writers' errors name no file."""
    existing = next(p for p in [folder, *folder.absolute().parents] if p.exists())
    free = shutil.disk_usage(existing).free
    if needed <= free:
        return None
    return f"{what} needs {size_text(needed)} more in {folder} but only {size_text(free)} is free: {remedy}"


def _remove_leftovers(path: Path) -> None:
    """Temporaries of ``path`` from writers that died before their rename (or cleanup)."""
    # mkstemp/mkdtemp names: the prefix, 8 characters of [a-z0-9_], the suffix.
    for stale in glob.glob(glob.escape(str(path.parent / f".{path.name}.")) + "[a-z0-9_]" * 8 + ".tmp"):
        shutil.rmtree(stale) if os.path.isdir(stale) else os.unlink(stale)


@contextlib.contextmanager
def out_of_space_named(path: Path, kept: str | None = None) -> Iterator[None]:
    """A write of ``path`` in the block that runs out of room becomes ``OutOfSpaceError`` naming ``path``, what ran
    out, the free space and what was ``kept`` (by default: the previous ``path``, as the atomic writes keep it)."""
    try:
        yield
    except Exception as err:
        code = _no_room(err)
        if code is None:
            raise
        free = shutil.disk_usage(path.parent).free
        kept = kept or f"the previous {path.name}, if any, is untouched"
        raise OutOfSpaceError(
            code, f"writing {path} failed: {NO_ROOM[code]} ({size_text(free)} free in {path.parent}); {kept}"
        ) from err


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` in one rename.

    The temporary file lives in the same directory so ``os.replace`` is atomic, and it is
    removed if the writer raises (a full disk, say), leaving the previous ``path`` untouched.
    The result has the mode of any new file (``_file_mode``), whatever the writer gave it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        with out_of_space_named(path):
            yield tmp_path
            with open(tmp_path, "rb") as f:
                os.fsync(f.fileno())
        os.chmod(tmp_path, _file_mode())
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``path`` only once everything in it is written.

    Its files get the mode of any new file (``_file_mode``), whatever their writers gave them.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes 0700
    try:
        with out_of_space_named(path):
            yield tmp
        mode = _file_mode()
        for folder, _, names in os.walk(tmp):  # links are left alone: their targets are not ours
            for name in names:
                if not os.path.islink(file := os.path.join(folder, name)):
                    os.chmod(file, mode)
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)  # a writer killed between the two renames below left it
        if path.exists():
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def parse_json_line(raw: bytes) -> Any:
    """One JSON Lines line, as bytes -> its value, or ValueError saying what is wrong (``read_jsonl`` adds
    ``file:line``)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"not UTF-8 text (byte {raw[err.start]:#04x} at byte {err.start + 1} of the line): "
            f"re-encode the file as UTF-8"
        ) from err
    try:
        return json.loads(text.rstrip("\r\n"))  # so an error at the end of the line is not "column 1" of the next
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg} at column {err.colno})") from err


def read_jsonl(path: str | Path, on_bad_record: Callable[[DataError], None] | None = None) -> Iterator[tuple[str, Any]]:
    """Yield ``(location, value)`` for each non-blank line of a JSON Lines file; ``location`` is ``path:line``
    (``path`` as given, lines counted from 1).

    A line that is not UTF-8 or not JSON raises DataError naming it, or is handed to ``on_bad_record`` and
    skipped when one is given (a generator cannot go on after raising, so the caller decides here).
    The file is read as bytes: a text-mode iterator meeting bytes that are not UTF-8 raises
    UnicodeDecodeError from inside the loop, naming neither the file nor the line.
    """
    with Path(path).expanduser().open("rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            location = f"{path}:{line_no}"
            try:
                value = parse_json_line(line)
            except ValueError as err:
                bad = DataError(str(err), location)
                if on_bad_record is None:
                    raise bad from err
                on_bad_record(bad)
                continue
            yield location, value


class NotWritableError(OSError):
    """An output folder that cannot be written at all: a read-only file system, or no permission."""


def check_writable(folder: str | Path) -> None:
    """NotWritableError naming ``folder`` when nothing can be written there (or in the ancestor it would be made in).

    Checked before a free-space check, which would otherwise report a read-only folder (0 bytes free on
    squashfs, ISO or a read-only NFS export) as a full disk. ``os.access`` answers for this process: it
    sees file permissions, the immutable attribute and read-only mounts, for root as well.
    """
    folder = Path(folder)
    existing = next(p for p in [folder, *folder.absolute().parents] if p.exists())
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        code, why = errno.EROFS, "is on a read-only file system"
    elif not os.access(existing, os.W_OK | os.X_OK):
        code, why = errno.EACCES, "is not writable by this process (permissions, an immutable folder or a policy)"
    else:
        return
    problem = f"{folder} {why}" if existing == folder else f"{folder} cannot be made: {existing} {why}"
    raise NotWritableError(code, f"{problem}; choose a writable output folder")


class FolderLockedError(RuntimeError):
    """Another live process is writing the same output folder."""


LOCK_NAME = ".lock"


@contextlib.contextmanager
def output_lock(folder: str | Path) -> Iterator[Path]:
    """Hold ``folder`` (made if missing) for this process alone while the block writes into it; yields it.

    Two writers of one folder would delete each other's temporaries (``_remove_leftovers``) and mix their
    files. The lock is ``flock`` on ``<folder>/.lock``: the kernel drops it when its holder exits, SIGKILL
    included, so a dead writer never blocks the next one. The file holds the holder's pid, for the
    message a second writer gets, and is removed on release.
    """
    folder = Path(folder)
    check_writable(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    fd = _take_lock(path)
    try:
        yield folder
    finally:
        path.unlink(missing_ok=True)  # still held here: a writer that opened this file retries on a new one
        os.close(fd)


def _take_lock(path: Path) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FolderLockedError(
                f"{path.parent} is being written by another process (pid {holder}, holding {path}): "
                "wait for it to finish or stop it; two writers of one folder would delete each other's files"
            ) from None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return fd
        os.close(fd)  # the holder released (and removed) it between our open and our flock: lock the new one
