"""Observability primitives that every floor of megalite may call: named timers (``Timers``), the waiting
clock of the straggler report (``waiting``, ``WaitClock``) and the memory accounting's labels
(``memory_label``). They import nothing of megalite, so communication and optimizer code can mark its
waits and allocations; the reports built on them (train/straggler.py, train/memory_account.py,
train/metrics.py) live with the training loop."""
