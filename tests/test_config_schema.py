"""Configuration from one schema: a setting declared once (``lumen_core/config/schema.py``) is
the dataclass default, the parser's check, its error message and its docs row, and
docs/configuration.md's tables are exactly what the declarations give."""
from __future__ import annotations

import dataclasses
import pathlib

import pytest

from lumen_core import config
from lumen_core.config import batching as batching_mod
from lumen_core.config import docs
from lumen_core.config.schema import Reader, read_settings, setting, settings_of, settings_table

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


@dataclasses.dataclass
class Knobs(config.BatchingConfig):
    """[tasks.batching] with one setting more, declared the only way a setting is declared."""

    warmup_batches: int = setting(4, "batches run at start-up before the task is ready",
                                  lo=1, hi=8)


def _task(batching: dict) -> dict:
    return {"tasks": [{"name": "t", "backend": "onnx", "batching": batching}]}


def test_a_setting_declared_once_is_parsed_checked_and_documented(monkeypatch):
    with pytest.raises(config.ConfigError, match="warmup_batches: unknown key"):
        config.parse_config(_task({"warmup_batches": 2}), "lumen.toml")
    monkeypatch.setattr(batching_mod, "BatchingConfig", Knobs)
    # the parser: the value, the declared default, and the other keys as before
    cfg = config.parse_config(_task({"warmup_batches": 2, "max_batch_size": 8}), "lumen.toml")
    assert cfg.tasks[0].batching.warmup_batches == 2
    assert cfg.tasks[0].batching.max_batch_size == 8
    assert config.parse_config(_task({}), "lumen.toml").tasks[0].batching.warmup_batches == 4
    assert Knobs().warmup_batches == 4  # the dataclass default is the declared one
    # its error messages: the bounds, named by file and key
    for value, problem in ((9, "must be an integer <= 8, got 9"),
                           (0, "must be an integer >= 1, got 0"),
                           ("4", "must be an integer, got '4'")):
        with pytest.raises(config.ConfigError) as ei:
            config.parse_config(_task({"warmup_batches": value}), "lumen.toml")
        assert str(ei.value) == f"lumen.toml: tasks[0].batching.warmup_batches: {problem}"
    # its docs row, in the page's [tasks.batching] table
    row = ("| `warmup_batches` | integer | `4` | 1..8 | batches run at start-up before the task "
           "is ready |")
    assert row in settings_table(Knobs)
    page = docs.render(PAGE.read_text(encoding="utf-8"),
                       {**docs.TABLES, "tasks.batching": Knobs})
    block = page.split("<!-- settings:tasks.batching -->")[1].split("<!-- /settings")[0]
    assert row in block and "`loop_execution_us`" in block


def test_the_docs_tables_are_what_the_schema_gives():
    page = PAGE.read_text(encoding="utf-8")
    assert docs.render(page) == page, \
        "run: python -m lumen_core.config.docs --write docs/configuration.md"
    for cls in docs.TABLES.values():
        for s in settings_of(cls):
            assert f"| `{s.name}` |" in page, s.name


def test_the_check_command_finds_drift_and_write_mends_it(tmp_path, capsys):
    page = tmp_path / "configuration.md"
    text = PAGE.read_text(encoding="utf-8")
    page.write_text(text.replace("| `http_port` | integer | `8000` |",
                                 "| `http_port` | integer | `8080` |"), encoding="utf-8")
    assert docs.main(["--check", str(page)]) == 1
    assert "--write" in capsys.readouterr().err
    assert docs.main(["--write", str(page)]) == 0
    assert page.read_text(encoding="utf-8") == text
    assert docs.main(["--check", str(page)]) == 0


def test_a_page_without_a_table_block_is_refused():
    with pytest.raises(ValueError, match="settings:server"):
        docs.render("# Configuration\n")


@pytest.mark.parametrize("cls", [config.ServerConfig, config.BatchingConfig, config.CacheConfig])
def test_every_field_of_a_settings_table_is_declared(cls):
    """No key of these tables bypasses the schema: each field is a declared setting whose
    declared default is the dataclass default."""
    declared = {s.name: s for s in settings_of(cls)}
    assert set(declared) == {f.name for f in dataclasses.fields(cls)}
    instance = cls()
    for name, s in declared.items():
        assert getattr(instance, name) == s.default


def test_the_defaults_other_modules_import_are_the_declared_ones():
    assert config.DEFAULT_HTTP_PORT == config.ServerConfig().http_port == 8000
    assert config.DEFAULT_READ_TIMEOUT_MS == config.ServerConfig().read_timeout_ms
    assert config.DEFAULT_SHM_MAX_REGIONS == config.ServerConfig().shm_max_regions == 256
    assert config.DEFAULT_LOOP_EXECUTION_US == config.BatchingConfig().loop_execution_us == 100
    assert config.DEFAULT_SEQUENCE_STRATEGY == config.SequenceConfig().strategy == "direct"


def test_a_bound_may_name_an_earlier_setting():
    r = Reader("lumen.toml", "tasks[0].batching", {"priority_levels": 2,
                                                   "default_priority_level": 3})
    with pytest.raises(config.ConfigError) as ei:
        read_settings(r, config.BatchingConfig)
    assert str(ei.value) == ("lumen.toml: tasks[0].batching.default_priority_level: "
                             "must be an integer <= 2, got 3")
    ok = Reader("x", "b", {"priority_levels": 3, "default_priority_level": 3})
    assert read_settings(ok, config.BatchingConfig)["default_priority_level"] == 3


def test_a_backend_default_overrides_the_declared_one():
    vad = config.parse_task({"name": "v", "backend": "vad"}).batching
    assert (vad.max_batch_size, vad.max_queue_size) == (256, 4096)
    assert vad.max_queue_delay_us == config.DEFAULT_MAX_QUEUE_DELAY_US


@pytest.mark.parametrize("default, kind, problem", [
    ([], None, "immutable"),
    (1.5, None, "kind"),
    (None, dict, "kind"),
])
def test_a_bad_declaration_is_refused_at_import(default, kind, problem):
    with pytest.raises(TypeError, match=problem):
        setting(default, "a thing", kind=kind)


def test_the_example_server_table_lists_every_key_with_its_default():
    """The page's first example says it lists every [server] key with its default: hold it
    to the declarations too."""
    import tomllib

    text = PAGE.read_text(encoding="utf-8")
    example = tomllib.loads(text.split("```toml\n", 1)[1].split("```", 1)[0])
    declared = {s.name: s.default for s in settings_of(config.ServerConfig)}
    written = {k: tuple(v) if isinstance(v, list) else v for k, v in example["server"].items()}
    assert written == declared


def test_a_required_setting_says_what_to_write():
    with pytest.raises(config.ConfigError) as ei:
        config.parse_task({"name": "t", "backend": "onnx", "cache": {"ttl_s": 5}}, "lumen.toml")
    assert str(ei.value) == ("lumen.toml: tasks[0].cache.max_bytes: is required: the cache's "
                             "size bound in bytes, e.g. 67108864")
    assert "| `max_bytes` | integer | required | 1..1099511627776 |" in \
        settings_table(config.CacheConfig)
