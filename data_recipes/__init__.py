"""Dataset recipes (chat template, loss masks), target regeneration and hidden-state capture."""
