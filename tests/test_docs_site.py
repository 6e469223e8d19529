"""The manual builds in MkDocs' strict mode (a broken link, a bad anchor or a page left out of
the navigation fails), and its pages keep up with what they list: every shipped config, every
error class the CLI prints, every benchmark, every page the README links to."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from asyncrl.cli import USER_ERRORS, bench_scripts

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_site_builds_in_strict_mode(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml")]
        + ["-d", str(site)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's end-of-life banner
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for page in ("index", "install", "quickstart", "concepts", "troubleshooting", "ARCHITECTURE"):
        assert (site / f"{page}.html").is_file(), page
    assert (site / "reference" / "config.html").is_file()


def test_recipes_page_lists_every_shipped_config():
    text = (DOCS / "recipes" / "index.md").read_text(encoding="utf-8")
    missing = [p.name for p in sorted((ROOT / "configs").glob("*.yaml")) if p.name not in text]
    assert not missing, f"configs missing from docs/recipes/index.md: {missing}"


def test_troubleshooting_names_every_error_the_cli_prints():
    text = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    missing = [name for _, name in USER_ERRORS if f"`{name}`" not in text]
    assert not missing, f"errors missing from docs/troubleshooting.md: {missing}"


def test_benchmarks_page_describes_every_bench():
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    missing = [name for name in bench_scripts() if f"### {name}" not in text]
    assert not missing, f"benches missing from docs/benchmarks.md: {missing}"


def test_readme_links_resolve():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links into the manual"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"
