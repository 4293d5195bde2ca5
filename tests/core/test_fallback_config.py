"""The fallback chains' configuration (router/core/settings.py): LiteLLM's three keys in both its
shapes load unchanged for models that exist; an unknown model, a model falling back to itself
and a cycle stop startup with one line that names them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from router.core.settings import ConfigError, load_settings
from router.request.placement.fallbacks import Fallbacks

BACKENDS = [
    {"name": "a", "url": "http://a.invalid", "models": ["llama-70b", "llama-8b"]},
    {"name": "b", "url": "http://b.invalid", "models": ["llama-8b-128k", "gpt-4o-mini"]},
]


def load(tmp_path: Path, **config: object) -> Fallbacks:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"backends": BACKENDS, **config}, sort_keys=False))
    return Fallbacks(load_settings(path))


def test_the_issues_mapping_form_loads(tmp_path: Path) -> None:
    chains = load(
        tmp_path,
        fallbacks={"llama-70b": ["gpt-4o-mini"]},
        context_window_fallbacks={"llama-8b": ["llama-8b-128k"]},
        content_policy_fallbacks={"llama-8b": ["gpt-4o-mini"]},
    ).chains
    assert chains["llama-70b"].error is not None
    assert chains["llama-70b"].error.models == ["gpt-4o-mini"]
    assert chains["llama-70b"].error.mid_stream == "continue"  # the default
    assert chains["llama-8b"].context_window is not None
    assert chains["llama-8b"].context_window.models == ["llama-8b-128k"]
    assert chains["llama-8b"].content_policy is not None


def test_litellms_list_of_mappings_loads_unchanged(tmp_path: Path) -> None:
    text = (
        'fallbacks: [{"llama-70b": ["gpt-4o-mini"]}, {"llama-8b": ["gpt-4o-mini"]}]\n'
        'context_window_fallbacks: [{"llama-8b": ["llama-8b-128k"]}]\n'
        'content_policy_fallbacks: [{"llama-8b": ["gpt-4o-mini"]}]\n'
    )
    path = tmp_path / "litellm.yaml"
    path.write_text(yaml.safe_dump({"backends": BACKENDS}) + text)
    chains = Fallbacks(load_settings(path)).chains
    assert set(chains) == {"llama-70b", "llama-8b"}
    assert chains["llama-8b"].context_window is not None


def test_a_chain_may_say_what_happens_mid_stream(tmp_path: Path) -> None:
    chains = load(
        tmp_path, fallbacks={"llama-70b": {"models": ["gpt-4o-mini"], "mid_stream": "error"}}
    ).chains
    assert chains["llama-70b"].error is not None
    assert chains["llama-70b"].error.mid_stream == "error"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"fallbacks": {"llama-70b": ["gpt-5"]}},
            "fallbacks: 'gpt-5' is a model no backend serves",
        ),
        (
            {"context_window_fallbacks": {"nope": ["llama-8b"]}},
            "context_window_fallbacks: 'nope' is a model no backend serves",
        ),
        (
            {"fallbacks": {"llama-8b": ["llama-8b"]}},
            "fallbacks: 'llama-8b' falls back to itself",
        ),
        (
            {
                "fallbacks": {
                    "llama-70b": ["llama-8b"],
                    "llama-8b": ["gpt-4o-mini"],
                    "gpt-4o-mini": ["llama-70b"],
                }
            },
            "fallbacks: a cycle: llama-70b -> llama-8b -> gpt-4o-mini -> llama-70b",
        ),
        (
            {"fallbacks": [{"llama-70b": ["llama-8b"]}, {"llama-70b": ["gpt-4o-mini"]}]},
            "'llama-70b' is given twice",
        ),
        ({"fallbacks": {"llama-70b": []}}, "fallbacks.llama-70b.models"),
    ],
)
def test_what_cannot_start_is_named(
    tmp_path: Path, config: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, **config)
    assert message in str(caught.value)


def test_a_chain_between_api_formats_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    backends = [
        {"name": "c", "url": "http://c.invalid", "models": ["claude"], "kind": "anthropic"},
        {"name": "o", "url": "http://o.invalid", "models": ["gpt-4o-mini"], "kind": "openai"},
        {"name": "v", "url": "http://v.invalid", "models": ["llama-8b"]},
    ]
    ok = {"backends": backends, "fallbacks": {"llama-8b": ["gpt-4o-mini", "claude"]}}
    path.write_text(yaml.safe_dump(ok))
    assert "llama-8b" in Fallbacks(load_settings(path)).chains  # vLLM serves both formats
    path.write_text(
        yaml.safe_dump({"backends": backends, "fallbacks": {"claude": ["gpt-4o-mini"]}})
    )
    with pytest.raises(ConfigError, match="'gpt-4o-mini' cannot serve 'claude''s requests"):
        load_settings(path)


def test_discovery_declares_its_models(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    config = {
        "discovery": [
            {"kind": "dns", "name": "vllm.svc", "port": 8000, "models": {"llama-70b": "x"}},
            {"kind": "dns", "name": "cloud.svc", "port": 8000, "models_allow": ["gpt-*"]},
        ],
        "fallbacks": {"llama-70b": ["gpt-4o-mini"]},
    }
    path.write_text(yaml.safe_dump(config))
    assert "llama-70b" in Fallbacks(load_settings(path)).chains
    path.write_text(yaml.safe_dump({**config, "fallbacks": {"llama-70b": ["claude"]}}))
    with pytest.raises(ConfigError, match="'claude' is a model no backend serves"):
        load_settings(path)


def test_a_key_entry_turns_fallbacks_off(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    keys = [{"sha256": "a" * 64, "fallbacks": False}, {"sha256": "b" * 64}]
    path.write_text(yaml.safe_dump({"backends": BACKENDS, "api_keys": keys}))
    settings = load_settings(path)
    assert [k.fallbacks for k in settings.api_keys] == [False, True]


def test_no_chain_is_no_route(tmp_path: Path) -> None:
    fallbacks = load(tmp_path, fallbacks={"llama-70b": ["gpt-4o-mini"]})
    assert fallbacks.route("llama-8b", None, None) is None  # a model without chains
    assert fallbacks.route("llama-70b", None, []) is None  # the body's `"fallbacks": []`
    route = fallbacks.route("llama-70b", None, None)
    assert route is not None and route.origin == "llama-70b"
