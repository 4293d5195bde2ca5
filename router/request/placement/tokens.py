"""A request's prompt as the engine's token ids: what the KV-event index (router/engine/) matches.

Two ways, chosen per model (`affinity.tokenizers`):
- `router`: the model's own `tokenizer.json` (HF `tokenizers`) and the chat template of its
  `tokenizer_config.json`, rendered as vLLM renders it (transformers' sandboxed jinja2
  environment with `trim_blocks`/`lstrip_blocks`, `tojson`, `raise_exception`, `strftime_now`;
  the special tokens as variables; `add_generation_prompt`; text parts joined by newlines for a
  template that does not loop over `content`; assistant `tool_calls` arguments parsed to objects;
  `developer` turned into `system` (merged into one first system message) for a template that
  does not know it), then encoded without special tokens. A completion prompt is encoded with
  them (the BOS), a list of ids taken as is. jinja2 because that is the template language: no
  other renderer gives the same text.
- `engine`: the backend's own `POST /tokenize` with the same body (messages, tools) - exact by
  construction, one round trip (~2-5 ms on a local engine) on the request's path; none for a
  chat whose earlier messages were seen before (router/request/placement/token_memo.py).
Cost (router): the rendered text is split at the special tokens (which the tokenizer never
merges across), a long piece further at the first "letter, space, letter" CHUNK to 2 x CHUNK
characters past the last cut (a regex-split byte-level BPE, GPT-2's, Llama 3's or Qwen's,
never merges across one: checked on a probe text when the tokenizer loads, else not split),
and each piece's ids are kept in an LRU of MAX_CACHED_TOKENS ids, so a repeated system prompt,
document or shared prefix costs dictionary lookups and only the new tail is encoded; a
completion prompt too, its special tokens (the BOS) put around as the tokenizer's template puts
them. New pieces are encoded in Rust, with the GIL released (`encode_batch`; `encode` keeps
it). A prompt past `tokenize_inline_chars` is tokenized in a worker thread, off the event loop.
The floor is the library's: a cold 8k-token prompt costs what `tokenizers` takes to encode it
(bench/scenarios/kv.py reports both).
Anything a template or tokenizer rejects gives no tokens (the request is routed on the
approximate index), never an error: the engine answers for the request itself.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import threading
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from router.core.backend import Backend
from router.core.settings import PoolLimits, Timeouts
from router.upstream.pools import Pools

if TYPE_CHECKING:
    import jinja2
    import jinja2.ext

# Ids kept across pieces: 30-45 MB (measured 31 bytes an id with the piece keys, on a
# 4k vocabulary; a large one's ids are int objects of their own, ~42 bytes each).
MAX_CACHED_TOKENS = 1_000_000
MIN_CACHED_PIECE = 64  # characters: shorter pieces are cheaper to encode than to key
GIL_FREE_CHARS = 4096  # longer texts are encoded with the GIL released
CHUNK = 512  # characters: a long piece is cut at the first safe point past each multiple
# A space between two letters: byte-level BPE's pre-tokenizer regex (GPT-2's ` ?\p{L}+`, Llama
# 3's `[^\r\n\p{L}\p{N}]?\p{L}+`) ends a word at the space and starts the next with it.
_SAFE = re.compile(r"(?<=[^\W\d_]) (?=[^\W\d_])")
# Letters, digits, punctuation, runs of spaces and newlines, contractions, accents and CJK:
# chunked and whole must encode alike before a tokenizer's pieces are chunked.
_PROBE = (
    "It's 2026; they'll route 1234567 prompts.  Twice\n\n\tindented  text, \u00e9t\u00e9 "
    "na\u00efve caf\u00e9 \u65e5\u672c\u8a9e \u0645\u0631\u062d\u0628\u0627 x_y z-w "
    "(a) [b] {c} <d> don't I'm we've you'd   end.\n"
)


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be used; str() names the file."""


