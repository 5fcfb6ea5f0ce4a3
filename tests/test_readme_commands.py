"""The README opens with the two commands a new user runs, and CI runs the second one verbatim.
The README links the contributor's guide, the architecture and the results, and every relative
link in the README, CONTRIBUTING.md and docs/ points at a file in the repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINKED_FROM_README = ("CONTRIBUTING.md", "docs/architecture.md", "docs/results.md")
# [text](target) and ![alt](target); fenced code blocks are left out (their brackets are code).
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    fence = readme.index("```sh")
    demo, test = readme[fence + 1], readme[fence + 2]
    assert fence < 5 and demo.endswith("mtp-gateway demo") and test.endswith("python3 -m pytest")
    ci = [line for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert ci[-1] == test


def relative_links(doc: Path) -> list[str]:
    text = FENCE.sub("", doc.read_text(encoding="utf-8"))
    return [target for target in LINK.findall(text)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")]


@pytest.mark.parametrize("doc", LINKED_FROM_README)
def test_the_readme_links_the_docs_that_exist(doc):
    assert (ROOT / doc).is_file(), doc
    assert doc in relative_links(ROOT / "README.md"), f"README.md does not link {doc}"


def docs_with_links() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", docs_with_links(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file_that_exists(doc):
    missing = [target for target in relative_links(doc)
               if not (doc.parent / target.split("#")[0]).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to what is not there: {missing}"
