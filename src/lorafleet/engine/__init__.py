"""The embedded reference engine: a CPU inference server with runtime LoRA (torch + PEFT).

It speaks vLLM's OpenAI-compatible API and runtime-LoRA routes, and SGLang's where practical, so
lorafleet's tests and default setup need no GPU. Heavy modules (torch) load only when the engine
runs: import ``lorafleet.engine.app`` / ``lorafleet.engine._runtime`` explicitly.
"""

__all__: list[str] = []
