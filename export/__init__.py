"""The engine-layout library: a trained head in the layouts serving engines load, and back.

One module per head type maps our head folder to each engine layout it serves and a published checkpoint back
(``eagle``, ``eagle3``, ``medusa``, ``dflash``, ``dspark``, ``dflash2``: ``layouts.EngineLayouts`` is the protocol
they implement); ``registry`` maps each head type to its module. Beside them: what the layouts share (``common``),
the model card (``card``) and the served-parity figures it carries (``parity``). The commands that use them are
in ``scripts/export``.

Nothing is imported here: the engines' side venv (no peft) imports ``parity`` and must not pull the heads in.
"""
