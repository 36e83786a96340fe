"""A torchrun worker for the launcher test: attempt 0 stops on a config error (exit 2), a later
attempt dies by SIGKILL, leaving no line of its own."""

import os
import signal

from titanlite.torchrun import start_attempt, write_error

start_attempt()
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    write_error("titanlite: config error: attempt 0 says so", 2)
    os._exit(2)
os.kill(os.getpid(), signal.SIGKILL)
