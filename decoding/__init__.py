"""The decoding engine: draft trees, the one verification core, every proposer and the tree/schedule rules.

The evaluation harness (``eval/``), training's measured acceptance (``train/``) and the export checks import it;
it imports only ``core`` and ``heads``.
"""
