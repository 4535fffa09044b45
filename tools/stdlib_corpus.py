#!/usr/bin/env python
"""Write the running Python's standard library as a JSONL text corpus (one document per .py file).

Every machine with Python has this text, so the demo trains on real data without a download:

    python tools/stdlib_corpus.py --output data/stdlib.jsonl [--max-mb 20] [--include-tests]

Each line is ``{"text": <source>, "path": <path relative to the stdlib>}``. Files are visited in sorted
order, so the output is deterministic for a given Python installation. site-packages, __pycache__,
unreadable and non-UTF-8 files are skipped; test suites are skipped unless --include-tests.
"""
from __future__ import annotations

import json
import os
import sys
import sysconfig
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config.cli import OneLineArgumentParser, one_line_errors  # noqa: E402
from megalite.errors import UserError  # noqa: E402

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def _is_test_path(rel: str) -> bool:
    parts = rel.split(os.sep)[:-1]
    return any(p in ("test", "tests", "idle_test") for p in parts)


def stdlib_files(root: str, include_tests: bool) -> list[str]:
    """Relative paths of the .py files under ``root``, sorted (deterministic)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                if include_tests or not _is_test_path(rel):
                    found.append(rel)
    return sorted(found)


def write_corpus(output: str, max_mb: float, include_tests: bool, root: str | None = None,
                 overwrite: bool = False) -> dict:
    root = root or sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise UserError(f"--root {root}: no such folder; give the standard library's folder (default: this "
                        "Python's)")
    if os.path.exists(output) and not overwrite:
        raise UserError(f"--output {output} already exists; pass --overwrite to replace it")
    budget = int(max_mb * 1024 * 1024)
    stats = {"files": 0, "bytes": 0, "skipped_unreadable": 0, "skipped_non_utf8": 0,
             "skipped_empty": 0, "stopped_at_cap": False}
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = f"{output}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for rel in stdlib_files(root, include_tests):
                try:
                    with open(os.path.join(root, rel), "rb") as f:
                        raw = f.read()
                except OSError:
                    stats["skipped_unreadable"] += 1
                    continue
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    stats["skipped_non_utf8"] += 1
                    continue
                if not text.strip():
                    stats["skipped_empty"] += 1
                    continue
                if stats["bytes"] + len(raw) > budget:
                    stats["stopped_at_cap"] = True
                    break
                out.write(json.dumps({"text": text, "path": rel.replace(os.sep, "/")},
                                     ensure_ascii=False) + "\n")
                stats["files"] += 1
                stats["bytes"] += len(raw)
        if stats["files"] == 0:
            raise UserError(f"no readable .py files found under {root}")
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return stats


@one_line_errors
def main(argv=None) -> int:
    parser = OneLineArgumentParser(prog="tools/stdlib_corpus.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--max-mb", type=float, default=20.0,
                        help="stop before the corpus exceeds this many MiB of source (default 20)")
    parser.add_argument("--include-tests", action="store_true",
                        help="also include the standard library's test suites")
    parser.add_argument("--root", default=None, help="library folder (default: this Python's stdlib)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    args = parser.parse_args(argv)
    start = time.time()
    stats = write_corpus(args.output, args.max_mb, args.include_tests, args.root, args.overwrite)
    skipped = stats["skipped_unreadable"] + stats["skipped_non_utf8"] + stats["skipped_empty"]
    print(f"wrote {args.output}: {stats['files']} documents, {stats['bytes'] / 1e6:.1f} MB "
          f"(skipped {skipped}: {stats['skipped_non_utf8']} non-UTF-8, {stats['skipped_unreadable']} "
          f"unreadable, {stats['skipped_empty']} empty{'; stopped at --max-mb' if stats['stopped_at_cap'] else ''}) "
          f"in {time.time() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
