"""Top-floor tools: demo, export, import, hub push and building the bundled models."""
