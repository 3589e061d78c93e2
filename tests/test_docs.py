"""docs/: the configuration reference matches the option declarations, and the links resolve."""

import re
import subprocess
import sys
from pathlib import Path

from launch import ROOT


def test_config_reference_is_generated_from_the_declarations():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate_config_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_config_reference_lists_every_option():
    from torchtitan.config.options import JobConfig

    text = (ROOT / "docs" / "config_reference.md").read_text()
    for section, options in JobConfig().to_dict().items():
        assert f"## [{section}]" in text
        for option in options:
            assert f"| `{option}` |" in text, f"{section}.{option}"
    assert "| `profile_freq` | int | `10` |" in text


def test_relative_links_in_the_docs_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert {p.name for p in pages} >= {
        "config_reference.md",
        "composability.md",
        "checkpointing.md",
        "datasets.md",
        "debugging.md",
        "performance.md",
    }
    for page in pages:
        for target in re.findall(r"\]\(([^)#:]+)\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def heading_anchors(page: Path) -> set[str]:
    """The #anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_every_link_and_anchor_in_the_docs_resolves():
    """Every relative link of README.md and docs/, #anchors included (the test above skips links with
    one): its file is there and, for a Markdown page, so is the heading the anchor names."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in re.findall(r"\]\((?![a-z]+:)([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            path = (page.parent / target) if target else page
            if not path.exists():
                broken.append(f"{page.name} links to missing {target}")
            elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path):
                broken.append(f"{page.name} links to {target}#{anchor}, a heading {path.name} lacks")
    assert not broken, "\n".join(broken)


def test_the_readme_links_each_objective_to_the_page_that_explains_it():
    """The README's sentence on DeepSeek-V3's objectives sends each to its own page's section: the
    sequence-wise balance loss is docs/moe.md's (docs/objectives.md has multi-token prediction)."""
    readme = (ROOT / "README.md").read_text()
    for option, page, heading in (
        ("moe.sequence_aux_loss_weight", "docs/moe.md", "sequence-wise-balance-loss"),
        ("model.mtp_layers", "docs/objectives.md", ""),
    ):
        after = readme[readme.index(f"(`{option}`") :]
        target = re.search(r"\]\(([^)]+)\)", after).group(1)
        assert target == page + (f"#{heading}" if heading else ""), (option, target)
        assert not heading or heading in heading_anchors(ROOT / page)
