"""Developer tools: building the bundled demo models, comparing captures and regenerations, the GPU check."""
