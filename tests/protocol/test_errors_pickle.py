"""Every lorafleet error survives plain pickling whole: class, message, code and attributes.

Ray hands an actor's exception to the driver by pickle, and several error classes take
keyword-only arguments (``path=``, ``code=``) that pickle's default reduction cannot pass.
"""

from __future__ import annotations

import pickle

import pytest

from lorafleet import errors
from lorafleet.errors import LorafleetError, PathEscape, PublishError, ServiceError


def _classes(root: type) -> list[type]:
    out = []
    for sub in root.__subclasses__():
        out += [sub, *_classes(sub)]
    return out


def _example(cls: type) -> LorafleetError:
    """One instance of ``cls``, built as lorafleet's own code builds it."""
    if issubclass(cls, errors.PathError):
        return cls("not allowed here", path="../etc/passwd")
    if issubclass(cls, ServiceError) and cls.code is None:
        return cls("explicit", code="conflict", param="version", status=409, url="http://x/y")
    if issubclass(cls, PublishError):
        return cls("publication failed", {"replica-1": "422 adapter_invalid"})
    if issubclass(cls, errors.TenantQuotaExceeded):
        return cls("over its byte quota", quota="max_bytes", limit=10, usage=12)
    return cls("it failed")


@pytest.mark.parametrize("cls", sorted(set(_classes(LorafleetError)), key=lambda c: c.__name__))
def test_each_error_class_round_trips_through_plain_pickle(cls) -> None:
    exc = _example(cls)
    exc.add_note("from a Ray actor")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls
    assert str(back) == str(exc) and back.args == exc.args
    assert vars(back) == vars(exc)
    assert getattr(back, "code", None) == getattr(exc, "code", None)
    assert back.__notes__ == ["from a Ray actor"]


def test_a_keyword_only_constructor_is_never_called_on_the_way_back() -> None:
    exc = PathEscape("escapes the root", path="../../x")
    assert pickle.loads(pickle.dumps(exc)).path == "../../x"
