"""Configuration: backend-declared options read by the config layer, the effective
``[tasks.sequence]`` of a stateful backend (the TaskConfig is never changed), dtype choices
taken from the contract, and the package's public surface (``__all__``, ``__version__``)."""
from __future__ import annotations

import copy
import dataclasses
import importlib.metadata

import numpy as np
import onnx_models as M
import pytest

import lumen_core as lc
from lumen_core import config, errors
from lumen_core.config import (
    ConstantConfig,
    Option,
    SequenceConfig,
    StateConfig,
    effective_sequence,
    parse_task,
    read_options,
)
from lumen_core.contract import DTYPES, LAYOUTS
from lumen_core.models import minilm, silero
from lumen_core.tasks import BACKENDS, backend_class
from lumen_core.tasks.image_embedding import ImageEmbeddingBackend
from lumen_core.tasks.onnx import OnnxBackend
from lumen_core.tasks.text_embedding import TextEmbeddingBackend
from lumen_core.tasks.vad import VadBackend, default_sequence

SCHEMA = (
    Option("count", int, 3, "how many", lo=1, hi=9),
    Option("floor", int, 0, "the least", lo=0),
    Option("flag", bool, True, "on or off"),
    Option("name", str, None, "a model output name"),
    Option("mode", str, "a", "the mode", choices=("a", "b")),
    Option("ids", list, ("none",), "preprocess ids"),
)


def task(options=None, backend="demo", **over):
    table = {"name": "t", "backend": backend, **over}
    if options is not None:
        table["options"] = options
    return parse_task(table, "lumen.toml", "tasks[2]")


# --------------------------------------------------------------------------- read_options
def test_defaults_fill_every_declared_option():
    assert read_options(task(), SCHEMA) == {"count": 3, "floor": 0, "flag": True, "name": None,
                                            "mode": "a", "ids": ("none",)}


def test_values_are_read_and_a_single_string_is_a_list_of_one():
    opts = read_options(task({"count": 9, "floor": 7, "flag": False, "name": "emb",
                              "mode": "b", "ids": "p1"}), SCHEMA)
    assert opts == {"count": 9, "floor": 7, "flag": False, "name": "emb", "mode": "b",
                    "ids": ("p1",)}
    assert read_options(task({"ids": ["p1", "p2"]}), SCHEMA)["ids"] == ("p1", "p2")


@pytest.mark.parametrize("key, value, problem", [
    ("count", 0, "must be an integer in 1..9, got 0"),
    ("count", 10, "must be an integer in 1..9, got 10"),
    ("count", True, "must be an integer in 1..9, got True"),
    ("count", "3", "must be an integer in 1..9, got '3'"),
    ("floor", -1, "must be an integer >= 0, got -1"),
    ("flag", "yes", "must be true or false, got 'yes'"),
    ("name", "", "must be a non-empty string (a model output name), got ''"),
    ("name", 5, "must be a non-empty string (a model output name), got 5"),
    ("mode", "c", "must be one of a, b (the mode), got 'c'"),
    ("ids", [], "must be a list of non-empty strings (preprocess ids), got []"),
    ("ids", ["p", ""], "must be a list of non-empty strings (preprocess ids), got ['p', '']"),
    ("ids", 3, "must be a list of non-empty strings (preprocess ids), got 3"),
])
def test_bad_values_name_source_key_and_what_to_use(key, value, problem):
    with pytest.raises(errors.ConfigError) as ei:
        read_options(task({key: value}), SCHEMA)
    assert (ei.value.source, ei.value.key, ei.value.problem) == (
        "lumen.toml", f"tasks[2].options.{key}", problem)
    assert str(ei.value) == f"lumen.toml: tasks[2].options.{key}: {problem}"


def test_unknown_option_lists_the_declared_ones():
    with pytest.raises(errors.ConfigError) as ei:
        read_options(task({"zeta": 1, "alpha": 2}), SCHEMA)
    assert ei.value.key == "tasks[2].options.alpha"
    assert ei.value.problem == ("unknown option for backend 'demo' "
                                "(known: count, floor, flag, name, mode, ids)")


def test_a_backend_without_options_says_so():
    with pytest.raises(errors.ConfigError) as ei:
        read_options(task({"x": 1}, backend="vad"), ())
    assert ei.value.key == "tasks[2].options.x"
    assert ei.value.problem == "backend 'vad' takes no options"


def test_reading_options_leaves_the_task_config_unchanged():
    cfg = task({"count": 4})
    before = copy.deepcopy(cfg.options)
    opts = read_options(cfg, SCHEMA)
    opts["count"] = 5
    assert cfg.options == before == {"count": 4}


def test_an_undeclared_option_kind_is_refused():
    with pytest.raises(TypeError, match="kind"):
        Option("ratio", complex, 0.5, "a fraction")


