"""The error family: one base with an exit code, the old names still importable."""

import ast
import sys
from pathlib import Path

import pytest

import jaxtrain
from jaxtrain import errors
from jaxtrain.errors import EXIT_BAD_INPUT, JaxtrainError

# (old home, name, exit code); each old home must hand out the very class of jaxtrain.errors.
OLD_HOMES = [
    ("jaxtrain.arguments", "ArgumentError", EXIT_BAD_INPUT),
    ("jaxtrain.parallel.mesh", "MeshError", EXIT_BAD_INPUT),
    ("jaxtrain.parallel.rules", "ShardingRuleError", EXIT_BAD_INPUT),
    ("jaxtrain.parallel", "DistributedError", EXIT_BAD_INPUT),
    ("jaxtrain.data", "DatasetError", EXIT_BAD_INPUT),
    ("jaxtrain.hf", "HFError", EXIT_BAD_INPUT),
    ("jaxtrain.training.checkpoint", "CheckpointError", EXIT_BAD_INPUT),
    ("jaxtrain.observability", "TrackerError", EXIT_BAD_INPUT),
    ("jaxtrain.observability", "ReportError", errors.EXIT_CRASH),
    ("jaxtrain.training.stopping", "NonFiniteLossError", errors.EXIT_NONFINITE),
    ("jaxtrain.trainers.rewards", "RewardError", EXIT_BAD_INPUT),
]
# Exceptions of the package outside the family, each for a reason: none reaches a user.
NOT_IN_THE_FAMILY = {
    "DataExhausted": "a loader's end of data, caught by the loop",
    "_ProcessLost": "a Ray actor's death, turned into DistributedError by the driver",
    "RequestError": "an HTTP answer of `jaxtrain serve` (status and OpenAI's error shape)",
}


@pytest.mark.parametrize("module, name, code", OLD_HOMES)
def test_old_homes_export_the_family(module, name, code):
    __import__(module)
    cls = getattr(sys.modules[module], name)
    assert cls is getattr(errors, name)
    assert getattr(jaxtrain, name, cls) is cls  # the top-level names are the same classes
    assert issubclass(cls, JaxtrainError)
    assert cls("x").exit_code == code


def test_top_level_exports_the_base():
    assert {"JaxtrainError", "ReportError", "ArgumentError"} <= set(jaxtrain.__all__)


def test_bad_input_errors_stay_value_errors():
    # Code written before the family caught ValueError for bad input; it must keep working.
    for cls in (errors.ArgumentError, errors.DatasetError, errors.HFError, errors.MeshError):
        assert issubclass(cls, ValueError)


def test_interrupt_exit_code_is_the_shell_convention():
    err = errors.TrainingInterrupted("SIGTERM", step=7, checkpoint_path=None)
    assert isinstance(err, JaxtrainError) and err.exit_code == 143 and "step 7" in str(err)


def test_errors_module_is_a_leaf():
    tree = ast.parse(Path(errors.__file__).read_text())
    imported = [
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (node.names if isinstance(node, ast.Import) else [node])
    ]
    assert not [m for m in imported if m.split(".")[0] == "jaxtrain"], imported


def test_every_exception_the_package_defines_is_in_the_family():
    """A reward function's failure (RewardError, a bare ValueError) once escaped the CLI as a
    traceback with exit 1, which the exit codes keep for bugs. Read from the source: a class
    whose base is a built-in exception must be in NOT_IN_THE_FAMILY."""
    import builtins

    builtin = {n for n, v in vars(builtins).items() if isinstance(v, type)
               and issubclass(v, BaseException)}  # fmt: skip
    outside = []
    for path in Path(jaxtrain.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and path.name != "errors.py":
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                if bases & builtin and node.name not in NOT_IN_THE_FAMILY:
                    outside.append(f"{path.name}: {node.name}")
    assert outside == [], outside
