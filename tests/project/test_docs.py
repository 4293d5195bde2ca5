"""The docs a newcomer reads: the README starts with the two commands and stays short, and every
relative link in the README, the CHANGELOG and docs/ reaches a file (and heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

from router.core.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings (outside code blocks)."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    out: set[str] = set()
    for line in text.splitlines():
        if m := re.match(r"^#{1,6}\s+(.*)", line):
            slug = m.group(1).strip().lower().replace(" ", "-")
            out.add("".join(c for c in slug if c.isalnum() or c in "-_"))
    return out


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans: patterns, not links
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", text)]


def test_the_readme_starts_with_the_two_commands_and_stays_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300
    first_block = next(i for i, line in enumerate(lines) if line.startswith("```"))
    assert lines[first_block] == "```sh"
    commands = [line.split("#")[0].strip() for line in lines[first_block + 1 : first_block + 3]]
    assert commands == ["make demo", "make test"]


def test_every_relative_link_resolves() -> None:
    broken: list[str] = []
    for page in PAGES:
        for link in _links(page):
            if re.match(r"^[a-z]+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.name}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{page.name}: {link} (no such heading)")
    assert broken == []


def test_the_link_check_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Top\n[a](missing.md) [b](#top) [c](#nowhere) `[d](x)`\n")
    assert _links(page) == ["missing.md", "#top", "#nowhere"]
    assert "top" in _anchors(page) and "nowhere" not in _anchors(page)


def test_the_annotated_config_example_loads(tmp_path: Path) -> None:
    """docs/running.md's example file is a config the router accepts, key for key."""
    text = (ROOT / "docs" / "running.md").read_text(encoding="utf-8")
    example = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)[0]
    keys = tmp_path / "keys.yaml"
    keys.write_text("[]\n")
    assert "api_keys_file: /etc/sluicegate/keys/keys.yaml" in example
    example = example.replace("/etc/sluicegate/keys/keys.yaml", str(keys))
    (tmp_path / "config.yaml").write_text(example)
    settings = load_settings(tmp_path / "config.yaml")
    assert [b.name for b in settings.backends] == ["vllm-a", "openai", "azure"]
    assert settings.admission is not None and settings.redis_prefix == "sluicegate"


def test_the_readme_quotes_no_benchmark_figure() -> None:
    """Figures live on the benchmark page, made from the results; a README that copies them
    drifts (as the Targets table once did). Latencies, ratios and rates outside code blocks
    are refused here."""
    text = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S)
    figures = re.findall(r"\b\d+(?:\.\d+)?\s?(?:ms|us|µs|x|%|req/s|tokens/s)(?![\w/])", text)
    assert figures == [], f"README quotes figures (move them to bench/reading.md): {figures}"
