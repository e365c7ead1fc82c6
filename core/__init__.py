"""The small shared core every headstart package may import: config, I/O and runtime helpers."""
