"""docs/configuration.md against the settings model: every key of Settings and of each model nested
in it has its row (type, default, limits, description), and the committed page is what the model
says today (`make docs` rewrites it)."""

from __future__ import annotations

import typing

from pydantic import BaseModel, Field

from router.core import settings as s
from router.tools import settings_doc as doc


def _paths(model: type[BaseModel], seen: set[type[BaseModel]]) -> list[tuple[str, str]]:
    """(model name, key) of every field reachable from `model`, walked independently of the
    generator, so a section or a row the generator skipped is noticed."""
    out: list[tuple[str, str]] = []
    if model in seen:
        return out
    seen.add(model)
    for name, field in model.model_fields.items():
        out.append((model.__name__, name))
        stack = [field.annotation]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                out += _paths(t, seen)
            else:
                stack += list(typing.get_args(t))
    return out


def test_the_committed_page_is_the_models_page() -> None:
    page = doc.PAGE.read_text(encoding="utf-8")
    assert doc.problems(page) == [], "docs/configuration.md is stale: run `make docs`"
    assert page == doc.render()


def test_every_setting_has_a_row_with_a_description() -> None:
    page = doc.PAGE.read_text(encoding="utf-8")
    by_model = {sec.model.__name__: sec for sec in doc.sections()}
    keys = _paths(s.Settings, set())
    assert len(keys) > 150  # every nested model was walked, not just the top level
    for model, key in keys:
        sec = by_model[model]
        rows = {r.key: r for r in sec.rows}
        assert key in rows, f"{sec.path}: {key} has no row"
        assert rows[key].description.strip(" ."), f"{sec.path}: {key} has no description"
        assert f"| `{key}` |" in page.split(f"## {sec.path}\n", 1)[1].split("\n## ", 1)[0]
    # Settings the old README's YAML block missed are there, with their defaults.
    top = {r.key: r for r in by_model["Settings"].rows}
    assert top["redis_prefix"].default == '`"sluicegate"`'
    assert top["max_error_body_bytes"].default == "`65536`"
    assert top["port"].limits == ">= 0, <= 65_535"


class _Grown(s.Settings):
    brand_new: int = Field(7, ge=1, description="a setting added after the page was written")


class _Renamed(s.Settings):
    drain_grace: float = Field(45.0, ge=0, description="seconds streams may take on SIGTERM")


def test_a_missing_or_stale_setting_is_named() -> None:
    page = doc.render()
    assert doc.problems(page) == []
    assert doc.problems(page, _Grown) == ["top level: `brand_new` missing"]
    assert doc.problems(page, _Renamed) == ["top level: `drain_grace` stale"]
    row = "| `drain_grace` | number | "
    hand_edited = page.replace(row + "`30.0`", row + "`60`")
    assert hand_edited != page
    assert doc.problems(hand_edited) == ["top level: `drain_grace` stale"]


def test_a_setting_without_any_description_stops_the_generator() -> None:
    class Bare(BaseModel):
        undocumented: int = 1

    try:
        doc.render(Bare)
    except LookupError as exc:
        assert "Bare.undocumented" in str(exc)
    else:
        raise AssertionError("a setting without a description was rendered")


def test_check_mode_exit_codes(capsys: typing.Any) -> None:
    assert doc.main(["--check"]) == 0
    assert doc.main(["--bogus"]) == 2
    capsys.readouterr()
