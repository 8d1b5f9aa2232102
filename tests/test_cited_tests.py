"""Every test file that the package, the docs, the benchmarks or the README cite as the proof
of a claim exists (evaluation/lm.py once cited a tests/evaluation/test_parity.py that never
did)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r"tests/[A-Za-z0-9_/]+\.py")
# Not a citation: development.md's example of narrowing a test run.
PLACEHOLDERS = {"tests/x.py"}


def citing_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder, pattern in (("jaxtrain", "*.py"), ("docs", "*.md"), ("bench", "*")):
        files += [p for p in (ROOT / folder).rglob(pattern) if p.is_file()]
    return files


def test_every_cited_test_file_exists():
    missing, cited = [], 0
    for path in citing_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # a binary benchmark artefact cites nothing
            continue
        for name in set(CITED.findall(text)) - PLACEHOLDERS:
            cited += 1
            if not (ROOT / name).is_file():
                missing.append(f"{path.relative_to(ROOT)} cites {name}")
    assert cited > 20  # the scan sees the citations
    assert not missing, missing
