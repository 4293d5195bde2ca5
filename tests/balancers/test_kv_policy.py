"""`cache_aware` on KV-event holdings: the exchange rate between cached tokens and running
requests comes from each engine's own rates; reasons say whether the holding was exact; pending
dispatches spread a burst; the rates are learned from the engine's histograms; the router's
tokenizer gives the same ids with and without its piece cache."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from balancers.base import Candidate
from balancers.cache_aware import DEFAULT_PREFILL_S_PER_TOKEN, CacheAware, Hints, KvHints
from balancers.context import PickContext
from router.core.engine import EngineReading
from router.engine.calibrate import ALPHA, Calibration
from router.request.placement.tokens import GIL_FREE_CHARS, RouterTokenizer
from tests.support.picking import Bound
from tests.support.tiny_tokenizer import write_tokenizer


def reading(running: float, p: float | None = None, q: float | None = None) -> EngineReading:
    return EngineReading(
        0.0, running, 0.1, 100_000, 0.0, 1.0, 1, prefill_s_per_token=p, step_s_per_seq=q
    )


def pick(cands: list[Candidate], kv: KvHints) -> tuple[str, str]:
    bal = Bound(
        CacheAware(random.Random(1)),
        PickContext(hints=Hints(8, 256, {}, None, kv), load_factor=1.25),
    )
    chosen = bal.pick(cands)
    assert chosen is not None
    return chosen.candidate.name, chosen.reason


def test_the_engines_rates_set_the_exchange_rate() -> None:
    kv = KvHints(2048, {"a": 2048}, frozenset({"a", "b"}))
    # A GPU-like engine: prefill dear (1 ms / 1k tokens... x 100), decode contention cheap.
    gpu = [
        Candidate("a", 1.0, 6, reading(6, p=100e-6, q=0.2e-3)),
        Candidate("b", 1.0, 0, reading(0, p=100e-6, q=0.2e-3)),
    ]
    assert pick(gpu, kv) == ("a", "prefix_exact")
    # A CPU-like engine: prefill cheap, every running sequence slows the step a lot.
    cpu = [
        Candidate("a", 1.0, 6, reading(6, p=2e-6, q=5e-3)),
        Candidate("b", 1.0, 0, reading(0, p=2e-6, q=5e-3)),
    ]
    assert pick(cpu, kv) == ("b", "spill")


def test_reasons_say_exact_or_approximate() -> None:
    cands = [Candidate("a", 1.0, 0, reading(0)), Candidate("b", 1.0, 0, reading(0))]
    assert pick(cands, KvHints(1024, {"a": 896}, frozenset({"a", "b"}))) == ("a", "prefix_exact")
    assert pick(cands, KvHints(1024, {"b": 896}, frozenset({"a"}))) == ("b", "prefix_approx")


def test_pending_dispatches_spread_a_burst() -> None:
    cands = [Candidate("a", 1.0, 0, reading(0)), Candidate("b", 1.0, 0, reading(0))]
    cached = {"a": 256, "b": 256}
    assert pick(cands, KvHints(4096, cached, frozenset({"a", "b"}), {"a": 8000}))[0] == "b"
    assert pick(cands, KvHints(4096, cached, frozenset({"a", "b"}), {"b": 8000}))[0] == "a"


def test_pending_prefills_count_what_is_left_of_them() -> None:
    """A prompt whose first request still prefills on `a` (it counts as held there): the second
    waits for the rest of that prefill rather than computing it all again on an idle `b`."""
    p, q = 130e-6, 4e-3  # the real CPU engines' rates
    cands = [
        Candidate("a", 1.0, 1, reading(0, p=p, q=q)),
        Candidate("b", 1.0, 0, reading(0, p=p, q=q)),
    ]
    names = frozenset({"a", "b"})

    def second(age: float) -> tuple[str, str]:
        return pick(cands, KvHints(1088, {"a": 1024}, names, {"a": 1088}, {}, {"a": age}))

    # Sent just now, a copy on b would cost what waiting does, and evict as much there.
    assert second(0.0) == ("a", "prefix_exact")
    assert second(0.05) == ("a", "prefix_exact")
    # With room in b's cache (its events say so) the copy evicts nothing: the two cost the
    # same and b's empty batch decides.
    roomy = KvHints(1088, {"a": 1024}, names, {"a": 1088}, {"b": 0}, {"a": 0.0})
    assert pick(cands, roomy) == ("b", "spill")
    # Hits answered on the holder are no longer pending: an idle holder with the prompt wins.
    assert pick(cands, KvHints(1088, {"a": 1024}, names)) == ("a", "prefix_exact")


def test_a_new_home_goes_where_the_cache_has_room() -> None:
    """No candidate holds the prompt: the engines whose free KV takes it without evicting, at
    least half as often as the roomiest, win over a less loaded one whose cache is full (a
    restarted engine, emptied, against engines that took on its customers), load deciding
    among them; a queue there, or every cache full, leaves it to load."""

    def engine(running: float, waiting: float = 0.0) -> EngineReading:
        return EngineReading(waiting, running, 0.05 * running, 8000, 0.0, 1.0, 1)

    def cands(b_waiting: float = 0.0) -> list[Candidate]:
        return [
            Candidate("a", 1.0, 0, engine(0)),  # least loaded; its cache is full
            Candidate("b", 1.0, 2, engine(2, b_waiting)),  # restarted: its cache is empty
            Candidate("c", 1.0, 1, engine(1)),  # room for one prompt more
        ]

    names = frozenset({"a", "b", "c"})
    kv = KvHints(1500, {}, names, {}, {"a": 8000, "b": 0, "c": 6000})
    assert pick(cands(), kv) == ("b", "load")  # room for 5 prompts against c's 1
    # Room for 3 and 2: both ample, and the less loaded takes it.
    both = KvHints(1500, {}, names, {}, {"a": 8000, "b": 3500, "c": 5000})
    assert pick(cands(), both) == ("c", "load")
    assert pick(cands(b_waiting=1), kv)[0] == "c"  # b queues: the next with room
    # Tokens sent since their last event count as stored: c's room is taken.
    taken = KvHints(1500, {}, names, {"c": 1500}, kv.stored)
    assert pick(cands(b_waiting=1), taken)[0] == "a"  # nobody with room is free of a queue
    full = KvHints(1500, {}, names, {}, {"a": 8000, "b": 7000, "c": 8000})
    assert pick(cands(), full)[0] == "a"  # every cache would evict: least load
    unknown = KvHints(1500, {}, frozenset({"a", "c"}), {}, {"a": 8000, "c": 6000})
    assert pick(cands(), unknown)[0] == "a"  # b's events are not live: no room to weigh


def test_with_every_cache_full_a_new_home_goes_where_it_evicts_least() -> None:
    """Every cache would evict: the prompt goes where blocks stay longest (hidden clients flood
    `a`, the least loaded: a prompt placed there is soon evicted again), load deciding among
    those evicting alike; with no eviction rate known, load alone."""

    def engine(running: float) -> EngineReading:
        return EngineReading(0.0, running, 0.05 * running, 8000, 0.0, 1.0, 1)

    cands = [
        Candidate("a", 1.0, 0, engine(0)),
        Candidate("b", 1.0, 2, engine(2)),
        Candidate("c", 1.0, 1, engine(1)),
    ]
    names = frozenset({"a", "b", "c"})
    full = {"a": 8000, "b": 8000, "c": 8000}

    def churn(rates: dict[str, float]) -> KvHints:
        return KvHints(1500, {}, names, {}, full, {}, rates)

    assert pick(cands, churn({"a": 40.0, "b": 0.8})) == ("c", "load")  # b and c: alike
    assert pick(cands, churn({"a": 40.0, "b": 1.5, "c": 9.0}))[0] == "b"
    assert pick(cands, churn({}))[0] == "a"


def test_rates_are_learned_from_the_histograms() -> None:
    cal = Calibration()
    base = {
        "prefill_s": 1.0,
        "prompt_tokens": 10_000,
        "cached_tokens": 2_000,
        "itl_s": 2.0,
        "itl_n": 100,
    }
    cal.update(base, running=4)
    assert cal.prefill_s_per_token is None and cal.step_s_per_seq is None  # one point: no rate
    later = {
        "prefill_s": 1.5,
        "prompt_tokens": 22_000,
        "cached_tokens": 4_000,
        "itl_s": 2.8,
        "itl_n": 140,
    }
    cal.update(later, running=4)
    assert (
        cal.prefill_s_per_token is not None and abs(cal.prefill_s_per_token - 0.5 / 10_000) < 1e-9
    )
    assert cal.step_s_per_seq is not None and abs(cal.step_s_per_seq - 0.02 / 4) < 1e-9
    cal.update({k: v / 10 for k, v in later.items()}, running=1)  # the engine restarted
    assert abs(cal.prefill_s_per_token - 0.5 / 10_000) < 1e-9  # a window over, nothing learned


def test_a_prefill_rate_is_learned_from_scrapes_too_small_alone() -> None:
    """An engine whose prompts mostly hit computes few tokens between two scrapes, and its
    histogram may count a request's prefill time a scrape after its tokens: the window stays
    open until MIN_TOKENS were computed, then the rate is the whole window's."""
    cal = Calibration()
    c = {"prefill_s": 0.0, "prompt_tokens": 0.0, "cached_tokens": 0.0, "itl_s": 0.0, "itl_n": 0.0}
    cal.update(dict(c), running=1)
    for tokens, cached, secs in ((1100, 1000, 0.0), (1100, 1000, 0.0), (1100, 800, 0.0)):
        c = {**c, "prompt_tokens": c["prompt_tokens"] + tokens}
        c = {**c, "cached_tokens": c["cached_tokens"] + cached, "prefill_s": c["prefill_s"] + secs}
        cal.update(dict(c), running=1)
        assert cal.prefill_s_per_token is None  # 100, 200, then 500 computed: below MIN_TOKENS
    c = {
        **c,
        "prompt_tokens": c["prompt_tokens"] + 1100,
        "cached_tokens": c["cached_tokens"] + 1000,
    }
    c = {**c, "prefill_s": c["prefill_s"] + 0.06}  # the window's prefill time, counted late
    cal.update(dict(c), running=1)
    assert cal.prefill_s_per_token is not None
    assert abs(cal.prefill_s_per_token - 0.06 / 600) < 1e-12
    # The next window starts there: its own 600 tokens at twice the time each.
    c = {**c, "prompt_tokens": c["prompt_tokens"] + 600, "prefill_s": c["prefill_s"] + 0.12}
    cal.update(dict(c), running=1)
    assert abs(cal.prefill_s_per_token - (0.06 / 600 + ALPHA * (0.12 / 600 - 0.06 / 600))) < 1e-12


