"""A torchrun worker for the launcher test: every rank leaves a config error of its own, then they
exit highest rank first, so the line the launcher shows must be chosen by rank, not by which rank
ended first (torchrun stops the others once one has exited)."""

import os
import time
from pathlib import Path

from titanlite.torchrun import ERROR_DIR, start_attempt, write_error

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if rank == 0:
    start_attempt()
write_error(f"titanlite: config error: rank {rank} says so", 2)
deadline = time.monotonic() + 30
while len(list(Path(os.environ[ERROR_DIR]).glob("attempt0.rank*.json"))) < world and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5 * (world - 1 - rank))
os._exit(2)
