"""The executor seam: `Executor` is everything the controller calls, LocalExecutor implements all
of it with the same signatures, and the controller reaches past it nowhere (so a Kubernetes
executor that implements the protocol is enough)."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

from tests.recovery.fakes import FakeExecutor
from vigil.recovery import controller, executor, local


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in vars(executor.Executor).items()
        if callable(fn) and not name.startswith("_")
    }


def test_the_protocol_holds_what_recovery_needs() -> None:
    assert set(_protocol_methods()) == {
        "launch",
        "adopt",
        "kill_attempt",
        "poll",
        "alive",
        "stop",
        "dump_stacks",
        "diagnose",
        "cordon",
        "forget_node",
    }
    for name, fn in vars(executor.Executor).items():
        if callable(fn) and not name.startswith("_"):
            assert (fn.__doc__ or "").strip(), f"Executor.{name} must say what it guarantees"


def test_local_executor_implements_every_method_with_the_same_signature() -> None:
    for name, wanted in _protocol_methods().items():
        got = inspect.signature(getattr(local.LocalExecutor, name))
        assert list(got.parameters) == list(wanted.parameters), name
        for param in wanted.parameters.values():
            assert got.parameters[param.name].kind == param.kind, (name, param.name)
        assert got.return_annotation == wanted.return_annotation, name
    # The stand-in used by the controller tests implements the protocol and nothing more.
    extra = {
        n
        for n in vars(FakeExecutor)
        if not n.startswith("_") and callable(getattr(FakeExecutor, n))
    }
    assert extra - set(_protocol_methods()) <= {"script"}


def test_the_controller_is_typed_against_the_protocol_alone() -> None:
    hints = typing.get_type_hints(controller.Controller)
    assert hints["executor"] is executor.Executor
    source = Path(inspect.getfile(controller)).read_text()
    tree = ast.parse(source)
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert "LocalExecutor" not in imported and "local" not in imported
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "executor"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "self"
    }
    assert used, "the controller calls its executor"
    assert used <= set(_protocol_methods()), used - set(_protocol_methods())