def test_piece_cache_gives_the_same_ids(tmp_path: Path) -> None:
    from router.request.placement.tokens import RouterTokenizer
    from tests.support.tiny_tokenizer import write_tokenizer

    tk = RouterTokenizer(str(write_tokenizer(tmp_path)))
    doc = "def add(a, b):\n    return a + b  # sum\n" * 80
    chat = {"messages": [{"role": "system", "content": doc}, {"role": "user", "content": "hi é"}]}
    text = tk.render(chat)
    assert text is not None and text.startswith("<|begin_of_text|><|start_header_id|>system")
    plain = list(tk.tokenizer.encode(text, add_special_tokens=False).ids)
    assert tk.tokens(chat) == plain  # cold: pieces encoded
    assert tk.tokens(chat) == plain  # warm: pieces from the cache
    assert tk.tokens({"prompt": "hello"}) == list(tk.tokenizer.encode("hello").ids)
    # A long completion prompt goes through the GIL-releasing batch call: the same ids.
    long = doc * 2
    assert len(long) > GIL_FREE_CHARS
    assert tk.tokens({"prompt": long}) == list(tk.tokenizer.encode(long).ids)
    assert tk.tokens({"prompt": [5, 6, 7]}) == [5, 6, 7]
    cut = tk.tokens(chat, limit=200)
    assert cut is not None and plain[: len(cut)] == cut and len(cut) < len(plain)


