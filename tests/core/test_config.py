"""A bad config stops startup with one line naming the file and the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from router.core.settings import ConfigError, load_settings
from tests.support.harness import ROOT


def run_serve(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("backends:\n  - name: a\n    models: [m]\n", "backends[0](a).url"),
        ("backends:\n  - name: a\n    url: ftp://x\n    models: [m]\n", "backends[0](a).url"),
        ("backends:\n  - name: a\n    url: http://x\n    models: []\n", "backends[0](a).models"),
        (
            "backends:\n  - name: a\n    url: http://x\n    models: [m]\n    colour: red\n",
            "backends[0](a).colour",
        ),
        ("timeouts: {connect: -1}\n", "timeouts.connect"),
        ("backends: [\n", "line"),
        ("- just a list\n", "top level"),
    ],
)
def test_bad_config_exits_with_a_clear_message(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = run_serve(path)
    assert result.returncode == 2
    err = result.stderr.strip().splitlines()
    assert len(err) == 1, result.stderr
    assert str(path) in err[0] and field in err[0], err[0]
    assert "Traceback" not in result.stderr


def test_missing_file_is_reported(tmp_path: Path) -> None:
    result = run_serve(tmp_path / "nope.yaml")
    assert result.returncode == 2 and "nope.yaml" in result.stderr


def test_models_list_or_map_and_env_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(
        "port: 9000\nbackends:\n"
        "  - {name: a, url: 'http://a:8000/', models: [x, y]}\n"
        "  - {name: b, url: 'https://b', kind: openai, models: {pub: real}, api_key_env: KEY_B}\n"
    )
    monkeypatch.setenv("SLUICEGATE_PORT", "9100")
    monkeypatch.setenv("KEY_B", "sk-secret")
    s = load_settings(path)
    assert s.port == 9100
    assert s.backends[0].models == {"x": "x", "y": "y"}
    assert s.backends[0].url == "http://a:8000"
    assert s.backends[1].models == {"pub": "real"}
    assert s.backends[1].resolved_key() == "sk-secret"
    assert "sk-secret" not in repr(s)


def test_duplicate_names_rejected(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text(
        "backends:\n  - {name: a, url: 'http://a', models: [x]}\n"
        "  - {name: a, url: 'http://b', models: [y]}\n"
    )
    with pytest.raises(ConfigError, match="duplicate backend name"):
        load_settings(path)
