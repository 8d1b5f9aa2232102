"""How the two example tasks' data were made (kept so the data can be read and rebuilt):
lines of jaxtrain's own source code, which the demo (trained on the standard library) has
never seen, each cut into a prefix and the rest of the line.

- python_em (generate_until, exact match): the prefix; the answer is the rest of the line.
- python_mc (multiple choice): the prefix; the choices are the rest of the line and the
  rests of three other lines.

    python -m jaxtrain.evaluation.examples.build_examples   # rewrites the .jsonl files

Rebuilding from a changed source tree changes the tasks: bump their metadata.version.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = ("data/loader.py", "data/packing.py", "training/step.py", "models/llama.py")
DOCS = 40


def candidate_lines(root: Path) -> list[str]:
    """Code lines (no comments, strings or docstring prose) of 30 to 80 characters."""
    out = []
    for name in SOURCES:
        for line in (root / name).read_text().splitlines():
            code = line.strip()
            if not 30 <= len(code) <= 80 or code.startswith(("#", '"', "'")) or '"' in code:
                continue
            if not re.search(r"[()=\[\]:,]", code):  # prose of a docstring
                continue
            out.append(line.rstrip())
    return out


def cut(line: str) -> tuple[str, str] | None:
    """(prefix, rest): cut before a space (the rest starts with it, as a word's tokens do)
    or after an opening parenthesis."""
    indent = len(line) - len(line.lstrip())
    body = line[indent:]
    points = [m.start() if m.group() == " " else m.end() for m in re.finditer(r"[ (]", body)]
    points = [p for p in points if 0.4 <= p / len(body) <= 0.7]
    if not points:
        return None
    at = indent + points[len(points) // 2]
    return line[:at], line[at:]


def main() -> None:
    root = HERE.parents[1]
    rng = random.Random(0)
    lines = candidate_lines(root)
    rng.shuffle(lines)
    pairs = [p for p in map(cut, lines) if p is not None and len(p[1]) <= 24][:DOCS]
    rests = [rest for _, rest in pairs]
    with open(HERE / "python_em.jsonl", "w") as em, open(HERE / "python_mc.jsonl", "w") as mc:
        for i, (prefix, rest) in enumerate(pairs):
            em.write(json.dumps({"prefix": prefix, "rest": rest}) + "\n")
            others = rng.sample([r for j, r in enumerate(rests) if j != i and r != rest], 3)
            gold = rng.randrange(4)
            choices = others[:gold] + [rest] + others[gold:]
            mc.write(json.dumps({"prefix": prefix, "choices": choices, "gold": gold}) + "\n")


if __name__ == "__main__":
    main()