def _hub_dir(name: str) -> Path | None:
    """A hub id already in the local HF cache (never downloaded here)."""
    import os

    home = Path(os.environ.get("HF_HUB_CACHE") or Path.home() / ".cache/huggingface/hub")
    snaps = home / f"models--{name.replace('/', '--')}" / "snapshots"
    if not snaps.is_dir():
        return None
    found = sorted(snaps.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0] if found else None


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


def _loops_over_content(template: str, env: jinja2.Environment) -> bool:
    """vLLM's content-format detection, simplified: does the template iterate a `content`?"""
    import jinja2.nodes

    try:
        ast = env.parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        if isinstance(it, jinja2.nodes.Name) and it.name == "content":
            return True
        if isinstance(it, jinja2.nodes.Getitem) and isinstance(it.arg, jinja2.nodes.Const):
            if it.arg.value == "content":
                return True
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return True
    return False


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


# jinja2 and tokenizers load with the first router-side tokenizer: most configurations have none,
# and every router start would pay their import.
@functools.cache
def _generation_tag() -> type[jinja2.ext.Extension]:
    """transformers' `{% generation %}` tag: renders its body unchanged."""
    import jinja2.ext
    import jinja2.nodes
    import jinja2.parser

    class _Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body)
            return call.set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    return _Generation


