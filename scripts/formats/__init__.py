"""Per-format name and config mappings between our head folders and what serving engines load.

Each module maps one head type both ways: ``export_files`` (our config + tensors -> the engine's
config.json + tensors) and ``import_files`` (a published checkpoint -> our head options, draft
arch and tensors). Which engine file each mapping matches is cited beside it and in docs/EXPORT.md.
"""
