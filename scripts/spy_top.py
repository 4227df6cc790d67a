"""Summarizes scripts/gpu_spy.sh's py-spy windows: for each window of a process (``e``: engine, ``w``: worker)
whose samples hit ``--match`` at least ``--min-hits`` times, the top frames of each thread, counted inclusively
(a frame counts every sample whose stack holds it; idle waits are samples too).

    python3 scripts/spy_top.py DIR [--process w] [--match Grammar] [--min-hits 300] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re

FRAME = re.compile(r"(.*?) \((.*?)(?::(\d+))?\)$")


def windows(folder: pathlib.Path, process: str) -> list[pathlib.Path]:
    return sorted(folder.glob(f"{process}*.raw"), key=lambda p: int(p.stem[1:]))


def read(path: pathlib.Path) -> dict[str, list[tuple[list[str], int]]]:
    """{thread: [(frames outermost first, samples)]} from a py-spy raw (collapsed stacks) file."""
    threads: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():  # (a sample py-spy could not read a stack for)
            continue
        frames = stack.split(";")
        thread = re.sub(r"^thread \(\d+\): ", "", frames[0])
        threads[thread].append((frames[1:], int(count)))
    return threads


def inclusive(stacks: list[tuple[list[str], int]]) -> tuple[int, collections.Counter]:
    counts: collections.Counter = collections.Counter()
    total = 0
    for frames, n in stacks:
        total += n
        seen = set()
        for frame in frames:
            m = FRAME.match(frame)
            name = f"{m.group(1)} {m.group(2).split('/')[-1]}:{m.group(3)}" if m else frame
            if name not in seen:
                seen.add(name)
                counts[name] += n
    return total, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--process", default="w", choices=("e", "w"))
    parser.add_argument("--match", default="", help="only windows whose samples name this (a function, a file)")
    parser.add_argument("--min-hits", type=int, default=1)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    for path in windows(pathlib.Path(args.folder), args.process):
        threads = read(path)
        hits = sum(n for stacks in threads.values() for frames, n in stacks if any(args.match in f for f in frames))
        if hits < args.min_hits:
            continue
        print(f"== {path.name}: {hits} samples naming {args.match!r}")
        for thread, stacks in threads.items():
            total, counts = inclusive(stacks)
            print(f"  -- {thread}: {total} samples")
            for name, n in counts.most_common(args.top):
                if not any(s in name for s in ("<frozen", "runpy", "threading.py")):
                    print(f"  {n:6d} {name}")


if __name__ == "__main__":
    main()
