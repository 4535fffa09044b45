"""Update rules by their --optimizer name. A rule is built from the master pieces, their learning-rate
groups and the OptimizerConfig (Muon also from each piece's optim/muon_matrices.Matrix, None for the
pieces its scalar optimizer steps), and exposes ``state_names`` (the state of a piece that is not a Muon
matrix), ``matrix_state_names`` (of one that is), ``named_state(master)``, ``step_count`` (settable),
``state_tensors()`` and ``step(masters, grads, group_lr)`` (rules/adamw.py). A new rule is one file here
and one line below; its name also goes in config.schema.OPTIMIZERS (the flag's choices)."""
from megalite.optim.rules.adamw import AdamW
from megalite.optim.rules.muon import Muon

RULES = {"adam": AdamW, "muon": Muon}
