"""The package's shape: no import cycles, and a raw-DDP layer that stands on its own."""

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def imports_of(path: Path) -> set[str]:
    """Every ``finetune.*`` module ``path`` imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return {name for name in found if name.startswith("finetune.")}


def test_no_module_of_the_package_imports_itself_through_others():
    modules = {f"finetune.{p.stem}": imports_of(p) for p in (REPO / "finetune").glob("*.py") if p.stem != "__init__"}
    assert len(modules) > 10

    def reaches(start: str, target: str, seen: set) -> bool:
        for name in modules.get(start, ()):
            if name == target or (name not in seen and reaches(name, target, seen | {name})):
                return True
        return False

    cycles = sorted(name for name in modules if reaches(name, name, set()))
    assert not cycles, f"import cycles through {cycles}"


def test_the_raw_ddp_layer_loads_neither_accelerate_nor_the_training_loop():
    probe = ("import sys, finetune.ddp\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'accelerate' or m in "
             "('finetune.config', 'finetune.runtime', 'finetune.loop', 'transformers')))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True)
    assert result.stdout.strip() == "[]"
