"""`hasten bench --contention N`: N busy neighbour processes while a workload is measured.

Users train beside other programs (a browser, a compile, another job), and a
runtime that spins its OpenMP threads or pins them to cores can lose far more
than its share when one core is taken. The neighbour is a fixed pure-CPU
burner: a Python integer loop, one process per neighbour, no memory traffic
to speak of, so what it takes is one core's time and nothing else. Both sides
of a comparison run under the same neighbours.

`Neighbours(n)` starts them (each says "ready" once it spins, so the
measurement never starts before they do) and stops them on exit, also when
the block raises or is interrupted (Ctrl-C). A burner also checks every
few milliseconds that its parent is still the process that started it and
exits when it is not, so a bench killed with SIGKILL leaves nothing behind.
"""

from __future__ import annotations

import os
import subprocess
import sys

# One core's worth of work: a fixed integer loop, re-checking the parent ~every few ms.
BURNER = """
import os, sys
parent = int(sys.argv[1])
print("ready", flush=True)
while os.getppid() == parent:
    total = 0
    for i in range(20000):
        total += i * i
"""


def parse_levels(text: str) -> list[int]:
    """"0,1" -> [0, 1]: the neighbour counts to measure at, in order. ValueError names the bad part."""
    levels = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(f"'{part}' is not a count of neighbour processes (use e.g. 0,1)")
        levels.append(int(part))
    if len(set(levels)) != len(levels):
        raise ValueError(f"a level appears twice in '{text}'")
    return levels


def label(level: int) -> str:
    """The suffix rows measured under `level` neighbours carry ("" for none)."""
    return f" +{level} busy" if level else ""


class Neighbours:
    """A context manager: `level` burner processes alive for the duration of the block."""

    def __init__(self, level: int):
        self.level = level
        self.processes: list[subprocess.Popen] = []
        self.load_before = self.load_after = 0.0

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def __enter__(self) -> Neighbours:
        self.load_before = os.getloadavg()[0]
        try:
            for _ in range(self.level):
                process = subprocess.Popen([sys.executable, "-c", BURNER, str(os.getpid())],
                                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
                self.processes.append(process)
                if process.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"neighbour process {process.pid} did not start (exit {process.poll()})")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.load_after = os.getloadavg()[0]
        self.stop()

    def stop(self) -> None:
        """Kill every burner and reap it (idempotent)."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()  # a burner holds nothing worth a graceful exit
        for process in self.processes:
            process.wait()
            if process.stdout is not None:
                process.stdout.close()
        self.processes = []
