"""The tenants file: validation, name patterns, token identification and quotas."""

from __future__ import annotations

import hashlib
import hmac
import json
from fnmatch import fnmatchcase

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafleet.errors import InvalidRequest, TenantQuotaExceeded
from lorafleet.protocol import tenants as tenants_module
from lorafleet.protocol.names import NAME_PATTERN
from lorafleet.protocol.router import AliasEntry, RoutableVersion
from lorafleet.protocol.tenants import Tenant, Tenants, adapter_of, token_digest

names = st.from_regex(NAME_PATTERN, fullmatch=True)
tokens = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=40
)


def _tenant(**kw) -> dict:
    return {"id": "alice", "token": "a-token", "names": ["alice-*"], **kw}


def _entry(name: str, *versions: tuple[int, int | None, int], keep: int = 2) -> AliasEntry:
    """An alias whose routable versions are (version, size, replica count), newest first."""
    routable = [
        RoutableVersion(
            version=v, engine_name=f"{name}@v{v}", replicas=[f"r{i}" for i in range(n)], size=s
        )
        for v, s, n in versions
    ]
    top = routable[0]
    return AliasEntry(
        name=name,
        version=top.version,
        engine_name=top.engine_name,
        replicas=top.replicas,
        seq=1,
        keep_versions=keep,
        routable=routable,
    )


def test_a_toml_and_a_json_file_load_alike(tmp_path):
    digest = hashlib.sha256(b"b-token").hexdigest()
    (tmp_path / "t.toml").write_text(
        '[[tenant]]\nid = "alice"\ntoken = "a-token"\nnames = ["alice-*"]\nmax_adapters = 2\n'
        f'[[tenant]]\nid = "bob"\ntoken_sha256 = "{digest.upper()}"\nnames = ["bob-*", "b?"]\n'
    )
    doc = {
        "tenant": [
            _tenant(max_adapters=2),
            {"id": "bob", "token_sha256": digest, "names": ["bob-*", "b?"]},
        ]
    }
    (tmp_path / "t.json").write_text(json.dumps(doc))
    for path in (tmp_path / "t.toml", tmp_path / "t.json"):
        loaded = Tenants.load(path)
        assert [t.id for t in loaded] == ["alice", "bob"]
        assert loaded.identify("Bearer b-token").id == "bob"  # type: ignore[union-attr]
        assert loaded.identify(b"bearer a-token").id == "alice"  # type: ignore[union-attr]
        assert loaded.tenants[0].max_adapters == 2


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({"tenant": [_tenant(), _tenant(token="other")]}, "ids must be unique: alice"),
        ({"tenant": [_tenant(), _tenant(id="bob", names=["b*"])]}, "same token"),
        ({"tenant": [_tenant(id="no/slash")]}, "invalid adapter name"),
        ({"tenant": [_tenant(names=[])]}, "names"),
        ({"tenant": [_tenant(names=[""])]}, "must not be empty"),
        ({"tenant": [_tenant(token=None)]}, "exactly one of token_sha256 and token"),
        ({"tenant": [_tenant(token_sha256="ab" * 32)]}, "exactly one of token_sha256 and token"),
        ({"tenant": [_tenant(token=None, token_sha256="xyz")]}, "64 hex digits"),
        ({"tenant": [_tenant(max_bytes=-1)]}, "max_bytes"),
        ({"tenant": [_tenant(shape="round")]}, "shape"),
        ({"tenants": []}, "tenants"),
    ],
)
def test_a_bad_file_is_refused_naming_the_problem(doc, words, tmp_path):
    with pytest.raises(InvalidRequest, match=words):
        Tenants.parse(doc)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=str(path)):
        Tenants.load(path)


def test_an_unreadable_file_is_refused(tmp_path):
    with pytest.raises(InvalidRequest, match="tenants file"):
        Tenants.load(tmp_path / "absent.toml")
    (tmp_path / "bad.toml").write_text("[[tenant]\n")
    with pytest.raises(InvalidRequest, match=r"bad\.toml"):
        Tenants.load(tmp_path / "bad.toml")


PATTERNS = st.lists(st.from_regex(r"[A-Za-z0-9*?.-]{1,12}", fullmatch=True), min_size=1, max_size=3)


