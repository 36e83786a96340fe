"""The key tables of docs/config.md, written from the schema, so the page cannot drift from the code.

    python -m titanlite.config.reference           # rewrite the tables in docs/config.md
    python -m titanlite.config.reference --check   # exit 1 if the page differs (tests/test_docs.py does this)

The page keeps its own prose; only the text between the two marker lines is written here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from titanlite.config.fields import choices_text
from titanlite.config.help import sections
from titanlite.config.keys import default_value
from titanlite.config.writing import toml_value

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"
BEGIN = "<!-- key tables: written by `python -m titanlite.config.reference` from the schema; do not edit by hand -->"
END = "<!-- end of key tables -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(f) -> str:
    value = default_value(f)
    return "none" if value is None else f"`{_cell(toml_value(value))}`"


def key_tables() -> str:
    """One table per section (key, default, meaning; titanlite's own keys marked), then one closing
    table of the TorchTitan keys accepted only at their default."""
    lines: list[str] = []
    for section, keys in sections():  # --help's order: model, training, parallelism, checkpoint, ...
        rows = []
        for key, f in keys:
            meta = f.metadata
            if meta["not_implemented"]:
                continue
            meaning = meta["help"] + choices_text(meta)
            for value, instead in meta["unsupported"].items():
                meaning += f"; `{value}` is refused: {instead}"
            mark = " *(titanlite)*" if meta["extension"] else ""
            rows.append(f"| `{key.rsplit('.', 1)[1]}`{mark} | {_default(f)} | {_cell(meaning)} |")
        if rows:
            lines += ["", f"### `[{section}]`", "", "| key | default | meaning |", "|---|---|---|", *rows]
    lines += ["", "### TorchTitan keys accepted only at their default", "",
              "Any other value stops the run before launch, in one line saying what to use instead.", "",
              "| key | default | instead |", "|---|---|---|"]
    lines += [f"| `{key}` | {_default(f)} | {_cell(f.metadata['not_implemented'])} |"
              for _, keys in sections() for key, f in keys if f.metadata["not_implemented"]]
    return "\n".join(lines).strip("\n")


def page_with_tables(page: str) -> str:
    head, found, rest = page.partition(BEGIN)
    _, found_end, tail = rest.partition(END)
    if not (found and found_end):
        raise SystemExit(f"{PAGE}: the marker lines are missing; put {BEGIN!r} and {END!r} where the tables go")
    return f"{head}{BEGIN}\n{key_tables()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config.md's tables are not the schema's")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    written = page_with_tables(page)
    if args.check:
        if written != page:
            print(f"{PAGE} is out of date: run python -m titanlite.config.reference", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
