"""hf_zero's import graph against the layering ARCHITECTURE.md states.

Every import statement of every module under ``hf_zero/`` is read with ``ast`` — the ones inside
functions too: an import deferred to call time is still a dependency, and deferring it is how a
cycle hides. The layers come from ARCHITECTURE.md's table, so the document and the code cannot
drift apart: a module may import its own layer and the layers below, never above; the graph has
no cycle; and the boundaries the design leans on are asserted by name as well, so that an edit
of the table alone cannot make them pass.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_zero"


def _modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of the package (a package is its ``__init__``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(importer: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The hf_zero modules one import statement loads (``from pkg import mod`` names the module itself)."""
    targets: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("hf_zero"):
                targets.add(name)
        return targets
    base = node.module or ""
    if node.level:  # relative: from the importer's package
        pkg = importer if MODULES[importer].name == "__init__.py" else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        base = f"{pkg}.{base}" if base else pkg
    if not base.startswith("hf_zero"):
        return targets
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        targets.add(sub if sub in MODULES else base)
    return targets


def import_graph() -> dict[str, set[str]]:
    """Module -> the hf_zero modules it imports anywhere in its body."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= _resolve(name, node)
        deps.discard(name)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of modules, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def _layers() -> list[list[str]]:
    """ARCHITECTURE.md's layer table, lowest first: each row's modules and packages (``zero/`` = the package)."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("<!-- layers -->")[1].split("<!-- /layers -->")[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            rows.append((int(cells[0]), re.findall(r"`([^`]+)`", cells[1])))
    rows.sort()
    assert [n for n, _ in rows] == list(range(len(rows))), "ARCHITECTURE.md's layers are numbered 0, 1, 2, ..."
    return [names for _, names in rows]


def _layer_of(layers: list[list[str]]) -> dict[str, int]:
    """Every module's layer: a listed module, or the deepest listed package holding it."""
    entries: dict[str, int] = {}
    for i, names in enumerate(layers):
        for n in names:
            dotted = "hf_zero" if n == "hf_zero" else "hf_zero." + n.rstrip("/").removesuffix(".py").replace("/", ".")
            assert dotted not in entries, f"ARCHITECTURE.md lists {n} twice"
            entries[dotted] = i
    out = {}
    for m in MODULES:
        name = m
        while name and name not in entries:
            name = name.rpartition(".")[0]
        assert name, f"{m} is in no layer of ARCHITECTURE.md; add it to the table"
        out[m] = entries[name]
    return out


def test_the_import_graph_is_read_whole() -> None:
    """The reader sees what it must: a function-level import, a relative one, a module named through its package."""
    graph = import_graph()
    assert "hf_zero.zero.stage3" in graph["hf_zero.training.compile"]
    assert "hf_zero.checkpoint.save" in graph["hf_zero.engine.persistence"]  # imported inside Persistence.save
    assert "hf_zero.distributed.dist" in graph["hf_zero.engine.persistence"]  # `from hf_zero.distributed import dist as hz_dist`
    assert len(graph) == len(MODULES) > 40


def test_no_import_cycles() -> None:
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_import_goes_down_the_layers_of_architecture_md() -> None:
    layer = _layer_of(_layers())
    upward = [
        f"{m} (layer {layer[m]}) imports {d} (layer {layer[d]})"
        for m, deps in import_graph().items() for d in sorted(deps) if layer[d] > layer[m]
    ]
    assert not upward, "imports against ARCHITECTURE.md's layers:\n" + "\n".join(upward)


def test_the_boundaries_the_design_relies_on() -> None:
    """zero/ is below everything that runs it; checkpoints know no pipeline; the errors module knows nothing."""
    graph = import_graph()

    def reaches(packages: tuple[str, ...], deps: set[str]) -> list[str]:
        return sorted(d for d in deps if d == "hf_zero" or any(d == p or d.startswith(p + ".") for p in packages))

    above_zero = ("hf_zero.engine", "hf_zero.pipe", "hf_zero.checkpoint", "hf_zero.integrations", "hf_zero.hub",
                  "hf_zero.launch.cli", "hf_zero.api", "hf_zero.training.step")
    for m, deps in graph.items():
        if m.startswith("hf_zero.zero"):
            assert not reaches(above_zero, deps), f"{m} imports {reaches(above_zero, deps)}"
        if m.startswith(("hf_zero.checkpoint", "hf_zero.hub.model_cards")):
            assert not reaches(("hf_zero.pipe", "hf_zero.engine", "hf_zero.integrations"), deps), m
    assert graph["hf_zero.errors"] == set()


# What the engine hands below itself is a TrainState (hf_zero/checkpoint/state.py), never itself: the import
# graph cannot see an engine passed as an argument (nothing imports engine.py by name to receive one), so the
# functions are read as well. Besides the modules of the layers under the engine's, pipe/consolidated.py (above
# it, but a consumer of the state like checkpoint/) is held to the same rule.
TAKES_A_TRAIN_STATE = ("hf_zero.pipe.consolidated",)
# Methods only an engine answers: calling one means an engine was reached some other way.
ENGINE_ONLY_CALLS = ("checkpoint_layout", "train_state", "zero_optimization_stage", "gradient_accumulation_steps",
                     "train_micro_batch_size_per_gpu")


def engine_handles(tree: ast.AST) -> list[str]:
    """Where a module takes or reaches an engine: a parameter named ``engine`` or annotated with a class named
    ``...Engine``, an ``.engine`` attribute or ``getattr(x, "engine")``, a call of a method only an engine has."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []),
                        *([a.kwarg] if a.kwarg else [])]:
                note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if arg.arg == "engine" or re.search(r"Engine\b", note):
                    found.append(f"line {arg.lineno}: parameter {arg.arg}{': ' + note if note else ''}")
        elif isinstance(node, ast.Attribute) and node.attr == "engine":
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in ENGINE_ONLY_CALLS:
                found.append(f"line {node.lineno}: {ast.unparse(f)}()")
            if (isinstance(f, ast.Name) and f.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value == "engine"):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_below_the_engine_takes_the_engine() -> None:
    """checkpoint/, model_cards/ and every other module under the engine's layer take a TrainState, never the engine."""
    layer = _layer_of(_layers())
    below = [m for m in MODULES if layer[m] < layer["hf_zero.engine"]] + list(TAKES_A_TRAIN_STATE)
    assert {"hf_zero.checkpoint.save", "hf_zero.checkpoint.load", "hf_zero.hub.model_cards.record"} <= set(below)
    seen = {m: engine_handles(ast.parse(MODULES[m].read_text(), str(MODULES[m]))) for m in below}
    offending = [f"{m} {where}" for m, found in seen.items() for where in found]
    assert not offending, "the engine travels below itself (hand a TrainState instead):\n" + "\n".join(offending)


def test_the_checker_sees_an_engine_handed_down() -> None:
    """The check above finds each way in (so that it cannot pass by reading nothing)."""
    cases = {
        "def save(engine, d): pass": 1,
        "def save(e: 'ZeroEngine', d): pass": 1,
        "def card(trainer):\n    return trainer.engine.config": 1,
        "def card(trainer):\n    return getattr(trainer, 'engine', None)": 1,
        "def save(state, x):\n    return x.checkpoint_layout()": 1,
        "def save(state: TrainState, engines: int, engine_count: int):\n    return state.layout": 0,
    }
    for source, n in cases.items():
        assert len(engine_handles(ast.parse(source))) == n, source


def test_the_train_state_is_what_they_take() -> None:
    """The entry points of save, load, consolidation and the record name the state's type in their signature."""
    entry = {
        "hf_zero.checkpoint.save": ("save", "plan_share"), "hf_zero.checkpoint.load": ("load",),
        "hf_zero.checkpoint.consolidated": ("save_pretrained", "save_single_file", "OneUnitAtATime.__init__"),
        "hf_zero.checkpoint.adapters": ("save_adapters", "save_merged", "gather_full_state_dict"),
        "hf_zero.checkpoint.deepspeed": ("load", "resume_trainer"),
        "hf_zero.hub.model_cards.record": ("engine_record", "write_engine_record", "engine_values"),
        "hf_zero.pipe.consolidated": ("save_pretrained",),
    }
    for m, names in entry.items():
        tree = ast.parse(MODULES[m].read_text())
        defs = {f"{c.name}.{f.name}": f for c in tree.body if isinstance(c, ast.ClassDef) for f in c.body
                if isinstance(f, ast.FunctionDef)}
        defs |= {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
        for name in names:
            args = [a for a in defs[name].args.args if a.arg != "self"]
            assert args and args[0].annotation is not None and ast.unparse(args[0].annotation) == "TrainState", (m, name)


def test_errors_keep_their_old_import_paths() -> None:
    """The classes moved to hf_zero.errors; the paths users wrote still name the same classes."""
    import hf_zero
    import hf_zero.errors as E
    from hf_zero.checkpoint import CheckpointError
    from hf_zero.config import ConfigError
    from hf_zero.distributed.dist import PeerFailureError
    from hf_zero.engine import UsageError
    from hf_zero.hub.transfer import HubError
    from hf_zero.launch.cli import LaunchError
    from hf_zero.optim.optimizers import OptimizerConfigError
    from hf_zero.pipe import PipelineError
    from hf_zero.precision.policies import LossScaleFloorError, NonFiniteLossError

    assert (CheckpointError, LaunchError, ConfigError, PeerFailureError, UsageError, HubError, OptimizerConfigError,
            PipelineError, LossScaleFloorError, NonFiniteLossError) == (
        E.CheckpointError, E.LaunchError, E.ConfigError, E.PeerFailureError, E.UsageError, E.HubError,
        E.OptimizerConfigError, E.PipelineError, E.LossScaleFloorError, E.NonFiniteLossError)
    assert hf_zero.UsageError is E.UsageError and hf_zero.ConfigError is E.ConfigError
    assert sorted(E.__all__) == sorted(n for n in dir(E) if n.endswith("Error"))
