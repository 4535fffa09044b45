"""Optimizers: mixed-precision AdamW over flat fp32 main parameters, gradient clipping, loss scaling, LR schedules."""
