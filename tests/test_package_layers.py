"""The packages' layering: ``training/`` and ``checkpoint/`` never import each other (the entry
point's ``megatron_dilocox/job.py`` wires them), read from every import statement of their modules."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_dilocox"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("package, other", [("training", "checkpoint"), ("checkpoint", "training")])
def test_training_and_checkpoint_do_not_import_each_other(package, other):
    modules = sorted((PACKAGE / package).rglob("*.py"))
    assert modules
    offenders = {m.name: sorted(n for n in imported_modules(m) if n.startswith(f"megatron_dilocox.{other}"))
                 for m in modules}
    assert not {m: names for m, names in offenders.items() if names}


def test_the_job_module_wires_both():
    """The check above reads imports the way job.py writes them: it finds both packages there."""
    names = imported_modules(PACKAGE / "job.py")
    assert any(n.startswith("megatron_dilocox.checkpoint") for n in names)
    assert any(n.startswith("megatron_dilocox.training") for n in names)
