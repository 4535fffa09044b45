"""Typed configuration: the dataclasses, Megatron's command line that fills them, and every cross-field rule."""
