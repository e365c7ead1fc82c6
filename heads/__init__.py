"""Draft-head modules: EAGLE-1/2, EAGLE-3 and Medusa (built on the shared core only)."""
