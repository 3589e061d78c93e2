"""docs/architecture.md's Layers table is true: every torchtitan module is in exactly one layer, and each
imports only from its own layer or a layer listed above it. scripts/ and train.py (the last layer) may
import anything from torchtitan; nothing in torchtitan imports them, and nothing imports train.py.

Read with `ast`, torch-free: every import, at the top of a module or inside a function, absolute or
relative. Importing a submodule runs its packages' `__init__.py` first, so those count as imported too."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# The table's entries that are files of this repository (the rest of its backticks are code names).
ENTRY = re.compile(r"^(torchtitan/|scripts/|train\.py$)")


def table() -> list[tuple[str, list[str]]]:
    """(layer, its file and folder entries) for each row of the Layers table, top row first."""
    text = ARCHITECTURE.read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # after the header
    assert rows, "docs/architecture.md: no Layers table"
    layers = []
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        entries = [e for e in re.findall(r"`([^`]+)`", cells[1]) if ENTRY.match(e)]
        assert entries, f"docs/architecture.md: the layer {cells[0]!r} names no file"
        layers.append((cells[0], entries))
    return layers


def python_files() -> list[str]:
    files = [*(ROOT / "torchtitan").rglob("*.py"), *(ROOT / "scripts").rglob("*.py"), ROOT / "train.py"]
    return sorted(str(f.relative_to(ROOT)) for f in files)


def layer_of_each_file() -> tuple[dict[str, int], list[str]]:
    """{file: index of its layer}, and a problem for each file in no layer or in two, and each entry
    naming nothing."""
    layers = table()
    files = python_files()
    where: dict[str, list[int]] = {f: [] for f in files}
    problems = []
    for index, (name, entries) in enumerate(layers):
        for entry in entries:
            covered = [f for f in files if f == entry or (entry.endswith("/") and f.startswith(entry))]
            if not covered:
                problems.append(f"the layer {name!r} lists {entry}, which is no Python file or folder of one")
            for f in covered:
                where[f].append(index)
    for f, found in where.items():
        if not found:
            problems.append(f"{f} is in no layer of docs/architecture.md's Layers table")
        elif len(found) > 1:
            problems.append(f"{f} is in several layers: {', '.join(repr(layers[i][0]) for i in found)}")
    return {f: found[0] for f, found in where.items() if found}, problems


def module_name(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: str, modules: dict[str, str]) -> list[tuple[int, str, str]]:
    """(line, the import as written, the imported module's file) for each import of a module in
    `modules` ({name: file}), with the packages whose `__init__.py` the import runs."""
    name = module_name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    source = (ROOT / path).read_text()
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            # `from package import submodule` imports the submodule; `from module import name`, the module.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        written = " ".join((ast.get_source_segment(source, node) or "").split())
        for target in dict.fromkeys(targets):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # the packages first, then the module
                if (prefix := ".".join(parts[:i])) in modules and prefix != name:
                    found.append((node.lineno, written, modules[prefix]))
    return found


def test_every_module_is_in_one_layer_and_imports_only_from_layers_above():
    layer_of, problems = layer_of_each_file()
    names = [name for name, _ in table()]
    modules = {module_name(f): f for f in python_files()}
    for path in python_files():
        for line, written, target in imported_modules(path, modules):
            if target == "train.py" or (target.startswith("scripts/") and path.startswith("torchtitan/")):
                problems.append(f"{path}:{line}: `{written}` imports {target}, which nothing may import")
            elif path in layer_of and target in layer_of and layer_of[target] > layer_of[path]:
                problems.append(
                    f"{path}:{line}: `{written}`: the layer {names[layer_of[path]]!r} imports {target} "
                    f"from the layer {names[layer_of[target]]!r}, listed below it"
                )
    assert not problems, "docs/architecture.md's Layers table is broken:\n" + "\n".join(problems)


def test_shared_models_import_no_family():
    """The modules directly under torchtitan/models/ (the decoder, mixture of experts, multi-token
    prediction, documents, init, the shared HF names, the spec) are what every family builds on: none
    imports a family package (torchtitan/models/<family>/), so no family's code runs up into them. The
    registry (`torchtitan/models/__init__.py`) names the families and is not one of them."""
    modules = {module_name(f): f for f in python_files()}
    shared = sorted(f for f in python_files() if re.fullmatch(r"torchtitan/models/(?!__init__)\w+\.py", f))
    assert "torchtitan/models/decoder.py" in shared and "torchtitan/models/moe.py" in shared
    problems = [
        f"{path}:{line}: `{written}` imports {target}, a family's"
        for path in shared
        for line, written, target in imported_modules(path, modules)
        if re.match(r"torchtitan/models/\w+/", target)
    ]
    assert not problems, "shared model modules import a family:\n" + "\n".join(problems)


def test_the_table_puts_the_tools_and_the_loop_last():
    layers = table()
    assert {"scripts/", "train.py"} <= set(layers[-1][1]), "scripts/ and train.py are the last layer"


MAX_LINES = 500
MAX_LOOSE_MODULES = 10


def test_files_stay_short_and_torchtitan_keeps_few_loose_modules():
    """docs/architecture.md's rules of the house: a file under torchtitan/ or scripts/ that outgrows
    MAX_LINES, or a torchtitan/ with more than MAX_LOOSE_MODULES modules outside its packages, is split
    by concern into a package (as torchtitan/optimizers/ and scripts/benchmarks/ were)."""
    files = [f for folder in ("torchtitan", "scripts") for f in (ROOT / folder).rglob("*") if f.is_file()]
    long = [
        f"{f.relative_to(ROOT)}: {lines} lines"
        for f in files
        if "__pycache__" not in f.parts and (lines := len(f.read_bytes().splitlines())) > MAX_LINES
    ]
    assert not long, f"over {MAX_LINES} lines:\n" + "\n".join(long)
    loose = sorted(f.name for f in (ROOT / "torchtitan").glob("*.py") if f.name != "__init__.py")
    assert len(loose) <= MAX_LOOSE_MODULES, f"torchtitan/ has {len(loose)} loose modules: {loose}"


def test_the_objective_takes_only_types_and_constants_from_the_models_and_the_data():
    """torchtitan/objective/ owns every loss term: from the models and the data it imports what names a
    batch's or a layer's kind (a class, a constant such as IGNORE_INDEX), never a function to compute
    with, which would be a loss's arithmetic living outside it."""
    problems = []
    for path in sorted((ROOT / "torchtitan" / "objective").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if node.module.startswith(("torchtitan.models", "torchtitan.datasets")):
                for alias in node.names:
                    if not (alias.name[0].isupper() or alias.name.isupper()):
                        problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}")
    assert not problems, "the objective computes with the models' or the data's functions:\n" + "\n".join(
        problems
    )
