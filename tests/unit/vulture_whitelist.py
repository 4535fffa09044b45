"""Names vulture reports as unused that are used, each with the reason (tests/unit/test_structure.py)."""
