"""The error tables cannot drift: what each route documents is what it can raise.

``STATUS_BY_CODE`` is the one table of codes and statuses. The routes' OpenAPI descriptions list
the codes it maps to each status (``lorafleet._service.describe``); the router's data plane is
documented from ``DATA_PLANE_ERRORS``. Here every route of the agent and the router, and the data
plane, is read for the ``ServiceError`` classes it can raise, following the calls it makes into
lorafleet (its dependencies, the objects its closure holds, ``self``'s methods) a few levels
deep; each one's status must be documented on that route.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from typing import Any

import pytest

from lorafleet import errors as errors_module
from lorafleet._service import STATUS_SUMMARY, codes_for
from lorafleet.errors import InternalError, ServiceError, StaleVersion
from lorafleet.protocol.errors import STATUS_BY_CODE, ErrorCode

TOKEN = "ctl-t0ken"
DEPTH = 4


def _target(node: ast.expr, scope: dict[str, Any], owner: type | None) -> Any:
    """What the callee expression ``node`` names, or None when it cannot be told statically."""
    if isinstance(node, ast.Name):
        return scope.get(node.id)
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            base: Any = owner
        else:
            base = _target(node.value, scope, owner)
        if base is None:
            return None
        if isinstance(base, (type, types.ModuleType)):
            return inspect.getattr_static(base, node.attr, None)
        # An object the app holds (a service, a store): its attribute, as the call would see it.
        static = inspect.getattr_static(type(base), node.attr, None)
        if isinstance(static, property):
            return None
        return getattr(base, node.attr, None)
    return None


def raised(func: Any, owner: type | None = None, depth: int = DEPTH, seen=None) -> set[type]:
    """``ServiceError`` subclasses ``func`` constructs, itself or through lorafleet calls."""
    seen = set() if seen is None else seen
    if inspect.ismethod(func):
        owner, func = type(func.__self__), func.__func__
    if isinstance(func, (staticmethod, classmethod)):
        func = func.__func__
    if not inspect.isfunction(func) or func in seen:
        return set()
    if not func.__module__.startswith("lorafleet"):
        return set()
    seen.add(func)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError):
        return set()
    closure = inspect.getclosurevars(func)
    scope = {**func.__globals__, **closure.globals, **closure.nonlocals}
    if owner is None and "." in func.__qualname__ and "<locals>" not in func.__qualname__:
        owner = scope.get(func.__qualname__.split(".")[0])
    out: set[type] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        target = _target(node.func, scope, owner)
        if isinstance(target, type) and issubclass(target, ServiceError):
            out.add(target)
        elif depth > 0:
            inner_owner = owner if isinstance(node.func, ast.Attribute) else None
            if isinstance(node.func, ast.Attribute) and not (
                isinstance(node.func.value, ast.Name) and node.func.value.id in ("self", "cls")
            ):
                base = _target(node.func.value, scope, owner)
                inner_owner = base if isinstance(base, type) else type(base)
            if isinstance(target, type):  # a class called: what its __init__ raises
                target, inner_owner = target.__dict__.get("__init__"), target
            out |= raised(target, inner_owner, depth - 1, seen)
    return out


def _documented(schema: dict, path: str, method: str) -> set[int]:
    op = schema["paths"][path][method.lower()]
    return {int(s) for s in op["responses"] if s.isdigit() and int(s) >= 400}


def _flat(routes):
    """Every route, also inside included routers (FastAPI 0.165 keeps those as
    ``_IncludedRouter`` entries instead of copying their routes)."""
    for route in routes:
        if hasattr(route, "original_router"):
            yield from _flat(route.original_router.routes)
        else:
            yield route


def _gaps(app) -> list[str]:
    schema = app.openapi()
    gaps = []
    for route in _flat(app.routes):
        endpoint = getattr(route, "endpoint", None)
        if endpoint is None or not getattr(route, "include_in_schema", False):
            continue
        can = raised(endpoint)
        for dep in route.dependant.dependencies:
            can |= raised(dep.call)
        for method in route.methods - {"HEAD"}:
            documented = _documented(schema, route.path_format, method)
            for cls in sorted(can - {InternalError}, key=lambda c: c.__name__):
                status = STATUS_BY_CODE[cls.code]
                if status not in documented:
                    gaps.append(
                        f"{method} {route.path_format}: {cls.__name__} ({status} {cls.code})"
                    )
    return gaps


def test_every_code_has_a_status_a_summary_and_a_class():
    codes = [v for k, v in vars(ErrorCode).items() if k.isupper()]
    assert sorted(codes) == sorted(STATUS_BY_CODE)
    assert set(STATUS_BY_CODE.values()) <= set(STATUS_SUMMARY)
    classes = {
        c.code
        for c in vars(errors_module).values()
        if isinstance(c, type) and issubclass(c, ServiceError) and c.code
    }
    assert classes == set(STATUS_BY_CODE)
    for status in set(STATUS_BY_CODE.values()):
        assert codes_for(status), status


def test_the_analysis_sees_a_raise():
    """The reader is not vacuous: the pipeline's resolve raises StaleVersion past max_staleness."""
    from lorafleet.dataplane.pipeline import Pipeline

    assert StaleVersion in raised(Pipeline.resolve)