@given(name=names, patterns=PATTERNS)
def test_owns_is_a_case_sensitive_match_of_any_pattern(name, patterns):
    t = Tenant(id="t", token="x", names=tuple(patterns))
    assert t.owns(name) == any(fnmatchcase(name, p) for p in patterns)
    assert Tenant(id="t", token="x", names=(name,)).owns(name)
    if name.lower() != name.upper():
        flipped = name.swapcase()
        assert Tenant(id="t", token="x", names=(name,)).owns(flipped) == (flipped == name)


@given(name=names, version=st.integers(1, 10**6))
def test_a_pin_names_its_adapter(name, version):
    assert adapter_of(f"{name}@v{version}") == name
    assert adapter_of(name) == name or "@v" in name


@settings(max_examples=50)
@given(secrets=st.lists(tokens, min_size=1, max_size=6, unique=True), other=tokens)
def test_identify_finds_exactly_the_tenant_of_a_token(secrets, other):
    tenants = Tenants(
        [Tenant(id=f"t{i}", token=s, names=(f"t{i}-*",)) for i, s in enumerate(secrets)]
    )
    for i, s in enumerate(secrets):
        assert tenants.identify(f"Bearer {s}").id == f"t{i}"  # type: ignore[union-attr]
    if other not in secrets:
        assert tenants.identify(f"Bearer {other}") is None
    assert tenants.identify(None) is None
    assert tenants.identify(f"Basic {secrets[0]}") is None
    assert tenants.identify("Bearer ") is None


def test_identify_compares_every_digest_whichever_matches(monkeypatch):
    """Constant time: every tenant's digest is compared, by hmac.compare_digest, even after the
    first one matched (the time says nothing about which tenant a token is)."""
    seen: list[bytes] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        seen.append(b)
        return compare(a, b)

    monkeypatch.setattr(tenants_module.hmac, "compare_digest", counting)
    tenants = Tenants([Tenant(id=f"t{i}", token=f"s{i}", names=("x",)) for i in range(5)])
    for token in ("s0", "s4", "nobody"):
        seen.clear()
        tenants.identify(f"Bearer {token}")
        assert seen == [token_digest(f"s{i}") for i in range(5)]


def test_quota_counts_the_tenants_names_only():
    t = Tenant(id="a", token="x", names=("a-*",), max_adapters=2, max_bytes=100, max_slots=3)
    aliases = {
        "a-1": _entry("a-1", (2, 30, 1), (1, 20, 1)),
        "b-1": _entry("b-1", (1, 1000, 5)),
    }
    assert t.usage(aliases) == tenants_module.TenantUsage(adapters=1, bytes=50, slots=2)
    # A new version of a-1 drops v1 (keep 2): 30 + 60.
    assert t.check_quota(aliases, "a-1", 60).bytes == 90
    # A second name: 50 + 40.
    assert t.check_quota(aliases, "a-2", 40).adapters == 2
    with pytest.raises(TenantQuotaExceeded) as info:
        t.check_quota(aliases, "a-2", 51)
    exc = info.value
    assert (exc.quota, exc.limit, exc.usage, exc.status, exc.code) == (
        "max_bytes",
        100,
        101,
        409,
        "tenant_quota_exceeded",
    )
    assert "limit is 100 bytes" in exc.message and "holds 50" in exc.message
    aliases["a-2"] = _entry("a-2", (1, None, 0))
    with pytest.raises(TenantQuotaExceeded, match="max_adapters"):
        t.check_quota(aliases, "a-3", 0)
    # Slots: judged only when asked (placement), with no new version.
    assert t.check_quota(aliases, "a-1", None, slots=1).slots == 3
    with pytest.raises(TenantQuotaExceeded, match="max_slots"):
        t.check_quota(aliases, "a-1", None, slots=2)


@given(
    sizes=st.lists(st.integers(0, 50), min_size=1, max_size=4),
    new=st.integers(0, 100),
    limit=st.integers(0, 200),
)
def test_a_load_passes_exactly_when_it_stays_within_max_bytes_or_does_not_grow(sizes, new, limit):
    t = Tenant(id="a", token="x", names=("a-*",), max_bytes=limit)
    versions = [(len(sizes) - i, s, 1) for i, s in enumerate(sizes)]
    aliases = {"a-n": _entry("a-n", *versions, keep=len(sizes))}
    held = sum(sizes)
    after = held - sizes[-1] + new
    try:
        t.check_quota(aliases, "a-n", new)
        assert after <= limit or after <= held
    except TenantQuotaExceeded as exc:
        assert after > limit and after > held and exc.usage == after
