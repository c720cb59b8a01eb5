"""The package's shape: no import cycles, and a raw-DDP layer that stands on its own."""

import ast
import subprocess
import sys
from pathlib import Path

from helpers import REPO


def package_modules(root: Path = REPO) -> dict[str, Path]:
    """Every module of ``root/finetune`` by its dotted name; a package's ``__init__.py`` is the package."""
    modules = {}
    for path in (root / "finetune").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(name: str, modules: dict[str, Path]) -> set[str]:
    """Every module of the package that module ``name`` imports, in any form (``import finetune.x``, ``from
    finetune import x``, ``from finetune.x import y``, relative imports), at the top or inside functions."""
    path = modules[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
            found |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
    return {module for module in found if module in modules and module != name}


def test_the_import_graph_reads_every_form_of_import(tmp_path):
    for name in ("__init__", "a", "b", "c", "sub/__init__", "sub/d", "sub/e"):
        (tmp_path / "finetune" / f"{name}.py").parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "finetune" / f"{name}.py").write_text("")
    (tmp_path / "finetune" / "sub" / "d.py").write_text(
        "import finetune.a\nfrom finetune import b\nfrom ..c import thing\nfrom . import e\n"
        "def later():\n    from finetune.sub.e import x\n")
    assert imports_of("finetune.sub.d", package_modules(tmp_path)) == {
        "finetune", "finetune.a", "finetune.b", "finetune.c", "finetune.sub", "finetune.sub.e"}


LAYERS = {
    "finetune.chat": 8, "finetune.cli": 7, "finetune.recipe": 7, "finetune.export": 7, "finetune.predict": 7,
    "finetune.loop": 6, "finetune.startup": 5, "finetune.evaluation": 5,
    "finetune.runtimes": 4,
    "finetune.tasks": 4, "finetune.models": 3, "finetune.hub": 3, "finetune.observability": 3,
    "finetune.distributed": 2, "finetune.data": 2, "finetune.checkpointing": 1, "finetune": 0,
}
"""Each room's floor: a module imports rooms on lower floors, and modules of its own room (the core, at floor 0:
errors, environment, config, task). ``recipe`` loads the loop once a recipe's flags are good; ``cli`` is the
``finetune`` command; ``export``, ``predict`` and ``chat`` (over ``predict``'s replies) use a trained folder."""


def room(module: str) -> str:
    return next(name for name in LAYERS if module == name or module.startswith(name + "."))


def test_every_module_is_in_a_room_and_imports_only_rooms_below_its_own():
    modules = package_modules()
    assert {room(name) for name in modules} == set(LAYERS), "every room holds modules, every module is in a room"
    upward = sorted(f"{name} -> {imported}" for name in modules for imported in imports_of(name, modules)
                    if room(imported) != room(name) and LAYERS[room(imported)] >= LAYERS[room(name)])
    assert not upward, upward


def test_no_module_of_the_package_imports_itself_through_others():
    modules = package_modules()
    graph = {name: imports_of(name, modules) for name in modules}
    assert len(graph) > 10

    def reaches(start: str, target: str, seen: set) -> bool:
        for name in graph.get(start, ()):
            if name == target or (name not in seen and reaches(name, target, seen | {name})):
                return True
        return False

    cycles = sorted(name for name in graph if reaches(name, name, set()))
    assert not cycles, f"import cycles through {cycles}"


def test_the_raw_ddp_layer_loads_neither_accelerate_nor_the_training_loop():
    probe = ("import sys, finetune.distributed.ddp, finetune.distributed.fsdp\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'accelerate' or "
             "m.startswith('finetune.runtimes') or m in ('finetune.config', 'finetune.loop', 'transformers')))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True)
    assert result.stdout.strip() == "[]"
