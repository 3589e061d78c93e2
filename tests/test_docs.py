"""docs/: the configuration reference matches the option declarations, and the links resolve."""

import re
import subprocess
import sys

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
