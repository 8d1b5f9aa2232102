"""The package's shape, checked statically: no import circle, no reaching into privates.

Both checks read the source with `ast` (nothing is imported), so they see every import,
including those inside functions that a runtime check would miss.
"""

import ast
import functools
from pathlib import Path

import jaxtrain

ROOT = Path(jaxtrain.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of import nodes under `if TYPE_CHECKING:` (never executed, so not an edge)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            skipped |= {id(n) for n in ast.walk(node)}
    return skipped


def imports_of(name: str, *, type_hints: bool = False) -> set[str]:
    """The jaxtrain modules `name` imports anywhere in its source (functions included).

    `from pkg import x` is an edge to `pkg.x` when that is a module, else to `pkg` (whose
    __init__ runs). Parent packages are not implicit edges: every module would then depend
    on jaxtrain/__init__, which re-exports the whole public API. `type_hints`: the imports
    under `if TYPE_CHECKING:` count too.
    """
    path = MODULES[name]
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = set() if type_hints else _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Every module's jaxtrain imports: built when a test first asks (parsing the package
    took 2.5 s of every pytest worker's collection)."""
    return {name: imports_of(name) for name in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_scanner_sees_imports_inside_functions():
    # The cycle finder is only as good as the edges: a lazy import must count.
    assert "jaxtrain.cli.commands" in import_graph()["jaxtrain.cli"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_loop_and_the_trainer_make_no_circle_even_in_type_hints():
    """The loop and its hooks once imported the Trainer for their type hints (trainer ->
    loop -> trainer): they type against training/run_parts.py now."""
    training = {n for n in MODULES if n.startswith("jaxtrain.training")}
    hinted = {n: imports_of(n, type_hints=True) & training for n in training}
    cycle = find_cycle(hinted)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


LEAVES = ("jaxtrain.errors", "jaxtrain.pytrees")  # import nothing from jaxtrain; anyone may


def test_leaf_modules_import_nothing_from_jaxtrain():
    for leaf in LEAVES:
        assert import_graph()[leaf] == set(), leaf


def test_models_do_not_depend_on_hf_or_training():
    # Models are the bottom layer: hf, parallel, training and the CLI build on them. They read
    # the configuration's tables of names (remat policies, LoRA targets) and nothing else of it.
    for name, targets in import_graph().items():
        if name.startswith("jaxtrain.models"):
            allowed = ("jaxtrain.models", "jaxtrain.config.tables", *LEAVES)
            bad = {t for t in targets if not t.startswith(allowed)}
            assert not bad, f"{name} imports {sorted(bad)}"


def _private_names_defined(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, globals, `self._name = ...`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)  # not `other._x = ...`: that is reaching in too
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_")}


# Underscore names that are documented public API of their (standard-library) owners.
PUBLIC_UNDERSCORE = {"_exit", "_replace", "_asdict", "_fields", "_make"}


def test_no_module_reaches_a_private_name_of_another_module():
    """`obj._name` is allowed only where `_name` is defined in the same module (a class's
    own helpers); elsewhere a private attribute is somebody else's business. Importing a
    private name from another module is refused likewise."""
    offences = []
    for path in MODULES.values():
        tree = ast.parse(path.read_text())
        own = _private_names_defined(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                attr = node.attr
                private = attr.startswith("_") and not attr.startswith("__")
                if private and attr not in own and attr not in PUBLIC_UNDERSCORE:
                    offences.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxtrain"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        offences.append(f"{path}:{node.lineno}: imports {alias.name}")
    assert not offences, "\n".join(offences)


def test_the_loop_uses_only_the_trainers_public_interface():
    # The issue's own grep: nothing outside trainer.py touches `trainer._...`.
    users = [
        f"{path}: {line.strip()}"
        for name, path in MODULES.items()
        if not name.endswith("training.trainer")
        for line in path.read_text().splitlines()
        if "trainer._" in line
    ]
    assert not users, "\n".join(users)


# The run's environment has one owner (jaxtrain/runtime): nothing else forms the cluster,
# turns on the compilation cache, builds a sharding plan from arguments or resolves the XLA
# options, so a new way of building a run cannot forget one of them.
RUNTIME_STEPS = {
    "initialize_distributed",
    "enable_compilation_cache",
    "ShardingPlan.from_settings",
    "run_compiler_options",
}


def _called_names(tree: ast.Module) -> set[str]:
    """Names of the functions a module calls: `f(...)` -> f, `X.f(...)` -> f and X.f."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                names |= {func.attr, ast.unparse(func)}
            elif isinstance(func, ast.Name):
                names.add(func.id)
    return names


def test_only_the_runtime_builds_the_run_s_environment():
    callers = {
        name: sorted(RUNTIME_STEPS & _called_names(ast.parse(path.read_text())))
        for name, path in MODULES.items()
    }
    outside = {
        name: steps for name, steps in callers.items() if steps and name != "jaxtrain.runtime"
    }
    assert not outside, outside
    assert callers["jaxtrain.runtime"] == sorted(RUNTIME_STEPS)


# The layers, lowest first: a module may import its own layer and those below. The
# foundation (errors, the state type, the objective contract, ...) and the configuration
# (arguments, their checks and value parsing) import no implementation.
LAYERS = (
    (
        "jaxtrain.errors",
        "jaxtrain.pytrees",
        "jaxtrain.interrupts",
        "jaxtrain.cache",
        "jaxtrain.state",
        "jaxtrain.objective",
    ),
    (
        "jaxtrain.arguments",
        "jaxtrain.config",
        "jaxtrain.config_values",
        "jaxtrain.task_arguments",
        "jaxtrain.rollout_arguments",
        "jaxtrain.seed_names",
    ),
    ("jaxtrain.models", "jaxtrain.quantization"),
    ("jaxtrain.parallel",),
    ("jaxtrain.runtime",),
    ("jaxtrain.data",),
    ("jaxtrain.hf",),
    ("jaxtrain.observability", "jaxtrain.checkpointing"),
    ("jaxtrain.serving",),
    ("jaxtrain.evaluation",),
    ("jaxtrain.training",),
    ("jaxtrain.trainers",),
    ("jaxtrain.tasks",),  # each task's definition: its arguments, trainer, model, objective
    ("jaxtrain.planning",),
    ("jaxtrain.distributed",),
    ("jaxtrain.cli", "jaxtrain"),  # the package's __init__ re-exports the public API
)

# The imports that go up, each with its reason (at most 3). None now: detecting a SLURM
# cluster once imported the sbatch writer's module, and with it the Ray driver and every
# Trainer; SLURM's variables are read in parallel/slurm_env.py.
UPWARD_IMPORTS: set[tuple[str, str]] = set()


def layer_of(module: str) -> int:
    matches = [
        (len(prefix), index)
        for index, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} belongs to no layer: add it to LAYERS"
    return max(matches)[1]


def test_imports_go_down_the_layers():
    upward = {
        (name, target)
        for name, targets in import_graph().items()
        for target in targets
        if layer_of(target) > layer_of(name)
    }
    assert upward == UPWARD_IMPORTS, sorted(upward ^ UPWARD_IMPORTS)
    assert len(UPWARD_IMPORTS) <= 3


def test_the_configuration_imports_nothing_of_the_implementation():
    configuration = {name for name in MODULES if layer_of(name) == 1}
    assert "jaxtrain.config.checks" in configuration
    for name in configuration:
        targets = import_graph()[name]
        assert all(layer_of(target) <= 1 for target in targets), (name, targets)
        assert {t for t in targets if layer_of(t) == 0} <= {"jaxtrain.errors"}, name


def test_no_test_imports_a_conftest_by_name():
    """`from conftest import X` finds whichever conftest.py was imported first: a run of
    tests/serving and tests/trainers together once failed to collect (serving's conftest
    has no `tiny_arguments`). Shared helpers live in modules with names of their own."""
    tests = ROOT.parent / "tests"
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if "conftest" in names:
                found.append(f"{path.relative_to(tests)}:{node.lineno}")
    assert not found, f"imports of a conftest by name: {found}"
