"""Sum py-spy's raw collapsed stacks (`bench/control_plane.py --profile`) by function: the share
of samples in which each function is on the stack (inclusive) and on top (self).

    .venv/bin/python bench/profile_summary.py .cache/profile/trainop-500.txt [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

_LINE = re.compile(r" \(([^()]*):\d+\)$")  # "func (file.py:123)" -> "func (file.py)"


def summarise(path: Path) -> tuple[int, collections.Counter, collections.Counter]:
    total, inclusive, own = 0, collections.Counter(), collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = [_LINE.sub(r" (\1)", f) for f in stack.split(";")]
        total += n
        for frame in set(frames):
            inclusive[frame] += n
        own[frames[-1]] += n
    return total, inclusive, own


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", type=Path)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--match", default="", help="only frames containing this text (e.g. trainop/)")
    args = p.parse_args()
    total, inclusive, own = summarise(args.profile)
    print(f"{total} samples")
    for title, counter in (("inclusive", inclusive), ("self", own)):
        print(f"\n{title}:")
        rows = [(f, c) for f, c in counter.most_common() if args.match in f][:args.top]
        for frame, c in rows:
            print(f"{100 * c / total:6.1f}%  {frame}")


if __name__ == "__main__":
    main()
