"""Every config field is set by exactly one command-line flag or says what it is derived from; no flag is
defined twice; every flag of megatron_flags_accepted.txt (the recorded list of flags pretrain_gpt.py
accepts) is accepted."""
import os
from collections import Counter
from dataclasses import fields

from megalite.config.megatron_cli import COMPAT_FLAGS, MEGATRON_INPUTS, build_parser, field_flags
from megalite.config.fields import DERIVED, FLAG
from megalite.config.schema import CONFIG_SECTIONS

ACCEPTED = os.path.join(os.path.dirname(__file__), "megatron_flags_accepted.txt")


def test_each_field_has_one_flag_or_a_derivation():
    for section in CONFIG_SECTIONS:
        for f in fields(section):
            kinds = [key for key in (FLAG, DERIVED) if key in f.metadata]
            assert len(kinds) == 1, f"{section.__name__}.{f.name}: give it a flag(...) or derived(...), not {kinds}"
            if DERIVED in f.metadata:
                assert f.metadata[DERIVED].strip(), f"{section.__name__}.{f.name}: say what it is derived from"


def test_no_flag_is_defined_twice():
    names = [name for section in CONFIG_SECTIONS for name, _ in field_flags(section)]
    names += [name for name, _ in MEGATRON_INPUTS + COMPAT_FLAGS]
    twice = [name for name, count in Counter(names).items() if count > 1]
    assert not twice, twice
    parser_flags = [s for action in build_parser()._actions for s in action.option_strings if s not in ("-h", "--help")]
    assert sorted(parser_flags) == sorted(names)


def test_a_field_flag_stores_into_its_field():
    for section in CONFIG_SECTIONS:
        for name, keywords in field_flags(section):
            assert keywords["dest"] in {f.name for f in fields(section)}, name


def test_every_flag_accepted_before_is_still_accepted():
    with open(ACCEPTED) as f:
        before = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    now = {s for action in build_parser()._actions for s in action.option_strings}
    assert not before - now, sorted(before - now)
