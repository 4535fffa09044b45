"""Update rules by their --optimizer name. A rule is built from the master pieces, their learning-rate
groups and the OptimizerConfig, and exposes ``state_names``, ``named_state(master)``, ``step_count``
(settable), ``state_tensors()`` and ``step(masters, grads, group_lr)`` (rules/adamw.py). A new rule is
one file here and one line below; its name also goes in config.schema.OPTIMIZERS (the flag's choices)."""
from megalite.optim.rules.adamw import AdamW

RULES = {"adam": AdamW}
