"""Tree-based verification, baselines and reports."""
