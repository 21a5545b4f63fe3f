"""How much of each chapter's code the learner writes: per chapter, the lines its
`%%writefile` cells write and the lines inside its exercise regions (neither blank nor comments), and the share; and the longest
cell a learner reads.

    python tools/exercise_share.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools import workbook as wb  # noqa: E402


def code_lines(text: str) -> int:
    """Lines that are neither blank nor a comment (docstrings count: the learner reads them)."""
    return sum(1 for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))


def main() -> int:
    root = wb.ROOT
    total_lines = total_written = 0
    print(f"{'chapter':<34} {'exercises':>9} {'lines':>6} {'learner':>8} {'share':>6}  longest cell")
    for nn, path in sorted(wb.solution_notebooks(root)[0].items()):
        chap = wb.parse_chapter(nn, path.name, wb.read_json(path))
        lines = sum(map(code_lines, chap.modules.values()))
        written = sum(map(code_lines, chap.bodies.values()))
        longest = max(((len(t.splitlines()), rel) for rel, t in chap.modules.items()),
                      default=(0, "-"))
        total_lines += lines
        total_written += written
        share = f"{100 * written / lines:.0f}%" if lines else "-"
        print(f"{path.stem:<34} {len(chap.bodies):>9} {lines:>6} {written:>8} {share:>6}  "
              f"{longest[0]} ({longest[1]})")
    print(f"{'all':<34} {'':>9} {total_lines:>6} {total_written:>8} "
          f"{100 * total_written / max(total_lines, 1):>5.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