# --------------------------------------------------------------------------- backend schemas
SCHEMAS = {name: backend_class(name).options_schema for name in BACKENDS}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_declared_option_is_documented_and_its_default_reads_back(name):
    schema = SCHEMAS[name]
    names = [o.name for o in schema]
    assert len(names) == len(set(names))
    for opt in schema:
        assert opt.doc.strip(), opt
        if opt.default is None:  # derived by the backend (from the model)
            continue
        value = list(opt.default) if opt.kind is list else opt.default
        if opt.kind is int and opt.lo is not None and value < opt.lo:
            continue  # a sentinel (onnx max_dim: unbounded) that no config can spell
        got = read_options(task({opt.name: value}, backend=name), schema)[opt.name]
        assert got == opt.default


def test_backends_validate_options_when_built_not_when_loaded():
    with pytest.raises(errors.ConfigError) as ei:
        TextEmbeddingBackend(task({"max_seq_length": 10000}, backend="text_embedding"))
    assert ei.value.key == "tasks[2].options.max_seq_length"
    # (the model's own bound, its max_positions, is checked when it loads: test_text_models.py)
    assert ei.value.problem == "must be an integer in 2..8192, got 10000"
    with pytest.raises(errors.ConfigError) as ei:
        ImageEmbeddingBackend(task({"preprocess_id": "siglip_v1"}, backend="image_embedding"))
    assert "clip_image_openai_v1" in ei.value.problem and "siglip_v1" in ei.value.problem
    with pytest.raises(errors.ConfigError) as ei:
        VadBackend(task({"thresold": 0.5}, backend="vad"))
    assert ei.value.problem.startswith("unknown option for backend 'vad' (known: threshold,")
    with pytest.raises(errors.ConfigError) as ei:
        VadBackend(task({"threshold": 1.5}, backend="vad"))
    assert ei.value.problem.startswith("must be a number in 0.0..1.0")
    built = ImageEmbeddingBackend(task({"normalize": False, "max_image_pixels": 10},
                                       backend="image_embedding"))
    assert (built.normalize, built.max_pixels, built.output_name) == (False, 10, "")


def test_text_embedding_defaults_are_the_models_facts():
    backend = TextEmbeddingBackend(task(backend="text_embedding"))
    assert backend.max_seq_length == minilm.MAX_SEQ_LENGTH
    # the bound of the option is every model's cap; the model's own (its max_positions, from
    # its "text_model" block or minilm.py for the built-in MiniLM) is checked when it loads
    hi = {o.name: o.hi for o in TextEmbeddingBackend.options_schema}["max_seq_length"]
    assert hi >= minilm.MAX_POSITIONS


def test_onnx_layout_must_fit_the_inputs_rank(tmp_path):
    path = M.scale(str(tmp_path / "scale.onnx"))  # input [N, L]
    with pytest.raises(errors.ConfigError) as ei:
        OnnxBackend(task({"layout": "NCHW"}, backend="onnx", model=path)).load()
    rank2 = [n for n, lay in LAYOUTS.items() if lay.rank == 2]
    assert ei.value.key == "tasks[2].options.layout"
    assert "rank 2" in ei.value.problem and all(n in ei.value.problem for n in rank2)
    with pytest.raises(errors.ConfigError) as ei:
        OnnxBackend(task({"layout": "NXY"}, backend="onnx", model=path))
    assert ei.value.problem.startswith("must be one of N, NC, NL")
    spec = OnnxBackend(task({"layout": "NL", "preprocess_ids": "p1", "max_dim": 8},
                            backend="onnx", model=path))
    spec.load()
    (sig,) = spec.contract.specs
    assert sig.layout == "NL" and set(sig.preprocess_ids) == {"p1"} and sig.dims[1] == (1, 8)


# --------------------------------------------------------------------------- sequences
POLICY = SequenceConfig(strategy="oldest", max_sequence_idle_us=5000, max_candidate_sequences=8)
DECLARED = SequenceConfig(
    state=(StateConfig("s", "s_out", "fp32", (4,)),),
    constant=(ConstantConfig("k", "int64", (), np.array(3, np.int64)),))


def test_effective_sequence_fills_the_declared_inputs_without_changing_either():
    policy = copy.deepcopy(POLICY)
    declared = copy.deepcopy(DECLARED)
    eff = effective_sequence(policy, declared)
    assert eff is not policy
    assert (eff.strategy, eff.max_sequence_idle_us, eff.max_candidate_sequences) == (
        "oldest", 5000, 8)
    assert eff.state == DECLARED.state and eff.constant == DECLARED.constant
    assert dataclasses.astuple(policy) == dataclasses.astuple(POLICY)
    assert policy.state == () and declared.state == DECLARED.state


def test_effective_sequence_keeps_a_config_that_declares_its_inputs():
    own = dataclasses.replace(POLICY, state=(StateConfig("x", "x_out", "fp16", (2,)),))
    assert effective_sequence(own, DECLARED) is own
    assert effective_sequence(None, DECLARED) is DECLARED
    assert effective_sequence(POLICY, None) is POLICY
    assert effective_sequence(None, None) is None


