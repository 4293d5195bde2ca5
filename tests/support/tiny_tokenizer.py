"""A tiny byte-level BPE tokenizer with a Llama-3-style chat template, written in well under a
second from text made here (nothing downloaded), for tests of the router's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Tools: {{ tools | tojson }}<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}"
    "{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


# Llama 3's pre-tokenizer regex (its tokenizer.json), ahead of a ByteLevel without its own.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def write_tokenizer(
    where: Path, vocab: int = 600, kind: str = "gpt2", corpus: list[str] | None = None
) -> Path:
    """kind: `gpt2` (ByteLevel's own regex), `llama3` (a Split regex, then ByteLevel),
    `metaspace` (SentencePiece's space marker) or `none` (no pre-tokenizer: merges may cross
    spaces)."""
    words = ["def", "return", "class", "import", "self", "value", "index", "block", "cache"]
    if corpus is None:
        corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(300)]
    tok = Tokenizer(models.BPE())
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif kind == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif kind == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    if kind == "metaspace":
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
    else:
        tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<unk>", *SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    where.mkdir(parents=True, exist_ok=True)
    tok.save(str(where / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": TEMPLATE,
    }
    (where / "tokenizer_config.json").write_text(json.dumps(config))
    return where
