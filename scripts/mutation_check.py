"""Break the code on purpose, one line at a time, and check that the test meant to guard it fails.

    python scripts/mutation_check.py                  # every mutation in scripts/mutations.toml
    python scripts/mutation_check.py --only nan_loss  # some (repeat --only)
    python scripts/mutation_check.py --list           # names, files and tests
    python scripts/mutation_check.py --markdown F     # also write the result table to F
    python scripts/mutation_check.py --skip-baseline  # right after the whole suite passed on this tree

Each entry of scripts/mutations.toml names a file, the text `before` (found exactly once in it), the
text `after`, and the tests that must catch the change (pytest node ids). The mutation is applied to
a scratch copy of the working tree (the checkout itself is never touched), and its tests run there
with that copy first on the import path: tests that fail are "caught", tests that pass "missed"; a
timeout or a collection error is reported as such, and is not caught.
Before any mutation runs, the tests of the selected entries run once on the unchanged copy: a test
that fails there would make every mutation look caught. Exit status 1 if any mutation is not caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MUTATIONS = REPO / "scripts" / "mutations.toml"


def load_mutations(path: Path = MUTATIONS) -> list[dict]:
    entries = tomllib.loads(path.read_text())["mutation"]
    names = [e["name"] for e in entries]
    duplicated = {n for n in names if names.count(n) > 1}
    if duplicated:
        raise SystemExit(f"{path}: mutation names used twice: {sorted(duplicated)}")
    for entry in entries:
        missing = {"name", "file", "before", "after", "tests", "why"} - set(entry)
        if missing:
            raise SystemExit(f"{path}: mutation {entry.get('name', '?')} lacks {sorted(missing)}")
    return entries


def scratch_copy(destination: Path) -> None:
    """The working tree as git sees it (tracked and untracked files, none it ignores) in `destination`."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO, check=True,
        capture_output=True,
    ).stdout.decode().split("\0")
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def apply(root: Path, entry: dict) -> None:
    path = root / entry["file"]
    text = path.read_text()
    count = text.count(entry["before"])
    if count != 1:
        raise SystemExit(f"mutation {entry['name']}: its 'before' text occurs {count} times in {entry['file']}, not once")
    path.write_text(text.replace(entry["before"], entry["after"]))


def run_tests(root: Path, tests: list[str], python: str, timeout: int) -> tuple[str, str]:
    """(passed, failed, or why neither: a timeout, no test collected, an error; the tail of the output),
    the tests run in `root` with it first on the path. Only "failed" counts as caught."""
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "full or not full", *tests]
    try:
        out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout} s", ""
    outcome = {0: "passed", 1: "failed", 5: "no test collected"}.get(out.returncode, f"pytest error {out.returncode}")
    return outcome, (out.stdout + out.stderr)[-1500:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], help="run only this mutation (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--markdown", type=Path, help="write the result table (markdown) to this file")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs the tests")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per test run")
    parser.add_argument("--skip-baseline", action="store_true",
                        help="skip the unchanged-code run (only right after the whole suite passed on this tree)")
    args = parser.parse_args()

    entries = load_mutations()
    if args.only:
        unknown = set(args.only) - {e["name"] for e in entries}
        if unknown:
            raise SystemExit(f"no mutation named {sorted(unknown)}; see --list")
        entries = [e for e in entries if e["name"] in args.only]
    if args.list:
        for e in entries:
            print(f"{e['name']}: {e['file']} -> {' '.join(e['tests'])}")
        return

    with tempfile.TemporaryDirectory(prefix="titanlite-mutants-") as tmp:
        clean = Path(tmp) / "clean"
        scratch_copy(clean)
        if not args.skip_baseline:
            tests = sorted({t for e in entries for t in e["tests"]})
            print(f"baseline: {len(tests)} test(s) on the unchanged code ...", flush=True)
            outcome, output = run_tests(clean, tests, args.python, args.timeout)
            if outcome != "passed":
                raise SystemExit(f"the tests do not pass on the unchanged code ({outcome}); fix that first:\n{output}")
        rows = []
        for i, entry in enumerate(entries, 1):
            root = Path(tmp) / entry["name"]
            shutil.copytree(clean, root)
            apply(root, entry)
            start = time.monotonic()
            outcome, output = run_tests(root, entry["tests"], args.python, args.timeout)
            seconds = time.monotonic() - start
            verdict = {"failed": "caught", "passed": "missed"}.get(outcome, outcome)
            rows.append((entry, verdict, seconds))
            print(f"[{i}/{len(entries)}] {entry['name']}: {verdict} ({seconds:.0f}s)", flush=True)
            if verdict != "caught":
                print(f"    {entry['file']}: {entry['before']!r} -> {entry['after']!r}: {' '.join(entry['tests'])} {outcome}")
            shutil.rmtree(root)

    table = ["| mutation | file | what it breaks | test that must catch it | result |", "|---|---|---|---|---|"]
    for entry, verdict, seconds in rows:
        tests = "<br>".join(f"`{t}`" for t in entry["tests"])
        table.append(f"| {entry['name']} | `{entry['file']}` | {entry['why']} | {tests} | {verdict} ({seconds:.0f} s) |")
    missed = [e["name"] for e, verdict, _ in rows if verdict != "caught"]
    summary = f"{len(rows) - len(missed)} of {len(rows)} mutations caught" + (f"; not caught: {', '.join(missed)}" if missed else "")
    print("\n".join(table) + "\n" + summary)
    if args.markdown:
        args.markdown.write_text("\n".join(table) + "\n\n" + summary + "\n")
    raise SystemExit(1 if missed else 0)


if __name__ == "__main__":
    main()
