"""The package's structure: stages meet only in storage, and the contracts import no stage.

Parses every module of ``eagle3ray/`` (module-level and function-local imports alike) and fails naming the
importing module, the line and the stage it reaches into.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "eagle3ray"

#: Stage -> the modules that implement it (the train stage has a driver and a worker module).
STAGES = {"prepare": {"prepare"}, "extract": {"extract", "online"}, "vocab": {"vocab"},
          "train": {"train", "train_worker"},
          "export": {"export"}, "check": {"draft_check"}, "validate": {"validate"}}
STAGE_OF = {m: s for s, mods in STAGES.items() for m in mods}
#: Modules that may import stages: they order them (pipeline), present them (cli) or time their own code to
#: plan them (plan: the probe runs prepare's record reader and the Ray Train worker's DraftStep).
ORCHESTRATORS = {"pipeline", "cli", "plan"}


def _imports(path: Path) -> list[tuple[str, int]]:
    """(eagle3ray module name, line) of every import of the package in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .x import y / from . import x
                if node.module:
                    out.append((node.module.split(".")[0], node.lineno))
                else:
                    out += [(a.name, node.lineno) for a in node.names]
            elif node.level == 0 and node.module and node.module.startswith("eagle3ray."):
                out.append((node.module.split(".")[1], node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name.split(".")[1], node.lineno) for a in node.names if a.name.startswith("eagle3ray.")]
    return out


def _graph() -> dict[str, list[tuple[str, int]]]:
    return {p.stem: _imports(p) for p in sorted(PKG.glob("*.py"))}


def test_the_import_parser_sees_local_and_module_imports():
    g = _graph()
    assert any(m == "storage" for m, _ in g["extract"])  # from . import blocks, storage
    assert any(m == "verifier_service" for m, _ in g["extract"])  # a function-local import
    assert any(m in STAGE_OF for m, _ in g["pipeline"])  # the orchestrator does import stages


def test_no_stage_module_imports_another_stage():
    bad = []
    for mod, imports in _graph().items():
        if mod in ORCHESTRATORS or mod not in STAGE_OF:
            continue
        for target, line in imports:
            if target in STAGE_OF and STAGE_OF[target] != STAGE_OF[mod]:
                bad.append(f"eagle3ray/{mod}.py:{line} (stage {STAGE_OF[mod]}) imports {target} "
                           f"(stage {STAGE_OF[target]}); read its output through eagle3ray.artifacts instead")
    assert not bad, "\n".join(bad)


def test_contracts_and_helpers_import_no_stage():
    bad = []
    for mod, imports in _graph().items():
        if mod in ORCHESTRATORS or mod in STAGE_OF:
            continue
        bad += [f"eagle3ray/{mod}.py:{line} imports stage module {t}" for t, line in imports if t in STAGE_OF]
    assert not bad, "\n".join(bad)
    g = _graph()
    assert {m for m, _ in g["blocks"]} <= {"storage"}, g["blocks"]  # the block contract imports no engine
    assert {m for m, _ in g["draft"]} == set(), g["draft"]


def test_long_functions_stay_readable():
    """The Ray Train loop and the extract stage each fit on a screen (about 80 lines)."""
    lengths = {}
    for mod, name in (("train_worker", "train_loop_per_worker"), ("extract", "extract")):
        tree = ast.parse((PKG / f"{mod}.py").read_text())
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
        lengths[name] = fn.end_lineno - fn.lineno + 1
    assert all(n <= 85 for n in lengths.values()), lengths


def test_benchmarks_time_the_product_step_not_a_copy():
    """A benchmark that trains the draft runs DraftStep (what the Ray Train workers run), never its own step."""
    bench = PKG.parent / "benchmarks"
    copies = [p.name for p in sorted(bench.glob("*.py"))
              if any(s in p.read_text() for s in (".backward(", "optim.AdamW(", "clip_grad_norm_("))]
    assert not copies, f"benchmarks with their own training step: {copies}; use eagle3ray.train_worker.DraftStep"
    users = {p.name for p in bench.glob("*.py") if "DraftStep" in p.read_text()}
    assert {"train.py", "train_step_cost.py", "gpu_draft_step.py"} <= users, users
