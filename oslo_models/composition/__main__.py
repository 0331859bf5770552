"""``python -m oslo_models.composition [--write PATH]``: print (or write) the composition table."""
from __future__ import annotations

import argparse

from .table import counts, pairs, render


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--write", metavar="PATH", help="write the markdown page to PATH instead of printing it")
    args = parser.parse_args(argv)
    cells = pairs()
    text = render(cells)
    if args.write:
        with open(args.write, "w", encoding="utf-8") as handle:
            handle.write(text)
        print(f"wrote {args.write}: {counts([c for c in cells if len(c.axes) == 2])}")
    else:
        print(text)


if __name__ == "__main__":
    main()
