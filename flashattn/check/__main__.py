"""``python -m flashattn.check --list <checker or exercise>``: the mistakes a checker tries, in order.

    python -m flashattn.check --list               # the checkers
    python -m flashattn.check --list dq_kernel     # check.dq_kernel's order, stage by stage
    python -m flashattn.check --list 02            # exercise 02's two checkers, one after the other
"""
from __future__ import annotations

import argparse
import sys

from . import MISTAKES
from .checkers import EVERY, by_name


def listing(name: str) -> str:
    """The order of each checker ``name`` stands for, numbered and grouped by stage, with titles."""
    return "\n\n".join(_listing(checker) for checker in by_name(name))


def _listing(checker) -> str:
    lines = [f"check.{checker.name} (exercise {checker.exercise}: {checker.what}): {len(checker.order)} mistakes, "
             f"tried in this order -- the first whose test fits is the diagnosis"]
    stage = None
    for n, mid in enumerate(checker.order, 1):
        m = MISTAKES[mid]
        if m.stage != stage:
            stage = m.stage
            lines += ["", stage]
        lines.append(f"  {n:3d}  {mid:34s} {m.title}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashattn.check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", nargs="?", const="", metavar="CHECKER", required=True,
                    help="the mistakes a checker (dq_kernel) or an exercise's checkers (03) try, in order; "
                         "no name: the checkers")
    args = ap.parse_args(argv)
    if not args.list:
        for c in EVERY:
            print(f"{c.name:20s} exercise {c.exercise}: {c.what} ({len(c.order)} mistakes)")
        return 0
    try:
        print(listing(args.list))
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
