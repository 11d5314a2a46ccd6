"""An ONNX export of a transformer (optimum, ``torch.onnx.export``: ``input_ids``,
``attention_mask``, optional ``token_type_ids`` -> ``last_hidden_state``) turned into a
sentence encoder: the folder's pooling and Normalize are appended to the graph, so a batch is
still one ``session.run``.

``token_type_ids`` stops being an input (single texts have type 0 everywhere): a
``ConstantOfShape`` of ``input_ids``' shape feeds the nodes that read it, so the graph keeps
the two inputs every text model has.  An int32 input is fed through a ``Cast`` from the int64
one.  Reductions are written in the export's opset (``axes`` as an input from opset 18).
"""
from __future__ import annotations

import pathlib
from typing import Any

from ._graph import ATTENTION_MASK, INPUT_IDS, GraphBuilder
from ._heads import add_embed_outputs

TOKEN_TYPE_IDS = "token_type_ids"
#: graph outputs taken as the token embeddings, in order of preference (else the first of rank 3)
HIDDEN_NAMES = ("last_hidden_state", "token_embeddings")
MIN_OPSET = 13
PREFIX = "lumen/"


class ExportError(ValueError):
    """The export cannot be spliced (the importer names the file)."""


def _opset(model: Any) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def load(path: pathlib.Path) -> Any:
    """The export as an ``onnx.ModelProto`` (external data beside it loaded too)."""
    import onnx

    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
    except Exception as exc:  # onnx raises DecodeError, ValidationError, OSError...
        raise ExportError(f"not a readable ONNX model ({type(exc).__name__}: {str(exc)[:160]})") from None
    return model


def splice(model: Any, pooling: tuple, normalized: bool, embedding: str, pooled: str) -> Any:
    """``model`` (edited in place and returned) with inputs ``input_ids`` / ``attention_mask``
    (int64) and outputs ``embedding`` / ``pooled``."""
    from onnx import TensorProto, helper

    graph = model.graph
    opset = _opset(model)
    if opset < MIN_OPSET:
        raise ExportError(f"opset {opset} (at least {MIN_OPSET} is needed)")
    inputs = {i.name: i for i in graph.input}
    for need in (INPUT_IDS, ATTENTION_MASK):
        if need not in inputs:
            raise ExportError(f"no {need!r} input (inputs: {', '.join(inputs)})")
    extra = set(inputs) - {INPUT_IDS, ATTENTION_MASK, TOKEN_TYPE_IDS}
    if extra:
        raise ExportError(f"unexpected inputs {', '.join(sorted(extra))}")
    outputs = [o for o in graph.output]
    hidden = next((o.name for n in HIDDEN_NAMES for o in outputs if o.name == n), None)
    if hidden is None:
        hidden = next((o.name for o in outputs if len(o.type.tensor_type.shape.dim) == 3), None)
    if hidden is None:
        raise ExportError(f"no last_hidden_state output (outputs: {', '.join(o.name for o in outputs)})")
    g = GraphBuilder(prefix=PREFIX, opset=opset)
    front: list = []
    for name in (INPUT_IDS, ATTENTION_MASK):
        dtype = inputs[name].type.tensor_type.elem_type
        if dtype == TensorProto.INT64:
            continue
        if dtype != TensorProto.INT32:
            raise ExportError(f"input {name!r} has element type {dtype} (int64 or int32 expected)")
        inner = PREFIX + name + "_int32"
        _rename_consumers(graph, name, inner)
        front.append(helper.make_node("Cast", [name], [inner], name=inner + "_cast", to=TensorProto.INT32))
        inputs[name].type.tensor_type.elem_type = TensorProto.INT64
    if TOKEN_TYPE_IDS in inputs:
        dtype = inputs[TOKEN_TYPE_IDS].type.tensor_type.elem_type
        shape = PREFIX + "ids_shape"
        front.append(helper.make_node("Shape", [INPUT_IDS], [shape], name=shape + "_node"))
        front.append(helper.make_node(
            "ConstantOfShape", [shape], [TOKEN_TYPE_IDS], name=PREFIX + "token_types_zero",
            value=helper.make_tensor("zero", dtype, [1], [0])))
        graph.input.remove(inputs[TOKEN_TYPE_IDS])
    add_embed_outputs(g, hidden, pooling, normalized, embedding, pooled)
    nodes = front + list(graph.node) + g.nodes
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(g.initializers)
    del graph.output[:]
    graph.output.extend([helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", None])
                         for n in (embedding, pooled)])
    return model


def _rename_consumers(graph: Any, old: str, new: str) -> None:
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new

