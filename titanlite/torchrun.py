"""torchrun, with a rank's one-line error instead of the launcher's traceback (run_train.sh uses it):

    python -m titanlite.torchrun [torchrun options] -m titanlite.train [--section.key value ...]

A rank that stops on bad input only it can see (a config error: exit code 2) or on diverged training
(exit code 1) writes its line into TITANLITE_ERROR_DIR instead of printing it. When the job fails,
this prints the line of the lowest such rank of the job's latest attempt, once, and exits with its
code; torchrun's reports of that failure (its log lines and the ChildFailedError traceback) are left
out. Any other failure keeps torchrun's report of which rank died and how, without the launcher's
own Python traceback.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path

ERROR_DIR = "TITANLITE_ERROR_DIR"


def attempt() -> int:
    """Which attempt of the job this is (torchrun counts its restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _write_atomically(path: Path, text: str) -> None:
    """Readers never see a half-written file (a rank may be stopped mid-write)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def start_attempt() -> None:
    """Under this launcher: record that this attempt of the job started, so errors of an attempt
    that torchrun then restarted are not reported as the job's."""
    folder = os.environ.get(ERROR_DIR)
    if folder:
        _write_atomically(Path(folder, "attempt"), str(attempt()))


def write_error(message: str, code: int) -> bool:
    """Under this launcher: leave the rank's line for it and return True; else return False."""
    folder = os.environ.get(ERROR_DIR)
    if not folder:
        return False
    rank = int(os.environ.get("RANK", "0"))
    record = {"rank": rank, "code": code, "message": message}
    _write_atomically(Path(folder, f"attempt{attempt()}.rank{rank}.json"), json.dumps(record))
    return True


def first_error(folder: str) -> dict | None:
    """The lowest rank's error in the latest attempt, or None."""
    try:
        latest = int(Path(folder, "attempt").read_text())
    except (OSError, ValueError):
        return None
    errors = [json.loads(p.read_text()) for p in Path(folder).glob(f"attempt{latest}.rank*.json")]
    return min(errors, key=lambda e: e["rank"]) if errors else None


class _UnlessRankReported(logging.Filter):
    """Drops torchrun's log lines once a rank has reported its own error: they only retell it."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def filter(self, record: logging.LogRecord) -> bool:
        return first_error(self.folder) is None


def torch_log_handlers() -> list[logging.Handler]:
    """The handlers that print torch.distributed's log lines (torch gives several loggers their own)."""
    loggers = [logging.getLogger("torch")] + [
        logger for name, logger in logging.Logger.manager.loggerDict.items()
        if name.startswith("torch.distributed") and isinstance(logger, logging.Logger)
    ]
    return [handler for logger in loggers for handler in logger.handlers]


def color_console(train_args: list[str]) -> None:
    """Ranks print plain lines into torchrun's pipes and log files; on a terminal, colour them here,
    as they reach it (metrics.disable_color_printing and NO_COLOR say no)."""
    from titanlite.config import parse_args
    from titanlite.errors import ConfigError
    from titanlite.metrics import ColorizedStream, use_color

    try:
        config = parse_args(train_args)
    except (ConfigError, SystemExit):
        return  # the rank reports a bad config itself
    if use_color(config, sys.stdout):
        sys.stdout = ColorizedStream(sys.stdout)


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    color_console(args.training_script_args)
    with tempfile.TemporaryDirectory(prefix="titanlite-errors-") as folder:
        os.environ[ERROR_DIR] = folder  # the workers inherit it
        quiet = _UnlessRankReported(folder)
        for handler in torch_log_handlers():
            handler.addFilter(quiet)
        try:
            run(args)
        except ChildFailedError as e:
            error = first_error(folder)
            if error is None:
                print(e, file=sys.stderr)
                raise SystemExit(1)
            print(error["message"], file=sys.stderr)
            raise SystemExit(error["code"])


if __name__ == "__main__":
    main()