def test_vad_declares_silero_state_and_leaves_the_config_alone():
    cfg = task(backend="vad")
    assert cfg.sequence is None
    backend = VadBackend(cfg)
    assert cfg.sequence is None  # not written back
    (st,) = backend.sequence.state
    assert (st.input_name, st.output_name, st.dims, st.batch_axis) == (
        silero.STATE, silero.STATE_OUTPUT, silero.STATE_DIMS, silero.STATE_BATCH_AXIS)
    (sr,) = backend.sequence.constant
    assert sr.input_name == silero.SAMPLE_RATE_INPUT and int(sr.value) == silero.SAMPLE_RATE

    policy_only = task(backend="vad", sequence={"max_sequence_idle_us": 20_000})
    backend = VadBackend(policy_only)
    assert policy_only.sequence.state == () and policy_only.sequence.constant == ()
    assert backend.sequence.max_sequence_idle_us == 20_000
    assert backend.sequence.state == default_sequence().state


# --------------------------------------------------------------------------- dtype choices
def test_state_and_constant_dtypes_are_the_contracts():
    assert config.STATE_DTYPES == config.CONSTANT_DTYPES == tuple(DTYPES)
    assert set(config.CONTROL_DTYPES) <= set(DTYPES)
    assert config.MAX_STATE_RANK == lc.contract.MAX_RANK
    with pytest.raises(errors.ConfigError) as ei:
        task(backend="vad", sequence={"state": [{"input_name": "s", "output_name": "o",
                                                 "dims": [1], "dtype": "float64"}]})
    assert ei.value.key == "tasks[2].sequence.state[0].dtype"
    assert ei.value.problem == f"must be one of {', '.join(DTYPES)}, got 'float64'"


# --------------------------------------------------------------------------- public surface
def test_all_lists_exactly_the_public_names():
    assert sorted(lc.__all__) == sorted(set(lc.__all__))
    for name in lc.__all__:
        assert getattr(lc, name) is not None, name
    assert lc.Runtime.__module__ == "lumen_core.runtime"
    assert "Runtime" in dir(lc)


def test_start_up_errors_have_one_home():
    assert lc.ConfigError is errors.ConfigError is config.ConfigError
    assert lc.ModelMissingError is errors.ModelMissingError
    from lumen_core import models

    assert models.ModelMissingError is errors.ModelMissingError  # read there by lumen_core/cli


def test_version_comes_from_the_installed_distribution():
    assert lc.__version__ == importlib.metadata.version(lc.DISTRIBUTION)


# --------------------------------------------------------------------------- [server] bounds
@pytest.mark.parametrize("key, value, problem", [
    ("shm_max_regions", 0, "integer >= 1"),
    ("shm_max_regions", 1 << 20, "integer <= 65536"),
    ("admin_max_model_bytes", 0, "integer >= 1"),
    ("admin_api_keys", [" padded "], "printable ASCII"),
    ("admin_api_keys", "k", "array"),
    ("model_root", 3, "string"),
])
def test_server_bounds_are_checked_and_named(key, value, problem):
    from lumen_core.config import parse_config

    with pytest.raises(errors.ConfigError) as ei:
        parse_config({"server": {key: value}}, source="lumen.toml")
    assert f"lumen.toml: server.{key}:" in str(ei.value) and problem in str(ei.value)


def test_model_root_defaults_to_the_config_folder(tmp_path):
    from lumen_core.config import load_config, model_root, parse_config

    (tmp_path / "models").mkdir()
    cfg = tmp_path / "lumen.toml"
    cfg.write_text('[server]\nmodel_root = "models"\nadmin_api_keys = ["a"]\n')
    loaded = load_config(str(cfg))
    assert model_root(loaded) == str(tmp_path / "models")
    assert "admin_api_keys=<1 keys>" in repr(loaded.server) and "'a'" not in repr(loaded.server)
    cfg.write_text("[server]\n")
    assert model_root(load_config(str(cfg))) == str(tmp_path)
    assert model_root(parse_config({})) == ""  # no file: no root, admin loads name no path


def test_a_vad_task_from_a_config_file_gets_the_backends_batching_defaults(monkeypatch):
    """Issue 38 row 9: a vad task written in a config file got the general max_queue_size
    (1024) and max_batch_size (32) where the default vad task has 4096 and 256: one default."""
    from lumen_core.tasks import vad

    monkeypatch.setattr(vad, "require_model", lambda name: None)  # the table, not the model
    from_file = config.parse_task({"name": "v", "backend": "vad"}).batching
    default = config.parse_task(vad.default_task_table()).batching
    assert from_file.max_queue_size == default.max_queue_size == vad.DEFAULT_MAX_QUEUE_SIZE == 4096
    assert from_file.max_batch_size == default.max_batch_size == vad.DEFAULT_MAX_BATCH_SIZE == 256
    # what a file says still wins; other backends keep the general defaults
    assert config.parse_task({"name": "v", "backend": "vad",
                              "batching": {"max_queue_size": 64}}).batching.max_queue_size == 64
    other = config.parse_task({"name": "o", "backend": "onnx", "model": "m.onnx"}).batching
    assert other.max_queue_size == config.DEFAULT_MAX_QUEUE_SIZE == 1024
