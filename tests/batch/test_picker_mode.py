"""The endpoint picker (`sluicegate epp`) runs no batch jobs: it sends nothing itself (the gateway
does), so a job submitted through a proxy replica sharing its Redis is run by the proxy replicas
alone, and the picker with `batch:` configured takes no line."""

from __future__ import annotations

from pathlib import Path

import yaml

from router.app import create_app
from router.core.settings import load_settings


def test_the_endpoint_picker_takes_no_batch_line_where_a_proxy_replica_does(
    tmp_path: Path,
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "backends": [{"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]}],
                "redis_url": "redis://127.0.0.1:9",  # never reached: nothing is started
                "batch": {"storage_dir": str(tmp_path / "batch")},
            }
        )
    )
    settings = load_settings(config)
    picker = create_app(settings, proxy_routes=False, tune_gc=False).parts  # as `epp` builds it
    proxy = create_app(settings, tune_gc=False).parts
    assert picker.batch is None
    assert "batch" not in {c.name for c in picker.runner.stats()}
    assert proxy.batch is not None
    assert "batch" in {c.name for c in proxy.runner.stats()}
