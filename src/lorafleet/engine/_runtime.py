"""The model side of the reference engine: a causal LM, PEFT adapters, and one worker thread.

Every touch of the model (forward passes and PEFT's add/delete of adapters) runs on a single
worker thread, in arrival order. That keeps the event loop free for health and control calls, and
it makes adapter changes safe without locks around forward passes: a request queued before an
unload runs before it, a request queued after it cannot name the adapter any more.

Adapters are PEFT's own multi-adapter LoRA layers (``PeftModel.from_pretrained`` /
``load_adapter`` / ``delete_adapter`` / ``set_adapter`` / ``disable_adapter``). Each public name
maps to an internal PEFT adapter name, so an in-place reload can load the new weights beside the
old ones and then swap, and so public names need not be valid module names.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lorafleet.engine._errors import EngineError
from lorafleet.engine._validate import check_adapter_dir
from lorafleet.rules import REFERENCE, Rulebook

__all__ = ["AdapterRecord", "GenParams", "GenResult", "Runtime", "TokenEvent"]


@dataclass(frozen=True)
class AdapterRecord:
    """A registered adapter: its public name, the path it came from, and PEFT's name for it."""

    name: str
    path: str
    internal: str
    rank: int
    created: float = field(default_factory=time.time)


MIN_TEMPERATURE = 1e-2
"""vLLM's ``_MAX_TEMP``: a smaller positive temperature is raised to it."""


