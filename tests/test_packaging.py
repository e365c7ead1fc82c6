"""The installed layout: the repository's folders become ``headstart.<folder>``, and imports run one way."""

import ast

import tomllib

from tests.helpers import REPO

LIBRARY = ("core", "heads", "data_recipes", "decoding", "train", "eval", "export", "scripts")
# Which of our packages each folder may import (docs/ARCHITECTURE.md): core <- heads, data_recipes <- decoding (the
# engine) <- train, eval, export (the engine layouts) <- scripts. train, eval and export never import each other;
# the engine imports none of them; nothing imports scripts.
MAY_IMPORT = {
    "core": {"core"},
    "heads": {"core", "heads"},
    "data_recipes": {"core", "data_recipes"},
    "decoding": {"core", "heads", "decoding"},
    "train": {"core", "heads", "data_recipes", "decoding", "train"},
    "eval": {"core", "heads", "data_recipes", "decoding", "eval"},
    "export": {"core", "heads", "data_recipes", "decoding", "export"},
    "scripts": set(LIBRARY),
}
# The commands' folders under scripts/ that never import each other: what two of them share lives on a floor below.
APART = ("bench", "dev")


def our_imports(path):
    """(line, top folder) of every import of our modules in ``path``, and any import by a bare folder name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found += [(node.lineno, name) for name in names if name.split(".")[0] in ("headstart", *LIBRARY)]
    return found


def apart_folder(parts):
    """``bench`` for ``headstart.scripts.bench...`` (a module's name, or its path's parts below ``headstart``)."""
    return parts[2] if len(parts) > 2 and parts[1] == "scripts" and parts[2] in APART else None


def test_every_package_folder_is_installed_under_headstart():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {str(init.parent.relative_to(REPO)) for top in LIBRARY for init in (REPO / top).rglob("__init__.py")}
    expected = {"headstart." + folder.replace("/", "."): folder for folder in folders}
    assert setuptools["package-dir"] == expected
    assert sorted(setuptools["packages"]) == sorted(expected)


def test_our_modules_are_imported_by_their_installed_names_and_one_way():
    wrong = []
    for top in LIBRARY:
        for path in sorted((REPO / top).rglob("*.py")):
            here = apart_folder(["headstart", *path.relative_to(REPO).parts])
            for line, name in our_imports(path):
                parts = name.split(".")
                if parts[0] != "headstart":
                    wrong.append(f"{path.relative_to(REPO)}:{line} imports {name} by its bare folder name")
                elif len(parts) > 1 and parts[1] not in MAY_IMPORT[top]:
                    wrong.append(f"{path.relative_to(REPO)}:{line}: {top} may not import {name}")
                elif here and apart_folder(parts) not in (None, here):
                    wrong.append(f"{path.relative_to(REPO)}:{line}: scripts/{here} may not import {name}")
    for path in sorted((REPO / "tests").rglob("*.py")):
        wrong += [
            f"{path.relative_to(REPO)}:{line} imports {name} by its bare folder name"
            for line, name in our_imports(path)
            if not name.startswith("headstart")
        ]
    assert not wrong, "\n".join(wrong)