@pytest.mark.parametrize("kind", ["gpt2", "llama3", "metaspace", "none"])
def test_long_prompts_sharing_a_prefix_encode_as_a_whole(tmp_path: Path, kind: str) -> None:
    """Prompts that share a long prefix, encoded in chunks (the shared ones from the cache),
    give exactly the ids of encoding each whole, chat and completion, for every kind of
    pre-tokenizer; one whose merges cross spaces is not chunked at all, and one that marks
    the start of every piece (SentencePiece's metaspace) not split at all."""
    import random

    from router.request.placement import tokens
    from tests.support.tiny_tokenizer import write_tokenizer

    rng = random.Random(kind)
    alphabet = (
        "abc d\u00e9f  ghi\n\tj,k. 12 345 \u00c9\u00c0 \u65e5\u672c ' s'll x_y \u00b2 \u216b  "
    )
    words = ["def", "return", "class", "value", "index", "cache", "it's", "we'll", "2026"]

    def text(n: int) -> str:
        if rng.random() < 0.5:
            return "".join(rng.choice(alphabet) for _ in range(n))
        return " ".join(rng.choice(words) for _ in range(n // 5))

    corpus = [tokens._PROBE * 4, *(text(400) for _ in range(50))] if kind == "none" else None
    tk = RouterTokenizer(str(write_tokenizer(tmp_path, kind=kind, corpus=corpus)))
    assert tk._chunked == (kind in ("gpt2", "llama3"))
    assert (tk._split is None) == (kind == "metaspace")
    prefix = text(5 * tokens.CHUNK)
    for _ in range(6):
        prompt = prefix + text(rng.randrange(10, 3 * tokens.CHUNK))
        assert tk.tokens({"prompt": prompt}) == list(tk.tokenizer.encode(prompt).ids)
        chat = {
            "messages": [{"role": "system", "content": prompt}, {"role": "user", "content": "hi"}]
        }
        rendered = tk.render(chat)
        assert rendered is not None
        whole = list(tk.tokenizer.encode(rendered, add_special_tokens=False).ids)
        assert tk.tokens(chat) == whole
    if tk._chunked:  # the shared prefix's chunks were reused, not encoded again
        assert any(len(piece) >= tokens.CHUNK and prefix.startswith(piece) for piece in tk._cache)


def test_developer_and_several_system_messages_render_as_vllm_does(tmp_path: Path) -> None:
    tk = RouterTokenizer(str(write_tokenizer(tmp_path)))
    text = tk.render(
        {
            "messages": [
                {"role": "system", "content": "one"},
                {"role": "system", "content": [{"type": "text", "text": "two"}]},
                {"role": "developer", "content": "three", "tools": [{"x": 1}]},
                {"role": "user", "content": "hi"},
            ]
        }
    )
    # The template loops over content parts, knows no `developer`: vLLM turns it into system
    # and merges every system text, in order, into the first message.
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\none\n\ntwo\n\nthree"
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_the_mocks_histograms_teach_its_own_rates() -> None:
    """The mock engine times prefill and decode steps in its histograms as vLLM does, so the
    router's calibration learns the mock's configured costs (never less: a busy host only
    stretches its sleeps), not a documented default."""
    import asyncio

    from router.engine.parse import parse
    from router.tools.mock.engine import Engine, EngineConfig

    prefill_ms_per_1k, decode_ms = 40.0, 5.0

    async def main() -> Calibration:
        engine = Engine(
            EngineConfig(prefill_ms_per_1k=prefill_ms_per_1k, decode_ms=decode_ms, block_size=16)
        )
        cal = Calibration()

        def scrape() -> None:
            p = parse(engine.metrics_text(), "vllm")
            cal.update(p.counters, p.running)

        scrape()
        seqs = [engine.submit(1000, 12) for _ in range(3)]
        async with asyncio.timeout(10):
            while not all(s.done for s in seqs):  # noqa: ASYNC110 (the step loop sets it)
                await asyncio.sleep(0.01)
        scrape()
        return cal

    cal = asyncio.run(main())
    assert cal.prefill_s_per_token is not None and cal.step_s_per_seq is not None
    # 3 prompts of 1000 tokens prefilled in one step: each waited for all 3000 tokens' prefill
    assert cal.prefill_s_per_token >= 3 * prefill_ms_per_1k / 1000 / 1000
    assert cal.step_s_per_seq >= decode_ms / 1000 / 3  # a step's time over the 3 running


def test_an_engine_never_taught_takes_its_peers_rates_not_the_default() -> None:
    """On 2 real CPU engines a prompt one of them held went to the other: the holder had learned
    a prefill rate ~10x the default (a small GPU's), the other had served nothing and was costed
    at the default, so its full prefill looked cheaper than the holder's short one. An engine
    with no rate of its own takes its peers'."""
    slow_p = 40 * DEFAULT_PREFILL_S_PER_TOKEN
    kv = KvHints(1300, {"holder": 1152}, frozenset({"holder", "fresh"}))
    cands = [
        Candidate("fresh", 1.0, 0, reading(0)),  # nothing learned yet
        Candidate("holder", 1.0, 0, reading(0, p=slow_p, q=5e-3)),
    ]
    assert pick(cands, kv) == ("holder", "prefix_exact")
    # Taught alike, the holder wins as well; taught faster by far, the fresh engine may win.
    cands[0] = Candidate("fresh", 1.0, 0, reading(0, p=slow_p, q=5e-3))
    assert pick(cands, kv) == ("holder", "prefix_exact")
    cands[0] = Candidate("fresh", 1.0, 0, reading(0, p=slow_p / 100, q=5e-3))
    assert pick(cands, kv) == ("fresh", "spill")
