"""Run the trainer (1 process) and die with SIGKILL's exit code at one point of its second
checkpoint save, as a crash or a power cut there would: `python crash_during_save.py POINT ARGS...`.

  data_written     the shards are written, DCP's metadata is not (the save's last write)
  before_commit    the save is complete in step-N.tmp, not yet renamed to step-N
  during_removal   keep_latest_k removes the oldest checkpoint: one of its files is gone
  between_renames  a save of a step that has a checkpoint already (a rewound run): the old one is
                   moved aside, the new one not yet moved in
"""

import os
import shutil
import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp

import titanlite.checkpoint.checkpointer
from titanlite.train import main

saves = 0
original_rmtree = shutil.rmtree
original_rename = Path.rename


def die() -> None:
    sys.stdout.flush()
    os._exit(137)


def crash_on_second(original):
    def wrapper(*args, **kwargs):
        global saves
        saves += 1
        if saves == 2:
            die()
        return original(*args, **kwargs)

    return wrapper


def rename_then_die_if_moved_aside(self, target):
    """Path.rename that dies right after a checkpoint is moved aside for its replacement."""
    result = original_rename(self, target)
    if str(target).endswith(".replaced"):
        die()
    return result


def remove_one_file_then_die(path, *args, **kwargs):
    """shutil.rmtree that dies after removing one data file of a complete checkpoint."""
    if (Path(path) / ".metadata").exists():
        next(Path(path).glob("*.distcp")).unlink()
        die()
    return original_rmtree(path, *args, **kwargs)


if __name__ == "__main__":
    point, args = sys.argv[1], sys.argv[2:]
    if point == "data_written":
        dcp.FileSystemWriter.finish = crash_on_second(dcp.FileSystemWriter.finish)
    elif point == "before_commit":
        titanlite.checkpoint.checkpointer.Checkpointer.commit = crash_on_second(titanlite.checkpoint.checkpointer.Checkpointer.commit)
    elif point == "during_removal":
        titanlite.checkpoint.checkpointer.shutil.rmtree = remove_one_file_then_die
    elif point == "between_renames":
        Path.rename = rename_then_die_if_moved_aside
    else:
        raise SystemExit(f"unknown point {point}")
    main(args)
