"""SGLang 0.5.23, as seen on real servers (docs/engines/sglang.md).

A bare adapter name in ``model`` silently serves the **base model**. The adapter applies for
``model = "<served base name>:<adapter name>"`` (which wins over ``lora_path``), or ``lora_path``
with ``model`` the base name. ``/generate`` reads only ``lora_path``. SGLang re-reads a name's
remembered path after an unload, so in-place loads go through a link the agent repoints.
"""

from __future__ import annotations

from lorafleet.engine_kinds import EngineKindInfo, EngineOption

UPSERT = EngineOption(
    key="sglang_upsert",
    flag="--sglang-upsert",
    help="The SGLang server accepts Miles' upsert.",
    param="upsert",
)

KIND = EngineKindInfo(
    name="sglang",
    title="SGLang 0.5.23",
    backend="lorafleet.agent.backends.sglang:SGLangBackend",
    rules="lorafleet.rules.sglang:SGLANG",
    launch_spec="lorafleet.launch.specs:SGLangSpec",
    adapter_in_model=lambda base, engine_name: f"{base}:{engine_name}",
    links_in_place=True,
    options=(UPSERT,),
    # 400 with the tokenizer manager's words: a name it never saw (an engine restarted empty),
    # or one the registry lost between the check and the lookup.
    lacks_adapter=lambda status, body: (
        status == 400 and (b"has never been loaded" in body or b"are not loaded" in body)
    ),
    # /generate takes the adapter as lora_path; its answer is SGLang's own.
    native_routes=frozenset({"/generate"}),
    abort_route="/abort_request",
    # float32 on CPU matched PEFT to 2e-6; bf16 kernels on a GPU differ from a float32 trainer
    # by tenths of a nat at the extremes (not measured here): the relative rule decides there.
    canary_tolerance=0.5,
)
