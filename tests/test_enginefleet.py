"""The engine fleet's parts that need no engine: the model writer and the venv's reuse.

(The engines themselves are started by the engine tier, `make test-engine`.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.enginefleet import install
from router.enginefleet.fleet import Engine, EngineOptions
from router.enginefleet.model import MODEL_VERSION, corpus, write_model


def test_the_model_is_written_the_same_every_time(tmp_path: Path) -> None:
    a, b = write_model(tmp_path / "a"), write_model(tmp_path / "b")
    assert a.name == MODEL_VERSION
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert write_model(tmp_path / "a") == a  # a written one is reused as it is
    assert corpus(1000) == corpus(1000) != corpus(1000, seed=1)


def test_the_tokenizer_fits_the_model_and_has_a_chat_template(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    model = write_model(tmp_path)
    config = json.loads((model / "config.json").read_text())
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert tok.get_vocab_size() == config["vocab_size"]
    tconf = json.loads((model / "tokenizer_config.json").read_text())
    assert tok.token_to_id(tconf["eos_token"]) == config["eos_token_id"]
    assert "<|start_header_id|>" in tconf["chat_template"]
    ids = tok.encode("the router streams tokens").ids
    assert tok.decode(ids) == "the router streams tokens"


def test_a_stamped_venv_is_reused_without_installing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = install.venv_python(tmp_path)
    python.parent.mkdir(parents=True)
    python.touch()
    install.stamp(tmp_path).touch()
    monkeypatch.setattr(install, "_run", lambda args: pytest.fail(f"ran {args}"))
    assert install.ensure_venv(tmp_path) == python


def test_engines_run_on_loopback_with_the_tier_s_settings(tmp_path: Path) -> None:
    e = Engine(1, Path("python"), tmp_path, tmp_path, EngineOptions(kv_blocks=24))
    args = e.args()
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert args[args.index("--num-gpu-blocks-override") + 1] == "24"
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details"):
        assert flag in args
    events = json.loads(args[args.index("--kv-events-config") + 1])
    assert events["endpoint"] == e.kv_events_endpoint and events["endpoint"].startswith("ipc://")
    assert e.env()["VLLM_NO_USAGE_STATS"] == "1"
