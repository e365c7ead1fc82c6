"""The decoding engine: draft trees, the one verification core, every proposer and the tree/schedule rules.

The evaluation harness (``eval/``), training's measured acceptance (``train/``) and the export checks import it;
it imports only ``core`` and ``heads``.
"""

from headstart.decoding.head_proposers import register_proposer
from headstart.decoding.proposers_block import DFlash, DFlash2, Domino
from headstart.decoding.proposers_dspark import DSpark
from headstart.decoding.proposers_eagle import Eagle, PEagle
from headstart.decoding.proposers_medusa import Medusa

# The proposers of the package's head types, one line per drafting method (heads.register adds the method; a head
# type from elsewhere: head_proposers.register_proposer).
register_proposer("eagle", Eagle)
register_proposer("eagle3", Eagle)
register_proposer("peagle", PEagle)
register_proposer("medusa", Medusa)
register_proposer("dflash", DFlash)
register_proposer("dspark", DSpark)
register_proposer("dflash2", DFlash2)
register_proposer("mtp", Eagle)  # the target's MTP layer drafts as an EAGLE-1 head does: a feature per step
register_proposer("domino", Domino)
