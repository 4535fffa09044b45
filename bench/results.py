"""One benchmark's section of bench/RESULTS.md, replaced in place; the other sections stay as they are."""
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def replace_section(key: str, lines: list[str], path: str = RESULTS) -> None:
    begin, end = f"<!-- {key} begin -->", f"<!-- {key} end -->"
    block = "\n".join([begin, *lines, end])
    text = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)
