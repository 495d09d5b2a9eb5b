"""The docs say what the code does: the generated pages are current, every error and recipe key is in
them, every relative link resolves, and the front page leads with the two commands and recipes that load."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import make_docs  # noqa: E402

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code (links and headings there are not links)."""
    return re.sub(r"``.*?``|`[^`\n]*`", "", FENCE.sub("", text))


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_generated_pages_are_what_the_code_generates_today() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_docs.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_every_raise_site_is_in_the_error_catalogue() -> None:
    """Counted by a plain text search, independently of the ast walk that writes the page."""
    modules = make_docs._modules()
    names = "|".join(sorted(make_docs.error_classes(modules)))
    expected = 0
    for path in sorted((REPO / "liger_cli").rglob("*.py")):
        text = path.read_text()
        expected += len(re.findall(rf"\braise\s+({names})\(", text))
        if path.parent.name == "recipe":
            expected += len(re.findall(r"\braise\s+ValueError\(", text))
    sites = make_docs.raise_sites(modules)
    assert len(sites) == expected, f"the catalogue found {len(sites)} raise sites, the source has {expected}"
    page = (REPO / "docs" / "errors.md").read_text()
    for site in sites:
        shown = " ".join((site["message"] or site["built"]).split()).replace("|", "\\|")
        assert shown in page, f"{site['module']}:{site['line']} is missing from docs/errors.md"
    assert f"{len(sites)} messages in" in page


def test_every_recipe_key_and_section_has_a_description() -> None:
    from liger_cli.recipe import describe
    from liger_cli.recipe.schema import Recipe

    missing, seen, queue = [], set(), [(Recipe, "")]
    while queue:
        section, prefix = queue.pop()
        for key in describe.keys(section):
            if key.section is not None:
                if key.section not in seen:
                    seen.add(key.section)
                    queue.append((key.section, f"{prefix}{key.name}."))
                    if not describe.section_doc(key.section):
                        missing.append(f"{prefix}{key.name} (the section's class docstring)")
            elif not key.description:
                missing.append(prefix + key.name)
    assert not missing, f"give these a one-line docstring in liger_cli/recipe/: {missing}"
    reference = (REPO / "docs" / "recipe-reference.md").read_text()
    assert (
        "| `training.objective` | one of `sft`, `dpo`, `simpo`, `orpo`, `kto`, `reward`, `grpo`, `distill` | `sft` |"
        in reference
    )


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_linked_from_the_manual_index() -> None:
    index = (REPO / "docs" / "README.md").read_text()
    for page in PAGES[1:]:
        if page.name != "README.md":
            assert f"]({page.name})" in index, f"docs/README.md does not link {page.name}"


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def test_readme_is_a_front_page_that_leads_with_the_two_commands() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    first, second = _blocks(readme, "bash")[:2]
    assert first.strip() == "bash scripts/setup.sh && .venv/bin/liger train recipes/quickstart.yaml"
    assert second.strip() == "bash scripts/setup.sh && .venv/bin/python -m pytest -q"
    headings = re.findall(r"^## (.*)$", FENCE.sub("", readme), re.M)
    assert headings[0] == "Two commands", f"README.md must lead with the two commands, not {headings[0]!r}"
    ci = (REPO / ".ci" / "run").read_text()
    assert second.strip() in ci, ".ci/run must run exactly the README's test command"


def test_readme_has_a_recipe_per_objective_and_each_validates() -> None:
    from liger_cli.recipe.schema import Recipe

    recipes = [yaml.safe_load(block) for block in _blocks((REPO / "README.md").read_text(), "yaml")]
    objectives = set()
    for data in recipes:
        assert data, "an empty yaml block in README.md"
        # adapter.init must name an adapter folder that exists: the example's is the user's own SFT run
        data = {**data, "adapter": {k: v for k, v in data.get("adapter", {}).items() if k != "init"}}
        recipe = Recipe.model_validate(data, context={"base_dir": REPO})
        objectives.add("qlora" if recipe.model.quantize != "none" else recipe.training.objective)
    assert objectives == {"sft", "dpo", "grpo", "qlora"}


def test_the_recipe_overview_in_docs_uses_only_keys_the_schema_has() -> None:
    from liger_cli.recipe.schema import Recipe

    blocks = _blocks((REPO / "docs" / "recipes.md").read_text(), "yaml")
    assert blocks
    for block in blocks:
        Recipe.model_validate(yaml.safe_load(block), context={"base_dir": REPO / "recipes"})