def _data_plane_raises() -> set[type]:
    """What the pipeline and every generation shape can raise. A shape reaches the pipeline
    through its ``pipe`` argument, which the reader cannot follow: each side is read whole."""
    from lorafleet.dataplane.pipeline import Pipeline
    from lorafleet.dataplane.shapes import SHAPES

    can = set()
    for name, member in vars(Pipeline).items():
        if inspect.isfunction(member) or name == "__call__":
            can |= raised(member, Pipeline)
    for shape in SHAPES:
        cls = type(shape)
        for klass in cls.__mro__:
            for member in vars(klass).values():
                if inspect.isfunction(member):
                    can |= raised(member, cls)
        module = inspect.getmodule(cls)
        for member in vars(module).values():
            if inspect.isfunction(member) and member.__module__ == module.__name__:
                can |= raised(member)
    return can


def test_router_routes_document_what_they_raise():
    from lorafleet.router.app import RouterConfig, create_app

    app = create_app(RouterConfig(agents=["http://127.0.0.1:9"], control_token=TOKEN))
    assert _gaps(app.api) == []


def test_agent_routes_document_what_they_raise(tmp_path):
    from lorafleet.agent.app import AgentConfig, create_app

    app = create_app(
        AgentConfig(
            engine="reference",
            engine_url="http://127.0.0.1:9",
            data_dir=str(tmp_path / "d"),
            token=TOKEN,
            replica_id="r0",
        )
    )
    try:
        assert _gaps(app) == []
    finally:
        app.state.runtime.db.close()


@pytest.mark.parametrize("keyed", [False, True])
def test_data_plane_documents_every_refusal_the_proxy_raises(keyed):
    from lorafleet.dataplane.pipeline import DATA_PLANE_ERRORS
    from lorafleet.dataplane.shapes import HOT_PATHS
    from lorafleet.router.app import RouterConfig, create_app

    can = _data_plane_raises() - {InternalError}
    assert StaleVersion in can
    assert can <= set(DATA_PLANE_ERRORS), can - set(DATA_PLANE_ERRORS)
    cfg = RouterConfig(agents=[], control_token=TOKEN, api_key="k" if keyed else None)
    schema = create_app(cfg).api.openapi()
    for path in HOT_PATHS:
        responses = schema["paths"][path]["post"]["responses"]
        for cls in DATA_PLANE_ERRORS:
            status = STATUS_BY_CODE[cls.code]
            if status in (401, 403) and not keyed:
                assert str(status) not in responses
                continue
            assert str(status) in responses, (path, cls.__name__)
            assert cls.code in responses[str(status)]["description"], (path, cls.__name__)
