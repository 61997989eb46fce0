"""docs/ holds the specification and the design the code cites, and every citation resolves.

Every ``ALGORITHM.md §N[.M]`` (single sections and ranges such as ``§2.1-2.6``), every ``§6 case N`` and every
``DESIGN.md example N`` in the repository's code, configs and docs must name a heading, a numbered case or a
numbered example that exists in ``docs/``. Where the steering copy of the specification sits beside the checkout
(``../shared/spec``), ``docs/`` must equal it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SCANNED = ("alignopsd", "kernels", "engine", "csrc", "bench", "tests", "configs", "tools", "docs", "README.md")
SECTION_REF = re.compile(r"ALGORITHM\.md\s*§\s*(\d+(?:\.\d+)?)(?:\s*[-–]\s*(\d+(?:\.\d+)?))?")
CASE_REF = re.compile(r"§\s*6,?\s+cases?\s+(\d+)(?:\s*(?:-|–|and)\s*(\d+))?")
EXAMPLE_REF = re.compile(r"DESIGN\.md,?\s+example\s+(\d+)")


def _files():
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            yield path
            continue
        for f in sorted(path.rglob("*")):
            if f.suffix in {".py", ".md", ".yaml", ".sh", ".cpp"} and f.is_file():
                yield f


def _citations(pattern: re.Pattern) -> list[tuple[str, str]]:
    found = []
    for f in _files():
        text = f.read_text(encoding="utf-8", errors="replace")
        for m in pattern.finditer(text):
            for group in m.groups():
                if group:
                    found.append((str(f.relative_to(ROOT)), group))
    return found


def _spec_sections() -> set[str]:
    text = (DOCS / "ALGORITHM.md").read_text(encoding="utf-8")
    return {m.group(1).rstrip(".") for m in re.finditer(r"^#{2,3}\s+(\d+(?:\.\d+)?\.?)\s", text, re.M)}


def _spec_cases() -> set[str]:
    text = (DOCS / "ALGORITHM.md").read_text(encoding="utf-8")
    section6 = text.split("## 6.", 1)[1].split("\n## 7.", 1)[0]
    return {m.group(1) for m in re.finditer(r"^(\d+)\.\s", section6, re.M)}


def _design_examples() -> set[str]:
    text = (DOCS / "DESIGN.md").read_text(encoding="utf-8")
    examples = text.split("## Examples to follow", 1)[1].split("\n## ", 1)[0]
    return {m.group(1) for m in re.finditer(r"^(\d+)\.\s", examples, re.M)}


def test_every_spec_section_cited_exists():
    cited = _citations(SECTION_REF)
    assert len(cited) > 50, "the scan found almost no citations: the pattern no longer matches the code's style"
    sections = _spec_sections()
    missing = [(f, s) for f, s in cited if s not in sections]
    assert not missing, f"citations of sections docs/ALGORITHM.md does not have: {missing[:10]}"


def test_every_spec_case_cited_exists():
    cited = _citations(CASE_REF)
    assert cited
    cases = _spec_cases()
    assert {"1", "17", "48"} <= cases
    missing = [(f, c) for f, c in cited if c not in cases]
    assert not missing, f"citations of §6 cases docs/ALGORITHM.md does not have: {missing[:10]}"


def test_every_design_example_cited_exists():
    cited = _citations(EXAMPLE_REF)
    assert cited
    examples = _design_examples()
    missing = [(f, e) for f, e in cited if e not in examples]
    assert not missing, f"citations of DESIGN.md examples docs/DESIGN.md does not have: {missing[:10]}"


@pytest.mark.parametrize(
    "name, steering", [("ALGORITHM.md", "shared/spec/ALGORITHM.md"), ("API.md", "shared/spec/API.md")]
)
def test_docs_in_step_with_the_steering_spec(name, steering):
    source = ROOT.parent / steering
    if not source.is_file():
        pytest.skip(f"no steering copy beside the checkout ({steering})")
    assert (DOCS / name).read_text(encoding="utf-8") == source.read_text(encoding="utf-8"), (
        f"docs/{name} differs from the steering copy: copy it over"
    )
