"""The README opens with the two commands a new user runs, and CI runs the second one verbatim."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    fence = readme.index("```sh")
    demo, test = readme[fence + 1], readme[fence + 2]
    assert fence < 5 and demo.endswith("mtp-gateway demo") and test.endswith("python3 -m pytest")
    ci = [line for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert ci[-1] == test