@dataclass
class GenParams:
    """Sampling parameters; ``temperature == 0`` is greedy (argmax, as HF ``do_sample=False``)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """Sample from the k likeliest tokens only; 0 or -1: every token (vLLM's)."""
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: no logprobs; k: the sampled token plus the top k
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    """Also score the prompt: each prompt token's logprob given the ones before it, and the k
    likeliest tokens at each position (None: no scoring; 0: the prompt's own tokens only)."""

    def __post_init__(self) -> None:
        # As vLLM's SamplingParams: a temperature this close to 0 overflows the softmax (inf,
        # then NaN probabilities, which torch.multinomial refuses), so it is raised to the floor.
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE


@dataclass
class TokenEvent:
    """One generated token, and the text it released (held back text is released later)."""

    token_id: int
    text: str
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass
class GenResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "length" | "stop" | "abort"
    stop_reason: str | int | None
    prompt_tokens: int
    prompt_logprobs: list[float | None] | None = None
    """With ``GenParams.prompt_logprobs``: None for the first token, then one per token."""
    prompt_top: list[PromptScore | None] | None = None
    """With ``GenParams.prompt_logprobs``: None for the first token, then each position's score
    (the prompt token's rank, and the k likeliest tokens there)."""


@dataclass
class PromptScore:
    """One prompt position: its own token's rank among all, and the k likeliest tokens."""

    rank: int
    top: list[tuple[int, float]]


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters might still grow into a stop string (or a UTF-8 char)."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    if text.endswith("\ufffd"):
        hold = max(hold, len(text) - len(text.rstrip("\ufffd")))
    return hold


class Runtime:
    """Tokenizer, model, adapter registry and the worker thread that owns the model."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        served_model_name: str,
        max_loras: int = 8,
        max_lora_rank: int = 64,
        max_model_len: int | None = None,
        rules: Rulebook = REFERENCE,
        max_logprobs: int = 20,
    ) -> None:
        """``rules``: what a load refuses, in whose words (vLLM's by default; SGLang's for the
        SGLang dialect)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir = str(Path(model_dir).resolve())
        self.served_model_name = served_model_name
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.rules = rules
        self.max_logprobs = max_logprobs
        """vLLM's ``--max-logprobs``: the most logprobs per token a request may ask (-1: all)."""
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.eval()
        self.max_model_len = max_model_len or int(
            getattr(self.model.config, "max_position_embeddings", 2048)
        )
        eos = self.tokenizer.eos_token_id
        self.eos_ids = {eos} if eos is not None else set()
        # What vLLM accepts for this architecture: the leaf names of the decoder's Linear layers.
        self.lora_modules = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, mod in self.model.named_modules()
                if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head")
            }
        )
        self.peft: Any = None  # a PeftModel once the first adapter is loaded
        self.adapters: dict[str, AdapterRecord] = {}  # public registry, event-loop side only
        self._ids = itertools.count(1)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-model")
        self.admin_lock = asyncio.Lock()

    # --- worker-thread side -----------------------------------------------------------------

    def _peft_add(self, internal: str, path: str) -> None:
        from peft import PeftModel

        if self.peft is None:
            self.peft = PeftModel.from_pretrained(
                self.model, path, adapter_name=internal, is_trainable=False
            )
            return
        try:
            self.peft.load_adapter(path, adapter_name=internal, is_trainable=False)
        except BaseException:
            # A half-loaded adapter must not stay behind in PEFT's layers.
            with contextlib.suppress(Exception):
                self._peft_delete(internal)
            raise

    def _peft_delete(self, internal: str) -> None:
        if self.peft is None or internal not in self.peft.peft_config:
            return
        if len(self.peft.peft_config) == 1:
            # PEFT cannot delete its last adapter cleanly; unload() restores the plain layers.
            self.model = self.peft.unload()
            self.peft = None
            return
        if self.peft.active_adapter == internal:
            other = next(a for a in self.peft.peft_config if a != internal)
            self.peft.set_adapter(other)
        self.peft.delete_adapter(internal)

    def _adapter_context(self, internal: str | None) -> contextlib.AbstractContextManager:
        if self.peft is None:
            if internal is not None:
                raise EngineError.not_found(f"adapter {internal} is not loaded")
            return contextlib.nullcontext()
        if internal is None:
            return self.peft.disable_adapter()
        if internal not in self.peft.peft_config:
            raise EngineError.not_found(f"adapter {internal} is not loaded")
        self.peft.set_adapter(internal)
        return contextlib.nullcontext()

    def _pick(
        self, logits: torch.Tensor, p: GenParams, gen: torch.Generator | None
    ) -> tuple[int, torch.Tensor]:
        logp = torch.log_softmax(logits, dim=-1)
        if not p.temperature:
            return int(torch.argmax(logits)), logp
        probs = torch.softmax(logits / p.temperature, dim=-1)
        if 0 < p.top_k < probs.numel():
            # vLLM's order: top-k, then top-p over what is left.
            kth = torch.topk(probs, p.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
            probs = probs / probs.sum()
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            drop = torch.cumsum(sorted_p, 0) - sorted_p > p.top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=gen)), logp

    def generate_sync(
        self,
        prompt_ids: list[int],
        internal: str | None,
        params: GenParams,
        emit: Callable[[TokenEvent], None] | None = None,
        cancelled: threading.Event | None = None,
    ) -> GenResult:
        """Generate on the calling thread (the worker); ``emit`` sees each token as it comes."""
        gen = None
        if params.seed is not None:
            gen = torch.Generator().manual_seed(params.seed)
        out_ids: list[int] = []
        released = 0
        text = ""
        finish, stop_reason = "length", None
        prompt_lps: list[float | None] | None = None
        prompt_top: list[PromptScore | None] | None = None
        scoring = params.prompt_logprobs is not None
        with torch.inference_mode(), self._adapter_context(internal):
            past = None
            step_input = torch.tensor([prompt_ids], dtype=torch.long)
            for _ in range(params.max_tokens):
                if cancelled is not None and cancelled.is_set():
                    finish = "abort"
                    break
                # The first pass keeps every position's logits when the prompt is scored
                # (echo with logprobs, as vLLM answers it); later passes only the last.
                keep = 0 if scoring and past is None else 1
                out = self.model(
                    input_ids=step_input, cache=past, use_cache=True, logits_to_keep=keep
                )
                if keep == 0:
                    prompt_lps, prompt_top = self._score_prompt(out.logits, prompt_ids, params)
                past = out.cache
                tok, logp = self._pick(out.logits[0, -1].float(), params, gen)
                out_ids.append(tok)
                text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
                done = False
                if tok in self.eos_ids and not params.ignore_eos:
                    finish, stop_reason, done = "stop", None, True
                for s in params.stop:
                    at = text.find(s)
                    if s and at >= 0:
                        text = text[:at]
                        finish, stop_reason, done = "stop", s, True
                        break
                if emit is not None:
                    upto = len(text) if done else len(text) - _held_back(text, params.stop)
                    upto = max(upto, released)
                    ev = TokenEvent(tok, text[released:upto])
                    released = upto
                    if params.logprobs is not None:
                        ev.logprob = float(logp[tok])
                        if params.logprobs > 0:
                            vals, idx = torch.topk(logp, min(params.logprobs, logp.numel()))
                            ev.top = [(int(i), float(v)) for i, v in zip(idx, vals, strict=True)]
                    emit(ev)
                if done:
                    break
                step_input = torch.tensor([[tok]], dtype=torch.long)
        if scoring and prompt_lps is None:  # max_tokens 0: the prompt is still scored
            with torch.inference_mode(), self._adapter_context(internal):
                out = self.model(input_ids=torch.tensor([prompt_ids]), logits_to_keep=0)
                prompt_lps, prompt_top = self._score_prompt(out.logits, prompt_ids, params)
        # Like vLLM's incremental detokenizer: bytes of an unfinished UTF-8 character at the very
        # end never become text (HF's decode would show them as U+FFFD).
        text = text.rstrip("\ufffd")
        if emit is not None and released < len(text):
            emit(TokenEvent(-1, text[released:]))  # flush what was held back at "length"
        return GenResult(
            out_ids, text, finish, stop_reason, len(prompt_ids), prompt_lps, prompt_top
        )

    def _score_prompt(
        self, logits: torch.Tensor, prompt_ids: list[int], params: GenParams
    ) -> tuple[list[float | None], list[PromptScore | None]]:
        """Each prompt token's logprob given the ones before it, and its position's score."""
        scored = torch.log_softmax(logits[0, :-1].float(), dim=-1)
        targets = torch.tensor(prompt_ids[1:], dtype=torch.long)
        picked = scored.gather(1, targets.unsqueeze(1)).squeeze(1)
        k = params.prompt_logprobs or 0
        k = scored.shape[-1] if k < 0 else min(k, scored.shape[-1])
        ranks = (scored > picked.unsqueeze(1)).sum(dim=1) + 1
        tops: list[PromptScore | None] = [None]
        if k:
            vals, idx = torch.topk(scored, k, dim=-1)
        for pos in range(len(targets)):
            top = (
                [(int(i), float(v)) for i, v in zip(idx[pos], vals[pos], strict=True)] if k else []
            )
            tops.append(PromptScore(int(ranks[pos]), top))
        return [None, *picked.tolist()], tops

    # --- event-loop side --------------------------------------------------------------------

    async def _on_worker(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    def resolve(self, model: str | None) -> AdapterRecord | None:
        """The adapter a request names (None for the base model); 404 for an unknown name."""
        if not model or model == self.served_model_name:
            return None
        rec = self.adapters.get(model)
        if rec is None:
            raise EngineError.not_found(
                f"The model `{model}` does not exist. Valid aliases: {self.served_model_name}.",
                param="model",
            )
        return rec

    async def load_adapter(self, name: str, path: str, *, replace: bool = False) -> AdapterRecord:
        """Validate and load ``path`` under ``name``; ``replace`` swaps an existing one in place.

        Raises ``EngineError``: 404 (no adapter at path), 500 (vLLM would refuse it, or PEFT
        failed), 507-ish capacity refusal as 503 when ``max_loras`` adapters are registered.
        Callers hold ``admin_lock`` and check duplicates and names first.
        """
        old = self.adapters.get(name)
        if old is None and len(self.adapters) >= self.max_loras:
            raise EngineError(
                503,
                "ServiceUnavailableError",
                f"Cannot load LoRA adapter '{name}': the engine already holds "
                f"max_loras={self.max_loras} adapters ({', '.join(sorted(self.adapters))}). "
                "Unload one first.",
            )
        cfg = check_adapter_dir(
            name,
            path,
            max_lora_rank=self.max_lora_rank,
            expected_modules=self.lora_modules,
            rules=self.rules,
        )
        internal = f"lf{next(self._ids)}"
        try:
            await self._on_worker(self._peft_add, internal, path)
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError.internal(f"Loading lora {name} failed: {exc}") from exc
        rec = AdapterRecord(name=name, path=path, internal=internal, rank=int(cfg["r"]))
        self.adapters[name] = rec
        if old is not None and replace:
            # Requests queued before this point still run on the old weights (FIFO worker).
            await self._on_worker(self._peft_delete, old.internal)
        return rec

    async def unload_adapter(self, name: str) -> AdapterRecord:
        """Forget ``name`` now and free its PEFT layers once earlier requests have run."""
        rec = self.adapters.pop(name)
        await self._on_worker(self._peft_delete, rec.internal)
        return rec

    async def generate(
        self, prompt_ids: list[int], adapter: AdapterRecord | None, params: GenParams
    ) -> GenResult:
        internal = adapter.internal if adapter else None
        return await self._on_worker(self.generate_sync, prompt_ids, internal, params)

    async def stream(
        self, prompt_ids: list[int], adapter: AdapterRecord | None, params: GenParams
    ) -> AsyncIterator[TokenEvent | GenResult]:
        """Yield each ``TokenEvent`` as it is generated, then the ``GenResult``.

        Closing the iterator early (client gone) stops generation at the next token.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        cancelled = threading.Event()
        internal = adapter.internal if adapter else None

        def emit(ev: TokenEvent) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, ev)

        fut = loop.run_in_executor(
            self._worker, self.generate_sync, prompt_ids, internal, params, emit, cancelled
        )
        getter: asyncio.Future | None = None
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, fut}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                    continue
                getter.cancel()
                while not queue.empty():
                    yield queue.get_nowait()
                yield fut.result()
                return
        finally:
            cancelled.set()  # the worker stops at its next token
            if getter is not None and not getter.done():
                getter.cancel()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
