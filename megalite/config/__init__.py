"""Typed configuration: the dataclasses and their derived sizes (schema.py), Megatron's command line that
fills them (megatron_cli.py, with cli.py's parser and number types and batch_schedule.py's schedules), and
every rule between their fields (validate.py)."""