class RouterTokenizer:
    def __init__(self, path: str) -> None:
        import jinja2.ext
        import jinja2.sandbox
        from tokenizers import Tokenizer

        where = Path(path)
        if not where.is_dir():
            hub = _hub_dir(path)
            if hub is None:
                raise TokenizerError(f"tokenizer {path}: not a directory nor a cached hub id")
            where = hub
        try:
            self.tokenizer = Tokenizer.from_file(str(where / "tokenizer.json"))
        except Exception as exc:
            raise TokenizerError(f"{where / 'tokenizer.json'}: {exc}") from None
        try:
            config = json.loads((where / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (where / "chat_template.jinja").is_file():
            template = (where / "chat_template.jinja").read_text(encoding="utf-8")
        self.specials: dict[str, str] = {}
        for key in (
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ):
            text = _token_text(config.get(key))
            if text is not None:
                self.specials[key] = text
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_generation_tag(), jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(template) if isinstance(template, str) else None
        self._openai_content = isinstance(template, str) and _loops_over_content(template, env)
        self._developer = isinstance(template, str) and (
            '"developer"' in template or "'developer'" in template
        )
        # Pieces split at special tokens encode alike alone or together, unless a token strips
        # the whitespace next to it.
        added = [t for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]
        splittable = bool(added) and not any(t.lstrip or t.rstrip for t in added)
        self._split = (
            re.compile("(" + "|".join(re.escape(t.content) for t in added) + ")")
            if splittable
            else None
        )
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cached_tokens = 0
        self._lock = threading.Lock()
        self._wrap = self._specials_around()
        self._chunked = False
        if added and self._split is not None:
            # A tokenizer that marks a word's start (SentencePiece's metaspace, "first") does
            # so at the start of each piece too: then pieces do not encode as the whole.
            first, last = added[0].content, added[-1].content
            if not self._pieces_match(f"{first}system{last}\n\n{_PROBE}{first} x{last}"):
                self._split = None
            elif not any(
                _SAFE.search(t.content) for t in self.tokenizer.get_added_tokens_decoder().values()
            ):
                self._chunked = True  # for the probe: chunked against whole
                self._chunked = self._pieces_match(_PROBE * (3 * CHUNK // len(_PROBE) + 1))
            self._cache.clear()
            self._cached_tokens = 0

    def _pieces_match(self, probe: str) -> bool:
        specials = (False, True) if self._wrap is not None else (False,)
        return all(self._encode_pieces(probe, s) == self._plain(probe, s) for s in specials)

    def _specials_around(self) -> tuple[list[int], list[int]] | None:
        """The ids the tokenizer's post-processor puts before and after a text's own (the BOS),
        when it does so alike for any text; None otherwise."""
        found: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        for probe in ("a", "Hello world", " 12"):
            bare = list(self.tokenizer.encode(probe, add_special_tokens=False).ids)
            full = list(self.tokenizer.encode(probe, add_special_tokens=True).ids)
            at = next(
                (i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare),
                None,
            )
            if not bare or at is None:
                return None
            found.add((tuple(full[:at]), tuple(full[at + len(bare) :])))
        if len(found) != 1:
            return None
        pre, post = found.pop()
        return list(pre), list(post)

    # --- rendering ------------------------------------------------------------------------------

    def render(self, payload: dict[str, Any]) -> str | None:
        """The chat prompt as text, as vLLM renders it; None when the template refuses it."""
        if self.template is None:
            return None
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return None
        conv = [_message(m, self._openai_content) for m in messages if isinstance(m, dict)]
        if not self._developer and any(m.get("role") == "developer" for m in conv):
            conv = _merge_system([_as_system(m) for m in conv])
        kwargs = payload.get("chat_template_kwargs")
        extra = dict(kwargs) if isinstance(kwargs, dict) else {}
        add_gen = payload.get("add_generation_prompt", True)
        try:
            return self.template.render(
                **self.specials,
                **extra,
                messages=conv,
                tools=payload.get("tools") or None,
                documents=payload.get("documents"),
                add_generation_prompt=bool(add_gen) and not payload.get("continue_final_message"),
            )
        except Exception:  # the template's own raise_exception, or a broken template
            return None

    # --- encoding -------------------------------------------------------------------------------

    def encode(self, text: str, special: bool) -> list[int]:
        if (
            self._split is None
            or len(text) < 2 * MIN_CACHED_PIECE
            or (special and self._wrap is None)
        ):
            return self._plain(text, special)
        return self._encode_pieces(text, special)

    def _plain(self, text: str, special: bool) -> list[int]:
        if len(text) < GIL_FREE_CHARS:
            return list(self.tokenizer.encode(text, add_special_tokens=special).ids)
        # `encode` holds the GIL throughout (the event loop stalls for all of it even with
        # this in a worker thread); `encode_batch` releases it.
        return list(self.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids)

    def _encode_pieces(self, text: str, special: bool) -> list[int]:
        assert self._split is not None
        cache = self._cache
        misses: list[tuple[int, str]] = []
        pieces = [p for p in self._split.split(text) if p]
        if self._chunked:
            pieces = [c for p in pieces for c in _chunks(p)]
        parts: list[list[int] | None] = []
        # Long prompts are encoded in worker threads, short ones on the event loop: one cache.
        with self._lock:
            for p in pieces:
                hit = cache.get(p) if len(p) >= MIN_CACHED_PIECE else None
                if hit is not None:
                    cache.move_to_end(p)
                else:
                    misses.append((len(parts), p))
                parts.append(hit)
        if misses:
            encoded = self.tokenizer.encode_batch([p for _, p in misses], add_special_tokens=False)
            with self._lock:
                for (i, p), enc in zip(misses, encoded, strict=True):
                    ids = list(enc.ids)
                    parts[i] = ids
                    if len(p) >= MIN_CACHED_PIECE:
                        self._remember(p, ids)
        before, after = self._wrap if special and self._wrap is not None else ((), ())
        out = list(before)
        for part in parts:
            out += part or ()
        out += after
        return out

    def _remember(self, piece: str, ids: list[int]) -> None:
        cache = self._cache
        if piece in cache:
            return
        cache[piece] = ids
        self._cached_tokens += len(ids)
        while self._cached_tokens > MAX_CACHED_TOKENS and cache:
            _, old = cache.popitem(last=False)
            self._cached_tokens -= len(old)

    def tokens(self, payload: dict[str, Any], limit: int = 1 << 24) -> list[int] | None:
        """The prompt's ids; of a text past `limit` characters, those of its first `limit`
        characters less the last 16 ids (the cut may have split a token)."""
        if "messages" in payload:
            text = self.render(payload)
            special = False
        else:
            prompt = payload.get("prompt")
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return list(prompt)
            text = prompt if isinstance(prompt, str) else None
            special = True
        if text is None:
            return None
        if len(text) <= limit:
            return self.encode(text, special)
        return self.encode(text[:limit], special)[:-16]


def _chunks(piece: str) -> list[str]:
    """`piece` cut at the first safe point (a space between two letters) from CHUNK to
    2 x CHUNK characters past the last cut; with none there, the rest is one piece (a text
    without such points, digits or CJK, costs a scan of 2 x CHUNK, not of all of it). Each cut
    depends only on the text before it and shortly after, so two prompts sharing a prefix share
    its chunks up to the last cut before they differ."""
    if len(piece) < 2 * CHUNK:
        return [piece]
    out: list[str] = []
    start = 0
    search = _SAFE.search
    while True:
        end = start + 2 * CHUNK
        m = search(piece, start + CHUNK, end)
        # `[^\W\d_]` takes in numerals (Roman ones, superscripts) that are not \p{L}.
        while m is not None and not (
            piece[m.start() - 1].isalpha() and piece[m.start() + 1].isalpha()
        ):
            m = search(piece, m.start() + 1, end)
        if m is None:
            break
        out.append(piece[start : m.start()])
        start = m.start()
    out.append(piece[start:])
    return out


def _message(m: dict[str, Any], openai_content: bool) -> dict[str, Any]:
    """One message as vLLM hands it to the template: role, content (a list of text parts for a
    template that loops over content, else the parts' text joined by newlines), and only the
    keys vLLM keeps (assistant `tool_calls` with parsed arguments, a tool's `tool_call_id`,
    `name`, `reasoning`)."""
    role = m.get("role")
    content = m.get("content")
    parts: list[Any]
    if content is None:
        parts = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        parts = [content]
    texts = [
        p["text"] if isinstance(p, dict) else p
        for p in parts
        if isinstance(p, str) or (isinstance(p, dict) and isinstance(p.get("text"), str))
    ]
    out: dict[str, Any] = {"role": role}
    if openai_content:
        wrapped = [{"type": "text", "text": t} for t in texts]
        out["content"] = "\n".join(texts) if role == "tool" else wrapped
    else:
        out["content"] = "\n".join(texts)
    calls = m.get("tool_calls")
    if role == "assistant" and isinstance(calls, list) and calls:
        fixed = []
        for c in calls:
            c = dict(c) if isinstance(c, dict) else c
            fn = c.get("function") if isinstance(c, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                fn = dict(fn)
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
                c["function"] = fn
            fixed.append(c)
        out["tool_calls"] = fixed
    if role == "assistant" and m.get("reasoning") is not None:
        out["reasoning"] = out["reasoning_content"] = m["reasoning"]
    if role == "tool" and "tool_call_id" in m:
        out["tool_call_id"] = m["tool_call_id"]
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if role == "developer":
        out["tools"] = m.get("tools")
    return out


def _as_system(m: dict[str, Any]) -> dict[str, Any]:
    if m.get("role") != "developer":
        return m
    out = {**m, "role": "system"}
    out.pop("tools", None)
    return out


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(
            p["text"] if isinstance(p, dict) else p
            for p in content
            if isinstance(p, str) or (isinstance(p, dict) and isinstance(p.get("text"), str))
        )
    return content if isinstance(content, str) else ""


def _merge_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's consolidation after developer -> system: every system message's text (parts
    joined by newlines) in one string-content system message first."""
    systems = [m for m in conv if m.get("role") == "system"]
    if len(systems) <= 1 and (not systems or conv[0] is systems[0]):
        return conv
    texts = [t for m in systems if (t := _text(m.get("content")))]
    merged = {"role": "system", "content": "\n\n".join(texts)}
    return [merged, *(m for m in conv if m.get("role") != "system")]


class EngineTokenizer:
    """The backend's own `/tokenize`: exact, one round trip, over the backend's traffic pool
    (router/upstream/pools.py: its TLS policy and limits), bounded by `timeout` and
    `MAX_TOKENIZE_BODY`."""

    def __init__(self, pools: Pools | None = None, timeout: float = 2.0) -> None:
        self._pools = pools if pools is not None else Pools(Timeouts(), PoolLimits())
        self._timeout = timeout

    async def tokens(
        self, payload: dict[str, Any], backend: Backend, model: str, limit: int = 1 << 24
    ) -> list[int] | None:
        if prompt_chars(payload) > limit:
            return None  # not worth a round trip carrying the whole prompt again
        body: dict[str, Any] = {"model": model}
        for key in (
            "messages",
            "prompt",
            "tools",
            "chat_template_kwargs",
            "add_generation_prompt",
            "continue_final_message",
        ):
            if key in payload:
                body[key] = payload[key]
        headers = [(b"content-type", b"application/json"), *backend.auth_headers]
        try:
            data = json.dumps(body).encode()
            transport, request = self._pools.request(backend, "/tokenize", headers, data)
            answer = bytearray()
            async with asyncio.timeout(self._timeout):
                r = await transport.send(request)
                try:
                    if r.status_code != 200:
                        return None
                    async for chunk in r.aiter_raw():
                        answer += chunk
                        if len(answer) > MAX_TOKENIZE_BODY:
                            return None
                finally:
                    await r.aclose()
            ids = json.loads(answer).get("tokens")
        except (TimeoutError, httpx.HTTPError, ValueError, TypeError, AttributeError):
            return None
        return ids if isinstance(ids, list) and all(type(t) is int for t in ids) else None


# A /tokenize answer is read up to this (about 2 M token ids); a longer one is not used.
MAX_TOKENIZE_BODY = 16 * 1024 * 1024


async def request_tokens(
    tokenizer: RouterTokenizer, payload: dict[str, Any], inline_chars: int, limit: int
) -> list[int] | None:
    """The router tokenizer's answer, in a worker thread when the prompt is long."""
    if prompt_chars(payload) <= inline_chars:
        return tokenizer.tokens(payload, limit)
    return await asyncio.to_thread(tokenizer.tokens, payload, limit)


def prompt_chars(payload: dict[str, Any]) -> int:
    """A prompt's characters of text, as the size guards need them: a message's content as a
    string or as a list of parts (each text part's length, OTHER_PART for any other part, as
    for a content of another kind), its `reasoning` and its tool calls' `arguments`; a
    completion prompt's text, ids, or every prompt of a batch. One pass over the messages and
    their parts (what the JSON parse already walked), no copy."""
    messages = payload.get("messages")
    if isinstance(messages, list):
        return sum(_message_chars(m) for m in messages)
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        if not prompt or type(prompt[0]) is int:
            return len(prompt)  # token ids: about a character each at the least
        return sum(len(p) if isinstance(p, str | list) else OTHER_PART for p in prompt)
    return 0


# What a content part that is not text (an image, audio), or a content of another kind, counts.
OTHER_PART = 256


def _message_chars(m: Any) -> int:
    if not isinstance(m, dict):
        return OTHER_PART
    content = m.get("content")
    if isinstance(content, str):
        n = len(content)
    elif isinstance(content, list):
        n = 0
        for p in content:
            if isinstance(p, str):
                n += len(p)
            elif isinstance(p, dict) and isinstance(text := p.get("text"), str):
                n += len(text)
            else:
                n += OTHER_PART
    else:
        n = 0 if content is None else OTHER_PART
    reasoning = m.get("reasoning")
    if isinstance(reasoning, str):
        n += len(reasoning)
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        for c in calls:
            fn = c.get("function") if isinstance(c, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            n += len(args) if isinstance(args, str) else OTHER_PART
    return n
