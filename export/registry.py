"""Head type -> its engine layouts (``layouts.EngineLayouts``): the package's head types are registered below, one
line each; a head type from elsewhere registers its own after its ``heads.register`` call.

    register_layouts("mine", MyLayouts())      # a head type from outside the package
    layouts_of("eagle3").LAYOUTS               # ("vllm", "sglang", "speculators")
    written_layouts()                          # every --format choice, in the head types' registration order

A head type with no layouts registered is trained, evaluated and tuned as any other; export refuses it.
"""

from __future__ import annotations

from headstart.core.settings import rebuild_schemas
from headstart.export import dflash, dflash2, domino, dspark, eagle, eagle3, medusa, mtp
from headstart.export.layouts import EngineLayouts
from headstart.heads import HEAD_TYPES, head_type

HEAD_LAYOUTS: dict[str, EngineLayouts] = {}


def register_layouts(name: str, layouts: EngineLayouts) -> EngineLayouts:
    """Export writes, and import reads, the registered head type ``name`` in ``layouts`` from now on (the
    commands' ``--format`` and ``--from`` choices too: every schema is rebuilt)."""
    head_type(name)  # refuses a head type that is not registered
    if HEAD_LAYOUTS.get(name, layouts) is not layouts:
        raise ValueError(f"engine layouts for {name!r} heads are registered already")
    HEAD_LAYOUTS[name] = layouts
    rebuild_schemas()
    return layouts


def layouts_of(name: str) -> EngineLayouts:
    """The engine layouts of the head type ``name``."""
    if name not in HEAD_LAYOUTS:
        raise ValueError(f"no engine layout is declared for {name} heads (export.registry.register_layouts)")
    return HEAD_LAYOUTS[name]


def exported_types() -> dict[str, EngineLayouts]:
    """Every registered head type that engines serve -> its layouts, in registration order."""
    return {name: HEAD_LAYOUTS[name] for name in HEAD_TYPES if name in HEAD_LAYOUTS}


def written_layouts() -> tuple[str, ...]:
    """Every layout export writes (``--format``), in the order the head types declare them."""
    return tuple(dict.fromkeys(fmt for found in exported_types().values() for fmt in found.LAYOUTS))


def sources() -> dict[str, str]:
    """Every layout import reads (``--from``) -> the head type that reads it."""
    return {kind: name for name, found in exported_types().items() for kind in found.SOURCES}


def export_files_names() -> frozenset[str]:
    """Every file an export may hold: what tells an earlier export from a folder of the user's."""
    return frozenset(name for found in exported_types().values() for name in found.FILES)


# The package's head types' layouts, one line each.
register_layouts("eagle", eagle)
register_layouts("eagle3", eagle3)
register_layouts("medusa", medusa)
register_layouts("dflash", dflash)
register_layouts("dspark", dspark)
register_layouts("dflash2", dflash2)
register_layouts("mtp", mtp)
register_layouts("domino", domino)
