"""The tiny model a CPU vLLM serves: a Llama config and a byte-level BPE tokenizer, written here.

vLLM's `--load-format dummy` fills the weights with seeded random values, so the directory holds
no weight files: `config.json`, `tokenizer.json` (trained with `tokenizers` on a corpus this
module generates from a fixed seed, so the same bytes come out on every machine and Python
version), `tokenizer_config.json` with a Llama-3-style chat template, and
`generation_config.json`. Nothing is downloaded. The directory is written next to its final
place and renamed into it, so a reader never sees half of one; `MODEL_VERSION` names the layout.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

MODEL_VERSION = "tiny-llama-v1"
VOCAB_SIZE = 4096
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
HEADER_START, HEADER_END, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SPECIAL = [BOS, EOS, HEADER_START, HEADER_END, EOT]
_READY = ".complete"

# Llama 3's template, less its tool and date preamble: role headers, content, end of turn.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] | trim }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": VOCAB_SIZE,
}

_SYLLABLES = (
    "ka ne ro mi tu sa le vo pri sto gan del fin mar qua zel bro chi then wor "
    "ing ed er ly tion ous ment able al ic"
).split()
_WORDS = (
    "the a of to and in is it for on with as at by from that this be are was request "
    "router engine token cache prefix stream model backend block queue load user assistant "
    "system message content answer question time data value error status health metric "
    "one two three four five six seven eight nine ten"
).split()
_PUNCT = [". ", ", ", "; ", ": ", "? ", "! ", "\n", " (", ") ", ' "', '" ', " - "]


def corpus(chars: int = 600_000, seed: int = 20) -> str:
    """Text from a fixed seed: common words, made-up words, numbers, punctuation, code-ish lines.

    `random.Random(seed)` draws the same sequence on every Python 3 version for `random()`,
    `choice()` and `randrange()`, so the corpus (and the trained tokenizer) is the same
    everywhere, unlike any text read from the installed Python's own files.
    """
    rng = random.Random(seed)
    made_up = [
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randrange(1, 4))) for _ in range(3000)
    ]
    out: list[str] = []
    size = 0
    while size < chars:
        roll = rng.random()
        if roll < 0.55:
            word = rng.choice(_WORDS)
        elif roll < 0.9:
            word = rng.choice(made_up)
        elif roll < 0.95:
            word = str(rng.randrange(0, 10_000))
        else:
            word = f"{rng.choice(made_up)}_{rng.choice(made_up)}({rng.randrange(100)})"
        if rng.random() < 0.08:
            word = word.capitalize()
        piece = word + (rng.choice(_PUNCT) if rng.random() < 0.15 else " ")
        out.append(piece)
        size += len(piece)
    return "".join(out)


def _train_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus()
    lines = text.split("\n")
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tok


def _dump(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"


def _files(tok: Any, dims: dict[str, Any] | None = None) -> dict[str, str]:
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    config = {**CONFIG, **(dims or {}), "bos_token_id": ids[BOS], "eos_token_id": ids[EOT]}
    # The model's vocabulary must cover every id the tokenizer has, and the dummy weights can
    # emit any id up to vocab_size: keep both the same size.
    config["vocab_size"] = max(VOCAB_SIZE, tok.get_vocab_size())
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOT,
        "pad_token": EOS,
        "model_max_length": CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(ids[t]): {
                "content": t,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for t in SPECIAL
        },
    }
    generation = {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOT], ids[EOS]]}
    return {
        "config.json": _dump(config),
        "tokenizer.json": tok.to_str(pretty=False),
        "tokenizer_config.json": _dump(tokenizer_config),
        "special_tokens_map.json": _dump({"bos_token": BOS, "eos_token": EOT, "pad_token": EOS}),
        "generation_config.json": _dump(generation),
    }


# Where prefill costs enough to be worth moving (benchmarks of prefill/decode disaggregation):
# a 1500-token prompt took 0.83-0.86 s to prefill on one core, against ~0.07 s for the tiny one.
LARGER_VERSION = "larger-llama-v1"
LARGER: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 64,
}
SIZES: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": (MODEL_VERSION, {}),
    "larger": (LARGER_VERSION, LARGER),
}


def write_model(cache: Path, size: str = "tiny") -> Path:
    """The model directory under `cache` (written if absent); its path. `size`: `tiny` (the
    tier's) or `larger` (same tokenizer, hidden 1024, 4 layers)."""
    version, dims = SIZES[size]
    final = cache / version
    if (final / _READY).exists():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=cache))
    try:
        for name, text in _files(_train_tokenizer(), dims).items():
            (tmp / name).write_text(text, encoding="utf-8")
        (tmp / _READY).write_text(version + "\n")
        try:
            os.rename(tmp, final)
        except OSError:  # another writer got there first (or a stale incomplete one is there)
            if not (final / _READY).exists():
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
